"""Byzantine robustness: every robust rule and chain keeps a finite output within the bound documented in
``zo_byzantine/aggregators.py``, whatever the (sanitised) values of up to ``f`` Byzantine rows.

Notation as there: honest rows ``H`` (``h = m - f`` of them, from [-100, 100]), their mean ``hbar``, radius
``R = max_H ||v - hbar||``, diameter ``D``, per-coordinate range ``[lo, hi]``, ``w = max(hi - hbar, hbar - lo)``.
The counts of rule x attack-value combinations tried, and of outputs outside the bound, are printed at the
end of the module (``pytest -s`` shows them).
"""

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zo_byzantine.aggregators import NNM, Bucketing, Clip, GeoMed, Krum, _pairwise_sq_distances, build_aggregator
from zo_byzantine.context import RoundContext, SizingError
from zo_byzantine.server import sanitize

FLOAT32_MAX = 3.4028234663852886e38
NAN, INF = float("nan"), float("inf")
ATTACKS = {
    "nan": NAN, "+inf": INF, "-inf": -INF, "+f32max": FLOAT32_MAX, "-f32max": -FLOAT32_MAX,
    "+1e66": 1e66, "-1e66": -1e66, "+1e300": 1e300, "-1e300": -1e300,
    "+f64max": 1.7976931348623157e308, "-f64max": -1.7976931348623157e308,  # finite: a client may send them
    "honest-looking": None,
}
HONEST = st.floats(-100, 100, allow_nan=False, width=64)

RULES = {  # label -> (name, kwargs)
    "cwtm": ("cwtm", {}), "median": ("median", {}), "krum": ("krum", {}),
    "krum(plain)": ("krum", {"squared": False}), "multikrum": ("multikrum", {}), "geomed": ("geomed", {}),
    "cclip": ("cclip", {}),
}
CLIP_C = 50.0
STEPS = {"": [], "nnm+": ["nnm"], "clip+": [f"clip:c={CLIP_C}"], "bucketing+": ["bucketing:s=2"]}
TARGETS = [(prefix + label, steps, *RULES[label]) for prefix, steps in STEPS.items() for label in RULES]

TRIED, OUTSIDE, EXAMPLES = Counter(), Counter(), Counter()


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: worker threads only add overhead (and contend on a busy machine)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
    attacks = list(ATTACKS)
    print("\n\nrobustness: rule x attack value: examples containing the value (outputs outside the bound)")
    print(f"{'target':<24}{'examples':>9}" + "".join(f"{a[:10]:>11}" for a in attacks))
    for target, *_ in TARGETS:
        if EXAMPLES[target]:
            cells = "".join(f"{f'{TRIED[target, a]}({OUTSIDE[target, a]})':>11}" for a in attacks)
            print(f"{target:<24}{EXAMPLES[target]:>9}{cells}")
    combos = sum(1 for key in TRIED if TRIED[key])
    print(f"total: {sum(EXAMPLES.values())} examples, {combos} rule x attack-value combinations tried, "
          f"{sum(TRIED.values())} (example, value) pairs, {sum(OUTSIDE.values())} outside the bound")


def max_byzantine(rule, m: int) -> int:
    """The largest ``f`` the rule accepts for ``m`` vectors (-1 if none)."""
    f = -1
    while f + 1 < m:
        try:
            rule.check(m, f + 1)
        except SizingError:
            break
        f += 1
    return f


@dataclass
class Honest:
    """Where the honest vectors the rule receives lie: ``B(centre, radius)``, diameter, box ``[lo, hi]``."""

    centre: torch.Tensor
    radius: float
    diameter: float
    lo: torch.Tensor
    hi: torch.Tensor

    @classmethod
    def of(cls, rows: torch.Tensor) -> "Honest":
        rows = rows.double()
        centre = rows.mean(dim=0)
        diameter = float(torch.cdist(rows, rows).max())
        return cls(centre, float((rows - centre).norm(dim=1).max()), diameter, rows.min(0).values, rows.max(0).values)

    def spread(self) -> float:
        """``||w||``: how far a point of the box can be from the centre."""
        return float(torch.maximum(self.hi - self.centre, self.centre - self.lo).abs().norm())


