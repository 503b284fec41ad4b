"""Robust aggregation rules on the clients' vectors in R^nu (SPEC 2).

A rule is a callable ``rule(vectors: Tensor[n, nu]) -> Tensor[nu]`` with its parameters in
``__init__``; rules are registered by name and built by :func:`build_aggregator` with the
federation's ``n`` and ``b`` so that they can default and validate their parameters.
"""

from __future__ import annotations

import torch

from .registry import Registry

AGGREGATORS = Registry("aggregator")
register_aggregator = AGGREGATORS.register


@register_aggregator("mean")
class Mean:
    """Arithmetic mean: ``R(v_1..v_n) = (1/n) sum_i v_i``. Not robust (one client moves it anywhere).

    >>> Mean()(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    tensor([2., 4.])
    """

    def __init__(self, num_clients: int | None = None, num_byzantine: int | None = None):
        pass

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        return vectors.mean(dim=0)


def build_aggregator(rule, num_clients: int, num_byzantine: int, **kwargs):
    """A rule object from a registered name (with ``kwargs``) or a callable passed through."""
    if callable(rule):
        return rule
    return AGGREGATORS.get(rule)(num_clients=num_clients, num_byzantine=num_byzantine, **kwargs)
