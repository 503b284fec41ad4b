"""Probe, then fine-tune: the pooled classifier starts at the probe's predictions, constant feature dimensions
stay 0, and the encoder benchmark's smoke (real MiniLM, real SST-2) runs every stage."""

import json
import math
import os
import pickle
import subprocess
import sys

import pytest
import torch
from helpers import sentences, wordpiece_tokenizer
from prompt_helpers import DATA
from transformers import BertConfig, BertModel

from zo_byzantine.features import FeatureHead, PooledClassifier, embed, moments, standardize
from zo_byzantine.perturbation import ParameterTable, perturbed

pytestmark = pytest.mark.slow  # the encoder experiment's smokes: real MiniLM runs in subprocesses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENCODER = os.path.join(ROOT, "experiments", "real_model", "encoder.py")


def test_moments_zero_a_constant_dimension_even_when_it_moves():
    train = torch.randn(50, 4, dtype=torch.float64)
    train[:, 2] = 1e-9 * torch.randn(50, dtype=torch.float64)  # float noise around a dead dimension
    mean, std = moments(train)
    assert torch.isinf(std[2]) and torch.isfinite(std[[0, 1, 3]]).all()
    torch.testing.assert_close(std[[0, 1, 3]], train[:, [0, 1, 3]].std(0))
    moved = train + 1e-3  # what a perturbed encoder does to every dimension
    standardized = (moved - mean) / std
    assert torch.equal(standardized[:, 2], torch.zeros(50, dtype=torch.float64))
    torch.testing.assert_close(standardized[:, 0], (moved[:, 0] - train[:, 0].mean()) / train[:, 0].std())
    assert torch.equal(standardize(train)[0][:, 2], torch.zeros(50, dtype=torch.float64))


def test_pooled_classifier_starts_at_the_probe_and_perturbs_only_the_encoder_and_head():
    tokenizer = wordpiece_tokenizer()
    torch.manual_seed(0)
    encoder = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=32, max_position_embeddings=64),
                        add_pooling_layer=False).eval()
    texts = [s for s, _ in sentences(12)]
    features = embed(encoder, tokenizer, texts, max_length=16, batch=5)  # the probe's path: batches of 5
    mean, std = moments(features)
    head = FeatureHead(16, 3)
    model = PooledClassifier(encoder, head, mean, std).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch)["logits"]
        torch.testing.assert_close(logits, head(standardize(features)[0])["logits"], rtol=1e-5, atol=1e-5)
        table = ParameterTable(model)
        assert {n.split(".")[0] for n in table.names} == {"encoder", "head"} and "mean" not in table.names
        with perturbed(table, [(123, 1e-3)]):
            moved = model(**batch)["logits"]
    assert 0 < float((moved - logits).abs().max()) < 1.0  # a 1e-9 std scale would make it ~1e5 or more


