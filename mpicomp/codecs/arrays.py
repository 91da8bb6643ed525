"""Gradients as the codecs take them: contiguous float32 arrays of their own backend (NumPy,
CuPy), converted once, checked for NaN/Inf."""

from __future__ import annotations

import ctypes
import math
import os
from contextlib import nullcontext
from typing import NamedTuple

import numpy as np

from mpicomp.kernels import ENV, backend, backend_of
from mpicomp.kernels.readback import read

_ACCEPTED = (np.float16, np.float32, np.float64)
_F32_MAX = float(np.finfo(np.float32).max)

#: Why a rank's input cannot be encoded, in words that follow "holds": the first two are
#: the NaN/Inf policy's, the others an ``Unencodable``'s. A cause reaches the other
#: ranks as its number, ``cause_code`` (one byte per rank).
CAUSES = (
    "NaN or Inf",
    "float64 values beyond float32's range",
    "values beyond float16's range (max 65504)",
    "values that round to Inf in bfloat16 (beyond its max, 3.3895e38)",
    "values whose norm overflows float32",
    "values whose spectrum overflows float32",
    "values that overflow float32 with the error kept from earlier calls",
)
NONFINITE, FLOAT64, FLOAT16, BFLOAT16, NORM, SPECTRUM, KEPT = CAUSES


class Range(NamedTuple):
    """What a dtype holds of float32 values: ``limit``, the largest magnitude that stays
    finite when rounded to it (to nearest, ties to even; the next float32 up becomes
    Inf), and ``largest``, its largest finite value as messages say it."""

    dtype: str
    limit: float
    largest: str


FLOAT32_RANGE = Range("float32", _F32_MAX, "3.4e38")
# float16 rounds from 65520 up to Inf, bfloat16 from 0x7F7F8000 (3.3962e38): the float32
# just below is the limit.
_NARROW = {
    "float16": Range("float16", float(np.nextafter(np.float32(65520), np.float32(0))), "65504"),
    "bfloat16": Range("bfloat16", float(np.uint32(0x7F7F7FFF).view(np.float32)), "3.3895e38"),
}


def result_range(dtype: str) -> Range:
    """Return the ``Range`` a float32 result given back as ``dtype`` (a name, as the
    caller's dtype prints) must stay in: float16's or bfloat16's, else float32's."""
    return _NARROW.get(dtype, FLOAT32_RANGE)


def cause_code(cause: str) -> int:
    """Return the number of ``cause`` (one of ``CAUSES``; 0 stands for none)."""
    return CAUSES.index(cause) + 1


