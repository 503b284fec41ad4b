"""Shared-seed directions and perturbed forward passes (SPEC 1.2, 1.3).

Direction ``r`` of local step ``l`` in round ``t`` is ``z = (z_0, z_1, ...)``, one tensor per
trainable parameter, regenerated on demand from the seed tuple ``(s, t, l, r)``:

    direction_seed = SeedSequence([s, t, l, r])
    z_j = the table's generator (``directions.py``) at (direction_seed, j)

Each tensor has its own stream, so ``z_j`` does not depend on the order in which tensors are
visited, and no direction is ever held whole.

A perturbed forward evaluates ``F(w + sum_k c_k z_k)`` without modifying the stored weights:
a pre-forward hook on each module that owns trainable parameters swaps in ``p + sum_k c_k z_k``
for the duration of that module's call and puts the parameter back afterwards. Restore is
therefore exact in every dtype (no ``+mu, -2mu, +mu`` rounding drift, MeZO issue #42), and
the only extra memory is one module's perturbed parameters at a time.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from .directions import COUNTER, Directions, Terms, build_directions, direction_seed, tensor_seed

__all__ = ["COUNTER", "ParameterTable", "Terms", "antithetic", "apply_update", "direction_seed", "perturbed",
           "tensor_seed"]


class ParameterTable:
    """The trainable parameters of a model in a fixed order, with their owning modules.

    Index ``j`` of a parameter is its position in ``model.named_parameters()`` (trainable only,
    tied parameters once); it names the tensor ``z_j`` of every direction, drawn by ``directions``
    (the run's generator; default ``counter``, Gaussian).
    """

    def __init__(self, model: nn.Module, directions: Directions | None = None):
        self.directions = directions if directions is not None else build_directions()
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        index_of: dict[int, int] = {}
        for name, param in model.named_parameters():
            if param.requires_grad and id(param) not in index_of:
                index_of[id(param)] = len(self.params)
                self.names.append(name)
                self.params.append(param)
        if not self.params:
            raise ValueError("The model has no trainable parameters (requires_grad=True): nothing to optimise.")
        self.index_of = index_of
        # module -> [(attribute name, parameter index)], tied parameters listed under every owner
        self.owners: list[tuple[nn.Module, list[tuple[str, int]]]] = []
        for module in model.modules():
            owned = [(name, index_of[id(p)]) for name, p in module.named_parameters(recurse=False) if id(p) in index_of]
            if owned:
                self.owners.append((module, owned))
        seen = [index for _, owned in self.owners for _, index in owned]
        self.tied = {index for index in seen if seen.count(index) > 1}  # drawn once per forward, then reused
        self.reached: set[int] = set()  # parameters a perturbed forward has swapped (see ``unreached``)

    def unreached(self) -> list[str]:
        """Trainable parameters no perturbed forward has reached: their owning module never ran (unused, or
        the parameter is read outside its module's forward, e.g. a PEFT embedding adapter's ParameterDict).
        Their estimated directional derivative is zero."""
        return [name for index, name in enumerate(self.names) if index not in self.reached]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def __len__(self) -> int:
        return len(self.params)

    def __iter__(self) -> Iterator[tuple[int, nn.Parameter]]:
        return iter(enumerate(self.params))


@contextlib.contextmanager
def perturbed(table: ParameterTable, terms: Terms, cache: dict | None = None,
              base: list[torch.Tensor] | None = None):
    """Within the block, forwards of the table's model compute ``F(w + sum_k c_k z_k)``.

    Stored parameters are never written: each owning module sees ``p + sum_k c_k z_k`` only
    while it runs. With no terms, the block is a plain forward. ``cache``: directions kept by seed
    (``Directions.total``); a tied parameter is perturbed once per forward and shared by its owners.
    ``base`` (no gradients): tensors ``b_j`` (any float dtype) that stand for the weights, so that the
    forwards compute ``F(b + sum_k c_k z_k)``, cast to each parameter's dtype (a client's local model).
    """
    if not terms and base is None:
        yield
        return
    handles = []
    saved: dict[int, list[list[tuple[str, torch.Tensor]]]] = {}  # per module, a stack: calls may nest
    tied: dict[int, torch.Tensor] = {}

    def swap_in(module, _args):
        originals: list[tuple[str, torch.Tensor]] = []
        saved.setdefault(id(module), []).append(originals)  # before any swap: a failure restores what was done
        for name, index in owned_by[id(module)]:
            param = module._parameters[name]
            table.reached.add(index)
            shifted = tied.get(index)
            if shifted is None:
                if base is None:
                    shifted = table.directions.perturb(param, index, terms, cache)  # grads flow to param
                else:
                    source = base[index]
                    shifted = (table.directions.perturb(source, index, terms, cache) if terms else source)
                    shifted = shifted.to(param.dtype)
                if index in table.tied:
                    tied[index] = shifted
            originals.append((name, param))
            module._parameters[name] = shifted

    def restore(module):
        stack = saved.get(id(module))
        for name, param in stack.pop() if stack else ():
            module._parameters[name] = param

    def swap_out(module, _args, _output):
        restore(module)

    owned_by = {id(module): owned for module, owned in table.owners}
    try:
        for module, _ in table.owners:
            handles.append(module.register_forward_pre_hook(swap_in))
            handles.append(module.register_forward_hook(swap_out, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, _ in table.owners:  # a forward that raised inside a module
            while saved.get(id(module)):
                restore(module)


def _new_pool() -> None:
    global _POOL
    _POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)))


_new_pool()
if hasattr(os, "register_at_fork"):  # a forked child has no pool threads
    os.register_at_fork(after_in_child=_new_pool)


def apply_update(
    table: ParameterTable,
    terms: Terms,
    lr: float,
    weight_decay: dict[int, float] | None = None,
    cache: dict | None = None,
) -> None:
    """In place: ``w_j <- w_j - lr * (sum_k c_k z_k[j] + wd_j * w_j)`` for every parameter ``j``.

    This is the only write to the weights; training and ledger replay both call it, so a replay
    reproduces the trained weights bitwise. Tensors are independent (one stream each): a generator
    that is not multi-threaded itself gets them mapped over a small thread pool (torch releases the
    GIL); the arithmetic per tensor is unchanged. With ``cache`` (directions kept by the ``cached``
    schedule) no ``z`` is drawn again.
    """
    directions = table.directions

    def update(item):
        index, param = item
        with torch.no_grad():  # grad mode is per thread
            decay = (weight_decay or {}).get(index, 0.0)
            if decay:
                param.mul_(1.0 - lr * decay)
            if terms:
                directions.step_(param, index, terms, lr, cache)

    if directions.threads_per_tensor:
        for item in table:
            update(item)
    else:
        list(_POOL.map(update, table))


_HALF = threading.local()  # sign of the half an enclosing owner module is running (nested owners)


def _split(value, n: int, part: int):
    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n:
        return value[: n // 2] if part == 0 else value[n // 2 :]
    return value


def _concat(first, second, half: int | None = None):
    """Join the two halves' outputs; ``half`` set: outputs of a broadcast input (leading dim 1) are expanded."""
    if torch.is_tensor(first):
        if half is not None:
            if first.dim() == 0 or first.shape[0] != 1:
                raise TypeError(f"antithetic forward: output of shape {tuple(first.shape)} for a broadcast input")
            return torch.cat([first.expand(half, *first.shape[1:]), second.expand(half, *second.shape[1:])])
        return torch.cat([first, second])
    if first is None:
        return None
    if isinstance(first, tuple | list):
        return type(first)(_concat(a, b, half) for a, b in zip(first, second, strict=True))
    if isinstance(first, dict):
        return type(first)({k: _concat(first[k], second[k], half) for k in first})
    raise TypeError(f"antithetic forward cannot join outputs of type {type(first).__name__}")


