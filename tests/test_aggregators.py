"""Every rule on hand-computed examples, and properties with hypothesis."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from zo_byzantine.aggregators import (
    AGGREGATORS,
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
    Rule,
    _pairwise_sq_distances,
    build_aggregator,
    register_aggregator,
)
from zo_byzantine.context import Aggregation, RoundContext, SizingError
from zo_byzantine.server import sanitize

T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731


def ctx(m: int, f: int = 0, byzantine=None, key=(0, 0, 1)) -> RoundContext:
    return RoundContext(key, m, f, None if byzantine is None else torch.tensor(byzantine))


def agg(rule, vectors, f=0, **kwargs):
    """The aggregate of ``rule`` on ``vectors`` with ``f`` Byzantine tolerated."""
    return rule(vectors, ctx(len(vectors), f, **kwargs)).value


def test_cwtm_counter_example_is_outside_the_span_of_the_inputs():
    inputs = T([[2, 2, 0], [0, -1, -1], [4, 0, -4]])
    out = agg(CWTM(), inputs, 1)
    assert out.tolist() == [2.0, 0.0, -1.0]
    # least squares in the span of the inputs leaves a residual: [2, 0, -1] is not a combination of them
    coeffs = torch.linalg.lstsq(inputs.T, out[:, None]).solution
    assert float((inputs.T @ coeffs - out[:, None]).norm()) > 1e-3
    assert torch.linalg.matrix_rank(inputs) == 2


def test_hand_computed_examples():
    v = T([[1, 10], [2, 20], [3, 30], [4, 40], [100, -100]])
    assert agg(Mean(), v).tolist() == [22.0, 0.0]
    assert agg(CWTM(), v, 1).tolist() == [3.0, 20.0]  # drops 1 and 100; drops -100 and 40
    assert agg(Median(), v, 1).tolist() == [3.0, 20.0]
    assert agg(Median(), v[:4], 1).tolist() == [2.5, 25.0]
    # Krum, f = 1: each score sums squared distances to the n - f - 2 = 2 nearest others
    w = T([[0.0], [1.0], [3.0], [4.0], [10.0], [11.0]])  # scores: 0:1+9 1:1+4 2:1+4 3:1+9 4:1+36 5:1+49
    assert agg(Krum(), w, 1).tolist() == [1.0]
    assert agg(MultiKrum(m=2), w, 1).tolist() == [2.0]  # clients 1 and 2
    assert agg(Krum(squared=False), w, 1).tolist() == [1.0]  # 1+2 = 3 for clients 1 and 2; first wins
    # the diagnostics say which values of the Byzantine rows survived, from the call's own result
    cwtm = CWTM()(v, ctx(5, 1, [False, False, False, False, True]))
    assert cwtm.diagnostics == {"byzantine_values_kept": 0}
    cwtm = CWTM()(v, ctx(5, 1, [False, False, True, False, False]))
    assert cwtm.diagnostics == {"byzantine_values_kept": 2}  # client 2 holds both medians
    assert Krum()(w, ctx(6, 1, [False, True, False, False, False, False])).diagnostics == {"byzantine_selected": 1}


def test_geomed_of_collinear_points_and_cclip():
    points = T([[0.0], [1.0], [2.0], [3.0], [100.0]])
    assert agg(GeoMed(max_iter=1000, tol=1e-12), points, 1).item() == pytest.approx(2.0, abs=1e-4)
    square = T([[1, 1], [1, -1], [-1, 1], [-1, -1]])
    assert torch.allclose(agg(GeoMed(), square, 1), torch.zeros(2, dtype=torch.float64), atol=1e-9)
    # cclip from the median 0: one step moves by the mean of clipped differences
    v = T([[0.0], [0.0], [0.0], [10.0]])
    assert agg(CClip(tau=1.0, iters=1), v, 1).item() == pytest.approx(0.25)


def test_pre_aggregation_steps():
    v = T([[0.0], [1.0], [2.0], [10.0]])
    assert NNM()(v, ctx(4, 1)).squeeze(1).tolist() == [1.0, 1.0, 1.0, 13 / 3]  # mean of the 3 nearest
    torch.testing.assert_close(Clip(c=2.0)(T([[3.0, 4.0], [0.6, 0.8]]), ctx(2)), T([[1.2, 1.6], [0.6, 0.8]]))
    buckets = Bucketing(s=2)
    out = buckets(v, ctx(4, 1, key=(1, 2, 3)))
    assert out.shape == (2, 1) and sorted(out.sum(0).tolist()) == [13 / 2]
    assert torch.equal(buckets(v, ctx(4, 1, key=(1, 2, 3))), out)  # the round key seeds the shuffle
    orders = {tuple(buckets(T([[float(i)] for i in range(8)]), ctx(8, 1, key=(1, t, 1))).squeeze(1).tolist())
              for t in range(6)}
    assert len(orders) > 1


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
    torch.testing.assert_close(NNM()(w, ctx(12, 3)), slow)


def test_chain_is_a_rule_and_validates_the_rule_against_what_steps_leave():
    rule = build_aggregator("cwtm", ["nnm", "clip:c=5"])
    assert isinstance(rule, Chain) and rule.name == "nnm+clip+cwtm"
    v = torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    manual = agg(CWTM(), Clip(c=5.0)(NNM()(v, ctx(12, 3)), ctx(12, 3)), 3)
    assert torch.equal(agg(rule, v, 3), manual)
    with pytest.raises(SizingError, match=r"krum: needs m > 2f \+ 2 = 6 \(m=4 vectors, f=2 Byzantine\)"):
        build_aggregator("krum", ["bucketing:s=2"]).check(8, 2)
    # the rule's diagnostics survive a row-preserving step (NNM), not a mixing one (bucketing)
    mask = [True, True, True] + [False] * 9
    assert "byzantine_values_kept" in rule(v, ctx(12, 3, mask)).diagnostics
    assert build_aggregator("cwtm", ["bucketing:s=2"])(v, ctx(12, 1, mask)).diagnostics == {}


@pytest.mark.parametrize(
    ("name", "kwargs", "m", "f"),
    [("cwtm", {}, 6, 3), ("median", {}, 4, 2), ("krum", {}, 6, 2), ("multikrum", {}, 5, 2), ("geomed", {}, 2, 1),
     ("cclip", {}, 2, 1), ("multikrum", {"m": 9}, 8, 1)],
)
def test_every_rule_checks_its_sizing_at_call_time(name, kwargs, m, f):
    rule = build_aggregator(name, **kwargs)
    with pytest.raises(SizingError, match=rf"{name}: .*\(m={m} vectors, f={f} Byzantine\)"):
        rule(torch.zeros(m, 2, dtype=torch.float64), ctx(m, f))
    rule(torch.zeros(m + 3, 2, dtype=torch.float64), ctx(m + 3, f))  # three more vectors: it holds
    with pytest.raises(SizingError, match=r"nnm: averages m - f neighbours; needs f < m \(m=2 vectors, f=2"):
        build_aggregator("mean", ["nnm"])(torch.zeros(2, 1), ctx(2, 2))


def test_registry_accepts_user_rules_refuses_duplicates_and_lists_known_names():
    @register_aggregator("first_client")
    class First(Rule):
        name = "first_client"

        def aggregate(self, vectors, ctx):
            return Aggregation(vectors[0], {"seen": ctx.num_vectors})

    try:
        assert agg(build_aggregator("first_client"), T([[7.0], [1.0]])).tolist() == [7.0]
        with pytest.raises(ValueError, match="Unknown aggregator 'nope'; known: cclip, cwtm, first_client"):
            build_aggregator("nope")
        with pytest.raises(ValueError, match="aggregator 'first_client' is already registered"):
            register_aggregator("first_client")(Mean)
        register_aggregator("first_client", exist_ok=True)(First)
        with pytest.raises(ValueError, match=r"aggregator_kwargs: aggregator 'cwtm' does not take \['nope'\]"):
            build_aggregator("cwtm", nope=1)
    finally:
        AGGREGATORS.unregister("first_client")
    assert "first_client" not in AGGREGATORS


RULES = {
    "mean": Mean,
    "cwtm": CWTM,
    "median": Median,
    "krum": Krum,
    "multikrum": MultiKrum,
    "geomed": lambda: GeoMed(tol=1e-12, max_iter=500),
    "cclip": lambda: CClip(tau=1.0),
}

finite = st.floats(-100, 100, allow_nan=False, width=64)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(RULES)))
def test_permutation_invariance(data, name):
    n, nu = data.draw(st.integers(7, 10)), data.draw(st.integers(1, 4))
    # distinct, well-separated values so that ties cannot make the result order-dependent
    v = data.draw(arrays(np.float64, (n, nu), elements=finite, unique=True))
    perm = data.draw(st.permutations(range(n)))
    rule = RULES[name]()
    a, b = agg(rule, torch.tensor(v), 2), agg(rule, torch.tensor(v[list(perm)]), 2)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(["mean", "cwtm", "median", "krum", "geomed"]))
def test_translation_equivariance(data, name):
    n, nu = data.draw(st.integers(7, 10)), data.draw(st.integers(1, 4))
    v = torch.tensor(data.draw(arrays(np.float64, (n, nu), elements=finite, unique=True)))
    shift = torch.tensor(data.draw(arrays(np.float64, (nu,), elements=finite)))
    rule = RULES[name]()
    torch.testing.assert_close(agg(rule, v + shift, 2), agg(rule, v, 2) + shift, rtol=1e-6, atol=1e-5)


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
    out = agg(RULES[name](), vectors, b)
    assert (out >= honest.min(0).values - 1e-9).all() and (out <= honest.max(0).values + 1e-9).all()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_krum_returns_an_honest_vector_when_byzantine_ones_are_far(data):
    n = data.draw(st.integers(7, 12))
    b = (n - 3) // 2
    nu = data.draw(st.integers(1, 3))
    honest = torch.tensor(data.draw(arrays(np.float64, (n - b, nu), elements=st.floats(-1, 1, width=64))))
    bad = torch.full((b, nu), 1e6, dtype=torch.float64) + torch.arange(b, dtype=torch.float64)[:, None]
    out = agg(Krum(), torch.cat([bad, honest]), b)
    assert any(torch.equal(out, h) for h in honest)


@pytest.mark.parametrize("beta", [None, 0.0, 0.1, 0.45])
def test_cwtm_byzantine_values_kept_equals_the_stable_sort_count(beta):
    """The diagnostic's shortcut (values in ``[s_k, s_(m-k-1)]`` where no tie crosses a window end) counts what the
    stable sort's window holds: continuous values, copies straddling a window end, integer ties, NaN and inf."""
    g = torch.Generator().manual_seed(11)
    m, f = 20, 5
    for case in range(5):
        v = torch.randn(m, 300, generator=g, dtype=torch.float64)
        if case == 1:
            v[-f:] = v[:3].mean(0) + 0.3  # identical copies, around the upper window end in many columns
        if case == 2:
            v = v.mul(1.5).round()  # many ties
        if case == 3:
            v[-2:, ::7], v[0, ::5], v[-1, ::3] = float("nan"), float("inf"), -float("inf")
        if case == 4:
            v = v.float()
        mask = torch.zeros(m, dtype=torch.bool)
        mask[torch.randperm(m, generator=g)[:f]] = True
        rule = CWTM(beta)
        k = rule.trim(m, f)
        order = v.sort(dim=0, stable=True).indices
        expected = int(torch.zeros_like(v, dtype=torch.bool).scatter_(0, order[k : m - k], True)[mask].sum())
        assert rule(v, ctx(m, f, mask.tolist())).diagnostics == {"byzantine_values_kept": expected}
