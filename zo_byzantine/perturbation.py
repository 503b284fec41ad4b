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

from .directions import COUNTER, CounterDirections, Directions, Terms, build_directions, direction_seed, tensor_seed
from .offload import stream_of
from .rounding import ROUNDINGS, STOCHASTIC_DTYPES, rounding_key, rounds_stochastically, stochastic_round_

__all__ = ["COUNTER", "ParameterTable", "Terms", "antithetic", "apply_update", "direction_seed", "perturbed",
           "rounded_away", "tensor_seed"]


class ParameterTable:
    """The trainable parameters of a model in a fixed order, with their owning modules.

    Index ``j`` of a parameter is its position in ``model.named_parameters()`` (trainable only,
    tied parameters once); it names the tensor ``z_j`` of every direction, drawn by ``directions``
    (the run's generator; default ``counter``, Gaussian).
    """

    def __init__(self, model: nn.Module, directions: Directions | None = None):
        self.directions = directions if directions is not None else build_directions()
        self.stream = stream_of(model)  # offloaded modules (accelerate) streamed layer by layer; None: all resident
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
        self.tied = {index for index in seen if seen.count(index) > 1}  # stacked forwards draw them once for all owners
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
    (``Directions.total``). A tied parameter is perturbed again for each owner (the same bits: a draw depends on its
    seed and parameter index alone), so that no owner's copy outlives its module's forward: a tied LM head's copy held
    from the embedding to the head would sit through the whole forward (SmolLM2: 28M values, 113 MB, the round's
    peak memory over inference's; measured in ``benchmarks/README.md``).
    ``base`` (no gradients): tensors ``b_j`` (any float dtype) that stand for the weights, so that the
    forwards compute ``F(b + sum_k c_k z_k)``, cast to each parameter's dtype (a client's local model).
    """
    if not terms and base is None:
        yield
        return
    handles = []
    saved: dict[int, list[list[tuple[str, torch.Tensor]]]] = {}  # per module, a stack: calls may nest

    def swap_in(module, args):
        originals: list[tuple[str, torch.Tensor]] = []
        saved.setdefault(id(module), []).append(originals)  # before any swap: a failure restores what was done
        for name, index in owned_by[id(module)]:
            param = module._parameters[name]
            table.reached.add(index)
            loaded = stream.private(param) if stream is not None and base is None else None
            if loaded is not None:  # a streamed layer's private copy on the execution device: perturbed in place,
                if not loaded.perturbed:  # once per load (tied owners share it), and never written back
                    table.directions.perturb_(param.data, index, terms, cache)
                    loaded.perturbed = True
                originals.append((name, param))
                continue
            if by_rows(module, param, base, args):  # the rows the lookup reads, looked up by their new positions
                used, inverse = rows_read(args[0])
                originals.append((name, param))
                module._parameters[name] = table.directions.perturb_rows(param, index, terms, used, cache)
                looked_up[id(module)].append(module.padding_idx)
                module.padding_idx = None  # a gradient mask only (none is taken here): no row is special
                return (inverse, *args[1:])
            if base is None:
                shifted = table.directions.perturb(param, index, terms, cache)  # grads flow to param
            else:
                source = base[index]
                shifted = (table.directions.perturb(source, index, terms, cache) if terms else source)
                shifted = shifted.to(param.dtype)
            originals.append((name, param))
            module._parameters[name] = shifted

    def restore(module):
        stack = saved.get(id(module))
        for name, param in stack.pop() if stack else ():
            module._parameters[name] = param
        if looked_up.get(id(module)):
            module.padding_idx = looked_up[id(module)].pop()

    def by_rows(module, param, base, args) -> bool:
        """A plain ``nn.Embedding`` read without gradients: only the rows its input reads are perturbed (fewer draws
        where the directions draw by rows, and no whole perturbed table held: a tied LM head's would otherwise be
        kept for the head at the end of the forward)."""
        plain = (type(module).forward is nn.Embedding.forward and "forward" not in module.__dict__
                 and module.max_norm is None and len(args) == 1 and torch.is_tensor(args[0]))
        return plain and base is None and table.directions.draws_rows and not (
            torch.is_grad_enabled() and param.requires_grad)

    def swap_out(module, _args, _output):
        restore(module)

    owned_by = {id(module): owned for module, owned in table.owners}
    looked_up = {id(module): [] for module, _ in table.owners}  # per embedding, the padding_idx to put back
    stream = table.stream
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
    rounding: str = "stochastic",
    salt: int = 0,
) -> None:
    """In place: ``w_j <- w_j - lr * (sum_k c_k z_k[j] + wd_j * w_j)`` for every parameter ``j``.

    This is the only write to the weights; training and ledger replay both call it, so a replay
    reproduces the trained weights bitwise. Tensors are independent (one stream each): a generator
    that is not multi-threaded itself gets them mapped over a small thread pool (torch releases the
    GIL); the arithmetic per tensor is unchanged. With ``cache`` (directions kept by the ``cached``
    schedule) no ``z`` is drawn again.

    ``rounding`` (``update_rounding``): ``"stochastic"`` writes a bfloat16 or float16 weight as the float32 result
    ``(w_j (1 - lr wd_j)) - lr sum_k c_k z_k[j]`` rounded stochastically (``rounding.py``: unbiased, its bits seeded
    by the terms' seeds and ``salt``, so a replay rounds the same way); ``"nearest"`` rounds each operation to the
    nearest value of the weight's dtype, which loses every step below half its spacing. float32 and float64 weights
    are written the same way under both.

    A streamed tensor (``table.stream``: an offloaded model) is updated where it lives, its home (``offload.py``):
    the store file through its shared mapping, or CPU memory; its ``z`` regenerated (the same bits as kept ones, and
    where the home is), its pages faulted in while the tensor before it is updated and dropped after.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"update_rounding={rounding!r} is not supported; accepted: {', '.join(ROUNDINGS)}.")
    directions, stream = table.directions, table.stream
    if stream is not None:
        stream.before_update()  # copies read before this update would be stale
    key = rounding_key(terms, salt) if any(rounds_stochastically(p.dtype, rounding) for p in table.params) else 0

    def update(item):
        index, param = item
        streamed = stream is not None and stream.holds(param)
        kept = None if streamed else cache
        with torch.no_grad():  # grad mode is per thread
            decay = (weight_decay or {}).get(index, 0.0)
            if rounds_stochastically(param.dtype, rounding) and isinstance(directions, CounterDirections) \
                    and directions.rounds_fused(param, kept):  # the same bits in one pass, no float32 copy
                directions.step_rounded_(param, index, terms, lr, decay, tensor_seed(key, index))
            elif rounds_stochastically(param.dtype, rounding):
                exact = _exact_update(directions, param, index, terms, lr, decay, kept)
                stochastic_round_(param.data, exact, tensor_seed(key, index))
                torch.autograd.graph.increment_version(param)
            else:
                if decay:
                    param.mul_(1.0 - lr * decay)
                if terms:
                    directions.step_(param, index, terms, lr, kept)
        if streamed:
            stream.updated(param)

    if directions.threads_per_tensor:
        items = list(table)
        for k, item in enumerate(items):
            if stream is not None and k + 1 < len(items):
                stream.prefault(items[k + 1][1])
            update(item)
    else:
        list(_POOL.map(update, table))


