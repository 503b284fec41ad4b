"""experiments/smollm2/table.py: configurations derived by flag overrides, a cell finished under fewer rounds
resumed rather than reported, extra flags last; room.py's ratio of means."""

import json
import os
import sys

import pytest

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


def test_extra_flags_come_last_and_room_is_a_ratio_of_means(tmp_path):
    import room

    folder = str(tmp_path / "sst2_alie_b8_s0")
    line = table.command("cpu_long", "sst2", "alie", 0, folder, "smollm2-135m", ("--max_steps", "20"))
    assert line[-2:] == ["--max_steps", "20"] and line.count("--max_steps") == 2  # argparse keeps the last
    os.makedirs(folder)
    logged = [{"step": 1, "aggregate_shift": 3.0, "honest_mean_norm": 1.0},
              {"step": 2, "aggregate_shift": 1.0, "honest_mean_norm": 3.0}, {"step": 2, "train_loss": 0.4}]
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 2, "log_history": logged}, f)
    assert room.room(folder) == {"rounds": 2, "shift": 2.0, "signal": 2.0, "ratio": 1.0}  # not the mean ratio, 5/3
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 2, "log_history": logged[2:]}, f)
    with pytest.raises(RuntimeError, match="aggregate_shift"):
        room.room(folder)
