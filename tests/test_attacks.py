"""Each attack's formula on hand-computed examples; omega search; attacks end to end."""

import math
import re

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, dataset_loss, make_trainer

from zo_byzantine.aggregators import CWTM, NNM, Chain, Mean, Median
from zo_byzantine.attacks import ATTACKS, Attack, build_attack, flip_labels, register_attack
from zo_byzantine.context import AttackOutput, RoundContext

HONEST = torch.tensor([[1.0, -2.0], [3.0, -4.0], [5.0, 0.0], [7.0, -6.0], [9.0, 2.0]], dtype=torch.float64)
OWN = torch.zeros(2, 2, dtype=torch.float64)  # n = 7, b = 2
MEAN = Chain([], Mean())


def ctx(m=7, f=2, key=(0, 0, 1)):
    return RoundContext(key, m, f)


def attack(name, **kwargs):
    return build_attack(name, **kwargs)(HONEST, OWN, MEAN, ctx()).vectors


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


def test_order_statistics_ranked_among_all_clients():
    # own = 0: per coordinate the 7 values sort to [0, 0, 1, 3, 5, 7, 9] and [-6, -4, -2, 0, 0, 0, 2]; k = 2;
    # the mean of all 7 is [25/7, -10/7]: TMA sends the 2nd smallest, then the 2nd largest
    assert attack("tma", ranked="all").tolist() == [[0.0, 0.0]] * 2
    assert attack("always_small", ranked="all").tolist() == [[0.0, -4.0]] * 2
    assert attack("always_large", ranked="all").tolist() == [[7.0, 0.0]] * 2
    with pytest.raises(ValueError, match="ranked='own' is not supported; accepted: honest, all"):
        build_attack("tma", ranked="own")


def test_tma_ranked_among_honest_lands_above_the_honest_median_past_one_third():
    """m = 40, alpha = beta = 0.375: 15 Byzantine send the 15th smallest of 25 honest values (above their median,
    the 13th) and CWTM, trimming 15 per side, returns exactly that value: no pull below the median. Ranked among
    all 40, the 15th smallest lies below the honest median and so does the aggregate."""
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(25, 64, generator=g, dtype=torch.float64).abs() + 0.1  # hbar > 0 everywhere
    own = torch.randn(15, 64, generator=g, dtype=torch.float64).abs() + 0.1
    rule = Chain([], CWTM(beta=0.375))
    median = honest.median(dim=0).values
    for ranked, below in (("honest", False), ("all", True)):
        sent = build_attack("tma", ranked=ranked)(honest, own, rule, ctx(40, 15)).vectors
        out = rule(torch.cat([honest, sent]), ctx(40, 15)).value
        if ranked == "honest":
            torch.testing.assert_close(out, honest.sort(dim=0).values[14])
        assert bool((out < median).all()) is below


def test_random_choice_and_gaussian_are_seeded_by_round():
    rc = build_attack("random_choice")
    picks = set()
    for t in range(20):
        out = rc(HONEST, OWN, MEAN, ctx(key=(0, t, 1))).vectors
        assert out[0, 0].item() in (3.0, 7.0) and out[0, 1].item() in (-4.0, 0.0)
        picks.add(tuple(out[0].tolist()))
    assert len(picks) > 1
    g = build_attack("gaussian", std=3.0)
    a = g(HONEST, OWN, MEAN, ctx(key=(0, 5, 1))).vectors
    assert torch.equal(a, g(HONEST, OWN, MEAN, ctx(key=(0, 5, 1))).vectors) and not torch.equal(a[0], a[1])
    assert not torch.equal(a, g(HONEST, OWN, MEAN, ctx(key=(0, 6, 1))).vectors)


def test_auto_omega_returns_the_grid_maximiser():
    honest = torch.tensor([[0.0], [2.0], [4.0]], dtype=torch.float64)  # hbar 2, sigma 2
    own = torch.zeros(2, 1, dtype=torch.float64)
    alie = build_attack("alie", candidates=[0.0, 1.0, 2.0, 5.0])
    # median of {0, 2, 4, 2 + 2w, 2 + 2w}: 2 at w=0, 4 for w >= 1: the first maximiser is w = 1
    out = alie(honest, own, Chain([], Median()), ctx(5, 2))
    assert out.diagnostics == {"omega": 1.0} and out.vectors.tolist() == [[4.0], [4.0]]
    foe = build_attack("foe")
    # |mean - hbar| = omega/2 (hbar = 2): grows with omega
    assert foe(honest, own[:1], MEAN, ctx(4, 1)).diagnostics == {"omega": 10.0}