def _exact_update(directions: Directions, param: torch.Tensor, index: int, terms: Terms, lr: float, decay: float,
                  cache: dict | None) -> torch.Tensor:
    """The float32 value of ``param``'s update before its final rounding: ``T(p) (1 - lr wd) - lr sum_k c_k z_k``.
    The counter generator sums in float32 whatever the weights' dtype (``directions.py``), so its in-place step on a
    float32 copy gives the value a nearest-rounded step rounds; the torch generator draws ``z`` in the weights' dtype
    (as its kept directions are), summed there."""
    exact = param.detach().float()
    if decay:
        exact.mul_(1.0 - lr * decay)
    if terms:
        if isinstance(directions, CounterDirections):
            directions.step_(exact, index, terms, lr, cache)
        else:
            exact.add_(directions.total(param.detach(), index, terms, cache).float(), alpha=-lr)
    return exact


def rounded_away(table: ParameterTable, terms: Terms, lr: float, cache: dict | None = None) -> dict[torch.dtype, float]:
    """For each dtype narrower than float32 (bfloat16, float16) among the table's weights: the share of its weights
    that the update ``w - lr sum_k c_k z_k`` moves in float32 and rounding to nearest leaves where they are (the step is
    below half the dtype's spacing there). Nothing is written. One extra update's arithmetic."""
    moved: dict[torch.dtype, list[int]] = {}
    with torch.no_grad():
        for index, param in table:
            if param.dtype not in STOCHASTIC_DTYPES or not terms:
                continue
            exact = _exact_update(table.directions, param, index, terms, lr, 0.0, cache)
            changed = exact != param.detach().float()
            stuck = changed & (exact.to(param.dtype) == param.detach())
            counts = moved.setdefault(param.dtype, [0, 0])
            counts[0] += int(stuck.sum())
            counts[1] += int(changed.sum())
    return {dtype: stuck / total for dtype, (stuck, total) in moved.items() if total}


