"""One federated round, independent of the Trainer: local steps, uplink, attack, rule, update.

The Trainer provides ``clients`` with two methods over the round's participants:
``losses(terms_per_client) -> Tensor[m]`` (client ``i`` at ``w + sum terms_i``; one batched forward
when all clients share their terms) and ``gradients(terms_per_client) -> (grads, losses)``.

Local steps (SPEC 1.5): client ``i``'s local model is ``w_t`` plus its own seeded steps, kept as
terms ``[(seed, -local_lr * v_{i,l}[r])]`` that the perturbed forward adds on the fly: the global
weights are never written during a round, so they end exactly where the update puts them.

    unbiased:   directions (s,t,l,r) at every step; uplink v_{i,1..K};   w -= lr sum_l sum_r R_l[r] z_{l,r}
    biased:     directions of l = 1 reused;          uplink sum_l v_{i,l}; w -= lr sum_r R[r] z_{1,r}
    compressed: as unbiased, then uplink (1/nu) Z_t^T u_i, u_i = sum_l Z_l v_{i,l}, Z_t from (s,t,0,r);
                w -= lr Z_t R; Z_t^T Z_l is computed by streaming the generators tensor by tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .estimators import FirstOrder
from .perturbation import ParameterTable, Terms, direction_seed, gaussian_like

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class SkipRound(Exception):
    """The round cannot be applied safely; the reason goes to the logs and the ledger.

    ``result`` holds what the round computed before it stopped (honest loss, non-finite count)."""

    def __init__(self, reason: str, result=None, nonfinite: int = 0):
        super().__init__(reason)
        self.result, self.nonfinite = result, nonfinite


@dataclass
class Protocol:
    """The round's settings (from ``ZOByzantineArguments``)."""

    zo_seed: int
    num_perturbations: int = 1
    local_steps: int = 1
    local_update: str = "unbiased"
    local_lr: float = 0.0
    directions: str = "shared"
    aggregation_space: str = "projection"


@dataclass
class RoundResult:
    terms: list = field(default_factory=list)  # (direction seed, coefficient): update sum c z
    seed_tuples: list = field(default_factory=list)  # the terms' seed tuples, for the ledger
    dense: list | None = None  # per-parameter dense update (first-order, parameter space)
    honest_loss: torch.Tensor | None = None
    nonfinite: int = 0
    aggregates: list = field(default_factory=list)  # (R, honest vectors, byzantine mask) per uplink