@contextlib.contextmanager
def antithetic(table: ParameterTable, base: Terms, seed: int, mu: float, batch: int):
    """Forwards of a doubled batch ``[x; x]`` (``batch`` rows): the first half is evaluated at
    ``w + base + mu z``, the second at ``w + base - mu z``, and each owning module draws its ``z`` once
    for both halves (one generator pass for the two evaluations of a two-point estimate).

    Each owning module runs its own forward once per half: inputs whose leading dimension is ``batch``
    are split and the outputs concatenated; a module fed a broadcast input (leading dimension 1, e.g.
    position ids) gets it whole and its two outputs are expanded to the halves. This assumes modules
    keep the batch as the leading dimension; the trainer checks the result against two plain forwards once.
    """
    owned_by = {id(module): owned for module, owned in table.owners}

    tied: dict = {}  # tied parameters' directions, drawn once for all their owners
    directions = table.directions

    def wrap(module, forward):
        def split_forward(*args, **kwargs):
            sign = getattr(_HALF, "sign", None)
            shifts = []
            for name, index in owned_by[id(module)]:
                table.reached.add(index)
                shifts.append((name, module._parameters[name], index, tied if index in table.tied else {}))

            def set_half(s: float):  # the terms of two_forwards, base + [(seed, +-mu)]; z drawn once per module
                for name, param, index, kept in shifts:
                    module._parameters[name] = directions.perturb(param, index, [*base, (seed, s * mu)], kept)

            try:
                if sign is not None:  # called inside an enclosing owner's half: no second split
                    set_half(sign)
                    return forward(*args, **kwargs)
                tensors = [v for v in [*args, *kwargs.values()] if torch.is_tensor(v) and v.dim() > 0]
                split = any(v.shape[0] == batch for v in tensors)
                halves = []
                for part, s in enumerate((1.0, -1.0)):
                    set_half(s)
                    _HALF.sign = s
                    try:
                        if split:
                            part_args = [_split(a, batch, part) for a in args]
                            part_kwargs = {k: _split(v, batch, part) for k, v in kwargs.items()}
                            halves.append(forward(*part_args, **part_kwargs))
                        else:
                            halves.append(forward(*args, **kwargs))
                    finally:
                        _HALF.sign = None
                return _concat(*halves, None if split else batch // 2)
            finally:
                for name, param, _, _ in shifts:
                    module._parameters[name] = param

        return split_forward

    previous = {id(module): module.__dict__.get("forward") for module, _ in table.owners}  # e.g. accelerate's
    try:
        for module, _ in table.owners:
            module.forward = wrap(module, module.forward)
        yield
    finally:
        for module, _ in table.owners:
            if previous[id(module)] is not None:
                module.forward = previous[id(module)]
            elif "forward" in module.__dict__:
                del module.forward