_GROUP = threading.local()  # the group an enclosing owner module is running (nested owners run it too)


def _part(value, groups: int, rows: int, g: int):
    """Group ``g``'s slice of a stacked input (leading dimension ``groups * rows``); other values whole."""
    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == groups * rows:
        return value[g * rows : (g + 1) * rows]
    return value


def _stack_outputs(outputs: list, rows: int):
    """Join the groups' outputs group-major; an output of leading dimension 1 (from a broadcast input) is
    expanded to ``rows`` first."""
    first = outputs[0]
    if torch.is_tensor(first):
        if first.dim() == 0 or first.shape[0] not in (1, rows):
            raise TypeError(f"stacked forward: an output of shape {tuple(first.shape)} is not per example")
        return torch.cat([o.expand(rows, *o.shape[1:]) for o in outputs])
    if first is None:
        return None
    if isinstance(first, tuple | list):
        return type(first)(_stack_outputs(list(parts), rows) for parts in zip(*outputs, strict=True))
    if isinstance(first, dict):
        return type(first)({k: _stack_outputs([o[k] for o in outputs], rows) for k in first})
    raise TypeError(f"stacked forward cannot join outputs of type {type(first).__name__}")


def _linear_all_groups(module: nn.Linear, x: torch.Tensor, groups: list[Terms], shifted, directions) -> torch.Tensor:
    """Every group's ``x W_g^T + b_g``, group-major, from one matrix product (the groups share the input ``x``).

    ``shifted(name, terms)``: the parameter ``name`` plus ``sum terms``; ``directions(name, seeds)``: its ``z`` of
    each seed, stacked ``[len(seeds), ...]`` (drawn together).
    When the groups share their terms but one each (the two-point pairs ``+-mu z_r``), by linearity
    ``y_g = x W_0^T + b_0 + c_g (x Z_{k_g}^T + z^b_{k_g})`` with ``W_0 = W + shared terms``: one product with
    ``(1 + K) out`` columns (``K`` distinct directions) instead of ``G out``. Else ``x [W_1; ...; W_G]^T``."""
    count, out = len(groups), module.out_features
    shared = [t for t in groups[0] if all(t in g for g in groups)]
    rest = [[t for t in g if t not in shared] for g in groups]
    if all(len(r) <= 1 for r in rest):
        seeds = list(dict.fromkeys(r[0][0] for r in rest if r))
        weight = torch.cat([shifted("weight", shared), directions("weight", seeds).flatten(0, 1)])
        bias = None if module.bias is None else torch.cat([shifted("bias", shared),
                                                           directions("bias", seeds).flatten(0, 1)])
        y = nn.functional.linear(x, weight, bias).unflatten(-1, (1 + len(seeds), out))
        blocks = y.movedim(-2, 0).contiguous()  # [1 + K, ..., out]: y_0, then x Z_k^T + z^b_k
        which = [1 + seeds.index(r[0][0]) if r else 0 for r in rest]
        coeff = torch.tensor([r[0][1] if r else 0.0 for r in rest], dtype=y.dtype, device=y.device)
        ones = [1] * (blocks.dim() - 1)
        if which == [1 + g // 2 for g in range(count)]:  # the pairs +-c z_k of each direction, in order: broadcast
            stacked_y = torch.addcmul(blocks[0], coeff.view(-1, 2, *ones), blocks[1:, None]).flatten(0, 1)
        else:
            index = torch.tensor(which, device=y.device)
            stacked_y = torch.addcmul(blocks[0], coeff.view(-1, *ones), blocks.index_select(0, index))
    else:
        weight = torch.cat([shifted("weight", terms) for terms in groups])  # [G out, in]
        bias = None if module.bias is None else torch.cat([shifted("bias", terms) for terms in groups])
        stacked_y = nn.functional.linear(x, weight, bias).unflatten(-1, (count, out)).movedim(-2, 0)
    return stacked_y.reshape(count * x.shape[0], *stacked_y.shape[2:])


def _count(usage: dict | None, key: str, index: int) -> None:
    if usage is not None:
        usage.setdefault(key, set()).add(index)


def kept_buffer(scratch: dict | None, key, like: torch.Tensor) -> torch.Tensor | None:
    """A tensor shaped like ``like`` kept in ``scratch`` under ``key`` from one call to the next (``None`` without
    ``scratch``: the operation allocates)."""
    if scratch is None:
        return None
    if key not in scratch or scratch[key].shape != like.shape or scratch[key].dtype != like.dtype:
        scratch[key] = torch.empty_like(like)
    return scratch[key]


def _linear_per_group(module: nn.Linear, x: torch.Tensor, count: int, weights) -> torch.Tensor:
    """``x_g W_g^T + b_g`` for the ``count`` groups' slices ``x_g`` of a stacked input, in one batched matrix
    product. ``weights(name)``: the groups' values of parameter ``name`` stacked ``[G, ...]``."""
    x3 = x.reshape(count, -1, x.shape[-1])
    weight = weights("weight").transpose(1, 2)
    y = torch.bmm(x3, weight) if module.bias is None else torch.baddbmm(weights("bias").unsqueeze(1), x3, weight)
    return y.reshape(*x.shape[:-1], module.out_features)


def rows_read(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted rows a lookup of ``ids`` reads and ``ids``' positions among them; a negative id raises IndexError
    as a plain lookup does (indexing the rows would wrap it)."""
    used, inverse = ids.unique(return_inverse=True)
    if len(used) and int(used[0]) < 0:
        raise IndexError(f"index {int(used[0])} is out of range of the embedding")
    return used, inverse


def _embedding_per_group(module: nn.Embedding, ids: torch.Tensor, count: int, rows: int, rows_of) -> torch.Tensor:
    """Each group's lookup of its slice of a stacked ``ids`` (or of all of a shared ``ids``) in its own table, of
    which only the rows it reads are formed: ``rows_of(g, used) -> [len(used), dim]``."""
    stacked_ids = ids.dim() > 0 and ids.shape[0] == count * rows
    out = []
    for g in range(count):
        part = ids[g * rows : (g + 1) * rows] if stacked_ids else ids
        used, inverse = rows_read(part)
        out.append(nn.functional.embedding(inverse, rows_of(g, used)))
    return torch.cat(out) if stacked_ids else _stack_outputs(out, rows)


@contextlib.contextmanager
def stacked(table: ParameterTable, groups: list[Terms], rows: int, usage: dict | None = None,
            bases: list | None = None, cache: dict | None = None, per_group_products: bool = False,
            scratch: dict | None = None, rows_of: dict | None = None):
    """Forwards evaluate ``G = len(groups)`` models at once: group ``g`` at ``w + sum groups[g]``, its
    outputs stacked group-major (leading dimension ``G * rows``); each owning module draws a direction once
    for all groups.

    ``bases`` (per parameter ``j`` a tensor ``[G, ...]``, no gradients): group ``g`` is evaluated at
    ``bases[j][g] + sum groups[g]`` instead (the clients' local models, as ``base`` in :func:`perturbed`).
    ``cache``: directions kept by seed for all modules (else each module keeps its own for the call).
    ``per_group_products``: on a stacked input, a plain ``nn.Linear`` makes one batched matrix product over the
    groups and a plain ``nn.Embedding`` forms only the rows each group reads, instead of running once per group
    (the clients' different models in one forward). ``scratch``: a dict that keeps the memory of those stacked
    weights from one forward to the next (a fresh allocation costs more than the sum written into it).
    ``rows_of[j](g, rows, terms)``: rows ``rows`` of group ``g``'s parameter ``j`` plus ``sum terms``, for an
    embedding table ``bases`` does not hold (``bases[j]`` is ``None``). ``usage`` also collects the parameter
    indices read by rows (``"read_by_rows"``) and whole (``"read_whole"``).
    """
    owned_by = {id(module): owned for module, owned in table.owners}
    tied: dict = {}  # tied parameters' directions, drawn once for all their owners
    directions, count = table.directions, len(groups)

    def wrap(module, forward):
        plain = "forward" not in module.__dict__
        plain_linear = type(module).forward is nn.Linear.forward and plain
        plain_embedding = type(module).forward is nn.Embedding.forward and plain and module.max_norm is None

        def group_forward(*args, **kwargs):
            owned = owned_by[id(module)]
            originals = {name: module._parameters[name] for name, _ in owned}
            kept = {}  # this module's directions, drawn once for all groups
            for _, index in owned:
                table.reached.add(index)

            cache_of = {name: (index, cache if cache is not None else tied if index in table.tied else kept)
                        for name, index in owned}

            def source(name: str, g: int | None) -> torch.Tensor:
                if bases is None:
                    return originals[name]
                held = None if g is None else bases[cache_of[name][0]]
                if held is None:  # only a group's own weights stand for it (never ``w``)
                    raise RuntimeError(f"stacked forward: {name!r} of {type(module).__name__} is needed whole for "
                                       f"group {g}, and the groups' local models hold it by rows only")
                return held[g]

            def shifted(name: str, terms: Terms, g: int | None = None) -> torch.Tensor:
                if name not in cache_of:  # a frozen parameter of the module
                    return getattr(module, name)
                index, kept_draws = cache_of[name]
                start = source(name, g)
                if not terms and start is not originals[name]:
                    return start.to(originals[name].dtype)
                return directions.perturb(start, index, terms, kept_draws).to(originals[name].dtype)

            def stacked_weights(name: str) -> torch.Tensor:
                if bases is not None and name in cache_of and all(terms == groups[0] for terms in groups):
                    # the groups' local models plus one shared sum, in one broadcast add (perturb's arithmetic)
                    index, kept_draws = cache_of[name]
                    total = directions.total(originals[name], index, groups[0], kept_draws,
                                             out=kept_buffer(scratch, (index, "sum"), originals[name]))
                    return torch.add(bases[index], total, out=kept_buffer(scratch, (index, "stacked"), bases[index]))
                return torch.stack([shifted(name, groups[g], g) for g in range(count)])

            def group_rows(g: int, used: torch.Tensor) -> torch.Tensor:
                index, kept_draws = cache_of["weight"]
                if rows_of and index in rows_of:
                    return rows_of[index](g, used, groups[g]).to(originals["weight"].dtype)
                return directions.perturb_rows(source("weight", g), index, groups[g], used,
                                               kept_draws).to(originals["weight"].dtype)

            def drawn(name: str, seeds: list[int]) -> torch.Tensor:
                if name not in cache_of:
                    frozen = getattr(module, name)
                    return frozen.new_zeros((len(seeds), *frozen.shape))
                index, cache = cache_of[name]
                return directions.stacked_draws(originals[name], index, seeds, cache)

            def weights(g: int) -> dict:
                return {name: shifted(name, groups[g], g) for name, _ in owned}

            def run(g: int, call_args, call_kwargs):
                module._parameters.update(weights(g))
                _GROUP.index = g
                try:
                    return forward(*call_args, **call_kwargs)
                finally:
                    _GROUP.index = None

            try:
                current = getattr(_GROUP, "index", None)
                if current is not None:  # inside an enclosing owner's group
                    module._parameters.update(weights(current))
                    return forward(*args, **kwargs)
                tensors = [v for v in [*args, *kwargs.values()] if torch.is_tensor(v) and v.dim() > 0]
                single = len(args) == 1 and not kwargs and torch.is_tensor(args[0])
                if per_group_products and single and plain_embedding and "weight" in cache_of:
                    _count(usage, "read_by_rows", cache_of["weight"][0])
                    return _embedding_per_group(module, args[0], count, rows, group_rows)
                for _, index in owned:
                    _count(usage, "read_whole", index)
                if any(v.shape[0] == count * rows for v in tensors):
                    if per_group_products and single and plain_linear and args[0].dim() > 1:
                        return _linear_per_group(module, args[0], count, stacked_weights)
                    return _stack_outputs([run(g, [_part(a, count, rows, g) for a in args],
                                               {k: _part(v, count, rows, g) for k, v in kwargs.items()})
                                           for g in range(count)], rows)
                if (plain_linear and bases is None and len(args) == 1 and not kwargs  # by linearity around w
                        and torch.is_tensor(args[0]) and args[0].dim() > 1 and args[0].shape[0] == rows):
                    if usage is not None:
                        usage["shared_products"] = usage.get("shared_products", 0) + 1
                    return _linear_all_groups(module, args[0], groups, shifted, drawn)
                return _stack_outputs([run(g, args, kwargs) for g in range(count)], rows)
            finally:
                module._parameters.update(originals)

        return group_forward

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


def antithetic(table: ParameterTable, base: Terms, seed: int, mu: float, batch: int):
    """Forwards of a doubled batch ``[x; x]`` (``batch`` rows): the first half is evaluated at
    ``w + base + mu z``, the second at ``w + base - mu z``; each owning module draws its ``z`` once for both
    halves (one generator pass for the two evaluations of a two-point estimate). :func:`stacked` with two
    groups; the trainer checks the result against two plain forwards once."""
    return stacked(table, [[*base, (seed, mu)], [*base, (seed, -mu)]], batch // 2)
