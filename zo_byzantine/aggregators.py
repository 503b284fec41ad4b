"""Robust aggregation rules on the clients' vectors in R^nu (SPEC 2), sized at call time.

A rule is a :class:`Rule`: ``rule(vectors: Tensor[m, nu], ctx) -> Aggregation(value, diagnostics)``,
its hyperparameters checked in ``__init__``, and ``check(m, f)`` telling whether it can hold for ``m``
vectors of which ``f`` may be Byzantine (``ctx.num_vectors``, ``ctx.num_byzantine``; re-checked at every
call, so a rule built once works for any number of reports). A pre-aggregation step is a
:class:`PreAggregator`: ``step(vectors, ctx) -> Tensor[m', nu]``. :class:`Chain` composes steps and a
rule into a rule. Register with ``@register_aggregator("name")`` / ``@register_pre_aggregator("name")``.

Robustness bounds (documented per rule; ``tests/test_robustness.py`` checks them on sanitised, hence finite,
inputs): with ``h >= m - f`` honest vectors ``H`` and at most ``f`` Byzantine ones of any finite size,
``hbar`` the honest mean, ``R = max_H ||v - hbar||``, ``D`` the honest diameter, ``[lo, hi]`` the honest
per-coordinate range and ``w = max(hi - hbar, hbar - lo)`` (``||w|| <= sqrt(nu) R``), every rule's but the mean's
output stays within a distance of ``hbar`` (or a box) that depends on these only, never on the Byzantine
values; every output is finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import seeds
from .context import Aggregation, RoundContext, SizingError
from .ordering import argsort_stable, sort_values
from .registry import Registry
from .validation import check_bool, check_fraction, check_integer, check_real

AGGREGATORS = Registry("aggregator")
PRE_AGGREGATORS = Registry("pre_aggregator")
register_aggregator = AGGREGATORS.register
register_pre_aggregator = PRE_AGGREGATORS.register


def _sizing(name: str, message: str, m: int, f: int) -> SizingError:
    return SizingError(f"{name}: {message} (m={m} vectors, f={f} Byzantine).")


HUGE_SQ_NORM = torch.finfo(torch.float64).max / 4  # beyond, the Gram form may give inf - inf


def _gram_sq_distances(wide: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D, norms)`` of float64 vectors ``[..., m, d]``: ``D[i, j] = ||v_i||^2 + ||v_j||^2 - 2 <v_i, v_j>``,
    clamped at 0 (cancellation), 0 on the diagonal."""
    gram = wide @ wide.transpose(-1, -2)
    norms = gram.diagonal(dim1=-2, dim2=-1)
    dist = (norms[..., :, None] + norms[..., None, :] - 2 * gram).clamp_min_(0)
    dist.diagonal(dim1=-2, dim2=-1).fill_(0)
    return dist, norms


