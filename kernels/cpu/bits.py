"""Arbitrary-width bit packing: codes of ``width`` bits, LSB-first, in a byte stream.

Element i occupies bits [i*width, (i+1)*width) of the stream, bit b of a stream
lives in byte b // 8 at position b % 8. Eight elements fill exactly ``width``
bytes, so any run of elements that starts at a multiple of 8 starts on a byte: the
drivers split the work into TASK-element runs packed in parallel.

Inside a run, values go through a BLOCK-element uint32 staging buffer: one loop
computes a block of values (simple enough for the compiler to vectorize), then
``mpicomp_bits_pack_block`` / ``mpicomp_bits_unpack_block`` move it to or from the
stream 32 bits at a time. The fused kernels (``*_repack``, ``*_unpack``) read a packed
stream, combine it with this rank's codes and write the result packed again, with no
full-length temporary; the ring collectives run one of them per step.

Loops index with unsigned or zero-based counters: a signed loop index from a runtime
start makes numba wrap negative indices, which turns vector loads into gathers.
"""

import numba as nb
import numpy as np

from mpicomp.kernels.numba_cache import guard

BLOCK = 2048  # elements per staging block: a multiple of 32, 8 KiB of uint32 (L1)
TASK = 1 << 16  # elements per parallel task: a multiple of BLOCK

_U8 = np.uint64(8)
_U32 = np.uint64(32)
_BYTE = np.uint64(0xFF)


@nb.njit(inline="always", cache=True)
def _tasks(n):
    return (n + TASK - 1) // TASK


@nb.njit(inline="always", cache=True)
def _task(t, n):
    lo = np.int64(t) * TASK  # prange indices are unsigned
    return lo, min(n, lo + TASK)


# Widths up to 16 go 8 elements at a time: a group fills exactly `width` bytes, built in
# one or two 64-bit words (four codes per word, 4*width <= 64 bits) with no dependency
# from one group to the next, and stored as 8-byte runs. Wider codes, and the last
# elements of a stream that do not fill a group, go through a 64-bit bit accumulator.


@nb.njit(inline="always", cache=True)
def _store(out, p, v, nbytes):
    """Write the low ``nbytes`` (<= 8) bytes of uint64 v at out[p], little-endian."""
    for t in range(nbytes):
        out[p + np.uint64(t)] = np.uint8((v >> np.uint64(8 * t)) & _BYTE)


@nb.njit(inline="always", cache=True)
def _store8(out, p, v, exact, nbytes):
    """Write 8 bytes of v at out[p], or only ``nbytes`` when ``exact``.

    The fixed-count branch is the common one: its byte stores merge into one word store.
    """
    if exact:
        _store(out, p, v, nbytes)
    else:
        _store(out, p, v, 8)


@nb.njit(inline="always", cache=True)
def _load8(stream, p, exact, nbytes):
    """Return 8 bytes at stream[p], or only ``nbytes`` when ``exact`` (fixed-count loads merge)."""
    if exact:
        return _load(stream, p, nbytes)
    return _load(stream, p, 8)


@nb.njit(inline="always", cache=True)
def _load(stream, p, nbytes):
    """Return the ``nbytes`` (<= 8) bytes at stream[p] as a little-endian uint64."""
    v = np.uint64(0)
    for t in range(nbytes):
        v |= np.uint64(stream[p + np.uint64(t)]) << np.uint64(8 * t)
    return v


@nb.njit(inline="always", cache=True)
def _word4(vals, j, w):
    """Return vals[j:j+4] side by side, ``w`` bits each, as one uint64 (4*w <= 64)."""
    return (
        np.uint64(vals[j])
        | (np.uint64(vals[j + 1]) << w)
        | (np.uint64(vals[j + 2]) << (w + w))
        | (np.uint64(vals[j + 3]) << (w * np.uint64(3)))
    )


@nb.njit(inline="always", cache=True)
def _unword4(v, w, mask, o, j):
    """Write the four ``w``-bit fields of uint64 v to o[j:j+4]."""
    for k in range(4):
        o[j + k] = np.uint32((v >> (np.uint64(k) * w)) & mask)


