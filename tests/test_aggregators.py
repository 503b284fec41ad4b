"""Every rule on hand-computed examples, and properties with hypothesis."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from zo_byzantine.aggregators import (
    CWTM,
    NNM,
    Bucketing,
    CClip,
    Chain,
    Clip,
    GeoMed,
    Krum,
    Mean,
    Median,
    MultiKrum,
    _pairwise_sq_distances,
    build_aggregator,
    register_aggregator,
)
from zo_byzantine.rounds import sanitize

T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731


def test_cwtm_counter_example_is_outside_the_span_of_the_inputs():
    inputs = T([[2, 2, 0], [0, -1, -1], [4, 0, -4]])
    out = CWTM(3, 1)(inputs)
    assert out.tolist() == [2.0, 0.0, -1.0]
    # least squares in the span of the inputs leaves a residual: [2, 0, -1] is not a combination of them
    coeffs = torch.linalg.lstsq(inputs.T, out[:, None]).solution
    assert float((inputs.T @ coeffs - out[:, None]).norm()) > 1e-3
    assert torch.linalg.matrix_rank(inputs) == 2


def test_hand_computed_examples():
    v = T([[1, 10], [2, 20], [3, 30], [4, 40], [100, -100]])
    assert Mean()(v).tolist() == [22.0, 0.0]
    assert CWTM(5, 1)(v).tolist() == [3.0, 20.0]  # drops 1 and 100; drops -100 and 40
    assert Median()(v).tolist() == [3.0, 20.0]
    assert Median()(v[:4]).tolist() == [2.5, 25.0]
    # Krum, f = 1: each score sums squared distances to the n - f - 2 = 2 nearest others
    w = T([[0.0], [1.0], [3.0], [4.0], [10.0], [11.0]])  # scores: 0:1+9 1:1+4 2:1+4 3:1+9 4:1+36 5:1+49
    assert Krum(6, 1)(w).tolist() == [1.0]
    assert MultiKrum(6, 1, m=2)(w).tolist() == [2.0]  # clients 1 and 2
    assert Krum(6, 1, squared=False)(w).tolist() == [1.0]  # 1+2 = 3 for clients 1 and 2; first wins


def test_geomed_of_collinear_points_and_cclip():
    points = T([[0.0], [1.0], [2.0], [3.0], [100.0]])
    assert GeoMed(max_iter=1000, tol=1e-12)(points).item() == pytest.approx(2.0, abs=1e-4)
    square = T([[1, 1], [1, -1], [-1, 1], [-1, -1]])
    assert torch.allclose(GeoMed()(square), torch.zeros(2, dtype=torch.float64), atol=1e-9)
    # cclip from the median 0: one step moves by the mean of clipped differences
    v = T([[0.0], [0.0], [0.0], [10.0]])
    assert CClip(tau=1.0, iters=1)(v).item() == pytest.approx(0.25)


def test_pre_aggregation_steps():
    v = T([[0.0], [1.0], [2.0], [10.0]])
    assert NNM(4, 1)(v).squeeze(1).tolist() == [1.0, 1.0, 1.0, 13 / 3]  # mean of the 3 nearest
    torch.testing.assert_close(Clip(c=2.0)(T([[3.0, 4.0], [0.6, 0.8]])), T([[1.2, 1.6], [0.6, 0.8]]))
    buckets = Bucketing(4, 1, s=2)
    buckets.set_round((1, 2, 3))
    out = buckets(v)
    assert out.shape == (2, 1) and sorted(out.sum(0).tolist()) == [13 / 2]
    buckets.set_round((1, 2, 3))
    assert torch.equal(buckets(v), out)


def test_distances_and_nnm_match_direct_differences():
    """The Gram-matrix distances and the product form of NNM against the obvious loops."""
    g = torch.Generator().manual_seed(3)
    v = torch.randn(12, 40, generator=g)
    v[0] += 5.0  # a common offset for one client
    v[3] = 3e38  # a sanitised Byzantine row (FLOAT32_MAX-sized) must not blur the others' distances
    wide = v.double()
    direct = torch.stack([((wide - wide[i]) ** 2).sum(dim=1) for i in range(len(v))])
    honest = [i for i in range(12) if i != 3]
    got = _pairwise_sq_distances(v).double()
    torch.testing.assert_close(got[honest][:, honest], direct[honest][:, honest], rtol=1e-6, atol=0)
    assert torch.isinf(got[3, honest]).all() and (got.diagonal() == 0).all()
    w = torch.randn(12, 40, dtype=torch.float64, generator=g)
    dist = torch.stack([((w - w[i]) ** 2).sum(dim=1) for i in range(len(w))])
    slow = torch.stack([w[dist[i].argsort(stable=True)[:9]].mean(dim=0) for i in range(len(w))])
    torch.testing.assert_close(NNM(12, 3)(w), slow)


def test_chain_is_a_rule_and_validates_the_rule_against_what_steps_leave():
    rule = build_aggregator("cwtm", 12, 3, ["nnm", "clip:c=5"])
    assert isinstance(rule, Chain) and rule.rule.trim == 3
    manual = CWTM(12, 3)(
        Clip(c=5.0)(NNM(12, 3)(torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))))
    )
    assert torch.equal(
        rule(torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))), manual
    )
    with pytest.raises(ValueError, match=r"krum: f=2 needs n > 2f \+ 2 = 6 \(n=4, b=2\)"):
        build_aggregator("krum", 8, 2, ["bucketing:s=2"])


def test_registry_accepts_user_rules_and_lists_known_names():
    @register_aggregator("first_client")
    class First:
        def __init__(self, num_clients, num_byzantine):
            pass

        def __call__(self, vectors):
            return vectors[0]

    assert build_aggregator("first_client", 4, 1)(T([[7.0], [1.0]])).tolist() == [7.0]
    with pytest.raises(ValueError, match="Unknown aggregator 'nope'; known: cclip, cwtm, first_client"):
        build_aggregator("nope", 4, 1)


RULES = {
    "mean": lambda n, b: Mean(),
    "cwtm": lambda n, b: CWTM(n, b),
    "median": lambda n, b: Median(),
    "krum": lambda n, b: Krum(n, b),
    "multikrum": lambda n, b: MultiKrum(n, b),
    "geomed": lambda n, b: GeoMed(tol=1e-12, max_iter=500),
    "cclip": lambda n, b: CClip(tau=1.0),
}

finite = st.floats(-100, 100, allow_nan=False, width=64)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(RULES)))
def test_permutation_invariance(data, name):
    n, nu = data.draw(st.integers(7, 10)), data.draw(st.integers(1, 4))
    # distinct, well-separated values so that ties cannot make the result order-dependent
    v = data.draw(arrays(np.float64, (n, nu), elements=finite, unique=True))
    perm = data.draw(st.permutations(range(n)))
    rule = RULES[name](n, 2)
    a, b = rule(torch.tensor(v)), rule(torch.tensor(v[list(perm)]))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(["mean", "cwtm", "median", "krum", "geomed"]))
def test_translation_equivariance(data, name):
    n, nu = data.draw(st.integers(7, 10)), data.draw(st.integers(1, 4))
    v = torch.tensor(data.draw(arrays(np.float64, (n, nu), elements=finite, unique=True)))
    shift = torch.tensor(data.draw(arrays(np.float64, (nu,), elements=finite)))
    rule = RULES[name](n, 2)
    torch.testing.assert_close(rule(v + shift), rule(v) + shift, rtol=1e-6, atol=1e-5)


byzantine_value = st.sampled_from([1e30, -1e30, float("inf"), float("-inf"), float("nan"), 5e3])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), name=st.sampled_from(["cwtm", "median"]))
def test_cwtm_and_median_stay_in_the_honest_range(data, name):
    n = data.draw(st.integers(5, 11))
    b = (n - 1) // 2
    nu = data.draw(st.integers(1, 3))
    honest = torch.tensor(data.draw(arrays(np.float64, (n - b, nu), elements=finite)))
    bad = torch.tensor([[data.draw(byzantine_value) for _ in range(nu)] for _ in range(b)], dtype=torch.float64)
    vectors, _ = sanitize(torch.cat([bad, honest]))
    out = RULES[name](n, b)(vectors)
    assert (out >= honest.min(0).values - 1e-9).all() and (out <= honest.max(0).values + 1e-9).all()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_krum_returns_an_honest_vector_when_byzantine_ones_are_far(data):
    n = data.draw(st.integers(7, 12))
    b = (n - 3) // 2
    nu = data.draw(st.integers(1, 3))
    honest = torch.tensor(data.draw(arrays(np.float64, (n - b, nu), elements=st.floats(-1, 1, width=64))))
    bad = torch.full((b, nu), 1e6, dtype=torch.float64) + torch.arange(b, dtype=torch.float64)[:, None]
    out = Krum(n, b)(torch.cat([bad, honest]))
    assert any(torch.equal(out, h) for h in honest)
