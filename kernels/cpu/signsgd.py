"""signSGD kernels: sign bits, votes and the majority decision from vote counts.

Element loops run from 0 over slices (see bits.py: a signed loop index from a runtime
start keeps numba from vectorizing); the parallel ones split the work into CHUNK-element
tasks. Sums of |x| are added per chunk in a fixed order, then chunk by chunk: the same
float whatever the thread count. A NaN in x only sets the flags that make the codec refuse
x; which NaN a sum of |x| returns is left to the compiler (nothing sends it).
"""

import numba as nb
import numpy as np

from mpicomp.kernels.numba_cache import guard
from mpicomp.kernels.signsgd import CHUNK, TIE_POSITIVE, TIE_RANDOM

from . import bits as _bits
from .floatbits import bits_float, float_bits
from .rng import mpicomp_bits

_SIGN = np.uint32(0x80000000)


@nb.njit(inline="always", cache=True)
def _chunk(c, n):
    lo = np.int64(c) * CHUNK  # prange indices are unsigned
    return lo, min(n, lo + CHUNK)


@nb.njit(inline="always", cache=True)
def _abs_sum(xs):
    """Return sum |xs| in float64 over 4 lanes (element j to lane j % 4, tail to lane 0)."""
    l0 = l1 = l2 = l3 = 0.0
    full = xs.size - xs.size % 4
    for j in range(0, full, 4):
        l0 += abs(np.float64(xs[j]))
        l1 += abs(np.float64(xs[j + 1]))
        l2 += abs(np.float64(xs[j + 2]))
        l3 += abs(np.float64(xs[j + 3]))
    for j in range(full, xs.size):
        l0 += abs(np.float64(xs[j]))
    return (l0 + l1) + (l2 + l3)


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_signsgd_pack(x, out):
    """Pack bit i = (x[i] > 0) LSB-first into ``out``; return False if ``x`` holds NaN/Inf."""
    n = x.size
    bad = np.zeros((n + CHUNK - 1) // CHUNK, np.int64)
    for c in nb.prange(bad.size):
        lo, hi = _chunk(c, n)
        xs = x[lo:hi]
        o = out[lo // 8 : (hi + 7) // 8]
        nb_bad = 0
        for b in range(o.size):
            byte = 0
            for k in range(min(8, xs.size - 8 * b)):
                v = xs[8 * b + k]
                nb_bad |= np.int64(not np.isfinite(v))
                byte |= np.int64(v > np.float32(0)) << k
            o[b] = np.uint8(byte)
        bad[c] = nb_bad
    return not bad.any()


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_signsgd_votes_scale(x, out):
    """Write out[i] = 1 if x[i] > 0 else 0 and return (no NaN/Inf in x, sum |x| in float64).

    One pass over x for both the votes and the scale.
    """
    n = x.size
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    part = np.zeros(nchunks, np.float64)
    for c in nb.prange(nchunks):
        lo, hi = _chunk(c, n)
        xs = x[lo:hi]
        o = out[lo:hi]
        nb_bad = 0
        for j in range(xs.size):
            v = xs[j]
            nb_bad |= np.int64(not np.isfinite(v))
            o[j] = np.uint8(v > np.float32(0))
        bad[c] = nb_bad
        part[c] = _abs_sum(xs)
    total = 0.0
    for p in part:
        total += p
    return not bad.any(), total


# Plain Python: a cached njit function must not call a parallel one (see bits.py).
def mpicomp_signsgd_votes(x, out):
    """Write out[i] = 1 if x[i] > 0 else 0; return False if ``x`` holds NaN/Inf."""
    ok, _ = mpicomp_signsgd_votes_scale(x, out)
    return ok


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_signsgd_majority(counts, nranks, tie, key, offset, out):
    """Pack bit i = majority of ``nranks`` votes given ``counts[i]`` votes for +1, LSB-first.

    A tie (2*count == nranks) follows ``tie``; TIE_RANDOM draws the bit from the
    counter-based RNG at global index ``offset + i``, identical on every rank.
    Returns False (``out`` then undefined) if a count lies outside [0, nranks].
    """
    n = counts.size
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    draw = tie == TIE_RANDOM and nranks % 2 == 0  # an odd number of voters never ties
    fixed = np.int64(tie == TIE_POSITIVE)
    for c in nb.prange(nchunks):
        lo, hi = _chunk(c, n)
        cs = counts[lo:hi]
        decided = np.empty(cs.size, np.uint32)
        nb_bad = 0
        for j in range(cs.size):  # branch-free, so it vectorizes (RNG included)
            count = np.int64(cs[j])
            nb_bad |= np.int64((count < 0) | (count > nranks))
            twice = 2 * count
            if draw:
                pick = np.int64(mpicomp_bits(key, offset + lo + j) >> np.uint64(63))
            else:
                pick = fixed
            decided[j] = np.uint32((twice > nranks) | ((twice == nranks) & (pick == 1)))
        bad[c] = nb_bad
        _bits.mpicomp_bits_pack_block(decided, cs.size, 1, out, lo // 8)
    return not bad.any()


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_signsgd_expand(bits, scale, out):
    """Write out[i] = +scale if bit i of ``bits`` is set, else -scale."""
    n = out.size
    pos = np.float32(scale)
    # A flip of the sign bit, as signsgd.cu's: numba's -x is 0 - x (fsub -0.0), whose NaN
    # sign and quieting the compiler would pick.
    neg = bits_float(float_bits(pos) ^ _SIGN)
    for c in nb.prange((n + CHUNK - 1) // CHUNK):
        lo, hi = _chunk(c, n)
        o = out[lo:hi]
        bs = bits[lo // 8 : (hi + 7) // 8]
        for j in range(o.size):
            o[j] = pos if (bs[j >> 3] >> (j & 7)) & 1 else neg


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_signsgd_abs_sum(x):
    """Return sum |x| accumulated in float64 in a fixed order (NaN/Inf propagate)."""
    n = x.size
    part = np.zeros((n + CHUNK - 1) // CHUNK, np.float64)
    for c in nb.prange(part.size):
        lo, hi = _chunk(c, n)
        part[c] = _abs_sum(x[lo:hi])
    total = 0.0
    for p in part:
        total += p
    return total


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
