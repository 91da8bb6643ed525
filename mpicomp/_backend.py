"""One dispatch point for array backends: NumPy on the CPU, CuPy on a GPU."""

from __future__ import annotations

import numpy as np

_ACCEPTED = (np.float16, np.float32, np.float64)


def get_array_module(x):
    """Return the array module (numpy or cupy) that owns ``x``."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def as_gradient(x, what: str = "x"):
    """Return ``x`` as a contiguous float32 array of its own backend, converting once.

    float16, bfloat16 and float64 are converted to float32; objects exposing
    ``__dlpack__`` (PyTorch, JAX) are taken without a copy where possible.

    Raises:
        TypeError: ``x`` is not an array, or its dtype is not a floating type.
    """
    if not isinstance(x, np.ndarray) and get_array_module(x) is np:
        if isinstance(x, np.generic):  # a NumPy scalar: treat as a 0-d array
            x = np.asarray(x)
        elif hasattr(x, "__dlpack__"):
            x = _from_dlpack(x, what)
        else:
            raise TypeError(f"{what} must be an array, got {type(x).__name__}")
    xp = get_array_module(x)
    dt = x.dtype
    if dt != np.float32 and dt not in _ACCEPTED and dt.name != "bfloat16":
        raise TypeError(f"{what} must be a floating-point array, got dtype {dt!r}")
    # asarray(order='C'), not ascontiguousarray, which makes a 0-d array 1-d.
    return xp.asarray(x, dtype=np.float32, order="C")


def _from_dlpack(x, what: str):
    """Import a DLPack producer without a copy; convert once where NumPy cannot hold its dtype."""
    try:
        return np.from_dlpack(x)
    except (RuntimeError, BufferError, TypeError) as e:
        # NumPy has no bfloat16: a PyTorch bfloat16 tensor is converted by its own .float().
        if callable(getattr(x, "float", None)):
            return np.from_dlpack(x.float())
        raise TypeError(f"{what}: cannot import {type(x).__name__} through DLPack ({e})") from e
