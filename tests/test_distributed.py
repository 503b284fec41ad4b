"""Clients spread over 2 processes (torch.distributed, gloo on CPU) give the 1-process result.

Each process evaluates its share of the clients under the shared perturbation; per-client vectors
are gathered, every process aggregates the same inputs and applies the same update. The processes'
weights must be bitwise identical. Against one process we allow 1e-6 relative: a process forwards a
different batch (its clients only), and BLAS may block a matmul differently for another batch size.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # two processes started by torchrun per test

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_worker.py")


def _run(out, processes, extra):
    flags = [f"{k}={json.dumps(v)}" for k, v in extra.items()]
    if processes == 1:
        cmd = [sys.executable, WORKER, str(out), *flags]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
            WORKER,
            str(out),
            *flags,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(processes)]


@pytest.mark.parametrize(
    "extra",
    [{}, {"local_steps": 2, "local_learning_rate": 0.1}, {"estimator": "first_order"}],
    ids=["K=1", "K=2", "first_order"],
)
def test_two_processes_match_one(tmp_path, extra):
    two = _run(tmp_path / "two", 2, extra)
    one = _run(tmp_path / "one", 1, extra)[0]
    assert two[0]["world"] == 2 and one["world"] == 1
    for key, value in two[0]["state"].items():
        assert torch.equal(value, two[1]["state"][key]), f"processes disagree on {key}"
        torch.testing.assert_close(value, one["state"][key], rtol=1e-6, atol=1e-7)
    coefficients = [torch.tensor([r["coefficients"] for r in run["ledger"]]) for run in (two[0], one)]
    torch.testing.assert_close(coefficients[0], coefficients[1], rtol=1e-6, atol=1e-9)
    # the main process logs once per logging step, with the same communication totals (no double counting)
    logs = [[e for e in run["log"] if "uplink_bytes_total" in e] for run in (two[0], one)]
    assert [e["uplink_bytes_total"] for e in logs[0]] == [e["uplink_bytes_total"] for e in logs[1]]
    assert os.path.isfile(tmp_path / "two" / "checkpoint-4" / "zo_ledger.json")
