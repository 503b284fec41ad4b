"""The compiled CPU kernel of the counter-based directions (``counter.c``), built on first use.

Why by hand: the kernel is 150 lines of C with no dependency, so it is compiled with the system C compiler
into a per-user cache (``$ZO_BYZANTINE_CACHE``, default ``~/.cache/zo_byzantine``) and loaded with ctypes,
in about a second. A torch C++ extension would need torch's headers at install time (a build environment
that pulls an unpinned torch) or a JIT build of minutes; ``torch.compile`` cannot express the 64-bit
hash without overflow checks and recompiles per shape. ``-march=native`` gives the machine's vector width;
``-ffp-contract=off`` keeps every operation rounded once, so the bits do not depend on it.

No compiler, a failed build, a library that does not reproduce the plain-torch path bitwise on a test stream
(checked at load: a compiler whose default float model is not IEEE), or ``ZO_BYZANTINE_NATIVE=0``:
``library()`` returns ``None`` (with one warning) and ``directions.py`` uses the plain-torch path
(``counter.py``), which gives the same numbers. The kernel runs in a thread pool whose threads keep the default
floating-point mode: flushing denormals to zero in the caller (``torch.set_flush_denormal(True)``) is not applied
to it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor, wait
from functools import cache
from pathlib import Path

import torch

from .counter import counter_stream  # the plain-torch reference the kernel must reproduce

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


def _cache_folder() -> Path:
    if os.environ.get("ZO_BYZANTINE_CACHE"):
        return Path(os.environ["ZO_BYZANTINE_CACHE"])
    return Path.home() / ".cache" / "zo_byzantine"  # RuntimeError without a home: no kernel


def _build(compiler: list[str]) -> Path:
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), version, platform.machine(), _cpu_signature()]).encode()
    ).hexdigest()[:16]
    folder = _cache_folder()
    target = folder / f"counter-{digest}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then renamed: safe for parallel builds
        built = Path(tmp) / target.name
        subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True,
                       timeout=300)
        os.replace(built, target)
    return target


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or ``None`` when it cannot be built here (the plain-torch path is used)."""
    if os.environ.get("ZO_BYZANTINE_NATIVE", "1") == "0":
        return None
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    try:
        if not compiler[0]:
            raise FileNotFoundError("no C compiler (cc, gcc or $CC) on PATH")
        lib = _declare(ctypes.CDLL(str(_build(compiler))))
        _self_check(lib)
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        detail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
        logger.warning("The compiled direction kernel is unavailable (%s %s); using the plain-torch path, which "
                       "gives the same numbers more slowly.", err, detail[-500:])
        return None
    return lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, u64p, f64p, vp = ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_double), \
        ctypes.c_void_p
    for name in ("zo_combine_f32", "zo_combine_f64"):
        getattr(lib, name).argtypes = [vp, vp, i64, u64p, f64p, i64, ctypes.c_int, i64, i64]
        getattr(lib, name).restype = None
    lib.zo_generate.argtypes = [vp, i64, ctypes.c_uint64, ctypes.c_int, i64, i64]
    lib.zo_generate.restype = None
    lib.zo_generate_rows.argtypes = [vp, i64, vp, i64, i64, ctypes.c_uint64, ctypes.c_int]
    lib.zo_generate_rows.restype = None
    lib.zo_step_rounded_bf16.argtypes = [vp, i64, u64p, f64p, i64, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                                         ctypes.c_uint64, i64, i64]
    lib.zo_step_rounded_bf16.restype = None
    return lib


