"""Shared-seed Gaussian directions and perturbed forward passes (SPEC 1.2, 1.3).

Direction ``r`` of local step ``l`` in round ``t`` is ``z = (z_0, z_1, ...)``, one Gaussian
tensor per trainable parameter, regenerated on demand from the seed tuple ``(s, t, l, r)``:

    direction_seed = SeedSequence([s, t, l, r])
    z_j ~ N(0, I) drawn by a dedicated ``torch.Generator`` seeded with mix(direction_seed, j)

Each tensor has its own generator, so ``z_j`` does not depend on the order in which tensors
are visited, and no direction is ever held whole. Generators are created on the parameter's
device: CPU and CUDA give different streams for the same seed, so every party of a run must
generate on the same device type.

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
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

_MASK64 = (1 << 64) - 1


def direction_seed(*key: int) -> int:
    """Map the seed tuple ``(s, t, l, r)`` (``(s, t, l, r, client)`` for per-client directions) to a 63-bit
    generator seed (SPEC 1.2)."""
    state = np.random.SeedSequence([int(k) for k in key]).generate_state(2, np.uint32)
    return ((int(state[0]) << 32) | int(state[1])) & (_MASK64 >> 1)


def tensor_seed(seed: int, index: int) -> int:
    """SplitMix64 of ``seed + (index + 1) * golden``: the seed of tensor ``index`` of a direction."""
    x = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & (_MASK64 >> 1)


class GeneratorCounter:
    """Counts Gaussian numbers drawn, to report generator passes (``drawn / d``) per round."""

    def __init__(self) -> None:
        self.drawn = 0

    def add(self, n: int) -> None:
        self.drawn += n


COUNTER = GeneratorCounter()


def gaussian_like(param: torch.Tensor, seed: int, index: int) -> torch.Tensor:
    """Draw ``z_index ~ N(0, I)`` with the shape, dtype and device of ``param``."""
    generator = torch.Generator(device=param.device)
    generator.manual_seed(tensor_seed(seed, index))
    COUNTER.add(param.numel())
    return torch.randn(param.shape, generator=generator, dtype=param.dtype, device=param.device)


Terms = Sequence[tuple[int, float]]  # (direction seed, coefficient) pairs: sum_k c_k z_k


def combination(param: torch.Tensor, index: int, terms: Terms, cache: dict | None = None) -> torch.Tensor:
    """``sum_k c_k z_k[index]`` for the (direction seed, coefficient) pairs in ``terms``.

    With ``cache`` (a dict), each ``z_k[index]`` is drawn once and kept there for later calls."""
    total = None
    for seed, coeff in terms:
        if cache is None:
            z = gaussian_like(param, seed, index)
        else:
            if (seed, index) not in cache:
                cache[(seed, index)] = gaussian_like(param, seed, index)
            z = cache[(seed, index)].clone()
        if total is None:
            total = z.mul_(coeff)
        else:
            total.add_(z, alpha=coeff)
    return total


class ParameterTable:
    """The trainable parameters of a model in a fixed order, with their owning modules.

    Index ``j`` of a parameter is its position in ``model.named_parameters()`` (trainable only,
    tied parameters once); it names the tensor ``z_j`` of every direction.
    """

    def __init__(self, model: nn.Module):
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
def perturbed(table: ParameterTable, terms: Terms, cache: dict | None = None):
    """Within the block, forwards of the table's model compute ``F(w + sum_k c_k z_k)``.

    Stored parameters are never written: each owning module sees ``p + sum_k c_k z_k`` only
    while it runs. With no terms, the block is a plain forward. ``cache``: see :func:`combination`.
    """
    if not terms:
        yield
        return
    handles = []
    saved: dict[int, list[tuple[str, torch.Tensor]]] = {}
    tied_cache: dict = {}

    def swap_in(module, _args):
        originals = []
        for name, index in owned_by[id(module)]:
            param = module._parameters[name]
            originals.append((name, param))
            table.reached.add(index)
            store = cache if cache is not None else (tied_cache if index in table.tied else None)
            module._parameters[name] = param + combination(param.detach(), index, terms, store)  # grads flow
        saved[id(module)] = originals

    def swap_out(module, _args, _output):
        for name, param in saved.pop(id(module), ()):
            module._parameters[name] = param

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
            for name, param in saved.pop(id(module), ()):
                module._parameters[name] = param


_POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)))


def apply_update(
    table: ParameterTable,
    terms: Terms,
    lr: float,
    weight_decay: dict[int, float] | None = None,
    cache: dict | None = None,
) -> None:
    """In place: ``w_j <- w_j - lr * (sum_k c_k z_k[j] + wd_j * w_j)`` for every parameter ``j``.

    This is the only write to the weights; training and ledger replay both call it, so a replay
    reproduces the trained weights bitwise. Tensors are independent (one generator each), so they are
    updated by a small thread pool (torch releases the GIL); the arithmetic per tensor is unchanged.
    With ``cache`` (directions kept by the ``cached`` schedule) no ``z`` is drawn again.
    """

    def update(item):
        index, param = item
        with torch.no_grad():  # grad mode is per thread
            decay = (weight_decay or {}).get(index, 0.0)
            if decay:
                param.mul_(1.0 - lr * decay)
            if terms:
                param.add_(combination(param, index, terms, cache), alpha=-lr)

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

    tied: dict[int, tuple] = {}  # tied parameters: (z, offset) drawn once for all their owners

    def draw(param: torch.Tensor, index: int) -> tuple:
        if index in tied:
            return tied[index]
        drawn = (gaussian_like(param, seed, index), combination(param, index, base) if base else None)
        if index in table.tied:
            tied[index] = drawn
        return drawn

    def wrap(module, forward):
        def split_forward(*args, **kwargs):
            sign = getattr(_HALF, "sign", None)
            shifts = []
            for name, index in owned_by[id(module)]:
                param = module._parameters[name]
                table.reached.add(index)
                z, offset = draw(param.detach(), index)
                shifts.append((name, param, z, offset))

            def set_half(s: float):
                for name, param, z, offset in shifts:
                    delta = z.mul(s * mu) if offset is None else offset.clone().add_(z, alpha=s * mu)
                    module._parameters[name] = param + delta

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
