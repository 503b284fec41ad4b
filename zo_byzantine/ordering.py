"""Sorts along one dimension, as ``torch.sort``, through NumPy's sort for CPU floats.

Why: the rules sort many short columns (CWTM and the median over 40 vectors of 7,850 values, an attacker's
search over 21 such sets); torch's CPU sort takes 10 ms for 40 x 7,850 float64 values and 240 ms for 21 sets,
NumPy's vectorised sort 1.6 and 41 ms on the same machine (one thread, ``benchmarks/README.md``). The values
are the same (NaN last; ``-0.0`` equals ``0.0``, as in torch, so the two zeros may sit in another order among
themselves than torch's unstable sort puts them), the stable order is the same (equal values keep their
positions, NaNs among NaNs as well); the result is contiguous in the input's shape, as torch's is for a
contiguous input (for a strided one torch keeps the input's strides), so sums over it have the same bits.
Other devices and dtypes, and tensors that require grad, use torch.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = (torch.float32, torch.float64)


def _on_numpy(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES and not x.requires_grad


def sort_values(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.sort(dim=dim).values``."""
    if not _on_numpy(x):
        return x.sort(dim=dim).values
    return torch.from_numpy(np.sort(x.contiguous().numpy(), axis=dim))


def argsort_stable(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.argsort(dim=dim, stable=True)`` (int64 indices)."""
    if not _on_numpy(x):
        return x.argsort(dim=dim, stable=True)
    return torch.from_numpy(np.argsort(x.contiguous().numpy(), axis=dim, kind="stable").astype(np.int64, copy=False))
