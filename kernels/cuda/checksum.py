"""CUDA launcher of the checksum family (``checksum.cu``), twin of ``kernels/cpu/checksum.py``.

``adler32`` has the numba record's name and arguments. The kernel reduces the bytes to two
partial sums per block; one counted synchronization brings them to the host, where
``kernels/checksum.py``'s ``combine`` continues the caller's running checksum.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.checksum import BASE, combine

DEFINES = {"MPICOMP_ADLER_BASE": f"{BASE}ull"}


def span_sums(partials, m: int) -> int:
    """Return the Adler-32 from 0 of m bytes given the kernel's per-block partials
    (rows of sum(b_i), sum((i mod BASE) * b_i), each mod BASE)."""
    s1 = int(partials[:, 0].sum()) % BASE
    s2 = (m * s1 - int(partials[:, 1].sum())) % BASE  # sum((m - i) * b_i)
    return (s2 << 16) | s1


def launchers(dev) -> SimpleNamespace:
    """Return the ``checksum`` launchers bound to ``dev``."""
    xp = dev.xp

    def adler32(src, value: int = 1, dst=None) -> int:
        """Return Adler-32 of the uint8 array ``src`` continued from ``value`` (zlib's
        rule); copy ``src`` into ``dst`` (uint8, same size) in the same pass if given."""
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
        src = xp.ascontiguousarray(src).reshape(-1)
        blocks = dev.grid(-(-n // 4))  # a thread per 32-bit word
        partials = xp.empty(2 * blocks, np.uint64)
        args = (src, dst.reshape(-1) if copy else src, np.int32(copy), np.int64(n), partials)
        dev.kernel("checksum", "mpicomp_checksum_adler32", DEFINES)((blocks,), (dev.threads,), args)
        return combine(
            int(value),
            span_sums(
                dev.to_host(partials, why="checksum.adler32: block sums").reshape(blocks, 2), n
            ),
            n,
        )

    return SimpleNamespace(adler32=adler32)