def test_auto_omega_targets_pipeline_or_final_rule():
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(9, 3, generator=g, dtype=torch.float64)
    own = torch.zeros(3, 3, dtype=torch.float64)
    pipeline = Chain([NNM()], CWTM())
    grid = [0.0, 0.5, 1.0, 2.0, 4.0, 8.0]

    def best(rule):
        gaps = [
            (
                float(
                    (
                        rule(torch.cat([honest, (honest.mean(0) + w * honest.std(0)).expand(3, -1)]), ctx(12, 3)).value
                        - honest.mean(0)
                    ).norm()
                ),
                -i,
            )
            for i, w in enumerate(grid)
        ]
        return grid[-max(gaps)[1]]

    a = build_attack("alie", candidates=grid)(honest, own, pipeline, ctx(12, 3))
    r = build_attack("alie", candidates=grid, target="rule")(honest, own, pipeline, ctx(12, 3))
    assert a.diagnostics["omega"] == best(pipeline) and r.diagnostics["omega"] == best(pipeline.rule)
    assert best(pipeline) != best(pipeline.rule)  # the two targets differ here, so the test tells them apart


def test_user_attack_registry():
    @register_attack("zeros")
    class Zeros(Attack):
        def __call__(self, honest, own, rule, ctx):
            return AttackOutput(torch.zeros_like(own), {"round": ctx.key[1]})

    try:
        out = build_attack("zeros")(HONEST, OWN + 1, MEAN, ctx(key=(0, 4, 1)))
        assert out.vectors.abs().sum() == 0 and out.diagnostics == {"round": 4}
        with pytest.raises(ValueError, match="attack 'zeros' is already registered"):
            register_attack("zeros")(Zeros)
    finally:
        ATTACKS.unregister("zeros")


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
    (log,) = [e for e in trainer.state.log_history if "byzantine_values_kept" in e]
    # SF sends -hbar from 2 of 8 clients (80 rounds x 4 directions x 2 = 640 values): CWTM trims 2 per side,
    # so copies of -hbar[r] survive only where it is not among the most extreme values: some, never all
    assert 0 < log["byzantine_values_kept"] < 640


def test_rule_diagnostics_reach_the_logs_through_nnm(tmp_path):
    trainer = make_trainer(LogisticRegression(), VectorDataset(256), tmp_path, num_clients=8, num_byzantine=2,
                           aggregator="cwtm", pre_aggregators=["nnm"], attack="sf", max_steps=4, logging_steps=4)
    trainer.train()
    (log,) = [e for e in trainer.state.log_history if "aggregate_shift" in e]
    assert 0 <= log["byzantine_values_kept"] <= 4 * 2 and log["byzantine_over_bound"] == 0


def test_nonfinite_attack_never_reaches_the_weights(tmp_path):
    for rule in ("cwtm", "median", "krum", "mean"):
        _, trainer = _honest_loss_change(tmp_path, rule, "nonfinite")
        logs = [e for e in trainer.state.log_history if "nonfinite_values" in e]
        assert sum(e["nonfinite_values"] for e in logs) == 80 * 4 * 2


def test_label_flipping_changes_only_byzantine_labels(tmp_path):
    rows = torch.tensor([True] * 4 + [False] * 12)
    labels = torch.tensor([0, 1] * 8)
    flipped = flip_labels({"labels": labels}, rows, 2)["labels"]
    assert flipped[:4].tolist() == [1, 0, 1, 0] and torch.equal(flipped[4:], labels[4:])


