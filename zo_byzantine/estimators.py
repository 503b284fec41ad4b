"""Estimators of the directional derivatives ``g_i[r] = <grad F_i(w_i), z_{i,r}>`` (SPEC 1.3).

An estimator takes an oracle and ``nu`` and returns every client's vector
``v_i = (1/nu) (g_i[1], ..., g_i[nu])`` in R^nu. The oracle evaluates all clients at once:
``oracle.loss(r, c)`` is the loss of each client at ``w_i + c z_{i,r}`` (``r=None``: at ``w_i``),
``oracle.loss_pairs(mu)`` the losses at ``w_i + mu z_{i,r}`` and ``w_i - mu z_{i,r}`` for every ``r`` (n x nu
each; the schedule decides how),
``oracle.grad_dot(r)`` is ``<grad F_i(w_i), z_{i,r}>`` by backprop.

- ``two_point``:           ``g = (F(w + mu z) - F(w - mu z)) / (2 mu)``   (2 forwards per direction)
- ``one_point``:           ``g = (F(w + mu z) - F(w)) / mu``              (1 forward per direction + 1)
- ``gradient_projection``: ``g = <grad F(w), z>``                         (mu = 0; a backward per client)
- ``first_order``:         not an estimator: clients send backprop gradients (FedAvg baseline, R^d).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import Registry

ESTIMATORS = Registry("estimator")


@dataclass
class Estimate:
    """Per-client vectors ``v`` (n x nu) and the clients' losses near ``w`` (n) for logging."""

    vectors: torch.Tensor
    losses: torch.Tensor


@ESTIMATORS.register("two_point")
class TwoPoint:
    """Central difference: ``g_r = (F(w + mu z_r) - F(w - mu z_r)) / (2 mu)``."""

    uses_mu = True

    def __init__(self, mu: float):
        self.mu = mu

    def __call__(self, oracle, num_directions: int) -> Estimate:
        columns, losses = [], 0.0
        pluses, minuses = oracle.loss_pairs(self.mu)
        for plus, minus in zip(pluses.T, minuses.T, strict=True):
            columns.append((plus - minus) / (2 * self.mu))
            losses = losses + (plus + minus) / 2
        return Estimate(torch.stack(columns, dim=1) / num_directions, losses / num_directions)


@ESTIMATORS.register("one_point")
class OnePoint:
    """Forward difference (paper 002): ``g_r = (F(w + mu z_r) - F(w)) / mu``."""

    uses_mu = True

    def __init__(self, mu: float):
        self.mu = mu

    def __call__(self, oracle, num_directions: int) -> Estimate:
        base = oracle.loss(None, 0.0)
        columns = [(oracle.loss(r, self.mu) - base) / self.mu for r in range(num_directions)]
        return Estimate(torch.stack(columns, dim=1) / num_directions, base)


@ESTIMATORS.register("gradient_projection")
class GradientProjection:
    """``g_r = <grad F(w), z_r>`` by backprop (mu = 0 in papers 003/004): to study the estimator."""

    uses_mu = False

    def __init__(self, mu: float = 0.0):
        pass

    def __call__(self, oracle, num_directions: int) -> Estimate:
        columns = [oracle.grad_dot(r) for r in range(num_directions)]
        return Estimate(torch.stack(columns, dim=1) / num_directions, oracle.base_losses())


@ESTIMATORS.register("first_order")
class FirstOrder:
    """Marker: clients send their backprop gradients in R^d (FedAvg with robust aggregation)."""

    uses_mu = False

    def __init__(self, mu: float = 0.0):
        pass
