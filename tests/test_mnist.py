"""MNIST: IDX reading with the published counts; the smokes of the Table 5 grid and of paper 000 (CYBER-0)."""

import json
import os
import subprocess
import sys

import numpy as np
from helpers import load_example
from prompt_helpers import DATA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    return load_example("run_mnist_fed")


def test_idx_files_have_the_published_counts():
    example = _example()
    train = example.MNIST(os.path.join(DATA, "mnist"), "train")
    test = example.MNIST(os.path.join(DATA, "mnist"), "test", normalize=False)
    assert len(train) == 60000 and len(test) == 10000 and train.x.shape[1] == 784
    assert np.bincount(test.labels.numpy()).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert float(test.x.min()) == 0.0 and float(test.x.max()) == 1.0
    assert abs(float(train.x.mean())) < 0.01  # (x/255 - 0.1307)/0.3081 centres the training pixels


def test_table_smoke_runs_two_cells(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "mnist_table.py"), "--smoke", "--workers", "1",
           "--runs_dir", str(tmp_path), "--data_dir", os.path.join(DATA, "mnist")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "mnist_smoke.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| Fed")]
    assert len(rows) == 2
    for row in rows:
        accuracy = float(row.split("|")[2].split("±")[0])
        assert accuracy > 30.0, row  # 20 rounds: well above chance (10 %)


def test_table_report_on_a_users_own_run_says_what_to_use(tmp_path):
    (tmp_path / "mnist_results.json").write_text('{"final_accuracy": 0.9}')
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "mnist_table.py"), "--report",
                          "--runs_dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "holds no grid runs" in out.stderr and "zo_byzantine inspect" in out.stderr


def test_cyber0_smoke_runs_every_configuration(tmp_path):
    """Paper 000's Table 1 rows (alpha = 0.25, IID), the references and one Figure 1c attack, 10 rounds each."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "cyber0.py"), "--smoke", "--runs_dir", str(tmp_path),
           "--data_dir", os.path.join(DATA, "mnist")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "cyber0.json").read_text())
    assert len(summary) == 7 and all(s["seeds"] == [0] and s["rounds"] == 10 for s in summary.values())
    clean = summary["FedAvg / no Byzantine | iid | alpha=0"]["final"][0]
    assert clean > 40.0  # 10 rounds at lr 0.01: well above chance (10 %)
    krum = summary["Krum / Fang Krum | iid | alpha=0.25"]
    assert krum["final"][0] < clean - 30 and krum["mean_lambda"] > 0  # Krum picks the crafted gradient
    assert summary["Trimmed mean / Fang trim | iid | alpha=0.25"]["final"][0] < clean
    assert "| CYBER-0 / Full-Knowledge |" in (tmp_path / "cyber0.md").read_text()
