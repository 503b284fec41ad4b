"""Each attack's formula on hand-computed examples; omega search; attacks end to end."""

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, dataset_loss, make_trainer

from zo_byzantine.aggregators import CWTM, NNM, Chain, Mean, Median
from zo_byzantine.attacks import build_attack, register_attack

HONEST = torch.tensor([[1.0, -2.0], [3.0, -4.0], [5.0, 0.0], [7.0, -6.0], [9.0, 2.0]], dtype=torch.float64)
OWN = torch.zeros(2, 2, dtype=torch.float64)  # n = 7, b = 2


def attack(name, **kwargs):
    return build_attack(name, 7, 2, **kwargs)(HONEST, OWN, Mean())


def test_formulas_on_a_hand_computed_example():
    # hbar = [5, -2], unbiased sigma = [sqrt(10), sqrt(10)], k = floor(2/7 * 7) = 2
    s = 10**0.5
    assert attack("none").tolist() == OWN.tolist()
    torch.testing.assert_close(attack("alie", omega=1.5), torch.tensor([[5 + 1.5 * s, -2 + 1.5 * s]] * 2).double())
    assert attack("foe", omega=3.0).tolist() == [[-10.0, 4.0]] * 2
    assert attack("ipm", omega=3.0).tolist() == [[-10.0, 4.0]] * 2
    assert attack("sf").tolist() == [[-5.0, 2.0]] * 2
    assert attack("tma").tolist() == [[3.0, 0.0]] * 2  # hbar>0: 2nd smallest; hbar<0: 2nd largest
    assert attack("always_small").tolist() == [[3.0, -4.0]] * 2
    assert attack("always_large").tolist() == [[7.0, 0.0]] * 2
    assert torch.isnan(attack("nonfinite")).all() and torch.isinf(attack("nonfinite", value="-inf")).all()


def test_random_choice_and_gaussian_are_seeded_by_round():
    rc = build_attack("random_choice", 7, 2)
    picks = set()
    for t in range(20):
        rc.set_round((0, t, 1))
        out = rc(HONEST, OWN, Mean())
        assert out[0, 0].item() in (3.0, 7.0) and out[0, 1].item() in (-4.0, 0.0)
        picks.add(tuple(out[0].tolist()))
    assert len(picks) > 1
    g = build_attack("gaussian", 7, 2, std=3.0)
    g.set_round((0, 5, 1))
    a = g(HONEST, OWN, Mean())
    g.set_round((0, 5, 1))
    assert torch.equal(a, g(HONEST, OWN, Mean())) and not torch.equal(a[0], a[1])


def test_auto_omega_returns_the_grid_maximiser():
    honest = torch.tensor([[0.0], [2.0], [4.0]], dtype=torch.float64)  # hbar 2, sigma 2
    own = torch.zeros(2, 1, dtype=torch.float64)
    alie = build_attack("alie", 5, 2, candidates=[0.0, 1.0, 2.0, 5.0])
    # median of {0, 2, 4, 2 + 2w, 2 + 2w}: 2 at w=0, 4 for w >= 1: the first maximiser is w = 1
    out = alie(honest, own, Median())
    assert alie.last_omega == 1.0 and out.tolist() == [[4.0], [4.0]]
    foe = build_attack("foe", 4, 1)
    foe(honest, own[:1], Mean())  # |mean - hbar| = omega/2 (hbar = 2): grows with omega
    assert foe.last_omega == 10.0


def test_auto_omega_targets_pipeline_or_final_rule():
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(9, 3, generator=g, dtype=torch.float64)
    own = torch.zeros(3, 3, dtype=torch.float64)
    pipeline = Chain([NNM(12, 3)], CWTM(12, 3))
    grid = [0.0, 0.5, 1.0, 2.0, 4.0, 8.0]

    def best(rule):
        gaps = [
            (
                float(
                    (
                        rule(torch.cat([honest, (honest.mean(0) + w * honest.std(0)).expand(3, -1)])) - honest.mean(0)
                    ).norm()
                ),
                -i,
            )
            for i, w in enumerate(grid)
        ]
        return grid[-max(gaps)[1]]

    a = build_attack("alie", 12, 3, candidates=grid)
    a(honest, own, pipeline)
    r = build_attack("alie", 12, 3, candidates=grid, target="rule")
    r(honest, own, pipeline)
    assert a.last_omega == best(pipeline) and r.last_omega == best(pipeline.rule)