def after_steps(steps, honest_rows: torch.Tensor, m: int, f: int) -> tuple[Honest, int]:
    """The honest description and the number of vectors the rule receives after the (single) step."""
    if not steps:
        return Honest.of(honest_rows), m
    (step,) = steps
    if step.startswith("clip"):  # per row: the clipped honest rows are known exactly
        return Honest.of(Clip(c=CLIP_C)(honest_rows, RoundContext((0, 0, 1), len(honest_rows), 0))), m
    base = Honest.of(honest_rows)
    if step.startswith("bucketing"):  # clean buckets lie in the honest hull
        return base, math.ceil(m / 2)
    e = f * base.diameter / (m - f)  # nnm: B(hbar, R + f D / (m - f)), box widened by f D / (m - f)
    radius = base.radius + e
    return Honest(base.centre, radius, 2 * radius, base.lo - e, base.hi + e), m


def bound(rule, name: str, kwargs: dict, honest: Honest, m: int, f: int) -> float:
    """The documented bound on ``||out - centre||`` (the box rules return nan: checked against the box)."""
    if name in ("cwtm", "median"):
        return NAN
    if name in ("krum", "multikrum"):
        k = m - f - 2
        return honest.radius + (math.sqrt(k) if kwargs.get("squared", True) else k) * honest.diameter
    if name == "geomed":
        return max(honest.spread(), rule.eps, honest.radius * m / (m - 2 * f))
    if name == "cclip":
        return honest.spread() + rule.iters * rule.tau
    raise AssertionError(name)


@st.composite
def scenario(draw, rule):
    m_min = next(m for m in range(1, 64) if max_byzantine(rule, m) >= 1)
    m = draw(st.integers(m_min, m_min + 8))
    f = max_byzantine(rule, m)
    nu = draw(st.integers(1, 4))
    honest = [[draw(HONEST) for _ in range(nu)] for _ in range(m - f)]
    labels, byzantine = set(), []
    for _ in range(f):
        row = []
        for _ in range(nu):
            label = draw(st.sampled_from(list(ATTACKS)))
            labels.add(label)
            row.append(draw(HONEST) if ATTACKS[label] is None else ATTACKS[label])
        byzantine.append(row)
    if draw(st.booleans()):  # colluding clients send the same vector
        byzantine = [byzantine[0]] * f
    order = draw(st.permutations(range(m)))
    dtype = draw(st.sampled_from([torch.float64, torch.float64, torch.float64, torch.float32]))
    return m, f, honest, byzantine, order, dtype, labels


def run(target, steps, name, kwargs, rule, m, f, honest, byzantine, order, dtype):
    honest_t = torch.tensor(honest, dtype=torch.float64).to(dtype)  # the honest rows as the rule sees them
    stacked = torch.cat([honest_t.double(), torch.tensor(byzantine, dtype=torch.float64)])[list(order)]
    vectors, _ = sanitize(stacked.to(dtype))  # float32: values beyond its range become inf, then its max
    out = rule(vectors, RoundContext((0, 0, 1), m, f)).value.double()
    description, m_rule = after_steps(steps, honest_t, m, f)
    limit = bound(rule.rule, name, kwargs, description, m_rule, f)
    scale = 1.0 + float(description.centre.abs().max()) + (0.0 if math.isnan(limit) else limit)
    slack = (1e-9 if dtype == torch.float64 else 1e-5) * scale
    if math.isnan(limit):
        inside = bool((out >= description.lo - slack).all() and (out <= description.hi + slack).all())
        where = f"box [{description.lo.tolist()}, {description.hi.tolist()}]"
    else:
        inside = float((out - description.centre).norm()) <= limit + slack
        where = f"||out - centre|| = {float((out - description.centre).norm()):.6g} > {limit:.6g}"
    return bool(torch.isfinite(out).all()) and inside, f"{target}: m={m} f={f} out={out.tolist()} {where}"


