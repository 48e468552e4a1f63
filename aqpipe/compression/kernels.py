"""The quantizer's inner loops, in three bit-identical implementations (bfloat16 scales: two, C and torch).

`native`: a small C file (native/quant.c) compiled with the system C compiler on
first use and called through ctypes, which releases the GIL, so chunks run on
`torch.get_num_threads()` threads. One fused pass per step instead of the dozen
tensor passes (and a slow `torch.rand`) the torch version needs: that is what
brings the CPU round trip within reach of memory bandwidth.

`triton`: GPU kernels (triton_kernels.py), for CUDA tensors where Triton is installed.

`torch`: the same arithmetic in tensor ops, for any device and machines with
neither. All three use the same counter-based dither (a hash of the element's
index and a key drawn from the caller's torch.Generator) and the same float32
operations in the same order, so codes and decoded values match bit for bit:
tests/unit/test_kernels.py holds them to it (the Triton kernels in Triton's interpreter).

Choose with `configure(backend="auto"|"native"|"triton"|"torch")`: the trainer reads it from AQPIPE_KERNELS (with
AQPIPE_CACHE, where the compiled library is kept, and CC, the compiler), once, at start. auto: native on CPU
tensors, triton on CUDA ones, each falling back to torch with one warning where it cannot run.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from .group_math import bfloat16_scales, group_ranges, group_steps, group_views, inverse_steps, packed_nbytes

_SOURCE = Path(__file__).with_name("native") / "quant.c"
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
_MIN_CHUNK = 1 << 16  # elements per thread below which splitting costs more than it saves

BACKENDS = ("auto", "native", "triton", "torch")
_settings = {"backend": "auto", "cache_dir": None, "compiler": "cc", "interpret": False}  # what configure() set
_warned: set[str] = set()  # the fallbacks already warned about
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_triton_error: str | None = None  # "" once Triton imported
_lib_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def configure(backend: str = "auto", cache_dir: str | os.PathLike | None = None, compiler: str = "cc",
              interpret: bool = False) -> None:
    """How the quantizer runs, for the whole process: `backend` auto (the C kernels on CPU tensors where they build,
    Triton's on CUDA tensors where it imports, else torch ops), native, triton or torch; `cache_dir` where the
    compiled kernels are kept (default ~/.cache/aqpipe); `compiler` the C compiler's command; `interpret`: Triton
    runs in its interpreter (TRITON_INTERPRET=1, set before triton is imported), so backend triton takes CPU tensors
    too (tests), where otherwise it takes CUDA tensors only."""
    if backend not in BACKENDS:
        raise ValueError(f"AQPIPE_KERNELS={backend!r}: expected one of {', '.join(BACKENDS)}")
    global _triton_error
    _settings.update(backend=backend, cache_dir=cache_dir, compiler=compiler, interpret=interpret)
    _triton_error = None  # whether Triton imports is asked again


# ----------------------------------------------------------------------------- native library
def _cache_dir() -> Path:
    root = _settings["cache_dir"] or os.path.join(os.path.expanduser("~"), ".cache", "aqpipe")
    return Path(root) / "native"


def _cpu_signature() -> str:
    """-march=native code only runs on the CPU that built it: key the cache on its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build() -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"aqpipe_quant_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = str(_settings["compiler"])
    # Build beside the target and rename: ranks starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32
    lib.aq_quantize.argtypes = [p, i64, i64, i64, i64, i32, i32, u32, u32, i32, p, p, p]
    lib.aq_dequantize.argtypes = [p, i64, i64, i64, i32, p, p, p]
    lib.aq_quantize.restype = lib.aq_dequantize.restype = None
    lib.aq_little_endian.restype = ctypes.c_int


def native_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they cannot be built here (reason in `native_error()`)."""
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:
        return _lib
    with _lib_lock:
        if _lib is None and _lib_error is None:
            try:
                lib = ctypes.CDLL(str(_build()))
                _declare(lib)
                if not lib.aq_little_endian():
                    raise OSError("the packed format is little-endian; this host is not")
                _lib = lib
            except (OSError, subprocess.CalledProcessError) as exc:
                detail = getattr(exc, "stderr", "") or ""
                _lib_error = f"{exc} {detail}".strip()
    return _lib


def native_error() -> str | None:
    native_library()
    return _lib_error


def triton_error() -> str | None:
    """Why the Triton kernels cannot run here (None: they can); asked once a process."""
    global _triton_error
    if _triton_error is None:
        try:
            importlib.import_module(".triton_kernels", __package__)  # sys.modules decides: a test can hide triton
            _triton_error = ""
        except ImportError as exc:
            _triton_error = str(exc) or type(exc).__name__
    return _triton_error or None


def _fallback(kernel: str, why: str | None) -> str:
    """'torch', after one warning per kernel family."""
    if kernel not in _warned:
        warnings.warn(f"aqpipe: {kernel} quantizer kernels unavailable, using torch ops ({why})", stacklevel=4)
        _warned.add(kernel)
    return "torch"


def backend_for(t: torch.Tensor) -> str:
    """'native', 'triton' or 'torch' for a tensor, as configured."""
    choice = _settings["backend"]
    if choice == "torch" or sys.byteorder != "little":
        return "torch"
    on_gpu = t.device.type == "cuda" or (choice == "triton" and _settings["interpret"])
    if on_gpu and choice in ("triton", "auto"):
        why = triton_error()
        if why is None:
            return "triton"
        if choice == "triton":
            raise RuntimeError(f"AQPIPE_KERNELS=triton but Triton cannot be imported: {why}")
        return _fallback("Triton", why)
    if t.device.type != "cpu":
        return "torch"
    if native_library() is None:
        if choice == "native":
            raise RuntimeError(f"AQPIPE_KERNELS=native but the C kernels could not be built: {_lib_error}")
        return _fallback("C", _lib_error)
    return "native"


def _parallel(total: int, cost_per_item: int, fn: Callable[[int, int], None]) -> None:
    """Run fn(begin, end) over [0, total) in chunks on torch.get_num_threads() threads."""
    global _pool, _pool_size
    threads = max(1, torch.get_num_threads())
    chunks = min(threads, max(1, (total * cost_per_item) // _MIN_CHUNK), max(total, 1))
    if chunks <= 1:
        fn(0, total)
        return
    if _pool_size < chunks:  # first use, or torch's thread count grew
        _pool, _pool_size = ThreadPoolExecutor(max_workers=chunks, thread_name_prefix="aqpipe-quant"), chunks
    bounds = [total * k // chunks for k in range(chunks + 1)]
    futures = [_pool.submit(fn, bounds[k], bounds[k + 1]) for k in range(chunks)]
    for f in futures:
        f.result()


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


# ----------------------------------------------------------------------------- torch twins
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dither(n: int, key: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The uniform [0, 1) dither of elements 0..n-1 under `key`, as the C kernel computes it."""
    k0, k1 = key
    i = torch.arange(n, dtype=torch.int64, device=device) & 0xFFFFFFFF
    h = _mix32((_mul32(i, 0x9E3779B9) + k0) & 0xFFFFFFFF) ^ k1
    return (h >> 8).to(torch.float32) * (1.0 / 16777216.0)


def _per_group(values: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Slice a per-group vector to match `group_views`' parts, as (rows, 1) columns."""
    out, start = [], 0
    for p in parts:
        out.append(values[start : start + p.shape[0]].view(-1, 1))
        start += p.shape[0]
    return out


# ----------------------------------------------------------------------------- the kernels
def quantize_flat(
    flat: torch.Tensor, gs: int, bits: int, key: tuple[int, int] | None, scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a contiguous float32 vector in groups of gs: (packed codes, mins, steps).

    A group holding NaN or inf gets min = NaN, one wider than float32 holds an infinite step (the caller raises).
    `key` is the dither key for stochastic rounding, None for round-to-nearest. `scale_dtype` bfloat16: each
    group's min and step are ones bfloat16 holds (group_math.bfloat16_scales) and the codes are taken against them
    (the C and torch paths; Triton's kernels lack it, so a GPU tensor takes tensor ops).
    """
    n = flat.numel()
    groups = -(-n // gs) if n else 0
    if groups == 0:
        nothing = torch.empty(0, dtype=torch.float32, device=flat.device)
        return torch.empty(0, dtype=torch.uint8, device=flat.device), nothing, nothing.clone()
    bf16 = scale_dtype == torch.bfloat16
    chosen = backend_for(flat)
    if chosen == "triton" and bf16:
        chosen = "torch"
    if chosen == "triton":
        from . import triton_kernels  # deferred: importing Triton takes seconds, and only a GPU's tensors need it

        return triton_kernels.quantize_flat(flat, gs, bits, key)
    if chosen == "native":
        packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=flat.device)
        mins = torch.empty(groups, dtype=torch.float32, device=flat.device)
        maxs = torch.empty_like(mins)
        lib = native_library()
        k0, k1 = key if key is not None else (0, 0)
        align = 8 // math.gcd(gs, 8)  # chunks start on whole bytes of the stream

        def run(a: int, b: int) -> None:
            a, b = a * align, min(b * align, groups)
            if a < b:
                lib.aq_quantize(_ptr(flat), n, gs, a, b, bits, int(key is not None), k0, k1, int(bf16),
                                _ptr(mins), _ptr(maxs), _ptr(packed))

        _parallel(-(-groups // align), gs * align, run)
        return packed, mins, maxs if bf16 else group_steps(mins, maxs, bits)  # bf16: C wrote the steps
    if bf16:
        mins, steps, invs = bfloat16_scales(*group_ranges(flat, gs), bits)
        return _quantize_torch(flat, gs, bits, key, mins, invs), mins, steps
    mins, maxs = group_ranges(flat, gs)
    packed = _quantize_torch(flat, gs, bits, key, mins, inverse_steps(mins, maxs, bits))
    return packed, mins, group_steps(mins, maxs, bits)


def _quantize_torch(flat: torch.Tensor, gs: int, bits: int, key: tuple[int, int] | None, mins: torch.Tensor,
                    invs: torch.Tensor) -> torch.Tensor:
    """The packed codes of `flat` against each group's min and inverse step, with tensor ops."""
    n = flat.numel()
    parts = group_views(flat, gs)
    levels = (1 << bits) - 1
    codes = torch.empty(n, dtype=torch.uint8, device=flat.device)
    u_parts = group_views(dither(n, key, flat.device), gs) if key is not None else [0.5] * len(parts)
    start = 0
    for p, mn, inv, u in zip(parts, _per_group(mins, parts), _per_group(invs, parts), u_parts):
        v = (p - mn) * inv
        v = v + u
        codes[start : start + p.numel()] = v.clamp_(0.0, float(levels)).to(torch.uint8).reshape(-1)
        start += p.numel()
    return pack_codes(codes, bits)


def dequantize_flat(packed: torch.Tensor, n: int, gs: int, bits: int, mins: torch.Tensor,
                    steps: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
    """Decode n elements: code * step + min per element, as float32 (no fused multiply-add), plus `base` (flat
    float32, n elements) where given: AQ-SGD's m + change in the same pass on a GPU."""
    chosen = backend_for(packed) if n else "torch"
    if chosen == "triton":
        from . import triton_kernels  # deferred: importing Triton takes seconds, and only a GPU's tensors need it

        return triton_kernels.dequantize_flat(packed, n, gs, bits, mins, steps, base)
    out = torch.empty(n, dtype=torch.float32, device=packed.device)
    if n and chosen == "native":
        lib = native_library()
        blocks = -(-n // 8)
        packed = packed.contiguous()
        _parallel(blocks, 8, lambda a, b: lib.aq_dequantize(
            _ptr(packed), gs, 8 * a, min(8 * b, n), bits, _ptr(mins), _ptr(steps), _ptr(out)))
    elif n:
        _dequantize_torch(packed, n, gs, bits, mins, steps, out)
    return out if base is None else base + out


def _dequantize_torch(packed: torch.Tensor, n: int, gs: int, bits: int, mins: torch.Tensor, steps: torch.Tensor,
                      out: torch.Tensor) -> None:
    codes = unpack_codes(packed, bits, n)
    start = 0
    parts = group_views(codes, gs)
    for p, mn, st in zip(parts, _per_group(mins, parts), _per_group(steps, parts)):
        v = p.to(torch.float32) * st
        out[start : start + p.numel()] = (v + mn).reshape(-1)
        start += p.numel()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (each < 2**bits) into the little-endian bit stream, with tensor ops."""
    n = codes.numel()
    blocks = -(-n // 8)
    padded = torch.zeros(blocks * 8, dtype=torch.int64, device=codes.device)
    padded[:n] = codes
    words = (padded.view(blocks, 8) << (torch.arange(8, device=codes.device) * bits)).sum(dim=1)  # disjoint bits
    stream = (words.view(-1, 1) >> (torch.arange(bits, device=codes.device) * 8)) & 0xFF
    return stream.to(torch.uint8).reshape(-1)[: packed_nbytes(n, bits)]


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_codes`: n uint8 codes."""
    blocks = -(-n // 8)
    padded = torch.zeros(blocks * bits, dtype=torch.int64, device=packed.device)
    padded[: packed.numel()] = packed
    words = (padded.view(blocks, bits) << (torch.arange(bits, device=packed.device) * 8)).sum(dim=1)
    codes = (words.view(-1, 1) >> (torch.arange(8, device=packed.device) * bits)) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(-1)[:n]
