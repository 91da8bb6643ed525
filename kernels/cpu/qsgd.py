"""QSGD-MaxNorm kernels (paper 000 §3.1-3.4): norms, stochastic codes, scale indices,
reconstruction and the shared GlobalRandK coordinates.

All arithmetic on values is float32 in a fixed order (no fastmath), so a CUDA twin built
with --fmad=false gives the same codes: a = |v| / norm; y = a * s; l = floor(y); the
code is l + 1 iff u < y - l, u the counter-based uniform of (key, element index).
Error results are bit masks: ERR_VALUE (NaN/Inf, or |v| above the norm bound),
ERR_INDEX (a scale index outside the scale set), ERR_UNSAFE (a scale index whose
scale would push a code past s_min), ERR_RANGE (a code sum outside ±limit).

The element kernels work on a range [lo, hi) in one thread; the ``*_chunks`` drivers run
them over CHUNK-element chunks in parallel (same bytes, any thread count).
"""

import numba as nb
import numpy as np

from .rng import mpicomp_bits, mpicomp_uniform

ERR_VALUE = 1
ERR_INDEX = 2
ERR_UNSAFE = 4
ERR_RANGE = 8

CHUNK = 1 << 16  # elements per parallel task, and per partial sum of the norm (fixed order)

_LIMIT = np.float32(1.000001)  # |v| / norm may exceed 1 by this (norms computed elsewhere)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_unit(v, norm):
    """Return (a, ok): a = |v| / norm clamped to [0, 1], ok False for NaN/Inf or a > 1 + 1e-6."""
    if norm > _ZERO:
        a = abs(v) / norm
    elif v == _ZERO:
        a = _ZERO
    else:
        a = np.float32(np.inf)
    ok = a <= _LIMIT
    # Clamp so a norm a few ulps short (computed on another rank or device) keeps codes in
    # ±s; a bad value becomes 0 so nothing undefined reaches the float -> int conversion.
    return (min(a, _ONE) if ok else _ZERO), ok


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_round(v, a, s, u):
    """Return the signed code of v: l = floor(a * s), plus 1 iff u < a * s - l."""
    y = a * s
    lo = np.floor(y)
    if u < y - lo:
        lo = lo + _ONE
    c = np.int32(lo)
    return -c if v < _ZERO else c


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_mulhi64(a, b):
    """Return the high 64 bits of the 128-bit product of uint64 a and b."""
    a_lo = a & _LO32
    a_hi = a >> _S32
    b_lo = b & _LO32
    b_hi = b >> _S32
    p1 = a_lo * b_hi
    p2 = a_hi * b_lo
    mid = ((a_lo * b_lo) >> _S32) + (p1 & _LO32) + (p2 & _LO32)
    return a_hi * b_hi + (p1 >> _S32) + (p2 >> _S32) + (mid >> _S32)


@nb.njit(cache=True)
def mpicomp_qsgd_sumsq(x, idx, dense, lo, hi):
    """Return the float64 sum of squares of x[lo:hi] (or x[idx[lo:hi]]) in 8 lanes.

    Element i goes to lane (i - lo) % 8, a tail of fewer than 8 to lane 0; the lanes are
    added as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). NaN/Inf propagate.
    """
    l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = 0.0
    i = lo
    while i + 8 <= hi:
        if dense:
            v0, v1, v2, v3 = x[i], x[i + 1], x[i + 2], x[i + 3]
            v4, v5, v6, v7 = x[i + 4], x[i + 5], x[i + 6], x[i + 7]
        else:
            v0, v1, v2, v3 = x[idx[i]], x[idx[i + 1]], x[idx[i + 2]], x[idx[i + 3]]
            v4, v5, v6, v7 = x[idx[i + 4]], x[idx[i + 5]], x[idx[i + 6]], x[idx[i + 7]]
        l0 += np.float64(v0) * np.float64(v0)
        l1 += np.float64(v1) * np.float64(v1)
        l2 += np.float64(v2) * np.float64(v2)
        l3 += np.float64(v3) * np.float64(v3)
        l4 += np.float64(v4) * np.float64(v4)
        l5 += np.float64(v5) * np.float64(v5)
        l6 += np.float64(v6) * np.float64(v6)
        l7 += np.float64(v7) * np.float64(v7)
        i += 8
    while i < hi:
        v = x[i] if dense else x[idx[i]]
        l0 += np.float64(v) * np.float64(v)
        i += 1
    return ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))


