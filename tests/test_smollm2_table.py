"""experiments/smollm2/table.py: configurations derived by flag overrides, a cell finished under fewer rounds
resumed rather than reported, extra flags last; room.py's ratio of means; reports.py's recording rule and its
replay of the rules against hand-computed trimmed means."""

import collections
import json
import os
import sys

import pytest
import torch

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


def _rounds(values):
    """Recorded rounds of 12 one-direction reports, clients 0-2 marked Byzantine (as the runs record them)."""
    return [{"round": t, "clients": list(range(12)), "byzantine": [True] * 3 + [False] * 9,
             "vectors": [[v] for v in row]} for t, row in enumerate(values)]


def test_recorded_cwtm_keeps_the_rows_and_aggregates_as_cwtm(tmp_path):
    import reports

    from zo_byzantine.aggregators import CWTM
    from zo_byzantine.context import RoundContext

    path = str(tmp_path / "reports.jsonl")
    vectors = torch.tensor([[5.0], [-1.0], [2.0], [0.5], [9.0]])
    ctx = RoundContext((0, 7, 1), 5, 1, torch.tensor([True, False, False, False, False]), (0, 1, 2, 3, 4))
    assert torch.equal(reports.RecordedCWTM(path)(vectors, ctx).value, CWTM()(vectors, ctx).value)
    assert reports.load(path) == [{"round": 7, "clients": [0, 1, 2, 3, 4], "byzantine": [True] + [False] * 4,
                                   "vectors": [[5.0], [-1.0], [2.0], [0.5], [9.0]]}]


def test_replay_matches_hand_computed_trimmed_means_and_carries_the_history():
    import reports

    from zo_byzantine.attacks import build_attack

    values = [[float(v) for v in row] for row in torch.randn(6, 12, generator=torch.Generator().manual_seed(0))]
    rounds = _rounds(values)

    def by_hand(row, byzantine):  # CWTM on 12 values with f = 3: the mean of the 6 middle ones
        row = sorted(byzantine + row[3:])
        return sum(row[3:9]) / 6

    hbars = [sum(row[3:]) / 9 for row in values]
    pairs = list(zip(values, hbars, strict=True))
    calm = reports.replay(rounds, "cwtm", (), {}, None)
    assert calm["rounds"] == 6
    assert calm["shift"] == pytest.approx(sum(abs(by_hand(row, row[:3]) - h) for row, h in pairs) / 6)
    assert calm["signal"] == pytest.approx(sum(abs(h) for h in hbars) / 6)
    silent = reports.replay(rounds, "cwtm", (), {}, build_attack("alie", omega=0.0))  # every attacker sends hbar
    assert silent["shift"] == pytest.approx(sum(abs(by_hand(row, [h] * 3) - h) for row, h in pairs) / 6)
    # an attacker far out every round: the history rule leaves it out once its score has fallen over rounds, which
    # a rule that forgot its state between rounds never would (one round's score is at most 0.05 x 8 below 0)
    far = [[100.0] * 3 + row[3:] for row in values * 3]
    history = reports.replay(_rounds(far), "history", (), {"base": "cwtm"}, None)
    assert history["byzantine_excluded"] > 0 and history["honest_excluded"] == 0
    assert history["agreement"][0] < history["agreement"][1]  # the attackers' mean agreement, then the honest
    assert max(history["scores"][0]) < min(history["scores"][1]) and len(history["scores"][1]) == 9
    assert "agreement" not in calm  # a stateless rule has none


@pytest.mark.parametrize("cell", ["alie", "none"])
def test_linear_cells_are_their_cell_with_the_lr_decaying(tmp_path, cell):
    constant = table.command("cpu_long", "sst2", cell, 0, str(tmp_path), "smollm2-135m")
    linear = table.command("cpu_long", "sst2", f"{cell}_linear", 0, str(tmp_path), "smollm2-135m")
    i = len(linear) - linear[::-1].index("--lr_scheduler_type") - 1  # the cell's flag: the last one
    assert linear[i:i + 2] == ["--lr_scheduler_type", "linear"] and linear[:i] + linear[i + 2:] == constant
    assert constant[constant.index("--lr_scheduler_type") + 1] == "constant"  # the config's, which the cell's beats


def test_every_configuration_runs_trec_at_its_k_with_all_86_abbr(tmp_path):
    """The table runs every task at one k: TREC's ABBR class (86 examples) gives all it has instead of stopping the
    run at its first TREC cell (a k asked for explicitly used to be refused; the `gpu` configuration lists TREC)."""
    from helpers import load_example

    for config in table.CONFIGS:
        line = table.command(config, "trec", "alie", 0, str(tmp_path), "smollm2-135m")
        assert line[line.index("--per_class_at_most") + 1] == "true", config
    module = load_example("run_glue_fed")
    line = table.command("cpu_k512", "trec", "alie", 0, str(tmp_path), "smollm2-135m")  # gpu's bf16 needs a GPU
    argv = line[line.index("--model_name_or_path"):]
    _, data_args, _ = module.parse(argv)
    assert data_args.per_class_at_most and data_args.num_train_per_class == 512
    spec = module.load_task("trec")
    train, _ = module.raw_splits(spec, data_args, 0)
    assert sorted(collections.Counter(train["label"]).values()) == [86, 512, 512, 512, 512, 512]
    flag = argv.index("--per_class_at_most")
    _, strict, _ = module.parse(argv[:flag] + argv[flag + 2:])
    with pytest.raises(ValueError, match="class 2 has only 86 examples"):
        module.raw_splits(spec, strict, 0)
