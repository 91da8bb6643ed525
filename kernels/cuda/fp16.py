"""CUDA launchers of the float16 family (``fp16.cu``), twins of ``kernels/cpu/fp16.py``.

The launchers are the numba twin's ``add``, ``all_finite``, ``encode`` and ``decode``, in
its order, each taking the device it launches on before the twin's arguments
(``launchers(dev)`` binds them). ``encode``, ``decode`` and ``all_finite`` bring one small
array of per-block partials to the host (one counted synchronization each; ``decode``'s
through ``readback.read``: later in a batch, never inside ``readback.ignored()``); ``add``
none.

NaN results follow x86's rule as the numba twin's (see fp16.cu). Where ``decode`` divides
and the quotient falls below 2^-126, the kernel rounds it onto the denormal grid from the
double quotient: exact, because a quotient of two floats is never within half a double ulp
of a midpoint of the float grid unless it is that midpoint. A scale that is itself a
float32 denormal is flushed to zero on a GPU (``-ftz=true``): there the quotient is Inf.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.checksum import BASE, combine
from mpicomp.kernels.cuda import bind, contiguous, family_kernel
from mpicomp.kernels.readback import read

DEFINES = {"MPICOMP_ADLER_BASE": f"{BASE}ull"}

_kernel = family_kernel("fp16", DEFINES)


def _same_size(what: str, a, b) -> None:
    # The kernels index both arrays by one counter: a short one would be written past.
    if a.ndim != 1 or b.ndim != 1 or a.size != b.size:
        raise ValueError(f"{what}: arrays of shapes {a.shape} and {b.shape}, need equal 1-D sizes")


def _contiguous(what: str, **arrays) -> None:
    for name, a in arrays.items():
        contiguous(a, what, name)


def add(dev, a, b) -> None:
    """Set float16-bits array ``b`` (uint16) to float16(float32(a) + float32(b))."""
    _same_size("fp16 add", a, b)
    _contiguous("fp16 add", a=a, b=b)
    if b.size:
        _kernel(dev, "add")(*dev.launch_shape(b.size), (a, b, np.int64(b.size)))


def all_finite(dev, h):
    """Return True if no float16 bits of ``h`` (uint16) are NaN or Inf (exponent all ones)."""
    h = dev.flat(h)
    if h.size == 0:
        return True
    flags = dev.xp.empty(dev.grid(h.size), np.uint32)
    _kernel(dev, "all_finite")(*dev.launch_shape(h.size), (h, np.int64(h.size), flags))
    return not dev.to_host(flags, why="fp16.all_finite: flags").any()


def encode(dev, x, h16, h8=None):
    """As ``kernels.cpu.fp16.encode``: float32 ``x`` rounded to float16 bits in ``h16``;
    (ok, Adler-32 of ``h8`` or 0). One kernel pass; per-block flags and byte sums are
    brought to the host once and combined there."""
    _same_size("fp16 encode", x, h16)
    if h8 is not None and h8.size != 2 * h16.size:
        raise ValueError(f"fp16 encode: h8 has {h8.size} bytes, h16 needs {2 * h16.size}")
    _contiguous("fp16 encode", x=x, h16=h16)
    n = x.size
    if n == 0:
        return True, 0
    blocks = dev.grid(n)
    partials = dev.xp.empty(3 * blocks, np.uint64)
    want = np.int32(h8 is not None)
    args = (x.view(np.uint32), h16, np.int64(n), want, partials)
    _kernel(dev, "encode")(*dev.launch_shape(n), args)
    p = dev.to_host(partials, why="fp16.encode: block flags and sums").reshape(blocks, 3)
    if not want:
        return not p[:, 0].any(), 0
    # Exact sums mod BASE: s2 of the bytes from (0, 0) is m * s1 - sum(i * b_i).
    s1 = int(p[:, 1].sum()) % BASE
    s2 = (2 * n * s1 - int(p[:, 2].sum())) % BASE
    return not p[:, 0].any(), combine(0, (s2 << 16) | s1, 2 * n)


def decode(dev, h16, out, scale=1.0) -> bool:
    """As ``kernels.cpu.fp16.decode``: ``out`` = float16 bits ``h16`` as float32, / ``scale``;
    False when some value is NaN/Inf."""
    _same_size("fp16 decode", h16, out)
    _contiguous("fp16 decode", h16=h16, out=out)
    n = h16.size
    if n == 0:
        return True
    by = np.float32(scale)
    divide = by != np.float32(1)
    if divide and by == 0:
        raise ZeroDivisionError("division by zero")  # as the numba twin raises
    flags = dev.xp.empty(dev.grid(n), np.uint32)
    args = (h16, out.view(np.uint32), np.int64(n), by, np.int32(divide), flags)
    _kernel(dev, "decode")(*dev.launch_shape(n), args)
    return read(dev, flags, "fp16.decode: non-finite flags", _none_set)


def _none_set(flags) -> bool:
    return not flags.any()


def launchers(dev) -> SimpleNamespace:
    """Return the ``fp16`` launchers bound to ``dev``."""
    return bind(dev, add=add, all_finite=all_finite, encode=encode, decode=decode)
