"""Adler-32 of payload bytes (the header checksum of ``mpicomp.codecs._wire``), alone or
fused with the copy that moves the bytes anyway.

zlib's serial Adler-32 runs at about a quarter of memcpy here. Written as block sums
(over a block of m bytes b_0..b_{m-1}: s2 += m * s1 + m * sum(b) - sum(i * b_i), then
s1 += sum(b)) the inner loop carries no dependency but two integer sums, which LLVM
vectorizes. Chunks of CHUNK bytes run in parallel and are combined in order, so the
value never depends on the thread count. Kernels that make payload bytes (fp16) use
``block_sums``/``add_block`` on each block while it is still in cache.
"""

import zlib

import numba as nb
import numpy as np

from mpicomp.kernels.checksum import BASE
from mpicomp.kernels.numba_cache import guard

# Bytes per inner block: sum_i i * b_i <= 255 * BLOCK^2 / 2 stays below 2^32.
BLOCK = 4096
# Bytes per parallel task; a call on fewer bytes stays on the caller's thread.
CHUNK = 1 << 20
# The dst of a call that copies nothing (writable, so one compiled kernel serves both).
_NO_DST = np.empty(0, np.uint8)


@nb.njit(inline="always", cache=True)
def block_sums(blk):
    """Return (sum b_i, sum i * b_i) as uint32 of the uint8 block ``blk`` (<= BLOCK bytes)."""
    bsum = np.uint32(0)
    wsum = np.uint32(0)
    # numba widens integer arithmetic to 64 bits; truncating each step lets LLVM keep
    # 32-bit lanes (twice the elements per vector).
    for i in range(blk.size):
        b = np.uint32(blk[i])
        bsum = np.uint32(bsum + b)
        wsum = np.uint32(wsum + np.uint32(b * np.uint32(i)))
    return bsum, wsum


@nb.njit(inline="always", cache=True)
def block_copy_sums(blk, out):
    """``block_sums`` of ``blk``, copying it to ``out`` in the same loop (one read)."""
    bsum = np.uint32(0)
    wsum = np.uint32(0)
    for i in range(blk.size):
        v = blk[i]
        out[i] = v
        b = np.uint32(v)
        bsum = np.uint32(bsum + b)
        wsum = np.uint32(wsum + np.uint32(b * np.uint32(i)))
    return bsum, wsum


@nb.njit(inline="always", cache=True)
def add_block(s1, s2, m, bsum, wsum):
    """Return the (s1, s2) mod BASE of a span extended by a block of m bytes with these sums."""
    s2 = (s2 + m * s1 + m * np.int64(bsum) - np.int64(wsum)) % BASE
    s1 = (s1 + np.int64(bsum)) % BASE
    return s1, s2


@nb.njit(inline="always", cache=True)
def extend(value, s1, s2, m):
    """Return the Adler-32 ``value`` continued over m bytes whose span sums are (s1, s2)."""
    a = np.int64(value) & 0xFFFF
    b = np.int64(value) >> 16
    b = (b + (m % BASE) * a + s2) % BASE
    a = (a + s1) % BASE
    return (b << 16) | a


@nb.njit(inline="always", cache=True)
def _span(src, dst, copy, lo, hi):
    """Return (s1, s2) mod BASE of src[lo:hi] from (0, 0); copy it to dst[lo:hi] when ``copy``."""
    s1 = np.int64(0)
    s2 = np.int64(0)
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        # Zero-based views: indices LLVM knows are in range, so the loop vectorizes.
        if copy:
            bsum, wsum = block_copy_sums(src[start:stop], dst[start:stop])
        else:
            bsum, wsum = block_sums(src[start:stop])
        s1, s2 = add_block(s1, s2, stop - start, bsum, wsum)
    return s1, s2


@nb.njit(nogil=True, cache=True)
def mpicomp_adler32_serial(src, dst, copy, value):
    """Return Adler-32 of uint8 ``src`` continued from ``value`` (1 to start); copy src
    to ``dst`` (same size) in the same pass when ``copy``."""
    s1, s2 = _span(src, dst, copy, 0, src.size)
    return extend(value, s1, s2, src.size)


@nb.njit(parallel=True, nogil=True, cache=True)
def mpicomp_adler32_chunks(src, dst, copy, value):
    """``mpicomp_adler32_serial`` over CHUNK-byte chunks in parallel, combined in order."""
    n = src.size
    nchunks = (n + CHUNK - 1) // CHUNK
    part1 = np.empty(nchunks, np.int64)
    part2 = np.empty(nchunks, np.int64)
    for c in nb.prange(nchunks):
        lo = np.int64(c) * CHUNK  # prange indices are unsigned
        part1[c], part2[c] = _span(src, dst, copy, lo, min(n, lo + CHUNK))
    for c in range(nchunks):
        value = extend(value, part1[c], part2[c], min(CHUNK, n - c * CHUNK))
    return value


def adler32(src, value: int = 1, dst=None) -> int:
    """Return Adler-32 of the uint8 array ``src`` continued from ``value`` (zlib's rule).

    Args:
        src: 1-D uint8 array (read-only is fine).
        value: the running checksum of the bytes before ``src``: 1 for none; 0 gives
            the span checksum that ``combine`` appends to another checksum.
        dst: None, or a writable uint8 array of src's size that receives a copy of
            ``src``, written in the same pass.

    Returns:
        The checksum, equal to ``zlib.adler32(src, value)``.
    """
    copy = dst is not None
    if copy and dst.size != src.size:
        raise ValueError(f"adler32: dst has {dst.size} bytes, src {src.size}")
    if not copy and src.size <= BLOCK and src.flags.c_contiguous:
        return zlib.adler32(src, value)  # a few bytes: no kernel dispatch
    run = mpicomp_adler32_chunks if src.size > CHUNK else mpicomp_adler32_serial
    return int(run(src, dst if copy else _NO_DST, copy, value))


def adler32_into(src, value: int, out, dst=None) -> None:
    """Write ``adler32(src, value, dst)`` into the 4 uint8 ``out``, little-endian (on a GPU
    the twin writes it on the device: a payload's checksum field, no host read)."""
    if out.dtype != np.uint8 or out.size != 4:
        raise ValueError("adler32_into: out must be 4 uint8 bytes")
    out[:] = np.frombuffer(adler32(src, value, dst).to_bytes(4, "little"), np.uint8)


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
