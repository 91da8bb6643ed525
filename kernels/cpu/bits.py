"""Arbitrary-width bit packing: codes of ``width`` bits, LSB-first, in a byte stream.

Element i occupies bits [i*width, (i+1)*width) of the stream, bit b of a stream
lives in byte b // 8 at position b % 8. Eight elements fill exactly ``width``
bytes, so groups of eight are independent: the loops run in parallel over them.
"""

import numba as nb
import numpy as np


@nb.njit(cache=True)
def packed_size(n, width):
    """Return the number of bytes that ``n`` codes of ``width`` bits take."""
    return (n * width + 7) // 8


@nb.njit(parallel=True, cache=True)
def mpicomp_bits_pack(codes, width, out):
    """Pack unsigned ``codes`` (< 2**width, width 1..32) into ``out``, LSB-first."""
    n = codes.size
    groups = (n + 7) // 8
    for g in nb.prange(groups):
        acc = np.uint64(0)
        nacc = 0
        pos = g * width  # first byte of this group
        for i in range(g * 8, min(n, g * 8 + 8)):
            acc |= np.uint64(codes[i]) << np.uint64(nacc)
            nacc += width
            while nacc >= 8:
                out[pos] = np.uint8(acc & np.uint64(0xFF))
                acc >>= np.uint64(8)
                nacc -= 8
                pos += 1
        if nacc > 0:
            out[pos] = np.uint8(acc & np.uint64(0xFF))


@nb.njit(parallel=True, cache=True)
def mpicomp_bits_unpack(stream, width, out):
    """Unpack ``out.size`` codes of ``width`` bits (1..32) from ``stream``, LSB-first."""
    n = out.size
    groups = (n + 7) // 8
    mask = (np.uint64(1) << np.uint64(width)) - np.uint64(1)
    for g in nb.prange(groups):
        acc = np.uint64(0)
        nacc = 0
        pos = g * width
        for i in range(g * 8, min(n, g * 8 + 8)):
            while nacc < width:
                acc |= np.uint64(stream[pos]) << np.uint64(nacc)
                pos += 1
                nacc += 8
            out[i] = acc & mask
            acc >>= np.uint64(width)
            nacc -= width
