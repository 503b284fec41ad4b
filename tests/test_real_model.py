"""The real-model benchmark's smoke: all-MiniLM-L6-v2 (real weights, the ``bench`` extra) on real SST-2 and RTE
(a sentence-pair task: the head sees ``[u, v, |u - v|, u * v]``), every configuration of the Table 1 layout."""

import os
import subprocess
import sys

import pytest
from prompt_helpers import DATA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
sys.path.insert(0, os.path.join(EXPERIMENTS, "real_model"))

from real_model import CONFIGS  # noqa: E402

pytestmark = pytest.mark.slow  # the real-model experiments' smokes: real MiniLM runs in subprocesses


def test_real_model_smoke_learns_and_reports_every_configuration():
    cmd = [sys.executable, os.path.join(EXPERIMENTS, "real_model", "real_model.py"), "--smoke", "--tasks", "sst2",
           "rte", "--data", DATA]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ,
                         "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    tables = [[line.split("|")[1:-1] for line in block.splitlines() if line.startswith("| ")]
              for block in out.stdout.split("\n\n")]
    table1, runs, references = (t for t in tables if t and t[0][0].strip() == "task")
    assert [c.strip() for c in table1[0]] == ["task", "no attack", "ALIE", "FOE", "SF", "TMA", "mean / SF",
                                              "first-order head", "first-order full"]
    assert [r[0].strip() for r in table1[1:]] == ["sst2", "rte"]
    assert all("±" in cell for r in table1[1:] for cell in r[1:]), table1  # every cell measured
    for task in ("sst2", "rte"):
        configs = {(r[1].strip(), r[2].strip()): r for r in runs if r[0].strip() == task}
        assert set(configs) == set(CONFIGS), configs
    start, best = (float(configs_value.split("±")[0]) for configs_value in
                   [r for r in runs if r[0].strip() == "sst2" and r[2].strip() == "none"][0][3:5])
    assert best > start + 5, (start, best)  # 30 rounds of the head already learn from the random start
    features = {r[0].strip(): int(r[3]) for r in references if r[0].strip() != "task" and not r[0].startswith("-")}
    assert features == {"sst2": 384, "rte": 4 * 384}, references  # a pair's features: [u, v, |u - v|, u * v]


def test_foe_rules_smoke_reports_each_configuration_and_refuses_unknown_rules():
    script = os.path.join(EXPERIMENTS, "foe_rules", "foe_rules.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    bad = subprocess.run([sys.executable, script, "--configs", "cwtm+bucketing"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=env)
    assert bad.returncode != 0 and "--configs entry 'cwtm+bucketing'" in bad.stderr, bad.stderr[-2000:]
    out = subprocess.run([sys.executable, script, "--smoke", "--data", DATA], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r[0].strip(): r for r in (line.split("|")[1:-1] for line in out.stdout.splitlines())
            if r and r[0].strip() in ("cwtm", "median+nnm")}
    assert set(rows) == {"cwtm", "median+nnm"}, out.stdout[-2000:]
    for row in rows.values():
        none, foe, gap_own = float(row[1]), float(row[2]), float(row[3])
        assert abs(gap_own - (foe - none)) < 0.051, row  # the gap is the table's own difference
        assert 0 <= float(row[5]) <= 10, row  # the attacker's omega lies in its grid
