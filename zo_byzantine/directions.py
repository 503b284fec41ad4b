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

import math

import numpy as np
import torch

from . import native
from .validation import check_choice

_MASK64 = (1 << 64) - 1
GAMMA, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
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


def _signed(value: int) -> int:
    """A 64-bit pattern as torch's int64 (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix(key: int | torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """``splitmix64(key + (pair + 1) GAMMA)`` for int64 ``pairs``, as int64 bit patterns (wrapping arithmetic);
    ``key`` an int or an int64 tensor of one key per pair."""
    x = (pairs + 1) * _signed(GAMMA) + (key if torch.is_tensor(key) else _signed(key))
    x = (x ^ _lsr(x, 30)) * _signed(MIX1)
    x = (x ^ _lsr(x, 27)) * _signed(MIX2)
    return x ^ _lsr(x, 31)


def _gaussian_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Box-Muller of one 64-bit word per pair, operation for operation as ``counter.c``."""
    f32 = torch.float32
    n = (_lsr(x, 40) + 1).to(f32)  # u = n 2^-24 in (0, 1]
    bits = n.view(torch.int32)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(f32)  # n = m 2^e, m in [1, 2)
    big = m > math.sqrt(2.0)
    m = torch.where(big, m * 0.5, m)
    e = e + big.to(e.dtype)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    t = s2 * (1.0 / 7.0) + (1.0 / 5.0)
    for c in (1.0 / 3.0, 1.0):
        t = t * s2 + c
    lnm = (s * t) * 2.0  # ln m = 2 atanh(s)
    lnu = (e - 24).to(f32) * math.log(2.0) + lnm
    # torch's vectorised float32 sqrt is not correctly rounded (Sleef, 0.5001 ulp); the float64 sqrt rounded to
    # float32 is (53 >= 2 * 24 + 2 bits), as the kernel's sqrtf
    r = torch.sqrt((lnu * -2.0).double()).to(f32)
    lo = x & 0xFFFFFF
    o = lo >> 21  # octant of theta
    odd = (o & 1) == 1
    f = lo & 0x1FFFFF
    f = torch.where(odd, 0x1FFFFF - f, f)  # odd octants: the angle from the octant's end (exact)
    a = ((f.to(f32) + 0.5) * (1.0 / 2097152.0)) * (math.pi / 4)  # in (0, pi/4)
    a2 = a * a
    sn = a2 * (-1.0 / 5040.0) + (1.0 / 120.0)
    for c in (-1.0 / 6.0, 1.0):
        sn = sn * a2 + c
    sn = sn * a
    cs = a2 * (1.0 / 40320.0) + (-1.0 / 720.0)
    for c in (1.0 / 24.0, -1.0 / 2.0, 1.0):
        cs = cs * a2 + c
    c0, s0 = torch.where(odd, sn, cs), torch.where(odd, cs, sn)  # cos, sin of theta - q pi / 2
    q = o >> 1
    cos = torch.where(q == 0, c0, torch.where(q == 1, -s0, torch.where(q == 2, -c0, s0)))
    sin = torch.where(q == 0, s0, torch.where(q == 1, c0, torch.where(q == 2, -s0, -c0)))
    return r * cos, r * sin


def _rademacher_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    one = torch.ones((), dtype=torch.float32, device=x.device)
    return torch.where(x < 0, -one, one), torch.where(_lsr(x, 31) & 1 == 1, -one, one)


CHUNK_PAIRS = 1 << 19  # the plain path works in chunks: its ~40 temporaries stay ~100 MB, whatever the tensor
GPU_CHUNK_PAIRS = 1 << 21  # on an accelerator each of the ~60 operations is a kernel launch: larger chunks (~0.4 GB)
BLOCK_VALUES = 1 << 26  # a sum's directions drawn together, at most this many values (256 MB) at a time


def counter_stream(key: int, numel: int, distribution: str, device="cpu") -> torch.Tensor:
    """Elements ``0 .. numel-1`` of the counter stream of ``key`` (float32), in plain torch on any device with
    float64 ``sqrt`` (not MPS)."""
    return counter_streams([key], numel, distribution, device)[0]