@nb.njit(cache=True)
def mpicomp_qsgd_quantize(x, idx, dense, norm, levels, key, out, lo, hi):
    """Write the code of x[i] (or x[idx[i]]) to out[i], lo <= i < hi; return an error mask.

    The uniform of an element is drawn at its index in x, so a GlobalRandK coordinate
    gets the same rounding noise whatever K is.
    """
    s = np.float32(levels)
    bad = False
    for j in range(lo, hi):
        i = j if dense else idx[j]
        v = x[i]
        a, ok = mpicomp_qsgd_unit(v, norm)
        bad |= not ok
        out[j] = mpicomp_qsgd_round(v, a, s, mpicomp_uniform(key, i))
    return ERR_VALUE if bad else 0


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_pick_scale(a, scales):
    """Return the largest k with a * scales[k] <= scales[0] (scales ascending, float32)."""
    k = scales.size - 1
    while k > 0 and a * scales[k] > scales[0]:
        k -= 1
    return k


@nb.njit(cache=True)
def mpicomp_qsgd_multiscale_index(x, idx, dense, norm, scales, out, lo, hi):
    """Write the index of the finest safe scale of x[i] (or x[idx[i]]) to out[i]; return an error mask."""
    bad = False
    for j in range(lo, hi):
        v = x[j] if dense else x[idx[j]]
        a, ok = mpicomp_qsgd_unit(v, norm)
        bad |= not ok
        out[j] = mpicomp_qsgd_pick_scale(a, scales)
    return ERR_VALUE if bad else 0


@nb.njit(cache=True)
def mpicomp_qsgd_multiscale_quantize(x, idx, dense, norm, scales, sidx, key, out, lo, hi):
    """Write the code of x[i] (or x[idx[i]]) at scale scales[sidx[i]] to out[i]; return an error mask."""
    nsc = scales.size
    err = 0
    for j in range(lo, hi):
        i = j if dense else idx[j]
        v = x[i]
        a, ok = mpicomp_qsgd_unit(v, norm)
        if not ok:
            err |= ERR_VALUE
        k = np.int64(sidx[j])
        if k < 0 or k >= nsc:
            err |= ERR_INDEX
            k = 0
        s = scales[k]
        if a * s > scales[0]:
            err |= ERR_UNSAFE
            a = _ZERO
        out[j] = mpicomp_qsgd_round(v, a, s, mpicomp_uniform(key, i))
    return err


@nb.njit(cache=True)
def mpicomp_qsgd_dequantize(codes, norm, levels, nranks, limit, out, lo, hi):
    """Write out[i] = ((codes[i] * norm) / levels) / nranks in float32; return an error mask."""
    s = np.float32(levels)
    nr = np.float32(nranks)
    bad = False
    for i in range(lo, hi):
        c = np.int64(codes[i])
        bad |= c > limit or c < -limit
        out[i] = ((np.float32(c) * norm) / s) / nr
    return ERR_RANGE if bad else 0


@nb.njit(cache=True)
def mpicomp_qsgd_multiscale_dequantize(codes, sidx, norm, scales, nranks, limit, out, lo, hi):
    """Write out[i] = ((codes[i] * norm) / scales[sidx[i]]) / nranks in float32; return an error mask."""
    nr = np.float32(nranks)
    nsc = scales.size
    err = 0
    for i in range(lo, hi):
        c = np.int64(codes[i])
        if c > limit or c < -limit:
            err |= ERR_RANGE
        k = np.int64(sidx[i])
        if k < 0 or k >= nsc:
            err |= ERR_INDEX
            k = 0
        out[i] = ((np.float32(c) * norm) / scales[k]) / nr
    return err


# Parallel drivers: the kernels above over CHUNK-element chunks, one chunk per task. Each
# element is computed exactly as in a single call, so the bytes do not depend on threads;
# the codec calls a kernel directly for inputs of one chunk or less.