def _self_check(lib: ctypes.CDLL) -> None:
    """The loaded kernel must give the plain-torch path's bits (ValueError otherwise)."""
    n, keys, coeffs = 10_001, [0x0123456789ABCDEF, 42], [1e-3, -2.5]
    for gaussian, name in ((True, "gaussian"), (False, "rademacher")):
        z = torch.empty(n)
        lib.zo_generate(z.data_ptr(), n, keys[0], int(gaussian), 0, (n + 1) // 2)
        base = torch.linspace(-1, 1, n)
        out = torch.empty(n)
        lib.zo_combine_f32(base.data_ptr(), out.data_ptr(), n, (ctypes.c_uint64 * 2)(*keys),
                           (ctypes.c_double * 2)(*coeffs), 2, int(gaussian), 0, (n + 1) // 2)
        expected = base + (counter_stream(keys[0], n, name) * coeffs[0] + counter_stream(keys[1], n, name) * coeffs[1])
        if not (torch.equal(z.view(torch.int32), counter_stream(keys[0], n, name).view(torch.int32))
                and torch.equal(out.view(torch.int32), expected.view(torch.int32))):
            raise ValueError("the compiled kernel does not reproduce the plain-torch stream bitwise (a compiler "
                             "whose float model is not IEEE?)")


CPUS = max(1, os.cpu_count() or 1)  # read once (a system call: it was ~1 % of an MNIST round when read per draw)


def _new_pool() -> None:
    global _POOL
    _POOL = ThreadPoolExecutor(max_workers=CPUS)


_new_pool()
if hasattr(os, "register_at_fork"):  # a forked child (DataLoader worker, multiprocessing) has no pool threads
    os.register_at_fork(after_in_child=_new_pool)


def _ranges(numel: int, units: int | None = None) -> list[tuple[int, int]]:
    """Ranges of ``units`` (default: the pairs of a tensor of ``numel`` elements; or its rows) for torch's thread
    count of pool threads."""
    units = (numel + 1) // 2 if units is None else units
    threads = max(1, min(torch.get_num_threads(), CPUS))
    # a few ranges per thread, taken in turn by the pool: a core slowed by another process does not hold all back
    parts = 1 if numel < MIN_PARALLEL or threads == 1 else min(4 * threads, max(threads, numel // MIN_PARALLEL))
    bounds = [units * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _run(call, numel: int, units: int | None = None) -> None:
    ranges = _ranges(numel, units)
    if len(ranges) == 1:
        call(*ranges[0])
        return
    futures = [_POOL.submit(call, *r) for r in ranges]
    try:
        for future in futures:
            future.result()
    finally:  # an interrupt must not return while threads still write the caller's tensors
        wait(futures)


def combine(base: torch.Tensor, out: torch.Tensor, keys: list[int], coeffs: list[float], gaussian: bool) -> None:
    """``out = base + sum_k coeffs[k] z(keys[k])`` on contiguous CPU float32/float64 tensors (``out`` may be
    ``base``)."""
    if base.numel() != out.numel() or base.dtype != out.dtype or base.dtype not in (torch.float32, torch.float64) \
            or not (base.is_contiguous() and out.is_contiguous()) or base.device.type != "cpu" \
            or out.device.type != "cpu" or len(keys) != len(coeffs):
        raise ValueError("native.combine: base and out must be contiguous CPU float32/float64 tensors of one size "
                         "and dtype, with one coefficient per key.")
    if not keys:
        out.copy_(base)
        return
    lib = library()
    fn = lib.zo_combine_f64 if base.dtype == torch.float64 else lib.zo_combine_f32
    k = len(keys)
    key_array = (ctypes.c_uint64 * k)(*keys)
    coeff_array = (ctypes.c_double * k)(*coeffs)
    n, src, dst = base.numel(), base.data_ptr(), out.data_ptr()
    _run(lambda a, b: fn(src, dst, n, key_array, coeff_array, k, int(gaussian), a, b), n)


def generate(out: torch.Tensor, key: int, gaussian: bool) -> None:
    """``out = z(key)`` on a contiguous CPU float32 tensor."""
    if out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("native.generate: out must be a contiguous CPU float32 tensor.")
    lib, n, dst = library(), out.numel(), out.data_ptr()
    _run(lambda a, b: lib.zo_generate(dst, n, key, int(gaussian), a, b), n)


def generate_rows(out: torch.Tensor, rows: torch.Tensor, key: int, gaussian: bool) -> None:
    """``out[i] = z(key)`` at elements ``rows[i] * width ..`` (``out``: a contiguous CPU float32 ``[len(rows),
    width]``; ``rows``: int64 row indices)."""
    if out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu" or out.dim() != 2 \
            or rows.dtype != torch.int64 or rows.shape != (out.shape[0],) or not rows.is_contiguous():
        raise ValueError("native.generate_rows: out must be a contiguous CPU float32 [rows, width] tensor and rows "
                         "its int64 row indices.")
    lib, width, dst, src = library(), out.shape[1], out.data_ptr(), rows.data_ptr()
    _run(lambda a, b: lib.zo_generate_rows(dst, width, src, a, b, key, int(gaussian)), out.numel(), len(rows))


def step_rounded_bf16(param: torch.Tensor, keys: list[int], coeffs: list[float], decay: float | None,
                      round_key: int, gaussian: bool) -> None:
    """In place, one pass over a contiguous CPU bfloat16 ``param``: ``x = float32(param) * decay`` (when ``decay``
    is not None), ``x = x + sum_k coeffs[k] z(keys[k])``, ``param = SR(x)`` with the rounding bits of ``round_key``
    (``rounding.py``'s arithmetic and bits; the float32 ``x`` is never stored)."""
    if param.dtype != torch.bfloat16 or not param.is_contiguous() or param.device.type != "cpu" \
            or len(keys) != len(coeffs):
        raise ValueError("native.step_rounded_bf16: param must be a contiguous CPU bfloat16 tensor, with one "
                         "coefficient per key.")
    lib, k, n, dst = library(), len(keys), param.numel(), param.data_ptr()
    key_array = (ctypes.c_uint64 * max(1, k))(*keys)
    coeff_array = (ctypes.c_double * max(1, k))(*coeffs)
    factor, has_decay = (0.0, 0) if decay is None else (float(decay), 1)
    _run(lambda a, b: lib.zo_step_rounded_bf16(dst, n, key_array, coeff_array, k, int(gaussian), factor, has_decay,
                                               round_key, a, b), n)
