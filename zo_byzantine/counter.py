"""The counter-based stream in plain torch: element ``k`` of the stream of a 63-bit ``key`` is a pure function of
``(key, k)``. A SplitMix64 hash of the pair counter ``k // 2``, ``splitmix64(key + (k // 2 + 1) GAMMA)``, gives one
64-bit word per pair; Box-Muller (``gaussian``: ``r = sqrt(-2 ln u)``, ``(r cos theta, r sin theta)``, ln, sin and cos
as fixed polynomials) or two bits (``rademacher``) turn it into the pair's two values, operation for operation as the
compiled kernel ``counter.c`` (``native.py``), which is checked against this reference when it loads.

Any device with float64 ``sqrt`` (not MPS); the bits are the same on every IEEE-754 device.
"""

from __future__ import annotations

import math

import torch

_MASK64 = (1 << 64) - 1
GAMMA, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


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