@pytest.mark.parametrize(("target", "steps", "name", "kwargs"), TARGETS, ids=[t[0] for t in TARGETS])
def test_output_is_finite_and_within_the_documented_bound(target, steps, name, kwargs):
    rule = build_aggregator(name, steps, **kwargs)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def check(data):
        m, f, honest, byzantine, order, dtype, labels = data.draw(scenario(rule))
        ok, message = run(target, steps, name, kwargs, rule, m, f, honest, byzantine, order, dtype)
        EXAMPLES[target] += 1
        for label in labels:
            TRIED[target, label] += 1
            OUTSIDE[target, label] += not ok
        assert ok, message

    check()


def ctx(m, f):
    return RoundContext((0, 0, 1), m, f)


def test_geomed_ignores_a_huge_finite_byzantine_value():
    points = torch.tensor([[0.1], [0.2], [0.15], [0.12], [1e66]], dtype=torch.float64)
    out = GeoMed()(points, ctx(5, 1)).value.item()
    assert 0.1 <= out <= 0.2
    for huge in (1e75, 1e150, 1e300, FLOAT32_MAX, -1e300):
        points[4, 0] = huge
        assert 0.1 <= GeoMed()(points, ctx(5, 1)).value.item() <= 0.2


def test_geomed_leaves_a_start_on_a_data_point_that_is_not_the_median():
    points = torch.tensor([[5.0, 2.0], [5.0, 5.0], [3.0, 1.0], [5.0, 4.0], [-4.0, 1.0]], dtype=torch.float64)
    start = torch.tensor([5.0, 2.0], dtype=torch.float64)  # the coordinate median (f = 2): the first point
    objective = lambda z: float((points - z).norm(dim=1).sum())  # noqa: E731
    reference = GeoMed(max_iter=20000, tol=0)(points, ctx(5, 0)).value  # from the mean
    out = GeoMed()(points, ctx(5, 2)).value
    assert objective(start) > objective(reference) + 0.5  # stuck there, the iterations would be far off
    assert objective(out) <= objective(reference) + 1e-6


def test_distances_are_never_nan_and_huge_rows_are_far():
    v = torch.tensor([[1e300, -1e300], [1e300, -1e300], [1.0, 2.0], [2.0, 3.0], [1.7e308, 1.7e308]],
                     dtype=torch.float64)
    dist = _pairwise_sq_distances(v)
    assert not dist.isnan().any() and dist[0, 1] == 0 and dist[2, 3] == 2
    assert torch.isinf(dist[:2, 2:]).all() and torch.isinf(dist[4, :4]).all()
    # Krum: NaN scores of the two huge rows would win argmin; they are inf instead
    w = torch.cat([v[:2], torch.tensor([[1.0, 2.0], [2.0, 3.0], [3.0, 3.0], [0.0, 0.0], [1.0, 1.0]],
                                       dtype=torch.float64)])
    assert Krum()(w, ctx(7, 2)).value.abs().max() <= 3


def test_steps_do_not_overflow_in_float32():
    big = FLOAT32_MAX
    v = torch.tensor([[big, big], [big, big], [big, -big], [1.0, 2.0], [2.0, 3.0]], dtype=torch.float32)
    mixed = NNM()(v, ctx(5, 3))  # two neighbours: the sums of +max rows overflow a plain float32 product
    assert torch.isfinite(mixed).all()
    buckets = Bucketing(s=3)(torch.cat([v[:2], v[:2], v[3:]]), ctx(6, 1))
    assert torch.isfinite(buckets).all()
    clipped = Clip(c=2.0)(torch.tensor([[1e300, 1e300], [3.0, 4.0]], dtype=torch.float64), ctx(2, 0))
    torch.testing.assert_close(clipped.norm(dim=1), torch.tensor([2.0, 2.0], dtype=torch.float64))
