"""Robust aggregation rules on the clients' vectors in R^nu (SPEC 2).

A rule is a callable ``rule(vectors: Tensor[n, nu]) -> Tensor[nu]`` with its parameters in
``__init__`` (validated against ``n`` and ``b`` there). Pre-aggregation steps map
``Tensor[n, nu] -> Tensor[n', nu]``; :class:`Chain` composes steps and a rule into a rule.
Rules and steps are registered by name: ``@register_aggregator("name")``,
``@register_pre_aggregator("name")``; unknown names fail with the list of known ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .registry import Registry

AGGREGATORS = Registry("aggregator")
PRE_AGGREGATORS = Registry("pre_aggregator")
register_aggregator = AGGREGATORS.register
register_pre_aggregator = PRE_AGGREGATORS.register


def _fail(rule: str, message: str, n: int, b: int) -> None:
    raise ValueError(f"{rule}: {message} (n={n}, b={b}).")


def _pairwise_sq_distances(vectors: torch.Tensor) -> torch.Tensor:
    """``D[i, j] = ||v_i||^2 + ||v_j||^2 - 2 <v_i, v_j>`` from one float64 Gram matrix.

    A matrix product, ~8x faster than direct differences at n = 40, d = 7,850. In float64 the
    cancellation error of ``D[i, j]`` is ~1e-16 (||v_i||^2 + ||v_j||^2): it involves rows i and j
    only (a huge Byzantine row does not blur the honest distances), and integer data stay exact
    (ties stay ties). Returned in the input's dtype.
    """
    wide = vectors.double()
    gram = wide @ wide.T
    norms = gram.diagonal()
    return (norms[:, None] + norms[None, :] - 2 * gram).clamp_min_(0).fill_diagonal_(0).to(vectors.dtype)


def coordinate_median(vectors: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the middle value (mean of the two middle values for even n)."""
    ordered = vectors.sort(dim=0).values
    n = len(vectors)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


@register_aggregator("mean")
class Mean:
    """Arithmetic mean ``(1/n) sum_i v_i``. Not robust: one client moves it anywhere.

    >>> Mean()(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    tensor([2., 4.])
    """

    def __init__(self, num_clients: int = 1, num_byzantine: int = 0):
        pass

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        return vectors.mean(dim=0)


@register_aggregator("cwtm")
class CWTM:
    """Coordinate-wise trimmed mean (Yin et al. 2018): per coordinate drop the ``k = floor(beta n)``
    smallest and largest values, average the ``n - 2k`` left. ``beta`` defaults to ``b / n``.

    >>> CWTM(3, 1)(torch.tensor([[2.0, 2, 0], [0, -1, -1], [4, 0, -4]]))
    tensor([ 2.,  0., -1.])
    """

    def __init__(self, num_clients: int, num_byzantine: int = 0, beta: float | None = None):
        self.beta = num_byzantine / num_clients if beta is None else beta
        self.trim = math.floor(self.beta * num_clients + 1e-9)
        if not 0 <= self.beta or 2 * self.trim >= num_clients:
            _fail(
                "cwtm",
                f"beta={self.beta} trims 2*floor(beta*n)={2 * self.trim} of n values; need < n",
                num_clients,
                num_byzantine,
            )
        self.last_kept: torch.Tensor | None = None

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        n, k = len(vectors), self.trim
        ordered, order = vectors.sort(dim=0, stable=True)
        kept = torch.zeros_like(vectors, dtype=torch.bool).scatter_(0, order[k : n - k], True)
        self.last_kept = kept  # which (client, coordinate) values survived, for diagnostics
        return ordered[k : n - k].mean(dim=0)


@register_aggregator("median")
class Median:
    """Coordinate-wise median (mean of the two middle values for even n).

    >>> Median()(torch.tensor([[1.0, 5.0], [2.0, 7.0], [9.0, 6.0], [4.0, 0.0]]))
    tensor([3.0000, 5.5000])
    """

    def __init__(self, num_clients: int = 1, num_byzantine: int = 0):
        pass

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        return coordinate_median(vectors)