def test_encoder_smoke_probes_then_fine_tunes(tmp_path):
    out = tmp_path / "encoder.json"
    cmd = [sys.executable, ENCODER, "--smoke", "--data", DATA, "--out",
           str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rounds"] == 4 and result["probe"]["curve"]
    assert result["start"] == result["probe"]["final"]  # the fine-tune starts from the probe's predictions
    assert [step for step, _, _ in result["curve"]] == [0, 2, 4]
    assert 10_000_000 < result["trainable_parameters"] < 11_000_000  # six layers and the head; embeddings frozen
    assert (result["per_class"], result["train_examples"]) == (16, 32)
    assert 0.0 <= result["frozen_first_order_head"] <= 1.0  # the frozen-feature ceiling on the run's own data
    assert all(0.0 <= acc <= 1.0 for _, acc, _ in result["curve"])


def test_a_saved_probe_comes_back_with_its_head_and_results(tmp_path):
    """``--probe_dir``: the GPU run starts from probes made on the CPU; the head and its figures come back as saved;
    a probe made on other features (their statistics differ) is refused, and so is a file holding pickled code."""
    sys.path.insert(0, os.path.join(ROOT, "experiments", "real_model"))
    from encoder import load_probe, save_probe

    torch.manual_seed(0)
    head = FeatureHead(6, 3)
    mean, std = torch.randn(6), torch.rand(6) + 0.5
    std[2] = math.inf  # a dead dimension (features.moments)
    path = str(tmp_path / "probes" / "p.pt")
    save_probe(path, {"model": head, "best": 0.75, "final": 0.5, "curve": [(150, 0.75)], "omega": [2.5]}, mean, std)
    probe = load_probe(path, 6, 3, mean + 1e-6, std)  # the same features computed on another device
    loaded, saved = probe["model"].state_dict(), head.state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert (probe["best"], probe["final"], probe["loaded_from"]) == (0.75, 0.5, "p.pt")
    other_std = std.clone()
    other_std[2] = 1.0
    for other in ((mean + 0.1, std), (mean, std * 1.1), (mean, other_std), (mean[:5], std[:5])):
        with pytest.raises(ValueError, match="--probe_dir"):
            load_probe(path, 6, 3, *other)
    torch.save({"head": head.state_dict(), "features": {"mean": mean, "std": std}, "result": {"code": FeatureHead}},
               path)  # a pickled class
    with pytest.raises(pickle.UnpicklingError):
        load_probe(path, 6, 3, mean, std)


def _encoder_smoke(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, ENCODER, "--smoke", "--data", DATA, "--out",
           str(out), *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


LONG = pytest.mark.skipif(not os.environ.get("ZO_LONG_SMOKES"), reason="an experiment script's resume over two "
                          "legs (1-3 min): ZO_LONG_SMOKES=1 runs it; left out of CI to keep it under 20 minutes")


@LONG
def test_an_encoder_run_resumed_from_its_checkpoint_follows_the_same_trajectory(tmp_path):
    """``--checkpoint_dir``: 2 rounds, then 2 more from the checkpoint, give the losses and accuracies of 4 rounds
    in one go; the second leg trains 2 rounds (counted by its callback), and the result holds both legs and the
    whole curve with cumulative seconds."""
    whole = _encoder_smoke(tmp_path, "whole", "--lr", "1e-3")
    folder = str(tmp_path / "checkpoints")
    first = _encoder_smoke(tmp_path, "resumed", "--lr", "1e-3", "--rounds", "2", "--checkpoint_dir", folder)
    assert first["rounds"] == 2 and [(leg["from"], leg["to"]) for leg in first["legs"]] == [(0, 2)]
    resumed = _encoder_smoke(tmp_path, "resumed", "--lr", "1e-3", "--rounds", "4", "--checkpoint_dir", folder)
    assert resumed["rounds"] == 4 and [(leg["from"], leg["to"]) for leg in resumed["legs"]] == [(0, 2), (2, 4)]
    assert resumed["legs"][0] == first["legs"][0]
    assert [(s, a) for s, a, _ in resumed["curve"]] == [(s, a) for s, a, _ in whole["curve"]] == [
        (0, whole["start"]), (2, whole["curve"][1][1]), (4, whole["curve"][2][1])]
    assert resumed["loss"] == whole["loss"] and len(whole["loss"]) == 2
    seconds = [t for _, _, t in resumed["curve"]]
    assert seconds[1] == first["curve"][1][2] and seconds[2] > resumed["legs"][0]["seconds"]
    assert resumed["seconds"] == pytest.approx(sum(leg["seconds"] for leg in resumed["legs"]))
    with pytest.raises(AssertionError, match="other settings"):  # a resume with another learning rate
        _encoder_smoke(tmp_path, "resumed", "--lr", "2e-3", "--rounds", "6", "--checkpoint_dir", folder)


def test_earlier_legs_come_from_the_result_an_encoder_run_wrote(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "experiments", "real_model"))
    from encoder import previous_legs

    now = {"task": "sst2", "rule": "cwtm", "attack": "none", "seed": 0, "trainable": "layers", "lr": 2e-5,
           "mu": 1e-3, "nu": 1, "batch_per_client": 16, "group_by_length": True, "per_class": 1000}
    leg = {"device": "cpu", "from": 0, "to": 250, "seconds": 10.0}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**now, "device": "cpu", "rounds": 250, "seconds": 10.0,
                                "curve": [[0, 0.5, 0], [250, 0.6, 10.0]], "legs": [leg]}))
    assert previous_legs(str(path), 250, now) == ([leg], {0: 0, 250: 10.0})
    assert previous_legs(str(path), 0, now) == ([], {})
    # a leg that ended before writing its result: its rounds are known, its device and seconds are not
    gap = {"device": None, "from": 250, "to": 500, "seconds": None}
    assert previous_legs(str(path), 500, now) == ([leg, gap], {0: 0, 250: 10.0})
    assert previous_legs(str(tmp_path / "none.json"), 250, now) == ([{**gap, "from": 0, "to": 250}], {})
    with pytest.raises(ValueError, match=r"other settings .*'lr': \(2e-05, 3e-05\)"):
        previous_legs(str(path), 250, {**now, "lr": 3e-5})
    with pytest.raises(ValueError, match=r"other settings .*'per_class': \(1000, 12000\)"):  # other training data
        previous_legs(str(path), 250, {**now, "per_class": 12000})


@pytest.mark.parametrize("value", ["0", "-5"])
def test_encoder_refuses_a_bad_per_class_before_any_work(value):
    cmd = [sys.executable, ENCODER, "--per_class", value, "--data",
           "/nonexistent"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and f"--per_class={value}; accepted: a positive number" in run.stderr
