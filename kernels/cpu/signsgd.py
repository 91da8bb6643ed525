"""signSGD kernels: sign bits, votes and the majority decision from vote counts."""

import numba as nb
import numpy as np

from .rng import mpicomp_bits

TIE_NEGATIVE = 0
TIE_POSITIVE = 1
TIE_RANDOM = 2


@nb.njit(parallel=True, cache=True)
def mpicomp_signsgd_pack(x, out):
    """Pack bit i = (x[i] > 0) LSB-first into ``out``; return False if ``x`` holds NaN/Inf."""
    n = x.size
    bad = 0
    for b in nb.prange((n + 7) // 8):
        byte = 0
        for i in range(b * 8, min(n, b * 8 + 8)):
            v = x[i]
            if not np.isfinite(v):
                bad += 1
            if v > np.float32(0):
                byte |= 1 << (i - b * 8)
        out[b] = np.uint8(byte)
    return bad == 0


@nb.njit(parallel=True, cache=True)
def mpicomp_signsgd_votes(x, out):
    """Write out[i] = 1 if x[i] > 0 else 0; return False if ``x`` holds NaN/Inf."""
    bad = 0
    for i in nb.prange(x.size):
        v = x[i]
        if not np.isfinite(v):
            bad += 1
        out[i] = np.uint8(1) if v > np.float32(0) else np.uint8(0)
    return bad == 0


@nb.njit(parallel=True, cache=True)
def mpicomp_signsgd_majority(counts, nranks, tie, key, offset, out):
    """Pack bit i = majority of ``nranks`` votes given ``counts[i]`` votes for +1, LSB-first.

    A tie (2*count == nranks) follows ``tie``; TIE_RANDOM draws the bit from the
    counter-based RNG at global index ``offset + i``, identical on every rank.
    """
    n = counts.size
    for b in nb.prange((n + 7) // 8):
        byte = 0
        for i in range(b * 8, min(n, b * 8 + 8)):
            twice = 2 * np.int64(counts[i])
            if twice > nranks:
                bit = 1
            elif twice < nranks:
                bit = 0
            elif tie == TIE_RANDOM:
                bit = np.int64(mpicomp_bits(key, offset + i) >> np.uint64(63))
            else:
                bit = tie
            byte |= bit << (i - b * 8)
        out[b] = np.uint8(byte)


@nb.njit(parallel=True, cache=True)
def mpicomp_signsgd_expand(bits, scale, out):
    """Write out[i] = +scale if bit i of ``bits`` is set, else -scale."""
    for i in nb.prange(out.size):
        out[i] = scale if (bits[i >> 3] >> (i & 7)) & 1 else -scale


@nb.njit(parallel=True, cache=True)
def mpicomp_signsgd_abs_sum(x):
    """Return sum |x| accumulated in float64 (NaN/Inf propagate)."""
    acc = 0.0
    for i in nb.prange(x.size):
        acc += abs(np.float64(x[i]))
    return acc
