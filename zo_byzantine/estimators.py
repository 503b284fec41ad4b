"""Zeroth-order estimators of the directional derivatives ``<grad F_i(w), z_r>`` (SPEC 1.3).

Every estimator takes ``loss_at(terms) -> Tensor[n]``, the loss of each of the ``n`` clients at
``w + sum_k c_k z_k`` (one batched evaluation of all clients), and the round's directions,
and returns the clients' vectors ``v_i = (1/nu) (g_i[1], ..., g_i[nu])`` in R^nu.

- ``two_point``: ``g = (F(w + mu z) - F(w - mu z)) / (2 mu)``       (2 forwards per direction)
- ``one_point``: ``g = (F(w + mu z) - F(w)) / mu``                   (1 forward per direction + 1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .registry import Registry

LossAt = Callable[[Sequence[tuple[int, float]]], torch.Tensor]


@dataclass
class Estimate:
    """Per-client vectors ``v`` (n x nu) and the clients' losses near ``w`` (n) for logging."""

    vectors: torch.Tensor
    losses: torch.Tensor


class TwoPoint:
    """Central difference: ``g_r = (F(w + mu z_r) - F(w - mu z_r)) / (2 mu)``."""

    forwards_per_direction = 2

    def __init__(self, mu: float):
        self.mu = mu

    def __call__(self, loss_at: LossAt, seeds: Sequence[int]) -> Estimate:
        columns, losses = [], 0.0
        for seed in seeds:
            plus = loss_at([(seed, self.mu)])
            minus = loss_at([(seed, -self.mu)])
            columns.append((plus - minus) / (2 * self.mu))
            losses = losses + (plus + minus) / 2
        return Estimate(torch.stack(columns, dim=1) / len(seeds), losses / len(seeds))


class OnePoint:
    """Forward difference (paper 002): ``g_r = (F(w + mu z_r) - F(w)) / mu``."""

    forwards_per_direction = 1

    def __init__(self, mu: float):
        self.mu = mu

    def __call__(self, loss_at: LossAt, seeds: Sequence[int]) -> Estimate:
        base = loss_at([])
        columns = [(loss_at([(seed, self.mu)]) - base) / self.mu for seed in seeds]
        return Estimate(torch.stack(columns, dim=1) / len(seeds), base)


ESTIMATORS = Registry("estimator")
ESTIMATORS.register("two_point")(TwoPoint)
ESTIMATORS.register("one_point")(OnePoint)
