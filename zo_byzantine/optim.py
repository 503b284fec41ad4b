"""The server update as a ``torch.optim.Optimizer``, so Trainer schedulers drive its learning rate.

``training_step`` stages the round's update; ``step()`` applies it with ``lr`` and ``weight_decay``
read from the param groups at that moment (SPEC 1.4 step 6, 1.6):

- seeded terms ``[(seed, c)]`` (the protocol's downlink): ``g = sum_k c_k z_k``, regenerated from seeds;
- a dense update (first-order FedAvg, FedZO in parameter space): ``g`` given per parameter.

Server rule ``sgd``: ``w <- w - lr (g + wd w)`` (no state). Server rule ``amsgrad`` (ZO-AdaFL, paper 002,
SPEC 4) on the pseudo-gradient ``h = local_lr * g``:
``m <- b1 m + (1 - b1) h``, ``v <- b2 v + (1 - b2) h^2``, ``vhat <- max(vhat, v)`` (``v0 = vhat0 = 1e-5``),
``w <- w - lr m / sqrt(vhat + eps)``, no bias correction. Its state is dense: 3 d floats.

Weights held in bfloat16 or float16 get the update computed in float32 and rounded stochastically
(``rounding="stochastic"``, the default; ``rounding.py``), so that steps below the dtype's resolution are kept in
expectation; ``rounding="nearest"`` rounds to nearest, with a warning (once) when most of an update rounds away.
"""

from __future__ import annotations

import logging
import math

import torch

from .directions import tensor_seed
from .perturbation import ParameterTable, Terms, apply_update, rounded_away
from .rounding import ROUNDINGS, STOCHASTIC_DTYPES, rounding_key, rounds_stochastically, stochastic_round_
from .validation import check_choice, check_real

logger = logging.getLogger(__name__)

SERVER_OPTIMIZERS = ("sgd", "amsgrad")


def update_fits(params, lr: float, size: float) -> bool:
    """Whether ``w <- w - lr sum_k c_k z_k`` (or a dense ``g``) stays far inside the weights' dtype, with
    ``size = sum_k |c_k|`` (or ``max |g|``) and ``|z| < 10`` in practice: every term ``c_k z_k`` and the step,
    ``max(lr, 1) * size * 10 < limit``, where ``limit`` is ``sqrt(largest)`` for wide dtypes (fp32, bf16, fp64:
    no honest update comes near it) and ``largest`` itself for float16 (whose sqrt, 256, honest steps reach).
    With lr = 0 the terms must still fit: 0 * inf = NaN."""
    largest = min(torch.finfo(p.dtype).max for p in params)
    limit = largest if largest < 1e6 else math.sqrt(largest)
    return math.isfinite(size) and math.isfinite(lr) and max(lr, 1.0) * size * 10 < limit