@nb.njit(inline="always", cache=True)
def _pack_groups(vals, ngroups, width, out, p, end):
    """Pack vals[0:8*ngroups] (width <= 16) from byte p; return the byte after them.

    Whole 8-byte runs spill into the next group's bytes (rewritten next), never past
    byte ``end`` of this block: the bytes after it may belong to another task. One loop
    per case, so each stays a straight run of word operations.
    """
    w = np.uint64(width)
    sh = w * np.uint64(4)
    if width <= 8:
        for g in range(ngroups):
            v = _word4(vals, 8 * g, w) | (_word4(vals, 8 * g + 4, w) << sh)
            _store8(out, p, v, p + _U8 > end, width)
            p += w
    elif width < 16:
        for g in range(ngroups):
            lo = _word4(vals, 8 * g, w)
            hi = _word4(vals, 8 * g + 4, w)
            _store(out, p, lo | (hi << sh), 8)
            _store8(out, p + _U8, hi >> (np.uint64(64) - sh), p + np.uint64(16) > end, width - 8)
            p += w
    else:
        for g in range(ngroups):
            _store(out, p, _word4(vals, 8 * g, w), 8)
            _store(out, p + _U8, _word4(vals, 8 * g + 4, w), 8)
            p += w
    return p


@nb.njit(inline="always", cache=True)
def _unpack_groups(stream, p, width, ngroups, vals):
    """Unpack 8*ngroups codes (width <= 16) from byte p into vals; return the byte after them."""
    w = np.uint64(width)
    sh = w * np.uint64(4)
    mask = (np.uint64(1) << w) - np.uint64(1)
    size = np.uint64(stream.size)
    if width <= 8:
        for g in range(ngroups):
            v = _load8(stream, p, p + _U8 > size, width)  # whole words while inside the stream
            _unword4(v, w, mask, vals, 8 * g)
            _unword4(v >> sh, w, mask, vals, 8 * g + 4)
            p += w
    elif width < 16:
        for g in range(ngroups):
            lo = _load(stream, p, 8)
            hi = _load8(stream, p + _U8, p + np.uint64(16) > size, width - 8)
            _unword4(lo, w, mask, vals, 8 * g)
            _unword4((lo >> sh) | (hi << (np.uint64(64) - sh)), w, mask, vals, 8 * g + 4)
            p += w
    else:
        for g in range(ngroups):
            _unword4(_load(stream, p, 8), w, mask, vals, 8 * g)
            _unword4(_load(stream, p + _U8, 8), w, mask, vals, 8 * g + 4)
            p += w
    return p