def test_user_attack_registry():
    @register_attack("zeros")
    class Zeros:
        def __init__(self, num_clients, num_byzantine):
            pass

        def __call__(self, honest, own, rule):
            return torch.zeros_like(own)

    assert build_attack("zeros", 7, 2)(HONEST, OWN + 1, Mean()).abs().sum() == 0


def _honest_loss_change(tmp_path, aggregator, attack, **attack_kwargs):
    torch.manual_seed(0)
    model = LogisticRegression()
    dataset = VectorDataset(512)

    before = dataset_loss(model, dataset)
    trainer = make_trainer(
        model,
        dataset,
        tmp_path,
        num_clients=8,
        num_byzantine=2,
        per_device_train_batch_size=16,
        max_steps=80,
        learning_rate=0.2,
        num_perturbations=4,
        aggregator=aggregator,
        attack=attack,
        attack_kwargs=attack_kwargs,
        logging_steps=80,
    )
    trainer.train()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return dataset_loss(model, dataset) - before, trainer


@pytest.mark.parametrize("rule", ["cwtm", "median"])
def test_robust_rules_still_learn_where_the_mean_is_steered(tmp_path, rule):
    # FOE with omega = 10: Byzantine clients send -9 hbar; the mean becomes (6 - 18)/8 hbar = -1.5 hbar (ascent)
    mean_change, trainer = _honest_loss_change(tmp_path, "mean", "foe", omega=10.0)
    assert mean_change > 0
    robust_change, trainer = _honest_loss_change(tmp_path, rule, "foe", omega=10.0)
    assert robust_change < -0.1
    log = next(e for e in trainer.state.log_history if "aggregate_shift" in e)
    assert log["attack_omega"] == 10.0 and log["honest_mean_norm"] > 0


def test_sign_flip_slows_the_mean_but_not_cwtm(tmp_path):
    mean_change, _ = _honest_loss_change(tmp_path, "mean", "sf")
    cwtm_change, trainer = _honest_loss_change(tmp_path, "cwtm", "sf")
    assert cwtm_change < mean_change < 0  # mean: (6 - 2)/8 hbar = hbar/2, half speed
    log = next(e for e in trainer.state.log_history if "byzantine_values_kept" in e)
    assert 0 <= log["byzantine_values_kept"] <= 80 * 4 * 2


def test_nonfinite_attack_never_reaches_the_weights(tmp_path):
    for rule in ("cwtm", "median", "krum", "mean"):
        _, trainer = _honest_loss_change(tmp_path, rule, "nonfinite")
        logs = [e for e in trainer.state.log_history if "nonfinite_values" in e]
        assert sum(e["nonfinite_values"] for e in logs) == 80 * 4 * 2


def test_label_flipping_changes_only_byzantine_labels(tmp_path):
    trainer = make_trainer(
        LogisticRegression(), VectorDataset(128), tmp_path, num_clients=4, num_byzantine=1, attack="lf", max_steps=2
    )
    with pytest.raises(ValueError, match="num_classes"):
        trainer.train()
    trainer = make_trainer(
        LogisticRegression(),
        VectorDataset(128),
        tmp_path,
        num_clients=4,
        num_byzantine=1,
        attack="lf",
        attack_kwargs={"num_classes": 2},
        max_steps=2,
    )
    trainer.train()
    rows = torch.tensor([True] * 4 + [False] * 12)
    labels = torch.tensor([0, 1] * 8)
    flipped = trainer.flip_labels(trainer.model, {"labels": labels}, rows)["labels"]
    assert flipped[:4].tolist() == [1, 0, 1, 0] and torch.equal(flipped[4:], labels[4:])
