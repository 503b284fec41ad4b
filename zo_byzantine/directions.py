"""Direction generators: how tensor ``z_j`` of the direction with seed ``s`` is drawn, and the fused sums
``w + sum_k c_k z_k`` every perturbed forward, update and ledger replay is made of (SPEC 1.2).

``counter`` (default): element ``k`` of ``z_j`` is a pure function of ``(s, j, k)``: a SplitMix64 hash of
a counter (``counter.c``), then Box-Muller (``gaussian``) or one bit (``rademacher``). The transform uses
+, -, *, / and sqrt only (ln, sin and cos are fixed polynomials), each rounded once, so the bits are the
same on every IEEE-754 device, CPU or GPU, compiled kernel or plain torch. Gaussian values lie within
|z| <= 5.77 (u >= 2^-24, as any float32 Box-Muller); they differ from float64 Box-Muller of the same words
by less than 2e-6 relative (test), far below what the estimator can see: ``E[z] = 0`` and ``E[z z^T] = I``
are what it needs.

``torch`` (version 1): ``torch.randn`` from a CPU ``torch.Generator`` per tensor, the stream of runs made
before the counter generator (their ledgers replay with it). Drawn on the CPU and copied to the parameter's
device: torch's CUDA generator (Philox) gives other numbers than the CPU one (MT19937) for the same seed.

A ledger records ``describe()`` of its run's generator; ``from_description`` rebuilds it.
"""

from __future__ import annotations

import numpy as np
import torch

from . import native
from .counter import _MASK64, GAMMA, MIX1, MIX2, counter_streams, counter_values
from .validation import check_choice

BLOCK_VALUES = 1 << 26  # a sum's directions drawn together, at most this many values (256 MB) at a time
ROW_CHUNK = 1 << 16  # elements per chunk of a rows draw: its int64 temporaries stay a few MB
DISTRIBUTIONS = ("gaussian", "rademacher")
Terms = list[tuple[int, float]]  # (direction seed, coefficient) pairs: sum_k c_k z_k


def direction_seed(*key: int) -> int:
    """Map the seed tuple ``(s, t, l, r)`` (``(s, t, l, r, client)`` for per-client directions) to a 63-bit
    direction seed (SPEC 1.2)."""
    state = np.random.SeedSequence([int(k) for k in key]).generate_state(2, np.uint32)
    return ((int(state[0]) << 32) | int(state[1])) & (_MASK64 >> 1)


def tensor_seed(seed: int, index: int) -> int:
    """SplitMix64 of ``seed + (index + 1) * GAMMA``: the key of tensor ``index`` of a direction (63 bits)."""
    x = (seed + (index + 1) * GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * MIX2) & _MASK64
    return (x ^ (x >> 31)) & (_MASK64 >> 1)


class GeneratorCounter:
    """Counts direction values drawn, to report generator passes (``drawn / d``) per round."""

    def __init__(self) -> None:
        self.drawn = 0

    def add(self, n: int) -> None:
        self.drawn += n


COUNTER = GeneratorCounter()