def test_label_flipping_poisons_the_byzantine_reports_only(tmp_path):
    """Same seed with and without LF: round 0's honest loss is the same (honest data untouched), the
    aggregate differs (the Byzantine client's report was computed on flipped labels), and over training
    the flipped client slows the mean's progress on the honest loss."""
    runs = {}
    for attack in ("none", "lf"):
        torch.manual_seed(0)
        model = LogisticRegression()
        trainer = make_trainer(model, VectorDataset(256), tmp_path / attack, num_clients=4, num_byzantine=1,
                               attack=attack, attack_kwargs={"num_classes": 2} if attack == "lf" else {},
                               max_steps=40, learning_rate=0.2, num_perturbations=4, per_device_train_batch_size=16,
                               logging_steps=1)
        trainer.train()
        runs[attack] = (trainer, dataset_loss(model, VectorDataset(256)))
    clean, poisoned = runs["none"][0], runs["lf"][0]
    assert clean.state.log_history[0]["loss"] == poisoned.state.log_history[0]["loss"]
    assert clean.ledger.rounds[0]["seeds"] == poisoned.ledger.rounds[0]["seeds"]
    assert clean.ledger.rounds[0]["coefficients"] != poisoned.ledger.rounds[0]["coefficients"]
    assert runs["lf"][1] > runs["none"][1]


# ----- Fang et al. 2020 full-knowledge attacks ---------------------------------------------------


def test_fang_trim_draws_beyond_the_honest_range_against_the_honest_direction():
    # hbar = [5, -2] and per coordinate lo = [1, -6], hi = [9, 2]:
    #   coordinate 0: hbar > 0, lo = 1 > 0 -> U[1/2, 1];  coordinate 1: hbar < 0, hi = 2 > 0 -> U[2, 4]
    # negated honest vectors: hbar = [-5, 2], lo = [-9, -2], hi = [-1, 6]:
    #   coordinate 0: hbar < 0, hi = -1 <= 0 -> U[-1, -1/2]; coordinate 1: hbar > 0, lo = -2 <= 0 -> U[-4, -2]
    trim = build_attack("fang_trim")
    for honest, low, high in ((HONEST, [0.5, 2.0], [1.0, 4.0]), (-HONEST, [-1.0, -4.0], [-0.5, -2.0])):
        draws = torch.cat([trim(honest, torch.zeros(50, 2, dtype=torch.float64), MEAN, ctx(55, 50, (0, t, 1))).vectors
                           for t in range(4)])
        for j in range(2):
            assert low[j] <= draws[:, j].min() and draws[:, j].max() <= high[j]
            # uniform on the interval: both ends are approached, the clients draw their own values
            width = high[j] - low[j]
            assert draws[:, j].min() < low[j] + 0.05 * width and draws[:, j].max() > high[j] - 0.05 * width
            assert abs(draws[:, j].mean().item() - (low[j] + high[j]) / 2) < 0.1 * width
    once = trim(HONEST, OWN, MEAN, ctx(key=(3, 7, 1))).vectors
    assert torch.equal(once, trim(HONEST, OWN, MEAN, ctx(key=(3, 7, 1))).vectors)  # seeded by the round
    assert not torch.equal(once, trim(HONEST, OWN, MEAN, ctx(key=(3, 8, 1))).vectors)
    assert not torch.equal(once[0], once[1])
    wide = build_attack("fang_trim", b=4.0)(HONEST, torch.zeros(200, 2, dtype=torch.float64), MEAN, ctx(205, 200))
    assert 0.25 <= wide.vectors[:, 0].min() and wide.vectors[:, 0].min() < 0.4


def test_fang_trim_moves_the_trimmed_mean_against_the_honest_direction():
    g = torch.Generator().manual_seed(1)
    honest = torch.randn(30, 500, generator=g, dtype=torch.float64) + 0.3
    own = torch.zeros(10, 500, dtype=torch.float64)
    rule = Chain([], CWTM())
    attacked = build_attack("fang_trim")(honest, own, rule, ctx(40, 10)).vectors
    clean = rule(torch.cat([honest, own + honest.mean(0)]), ctx(40, 10)).value
    poisoned = rule(torch.cat([honest, attacked]), ctx(40, 10)).value
    hbar = honest.mean(0)
    # every coordinate of the trimmed mean moves toward the side opposite to sign(hbar)
    assert bool(((poisoned - clean) * torch.sign(hbar) < 0).all())