class Unencodable(ValueError):
    """Finite input a codec cannot encode (its wire's range, or its float32 arithmetic:
    a norm, a spectrum, the kept error added): ``cause`` is one of ``CAUSES``. A
    ``CompressedComm`` treats it as NaN/Inf's ``nonfinite=`` policy does, but for
    ``"zero"`` (nothing to zero): every rank raises, or skips under ``"skip_step"``."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause
        self.code = cause_code(cause)


def as_gradient(x, what: str = "x"):
    """Return ``x`` as a contiguous float32 array of its own backend, converting once.

    float16, bfloat16 and float64 are converted to float32; objects exposing
    ``__dlpack__`` (PyTorch, JAX) are taken without a copy where possible; a
    non-contiguous array is copied once.

    Raises:
        TypeError: ``x`` is not an array, or its dtype is not a floating type.
        ValueError: ``x`` is float64 with a finite value beyond float32's range
            (it would silently become Inf).
    """
    out, overflowed = to_float32(x, what)
    if overflowed:
        raise ValueError(f"{what} holds float64 values beyond float32's range (max {_F32_MAX:g})")
    return out


def to_float32(x, what: str = "x"):
    """Return ``(array, overflowed)``: ``x`` as ``as_gradient`` makes it, but a float64
    value beyond float32's range becomes Inf and sets ``overflowed`` instead of raising.

    Raises:
        TypeError: ``x`` is not an array, or its dtype is not a floating type.
    """
    if isinstance(x, np.generic):  # a NumPy scalar: treat as a 0-d array
        x = np.asarray(x)
    elif not isinstance(x, np.ndarray) and not is_device_array(x):
        if "complex" in str(getattr(x, "dtype", "")):  # named before DLPack refuses a view
            raise TypeError(f"{what} must be a real floating-point array, got dtype {x.dtype}")
        if hasattr(x, "__dlpack__"):
            x = _from_dlpack(x, what)
        elif hasattr(x, "__cuda_array_interface__"):
            x = _from_cai(x, what)
        else:
            raise TypeError(f"{what} must be an array, got {type(x).__name__}")
    dt = x.dtype
    if dt.name != "bfloat16" and (dt.kind != "f" or dt.newbyteorder("=") not in _ACCEPTED):
        real = " real" if dt.kind == "c" else ""
        raise TypeError(
            f"{what} must be a{real} floating-point array (float16, bfloat16, float32 or "
            f"float64), got dtype {dt}"
        )
    if not isinstance(x, np.ndarray):
        k = backend_of(x)
        with on_device(x):
            # asarray(order='C'), not ascontiguousarray, which makes a 0-d array 1-d.
            out = k.xp.asarray(x, dtype=np.float32, order="C")
            if dt != np.float64:
                return out, False
            # Overflow is a finite value cast to Inf: one pass and one read-back on a device.
            over = k.xp.any(k.xp.isinf(out) & k.xp.isfinite(x))
            return out, bool(k.to_host(over, why="float64 overflow flag"))
    if dt.itemsize != 8:
        # Also a float32 of the other byte order: converted to this machine's.
        return np.asarray(x, dtype=np.float32, order="C"), False
    # The cast sets the FPU's overflow flag for free: no extra pass over the data.
    try:
        with np.errstate(over="raise"):
            return np.asarray(x, dtype=np.float32, order="C"), False
    except FloatingPointError:
        with np.errstate(over="ignore"):
            return np.asarray(x, dtype=np.float32, order="C"), True


def is_device_array(x) -> bool:
    """Return True if ``x`` is an array of a device backend (CuPy's, or one registered)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return False
    try:
        backend_of(x)
    except TypeError:
        return False
    return True


def on_device(x):
    """Return a context manager inside which work on ``x`` goes to the GPU it lives on
    (CuPy allocates and launches on the current device); for a host array, one that does
    nothing."""
    if not is_device_array(x):
        return nullcontext()
    device = getattr(backend_of(x), "device", None)
    return nullcontext() if device is None else device.on(x.device.id)


def array_module(x):
    """Return the array module of ``x``: its device backend's (CuPy), else NumPy."""
    return backend_of(x).xp if is_device_array(x) else np


def is_array(x) -> bool:
    """Return True if ``x`` is a NumPy array or an array of a device backend."""
    return isinstance(x, np.ndarray) or is_device_array(x)


def all_finite(x, kernels=None) -> bool:
    """Return True if ``x`` holds no NaN or Inf (``kernels``: the record of NumPy arrays,
    as for ``backend_of``; its ``to_host`` counts the read on ``cuda-emulated`` as on a GPU)."""
    if x.size == 0:
        return True
    k = backend_of(x, kernels)
    return bool(k.to_host(_finite(k, x), why="non-finite check"))


def all_finite_later(x, kernels=None):
    """Return ``all_finite(x, kernels)``, or on a device inside a ``readback.batch`` a
    ``readback.Later`` of it, read with the batch's other values."""
    if x.size == 0:
        return True
    k = backend_of(x, kernels)
    return read(getattr(k, "device", None), _finite(k, x), "non-finite check", _true)


def within_later(x, limit: float, kernels=None):
    """Return whether every |x| is at most ``limit`` (False for NaN) as
    ``all_finite_later`` does: the same one pass."""
    if x.size == 0:
        return True
    k = backend_of(x, kernels)
    return read(getattr(k, "device", None), _within(x, limit), "range check", _true)


def within(x, limit: float, kernels=None) -> bool:
    """Return ``within_later`` read now."""
    if x.size == 0:
        return True
    k = backend_of(x, kernels)
    return bool(k.to_host(_within(x, limit), why="range check"))


def _finite(k, x):
    # min and max propagate NaN and reach ±Inf: two SIMD passes, no temporary, about
    # 8x faster than a scalar loop (0.5 ms for 4M float32 on one core).
    return k.xp.isfinite(x.min()) & k.xp.isfinite(x.max())


def _within(x, limit: float):
    # As _finite: a NaN fails both comparisons.
    return (x.min() >= -limit) & (x.max() <= limit)


def _true(host) -> bool:
    return bool(host)


def zero_nonfinite(x):
    """Return a copy of ``x`` with NaN and Inf replaced by 0 (the input is left as it is)."""
    xp = np if isinstance(x, np.ndarray) else backend_of(x).xp
    return xp.where(xp.isfinite(x), x, xp.float32(0))


def residual_view(residual, x, what: str):
    """Return an error-feedback ``residual`` as a flat writable view, checking it matches
    ``x``: float32, the same shape, C-contiguous, writeable, and an array of x's backend.

    Raises:
        ValueError: it does not match; the message starts with ``what``.
    """
    if not is_array(residual) or residual.dtype != np.float32:
        raise ValueError(
            f"{what} residual must be a float32 array, got {type(residual).__name__}"
            + (f" of dtype {residual.dtype}" if hasattr(residual, "dtype") else "")
        )
    if _home(residual) is not _home(x):
        raise ValueError(
            f"{what} residual is a {type(residual).__module__} array, x a {type(x).__module__} one"
        )
    if residual.shape != x.shape:
        raise ValueError(f"{what} residual has shape {residual.shape}, x has {x.shape}")
    # CuPy arrays carry no writeable flag: they always are.
    if not residual.flags.c_contiguous or not getattr(residual.flags, "writeable", True):
        raise ValueError(f"{what} residual must be C-contiguous and writeable")
    return residual.reshape(-1)


def _home(a) -> type:
    """Return the array type ``a`` belongs to: np.ndarray for NumPy ones (subclasses
    included), else its own type."""
    return np.ndarray if isinstance(a, np.ndarray) else type(a)


# DLPack device types (dlpack.h): where a producer's memory is.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _from_cai(x, what: str):
    """Take an object exposing ``__cuda_array_interface__`` (and no DLPack) without a copy:
    as a CuPy array through the ``cuda`` backend; or, where the selected backend is
    ``cuda-emulated`` (whose device memory is host memory, as in mpi4py's tests of GPU
    buffers), as a NumPy array over its pointer."""
    try:
        return backend("cuda").xp.asarray(x)
    except Exception as gpu_error:  # no CuPy, no GPU, or CuPy refused the interface
        if (os.environ.get(ENV) or "") != "cuda-emulated":
            raise TypeError(
                f"{what}: a {type(x).__name__} exposing __cuda_array_interface__ needs the "
                f"cuda kernel backend (CuPy and a GPU), which is not available here "
                f"({gpu_error}); under MPICOMP_KERNELS=cuda-emulated its memory is read as "
                "host memory"
            ) from gpu_error
    try:
        cai = x.__cuda_array_interface__
        shape = tuple(int(d) for d in cai["shape"])
        dtype = np.dtype(cai["typestr"])
        pointer = int(cai["data"][0])
        strides = cai.get("strides")
    except Exception as e:  # a malformed interface: the input's fault
        raise TypeError(f"{what}: unreadable __cuda_array_interface__ ({e!r})") from e
    numel = math.prod(shape)
    if numel == 0:
        return np.empty(shape, dtype)
    if strides is None:  # C order
        strides = tuple(dtype.itemsize * math.prod(shape[i + 1 :]) for i in range(len(shape)))
    span = sum((d - 1) * abs(st) for d, st in zip(shape, strides, strict=True)) + dtype.itemsize
    if pointer == 0 or any(st < 0 for st in strides):
        raise TypeError(f"{what}: __cuda_array_interface__ with a null pointer or negative strides")
    memory = np.ctypeslib.as_array((ctypes.c_char * span).from_address(pointer))
    return np.lib.stride_tricks.as_strided(memory.view(np.uint8).view(dtype), shape, strides)


def _from_dlpack(x, what: str):
    """Import a DLPack producer without a copy (a CUDA tensor as a CuPy array, through the
    ``cuda`` backend); convert once where the consumer cannot hold its dtype (bfloat16)."""
    kind = _DL_CPU
    if callable(getattr(x, "__dlpack_device__", None)):
        try:
            kind, _ = x.__dlpack_device__()
        except Exception as e:  # e.g. a tensor on a device DLPack cannot describe
            raise TypeError(f"{what}: {type(x).__name__} cannot say where it lives ({e})") from e
    if kind in (_DL_CUDA, _DL_CUDA_MANAGED):
        try:
            from_dlpack = backend("cuda").xp.from_dlpack
        except Exception as e:  # no CuPy, or CuPy without a GPU
            raise TypeError(
                f"{what}: a CUDA {type(x).__name__} needs the cuda kernel backend (CuPy and a "
                f"GPU), which is not available here ({e})"
            ) from e
    elif kind in (_DL_CPU, _DL_CUDA_HOST):
        from_dlpack = np.from_dlpack
    else:
        raise TypeError(
            f"{what}: a {type(x).__name__} on DLPack device type {kind} (not the CPU or a CUDA "
            "GPU) is not supported"
        )
    try:
        try:
            return from_dlpack(x)
        except (RuntimeError, BufferError, TypeError):
            # NumPy has no bfloat16: the producer converts it itself (PyTorch's .float(),
            # JAX's .astype). Complex producers never get here (refused above): their
            # .float() would drop the imaginary part.
            if callable(getattr(x, "float", None)):
                return from_dlpack(x.float())
            if callable(getattr(x, "astype", None)):
                return from_dlpack(x.astype("float32"))
            raise
    except Exception as e:  # whatever the producer raises: the input's fault
        raise TypeError(
            f"{what}: cannot import {type(x).__name__} through DLPack ({e}); mpicomp takes "
            "NumPy arrays, CuPy arrays, and tensors in host memory or on a CUDA GPU"
        ) from e