class Directions:
    """A direction generator. ``name``/``version``/``distribution`` identify its stream (``describe()``)."""

    name: str
    version: int
    distribution: str = "gaussian"
    threads_per_tensor = False  # True: calls use several threads themselves (do not map tensors over a pool)
    draws_rows = False  # True: ``draw_rows`` draws only the rows asked for (else it draws the whole tensor)

    def identity(self) -> tuple[str, int, str]:
        """``(name, version, distribution)``: what a plan names and a client must reproduce."""
        return self.name, self.version, self.distribution

    def describe(self) -> dict:
        """:meth:`identity` by field name, as a ledger records it."""
        return dict(zip(("name", "version", "distribution"), self.identity(), strict=True))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"

    def kept_bytes(self, params) -> int:
        """Bytes one whole direction takes when kept (the ``cached`` schedule)."""
        return sum(p.numel() * self.value_size(p) for p in params)

    def value_size(self, param: torch.Tensor) -> int:
        return param.element_size()

    def fused(self, param: torch.Tensor) -> bool:
        """Whether sums over ``param`` are drawn and added in one pass (then regenerating a direction costs less
        than reading a kept one, and ``zo_schedule="auto"`` does not keep them)."""
        return False

    def draw(self, like: torch.Tensor, seed: int, index: int) -> torch.Tensor:
        """``z_index`` of direction ``seed``, shaped like ``like``, on its device."""
        raise NotImplementedError

    def draw_many(self, like: torch.Tensor, seeds: list[int], index: int) -> torch.Tensor:
        """``[len(seeds), *like.shape]``: :meth:`draw` of each seed (a generator may draw them together)."""
        if not seeds:
            return torch.empty((0, *like.shape), dtype=like.dtype, device=like.device)
        return torch.stack([self.draw(like, seed, index) for seed in seeds])

    def stacked_draws(self, like: torch.Tensor, index: int, seeds: list[int], cache: dict | None = None
                      ) -> torch.Tensor:
        """``[len(seeds), *like.shape]`` in ``like``'s dtype: ``total(like, index, [(s, 1.0)], cache)`` of each seed
        (the same values: ``z * 1`` is exact). When ``cache`` holds none of them they are drawn together and not
        kept (kept rows of one block would keep the whole block alive); else as :meth:`_drawn`."""
        if cache is None or not any((seed, index) in cache for seed in seeds):
            unique = list(dict.fromkeys(seeds))
            block = self.draw_many(like, unique, index)
            if len(unique) < len(seeds):
                block = block[[unique.index(seed) for seed in seeds]]
            return block.to(like.dtype)
        drawn = self._drawn(like, index, seeds, cache)
        return torch.stack([drawn[seed] for seed in seeds]).to(like.dtype)

    def _drawn(self, like: torch.Tensor, index: int, seeds: list[int], cache: dict | None) -> dict:
        """``{seed: z_index}``: what ``cache`` keeps, the others drawn together by :meth:`draw_many` and kept in
        ``cache`` when given, each in memory of its own (a cache pruned seed by seed then frees it)."""
        held = {} if cache is None else {s: cache[(s, index)] for s in seeds if (s, index) in cache}
        missing = [s for s in dict.fromkeys(seeds) if s not in held]
        if missing:
            block = self.draw_many(like, missing, index)
            for seed, z in zip(missing, block, strict=True):
                held[seed] = z if cache is None or len(missing) == 1 else z.clone()
                if cache is not None:
                    cache[(seed, index)] = held[seed]
        return held

    def total(self, like: torch.Tensor, index: int, terms: Terms, cache: dict | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_k c_k z_k[index]`` in ``like``'s dtype. ``cache`` (a dict): each ``z`` drawn once, kept there.
        ``out``: a tensor like ``like`` to write the sum into (no new memory for it; not for no terms)."""
        raise NotImplementedError

    def perturb(self, param: torch.Tensor, index: int, terms: Terms, cache: dict | None = None) -> torch.Tensor:
        """``param + sum_k c_k z_k[index]`` as a new tensor (gradients flow to ``param``)."""
        raise NotImplementedError

    def perturb_(self, copy: torch.Tensor, index: int, terms: Terms, cache: dict | None = None) -> None:
        """In place: ``copy <- perturb(copy, index, terms, cache)``, the same bits, into a streamed layer's private
        copy (no second copy of it; never a weight)."""
        copy.copy_(self.perturb(copy, index, terms, cache))

    def step_(self, param: torch.Tensor, index: int, terms: Terms, lr: float, cache: dict | None = None) -> None:
        """In place: ``param <- param - lr sum_k c_k z_k[index]``; the only write to the weights."""
        raise NotImplementedError

    def draw_rows(self, like: torch.Tensor, seed: int, index: int, rows: torch.Tensor) -> torch.Tensor:
        """``draw(like, seed, index)[rows]`` (rows of the leading dimension)."""
        return self.draw(like, seed, index)[rows]

    def perturb_rows(self, source: torch.Tensor, index: int, terms: Terms, rows: torch.Tensor,
                     cache: dict | None = None) -> torch.Tensor:
        """``perturb(source, index, terms, cache)[rows]``, summing only those rows (an embedding table's rows a
        forward reads): the kept directions (``cache``; drawn whole once) are gathered, or without a cache only
        those rows are drawn (where ``draws_rows``), and summed by the same elementwise arithmetic, so the values
        are the same bits."""
        if not terms:
            return source[rows]
        if cache is None and not self.draws_rows:
            return self.perturb(source, index, terms)[rows]
        if cache is None:  # only those rows drawn
            gathered = {(seed, index): self.draw_rows(source, seed, index, rows) for seed in dict.fromkeys(
                seed for seed, _ in terms)}
        else:
            drawn = self._drawn(source, index, [seed for seed, _ in terms], cache)
            gathered = {(seed, index): z[rows] for seed, z in drawn.items()}
        return self.perturb(source[rows], index, terms, gathered)


class TorchDirections(Directions):
    """``z_j = torch.randn`` from a CPU ``torch.Generator(seed=tensor_seed(s, j))``, moved to the parameter's
    device: torch's CUDA generator gives other numbers than its CPU one for the same seed (measured on an H100),
    so drawing on the CPU keeps a run's ledger replayable on any device, at the cost of a host-to-device copy."""

    name, version = "torch", 1

    def draw(self, like, seed, index):
        generator = torch.Generator()
        generator.manual_seed(tensor_seed(seed, index))
        COUNTER.add(like.numel())
        return torch.randn(like.shape, generator=generator, dtype=like.dtype).to(like.device)

    def total(self, like, index, terms, cache=None, out=None):
        result = None
        for seed, coeff in terms:
            z = self._drawn(like, index, [seed], cache)[seed]
            if result is None and out is not None:
                result = torch.mul(z, coeff, out=out)
                continue
            z = z if cache is None else z.clone()
            if result is None:
                result = z.mul_(coeff)
            else:
                result.add_(z, alpha=coeff)
        return result

    def perturb(self, param, index, terms, cache=None):
        if not terms:  # no direction: the weights themselves (a copy, as with terms)
            return param.clone()
        return param + self.total(param.detach(), index, terms, cache)

    def step_(self, param, index, terms, lr, cache=None):
        param.add_(self.total(param, index, terms, cache), alpha=-lr)


class CounterDirections(Directions):
    """The counter-based stream (module docstring); sums fused in one pass by the compiled CPU kernel.

    Arithmetic of every sum, in the compute type ``T`` (float64 for float64 parameters, else float32):
    ``acc = T(z_0) c_0``, ``acc = acc + T(z_k) c_k`` in the order of the terms, ``out = dtype(T(p) + acc)``.
    The kernel and the plain-torch path (other devices, cached directions, gradients) follow it exactly.
    """

    name, version = "counter", 1
    threads_per_tensor = True
    draws_rows = True

    def __init__(self, distribution: str = "gaussian"):
        check_choice("zo_distribution", distribution, DISTRIBUTIONS)
        self.distribution = distribution

    def value_size(self, param):
        return 4  # draws are float32

    @staticmethod
    def _compute_type(param: torch.Tensor) -> torch.dtype:
        return torch.float64 if param.dtype == torch.float64 else torch.float32

    @staticmethod
    def _native(param: torch.Tensor) -> bool:
        return (param.device.type == "cpu" and param.is_contiguous() and param.is_floating_point()
                and native.library() is not None)

    def fused(self, param):
        return self._native(param)

    def draw_rows(self, like, seed, index, rows):
        """Only those rows' elements are drawn (element ``k`` depends on ``(seed, index, k)`` alone), a chunk of
        rows at a time: the int64 indices and the transform's temporaries of all rows at once (a few thousand rows of
        a 576-wide table) would be ten times the rows' own size."""
        self._real(like)
        width = like[0].numel()
        rows = rows.to(like.device, torch.int64)
        out = torch.empty(len(rows), width, dtype=torch.float32, device=like.device)
        if self._native(like):  # the kernel, row by row
            native.generate_rows(out, rows.contiguous(), tensor_seed(seed, index), self.distribution == "gaussian")
            COUNTER.add(out.numel())
            return out.view(len(rows), *like.shape[1:])
        step = max(1, ROW_CHUNK // width)
        columns = torch.arange(width, device=like.device)
        for start in range(0, len(rows), step):
            elements = (rows[start : start + step, None] * width + columns).reshape(-1)
            out[start : start + step] = counter_values(tensor_seed(seed, index), elements,
                                                       self.distribution).view(-1, width)
        COUNTER.add(out.numel())
        return out.view(len(rows), *like.shape[1:])

    def draw(self, like, seed, index):
        return self.draw_many(like, [seed], index)[0]

    def draw_many(self, like, seeds, index):
        """The compiled kernel one seed after the other; the plain path all seeds in the same operations
        (:func:`counter_streams`)."""
        self._real(like)
        keys = [tensor_seed(seed, index) for seed in seeds]
        COUNTER.add(like.numel() * len(keys))
        if self._native(like):
            out = torch.empty(len(keys), *like.shape, dtype=torch.float32)
            for row, key in zip(out, keys, strict=True):
                native.generate(row, key, self.distribution == "gaussian")
            return out
        return counter_streams(keys, like.numel(), self.distribution, like.device).view(len(keys), *like.shape)

    @staticmethod
    def _real(param: torch.Tensor) -> torch.Tensor:
        if not param.is_floating_point():
            raise ValueError(f"zo_generator='counter' draws real directions; a trainable tensor of dtype {param.dtype} "
                             "cannot be perturbed by it (train real parameters, e.g. through view_as_real).")
        return param

    def _accumulate(self, like, index, terms, cache, out=None):
        if not terms:
            return torch.zeros_like(like)
        ct, acc = self._compute_type(self._real(like)), None
        per_block = 1 if self._native(like) else max(1, BLOCK_VALUES // max(1, like.numel()))
        for start in range(0, len(terms), per_block):
            block = terms[start : start + per_block]
            drawn = self._drawn(like, index, [seed for seed, _ in block], cache)
            for seed, coeff in block:
                z = drawn[seed].to(ct)
                if acc is None:
                    acc = z * coeff if out is None or out.dtype != ct else torch.mul(z, coeff, out=out)
                else:
                    acc = acc.add_(z * coeff) if acc is out else acc + z * coeff
        return acc

    def _fused(self, base: torch.Tensor, out: torch.Tensor, index: int, terms: Terms) -> None:
        COUNTER.add(base.numel() * len(terms))
        native.combine(base, out, [tensor_seed(s, index) for s, _ in terms], [float(c) for _, c in terms],
                       self.distribution == "gaussian")

    def total(self, like, index, terms, cache=None, out=None):
        return self._accumulate(like, index, terms, cache, out).to(like.dtype)

    def _kernel_sum(self, base: torch.Tensor, index: int, terms: Terms, in_place: bool) -> torch.Tensor:
        """``dtype(T(base) + sum_k c_k z_k)`` by the kernel, into ``base`` itself when ``in_place``."""
        ct = self._compute_type(base)
        if base.dtype == ct:
            out = base if in_place else torch.empty_like(base)
            self._fused(base, out, index, terms)
            return out
        work = base.to(ct)
        self._fused(work, work, index, terms)
        return base.copy_(work) if in_place else work.to(base.dtype)

    def perturb(self, param, index, terms, cache=None):
        ct = self._compute_type(self._real(param))
        if not terms:
            return param.clone()
        if cache is None and self._native(param) and not (torch.is_grad_enabled() and param.requires_grad):
            return self._kernel_sum(param.detach(), index, terms, in_place=False)
        return (param.to(ct) + self._accumulate(param.detach(), index, terms, cache)).to(param.dtype)

    def perturb_(self, copy, index, terms, cache=None):
        if terms and cache is None and self._native(copy):
            self._kernel_sum(copy, index, terms, in_place=True)  # the kernel's in-place sum: perturb's bits
        else:
            super().perturb_(copy, index, terms, cache)

    def rounds_fused(self, param: torch.Tensor, cache: dict | None) -> bool:
        """Whether :meth:`step_rounded_` can write ``param``: bfloat16 on the CPU, the compiled kernel, no kept
        directions."""
        return cache is None and param.dtype == torch.bfloat16 and self._native(param)

    def step_rounded_(self, param: torch.Tensor, index: int, terms: Terms, lr: float, decay: float,
                      round_key: int) -> None:
        """In place, one pass: ``param <- SR(T(param) (1 - lr decay) - lr sum_k c_k z_k)``, the bits of
        ``rounding.stochastic_round_`` of the float32 update with key ``round_key`` (the kernel's
        ``zo_step_rounded_bf16``); where :meth:`rounds_fused`."""
        COUNTER.add(param.numel() * len(terms))
        native.step_rounded_bf16(param.detach(), [tensor_seed(s, index) for s, _ in terms],
                                 [-lr * c for _, c in terms], (1.0 - lr * decay) if decay else None, round_key,
                                 self.distribution == "gaussian")
        torch.autograd.graph.increment_version(param)  # written through a pointer: tell autograd

    def step_(self, param, index, terms, lr, cache=None):
        self._real(param)
        if not terms:
            return
        scaled = [(s, -lr * c) for s, c in terms]
        if cache is None and self._native(param):
            self._kernel_sum(param.detach(), index, scaled, in_place=True)
            torch.autograd.graph.increment_version(param)  # written through a pointer: tell autograd
        else:
            param.copy_(self.perturb(param.detach(), index, scaled, cache))


GENERATORS = ("counter", "torch")


def build_directions(name: str = "counter", distribution: str = "gaussian") -> Directions:
    """The generator ``name`` (``zo_generator``) with ``distribution`` (``zo_distribution``)."""
    check_choice("zo_generator", name, GENERATORS)
    if name == "torch":
        check_choice("zo_distribution (zo_generator='torch' draws Gaussian directions only)", distribution,
                     ("gaussian",))
        return TorchDirections()
    return CounterDirections(distribution)


def from_description(description: dict) -> Directions:
    """The generator a ledger names (``ledger.generator_of`` gives ``torch`` v1 for ledgers without one)."""
    generator = build_directions(description.get("name"), description.get("distribution", "gaussian"))
    if description.get("version") != generator.version:
        raise ValueError(f"The ledger's direction generator {description} has version {description.get('version')!r}; "
                         f"this zo_byzantine has {generator.describe()}: it cannot reproduce those directions.")
    return generator
