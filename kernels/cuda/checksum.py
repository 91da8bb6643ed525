"""CUDA launcher of the checksum family (``checksum.cu``), twin of ``kernels/cpu/checksum.py``.

``adler32(dev, ...)`` takes the numba twin's arguments after the device it launches on;
``launchers(dev)`` binds it. The kernel reduces the bytes to two partial sums per block;
one counted synchronization brings them to the host, where ``kernels/checksum.py``'s
``combine`` continues the caller's running checksum.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.checksum import BASE, combine
from mpicomp.kernels.cuda import bind

DEFINES = {"MPICOMP_ADLER_BASE": f"{BASE}ull"}


def span_sums(partials, m: int) -> int:
    """Return the Adler-32 from 0 of m bytes given the kernel's per-block partials
    (rows of sum(b_i), sum((i mod BASE) * b_i), each mod BASE)."""
    s1 = int(partials[:, 0].sum()) % BASE
    s2 = (m * s1 - int(partials[:, 1].sum())) % BASE  # sum((m - i) * b_i)
    return (s2 << 16) | s1


def adler32(dev, src, value: int = 1, dst=None) -> int:
    """Return Adler-32 of the uint8 array ``src`` continued from ``value`` (zlib's rule).

    Args:
        src: 1-D uint8 array (read-only is fine).
        value: the running checksum of the bytes before ``src``: 1 for none; 0 gives
            the span checksum that ``combine`` appends to another checksum.
        dst: None, or a writable C-contiguous uint8 array of src's size that receives a
            copy of ``src``, written in the same pass.

    Returns:
        The checksum, equal to ``zlib.adler32(src, value)``.
    """
    copy = dst is not None
    if copy and dst.size != src.size:
        raise ValueError(f"adler32: dst has {dst.size} bytes, src {src.size}")
    if src.dtype != np.uint8 or (copy and dst.dtype != np.uint8):
        raise TypeError("adler32: src and dst must be uint8 arrays")
    if copy and not dst.flags.c_contiguous:
        raise ValueError("adler32: dst must be C-contiguous")  # written through a pointer
    n = int(src.size)
    if n == 0:
        return combine(int(value), 0, 0)
    src = dev.xp.ascontiguousarray(src).reshape(-1)
    blocks = dev.grid(-(-n // 4))  # a thread per 32-bit word
    partials = dev.xp.empty(2 * blocks, np.uint64)
    args = (src, dst.reshape(-1) if copy else src, np.int32(copy), np.int64(n), partials)
    dev.kernel("checksum", "mpicomp_checksum_adler32", DEFINES)((blocks,), (dev.threads,), args)
    return combine(
        int(value),
        span_sums(dev.to_host(partials, why="checksum.adler32: block sums").reshape(blocks, 2), n),
        n,
    )


def launchers(dev) -> SimpleNamespace:
    """Return the ``checksum`` launchers bound to ``dev``."""
    return bind(dev, adler32=adler32)