def _slow_krum_bound(honest, c):
    h, d = honest.shape
    m = h + c
    sums = []
    for i in range(h):
        dists = sorted(float((honest[l] - honest[i]).norm()) for l in range(h) if l != i)
        sums.append(sum(dists[: m - c - 2]))
    return min(sums) / ((m - 2 * c - 1) * d**0.5) + max(float(v.norm()) for v in honest) / d**0.5


@pytest.mark.parametrize("dim", [3, 64, 7850])  # R^nu and R^d alike
def test_fang_krum_takes_the_largest_halving_of_the_bound_that_krum_selects(dim):
    from zo_byzantine.aggregators import Krum

    g = torch.Generator().manual_seed(dim)
    honest = torch.randn(12, dim, generator=g, dtype=torch.float64) + 0.5
    own = torch.zeros(4, dim, dtype=torch.float64)
    bound = _slow_krum_bound(honest, 4)
    from zo_byzantine.attacks import FangKrum

    assert FangKrum.upper_bound(honest, 4) == pytest.approx(bound, rel=1e-12)
    out = build_attack("fang_krum")(honest, own, Chain([], Krum()), ctx(16, 4))
    lam = out.diagnostics["lambda"]
    assert out.diagnostics["crafted_selected"] == 1
    halvings = round(math.log2(bound / lam))
    assert lam == pytest.approx(bound / 2**halvings, rel=1e-12)
    crafted = -lam * torch.sign(honest.mean(0))
    assert torch.equal(out.vectors, crafted.expand(4, -1))

    def picked(vector):
        return torch.equal(Krum()(torch.cat([honest, vector.expand(4, -1)]), ctx(16, 4)).value, vector)

    assert picked(crafted)
    if halvings:  # the previous (twice larger) lambda is not selected: the loop would have stopped there
        assert not picked(2 * crafted)


def test_fang_krum_gives_up_below_the_threshold_when_nothing_selects_it():
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(12, 8, generator=g, dtype=torch.float64)
    out = build_attack("fang_krum", threshold=1e-3)(honest, torch.zeros(4, 8, dtype=torch.float64), MEAN, ctx(16, 4))
    assert out.diagnostics["crafted_selected"] == 0 and 1e-3 <= out.diagnostics["lambda"] < 2e-3


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("fang_trim", {"b": 0.5}, "fang_trim: b=0.5 must be a finite number >= 1"),
    ("fang_trim", {"b": float("nan")}, "fang_trim: b=nan"),
    ("fang_krum", {"threshold": 0.0}, "fang_krum: threshold=0.0 must be a finite number > 0"),
])
def test_fang_attacks_refuse_bad_parameters(name, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_attack(name, **kwargs)


def test_fang_krum_defeats_first_order_krum_end_to_end(tmp_path):
    """FedAvg with Krum in R^d (8 clients, 2 Byzantine, d = 18): the attack's own count of rounds where its crafted
    gradient is selected equals Krum's count of Byzantine selections, most rounds, and the honest loss ends higher
    than without the attack; on R^nu vectors the same attack runs and logs lambda."""
    losses = {}
    for attack in ("none", "fang_krum"):
        torch.manual_seed(0)
        model = LogisticRegression()
        trainer = make_trainer(model, VectorDataset(256), tmp_path / attack, num_clients=8, num_byzantine=2,
                               estimator="first_order", aggregator="krum", attack=attack, max_steps=40,
                               logging_steps=40, learning_rate=0.2, per_device_train_batch_size=16)
        trainer.train()
        losses[attack] = dataset_loss(model, VectorDataset(256))
    (log,) = [e for e in trainer.state.log_history if "attack_lambda" in e]
    assert 20 < log["crafted_selected"] == log["byzantine_selected"] and log["attack_lambda"] > 0
    assert losses["fang_krum"] > losses["none"] + 0.05
    _, trainer = _honest_loss_change(tmp_path / "zo", "krum", "fang_krum")
    (log,) = [e for e in trainer.state.log_history if "attack_lambda" in e]
    assert 0 < log["crafted_selected"] == log["byzantine_selected"] and log["attack_lambda"] > 0
