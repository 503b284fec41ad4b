"""Seeded stochastic rounding of the update into weights held in bfloat16 or float16 (``update_rounding``).

Why: ``w <- w - lr g`` computed in float32 and rounded to the nearest bfloat16 loses every step smaller than half the
spacing of bfloat16 around ``w`` (``|w| 2^-9``): with a MeZO-sized ``lr = 1e-6`` almost no weight moves, silently.
Rounding up with probability ``p = (x - lo) / (hi - lo)`` (``lo <= x <= hi`` the two neighbours of the float32
result ``x`` in the narrow dtype) and down otherwise makes the stored weight equal ``x`` in expectation, so small
steps accumulate over rounds as in float32.

Reproducible: the rounding bits of tensor ``j`` in an update are the counter stream's SplitMix64 words
(``counter.mix``) of the key ``tensor_seed(rounding_key(terms), j)``, where ``rounding_key`` hashes the update's
direction seeds with a tag of its own (no direction draws the same words). Element ``k`` takes 16 bits of word
``k // 4`` (bits ``16 (k mod 4)`` and up): a pure function of the round's seeds and the element's position, so every
party, every device and the ledger's replay round the same elements the same way (integer arithmetic only).

bfloat16 (float32's upper 16 bits): ``bits(x) + r`` with ``r`` uniform in ``[0, 2^16)``, truncated to the upper 16
bits, rounds up exactly when ``r >= 2^16 - low16(x)``, i.e. with probability ``low16(x) / 2^16 = p``: exact for every
finite float32. float16: the neighbour below and the spacing at ``x`` in float32 arithmetic, up when
``u = r 2^-16 < p``; exact where ``p`` has at most 16 bits (normal float16 values: 13), within ``2^-16`` of ``p``
for float16 subnormals. Other dtypes (float32, float64) are written as before, rounded to nearest once.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from .counter import _lsr, mix
from .directions import Terms, tensor_seed

ROUNDINGS = ("stochastic", "nearest")
STOCHASTIC_DTYPES = (torch.bfloat16, torch.float16)
TAG = 0x524F554E44  # "ROUND": the rounding keys' own entry, apart from every direction seed tuple
CHUNK = 1 << 20  # elements rounded at a time (the bits and temporaries of one chunk stay in cache-sized memory)


def rounds_stochastically(dtype: torch.dtype, rounding: str) -> bool:
    """Whether an update into weights of ``dtype`` is rounded stochastically under ``update_rounding=rounding``."""
    return rounding == "stochastic" and dtype in STOCHASTIC_DTYPES


def rounding_key(terms: Terms, salt: int = 0) -> int:
    """The 63-bit key of an update's rounding bits: its direction seeds (one update per round, new seeds every round)
    hashed with :data:`TAG` and ``salt`` (an update without seeded terms: its step count)."""
    state = np.random.SeedSequence([TAG, int(salt), *(int(seed) for seed, _ in terms)]).generate_state(2, np.uint32)
    return ((int(state[0]) << 32) | int(state[1])) >> 1


def uniform_bits(key: int, start: int, count: int, device) -> torch.Tensor:
    """Bits 16 of elements ``start .. start + count - 1`` (``start`` a multiple of 4): int32 in ``[0, 2^16)``, element
    ``k`` the 16 bits ``16 (k mod 4) ..`` of ``mix(key, k // 4)`` (on a little-endian machine, the word's int16 view;
    half the operations of shifting each part out)."""
    words = mix(key, torch.arange(start // 4, (start + count + 3) // 4, dtype=torch.int64, device=device))
    if sys.byteorder == "little":
        return words.view(torch.int16)[:count].to(torch.int32) & 0xFFFF
    parts = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF, (words >> 32) & 0xFFFF, _lsr(words, 48)], dim=1)
    return parts.reshape(-1)[:count].to(torch.int32)


def _round_bfloat16(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return ((x.view(torch.int32) + r) >> 16).to(torch.int16).view(torch.bfloat16)


def _round_float16(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``lo`` or ``lo + s``: ``s`` the float16 spacing at ``x`` (``2^(e - 10)`` for ``|x|`` in ``[2^e, 2^(e+1))``,
    ``2^-24`` below ``2^-14``), ``lo`` the neighbour below; all float32 arithmetic exact (``x - lo < s``)."""
    exponent = ((x.view(torch.int32) >> 23) & 0xFF) - 127
    spacing = ((exponent.clamp(min=-14) - 10 + 127) << 23).view(torch.float32)
    near = x.to(torch.float16).float()
    lo = torch.where(near > x, near - spacing, near)
    p = (x - lo) / spacing  # 0 where x is representable; NaN (kept as lo) for NaN, and beyond the largest float16
    return torch.where(r.float() * (1.0 / 65536.0) < p, lo + spacing, lo).to(torch.float16)


def stochastic_round_(param: torch.Tensor, value: torch.Tensor, key: int) -> None:
    """``param <- SR(value)``: the float32 ``value`` (shaped like ``param``) rounded stochastically into ``param``
    (bfloat16 or float16), with the bits of ``key`` (module docstring)."""
    if param.dtype not in STOCHASTIC_DTYPES or value.dtype != torch.float32 or value.shape != param.shape:
        raise ValueError(f"stochastic rounding writes float32 values into {', '.join(map(str, STOCHASTIC_DTYPES))} "
                         f"tensors of their shape; got {value.dtype} {tuple(value.shape)} into {param.dtype} "
                         f"{tuple(param.shape)}.")
    flat_value = value.reshape(-1)
    target = param if param.is_contiguous() else torch.empty_like(param, memory_format=torch.contiguous_format)
    flat = target.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        x = flat_value[start : start + CHUNK]
        r = uniform_bits(key, start, x.numel(), x.device)
        flat[start : start + CHUNK] = (_round_bfloat16(x.contiguous(), r) if param.dtype == torch.bfloat16
                                       else _round_float16(x, r))
    if target is not param:
        param.copy_(target)


def stochastic_round(value: torch.Tensor, dtype: torch.dtype, key: int) -> torch.Tensor:
    """A new ``dtype`` tensor: :func:`stochastic_round_` of the float32 ``value``."""
    out = torch.empty(value.shape, dtype=dtype, device=value.device)
    stochastic_round_(out, value, key)
    return out


def tensor_key(key: int, index: int) -> int:
    """The rounding bits' key of parameter ``index`` in an update keyed ``key``."""
    return tensor_seed(key, index)
