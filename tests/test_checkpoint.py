"""Resume continues the same trajectory; the ledger replays the run bitwise and rejects bad files."""

import copy
import json
import os

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, assert_same_weights, make_trainer, state

from zo_byzantine import Ledger, LedgerError, replay
from zo_byzantine.ledger import LEDGER_NAME

SETTINGS = dict(
    num_clients=4,
    max_steps=8,
    learning_rate=0.1,
    num_perturbations=2,
    partition="dirichlet",
    lr_scheduler_type="linear",
    weight_decay=0.01,
)


def _model():
    torch.manual_seed(0)
    return LogisticRegression()


def test_resume_from_checkpoint_continues_the_same_trajectory(tmp_path):
    straight = _model()
    straight_loss = make_trainer(straight, VectorDataset(128), tmp_path / "a", **SETTINGS).train().training_loss

    resumed = _model()
    make_trainer(
        resumed, VectorDataset(128), tmp_path / "b", **{**SETTINGS, "save_strategy": "steps", "save_steps": 4}
    ).train()
    checkpoint = tmp_path / "b" / "checkpoint-4"
    assert (checkpoint / LEDGER_NAME).is_file()

    fresh = _model()  # a new process: weights come from the checkpoint
    trainer = make_trainer(fresh, VectorDataset(128), tmp_path / "c", **SETTINGS)
    resumed_loss = trainer.train(resume_from_checkpoint=str(checkpoint)).training_loss
    assert_same_weights(state(fresh), state(straight))
    assert [r["round"] for r in trainer.ledger.rounds] == list(range(8))
    assert resumed_loss == straight_loss  # train_loss over all 8 rounds, as uninterrupted


def test_a_finished_run_is_not_trained_further_on_resume(tmp_path):
    """A checkpoint at max_steps: the Trainer's loop would run one more round (each re-run of a finished job adding
    one); it is refused before any work, by path and by resume_from_checkpoint=True alike."""
    settings = {**SETTINGS, "max_steps": 4, "save_strategy": "steps", "save_steps": 4}
    make_trainer(_model(), VectorDataset(128), tmp_path, **settings).train()
    for resume in (str(tmp_path / "checkpoint-4"), True):
        trainer = make_trainer(_model(), VectorDataset(128), tmp_path, **settings)
        with pytest.raises(ValueError, match="checkpoint is at round 4, max_steps=4; nothing is left to train"):
            trainer.train(resume_from_checkpoint=resume)
        assert trainer.state.global_step == 0
    more = make_trainer(_model(), VectorDataset(128), tmp_path, **{**settings, "max_steps": 5})
    more.train(resume_from_checkpoint=True)
    assert more.state.global_step == 5 and [r["round"] for r in more.ledger.rounds] == list(range(5))


def test_ledger_replay_reproduces_final_weights_bitwise(tmp_path):
    model = _model()
    start = copy.deepcopy(model)
    trainer = make_trainer(model, VectorDataset(128), tmp_path, **SETTINGS)
    trainer.train()
    path = tmp_path / LEDGER_NAME
    assert path.is_file() and os.path.getsize(path) < 10_000
    replay(start, str(path))
    assert_same_weights(state(start), state(model))
    untouched = _model()
    assert not torch.equal(untouched.linear.weight, model.linear.weight)


def test_ledger_rejects_corrupt_truncated_and_mismatched_files(tmp_path):
    model = _model()
    make_trainer(model, VectorDataset(64), tmp_path, max_steps=3).train()
    text = (tmp_path / LEDGER_NAME).read_text()

    (tmp_path / "truncated.json").write_text(text[: len(text) // 2])
    with pytest.raises(LedgerError, match="corrupt or truncated"):
        Ledger.read(str(tmp_path / "truncated.json"))

    data = json.loads(text)
    data["rounds"][0]["coefficients"][0] += 1.0
    (tmp_path / "tampered.json").write_text(json.dumps(data))
    with pytest.raises(LedgerError, match="digest"):
        Ledger.read(str(tmp_path / "tampered.json"))

    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(LedgerError, match="not a"):
        Ledger.read(str(tmp_path / "other.json"))

    with pytest.raises(LedgerError, match="differ"):
        replay(LogisticRegression(dim=5), str(tmp_path / LEDGER_NAME))


def test_evaluate_predict_and_save_model_work(tmp_path):
    model = _model()
    dataset = VectorDataset(64)
    trainer = make_trainer(model, dataset, tmp_path, max_steps=2)
    trainer.eval_dataset = dataset
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    predictions = trainer.predict(dataset)
    assert predictions.predictions.shape == (64, 2)
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / LEDGER_NAME).is_file()


def test_resume_keeps_a_replayable_ledger_and_refuses_a_checkpoint_without_one(tmp_path):
    run = make_trainer(_model(), VectorDataset(128), tmp_path / "b",
                       **{**SETTINGS, "save_strategy": "steps", "save_steps": 4})
    run.train()
    checkpoint = tmp_path / "b" / "checkpoint-4"
    torch.manual_seed(123)
    fresh = LogisticRegression()  # another initialisation: the checkpoint's weights replace it
    trainer = make_trainer(fresh, VectorDataset(128), tmp_path / "c", **SETTINGS)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    start = _model()  # the run's true start: the resumed ledger still replays from it, bitwise
    replay(start, trainer.ledger.to_dict())
    assert_same_weights(state(start), state(fresh))
    os.remove(checkpoint / LEDGER_NAME)
    again = make_trainer(_model(), VectorDataset(128), tmp_path / "d", **SETTINGS)
    with pytest.raises(LedgerError, match="has no zo_ledger.json"):
        again.train(resume_from_checkpoint=str(checkpoint))


class _TiedModel(torch.nn.Module):
    """A plain module whose output layer shares its weight with the input layer (as an LM's tied head)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(dim, dim, bias=False)
        self.outer = torch.nn.Linear(dim, dim, bias=False)
        self.outer.weight = self.inner.weight
        self.head = LogisticRegression(dim)

    def forward(self, x, labels=None):
        return self.head(self.outer(torch.tanh(self.inner(x))), labels)


def test_resume_of_a_tied_model_loads_the_shared_weight_once_without_a_missing_key_warning(tmp_path, caplog):
    """The checkpoint stores the tied tensor once; resuming loads it through the stored key (the two stay one
    tensor, the trajectory continues) and Trainer's "missing keys" warning names nothing (it named the tied key)."""
    settings = {**SETTINGS, "max_steps": 6}
    straight = _TiedModel()
    make_trainer(straight, VectorDataset(128), tmp_path / "a", **settings).train()
    make_trainer(_TiedModel(), VectorDataset(128), tmp_path / "b",
                 **{**settings, "save_strategy": "steps", "save_steps": 3}).train()
    resumed = _TiedModel()
    with caplog.at_level("WARNING"):
        make_trainer(resumed, VectorDataset(128), tmp_path / "c", **settings).train(
            resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-3"))
    assert not [r for r in caplog.records if "missing keys" in r.getMessage()]
    assert resumed.outer.weight is resumed.inner.weight
    assert_same_weights(state(resumed), state(straight))


def test_a_truly_missing_key_is_still_reported():
    from zo_byzantine.checkpoints import missing_untied

    model = _TiedModel()
    assert missing_untied(model, ["outer.weight"]) == []  # loaded through inner.weight
    assert missing_untied(model, ["outer.weight", "inner.weight"]) == ["outer.weight", "inner.weight"]
    assert missing_untied(model, ["head.linear.bias"]) == ["head.linear.bias"]
