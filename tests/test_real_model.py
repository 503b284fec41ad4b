"""The real-model benchmark's smoke: all-MiniLM-L6-v2 (real weights, the ``bench`` extra) on real SST-2."""

import os
import subprocess
import sys

from prompt_helpers import DATA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_real_model_smoke_learns_and_reports_every_configuration():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "real_model.py"), "--smoke", "--tasks", "sst2",
           "--data", DATA]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ,
                         "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| sst2 |")]
    runs = {(r[1].strip(), r[2].strip()): r for r in rows if len(r) == 9}
    assert set(runs) == {("cwtm", "none"), ("cwtm", "alie"), ("cwtm", "foe"), ("cwtm", "sf"), ("cwtm", "tma"),
                         ("mean", "sf")}
    start, best = (float(runs["cwtm", "none"][i].split("±")[0]) for i in (3, 4))
    assert best > start + 5, (start, best)  # 30 rounds of the head already learn from the random start
    references = [r for r in rows if len(r) == 5]
    assert len(references) == 1 and "not run" not in references[0][3]
