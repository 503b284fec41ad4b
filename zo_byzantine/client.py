"""The client role (SPEC 1.3-1.5, 8): model + plan + the client's examples -> its report.

``client_reports(plan, clients, table, ids, sizes)`` runs the round's local steps for the clients ``ids``
and returns one :class:`Report` each. ``clients`` evaluates them (all together in one batched forward
when their terms agree; see ``batched_clients.BatchedClients``): ``losses(terms_per_client) -> Tensor[m]``
(client ``i`` at ``w + sum terms_i``), ``loss_pairs(offsets, seeds, mu) -> (plus, minus)`` (n x nu each) and
``gradients(terms_per_client) -> (grads, losses)``. A deployment's client is the case ``ids = [c]``.

Local steps (SPEC 1.5): client ``i``'s local model is ``w_t`` plus its own seeded steps, kept as
terms ``[(seed, -local_lr * v_{i,l}[r])]`` that the perturbed forward adds on the fly: the global
weights are never written during a round, so they end exactly where the update puts them.

    unbiased:   directions (s,t,l,r) at every step; uplink v_{i,1..K}
    biased:     directions of l = 1 reused;          uplink sum_l v_{i,l}
    compressed: as unbiased, then uplink (1/nu) Z_t^T u_i, u_i = sum_l Z_l v_{i,l}, Z_t from (s,t,0,r);
                Z_t^T Z_l is computed by streaming the generators tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .estimators import ESTIMATORS
from .messages import Plan, Report
from .perturbation import ParameterTable, Terms


class Oracle:
    """What an estimator may ask at one local step: losses at ``w_i + c z_{i,r}``, projected gradients."""

    def __init__(self, clients, table: ParameterTable, seeds: list[list[int]], offsets: list[Terms]):
        self.clients, self.table, self.seeds, self.offsets = clients, table, seeds, offsets
        self._gradients = None

    def loss(self, r: int | None, coeff: float) -> torch.Tensor:
        extra = [[] if r is None else [(seeds[r], coeff)] for seeds in self.seeds]
        return self.clients.losses([offset + e for offset, e in zip(self.offsets, extra, strict=True)])

    def loss_pairs(self, mu: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Losses at ``w_i + mu z_{i,r}`` and ``w_i - mu z_{i,r}`` for every direction ``r`` (n x nu each)."""
        return self.clients.loss_pairs(self.offsets, self.seeds, mu)

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
                    float(torch.dot(g.flatten().double(), self.table.directions.draw(p, seed, j).flatten().double()))
                    for (j, p), g in zip(self.table, client_grads, strict=True)
                )
            )
        return torch.tensor(dots, dtype=torch.float64)


def gram(table: ParameterTable, left: list[int], right: list[int]) -> torch.Tensor:
    """``G[a, b] = <z(left[a]), z(right[b])>`` over all parameters, streaming tensor by tensor."""
    total = torch.zeros(len(left), len(right), dtype=torch.float64)
    for j, p in table:
        a = table.directions.draw_many(p, left, j).flatten(1).double()
        b = table.directions.draw_many(p, right, j).flatten(1).double()
        total += (a @ b.T).cpu()
    return total


def client_reports(
    plan: Plan, clients, table: ParameterTable, ids: Sequence[int], sizes: Sequence[int]
) -> list[Report]:
    """The reports of clients ``ids`` (data sizes ``sizes``) for ``plan``, evaluated by ``clients``."""
    ids = [int(c) for c in ids]
    if tuple(plan.generator) != table.directions.identity():
        raise ValueError(f"The plan's directions come from generator {plan.generator}; this client draws "
                         f"{table.directions.identity()} and cannot reproduce them.")
    if plan.first_order:  # FedAvg baseline: each client's backprop gradient in R^d
        grads, losses = clients.gradients([[] for _ in ids])
        vectors = torch.stack([torch.cat([g.flatten().double() for g in gs]) for gs in grads])[:, None, :]
        return _reports(plan, ids, sizes, vectors, losses)
    estimator = ESTIMATORS.get(plan.estimator)(plan.mu)
    nu = plan.num_perturbations
    offsets: list[dict] = [{} for _ in ids]  # each client's local model: {seed: coefficient}
    steps, losses = [], None
    for step in range(1, plan.local_steps + 1):
        # shared directions: one list of seeds for every client (a SeedSequence per direction, not per client)
        seeds = [plan.seeds(step, c) for c in ids] if plan.per_client else [plan.seeds(step, ids[0])] * len(ids)
        estimate = estimator(Oracle(clients, table, seeds, [list(o.items()) for o in offsets]), nu)
        if losses is None:
            losses = estimate.losses
        steps.append(estimate.vectors)
        if step < plan.local_steps:  # local ZO-SGD step: w_i <- w_i - local_lr sum_r v_i[r] z_{i,r}
            for i in range(len(ids)):
                for s, v in zip(seeds[i], estimate.vectors[i].tolist(), strict=True):
                    offsets[i][s] = offsets[i].get(s, 0.0) - plan.local_lr * v
    if plan.local_update == "biased":
        uplinks = [sum(steps)]
    elif plan.local_update == "compressed":  # shared directions: one projection for every client
        step_seeds = [s for step in range(1, plan.local_steps + 1) for s in plan.seeds(step, ids[0])]
        projection = gram(table, plan.seeds(0, ids[0]), step_seeds) / nu  # (1/nu) Z_t^T Z_l
        uplinks = [torch.cat(steps, dim=1) @ projection.T]  # m x K nu -> m x nu
    else:
        uplinks = steps
    return _reports(plan, ids, sizes, torch.stack(uplinks, dim=1), losses)


def _reports(plan, ids, sizes, vectors, losses) -> list[Report]:
    return [
        Report(plan.round, c, vectors[i].double().cpu(), float(losses[i]), int(sizes[i]))
        for i, c in enumerate(ids)
    ]
