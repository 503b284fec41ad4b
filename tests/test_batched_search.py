"""The attacker's omega search evaluates every candidate's vector set at once: each rule's batched value equals
its value set by set, and the search picks the omega a loop over the candidates picks."""

import math

import helpers  # noqa: F401  (puts benchmarks/ on the path)
import pytest
import torch
from omega_search import loop_search  # the search as a loop over the candidates: the reference

from zo_byzantine import build_aggregator, build_attack
from zo_byzantine.context import RoundContext

PIPELINES = [("mean", []), ("cwtm", []), ("median", []), ("cwtm", ["nnm"]), ("median", ["nnm"]), ("krum", []),
             ("mean", ["bucketing:s=2"]), ("median", ["clip:c=1.0"]), ("geomed", ["nnm"])]


def _sets(seed, c=7, m=12, d=9, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    sets = torch.randn(c, m, d, generator=g, dtype=dtype)
    sets[:, -3:] *= torch.logspace(0, 6, c, dtype=dtype)[:, None, None]  # far Byzantine rows, growing
    return sets


@pytest.mark.parametrize("rule, steps", PIPELINES)
def test_batched_rule_values_equal_one_set_at_a_time(rule, steps):
    chain = build_aggregator(rule, steps)
    ctx = RoundContext((0, 3, 1), 12, 3)
    for seed in range(3):
        sets = _sets(seed)
        expected = torch.stack([chain(v, ctx).value for v in sets])
        torch.testing.assert_close(chain.aggregate_many(sets, ctx), expected, rtol=1e-12, atol=1e-12)


def test_batched_nnm_keeps_the_overflow_handling_of_one_set():
    chain = build_aggregator("cwtm", ["nnm"])
    ctx = RoundContext((0, 0, 1), 6, 2)
    sets = torch.randn(3, 6, 4, dtype=torch.float64)
    sets[1, -1] = 1e200  # squared norm beyond float64: the one-set path's direct differences
    sets[2, -2:] = torch.finfo(torch.float64).max / 2  # their sum overflows in the mixing product
    expected = torch.stack([chain(v, ctx).value for v in sets])
    got = chain.aggregate_many(sets, ctx)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("rule, steps", PIPELINES)
@pytest.mark.parametrize("name", ["alie", "foe"])
def test_search_picks_the_loops_omega(rule, steps, name):
    chain = build_aggregator(rule, steps)
    attack = build_attack(name, omega="auto")
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        honest = torch.randn(9, 16, generator=g, dtype=torch.float64) + 0.5
        own = torch.randn(3, 16, generator=g, dtype=torch.float64)
        ctx = RoundContext((seed, 2, 1), 12, 3, torch.tensor([False] * 9 + [True] * 3))
        out = attack(honest, own, chain, ctx)
        assert out.diagnostics["omega"] == loop_search(attack, honest, own, chain, ctx)
        assert math.isfinite(out.diagnostics["omega"])


def _explicit(rule, honest, candidates, k, ctx):
    """The reference: each candidate's whole set (honest, then k copies), one at a time through the rule."""
    sets = [torch.cat([honest, c.expand(k, -1)]) for c in candidates]
    return torch.stack([rule(v, ctx).value for v in sets])


@pytest.mark.parametrize("rule, steps, kwargs", [("cwtm", [], {}), ("cwtm", [], {"beta": 0.3}), ("median", [], {}),
                                                  ("krum", [], {}), ("krum", [], {"squared": False}),
                                                  ("cwtm", ["nnm"], {}), ("median", ["nnm"], {}), ("krum", ["nnm"], {}),
                                                  ("cwtm", ["nnm", "clip:c=2.0"], {}), ("mean", ["bucketing"], {})])
@pytest.mark.parametrize("h, k, f", [(9, 3, 3), (30, 10, 10), (10, 10, 4), (2, 9, 5), (7, 1, 0), (8, 2, 2)])
def test_closed_form_for_copies_equals_the_sets(rule, steps, kwargs, h, k, f):
    """A pipeline's value on honest + k copies of each candidate, from one sort of the honest values (CWTM and the
    median alone) or from the sets (with steps), equals the pipeline on each explicit set: continuous values,
    integers with ties (copies equal to honest values) and candidates below, inside and above the honest range;
    more copies than honest vectors."""
    chain = build_aggregator(rule, steps, **kwargs)
    if rule == "krum" and (2 * f + 2 >= h + k or (steps and k >= h)):
        pytest.skip("krum needs m > 2f + 2; with k >= h NNM leaves every score equal up to rounding")
    ctx = RoundContext((0, 1, 1), h + k, f)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        honest = torch.randn(h, 11, generator=g, dtype=torch.float64)
        if seed == 1:
            honest = honest.mul(2).round()
        candidates = torch.cat([torch.linspace(-4, 4, 17, dtype=torch.float64)[:, None].expand(-1, 11),
                                torch.randn(5, 11, generator=g, dtype=torch.float64) * 3]).round(decimals=seed)
        got = chain.aggregate_repeated(honest, candidates, k, ctx)
        torch.testing.assert_close(got, _explicit(chain, honest, candidates, k, ctx), rtol=1e-12, atol=1e-12)
        assert got.dtype == candidates.dtype


@pytest.mark.parametrize("rule", ["cwtm", "median"])
def test_closed_form_falls_back_on_non_finite_values(rule):
    chain = build_aggregator(rule)
    ctx = RoundContext((0, 1, 1), 8, 2)
    honest = torch.randn(6, 5, dtype=torch.float64)
    candidates = torch.randn(4, 5, dtype=torch.float64)
    candidates[1, 2], honest[3, 0] = math.inf, -math.inf
    torch.testing.assert_close(chain.aggregate_repeated(honest, candidates, 2, ctx),
                               _explicit(chain, honest, candidates, 2, ctx), equal_nan=True)


def test_closed_form_float32_matches_the_sort_within_rounding():
    chain = build_aggregator("cwtm")
    ctx = RoundContext((0, 1, 1), 40, 10)
    g = torch.Generator().manual_seed(5)
    honest = torch.randn(30, 7850, generator=g)
    candidates = honest.mean(0) + torch.linspace(0, 10, 21)[:, None] * honest.std(0)
    got = chain.aggregate_repeated(honest, candidates, 10, ctx)
    torch.testing.assert_close(got, _explicit(chain, honest, candidates, 10, ctx), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("h, k, f", [(9, 3, 3), (30, 10, 10), (4, 6, 5), (7, 1, 0)])
def test_nnm_form_for_copies_equals_nnm_on_each_set(dtype, h, k, f):
    """NNM's linear form ``A_c @ honest + b_c c`` gives, for each candidate, NNM's rows of its explicit set: the
    honest rows, then the row every copy becomes (ties in integer data broken as NNM breaks them)."""
    from zo_byzantine.aggregators import NNM

    nnm, ctx = NNM(), RoundContext((0, 1, 1), h + k, f)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        honest = torch.randn(h, 6, generator=g, dtype=torch.float64)
        honest = (honest.mul(2).round() if seed == 1 else honest).to(dtype)
        candidates = torch.cat([torch.linspace(-3, 3, 13, dtype=dtype)[:, None].expand(-1, 6), honest[:2]])
        mixing, own = nnm.transform_repeated(honest, candidates, k, ctx)
        assert mixing.shape == (len(candidates), h + 1, h) and own.shape == (len(candidates), h + 1)
        got = mixing @ honest + own[..., None] * candidates[:, None, :]
        for c, candidate in enumerate(candidates):
            expected = nnm(torch.cat([honest, candidate.expand(k, -1)]), ctx)
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            torch.testing.assert_close(got[c], expected[: h + 1], rtol=tol, atol=tol)
            torch.testing.assert_close(got[c, h].expand(k, -1), expected[h:], rtol=tol, atol=tol)  # copies mix alike


def test_nnm_form_falls_back_to_the_sets_on_huge_or_non_finite_values():
    chain = build_aggregator("cwtm", ["nnm"])
    ctx = RoundContext((0, 1, 1), 8, 2)
    honest = torch.randn(6, 5, dtype=torch.float64)
    candidates = torch.randn(4, 5, dtype=torch.float64)
    candidates[1] = torch.finfo(torch.float64).max / 2  # distances overflow: direct differences, infinitely far
    candidates[2, 0] = 1e200  # squared norm beyond float64
    got = chain.aggregate_repeated(honest, candidates, 2, ctx)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _explicit(chain, honest, candidates, 2, ctx), rtol=1e-12, atol=0)
    candidates[3, 4] = math.nan
    assert chain.steps[0].transform_repeated(honest, candidates, 2, ctx) is None
    torch.testing.assert_close(chain.aggregate_repeated(honest, candidates, 2, ctx),
                               _explicit(chain, honest, candidates, 2, ctx), equal_nan=True)


@pytest.mark.parametrize("steps", [[], ["nnm"]])
def test_closed_form_falls_back_when_its_prefix_sums_overflow(steps):
    """Honest values near the float64 range: the closed form's prefix sums overflow (``inf - inf``); it then gives
    what the sets give (the window's mean overflows there too), not NaN."""
    chain = build_aggregator("cwtm", steps)
    ctx = RoundContext((0, 1, 1), 12, 3)
    g = torch.Generator().manual_seed(2)
    honest = torch.finfo(torch.float64).max / 4 * (1 + torch.rand(9, 4, generator=g, dtype=torch.float64))
    candidates = torch.cat([torch.randn(2, 4, generator=g, dtype=torch.float64),  # below: one range overflows
                            torch.finfo(torch.float64).max * torch.tensor([[0.6], [0.9]], dtype=torch.float64)
                            .expand(-1, 4)])  # above: two ranges overflow, inf - inf
    got = chain.aggregate_repeated(honest, candidates, 3, ctx)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _explicit(chain, honest, candidates, 3, ctx))
