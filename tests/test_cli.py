"""``python -m zo_byzantine inspect|replay|plot RUN_DIR`` on runs made here (a trained run with evaluations, a run
whose rounds are all skipped, a tiny BERT), through ``zo_byzantine.runs`` and through the command line."""

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    LogisticRegression,
    TextDataset,
    VectorDataset,
    collate,
    make_trainer,
    tiny_bert,
    wordpiece_tokenizer,
)
from safetensors.torch import load_file, save_file

from zo_byzantine import Ledger, LedgerError, runs
from zo_byzantine.__main__ import main
from zo_byzantine.ledger import LEDGER_NAME
from zo_byzantine.metrics import compute_metrics_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(ROOT, "tests", "helpers.py")
ROUNDS = 8
TIMEOUT = 300  # seconds, for each subprocess (most of it is importing torch and transformers)


def _trained(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def cli(*args, **kwargs) -> subprocess.Popen:
    """``python -m zo_byzantine ARGS`` in a subprocess (started, not waited for)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "zo_byzantine", *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def finish(process: subprocess.Popen) -> SimpleNamespace:
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return SimpleNamespace(returncode=process.returncode, stdout=out, stderr=err)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """8 rounds, 3 of 5 clients per round, evaluated every 2 rounds, state saved: zo_ledger.json and
    trainer_state.json in ``dir``; the starting weights in ``start.pt`` and ``start.safetensors``."""
    tmp = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    model = LogisticRegression()
    torch.save(model.state_dict(), tmp / "start.pt")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "start.safetensors"))
    trainer = make_trainer(
        model, VectorDataset(128), tmp / "out", max_steps=ROUNDS, num_clients=5, clients_per_round=3,
        learning_rate=0.05, eval_strategy="steps", eval_steps=2,
        trainer_kwargs={"eval_dataset": VectorDataset(64, seed=1), "compute_metrics": compute_metrics_fn(["accuracy"])},
    )
    trainer.train()
    trainer.save_state()
    out = tmp / "out"
    assert (out / LEDGER_NAME).is_file() and (out / runs.TRAINER_STATE).is_file()
    with open(out / runs.TRAINER_STATE) as f:
        history = json.load(f)["log_history"]
    return SimpleNamespace(dir=out, tmp=tmp, trainer=trainer, trained=_trained(model), ledger=Ledger.read(out),
                           history=history)


@pytest.fixture(scope="module")
def skipped_run(tmp_path_factory):
    """Two rounds of a model whose logits are infinite: both skipped, no loss computed."""

    class Exploding(LogisticRegression):
        def forward(self, x, labels=None):
            out = super().forward(x, labels)
            out["logits"] = out["logits"] * float("inf")
            return out

    tmp = tmp_path_factory.mktemp("skipped")
    make_trainer(Exploding(), VectorDataset(64), tmp, max_steps=2).train()
    os.remove(tmp / runs.TRAINER_STATE)  # as a run made before the trainer wrote it at the end of train()
    return tmp


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """A plain Trainer script's output: evaluated before training and the start accuracy saved with save_metrics (as
    the main job), trained with evaluations every 2 rounds, no save_state() call."""
    tmp = tmp_path_factory.mktemp("plain")
    trainer = make_trainer(
        LogisticRegression(), VectorDataset(128), tmp, max_steps=6, num_clients=4, learning_rate=0.05,
        eval_strategy="steps", eval_steps=2,
        trainer_kwargs={"eval_dataset": VectorDataset(64, seed=1), "compute_metrics": compute_metrics_fn(["accuracy"])},
    )
    start = trainer.evaluate(metric_key_prefix="start")["start_accuracy"]
    trainer.train()
    trainer.save_metrics("eval", {"start_accuracy": start})  # as the main job: train() starts a history without it
    return SimpleNamespace(dir=tmp, start=start, trainer=trainer)


def test_inspect_and_plot_show_the_start_of_a_plain_trainer_scripts_run(plain_run):
    """The evaluation before training is the start (not the first periodic one), and a script that never called
    save_state() gets every panel: the trainer writes trainer_state.json at the end of train()."""
    loaded = runs.load_run(plain_run.dir)
    assert loaded.state_path == os.path.join(plain_run.dir, runs.TRAINER_STATE)
    accuracy = runs.summarize(loaded)["eval_accuracy"]
    evaluations = [(e["step"], e["eval_accuracy"]) for e in loaded.log_history if "eval_accuracy" in e]
    assert accuracy["start"] == (0, plain_run.start) and accuracy["first"] == (0, plain_run.start)
    assert [step for step, _ in evaluations] == [2, 4, 6] and accuracy["evaluations"] == 4
    assert accuracy["best"] == max([(0, plain_run.start), *evaluations], key=lambda pair: pair[1])
    assert f"eval accuracy  start {plain_run.start:.6g} (step 0), best" in runs.format_summary(runs.summarize(loaded))
    fig = runs.plot_figure(loaded)
    assert all(ax.lines for ax in fig.axes) and not any(ax.texts for ax in fig.axes)  # four panels, no "not available"
    start, periodic = fig.axes[1].lines
    assert list(zip(*start.get_data(), strict=True)) == [(0, plain_run.start)]
    assert list(zip(*periodic.get_data(), strict=True)) == evaluations
    low, high = fig.axes[1].get_ylim()
    assert low <= plain_run.start <= high  # the axis spans the start, not only the last evaluations


def test_an_evaluation_at_step_0_is_the_start(tmp_path):
    extra = {"eval_dataset": VectorDataset(32, seed=1), "compute_metrics": compute_metrics_fn(["accuracy"])}
    trainer = make_trainer(LogisticRegression(), VectorDataset(64), tmp_path, max_steps=2, eval_strategy="steps",
                           eval_steps=2, eval_on_start=True, trainer_kwargs=extra)
    trainer.train()
    accuracy = runs.summarize(runs.load_run(tmp_path))["eval_accuracy"]
    first = next(e for e in trainer.state.log_history if "eval_accuracy" in e)
    assert first["step"] == 0 and accuracy["start"] == (0, first["eval_accuracy"]) and accuracy["evaluations"] == 2


def test_a_runs_checkpoint_gives_its_log_history_when_the_directory_has_none(plain_run, tmp_path):
    older = tmp_path / "older"
    shutil.copytree(plain_run.dir, older)
    os.remove(older / runs.TRAINER_STATE)
    checkpoint = older / "checkpoint-4"
    checkpoint.mkdir()
    shutil.copy(plain_run.dir / runs.TRAINER_STATE, checkpoint / runs.TRAINER_STATE)
    assert runs.load_run(older).state_path == str(checkpoint / runs.TRAINER_STATE)


def test_notes_are_wrapped_inside_their_panel(skipped_run):
    fig = runs.plot_figure(runs.load_run(skipped_run))
    notes = [line for ax in fig.axes for text in ax.texts for line in text.get_text().splitlines()]
    assert notes and max(map(len, notes)) <= runs.NOTE_WIDTH


def _history(run, name):
    return [(entry["step"], entry[name]) for entry in run.history if name in entry]


# ----- inspect -------------------------------------------------------------------------------------


def test_inspect_summary_holds_the_ledgers_rounds_losses_and_participants(run):
    rounds = run.ledger["rounds"]
    losses = [entry["loss"] for entry in rounds]
    assert len(rounds) == ROUNDS and all(isinstance(loss, float) for loss in losses)
    summary = runs.summarize(runs.load_run(run.dir))
    assert summary["rounds"] == ROUNDS and summary["skipped"] == 0 and summary["skipped_reasons"] == {}
    low = min(range(ROUNDS), key=losses.__getitem__)
    assert summary["loss"] == {"not_computed": 0, "start": (0, losses[0]), "end": (ROUNDS - 1, losses[-1]),
                               "min": (low, losses[low])}
    shown = [0, 1, 2, ROUNDS - 3, ROUNDS - 2, ROUNDS - 1]
    assert summary["participants"] == {t: rounds[t]["participants"] for t in shown}
    assert all(len(rounds[t]["participants"]) == 3 for t in range(ROUNDS))
    assert len({tuple(entry["participants"]) for entry in rounds}) > 1  # sampled: not the same clients every round
    assert summary["lr_max"] == rounds[0]["lr"] and summary["lr_min"] == min(entry["lr"] for entry in rounds)
    assert summary["parameters"] == 18 and summary["fingerprint"] == run.ledger["fingerprint"]
    accuracy = _history(run, "eval_accuracy")
    assert [step for step, _ in accuracy] == [2, 4, 6, 8]
    best = max(accuracy, key=lambda pair: pair[1])
    assert summary["eval_accuracy"] == {"start": None, "first": accuracy[0], "best": best, "last": accuracy[-1],
                                        "evaluations": 4}  # no evaluation before training: no start
    logged = [entry for entry in run.history if "uplink_bytes_per_client" in entry][-1]
    assert summary["bytes"]["uplink_per_round"] == logged["uplink_bytes_per_client"] == 4
    assert summary["bytes"]["fedavg_per_round"] == logged["fedavg_bytes_per_client"] == 18 * 4

    text = runs.format_summary(summary)
    assert f"rounds         {ROUNDS} (applied {ROUNDS}, skipped 0, dense 0)" in text
    assert f"start {losses[0]:.6g} (round 0), end {losses[-1]:.6g} (round {ROUNDS - 1})" in text
    ids = ", ".join(map(str, rounds[ROUNDS - 1]["participants"]))
    assert f"round {ROUNDS - 1}: 3 [{ids}]" in text and f"... ({ROUNDS - 6} rounds)" in text
    assert f"round {ROUNDS // 2}: 3" not in text  # the middle rounds are elided
    assert f"checked (SHA-256 of the whole content): {run.ledger['digest']}" in text
    assert run.ledger["fingerprint"] in text and "optimizer sgd" in text
    assert f"best {best[1]:.6g} (step {best[0]})" in text and "dense FedAvg 72 (18x less)" in text
    assert f"start not evaluated ({runs.START}); first {accuracy[0][1]:.6g} (step 2)" in text


def test_inspect_rounds_lists_every_round_with_the_ledgers_exact_values(run):
    text = runs.format_rounds(runs.load_run(run.dir))
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["round", "lr", "loss", "clients", "directions"]
    assert len(lines) == ROUNDS + 1
    for line, entry in zip(lines[1:], run.ledger["rounds"], strict=True):
        t, lr, loss, clients, directions = line.split()
        assert (int(t), float(lr), float(loss)) == (entry["round"], entry["lr"], entry["loss"])  # exact
        assert (int(clients), int(directions)) == (len(entry["participants"]), len(entry["seeds"]))


@pytest.mark.slow  # subprocesses or an end-to-end job
def test_inspect_through_the_command_line_prints_the_table(run):
    done = finish(cli("inspect", run.dir, "--rounds"))
    assert done.returncode == 0, done.stderr
    loaded = runs.load_run(run.dir)
    assert done.stdout == runs.format_summary(runs.summarize(loaded)) + "\n" + runs.format_rounds(loaded)


def test_a_skipped_round_shows_its_reason_and_a_null_loss(skipped_run, capsys):
    ledger = Ledger.read(skipped_run)
    assert [(entry["loss"], entry["skipped"]) for entry in ledger["rounds"]] == [(None, "non-finite honest loss")] * 2
    loaded = runs.load_run(skipped_run)
    summary = runs.summarize(loaded)
    assert summary["skipped"] == 2 and summary["skipped_reasons"] == {"non-finite honest loss": [0, 1]}
    assert summary["loss"] == {"not_computed": 2, "start": None, "end": None, "min": None}
    assert main(["inspect", str(skipped_run), "--rounds"]) == 0
    out = capsys.readouterr().out
    assert "skipped        non-finite honest loss: round 0, 1" in out
    assert "honest loss    not computed in any round" in out
    assert "eval accuracy  not available: no trainer_state.json" in out
    rows = out.splitlines()[-2:]
    for t, row in enumerate(rows):
        assert row.split()[:3] == [str(t), repr(ledger["rounds"][t]["lr"]), "null"]
        assert row.endswith("non-finite honest loss")


def test_a_ledger_written_before_the_loss_and_participants_fields_still_inspects(run, tmp_path, capsys):
    older = copy.deepcopy(run.ledger)
    for entry in older["rounds"]:
        del entry["loss"], entry["participants"]
    older.pop("digest")  # resealed as the format says: SHA-256 of the canonical JSON of the other fields
    older["digest"] = hashlib.sha256(json.dumps(older, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (tmp_path / LEDGER_NAME).write_text(json.dumps(older))
    assert main(["inspect", str(tmp_path), "--rounds"]) == 0
    out = capsys.readouterr().out
    assert "participants   not recorded in this ledger" in out and "honest loss    not recorded" in out
    assert out.splitlines()[-1].split()[2:4] == ["-", "-"]


def test_hmac_key_is_checked_when_given(run, tmp_path, capsys):
    keyed = tmp_path / "keyed"
    shutil.copytree(run.dir, keyed)
    run.trainer.ledger.save(str(keyed), key=b"secret")
    (tmp_path / "key").write_bytes(b"secret")
    assert main(["inspect", str(keyed), "--key", "secret"]) == 0
    assert "hmac           checked with the key" in capsys.readouterr().out
    assert main(["inspect", str(keyed), "--key-file", str(tmp_path / "key")]) == 0
    assert "hmac           checked with the key" in capsys.readouterr().out
    assert main(["inspect", str(keyed)]) == 0
    assert "hmac           present, not checked (give --key)" in capsys.readouterr().out
    assert main(["inspect", str(keyed), "--key", "wrong"]) == 1
    assert "fails its HMAC check" in capsys.readouterr().err
    assert main(["inspect", str(run.dir), "--key", "secret"]) == 1
    assert "has no HMAC" in capsys.readouterr().err


# ----- replay --------------------------------------------------------------------------------------


@pytest.mark.slow  # subprocesses or an end-to-end job
def test_replay_through_the_command_line_writes_the_trained_weights_bitwise(run, tmp_path, capsys):
    process = cli("replay", run.dir, "--model-factory", f"{HELPERS}:LogisticRegression", "--start",
                  run.tmp / "start.pt", "--out", tmp_path / "pt.safetensors")
    assert main(["replay", str(run.dir), "--model-factory", "helpers:LogisticRegression", "--start",
                 str(run.tmp / "start.safetensors"), "--out", str(tmp_path / "safetensors.safetensors")]) == 0
    assert capsys.readouterr().out.startswith(f"replayed {ROUNDS} rounds (0 skipped): wrote 2 tensors (18 values)")
    done = finish(process)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"replayed {ROUNDS} rounds (0 skipped): wrote 2 tensors (18 values)")
    for suffix in ("pt", "safetensors"):
        weights = load_file(str(tmp_path / f"{suffix}.safetensors"))
        assert weights.keys() == run.trained.keys()
        for name, tensor in run.trained.items():
            assert torch.equal(weights[name], tensor), name
    start = torch.load(run.tmp / "start.pt", weights_only=True)
    assert not torch.equal(start["linear.weight"], run.trained["linear.weight"])  # the replay did train


def test_replay_refuses_other_starting_weights_and_bad_model_arguments(run, tmp_path, capsys):
    torch.manual_seed(1)
    torch.save(LogisticRegression().state_dict(), tmp_path / "other.pt")
    out = tmp_path / "w.safetensors"
    factory = f"{HELPERS}:LogisticRegression"
    assert main(["replay", str(run.dir), "--model-factory", factory, "--start", str(tmp_path / "other.pt"),
                 "--out", str(out)]) == 1
    assert "fingerprint mismatch" in capsys.readouterr().err and not out.exists()
    assert main(["replay", str(run.dir), "--model-factory", factory, "--start", str(run.tmp / "start.pt"),
                 "--dtype", "float64", "--out", str(out)]) == 1  # the same values in another dtype
    assert "fingerprint" in capsys.readouterr().err
    assert main(["replay", str(run.dir), "--model-factory", "nowhere:build", "--out", str(out)]) == 1
    assert "No module named 'nowhere'" in capsys.readouterr().err
    assert main(["replay", str(run.dir), "--out", str(out)]) == 1
    assert "exactly one of --model DIR" in capsys.readouterr().err
    assert main(["replay", str(run.dir), "--model", str(tmp_path), "--out", str(out)]) == 1
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["replay", str(run.dir), "--model-factory", factory, "--out", str(tmp_path / "w.bin")])
    assert exit_.value.code == 2
    assert not out.exists()


def test_replay_of_a_hugging_face_model_saved_with_save_pretrained(tmp_path):
    tokenizer = wordpiece_tokenizer()
    model = tiny_bert(vocab_size=tokenizer.vocab_size)
    for param in model.bert.embeddings.parameters():
        param.requires_grad_(False)  # a partly frozen run: replay makes the same parameters trainable
    model.save_pretrained(tmp_path / "start")
    trainer = make_trainer(model, TextDataset(tokenizer, 24), tmp_path / "out", collate(tokenizer), max_steps=2,
                           num_clients=2)
    trainer.train()
    trained = _trained(model)
    assert not any(name.startswith("bert.embeddings") for name in trained)
    out = tmp_path / "trained.safetensors"
    done = runs.replay_run(tmp_path / "out", str(out), model=str(tmp_path / "start"))
    assert done["rounds"] == 2 and done["tensors"] == len(trained)
    weights = load_file(str(out))
    assert weights.keys() == trained.keys()
    assert all(torch.equal(weights[name], tensor) for name, tensor in trained.items())
    with pytest.raises(LedgerError, match="fingerprint"):  # the trained folder is not the start
        model.save_pretrained(tmp_path / "end")
        runs.replay_run(tmp_path / "out", str(tmp_path / "x.safetensors"), model=str(tmp_path / "end"))


# ----- plot ----------------------------------------------------------------------------------------


def test_plot_figure_has_the_four_panels_with_the_runs_series(run):
    fig = runs.plot_figure(runs.load_run(run.dir))
    assert len(fig.axes) == 4
    assert [ax.get_title() for ax in fig.axes] == [f"{t}\n{line}" for t, line in zip(runs.PANELS, runs.EXPLAINED,
                                                                                   strict=True)]
    loss_ax, accuracy_ax, shift_ax, bytes_ax = fig.axes
    x, y = loss_ax.lines[0].get_data()
    assert list(x) == list(range(ROUNDS)) and list(y) == [entry["loss"] for entry in run.ledger["rounds"]]
    x, y = accuracy_ax.lines[0].get_data()
    assert list(zip(x, y, strict=True)) == _history(run, "eval_accuracy")
    x, y = shift_ax.lines[0].get_data()
    assert list(zip(x, y, strict=True)) == _history(run, "aggregate_shift")
    dense, ours = (line.get_data()[1] for line in bytes_ax.lines)
    assert list(dense) == [72 * t for t in range(1, ROUNDS + 1)] and list(ours) == [4 * t for t in range(1, ROUNDS + 1)]


def test_plot_says_which_series_are_not_available(skipped_run):
    fig = runs.plot_figure(runs.load_run(skipped_run))
    assert len(fig.axes) == 4
    texts = ["\n".join(t.get_text() for t in ax.texts) for ax in fig.axes]
    assert "no round computed an honest loss" in texts[0]
    assert "no trainer_state.json" in texts[1] and "no trainer_state.json" in texts[2]
    assert "zeroth-order uplink not available" in texts[3]
    assert [len(ax.lines) for ax in fig.axes] == [0, 0, 0, 1]  # dense FedAvg from the ledger's parameter count


def test_plot_through_the_command_line_writes_a_png(run, tmp_path, capsys):
    out = tmp_path / "sub" / "run.png"
    assert main(["plot", str(run.dir), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    from matplotlib.image import imread

    assert imread(str(out)).shape[:2] == (800, 1100)  # 11 x 8 inches at 100 dpi


# ----- a tampered ledger ---------------------------------------------------------------------------


@pytest.mark.slow  # subprocesses or an end-to-end job
def test_a_tampered_ledger_makes_every_subcommand_fail_with_the_ledger_error(run, tmp_path, capsys):
    tampered = tmp_path / "tampered"
    shutil.copytree(run.dir, tampered)
    text = (tampered / LEDGER_NAME).read_text()
    loss = json.dumps(run.ledger["rounds"][3]["loss"])
    assert text.count(loss) == 1
    (tampered / LEDGER_NAME).write_text(text.replace(loss, json.dumps(run.ledger["rounds"][3]["loss"] / 2)))
    with pytest.raises(LedgerError) as err:
        Ledger.read(tampered)
    message = str(err.value)
    assert "fails its digest check" in message
    process = cli("replay", tampered, "--model-factory", f"{HELPERS}:LogisticRegression", "--start",
                  run.tmp / "start.pt", "--out", tmp_path / "w.safetensors")
    for command, extra in (("inspect", ["--rounds"]), ("plot", ["--out", str(tmp_path / "p.png")])):
        assert main([command, str(tampered), *extra]) == 1
        out, err = capsys.readouterr()
        assert (out, err) == ("", f"python -m zo_byzantine {command}: error: {message}\n")
    done = finish(process)  # the process's exit status
    assert (done.returncode, done.stdout, done.stderr) == (1, "", f"python -m zo_byzantine replay: error: {message}\n")
    assert not (tmp_path / "w.safetensors").exists() and not (tmp_path / "p.png").exists()