def counter_streams(keys: list[int], numel: int, distribution: str, device="cpu",
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``[len(keys), numel]``: row ``i`` is :func:`counter_stream` of ``keys[i]``, all rows drawn by the same
    vectorised operations over the concatenated pairs of every key (an element depends on its key and position
    alone), so that many small tensors' directions cost one chunk's kernel launches, not one per key. ``out``: a
    contiguous float32 ``[len(keys), numel]`` tensor to write into."""
    pairs, count = (numel + 1) // 2, len(keys)
    device = torch.device(device) if out is None else out.device
    if out is None and count == 1 and numel % 2:  # one key: its extra element left at the end of the buffer
        work = torch.empty(2 * pairs, dtype=torch.float32, device=device)
        out = work[:numel].view(1, numel)
    else:
        out = torch.empty(count, numel, dtype=torch.float32, device=device) if out is None else out
        work = out.view(-1) if numel % 2 == 0 else torch.empty(count * 2 * pairs, dtype=torch.float32, device=device)
    transform = _gaussian_pair if distribution == "gaussian" else _rademacher_pair
    key_of = torch.tensor([_signed(k) for k in keys], dtype=torch.int64, device=device)
    chunk = CHUNK_PAIRS if device.type == "cpu" else GPU_CHUNK_PAIRS
    for start in range(0, count * pairs, chunk):
        flat = torch.arange(start, min(count * pairs, start + chunk), dtype=torch.int64, device=device)
        if count == 1:
            za, zb = transform(mix(key_of, flat))
        else:
            row = flat // pairs
            za, zb = transform(mix(key_of[row], flat - row * pairs))
        work[2 * start : 2 * start + 2 * len(flat)] = torch.stack([za, zb], dim=1).reshape(-1)
    if numel % 2 and work.data_ptr() != out.data_ptr():
        out.copy_(work.view(count, 2 * pairs)[:, :numel])
    return out


def counter_values(key: int, elements: torch.Tensor, distribution: str) -> torch.Tensor:
    """Elements ``elements`` (int64 indices) of the counter stream of ``key`` (float32): the pair of each element
    drawn as :func:`counter_stream` draws it, then the element's half."""
    transform = _gaussian_pair if distribution == "gaussian" else _rademacher_pair
    za, zb = transform(mix(key, elements // 2))
    return torch.where(elements % 2 == 0, za, zb)


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

    def step_(self, param: torch.Tensor, index: int, terms: Terms, lr: float, cache: dict | None = None) -> None:
        """In place: ``param <- param - lr sum_k c_k z_k[index]``; the only write to the weights."""
        raise NotImplementedError

    def draw_rows(self, like: torch.Tensor, seed: int, index: int, rows: torch.Tensor) -> torch.Tensor:
        """``draw(like, seed, index)[rows]`` (rows of the leading dimension)."""
        return self.draw(like, seed, index)[rows]

    def perturb_rows(self, source: torch.Tensor, index: int, terms: Terms, rows: torch.Tensor,
                     cache: dict | None = None) -> torch.Tensor:
        """``perturb(source, index, terms, cache)[rows]``, summing only those rows (an embedding table's rows a
        forward reads): the kept directions (``cache``; drawn whole once) are gathered and summed by the same
        elementwise arithmetic, so the values are the same bits."""
        if not terms:
            return source[rows]
        if cache is None:
            return self.perturb(source, index, terms)[rows]
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
        """Only those rows' elements are drawn (element ``k`` depends on ``(seed, index, k)`` alone)."""
        self._real(like)
        width = like[0].numel()
        elements = (rows.to(like.device, torch.int64)[:, None] * width
                    + torch.arange(width, device=like.device)).reshape(-1)
        COUNTER.add(elements.numel())
        values = counter_values(tensor_seed(seed, index), elements, self.distribution)
        return values.view(len(rows), *like.shape[1:])

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
