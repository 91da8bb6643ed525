"""CUDA launcher of the checksum family (``checksum.cu``), twin of ``kernels/cpu/checksum.py``.

``adler32(dev, ...)`` and ``adler32_into(dev, ...)`` take the numba twin's arguments after
the device they launch on; ``launchers(dev)`` binds them. ``adler32_into`` finishes the
sum on the device and writes it where the caller says (a payload's checksum field). The kernel reduces the bytes to two partial sums per block;
one counted synchronization brings them to the host (``readback.read``: later, with
its batch, inside one), where ``kernels/checksum.py``'s ``combine`` continues the
caller's running checksum.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.checksum import BASE, combine
from mpicomp.kernels.cuda import bind, contiguous
from mpicomp.kernels.readback import read

DEFINES = {"MPICOMP_ADLER_BASE": f"{BASE}ull"}


def span_sums(partials, m: int) -> int:
    """Return the Adler-32 from 0 of m bytes given the kernel's per-block partials
    (rows of sum(b_i), sum((i mod BASE) * b_i), each mod BASE)."""
    s1 = int(partials[:, 0].sum()) % BASE
    s2 = (m * s1 - int(partials[:, 1].sum())) % BASE  # sum((m - i) * b_i)
    return (s2 << 16) | s1


def adler32(dev, src, value: int = 1, dst=None) -> int:
    """As ``kernels.cpu.checksum.adler32``: ``zlib.adler32(src, value)`` of uint8 ``src``,
    copied into ``dst`` in the same pass when given (here ``dst`` must be C-contiguous)."""
    copy = dst is not None
    if copy and dst.size != src.size:
        raise ValueError(f"adler32: dst has {dst.size} bytes, src {src.size}")
    if src.dtype != np.uint8 or (copy and dst.dtype != np.uint8):
        raise TypeError("adler32: src and dst must be uint8 arrays")
    if copy:
        dst = contiguous(dst, "checksum adler32", "dst")
    n = int(src.size)
    if n == 0:
        return combine(int(value), 0, 0)
    src = dev.flat(src)
    words = -(-n // 4)  # a thread per 32-bit word
    blocks = dev.grid(words)
    partials = dev.xp.empty(2 * blocks, np.uint64)
    args = (src, dst if copy else src, np.int32(copy), np.int64(n), partials)
    kernel = dev.kernel("checksum", "mpicomp_checksum_adler32", DEFINES)
    kernel(*dev.launch_shape(words), args)

    def checksum(host) -> int:
        return combine(int(value), span_sums(host.reshape(blocks, 2), n), n)

    return read(dev, partials, "checksum.adler32: block sums", checksum)


def adler32_into(dev, src, value: int, out, dst=None) -> None:
    """As ``kernels.cpu.checksum.adler32_into``: write ``zlib.adler32(src, value)`` into
    the 4 uint8 ``out`` (little-endian), on the device: nothing comes to the host."""
    if out.dtype != np.uint8 or out.size != 4:
        raise ValueError("adler32_into: out must be 4 uint8 bytes")
    n = int(src.size)
    blocks = dev.grid(-(-n // 4)) if n else 0
    partials = dev.xp.zeros(2 * max(blocks, 1), np.uint64)
    if n:
        if dst is not None:
            if dst.size != n:
                raise ValueError(f"adler32_into: dst has {dst.size} bytes, src {n}")
            dst = contiguous(dst, "checksum adler32_into", "dst")
        if src.dtype != np.uint8:
            raise TypeError("adler32_into: src must be a uint8 array")
        flat = dev.flat(src)
        args = (flat, flat if dst is None else dst, np.int32(dst is not None))
        kernel = dev.kernel("checksum", "mpicomp_checksum_adler32", DEFINES)
        kernel(*dev.launch_shape(-(-n // 4)), (*args, np.int64(n), partials))
    finish = dev.kernel("checksum", "mpicomp_checksum_finish", DEFINES)
    finish((1,), (32,), (partials, np.int64(blocks), np.int64(n), np.uint32(value), out))


def launchers(dev) -> SimpleNamespace:
    """Return the ``checksum`` launchers bound to ``dev``."""
    return bind(dev, "checksum")
