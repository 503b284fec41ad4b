"""Resume that cannot be fooled or broken (issue 48, items 1-3): the ledger records the protocol settings and the
weights it was saved with; a checkpoint is complete or absent; what interrupted saves left is removed."""

import copy
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, assert_same_weights, make_trainer, state
from transformers.trainer_callback import TrainerState

from zo_byzantine import LedgerError, replay
from zo_byzantine.ledger import LEDGER_NAME, Ledger, _digest

SETTINGS = dict(num_clients=4, num_byzantine=1, max_steps=6, learning_rate=0.1, num_perturbations=2,
                save_strategy="steps", save_steps=3)


def _model():
    torch.manual_seed(0)
    return LogisticRegression()


def _train(output_dir, **changes):
    model = _model()
    trainer = make_trainer(model, VectorDataset(128), output_dir, **{**SETTINGS, **changes})
    trainer.train()
    return trainer, model


def test_a_checkpoint_holding_another_runs_ledger_is_refused(tmp_path):
    """Item 1: runs A and D from the same start, D with zo_seed=7; D's checkpoint ledger copied into A's checkpoint.
    Resuming A is refused for its settings (zo_seed), and, with D's settings, because the ledger was saved with other
    weights than A's checkpoint holds: a final ledger could never rebuild the model."""
    _train(tmp_path / "a")
    _train(tmp_path / "d", zo_seed=7)
    checkpoint = tmp_path / "a" / "checkpoint-3"
    shutil.copy(tmp_path / "d" / "checkpoint-3" / LEDGER_NAME, checkpoint / LEDGER_NAME)
    trainer = make_trainer(_model(), VectorDataset(128), tmp_path / "a", **SETTINGS)
    with pytest.raises(LedgerError, match=r"its protocol.zo_seed differ .*protocol.zo_seed: the ledger has int 7, this "
                                          r"run int 42"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.ledger is None  # refused before any work: no optimizer, no model loaded
    trainer = make_trainer(_model(), VectorDataset(128), tmp_path / "a", **{**SETTINGS, "zo_seed": 7})
    with pytest.raises(LedgerError, match="saved with other weights than those loaded .* another run or another "
                                          "checkpoint"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 3  # refused once the checkpoint's weights were loaded, before any round


def test_the_ledger_records_the_protocol_and_the_weights_it_was_saved_with(tmp_path):
    trainer, model = _train(tmp_path, aggregator="cwtm", aggregator_kwargs={"beta": 0.25}, attack="alie",
                            pre_aggregators=["nnm"])
    data = Ledger.read(tmp_path)
    assert data["version"] == 3
    protocol = data["protocol"]
    assert protocol["zo_seed"] == 42 and protocol["num_perturbations"] == 2 and protocol["num_clients"] == 4
    assert protocol["aggregator"] == [["nnm", {}], ["cwtm", {"beta": 0.25}]]
    assert protocol["attack"][0] == "ALIE" and protocol["attack"][1]["omega"] == "auto"
    assert protocol["train_examples"] == 128 and protocol["per_device_train_batch_size"] == 4
    from zo_byzantine.ledger import weights_fingerprint
    assert data["end_fingerprint"] == weights_fingerprint(model)
    checkpoint = Ledger.read(tmp_path / "checkpoint-3")
    assert len(checkpoint["rounds"]) == 3 and checkpoint["end_fingerprint"] != data["end_fingerprint"]
    assert checkpoint["protocol"] == protocol


CHANGES = {  # item 2: every one was accepted silently on resume
    "num_clients": 6,
    "aggregator": "median",
    "attack": "sf",
    "zo_eps": 2e-3,
    "num_perturbations": 3,
    "zo_seed": 7,
    "per_device_train_batch_size": 2,
    "partition": "dirichlet",
}


def test_resuming_with_other_protocol_settings_is_refused_naming_them(tmp_path):
    _train(tmp_path / "run")
    checkpoint = str(tmp_path / "run" / "checkpoint-3")
    for name, value in CHANGES.items():
        trainer = make_trainer(_model(), VectorDataset(128), tmp_path / name, **{**SETTINGS, name: value})
        with pytest.raises(LedgerError, match=rf"Cannot continue checkpoint .*: its .*protocol.{name}[ ,]"):
            trainer.train(resume_from_checkpoint=checkpoint)
        assert trainer.ledger is None and trainer.state.global_step == 0, name  # before any work
    # how rounds are evaluated is not part of the protocol: another schedule resumes
    again = make_trainer(_model(), VectorDataset(128), tmp_path / "again", **{**SETTINGS, "zo_schedule": "cached"})
    again.train(resume_from_checkpoint=checkpoint)
    assert again.state.global_step == 6


def test_version_2_ledgers_still_resume_and_replay(tmp_path, caplog):
    """A checkpoint written before version 3 (no protocol, no end fingerprint): read, resumed with a warning (nothing to
    check the settings and weights against), and the resumed run's ledger replays from the start, bitwise."""
    _train(tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoint-3"
    data = Ledger.read(checkpoint)
    old = {k: v for k, v in data.items() if k not in ("protocol", "end_fingerprint", "digest")}
    old["version"] = 2
    old["digest"] = _digest(old)
    (checkpoint / LEDGER_NAME).write_text(json.dumps(old))
    straight = _model()
    make_trainer(straight, VectorDataset(128), tmp_path / "straight", **{**SETTINGS, "save_strategy": "no"}).train()
    resumed = LogisticRegression()
    trainer = make_trainer(resumed, VectorDataset(128), tmp_path / "resumed", **SETTINGS)
    with caplog.at_level(logging.WARNING, logger="zo_byzantine"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "records no protocol settings" in caplog.text and "no fingerprint of the weights it was saved with" in \
        caplog.text
    assert_same_weights(state(resumed), state(straight))
    assert torch.equal(replay(_model(), trainer.ledger.to_dict()).linear.weight, resumed.linear.weight)


def test_a_save_that_fails_midway_leaves_no_checkpoint_and_resume_true_skips_incomplete_ones(tmp_path, monkeypatch,
                                                                                               caplog):
    """Item 3: a save interrupted while the trainer state is written leaves no checkpoint-6 (the Trainer wrote in place:
    checkpoint-6 without trainer_state.json, which resume_from_checkpoint=True picked and failed on). True resumes from
    the newest complete checkpoint, naming the incomplete ones it skipped, and the interrupted save's folder goes."""
    straight = _model()
    make_trainer(straight, VectorDataset(128), tmp_path / "straight", **{**SETTINGS, "save_strategy": "no"}).train()
    real, calls = TrainerState.save_to_json, []

    def fails_at_the_second_save(self, path):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "w") as f:
                f.write('{"global_step": ')
            raise OSError("No space left on device")
        real(self, path)

    out = tmp_path / "run"
    monkeypatch.setattr(TrainerState, "save_to_json", fails_at_the_second_save)
    with pytest.raises(OSError, match="No space left"):
        _train(out)
    monkeypatch.setattr(TrainerState, "save_to_json", real)
    assert sorted(os.listdir(out)) == [".checkpoint-6.staging", "checkpoint-3"]
    (out / "checkpoint-5").mkdir()  # an incomplete checkpoint (written by an earlier version, or copied in part)
    (out / "checkpoint-5" / "model.safetensors").write_bytes(b"")
    resumed = LogisticRegression()
    trainer = make_trainer(resumed, VectorDataset(128), out, **SETTINGS)
    with caplog.at_level(logging.WARNING, logger="zo_byzantine"):
        trainer.train(resume_from_checkpoint=True)
    assert "skipped incomplete checkpoint-5 (missing trainer_state.json, zo_ledger.json)" in caplog.text
    assert "checkpoint-3" in caplog.text.split("resuming from")[1]
    assert_same_weights(state(resumed), state(straight))
    assert not [name for name in os.listdir(out) if name.startswith(".")]
    for step in (3, 6):
        assert {"trainer_state.json", LEDGER_NAME} <= set(os.listdir(out / f"checkpoint-{step}"))


def test_resume_true_without_a_complete_checkpoint_names_what_it_found(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    trainer = make_trainer(_model(), VectorDataset(128), tmp_path, **SETTINGS)
    with pytest.raises(ValueError, match=r"no complete checkpoint .* \(incomplete: checkpoint-2 \(missing "
                                         r"trainer_state.json, zo_ledger.json\)\)"):
        trainer.train(resume_from_checkpoint=True)


def test_the_temporary_files_of_dead_ledger_writers_are_removed(tmp_path):
    """Item 3: a writer killed inside a ledger write left ``.zo_ledger.json.<pid>.tmp``; the next save in that folder
    removes it (a live process's file stays)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".{LEDGER_NAME}.{int(dead.stdout)}.tmp"
    live = tmp_path / f".{LEDGER_NAME}.{os.getppid()}.tmp"
    for path in (stale, live):
        path.write_text('{"format": "zo_byzantine.ledger", "vers')
    trainer = make_trainer(_model(), VectorDataset(64), tmp_path, max_steps=1)
    trainer.train()
    assert not stale.exists() and live.exists() and (tmp_path / LEDGER_NAME).is_file()
    live.unlink()
    copy.deepcopy(trainer.ledger).save(str(tmp_path))
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]


def test_staged_checkpoints_keep_the_best_one_and_rotate_in_the_output_folder(tmp_path):
    data = VectorDataset(128)
    trainer = make_trainer(_model(), data, tmp_path, trainer_kwargs={"eval_dataset": VectorDataset(64, seed=1)},
                           **{**SETTINGS, "save_steps": 1, "save_total_limit": 2, "eval_strategy": "steps",
                              "eval_steps": 1, "load_best_model_at_end": True, "metric_for_best_model": "loss",
                              "greater_is_better": True})
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert os.path.dirname(best) == str(tmp_path) and os.path.isdir(best)
    kept = sorted(name for name in os.listdir(tmp_path) if name.startswith("checkpoint-"))
    assert len(kept) <= 3 and "checkpoint-6" in kept and os.path.basename(best) in kept
    with open(os.path.join(best, "trainer_state.json")) as f:
        assert json.load(f)["best_model_checkpoint"] in (None, best)  # never the staging folder
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]
