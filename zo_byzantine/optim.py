"""The server update as a ``torch.optim.Optimizer``, so Trainer schedulers drive its learning rate.

``training_step`` stages the round's update ``sum_r R_t[r] z_r`` as (direction seed, R_t[r])
pairs; ``step()`` applies ``w <- w - lr * (sum_r R_t[r] z_r + wd * w)`` (SPEC 1.4 step 6, 1.6),
regenerating each ``z_r`` from its seed, with ``lr`` and ``weight_decay`` read from the param
groups at that moment.
"""

from __future__ import annotations

import torch

from .perturbation import ParameterTable, Terms, apply_update


class ZOOptimizer(torch.optim.Optimizer):
    """Applies staged seeded updates; holds no per-parameter state (memory: none)."""

    def __init__(self, table: ParameterTable, param_groups, lr: float):
        super().__init__(param_groups, {"lr": lr, "weight_decay": 0.0})
        self.table = table
        self._staged: Terms | None = None
        self.last_applied: dict | None = None

    def stage(self, terms: Terms) -> None:
        """The next ``step()`` applies ``w <- w - lr * sum_k c_k z_k`` (and weight decay)."""
        self._staged = list(terms)

    def weight_decay(self) -> dict[int, float]:
        return {
            self.table.index_of[id(p)]: group["weight_decay"]
            for group in self.param_groups
            for p in group["params"]
            if group["weight_decay"]
        }

    def learning_rate(self) -> float:
        rates = {group["lr"] for group in self.param_groups}
        if len(rates) != 1:
            raise ValueError(f"ZOOptimizer needs one learning rate for all parameter groups, got {sorted(rates)}.")
        return rates.pop()

    @torch.no_grad()
    def step(self, closure=None):
        """Apply the staged update, if any (a skipped round stages none)."""
        if closure is not None:
            raise ValueError("ZOOptimizer.step takes no closure: the update is staged by the trainer.")
        if self._staged is None:
            self.last_applied = None
            return None
        lr = self.learning_rate()
        apply_update(self.table, self._staged, lr, self.weight_decay())
        self.last_applied = {"lr": lr, "terms": self._staged}
        self._staged = None
        return None