class ZOOptimizer(torch.optim.Optimizer):
    """Applies staged seeded (or dense) updates with the server rule."""

    def __init__(
        self,
        table: ParameterTable,
        param_groups,
        lr: float,
        server: str = "sgd",
        local_lr: float = 1.0,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        v0: float = 1e-5,
        rounding: str = "stochastic",
    ):
        check_choice("update_rounding", rounding, ROUNDINGS)
        if server not in SERVER_OPTIMIZERS:
            raise ValueError(f"server_optimizer={server!r} is not supported; accepted: {', '.join(SERVER_OPTIMIZERS)}.")
        check_real("ZOOptimizer: local_lr", local_lr, 0.0)
        check_real("ZOOptimizer: eps", eps, 0.0, low_open=True)  # keeps the AMSGrad denominator away from 0
        check_real("ZOOptimizer: v0", v0, 0.0)
        if len(betas) != 2 or not all(isinstance(b, int | float) and 0 <= b < 1 for b in betas):
            raise ValueError(f"ZOOptimizer: betas={betas!r} must be two numbers in [0, 1).")
        super().__init__(param_groups, {"lr": lr, "weight_decay": 0.0})
        self.table, self.server = table, server
        self.local_lr, self.betas, self.eps, self.v0 = local_lr, betas, eps, v0
        self._staged: Terms | None = None
        self._dense: list[torch.Tensor] | None = None
        self._cache: dict | None = None
        self.rounding = rounding
        self.dense_steps = 0  # salt of a dense update's rounding bits (it has no seeds)
        self._resolution_checked = rounding == "stochastic" or not any(p.dtype in STOCHASTIC_DTYPES
                                                                       for p in table.params)

    def stage(self, terms: Terms, cache: dict | None = None) -> None:
        """The next ``step()`` applies ``g = sum_k c_k z_k`` (``cache``: directions already drawn, by seed)."""
        self._staged, self._dense, self._cache = list(terms), None, cache

    def stage_downlink(self, downlink, cache: dict | None = None) -> None:
        """The next ``step()`` applies the round's downlink (nothing for a skipped round)."""
        if downlink.skipped:
            self._staged = self._dense = self._cache = None
        elif downlink.dense is not None:
            self.stage_dense(downlink.dense)
        else:
            self.stage(downlink.terms(), cache)

    def stage_dense(self, update: list[torch.Tensor]) -> None:
        """The next ``step()`` applies ``g = update`` (one tensor per parameter of the table)."""
        self._staged, self._dense = None, update

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
        if self._staged is None and self._dense is None:
            return None
        lr, decay = self.learning_rate(), self.weight_decay()
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"ZOOptimizer: learning rate {lr!r} must be a finite number >= 0 (from the scheduler?).")
        if not self._resolution_checked and self._staged and lr > 0:
            self._check_resolution(lr)
        if self.server == "sgd" and self._dense is None:
            apply_update(self.table, self._staged, lr, decay, self._cache, self.rounding)
        else:
            if self._dense is not None:
                self.dense_steps += 1
            key = rounding_key(self._staged or [], self.dense_steps if self._dense is not None else 0)
            for index, param in self.table:
                g = self._dense[index].to(param.device) if self._dense is not None else self.table.directions.total(
                    param, index, self._staged, self._cache)
                step = self._server_direction(param, g)
                if rounds_stochastically(param.dtype, self.rounding):  # in float32, rounded once
                    exact = param.float()
                    if decay.get(index):
                        exact.mul_(1.0 - lr * decay[index])
                    exact.add_(step.float(), alpha=-lr)
                    stochastic_round_(param.data, exact, tensor_seed(key, index))
                    continue
                if decay.get(index):
                    param.mul_(1.0 - lr * decay[index])
                param.add_(step, alpha=-lr)
        self._staged = self._dense = self._cache = None
        return None

    def _check_resolution(self, lr: float) -> None:
        """Once, at the first seeded update with ``lr > 0`` under ``rounding="nearest"``: warn when most weights of a
        dtype narrower than float32 that the update moves keep their value (the step is below the dtype's spacing)."""
        self._resolution_checked = True
        for dtype, share in rounded_away(self.table, self._staged, lr, self._cache).items():
            if share > 0.5:
                logger.warning(
                    "learning_rate=%g with %s weights and update_rounding='nearest': %.1f%% of the weights this update "
                    "moves keep their value (the step is below half the dtype's spacing there and rounds away), so "
                    "the model barely trains. update_rounding='stochastic' (the default) rounds the float32 update "
                    "stochastically, unbiased; or hold the weights in float32.", lr, dtype, 100 * share)

    def _server_direction(self, param: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if self.server == "sgd":
            return g
        h = g * self.local_lr
        state = self.state[param]
        if not state:
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.full_like(param, self.v0)
            state["max_exp_avg_sq"] = torch.full_like(param, self.v0)
        b1, b2 = self.betas
        state["exp_avg"].mul_(b1).add_(h, alpha=1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(h, h, value=1 - b2)
        torch.maximum(state["max_exp_avg_sq"], state["exp_avg_sq"], out=state["max_exp_avg_sq"])
        return state["exp_avg"] / (state["max_exp_avg_sq"] + self.eps).sqrt()