@nb.njit(inline="always", cache=True)
def mpicomp_bits_pack_block(vals, m, width, out, pos):
    """Pack vals[0:m] (each < 2**width, width 1..32) into ``out`` from byte ``pos``.

    ``pos`` is where element 0 of the block starts: the block must begin at a multiple
    of 8 elements of the stream. Writes exactly the bytes of these m elements (the last
    one partly, when m*width is not a multiple of 8).
    """
    full = m // 8 if width <= 16 else 0
    end = np.uint64(pos + (m * width + 7) // 8)
    p = _pack_groups(vals, full, width, out, np.uint64(pos), end)
    w = np.uint64(width)
    acc = np.uint64(0)
    nacc = np.uint64(0)
    for j in range(8 * full, m):
        acc |= np.uint64(vals[j]) << nacc  # nacc < 32 and vals < 2**32: no bit lost
        nacc += w
        if nacc >= _U32:
            _store(out, p, acc, 4)
            p += np.uint64(4)
            acc >>= _U32
            nacc -= _U32
    while nacc > np.uint64(0):
        out[p] = np.uint8(acc & _BYTE)
        p += np.uint64(1)
        acc >>= _U8
        nacc = nacc - _U8 if nacc > _U8 else np.uint64(0)


@nb.njit(inline="always", cache=True)
def mpicomp_bits_unpack_block(stream, pos, width, m, vals):
    """Unpack m codes of ``width`` bits (1..32) starting at byte ``pos`` into vals[0:m].

    Reads whole words while they lie inside ``stream``, bytes at its very end: never
    past ``stream.size``.
    """
    full = m // 8 if width <= 16 else 0
    p = _unpack_groups(stream, np.uint64(pos), width, full, vals)
    w = np.uint64(width)
    mask = (np.uint64(1) << w) - np.uint64(1)
    size = np.uint64(stream.size)
    acc = np.uint64(0)
    nacc = np.uint64(0)
    for j in range(8 * full, m):
        if nacc < w:
            if p + np.uint64(4) <= size:
                acc |= _load(stream, p, 4) << nacc  # nacc < width <= 32: fits in 64 bits
                p += np.uint64(4)
                nacc += _U32
            else:
                while nacc < w:
                    acc |= np.uint64(stream[p]) << nacc
                    p += np.uint64(1)
                    nacc += _U8
        vals[j] = np.uint32(acc & mask)
        acc >>= w
        nacc -= w


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_bits_pack_shifted(codes, shift, width, out):
    """Pack codes[i] + shift (integer codes of any dtype; each sum in [0, 2**width)) into ``out``."""
    n = codes.size
    for t in nb.prange(_tasks(n)):
        lo, hi = _task(t, n)
        tmp = np.empty(BLOCK, np.uint32)
        for b in range(lo, hi, BLOCK):
            src = codes[b : min(hi, b + BLOCK)]
            for j in range(src.size):
                tmp[j] = np.uint32(np.int64(src[j]) + shift)
            mpicomp_bits_pack_block(tmp, src.size, width, out, (b * width) >> 3)


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_bits_unpack_shifted(stream, width, shift, out):
    """Write out[i] = (code i of ``stream``) - shift, for the out.size codes of ``width`` bits."""
    n = out.size
    for t in nb.prange(_tasks(n)):
        lo, hi = _task(t, n)
        tmp = np.empty(BLOCK, np.uint32)
        for b in range(lo, hi, BLOCK):
            dst = out[b : min(hi, b + BLOCK)]
            mpicomp_bits_unpack_block(stream, (b * width) >> 3, width, dst.size, tmp)
            for j in range(dst.size):
                dst[j] = np.int64(tmp[j]) - shift


# Plain Python on purpose: a cached njit function calling a parallel one can crash when
# loaded from numba's cache in another process (the parfor's symbol tags differ).
def mpicomp_bits_pack(codes, width, out):
    """Pack unsigned ``codes`` (< 2**width, width 1..32) into ``out``, LSB-first."""
    mpicomp_bits_pack_shifted(codes, 0, width, out)


def mpicomp_bits_unpack(stream, width, out):
    """Unpack ``out.size`` codes of ``width`` bits (1..32) from ``stream``, LSB-first."""
    mpicomp_bits_unpack_shifted(stream, width, 0, out)


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_bits_add_repack(stream, width, mine, shift, out_width, out):
    """Pack (code i of ``stream``) + mine[i] + shift at ``out_width`` bits into ``out``.

    One ring step: the partial sums received (``width`` bits each) plus this rank's codes
    (any integer dtype, shifted into the unsigned domain), packed for the next rank.
    Every sum must lie in [0, 2**out_width).
    """
    n = mine.size
    for t in nb.prange(_tasks(n)):
        lo, hi = _task(t, n)
        tmp = np.empty(BLOCK, np.uint32)
        for b in range(lo, hi, BLOCK):
            src = mine[b : min(hi, b + BLOCK)]
            mpicomp_bits_unpack_block(stream, (b * width) >> 3, width, src.size, tmp)
            for j in range(src.size):
                tmp[j] += np.uint32(np.int64(src[j]) + shift)
            mpicomp_bits_pack_block(tmp, src.size, out_width, out, (b * out_width) >> 3)


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_bits_add_unpack(stream, width, mine, shift, out):
    """Write out[i] = (code i of ``stream``) + mine[i] + shift: a ring step's sums, unpacked."""
    n = mine.size
    for t in nb.prange(_tasks(n)):
        lo, hi = _task(t, n)
        tmp = np.empty(BLOCK, np.uint32)
        for b in range(lo, hi, BLOCK):
            src = mine[b : min(hi, b + BLOCK)]
            dst = out[b : min(hi, b + BLOCK)]
            mpicomp_bits_unpack_block(stream, (b * width) >> 3, width, src.size, tmp)
            for j in range(src.size):
                dst[j] = np.int64(tmp[j]) + np.int64(src[j]) + shift


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_bits_min_repack(stream, width, mine, out):
    """Pack min(code i of ``stream``, mine[i]) at ``width`` bits into ``out`` (mine >= 0)."""
    n = mine.size
    for t in nb.prange(_tasks(n)):
        lo, hi = _task(t, n)
        tmp = np.empty(BLOCK, np.uint32)
        for b in range(lo, hi, BLOCK):
            src = mine[b : min(hi, b + BLOCK)]
            mpicomp_bits_unpack_block(stream, (b * width) >> 3, width, src.size, tmp)
            for j in range(src.size):
                tmp[j] = min(tmp[j], np.uint32(src[j]))
            mpicomp_bits_pack_block(tmp, src.size, width, out, (b * width) >> 3)


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
