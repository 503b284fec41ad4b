"""Partitions, client sampling and per-round batches."""

import numpy as np
import pytest
import torch
from helpers import LogisticRegression, VectorDataset, make_trainer

from zo_byzantine import Aggregation, Attack, AttackOutput, Rule
from zo_byzantine.federation import Federation, partition_dataset
from zo_byzantine.server import sanitize

LABELS = np.repeat(np.arange(5), 40)


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "shards"])
def test_partitions_are_seeded_disjoint_and_complete(kind):
    a = partition_dataset(kind, len(LABELS), 8, seed=3, labels=LABELS, alpha=0.5, min_examples=2)
    b = partition_dataset(kind, len(LABELS), 8, seed=3, labels=LABELS, alpha=0.5, min_examples=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    together = np.sort(np.concatenate(a))
    assert np.array_equal(together, np.arange(len(LABELS)))
    assert min(len(p) for p in a) >= 2
    c = partition_dataset(kind, len(LABELS), 8, seed=4, labels=LABELS, alpha=0.5, min_examples=2)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_dirichlet_small_alpha_is_skewed_and_shards_hold_few_labels():
    skewed = partition_dataset("dirichlet", len(LABELS), 5, seed=0, labels=LABELS, alpha=0.05)
    assert np.mean([len(np.unique(LABELS[p])) for p in skewed]) < 3.5
    shards = partition_dataset("shards", len(LABELS), 5, seed=0, labels=LABELS)
    assert max(len(np.unique(LABELS[p])) for p in shards) <= 2


def test_round_batches_come_from_each_clients_partition_and_cycle():
    parts = partition_dataset("iid", 30, 3, seed=0)
    fed = Federation(parts, batch_size=4, num_byzantine=1, seed=0)
    seen = {c: [] for c in range(3)}
    for t in range(5):
        idx = fed.round_indices(t)
        assert len(idx) == 12
        for c in range(3):
            chunk = idx[4 * c : 4 * c + 4]
            assert set(chunk) <= set(parts[c].tolist())
            seen[c].extend(chunk)
    for c in range(3):  # a full pass visits every example once before repeating
        assert sorted(seen[c][: len(parts[c])]) == sorted(parts[c].tolist())
    assert fed.is_byzantine.tolist() == [True, False, False]
    assert fed.round_indices(3) == Federation(parts, 4, 1, 0).round_indices(3)


def test_random_byzantine_selection_is_seeded():
    parts = partition_dataset("iid", 100, 10, seed=0)
    a = Federation(parts, 2, 4, seed=1, byzantine_selection="random").is_byzantine
    b = Federation(parts, 2, 4, seed=1, byzantine_selection="random").is_byzantine
    assert a.sum() == 4 and np.array_equal(a, b)


def test_sanitize_maps_nonfinite_to_extremes_and_counts():
    v = torch.tensor([[1.0, float("nan")], [float("inf"), float("-inf")]], dtype=torch.float64)
    cleaned, count = sanitize(v)
    big = float(torch.finfo(torch.float32).max)
    assert count == 3 and cleaned.tolist() == [[1.0, big], [big, -big]]


class NaNAttack(Attack):
    def __call__(self, honest, own, rule, ctx):
        return AttackOutput(torch.full_like(own, float("nan")), {})


class Median(Rule):
    def aggregate(self, vectors, ctx):
        return Aggregation(vectors.median(dim=0).values, {})


def test_nonfinite_byzantine_values_are_counted_and_never_reach_the_model(tmp_path):
    model = LogisticRegression()
    trainer = make_trainer(
        model,
        VectorDataset(128),
        tmp_path,
        num_clients=5,
        num_byzantine=2,
        max_steps=3,
        trainer_kwargs={"attack": NaNAttack(), "aggregator": Median()},
    )
    trainer.train()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert sum(entry["nonfinite_values"] for entry in logs) == 3 * 2


class Exploding(LogisticRegression):
    def forward(self, x, labels=None):
        out = super().forward(x, labels)
        out["logits"] = out["logits"] * float("inf")
        return out


def test_nonfinite_honest_loss_skips_the_round_and_logs_it(tmp_path, caplog):
    model = Exploding()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = make_trainer(model, VectorDataset(64), tmp_path, max_steps=2)
    trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert sum(entry.get("skipped_rounds", 0) for entry in trainer.state.log_history) == 2
    assert [r.get("skipped") for r in trainer.ledger.rounds] == ["non-finite honest loss"] * 2
    assert "skipped" in caplog.text
