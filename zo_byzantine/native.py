"""The compiled CPU kernel of the counter-based directions (``counter.c``), built on first use.

Why by hand: the kernel is 150 lines of C with no dependency, so it is compiled with the system C compiler
into a per-user cache (``$ZO_BYZANTINE_CACHE``, default ``~/.cache/zo_byzantine``) and loaded with ctypes,
in about a second. A torch C++ extension would need torch's headers at install time (a build environment
that pulls an unpinned torch) or a JIT build of minutes; ``torch.compile`` cannot express the 64-bit
hash without overflow checks and recompiles per shape. ``-march=native`` gives the machine's vector width;
``-ffp-contract=off`` keeps every operation rounded once, so the bits do not depend on it.

No compiler, a failed build or ``ZO_BYZANTINE_NATIVE=0``: ``library()`` returns ``None`` (with one warning)
and ``directions.py`` uses its plain-torch path, which gives the same numbers.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("counter.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c11",
         "-shared", "-fPIC"]
MIN_PARALLEL = 1 << 18  # elements: below, one call on the calling thread


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), version, platform.machine(), _cpu_signature()]).encode()
    ).hexdigest()[:16]
    folder = Path(os.environ.get("ZO_BYZANTINE_CACHE", Path.home() / ".cache" / "zo_byzantine"))
    target = folder / f"counter-{digest}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then renamed: safe for parallel builds
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True,
                       timeout=300)
        os.replace(built, target)
    return target


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or ``None`` when it cannot be built here (the plain-torch path is used)."""
    if os.environ.get("ZO_BYZANTINE_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        if compiler is None:
            raise FileNotFoundError("no C compiler (cc, gcc or $CC) on PATH")
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        logger.warning("The compiled direction kernel is unavailable (%s %s); using the plain-torch path, which "
                       "gives the same numbers more slowly.", err, detail.decode(errors="replace")[-500:])
        return None
    i64, u64p, f64p, vp = ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_double), \
        ctypes.c_void_p
    for name in ("zo_combine_f32", "zo_combine_f64"):
        getattr(lib, name).argtypes = [vp, vp, i64, u64p, f64p, i64, ctypes.c_int, i64, i64]
        getattr(lib, name).restype = None
    lib.zo_generate.argtypes = [vp, i64, ctypes.c_uint64, ctypes.c_int, i64, i64]
    lib.zo_generate.restype = None
    return lib


def _new_pool() -> None:
    global _POOL
    _POOL = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1))


_new_pool()
if hasattr(os, "register_at_fork"):  # a forked child (DataLoader worker, multiprocessing) has no pool threads
    os.register_at_fork(after_in_child=_new_pool)


def _ranges(numel: int) -> list[tuple[int, int]]:
    """Pair ranges of a tensor of ``numel`` elements, one per thread (torch's thread count)."""
    pairs = (numel + 1) // 2
    parts = 1 if numel < MIN_PARALLEL else max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
    bounds = [pairs * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _run(call, numel: int) -> None:
    ranges = _ranges(numel)
    if len(ranges) == 1:
        call(*ranges[0])
    else:
        list(_POOL.map(lambda r: call(*r), ranges))


def combine(base: torch.Tensor, out: torch.Tensor, keys: list[int], coeffs: list[float], gaussian: bool) -> None:
    """``out = base + sum_k coeffs[k] z(keys[k])`` on contiguous CPU float32/float64 tensors (``out`` may be
    ``base``)."""
    lib = library()
    fn = lib.zo_combine_f64 if base.dtype == torch.float64 else lib.zo_combine_f32
    k = len(keys)
    key_array = (ctypes.c_uint64 * k)(*keys)
    coeff_array = (ctypes.c_double * k)(*coeffs)
    n, src, dst = base.numel(), base.data_ptr(), out.data_ptr()
    _run(lambda a, b: fn(src, dst, n, key_array, coeff_array, k, int(gaussian), a, b), n)


def generate(out: torch.Tensor, key: int, gaussian: bool) -> None:
    """``out = z(key)`` on a contiguous CPU float32 tensor."""
    lib, n, dst = library(), out.numel(), out.data_ptr()
    _run(lambda a, b: lib.zo_generate(dst, n, key, int(gaussian), a, b), n)