@nb.njit(inline="always", cache=True)
def _chunk(c, n):
    lo = np.int64(c) * CHUNK  # prange indices are unsigned
    return lo, min(n, lo + CHUNK)


@nb.njit(inline="always", cache=True)
def _nchunks(n):
    return (n + CHUNK - 1) // CHUNK


@nb.njit(inline="always", cache=True)
def _or_all(res):
    err = 0
    for r in res:
        err |= r
    return err


@nb.njit(parallel=True, cache=True)
def mpicomp_qsgd_sumsq_chunks(x, idx, dense, n):
    """Return the sum of the chunk sums of mpicomp_qsgd_sumsq, added in chunk order."""
    part = np.empty(_nchunks(n), np.float64)
    for c in nb.prange(part.size):
        lo, hi = _chunk(c, n)
        part[c] = mpicomp_qsgd_sumsq(x, idx, dense, lo, hi)
    total = 0.0
    for p in part:
        total += p
    return total


@nb.njit(parallel=True, cache=True)
def mpicomp_qsgd_quantize_chunks(x, idx, dense, norm, levels, key, out, n):
    """Run mpicomp_qsgd_quantize over all n elements in parallel chunks; return the error mask."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_quantize(x, idx, dense, norm, levels, key, out, lo, hi)
    return _or_all(res)


@nb.njit(parallel=True, cache=True)
def mpicomp_qsgd_multiscale_index_chunks(x, idx, dense, norm, scales, out, n):
    """Run mpicomp_qsgd_multiscale_index over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_multiscale_index(x, idx, dense, norm, scales, out, lo, hi)
    return _or_all(res)


@nb.njit(parallel=True, cache=True)
def mpicomp_qsgd_multiscale_quantize_chunks(x, idx, dense, norm, scales, sidx, key, out, n):
    """Run mpicomp_qsgd_multiscale_quantize over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_multiscale_quantize(
            x, idx, dense, norm, scales, sidx, key, out, lo, hi
        )
    return _or_all(res)


@nb.njit(parallel=True, cache=True)
def mpicomp_qsgd_dequantize_chunks(codes, norm, levels, nranks, limit, out, n):
    """Run mpicomp_qsgd_dequantize over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_dequantize(codes, norm, levels, nranks, limit, out, lo, hi)
    return _or_all(res)


@nb.njit(parallel=True, cache=True)
def mpicomp_qsgd_multiscale_dequantize_chunks(codes, sidx, norm, scales, nranks, limit, out, n):
    """Run mpicomp_qsgd_multiscale_dequantize over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_multiscale_dequantize(
            codes, sidx, norm, scales, nranks, limit, out, lo, hi
        )
    return _or_all(res)


@nb.njit(cache=True)
def mpicomp_qsgd_grandk_scatter(vals, idx, ratio, out):
    """Write out[idx[j]] = vals[j] * ratio (float32); out is zero elsewhere already."""
    for j in range(idx.size):
        out[idx[j]] = vals[j] * ratio


@nb.njit(cache=True)
def mpicomp_qsgd_grandk_select(n, k, key, mask, picks):
    """Draw k distinct coordinates of [0, n) uniformly (Floyd's algorithm) into mask and picks.

    For j = n-k .. n-1: t = floor(bits(key, j) * (j+1) / 2^64); take t unless taken, else j.
    ``mask`` (n bytes, zero) marks the chosen ones; picks[j - (n-k)] records each choice.
    """
    first = n - k
    for j in range(first, n):
        t = np.int64(mpicomp_qsgd_mulhi64(mpicomp_bits(key, j), np.uint64(j + 1)))
        if mask[t]:
            t = j
        mask[t] = 1
        picks[j - first] = t


@nb.njit(cache=True)
def mpicomp_qsgd_grandk_compact(mask, out):
    """Write the positions of the nonzero bytes of mask, in increasing order, to out."""
    j = 0
    for i in range(mask.size):
        if mask[i]:
            out[j] = i
            j += 1


@nb.njit(cache=True)
def mpicomp_qsgd_grandk_sort(picks):
    """Sort the coordinates ``picks`` in place (the short path when k is far below n)."""
    picks.sort()