def _nearest_weights(dist: torch.Tensor, keep: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """NNM's weights (``[..., m, m]``): row i holds 1/keep at the ``keep`` vectors nearest v_i by ``dist`` (stable
    order: the first of equal distances), 0 elsewhere. Returns the weights and the neighbours' indices."""
    nearest = argsort_stable(dist, -1)[..., :keep]
    weights = torch.zeros(*dist.shape, dtype=dtype, device=dist.device)
    return weights.scatter_(-1, nearest, 1.0 / keep), nearest


def _mix_nearest(vectors: torch.Tensor, dist: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NNM's means as one product (``[..., m, d]``, :func:`_nearest_weights`). Returns the mixed vectors and the
    neighbours' indices."""
    weights, nearest = _nearest_weights(dist, keep, vectors.dtype)
    return weights @ vectors, nearest


def _distances_to_honest(honest: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Squared) distances among the ``h`` honest vectors (``h x h``) and from each candidate to them (``C x h``),
    from one :func:`_pairwise_sq_distances` of both (the candidates' own pairs unused)."""
    h = len(honest)
    dist = _pairwise_sq_distances(torch.cat([honest, candidates]))
    return dist[:h, :h], dist[h:, :h]


def _pairwise_sq_distances(vectors: torch.Tensor) -> torch.Tensor:
    """``D[i, j] = ||v_i||^2 + ||v_j||^2 - 2 <v_i, v_j>`` from one float64 Gram matrix.

    A matrix product, ~8x faster than direct differences at n = 40, d = 7,850. In float64 the
    cancellation error of ``D[i, j]`` is ~1e-16 (||v_i||^2 + ||v_j||^2): it involves rows i and j
    only (a huge Byzantine row does not blur the honest distances), and integer data stay exact
    (ties stay ties). A row whose ``||v_i||^2`` exceeds a quarter of the float64 range (entries of
    ~1e154 and more, where the Gram form could give ``inf - inf = nan``) gets its distances from direct
    differences instead: ``D`` is never NaN for finite input, ``inf`` only where the true value
    overflows. Returned in the input's dtype (distances beyond its range become ``inf``: far).
    """
    wide = vectors.double()
    dist, norms = _gram_sq_distances(wide)
    huge = ~(norms <= HUGE_SQ_NORM)  # also catches nan norms
    if bool(huge.any()):
        for i in huge.nonzero().flatten().tolist():
            row = (wide - wide[i]).square().sum(dim=1)
            dist[i], dist[:, i] = row, row
        dist.masked_fill_(dist.isnan(), math.inf)  # non-finite input only
    return dist.clamp_min_(0).fill_diagonal_(0).to(vectors.dtype)


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    """``||x_i||`` per row, as ``x.norm(dim=1)``; a row whose sum of squares overflows is rescaled by its
    largest entry (``s ||x_i / s||``), so a norm is ``inf`` only where the true norm exceeds the dtype."""
    norms = x.norm(dim=1)
    over = torch.isinf(norms)
    if bool(over.any()):
        rows = x[over]
        scale = rows.abs().amax(dim=1)
        rescaled = scale * (rows / scale[:, None]).norm(dim=1)
        norms[over] = torch.where(torch.isfinite(scale), rescaled, math.inf)
    return norms


def _clip_factors(x: torch.Tensor, c: float) -> torch.Tensor:
    """``min(1, c / ||x_i||)`` per row without overflow: rows with an overflowing norm use
    ``(c / s) / ||x_i / s||``, ``s`` their largest entry (so huge rows are clipped to norm c, not zeroed)."""
    norms = x.norm(dim=1)
    factors = (c / norms.clamp_min(1e-300)).clamp(max=1.0)
    over = torch.isinf(norms)
    if bool(over.any()):
        rows = x[over]
        scale = rows.abs().amax(dim=1)
        factors[over] = ((c / scale) / (rows / scale[:, None]).norm(dim=1)).clamp(max=1.0)
    return factors


def _rescaled_mean(rows: torch.Tensor) -> torch.Tensor:
    """Mean of finite rows whose plain mean overflowed: ``s mean(rows / s)``, ``s`` the largest entry,
    clamped to the dtype's range (where the exact mean lies)."""
    scale = rows.abs().amax().clamp_min(torch.finfo(rows.dtype).tiny)
    big = torch.finfo(rows.dtype).max
    return (scale * (rows / scale).mean(dim=0)).clamp(-big, big)


def _median_many(sets: torch.Tensor) -> torch.Tensor:
    """:func:`coordinate_median` of each set of ``C x m x d``."""
    ordered, m = sort_values(sets, 1), sets.shape[1]
    return ordered[:, m // 2] if m % 2 else (ordered[:, m // 2 - 1] + ordered[:, m // 2]) / 2


def coordinate_median(vectors: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the middle value (mean of the two middle values for even n)."""
    return _median_many(vectors[None])[0]


def _repeated_window_sums(honest: torch.Tensor, candidates: torch.Tensor, k: int, start: int, stop: int):
    """Per coordinate and candidate ``c`` (``C x d``), the sum of sorted positions ``[start, stop)`` of the ``h``
    honest values (``h x d``, or ``C x h x d``: each candidate's own) and ``k`` copies of ``c``: in the merged
    order positions ``p < r`` hold ``s_p``
    (``s`` the sorted honest values, ``r = #{s < c}``), ``[r, r + k)`` hold ``c``, later ones ``s_(p - k)``, so

        sum = (P[min(r, stop)] - P[start']) + k' c + (P[stop - k] - P[max(start, r + k) - k])   (P: prefix sums)

    with ``k'`` the copies inside the window and empty ranges counting 0 (each range summed apart, so candidates
    whose window holds the same honest values get the same bits). One sort of the honest values and a search per
    candidate, instead of a sort of ``h + k`` values per candidate. Float64 sums of finite inputs."""
    shared = honest.dim() == 2
    ordered = sort_values(honest.double().transpose(-1, -2), -1).contiguous()  # [d, h] or [C, d, h]: coordinate rows
    prefix = torch.cat([ordered.new_zeros(*ordered.shape[:-1], 1), ordered.cumsum(dim=-1)], dim=-1)
    values = (candidates.double().T if shared else candidates.double()[..., None]).contiguous()  # [d, C] or [C, d, 1]
    r = torch.searchsorted(ordered, values)

    def at(index):
        return prefix.gather(-1, index)

    before_end = r.clamp(max=stop)
    before_start = before_end.clamp(max=start)
    after_start = (r + k).clamp(min=start) - k
    after_end = torch.maximum(after_start, torch.full_like(r, stop - k))
    copies = ((r + k).clamp(max=stop) - r.clamp(min=start)).clamp(min=0)
    sums = (at(before_end) - at(before_start)) + copies * values + (at(after_end) - at(after_start))
    return sums.T.contiguous() if shared else sums[..., 0]


def _repeated_window_mean(rule, honest, candidates, k: int, ctx: RoundContext, window) -> torch.Tensor:
    """A coordinate-wise rule's value on ``honest`` plus ``k`` copies of each candidate: the mean of the sorted
    positions ``window(m) = (start, stop)`` (:func:`_repeated_window_sums`); non-finite inputs, and prefix sums that
    overflowed (values near the float64 range: ``inf - inf``), take the sets' path."""
    m = honest.shape[-2] + k
    rule.check(m, ctx.num_byzantine)
    if not _finite(honest, candidates):
        return Rule.aggregate_repeated(rule, honest, candidates, k, ctx)
    start, stop = window(m)
    means = _repeated_window_sums(honest, candidates, k, start, stop) / (stop - start)
    return means.to(candidates.dtype) if _finite(means) else Rule.aggregate_repeated(rule, honest, candidates, k, ctx)


def _kept_in_window(vectors: torch.Tensor, ordered: torch.Tensor, k: int, mask: torch.Tensor) -> int:
    """How many values of the rows in ``mask`` a stable sort of each column of ``vectors`` puts at positions
    ``[k, m - k)`` (``ordered``: the sorted columns). Where no value ties across a window end
    (``s_(k-1) < s_k`` and ``s_(m-k-1) < s_(m-k)``) those are the values in ``[s_k, s_(m-k-1)]``, one comparison;
    the other columns (ties, NaN; all when ``k = 0``) take the stable order itself, and all columns do when
    most are tied (e.g. an attacker's identical copies across a window end: a subset would only add a copy)."""
    m, mask = len(vectors), mask.to(vectors.device)
    clean = torch.zeros(vectors.shape[1:], dtype=torch.bool, device=vectors.device)
    if 0 < k < m - k:
        clean = (ordered[k - 1] < ordered[k]) & (ordered[m - k - 1] < ordered[m - k])
    if 2 * int(clean.sum()) < clean.numel():
        clean.fill_(False)
    own = vectors[mask]
    kept = int(((own >= ordered[k]) & (own <= ordered[m - k - 1]) & clean).sum()) if k < m - k else 0
    if not bool(clean.all()):
        tied = vectors[:, ~clean] if bool(clean.any()) else vectors
        window = torch.zeros_like(tied, dtype=torch.bool).scatter_(0, argsort_stable(tied, 0)[k : m - k], True)
        kept += int(window[mask].sum())
    return kept


def _candidate_groups(count: int, per_set: int, budget: int = 4 << 20):
    """Slices of ``count`` candidates, each at most ``budget`` bytes of sets of ``per_set`` bytes (at least one)."""
    group = max(1, budget // max(1, per_set))
    return [slice(start, start + group) for start in range(0, count, group)]


def _finite(*tensors: torch.Tensor) -> bool:
    """Every value finite: a finite sum says so at the cost of a sum (inf, -inf and nan propagate); a sum that
    overflowed is checked value by value."""
    return all(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()) for t in tensors)


class Rule:
    """Base of the rules: ``__call__`` checks the sizing against what it receives, then ``aggregate``."""

    name = "rule"

    def check(self, m: int, f: int) -> None:
        """Raise :class:`SizingError` if the rule cannot hold for ``m`` vectors with ``f`` Byzantine."""
        if m < 1:
            raise _sizing(self.name, "needs at least one vector", m, f)

    def aggregate(self, vectors: torch.Tensor, ctx: RoundContext) -> Aggregation:
        raise NotImplementedError

    def __call__(self, vectors: torch.Tensor, ctx: RoundContext) -> Aggregation:
        if len(vectors) != ctx.num_vectors:
            raise ValueError(f"{self.name}: got {len(vectors)} vectors, the context says {ctx.num_vectors}.")
        self.check(len(vectors), ctx.num_byzantine)
        return self.aggregate(vectors, ctx)

    def aggregate_many(self, sets: torch.Tensor, ctx: RoundContext) -> torch.Tensor:
        """The rule's value for each of ``C`` vector sets under one context (``C x m x d -> C x d``): what an
        attacker's search evaluates. A loop over ``__call__`` here; rules that can, do all sets at once."""
        return torch.stack([self(vectors, ctx).value for vectors in sets])

    def aggregate_repeated(self, honest: torch.Tensor, candidates: torch.Tensor, k: int, ctx: RoundContext):
        """The rule's value on ``honest`` (``h x d``, or ``C x h x d``: each candidate's own, as a pre-aggregation
        step leaves them) plus ``k`` copies of each candidate (``C x d -> C x d``), the sets ordered honest first,
        ``ctx`` for their ``h + k`` vectors: what an omniscient attacker's search evaluates. Here the sets
        themselves through :meth:`aggregate_many`, in groups of at most 4 MB (many small sets at once, large ones
        one by one, where batching only adds memory traffic: measured); rules with a closed form in the candidate
        do better."""
        outputs, per_set = [], (honest.shape[-2] + k) * honest.shape[-1] * honest.element_size()
        for part in _candidate_groups(len(candidates), per_set):
            sent = candidates[part, None, :].expand(-1, k, -1)
            own = honest.expand(len(sent), -1, -1) if honest.dim() == 2 else honest[part]
            outputs.append(self.aggregate_many(torch.cat([own, sent], dim=1), ctx))
        return torch.cat(outputs)


class PreAggregator:
    """Base of the pre-aggregation steps: ``Tensor[m, nu] -> Tensor[output_size(m), nu]``.

    ``keeps_rows``: row i of the output still stands for client i (the Byzantine mask stays meaningful)."""

    name = "pre_aggregator"
    keeps_rows = True

    def check(self, m: int, f: int) -> None:
        if m < 1:
            raise _sizing(self.name, "needs at least one vector", m, f)

    def output_size(self, m: int) -> int:
        return m

    def transform(self, vectors: torch.Tensor, ctx: RoundContext) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, vectors: torch.Tensor, ctx: RoundContext) -> torch.Tensor:
        self.check(len(vectors), ctx.num_byzantine)
        return self.transform(vectors, ctx)

    def transform_many(self, sets: torch.Tensor, ctx: RoundContext) -> torch.Tensor:
        """The step on each of ``C`` vector sets (``C x m x d -> C x m' x d``); a loop unless a step does better."""
        return torch.stack([self(vectors, ctx) for vectors in sets])

    def transform_repeated(self, honest: torch.Tensor, candidates: torch.Tensor, k: int, ctx: RoundContext):
        """The step on ``honest`` (``h x d``) plus ``k`` copies of each candidate (``C x d``), as
        :meth:`Rule.aggregate_repeated`, where its outputs are linear in them and keep that shape: ``(A, b)`` with
        ``A`` of ``C x (h + 1) x h`` and ``b`` of ``C x (h + 1)``, the outputs ``A_c @ honest + b_c c``: its ``h``
        honest rows, then the row all copies become. ``None`` here and where a step cannot (the sets then)."""
        return None


@register_aggregator("mean")
class Mean(Rule):
    """Arithmetic mean ``(1/m) sum_i v_i``. Not robust: one client moves it anywhere.

    >>> ctx = RoundContext(key=(0, 0, 1), num_vectors=2, num_byzantine=0)
    >>> Mean()(torch.tensor([[1.0, 2.0], [3.0, 6.0]]), ctx).value
    tensor([2., 4.])
    """

    name = "mean"

    def aggregate(self, vectors, ctx):
        return Aggregation(vectors.mean(dim=0), {})

    def aggregate_many(self, sets, ctx):
        self.check(sets.shape[1], ctx.num_byzantine)
        return sets.mean(dim=1)


@register_aggregator("cwtm")
class CWTM(Rule):
    """Coordinate-wise trimmed mean (Yin et al. 2018): per coordinate drop the ``k`` smallest and ``k``
    largest values, average the ``m - 2k`` left; ``k = f`` (``k = floor(beta m)`` when ``beta`` is set).
    Diagnostics: ``byzantine_values_kept``, Byzantine (client, coordinate) values among the averaged.

    Bound (``k >= f``): per coordinate at most ``k`` values lie below the honest minimum (or above the
    maximum), so all kept values, and their mean, lie in the honest range ``[lo, hi]``.

    >>> ctx = RoundContext(key=(0, 0, 1), num_vectors=3, num_byzantine=1)
    >>> CWTM()(torch.tensor([[2.0, 2, 0], [0, -1, -1], [4, 0, -4]]), ctx).value
    tensor([ 2.,  0., -1.])
    """

    name = "cwtm"

    def __init__(self, beta: float | None = None):
        self.beta = None if beta is None else check_fraction("cwtm: beta", beta)

    def trim(self, m: int, f: int) -> int:
        return f if self.beta is None else math.floor(self.beta * m + 1e-9)

    def check(self, m, f):
        super().check(m, f)
        k = self.trim(m, f)
        if 2 * k >= m:
            raise _sizing("cwtm", f"trims k={k} values from each side; needs 2k < m", m, f)

    def aggregate(self, vectors, ctx):
        m, k = len(vectors), self.trim(len(vectors), ctx.num_byzantine)
        ordered, mask = sort_values(vectors, 0), ctx.byzantine_rows()
        diagnostics = {} if mask is None else {"byzantine_values_kept": _kept_in_window(vectors, ordered, k, mask)}
        return Aggregation(ordered[k : m - k].mean(dim=0), diagnostics)

    def aggregate_many(self, sets, ctx):
        m = sets.shape[1]
        self.check(m, ctx.num_byzantine)
        k = self.trim(m, ctx.num_byzantine)
        return sort_values(sets, 1)[:, k : m - k].mean(dim=1)

    def aggregate_repeated(self, honest, candidates, k, ctx):
        """Closed form: the mean of sorted positions ``[t, m - t)`` (:func:`_repeated_window_mean`)."""
        return _repeated_window_mean(self, honest, candidates, k, ctx,
                                     lambda m: (t := self.trim(m, ctx.num_byzantine), m - t))


@register_aggregator("median")
class Median(Rule):
    """Coordinate-wise median (mean of the two middle values for even m).

    Bound: with ``2f < m`` each middle value has at least one honest value on either side (or is honest),
    so the output lies in the honest range ``[lo, hi]`` per coordinate.

    >>> ctx = RoundContext(key=(0, 0, 1), num_vectors=4, num_byzantine=1)
    >>> Median()(torch.tensor([[1.0, 5.0], [2.0, 7.0], [9.0, 6.0], [4.0, 0.0]]), ctx).value
    tensor([3.0000, 5.5000])
    """

    name = "median"

    def check(self, m, f):
        super().check(m, f)
        if 2 * f >= m:
            raise _sizing("median", "needs 2f < m", m, f)

    def aggregate(self, vectors, ctx):
        return Aggregation(coordinate_median(vectors), {})

    def aggregate_many(self, sets, ctx):
        self.check(sets.shape[1], ctx.num_byzantine)
        return _median_many(sets)

    def aggregate_repeated(self, honest, candidates, k, ctx):
        """Closed form: the mean of the middle sorted positions (:func:`_repeated_window_mean`)."""
        return _repeated_window_mean(self, honest, candidates, k, ctx, lambda m: ((m - 1) // 2, m // 2 + 1))


def krum_scores(vectors: torch.Tensor, f: int, squared: bool = True) -> torch.Tensor:
    """Score of ``v_i``: sum of its (squared) distances to its ``m - f - 2`` nearest other vectors."""
    dist = _pairwise_sq_distances(vectors)
    if not squared:
        dist = dist.sqrt()
    dist.fill_diagonal_(float("inf"))
    nearest = sort_values(dist, 1)[:, : len(vectors) - f - 2]
    return nearest.sum(dim=1)


class _KrumFamily(Rule):
    def __init__(self, f: int | None = None, squared: bool = True):
        self.f = None if f is None else check_integer(f"{self.name}: f", f, 0)
        self.squared = check_bool(f"{self.name}: squared", squared)

    def bound(self, f: int) -> int:
        return f if self.f is None else self.f

    def check(self, m, f):
        super().check(m, f)
        f = self.bound(f)
        if m <= 2 * f + 2:
            raise _sizing(self.name, f"needs m > 2f + 2 = {2 * f + 2}", m, f)

    @staticmethod
    def selected(chosen: torch.Tensor, ctx: RoundContext) -> dict:
        mask = ctx.byzantine_rows()
        return {} if mask is None else {"byzantine_selected": int(mask.to(chosen.device)[chosen].sum())}


@register_aggregator("krum")
class Krum(_KrumFamily):
    """Krum (Blanchard et al. 2017): ``v_{i*}``, ``i* = argmin_i sum_{j in C_i} ||v_i - v_j||^2``, ``C_i``
    the ``m - f - 2`` nearest others; ``squared=False`` uses plain distances (paper 004). ``f`` defaults to
    the context's. Diagnostics: ``byzantine_selected`` (0 or 1).

    Bound: ``||out - hbar|| <= R + sqrt(m - f - 2) D`` (``R + (m - f - 2) D`` with ``squared=False``): the
    selected score is at most an honest vector's (``<= (m - f - 2) D^2``), and its ``m - f - 2 > f - 1``
    nearest include an honest vector, which it is thus within ``sqrt(m - f - 2) D`` of. Distances are never
    NaN (see ``_pairwise_sq_distances``), so a Byzantine score is never NaN either (argmin would pick it).

    >>> ctx = RoundContext(key=(0, 0, 1), num_vectors=5, num_byzantine=1)
    >>> Krum()(torch.tensor([[0.0], [0.1], [0.2], [0.3], [50.0]]), ctx).value
    tensor([0.1000])
    """

    name = "krum"

    def aggregate(self, vectors, ctx):
        chosen = krum_scores(vectors, self.bound(ctx.num_byzantine), self.squared).argmin().reshape(1)
        return Aggregation(vectors[chosen[0]], self.selected(chosen, ctx))

    def aggregate_repeated(self, honest, candidates, k, ctx):
        """Closed form from the honest distances once and each candidate's to the honest vectors (``C x h``): an
        honest score sums the ``n = m - f - 2`` smallest of its distances to the other honest vectors and ``k``
        copies of its distance to ``c`` (:func:`_repeated_window_sums`); a copy's score sums ``k - 1`` zeros and
        its smallest distances to the honest vectors. The first lowest score wins (honest rows come first), as
        in :meth:`aggregate`. Finite inputs; else the sets."""
        m, f, h = honest.shape[-2] + k, self.bound(ctx.num_byzantine), honest.shape[-2]
        self.check(m, ctx.num_byzantine)
        if honest.dim() == 3 or h < 2 or not _finite(honest, candidates):
            return super().aggregate_repeated(honest, candidates, k, ctx)
        inner, to_point = _distances_to_honest(honest, candidates)
        if not self.squared:
            inner, to_point = inner.sqrt(), to_point.sqrt()
        n = m - f - 2
        others = inner.fill_diagonal_(math.inf).sort(dim=1).values[:, :-1]  # [h, h - 1]: each row's others
        honest_scores = _repeated_window_sums(others.T, to_point, k, 0, n)
        scores = torch.cat([honest_scores, honest_scores.new_zeros(len(candidates), 1)], dim=1)
        from_copies = n - min(k - 1, n)  # honest distances a copy adds after the k - 1 zeros
        if from_copies:
            scores[:, h] = sort_values(to_point.double(), 1)[:, :from_copies].sum(dim=1)
        chosen = scores.argmin(dim=1)
        return torch.where((chosen < h)[:, None], honest[chosen.clamp(max=h - 1)], candidates)


@register_aggregator("multikrum")
class MultiKrum(_KrumFamily):
    """Multi-Krum: mean of the ``m_sel`` vectors with the lowest Krum scores (``m`` sets ``m_sel``; it
    defaults to ``m - f`` of the vectors received). Diagnostics: ``byzantine_selected``.

    Bound (default ``m_sel = m - f <= h``): every selected score is at most the largest of the ``h`` honest
    scores, so, as for Krum, each selected vector and their mean lie within ``R + sqrt(m - f - 2) D`` of
    ``hbar`` (``R + (m - f - 2) D`` with ``squared=False``).

    >>> ctx = RoundContext(key=(0, 0, 1), num_vectors=6, num_byzantine=1)
    >>> MultiKrum(m=2)(torch.tensor([[0.0], [1.0], [3.0], [4.0], [10.0], [11.0]]), ctx).value
    tensor([2.])
    """

    name = "multikrum"

    def __init__(self, f: int | None = None, m: int | None = None, squared: bool = True):
        super().__init__(f, squared)
        self.m = None if m is None else check_integer("multikrum: m", m, 1)

    def selection(self, m: int, f: int) -> int:
        return m - self.bound(f) if self.m is None else self.m

    def check(self, m, f):
        super().check(m, f)
        if self.selection(m, f) > m:
            raise _sizing("multikrum", f"selects m={self.m} vectors; needs at most the number received", m, f)

    def aggregate(self, vectors, ctx):
        f = self.bound(ctx.num_byzantine)
        chosen = krum_scores(vectors, f, self.squared).argsort(stable=True)[: self.selection(len(vectors), f)]
        return Aggregation(vectors[chosen].mean(dim=0), self.selected(chosen, ctx))


@register_aggregator("geomed")
class GeoMed(Rule):
    """Geometric median ``argmin_z sum_i ||v_i - z||`` by smoothed Weiszfeld iterations:
    ``z <- sum_i a_i v_i / sum_i a_i``, ``a_i = 1 / max(eps, ||v_i - z||)`` (``a_i = 0`` where the distance
    overflows), from ``z_0`` = the coordinate-wise trimmed mean dropping ``f`` values per side (the mean when
    ``f = 0``), until ``||z_new - z|| <= tol * max(1, ||z||)`` or ``max_iter`` (a non-finite update stops).
    Where ``z`` lies within ``eps`` of ``k`` inputs although the others pull harder (``r = ||sum_far a_i (v_i
    - z)|| > k``: ``z`` is not optimal), those ``k`` get ``S_far / (r - k)`` (the Vardi-Zhang step) clamped to
    ``[1 / min_far ||v_i - z||, 1 / eps]`` instead of ``1 / eps``: the iterations leave the data point.

    Bound: ``||out - hbar|| <= max(||w||, eps, R m / (m - 2f))``. ``z_0`` lies in the honest range, so
    ``||z_0 - hbar|| <= ||w||``; a step maps ``B(hbar, rho)`` into itself for ``rho >= max(eps, R (h + b) / (h -
    b))``, b Byzantine: as ``a_i ||v_i - z|| <= 1`` (or ``a_i <= 1 / eps``) each pulls by at most ``1 / sum_i
    a_i``, and honest weights are ``>= 1 / (rho + R)``.

    >>> ctx = RoundContext(key=(0, 0, 1), num_vectors=4, num_byzantine=1)
    >>> GeoMed()(torch.tensor([[1.0, 1], [1, -1], [-1, 1], [-1, -1]], dtype=torch.float64), ctx).value
    tensor([0., 0.], dtype=torch.float64)
    """

    name = "geomed"

    def __init__(self, eps: float = 1e-8, max_iter: int = 100, tol: float = 1e-7):
        self.eps = check_real("geomed: eps", eps, 0.0, low_open=True)
        self.max_iter, self.tol = check_integer("geomed: max_iter", max_iter, 1), check_real("geomed: tol", tol, 0.0)

    def check(self, m, f):
        super().check(m, f)
        if 2 * f >= m:
            raise _sizing("geomed", "needs 2f < m", m, f)

    def _weights(self, vectors: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The ``a_i`` at ``z`` (see the class docstring)."""
        dist = _row_norms(vectors - z)
        weights = 1.0 / dist.clamp_min(self.eps)  # 1 / inf = 0, and no 0 * inf below: the vectors are finite
        near = dist < self.eps
        if bool(near.any()) and not bool(near.all()):
            far, k = ~near, int(near.sum())
            pull = float(((vectors[far] - z) * weights[far, None]).sum(dim=0).norm())
            if pull > k:
                total = weights[far].sum()
                share = (total / (pull - k)).clamp(float(1.0 / dist[far].min()), 1.0 / self.eps)
                weights = torch.where(near, share, weights)
        return weights

    def aggregate(self, vectors, ctx):
        f, m = ctx.num_byzantine, len(vectors)
        # a robust start: the mean would follow a huge Byzantine vector (and the iterations from there)
        z = vectors.mean(dim=0) if f == 0 else sort_values(vectors, 0)[f : m - f].mean(dim=0)
        for _ in range(self.max_iter):
            weights = self._weights(vectors, z)
            new = (weights[:, None] * vectors).sum(dim=0) / weights.sum()
            if not bool(torch.isfinite(new).all()):
                break
            done = (new - z).norm() <= self.tol * max(1.0, float(z.norm()))
            z = new
            if done:
                break
        return Aggregation(z, {})


@register_aggregator("cclip")
class CClip(Rule):
    """Centred clipping (Karimireddy et al. 2021): from ``c`` = the coordinate-wise median,
    ``iters`` times ``c <- c + (1/m) sum_i clip_tau(v_i - c)``, ``clip_tau(x) = x min(1, tau/||x||)``.

    Bound: ``||out - hbar|| <= ||w|| + iters tau``: the median lies in the honest range, and each iteration
    moves the centre by at most ``tau`` (a mean of vectors of norm ``<= tau``, computed without overflow).

    >>> ctx = RoundContext(key=(0, 0, 1), num_vectors=4, num_byzantine=1)
    >>> CClip(tau=1.0, iters=1)(torch.tensor([[0.0], [0.0], [0.0], [10.0]]), ctx).value
    tensor([0.2500])
    """

    name = "cclip"

    def __init__(self, tau: float = 1.0, iters: int = 3):
        check_real("cclip: tau", tau, 0.0, low_open=True)
        self.tau, self.iters = tau, check_integer("cclip: iters", iters, 1)

    def check(self, m, f):
        super().check(m, f)
        if 2 * f >= m:
            raise _sizing("cclip", "needs 2f < m", m, f)

    def aggregate(self, vectors, ctx):
        centre = coordinate_median(vectors)
        for _ in range(self.iters):
            diff = vectors - centre
            centre = centre + (diff * _clip_factors(diff, self.tau)[:, None]).mean(dim=0)
        return Aggregation(centre, {})


# ----- pre-aggregation ----------------------------------------------------------------------


@register_pre_aggregator("nnm")
class NNM(PreAggregator):
    """Nearest-neighbour mixing (Allouah et al. 2023): ``v_i <- mean of the m - f vectors nearest v_i``
    (itself included, Euclidean distance).

    Bound: an honest ``v_i`` has ``h >= m - f`` vectors within ``D``, so its ``m - f`` neighbours are; ``>= m - 2f``
    are honest (within ``R`` of hbar), so the honest outputs lie in ``B(hbar, R + f D / (m - f))`` and within
    ``f D / (m - f)`` of ``[lo, hi]`` per coordinate: the rule after it applies its bound to these.

    >>> ctx = RoundContext(key=(0, 0, 1), num_vectors=4, num_byzantine=1)
    >>> NNM()(torch.tensor([[0.0], [1.0], [2.0], [10.0]]), ctx).squeeze(1)
    tensor([1.0000, 1.0000, 1.0000, 4.3333])
    """

    name = "nnm"

    def check(self, m, f):
        super().check(m, f)
        if f >= m:
            raise _sizing("nnm", "averages m - f neighbours; needs f < m", m, f)

    def transform(self, vectors, ctx):
        keep = len(vectors) - ctx.num_byzantine
        mixed, nearest = _mix_nearest(vectors, _pairwise_sq_distances(vectors), keep)
        overflowed = ~torch.isfinite(mixed).all(dim=1)  # huge (Byzantine) rows summed past the dtype's range
        if bool(overflowed.any()):
            for i in overflowed.nonzero().flatten().tolist():
                mixed[i] = _rescaled_mean(vectors[nearest[i]])
        return mixed

    def transform_many(self, sets, ctx):
        """All sets at once (batched Gram matrices and mixing products); a set with huge or non-finite values
        takes the one-set path, with its overflow handling."""
        m = sets.shape[1]
        self.check(m, ctx.num_byzantine)
        dist, norms = _gram_sq_distances(sets.double())
        safe = (norms <= HUGE_SQ_NORM).all(dim=1)
        mixed, _ = _mix_nearest(sets, dist.to(sets.dtype), m - ctx.num_byzantine)
        redo = ~safe | ~torch.isfinite(mixed.sum(dim=(1, 2)))  # a finite sum: every value finite (else re-checked)
        for i in redo.nonzero().flatten().tolist():
            mixed[i] = self(sets[i], ctx)
        return mixed

    def transform_repeated(self, honest, candidates, k, ctx):
        """From the honest distances once and each candidate's to the honest vectors: an honest row's distances
        are its honest ones and ``k`` times its distance to ``c``, a copy's are its distances to the honest vectors
        and ``k`` zeros (so the copies mix alike); weights ``1 / (m - f)`` on the ``m - f`` nearest in
        :meth:`transform`'s stable order (honest first), the copies' summed into ``b``. Shared, finite honest
        vectors (else ``None``)."""
        h, f = honest.shape[-2], ctx.num_byzantine
        m, count = h + k, len(candidates)
        self.check(m, f)
        if honest.dim() != 2 or not _finite(honest, candidates):
            return None
        inner, to_point = _distances_to_honest(honest, candidates)
        to_honest = torch.cat([inner.expand(count, h, h), to_point[:, None, :]], dim=1)  # [C, h + 1, h]
        to_copies = torch.cat([to_point[:, :, None], to_point.new_zeros(count, 1, 1)], dim=1).expand(-1, -1, k)
        weights, _ = _nearest_weights(torch.cat([to_honest, to_copies], dim=2), m - f, honest.dtype)
        return weights[..., :h].contiguous(), weights[..., h:].sum(dim=-1)


@register_pre_aggregator("bucketing")
class Bucketing(PreAggregator):
    """Bucketing (Karimireddy et al. 2022): shuffle (seeded by the round key), average buckets of ``s``.
    A Byzantine vector spoils at most one bucket: ``f`` stays the bound on ``ceil(m / s)`` buckets.

    Bound: a clean bucket's mean lies in the honest convex hull (within ``R`` of hbar, in ``[lo, hi]``,
    diameter ``<= D``), so the rule's bound holds with the same ``hbar, R, D`` and ``m' = ceil(m / s)``."""

    name = "bucketing"
    keeps_rows = False

    def __init__(self, s: int = 2):
        self.s = check_integer("bucketing: s", s, 1)

    def output_size(self, m):
        return math.ceil(m / self.s)

    def transform(self, vectors, ctx):
        order = torch.as_tensor(ctx.rng(seeds.BUCKETING).permutation(len(vectors)), device=vectors.device)
        chunks = vectors[order].split(self.s)
        means = torch.stack([chunk.mean(dim=0) for chunk in chunks])
        overflowed = ~torch.isfinite(means).all(dim=1)
        if bool(overflowed.any()):
            for i in overflowed.nonzero().flatten().tolist():
                means[i] = _rescaled_mean(chunks[i])
        return means


@register_pre_aggregator("clip")
class Clip(PreAggregator):
    """Static clipping: ``v_i <- v_i min(1, c / ||v_i||)`` (huge rows too are scaled to norm ``c``).

    Bound: every output has norm ``<= c``; clipping is the projection onto ``B(0, c)``, 1-Lipschitz, so the
    honest outputs stay within ``R`` of ``clip(hbar)`` with diameter ``<= D``.

    >>> ctx = RoundContext(key=(0, 0, 1), num_vectors=2, num_byzantine=0)
    >>> Clip(c=2.0)(torch.tensor([[3.0, 4.0], [0.6, 0.8]]), ctx)
    tensor([[1.2000, 1.6000],
            [0.6000, 0.8000]])
    """

    name = "clip"

    def __init__(self, c: float = 1.0):
        check_real("clip: c", c, 0.0, low_open=True)
        self.c = c

    def transform(self, vectors, ctx):
        return vectors * _clip_factors(vectors, self.c)[:, None]


class Chain(Rule):
    """``Chain(steps, rule)(v, ctx) = rule(step_k(...step_1(v)))``: a composed rule is itself a rule.

    Each step and the rule are checked against the number of vectors the previous one leaves. Bounds
    compose: each step documents where it leaves the honest vectors, the rule's bound applies to those."""

    def __init__(self, steps: Sequence[PreAggregator], rule: Rule):
        for step in steps:
            if not isinstance(step, PreAggregator):
                raise TypeError(f"pre_aggregators: {step!r} is not a PreAggregator (zo_byzantine.PreAggregator).")
        if not isinstance(rule, Rule):
            raise TypeError(f"aggregator: {rule!r} is not a Rule (subclass zo_byzantine.Rule).")
        self.steps, self.rule = list(steps), rule
        self.name = "+".join([*(s.name for s in self.steps), rule.name])

    def check(self, m, f):
        for step in self.steps:
            step.check(m, f)
            m = step.output_size(m)
        self.rule.check(m, f)

    def __call__(self, vectors: torch.Tensor, ctx: RoundContext) -> Aggregation:
        """Each step and the rule check their own sizing when called: no second pass over ``check``."""
        if len(vectors) != ctx.num_vectors:
            raise ValueError(f"{self.name}: got {len(vectors)} vectors, the context says {ctx.num_vectors}.")
        return self.aggregate(vectors, ctx)

    def aggregate(self, vectors, ctx):
        for step in self.steps:
            vectors = step(vectors, ctx)
            ctx = ctx.after_step(len(vectors), step.keeps_rows)
        return self.rule(vectors, ctx)

    def aggregate_many(self, sets, ctx):
        if sets.shape[1] != ctx.num_vectors:
            raise ValueError(f"{self.name}: got {sets.shape[1]} vectors, the context says {ctx.num_vectors}.")
        for step in self.steps:
            sets = step.transform_many(sets, ctx)
            ctx = ctx.after_step(sets.shape[1], step.keeps_rows)
        return self.rule.aggregate_many(sets, ctx)

    def aggregate_repeated(self, honest, candidates, k, ctx):
        """No steps: the rule's own form. A first step with a linear form for copies
        (:meth:`PreAggregator.transform_repeated`: NNM): its outputs ``A_c @ honest + b_c c``, a few candidates
        at a time (a cache-sized group, as the sets: measured ~3x faster than one product for all), each
        candidate's honest rows and copies' row through the steps left and the rule. Else the sets."""
        form = self.steps[0].transform_repeated(honest, candidates, k, ctx) if self.steps else None
        if form is None:
            return (super() if self.steps else self.rule).aggregate_repeated(honest, candidates, k, ctx)
        mixing, own = form
        h, rest = honest.shape[-2], Chain(self.steps[1:], self.rule)
        after = ctx.after_step(h + k, self.steps[0].keeps_rows)
        outputs = []
        for part in _candidate_groups(len(candidates), (h + 1) * honest.shape[-1] * honest.element_size()):
            mixed = mixing[part] @ honest + own[part, :, None] * candidates[part, None, :]
            if _finite(mixed):
                outputs.append(rest.aggregate_repeated(mixed[:, :h], mixed[:, h], k, after))
            else:  # weights sum to 1, so only rounding at the top of the range: the sets, with NNM's rescaled means
                outputs.append(super().aggregate_repeated(honest, candidates[part], k, ctx))
        return torch.cat(outputs)


def parse_step(spec: str) -> tuple[str, dict]:
    """``"bucketing:s=2"`` -> ``("bucketing", {"s": 2})``; values are read as int, float, bool or str."""
    name, _, params = spec.partition(":")
    kwargs = {}
    for item in filter(None, params.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"pre_aggregators entry {spec!r}: expected name:key=value,...")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        else:
            value = {"true": True, "false": False}.get(value.lower(), value)
        kwargs[key.strip()] = value
    return name.strip(), kwargs


def build_aggregator(rule, pre_aggregators: Sequence = (), **kwargs) -> Chain:
    """The server's pipeline: pre-aggregation steps (names such as ``"nnm"``, ``"bucketing:s=2"``, or
    objects) then the rule (a name with ``kwargs``, or a :class:`Rule`). Always a :class:`Chain`."""
    steps = []
    for step in pre_aggregators:
        if isinstance(step, str):
            name, step_kwargs = parse_step(step)
            step = PRE_AGGREGATORS.build(name, f"pre_aggregators entry {step!r}", **step_kwargs)
        steps.append(step)
    if isinstance(rule, str):
        rule = AGGREGATORS.build(rule, "aggregator_kwargs", **kwargs)
    return Chain(steps, rule)


# the rules below the ones they build on: "history" (per-client state) and "fltrust" (a trusted client's report)
from . import history, trusted  # noqa: E402, F401