def krum_scores(vectors: torch.Tensor, f: int, squared: bool = True) -> torch.Tensor:
    """Score of ``v_i``: sum of its (squared) distances to its ``n - f - 2`` nearest other vectors."""
    dist = _pairwise_sq_distances(vectors)
    if not squared:
        dist = dist.sqrt()
    dist.fill_diagonal_(float("inf"))
    nearest = dist.sort(dim=1).values[:, : len(vectors) - f - 2]
    return nearest.sum(dim=1)


@register_aggregator("krum")
class Krum:
    """Krum (Blanchard et al. 2017): ``v_{i*}``, ``i* = argmin_i sum_{j in C_i} ||v_i - v_j||^2``, ``C_i``
    the ``n - f - 2`` nearest others; ``squared=False`` uses plain distances (paper 004). ``f`` defaults to b.

    >>> Krum(5, 1)(torch.tensor([[0.0], [0.1], [0.2], [0.3], [50.0]]))
    tensor([0.1000])
    """

    def __init__(self, num_clients: int, num_byzantine: int = 0, f: int | None = None, squared: bool = True):
        self.f = num_byzantine if f is None else f
        self.squared = squared
        if self.f < 0 or num_clients <= 2 * self.f + 2:
            _fail("krum", f"f={self.f} needs n > 2f + 2 = {2 * self.f + 2}", num_clients, num_byzantine)

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        return vectors[int(krum_scores(vectors, self.f, self.squared).argmin())]


@register_aggregator("multikrum")
class MultiKrum:
    """Multi-Krum: mean of the ``m`` vectors with the lowest Krum scores (``m`` defaults to ``n - f``)."""

    def __init__(
        self, num_clients: int, num_byzantine: int = 0, f: int | None = None, m: int | None = None, squared: bool = True
    ):
        self.f = num_byzantine if f is None else f
        self.m = num_clients - self.f if m is None else m
        self.squared = squared
        if self.f < 0 or num_clients <= 2 * self.f + 2:
            _fail("multikrum", f"f={self.f} needs n > 2f + 2 = {2 * self.f + 2}", num_clients, num_byzantine)
        if not 1 <= self.m <= num_clients:
            _fail("multikrum", f"m={self.m} must be in [1, n]", num_clients, num_byzantine)

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        chosen = krum_scores(vectors, self.f, self.squared).argsort(stable=True)[: self.m]
        return vectors[chosen].mean(dim=0)


@register_aggregator("geomed")
class GeoMed:
    """Geometric median ``argmin_z sum_i ||v_i - z||`` by smoothed Weiszfeld iterations:
    ``z <- sum_i a_i v_i / sum_i a_i``, ``a_i = 1 / max(eps, ||v_i - z||)``, from the mean, until
    ``||z_new - z|| <= tol * max(1, ||z||)`` or ``max_iter``.
    """

    def __init__(
        self, num_clients: int = 1, num_byzantine: int = 0, eps: float = 1e-8, max_iter: int = 100, tol: float = 1e-7
    ):
        if eps <= 0 or max_iter < 1 or tol < 0:
            _fail(
                "geomed",
                f"needs eps > 0, max_iter >= 1, tol >= 0; got eps={eps}, max_iter={max_iter}, tol={tol}",
                num_clients,
                num_byzantine,
            )
        self.eps, self.max_iter, self.tol = eps, max_iter, tol

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        z = vectors.mean(dim=0)
        for _ in range(self.max_iter):
            weights = 1.0 / (vectors - z).norm(dim=1).clamp_min(self.eps)
            new = (weights[:, None] * vectors).sum(dim=0) / weights.sum()
            done = (new - z).norm() <= self.tol * max(1.0, float(z.norm()))
            z = new
            if done:
                break
        return z


@register_aggregator("cclip")
class CClip:
    """Centred clipping (Karimireddy et al. 2021): from ``c`` = the coordinate-wise median,
    ``iters`` times ``c <- c + (1/n) sum_i clip_tau(v_i - c)``, ``clip_tau(x) = x min(1, tau/||x||)``.
    """

    def __init__(self, num_clients: int = 1, num_byzantine: int = 0, tau: float = 1.0, iters: int = 3):
        if tau <= 0 or iters < 1:
            _fail("cclip", f"needs tau > 0 and iters >= 1; got tau={tau}, iters={iters}", num_clients, num_byzantine)
        self.tau, self.iters = tau, iters

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        centre = coordinate_median(vectors)
        for _ in range(self.iters):
            diff = vectors - centre
            scale = (self.tau / diff.norm(dim=1).clamp_min(1e-300)).clamp(max=1.0)
            centre = centre + (diff * scale[:, None]).mean(dim=0)
        return centre


