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
from zo_byzantine.ledger import LEDGER_NAME, Ledger, _digest, temporary_name

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
    assert "has no protocol (written before version 3)" in caplog.text and "has no end_fingerprint (written before " \
        "version 3): it cannot be checked against the loaded weights" in caplog.text
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
    stale = tmp_path / temporary_name(int(dead.stdout))
    live = tmp_path / temporary_name(os.getppid())
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
        assert json.load(f)["best_model_checkpoint"] == best
    for name in kept:  # no checkpoint's trainer state names a staging folder
        with open(tmp_path / name / "trainer_state.json") as f:
            assert ".staging" not in f.read(), name
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]


def _rewrite(folder, **fields):
    data = Ledger.read(folder)
    data.update(fields)
    data.pop("digest")
    data["digest"] = _digest(data)
    (folder / LEDGER_NAME).write_text(json.dumps(data))


@pytest.mark.parametrize("changes", [{}, {"zo_seed": 7, "num_perturbations": 3}])
def test_a_version_3_ledger_without_protocol_is_refused_not_adopted(tmp_path, changes):
    """A version-3 checkpoint ledger whose protocol is null was resumed with a warning ("written before version 3")
    and the run's own settings then replaced it: refused, with this run's settings or others, before any work."""
    _train(tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoint-3"
    _rewrite(checkpoint, protocol=None)
    trainer = make_trainer(_model(), VectorDataset(128), tmp_path / "resumed", **{**SETTINGS, **changes})
    with pytest.raises(LedgerError, match=r"version-3 ledger whose protocol is null"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.ledger is None and trainer.state.global_step == 0


def test_a_version_3_ledger_without_end_fingerprint_is_refused(tmp_path):
    _train(tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoint-3"
    _rewrite(checkpoint, end_fingerprint=None)
    trainer = make_trainer(_model(), VectorDataset(128), tmp_path / "resumed", **SETTINGS)
    with pytest.raises(LedgerError, match=r"version-3 ledger whose end_fingerprint is null"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 3  # refused once the weights were loaded, before any round


def _listing(folder) -> dict:
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


@pytest.mark.parametrize("staged", ["complete", "partial", "absent"])
def test_a_save_killed_between_its_two_renames_keeps_the_checkpoint(tmp_path, staged):
    """``_publish`` of a re-saved checkpoint-6: the old one moved to ``.checkpoint-6.old``, the new one complete in
    ``.checkpoint-6.staging/checkpoint-6``, killed before the second rename. The next start removed both copies; it
    publishes the staged copy (or puts the old one back when the staged one is not complete)."""
    from zo_byzantine.checkpoints import latest_checkpoint, remove_leftovers

    _train(tmp_path)
    before = _listing(tmp_path / "checkpoint-6")
    os.rename(tmp_path / "checkpoint-6", tmp_path / ".checkpoint-6.old")
    (tmp_path / ".checkpoint-6.staging").mkdir()
    if staged != "absent":
        shutil.copytree(tmp_path / ".checkpoint-6.old", tmp_path / ".checkpoint-6.staging" / "checkpoint-6")
    if staged == "partial":
        (tmp_path / ".checkpoint-6.staging" / "checkpoint-6" / "trainer_state.json").unlink()
    remove_leftovers(str(tmp_path))
    assert latest_checkpoint(str(tmp_path))[0] == str(tmp_path / "checkpoint-6")
    assert _listing(tmp_path / "checkpoint-6") == before
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]


def test_resume_true_after_a_kill_in_the_final_ledger_write_restores_the_output_ledger(tmp_path, caplog):
    """Killed inside the final ``ledger.save(output_dir)`` (no output ledger, a temporary file left): the newest
    checkpoint is finished, so resume_from_checkpoint=True is refused ("nothing is left to train"), and output_dir's
    ledger was never written again. It is restored from that checkpoint, and the refusal says so."""
    _train(tmp_path)
    ended = Ledger.read(tmp_path)
    (tmp_path / LEDGER_NAME).unlink()
    (tmp_path / f".{LEDGER_NAME}.999999.tmp").write_text("{")
    os.utime(tmp_path / f".{LEDGER_NAME}.999999.tmp", (0, 0))  # a dead writer's, long ago
    trainer = make_trainer(_model(), VectorDataset(128), tmp_path, **SETTINGS)
    with caplog.at_level(logging.WARNING, logger="zo_byzantine"), pytest.raises(
            ValueError, match=r"nothing is left to train; output_dir held no readable ledger: its zo_ledger.json was "
                              r"restored from .*checkpoint-6"):
        trainer.train(resume_from_checkpoint=True)
    assert "restored its zo_ledger.json" in caplog.text
    assert Ledger.read(tmp_path) == ended
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]
    trainer = make_trainer(_model(), VectorDataset(128), tmp_path, **SETTINGS)
    with pytest.raises(ValueError, match=r"nothing is left to train \(accepted"):  # already there: nothing said
        trainer.train(resume_from_checkpoint=True)


class _Accelerator:
    def wait_for_everyone(self):
        pass


def test_each_node_publishes_its_own_staging_folder(tmp_path):
    """Several nodes without a shared filesystem: only the main process published (and cleaned) staging folders, so a
    node's other processes' files (``rng_state_<i>.pth``) stayed in ``.checkpoint-N.staging``. Each node's local
    process zero publishes its node's, after the main process (on a shared filesystem nothing is left to it)."""
    from types import SimpleNamespace

    from zo_byzantine.checkpoints import staged_checkpoint

    args = SimpleNamespace(should_save=False, local_process_index=0, save_total_limit=None)
    trainer = SimpleNamespace(args=args, accelerator=_Accelerator(), state=SimpleNamespace(
        global_step=4, best_model_checkpoint=None), _get_output_dir=lambda trial=None: str(tmp_path))
    (tmp_path / ".checkpoint-4.staging" / "stale").mkdir(parents=True)  # a killed save's, on this node
    with staged_checkpoint(trainer, None):
        folder = os.path.join(trainer._get_output_dir(), "checkpoint-4")
        os.makedirs(folder)
        (tmp_path / ".checkpoint-4.staging" / "checkpoint-4" / "rng_state_3.pth").write_bytes(b"rng")
    assert folder.startswith(str(tmp_path / ".checkpoint-4.staging"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]
    assert os.listdir(tmp_path / "checkpoint-4") == ["rng_state_3.pth"]


def test_temporary_files_of_other_hosts_are_judged_by_age_not_by_pid(tmp_path):
    """On a shared filesystem, a pid from another host (or container) says nothing here: such a file is kept while
    young (its writer may be alive there), removed once older than STALE_SECONDS; this host's dead writers' files go."""
    from zo_byzantine.ledger import remove_stale_temporaries, temporary_name

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert temporary_name().startswith(f".{LEDGER_NAME}.") and f".{os.getpid()}.tmp" in temporary_name()
    other_young = tmp_path / f".{LEDGER_NAME}.otherhost.{int(dead.stdout)}.tmp"
    other_old = tmp_path / f".{LEDGER_NAME}.otherhost.{os.getpid() + 1}.tmp"
    mine_dead = tmp_path / temporary_name(int(dead.stdout))
    for path in (other_young, other_old, mine_dead):
        path.write_text("{")
    os.utime(other_old, (0, 0))
    assert sorted(remove_stale_temporaries(str(tmp_path))) == sorted([other_old.name, mine_dead.name])
    assert other_young.exists()


def test_the_flower_coordinator_records_the_protocol(tmp_path):
    """The Flower coordinator's ledger was version 3 with a null protocol: it records the run's settings (no simulated
    attack: ``attack`` null)."""
    pytest.importorskip("flwr")
    from flower_helpers import coordinator, run_config

    server = coordinator(run_config())
    protocol = server.ledger.protocol
    args = server.deployment.args
    assert protocol is not None and protocol["attack"] is None
    assert protocol["zo_seed"] == args.zo_seed and protocol["num_clients"] == args.num_clients
    assert protocol["train_examples"] == len(server.task.train_dataset)
    server.ledger.save(str(tmp_path))
    assert Ledger.read(tmp_path)["protocol"] == protocol