def sanitize(vectors: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Non-finite entries become the most extreme value (nan, +inf -> +max; -inf -> -max), counted (SPEC 1.6)."""
    bad = ~torch.isfinite(vectors)
    if not bad.any():
        return vectors, 0
    cleaned = torch.nan_to_num(vectors, nan=FLOAT32_MAX, posinf=FLOAT32_MAX, neginf=-FLOAT32_MAX)
    return cleaned, int(bad.sum())


def robust_aggregate(vectors: torch.Tensor, byzantine: torch.Tensor, attack, rule):
    """Byzantine rows replaced by the attack, non-finite values sanitised, then ``R(vectors)``.

    Returns ``(R, honest vectors, number of non-finite values, vectors as received)``."""
    byzantine = byzantine.to(vectors.device)
    honest = vectors[~byzantine]
    if not torch.isfinite(honest).all():
        raise SkipRound("non-finite honest estimate")
    if byzantine.any():
        vectors = vectors.clone()
        vectors[byzantine] = attack(honest, vectors[byzantine], rule).to(vectors)
    vectors, nonfinite = sanitize(vectors)
    aggregate = rule(vectors)
    if not torch.isfinite(aggregate).all():
        raise SkipRound("non-finite aggregate", nonfinite=nonfinite)
    return aggregate, honest, nonfinite, vectors


class Oracle:
    """What an estimator may ask at one local step: losses at ``w_i + c z_{i,r}``, projected gradients."""

    def __init__(self, clients, table: ParameterTable, seeds: list[list[int]], offsets: list[Terms]):
        self.clients, self.table, self.seeds, self.offsets = clients, table, seeds, offsets
        self._gradients = None

    def loss(self, r: int | None, coeff: float) -> torch.Tensor:
        extra = [[] if r is None else [(seeds[r], coeff)] for seeds in self.seeds]
        return self.clients.losses([offset + e for offset, e in zip(self.offsets, extra, strict=True)])

    def loss_pair(self, r: int, mu: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Losses at ``w_i + mu z_{i,r}`` and ``w_i - mu z_{i,r}``."""
        return self.clients.loss_pair(self.offsets, [seeds[r] for seeds in self.seeds], mu)

    def _grads(self):
        if self._gradients is None:
            self._gradients = self.clients.gradients(self.offsets)
        return self._gradients

    def base_losses(self) -> torch.Tensor:
        return self._grads()[1]

    def grad_dot(self, r: int) -> torch.Tensor:
        grads = self._grads()[0]
        dots = []
        for i, client_grads in enumerate(grads):
            seed = self.seeds[i][r]
            dots.append(
                sum(
                    float(torch.dot(g.flatten().double(), gaussian_like(p, seed, j).flatten().double()))
                    for (j, p), g in zip(self.table, client_grads, strict=True)
                )
            )
        return torch.tensor(dots, dtype=torch.float64)


def gram(table: ParameterTable, left: list[int], right: list[int]) -> torch.Tensor:
    """``G[a, b] = <z(left[a]), z(right[b])>`` over all parameters, streaming tensor by tensor."""
    total = torch.zeros(len(left), len(right), dtype=torch.float64)
    for j, p in table:
        a = torch.stack([gaussian_like(p, s, j).flatten().double() for s in left])
        b = torch.stack([gaussian_like(p, s, j).flatten().double() for s in right])
        total += a @ b.T
    return total


def reconstruct(table: ParameterTable, seeds: list[int], vectors: torch.Tensor) -> torch.Tensor:
    """Rows ``sum_r v_i[r] z_r`` in R^d (m x d): the FedZO view of the clients' estimates."""
    parts = []
    for j, p in table:
        z = torch.stack([gaussian_like(p, s, j).flatten().double() for s in seeds])
        parts.append(vectors @ z)
    return torch.cat(parts, dim=1)


def unflatten(table: ParameterTable, flat: torch.Tensor) -> list[torch.Tensor]:
    out, start = [], 0
    for _, p in table:
        out.append(flat[start : start + p.numel()].view_as(p).to(p.dtype))
        start += p.numel()
    return out


def run_round(
    p: Protocol,
    estimator,
    clients,
    table: ParameterTable,
    t: int,
    client_ids,
    byzantine: torch.Tensor,
    attack,
    rule,
    set_round=None,
) -> RoundResult:
    """One round: estimates (with local steps), uplink, attack and rule per uplink vector set, update.

    Raises :class:`SkipRound` (with what was computed) when the round must not be applied."""
    result = RoundResult()
    try:
        return _run_round(result, p, estimator, clients, table, t, client_ids, byzantine, attack, rule, set_round)
    except SkipRound as skip:
        result.nonfinite += skip.nonfinite
        skip.result = result
        raise


def _run_round(result, p, estimator, clients, table, t, client_ids, byzantine, attack, rule, set_round):
    """``clients`` evaluates its share ``clients.local`` of the participants (all of them in one process);
    ``clients.gather`` assembles per-client rows from every process, so that every process aggregates the
    same vectors and applies the same update."""
    local_ids = np.asarray(client_ids)[clients.local]
    if isinstance(estimator, FirstOrder):
        grads, losses = clients.gradients([[] for _ in local_ids])
        losses = clients.gather(losses)
        result.honest_loss = losses[~byzantine].mean()
        if not torch.isfinite(losses[~byzantine]).all():
            raise SkipRound("non-finite honest loss")
        vectors = clients.gather(torch.stack([torch.cat([g.flatten().double() for g in gs]) for gs in grads]))
        if set_round:
            set_round((p.zo_seed, t, 1))
        aggregate, honest, result.nonfinite, _ = robust_aggregate(vectors, byzantine, attack, rule)
        result.aggregates.append((aggregate, honest, byzantine))
        result.dense = unflatten(table, aggregate)
        return result

    def keys(step: int, ids) -> list[list[tuple]]:
        """Seed tuples per client: (s, t, l, r), or (s, t, l, r, client) for per-client directions."""
        step = 1 if p.local_update == "biased" and step > 0 else step
        if p.directions == "per_client":
            return [[(p.zo_seed, t, step, r, int(c)) for r in range(p.num_perturbations)] for c in ids]
        return [[(p.zo_seed, t, step, r) for r in range(p.num_perturbations)]] * len(ids)

    def seeds_of(rows: list[list[tuple]]) -> list[list[int]]:
        if p.directions == "per_client":
            return [[direction_seed(*k) for k in row] for row in rows]
        return [[direction_seed(*k) for k in rows[0]]] * len(rows)

    offsets: list[dict] = [{} for _ in local_ids]  # each local client's local model: {seed: coefficient}
    steps = []  # (step l, this process's vectors)
    for l in range(1, p.local_steps + 1):
        seeds = seeds_of(keys(l, local_ids))
        estimate = estimator(Oracle(clients, table, seeds, [list(o.items()) for o in offsets]), p.num_perturbations)
        if l == 1:
            losses = clients.gather(estimate.losses)
            result.honest_loss = losses[~byzantine].mean()
            if not torch.isfinite(losses[~byzantine]).all():
                raise SkipRound("non-finite honest loss")
        steps.append((l, estimate.vectors))
        if l < p.local_steps:  # local ZO-SGD step: w_i <- w_i - local_lr sum_r v_i[r] z_{i,r}
            for i in range(len(local_ids)):
                for s, v in zip(seeds[i], estimate.vectors[i].tolist(), strict=True):
                    offsets[i][s] = offsets[i].get(s, 0.0) - p.local_lr * v

    if p.local_update == "biased":
        uplinks = [(1, sum(v for _, v in steps))]
    elif p.local_update == "compressed":
        step_seeds = [s for l, _ in steps for s in seeds_of(keys(l, [0]))[0]]  # shared directions
        seeds0 = seeds_of(keys(0, [0]))[0]
        projection = gram(table, seeds0, step_seeds) / p.num_perturbations  # (1/nu) Z_t^T Z_l
        uplinks = [(0, torch.cat([v for _, v in steps], dim=1) @ projection.T)]  # m x K nu -> m x nu
    else:
        uplinks = steps

    dense = None
    for index, (step, local_vectors) in enumerate(uplinks):
        vectors = clients.gather(local_vectors)
        rows = keys(step, client_ids)
        seeds = seeds_of(rows)
        if set_round:
            set_round((p.zo_seed, t, index + 1))
        if p.directions == "per_client":  # FedES: bases differ by client; weighted sum of scalars
            aggregate, honest, nonfinite, sent = robust_aggregate(vectors, byzantine, attack, rule)
            weights = clients.weights()
            for i in range(len(client_ids)):
                for k, s, v in zip(rows[i], seeds[i], sent[i].tolist(), strict=True):
                    result.terms.append((s, weights[i] * v))
                    result.seed_tuples.append(k)
        elif p.aggregation_space == "parameter":  # FedZO: the rule runs on reconstructed R^d estimates
            full = reconstruct(table, seeds[0], vectors)
            aggregate, honest, nonfinite, _ = robust_aggregate(full, byzantine, attack, rule)
            dense = aggregate if dense is None else dense + aggregate
        else:
            aggregate, honest, nonfinite, _ = robust_aggregate(vectors, byzantine, attack, rule)
            result.terms += list(zip(seeds[0], aggregate.tolist(), strict=True))
            result.seed_tuples += rows[0]
        result.nonfinite += nonfinite
        result.aggregates.append((aggregate, honest, byzantine))
    if dense is not None:
        result.dense = unflatten(table, dense)
    return result


def uplink_downlink_scalars(p: Protocol, estimator, d: int, m: int) -> tuple[int, int]:
    """Scalars one client sends and receives per round (SPEC 1.5, 2, 4)."""
    if isinstance(estimator, FirstOrder):
        return d, d
    up = p.num_perturbations * (p.local_steps if p.local_update == "unbiased" else 1)
    if p.aggregation_space == "parameter":
        return up, d
    if p.directions == "per_client":
        return up, m * up
    return up, up