# ----- pre-aggregation ----------------------------------------------------------------------


@register_pre_aggregator("nnm")
class NNM:
    """Nearest-neighbour mixing (Allouah et al. 2023): ``v_i <- mean of the n - b vectors nearest v_i``
    (itself included, Euclidean distance)."""

    def __init__(self, num_clients: int, num_byzantine: int = 0):
        if num_byzantine >= num_clients:
            _fail("nnm", "needs b < n", num_clients, num_byzantine)
        self.keep = num_clients - num_byzantine

    def output_size(self, n: int) -> int:
        return n

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        nearest = _pairwise_sq_distances(vectors).argsort(dim=1, stable=True)[:, : self.keep]
        # the means as one product: row i of ``weights`` holds 1/keep at v_i's neighbours, 0 elsewhere
        weights = torch.zeros(len(vectors), len(vectors), dtype=vectors.dtype, device=vectors.device)
        return weights.scatter_(1, nearest, 1.0 / self.keep) @ vectors


@register_pre_aggregator("bucketing")
class Bucketing:
    """Bucketing (Karimireddy et al. 2022): shuffle (seeded by the round), average buckets of ``s``."""

    def __init__(self, num_clients: int, num_byzantine: int = 0, s: int = 2):
        if s < 1:
            _fail("bucketing", f"s={s} must be >= 1", num_clients, num_byzantine)
        self.s = s
        self.round_key: tuple[int, ...] = (0,)

    def set_round(self, key: tuple[int, ...]) -> None:
        self.round_key = tuple(key)

    def output_size(self, n: int) -> int:
        return math.ceil(n / self.s)

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        rng = np.random.default_rng(np.random.SeedSequence([0xB0C7, *self.round_key]))
        order = torch.as_tensor(rng.permutation(len(vectors)), device=vectors.device)
        shuffled = vectors[order]
        return torch.stack([chunk.mean(dim=0) for chunk in shuffled.split(self.s)])


@register_pre_aggregator("clip")
class Clip:
    """Static clipping: ``v_i <- v_i min(1, c / ||v_i||)``."""

    def __init__(self, num_clients: int = 1, num_byzantine: int = 0, c: float = 1.0):
        if c <= 0:
            _fail("clip", f"c={c} must be > 0", num_clients, num_byzantine)
        self.c = c

    def output_size(self, n: int) -> int:
        return n

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        return vectors * (self.c / vectors.norm(dim=1).clamp_min(1e-300)).clamp(max=1.0)[:, None]


class Chain:
    """``Chain(steps, rule)(v) = rule(step_k(...step_1(v)))``: a composed rule is itself a rule."""

    def __init__(self, steps: Sequence, rule):
        self.steps, self.rule = list(steps), rule

    def set_round(self, key: tuple[int, ...]) -> None:
        for part in [*self.steps, self.rule]:
            if hasattr(part, "set_round"):
                part.set_round(key)

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            vectors = step(vectors)
        return self.rule(vectors)


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


def build_aggregator(rule, num_clients: int, num_byzantine: int, pre_aggregators: Sequence = (), **kwargs):
    """A rule object from a name (with ``kwargs``) or an object, behind the pre-aggregation steps.

    Steps are names (``"nnm"``, ``"bucketing:s=2"``) or objects; each step sees the number of vectors
    the previous one left, and so does the rule.
    """
    n, steps = num_clients, []
    for step in pre_aggregators:
        if isinstance(step, str):
            name, step_kwargs = parse_step(step)
            step = PRE_AGGREGATORS.get(name)(num_clients=n, num_byzantine=num_byzantine, **step_kwargs)
        steps.append(step)
        n = step.output_size(n) if hasattr(step, "output_size") else n
    if not callable(rule):
        rule = AGGREGATORS.get(rule)(num_clients=n, num_byzantine=num_byzantine, **kwargs)
    return Chain(steps, rule) if steps else rule
