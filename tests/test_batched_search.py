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
