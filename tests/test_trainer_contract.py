"""The Trainer's contract kept: unused fields refused by name, compute_loss overrides refused with the hook to
use, throughput counting every client, the best model's ledger beside it, a model card that tells the truth."""

import copy
import os

import pytest
import torch
from helpers import (
    LogisticRegression,
    TextDataset,
    VectorDataset,
    collate,
    make_trainer,
    state,
    tiny_bert,
    wordpiece_tokenizer,
)

from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer, replay
from zo_byzantine.metrics import compute_metrics_fn


@pytest.mark.parametrize(
    ("field", "value", "hint"),
    [("optim", "adafactor", "server_optimizer"), ("label_smoothing_factor", 0.3, "inside the model"),
     ("max_grad_norm", 1e-9, "clip:c="), ("torch_compile", True, "recompile"), ("adam_beta1", 0.5, "server_betas"),
     ("neftune_noise_alpha", 5.0, "embeddings")],
)
def test_training_arguments_the_protocol_replaces_are_refused_by_name(tmp_path, field, value, hint):
    with pytest.raises(ValueError, match=rf"{field}=.*not used by ZOByzantineTrainer.*{hint}"):
        ZOByzantineArguments(output_dir=str(tmp_path), report_to=[], **{field: value})


class SmoothLoss(ZOByzantineTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class DoubledLoss(SmoothLoss):
    def per_example_losses(self, model, inputs):
        sums, counts = super().per_example_losses(model, inputs)
        return 2 * sums, counts


def test_compute_loss_override_is_refused_unless_the_rounds_hook_is_given(tmp_path):
    args = ZOByzantineArguments(output_dir=str(tmp_path), report_to=[], num_clients=4, max_steps=2,
                                per_device_train_batch_size=4, disable_tqdm=True, remove_unused_columns=False)
    with pytest.raises(TypeError, match="overrides compute_loss.*per_example_losses"):
        SmoothLoss(model=LogisticRegression(), args=args, train_dataset=VectorDataset(64))
    runs = {}
    for cls in (ZOByzantineTrainer, DoubledLoss):
        torch.manual_seed(0)
        trainer = cls(model=LogisticRegression(), args=args, train_dataset=VectorDataset(64))
        trainer.train()
        runs[cls] = trainer.ledger.rounds[0]["coefficients"][0]
    assert runs[DoubledLoss] == pytest.approx(2 * runs[ZOByzantineTrainer], rel=1e-6)  # the hook is the loss


def test_throughput_counts_every_client(tmp_path):
    trainer = make_trainer(LogisticRegression(), VectorDataset(512), tmp_path, num_clients=8, clients_per_round=6,
                           per_device_train_batch_size=4, max_steps=10)
    metrics = trainer.train().metrics
    samples = metrics["train_samples_per_second"] * metrics["train_runtime"]
    assert samples == pytest.approx(10 * 6 * 4, rel=0.05)


def test_best_model_at_end_keeps_its_own_ledger_beside_it(tmp_path):
    torch.manual_seed(0)
    model = LogisticRegression()
    start = copy.deepcopy(model)
    data = VectorDataset(256)
    extra = {"eval_dataset": VectorDataset(64, seed=1), "compute_metrics": compute_metrics_fn(["accuracy"])}
    trainer = make_trainer(model, data, tmp_path, trainer_kwargs=extra,
                           max_steps=8, learning_rate=0.5, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                           save_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
                           greater_is_better=True, num_byzantine=1, attack="sf", aggregator="median")
    trainer.train()  # "best" = the highest eval loss: an early checkpoint, not the last round
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-8")
    replay(start, os.path.join(trainer.args.output_dir, "zo_ledger.json"))
    assert all(torch.equal(a, b) for a, b in zip(state(start).values(), state(model).values(), strict=True))


def test_model_card_describes_the_federation(tmp_path):
    tokenizer = wordpiece_tokenizer()
    trainer = make_trainer(tiny_bert(vocab_size=tokenizer.vocab_size), TextDataset(tokenizer, n=32), tmp_path,
                           collate(tokenizer), max_steps=2, num_byzantine=1, attack="sf", aggregator="median")
    trainer.train()
    trainer.create_model_card()
    card = open(os.path.join(trainer.args.output_dir, "README.md")).read()
    assert "ADAMW" not in card and "ZOOptimizer" in card and "4 per client" in card
    d = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    for part in ("n=4", "b=1 Byzantine", "rule: median", "attack: sf", "nu=1", "K=1", f"dense FedAvg: {4 * d}",
                 "rounds: 2", "digest"):
        assert part in card, part
