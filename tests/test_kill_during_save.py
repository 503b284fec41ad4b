"""Killed (SIGKILL) while saving, at chosen and at random moments, including inside the ledger write, a run resumed
with ``resume_from_checkpoint=True`` ends with the same checkpoints, bitwise, as a run never killed, and nothing the
kill left behind (issue 48, item 3)."""

import os
import random
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from helpers import LogisticRegression, VectorDataset, make_trainer
from kill_worker import SETTINGS

from zo_byzantine.ledger import LEDGER_NAME, Ledger

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_worker.py")
ROUNDS = SETTINGS["max_steps"]
# ledger writes: checkpoint-1 .. checkpoint-6, then the output folder's; trainer states: one per checkpoint
CHOSEN = [("ledger_write", 2), ("ledger_rename", 4), ("ledger_write", ROUNDS + 1), ("state", 3)]
RANDOM = [("timer", delay) for delay in random.Random(48).sample(range(0, 40_000), 3)]  # microseconds


def _leg(output_dir, moment="none", count=0) -> int:
    return subprocess.run([sys.executable, WORKER, str(output_dir), moment, str(count)], capture_output=True,
                          text=True, timeout=300).returncode


def _checkpoints(output_dir) -> dict:
    """Each checkpoint's trainable weights and ledger digest, and (key "output") the output folder's ledger."""
    out = {"output": Ledger.read(output_dir)}
    for step in range(1, ROUNDS + 1):
        folder = os.path.join(output_dir, f"checkpoint-{step}")
        out[step] = (safetensors.torch.load_file(os.path.join(folder, "model.safetensors")),
                     Ledger.read(folder)["digest"])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("straight")
    torch.manual_seed(0)
    make_trainer(LogisticRegression(), VectorDataset(128), output_dir, **SETTINGS).train()
    return _checkpoints(output_dir)


@pytest.mark.slow
@pytest.mark.parametrize("moment, count", CHOSEN + RANDOM)
def test_a_run_killed_while_saving_resumes_bitwise(tmp_path, reference, moment, count):
    killed = _leg(tmp_path, moment, count)
    assert killed == -9 or moment == "timer"  # a timer may fire once the run has ended
    left = sorted(os.listdir(tmp_path))
    if moment.startswith("ledger"):  # the ledger's temporary file is there, until the next save
        assert any(name.startswith(f".{LEDGER_NAME}.") for _, _, names in os.walk(tmp_path) for name in names), left
    assert _leg(tmp_path) == 0
    assert os.path.isfile(tmp_path / LEDGER_NAME), (moment, count, sorted(os.listdir(tmp_path)))
    resumed = _checkpoints(tmp_path)
    assert resumed.pop("output") == reference["output"]  # the run's final ledger, even when killed writing it
    for step, (weights, digest) in resumed.items():
        assert digest == reference[step][1], step
        assert weights.keys() == reference[step][0].keys()
        assert all(torch.equal(weights[k], reference[step][0][k]) for k in weights), step
    leftovers = [os.path.join(root, name) for root, dirs, names in os.walk(tmp_path) for name in dirs + names
                 if name.startswith(".")]
    assert not leftovers, (moment, count, left, leftovers)
