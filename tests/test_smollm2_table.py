"""experiments/smollm2/table.py: configurations derived by flag overrides, and a cell finished under fewer rounds
resumed rather than reported."""

import json
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "experiments", "smollm2"))

import table  # noqa: E402


def test_overridden_replaces_values_only():
    flags = ["--max_steps", "300", "--learning_rate", "1e-5", "--bf16", "true"]
    assert table.overridden(flags, {"--max_steps": "2000", "--learning_rate": "2e-5"}) == [
        "--max_steps", "2000", "--learning_rate", "2e-5", "--bf16", "true"]
    assert table.overridden(flags, {"300": "9"}) == flags  # a value is never taken for a flag


def test_cpu_long_is_cpu_k512_with_more_rounds():
    long, base = table.CONFIGS["cpu_long"]["flags"], table.CONFIGS["cpu_k512"]["flags"]
    differ = {long[i]: (base[i + 1], long[i + 1]) for i in range(0, len(long), 2) if long[i + 1] != base[i + 1]}
    assert differ == {"--max_steps": ("300", "2000"), "--eval_steps": ("50", "100"),
                      "--learning_rate": ("1e-5", "2e-5")}
    assert table.setting("cpu_long", "--max_steps") == 2000


def _cell(folder, step):
    os.makedirs(os.path.join(folder, f"checkpoint-{step}"))
    with open(os.path.join(folder, "eval_results.json"), "w") as f:
        json.dump({"start_accuracy": 0.78, "eval_best_accuracy": 0.83, "eval_accuracy": 0.82}, f)
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step, "log_history": [{"step": step, "eval_accuracy": 0.82, "loss": 0.4}]}, f)


def test_a_cell_short_of_the_rounds_is_unfinished_and_resumes(tmp_path):
    folder = str(tmp_path / "sst2_none_s0")
    assert table.result(folder, 1000) is None  # nothing yet
    _cell(folder, 1000)
    found = table.result(folder, 1000)
    assert (found["start"], found["best"], found["final"]) == (78.0, 83.0, 82.0)
    assert found["curve"] == [(1000, 82.0)]
    assert table.result(folder, 2000) is None
    line = table.command("cpu_long", "sst2", "none", 0, folder, "smollm2-135m")
    assert line[line.index("--max_steps") + 1] == "2000"
    assert line[-2:] == ["--resume_from_checkpoint", "true"]
    assert line[line.index("--save_steps") + 1] == "100"
