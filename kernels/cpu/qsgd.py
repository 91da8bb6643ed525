"""QSGD-MaxNorm kernels (paper 000 §3.1-3.4): norms, stochastic codes, scale indices,
reconstruction and the shared GlobalRandK coordinates.

All arithmetic on values is float32 in a fixed order (no fastmath), so a CUDA twin (planned) built
with --fmad=false gives the same codes: a = |v| / norm; y = a * s; l = floor(y); the
code is l + 1 iff u < y - l, u the counter-based uniform of (key, element index).
Error results are bit masks: ERR_VALUE (NaN/Inf, or |v| above the norm bound),
ERR_INDEX (a scale index outside the scale set), ERR_UNSAFE (a scale index whose
scale would push a code past s_min), ERR_RANGE (a code sum outside ±limit).

The element kernels work on a range [lo, hi) in one thread; the ``*_chunks`` drivers run
them over CHUNK-element chunks in parallel (same bytes, any thread count). Their loops
are branch-free and run from 0 over slices so that they vectorize (RNG included); the
``*_dequantize_packed`` kernels read the ring's bit-packed sums directly (bits.py).
They use error_model="numpy": no divisor is ever 0, and Python's zero-division check
per element would keep the divisions from vectorizing.
"""

import numba as nb
import numpy as np

from mpicomp._numba_cache import guard
from mpicomp.kernels.qsgd import CHUNK, ERR_RANGE, ERR_VALUE
from mpicomp.kernels.qsgd import LIMIT as _LIMIT

from . import bits as _bits
from .rng import mpicomp_bits, mpicomp_uniform

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


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_sumsq(x, idx, dense, lo, hi):
    """Return the float64 sum of squares of x[lo:hi] (or x[idx[lo:hi]]) in 8 lanes.

    Element i goes to lane (i - lo) % 8, a tail of fewer than 8 to lane 0; the lanes are
    added as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). NaN/Inf propagate (which
    NaN is the compiler's choice: callers only test the sum for finiteness and refuse x).
    """
    l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = 0.0
    m = hi - lo
    full = m - m % 8
    if dense:
        xs = x[lo:hi]
        for j in range(0, full, 8):
            v0, v1, v2, v3 = xs[j], xs[j + 1], xs[j + 2], xs[j + 3]
            v4, v5, v6, v7 = xs[j + 4], xs[j + 5], xs[j + 6], xs[j + 7]
            l0 += np.float64(v0) * np.float64(v0)
            l1 += np.float64(v1) * np.float64(v1)
            l2 += np.float64(v2) * np.float64(v2)
            l3 += np.float64(v3) * np.float64(v3)
            l4 += np.float64(v4) * np.float64(v4)
            l5 += np.float64(v5) * np.float64(v5)
            l6 += np.float64(v6) * np.float64(v6)
            l7 += np.float64(v7) * np.float64(v7)
        for j in range(full, m):
            l0 += np.float64(xs[j]) * np.float64(xs[j])
    else:
        ids = idx[lo:hi]
        for j in range(0, full, 8):
            v0, v1, v2, v3 = x[ids[j]], x[ids[j + 1]], x[ids[j + 2]], x[ids[j + 3]]
            v4, v5, v6, v7 = x[ids[j + 4]], x[ids[j + 5]], x[ids[j + 6]], x[ids[j + 7]]
            l0 += np.float64(v0) * np.float64(v0)
            l1 += np.float64(v1) * np.float64(v1)
            l2 += np.float64(v2) * np.float64(v2)
            l3 += np.float64(v3) * np.float64(v3)
            l4 += np.float64(v4) * np.float64(v4)
            l5 += np.float64(v5) * np.float64(v5)
            l6 += np.float64(v6) * np.float64(v6)
            l7 += np.float64(v7) * np.float64(v7)
        for j in range(full, m):
            v = x[ids[j]]
            l0 += np.float64(v) * np.float64(v)
    return ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))


# The element loops below run from 0 over slices: a signed loop index from a runtime
# start makes numba wrap negative indices, and the compiler then gathers instead of
# loading vectors. Errors accumulate as integer ORs, so the loops stay branch-free.


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_quantize(x, idx, dense, norm, levels, key, out, lo, hi):
    """Write the code of x[i] (or x[idx[i]]) to out[i], lo <= i < hi; return an error mask.

    The uniform of an element is drawn at its index in x, so a GlobalRandK coordinate
    gets the same rounding noise whatever K is.
    """
    s = np.float32(levels)
    o = out[lo:hi]
    bad = 0
    if dense:
        xs = x[lo:hi]
        for j in range(o.size):
            v = xs[j]
            a, ok = mpicomp_qsgd_unit(v, norm)
            bad |= np.int64(not ok)
            o[j] = mpicomp_qsgd_round(v, a, s, mpicomp_uniform(key, lo + j))
    else:
        ids = idx[lo:hi]
        for j in range(o.size):
            i = ids[j]
            v = x[i]
            a, ok = mpicomp_qsgd_unit(v, norm)
            bad |= np.int64(not ok)
            o[j] = mpicomp_qsgd_round(v, a, s, mpicomp_uniform(key, i))
    return ERR_VALUE if bad else 0


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_pick_scale(a, scales):
    """Return the largest k with a * scales[k] <= scales[0] (scales ascending, float32).

    The test is monotone in k (a >= 0), so the count of the k >= 1 that pass is that k.
    """
    if scales.size == 2:
        return np.int64(a * scales[1] <= scales[0])
    k = 0
    for t in range(1, scales.size):
        k += np.int64(a * scales[t] <= scales[0])
    return k


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_index(x, idx, dense, norm, scales, out, lo, hi):
    """Write the index of the finest safe scale of x[i] (or x[idx[i]]) to out[i]; return an error mask."""
    o = out[lo:hi]
    bad = 0
    if dense:
        xs = x[lo:hi]
        for j in range(o.size):
            a, ok = mpicomp_qsgd_unit(xs[j], norm)
            bad |= np.int64(not ok)
            o[j] = mpicomp_qsgd_pick_scale(a, scales)
    else:
        ids = idx[lo:hi]
        for j in range(o.size):
            a, ok = mpicomp_qsgd_unit(x[ids[j]], norm)
            bad |= np.int64(not ok)
            o[j] = mpicomp_qsgd_pick_scale(a, scales)
    return ERR_VALUE if bad else 0


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_scale_at(scales, k):
    """Return (scales[k], k is inside the set) for any integer k; scales[0] when outside."""
    k = np.int64(k)
    inside = (k >= 0) & (k < scales.size)
    return scales[k if inside else 0], inside


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_scale_of_two(s0, s1, k):
    """Return mpicomp_qsgd_scale_at for the scales (s0, s1) as a select (no gather).

    The two-scale loops use it with s0, s1 loaded before the loop, so they vectorize.
    """
    k = np.int64(k)
    return (s1 if k == 1 else s0), (k >= 0) & (k < 2)


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_ms_code(v, norm, s, inside, smin, u):
    """Return (code, error mask) of v at scale s (``inside``: its index was valid), uniform u."""
    a, ok = mpicomp_qsgd_unit(v, norm)
    safe = a * s <= smin
    # ERR_VALUE | ERR_INDEX | ERR_UNSAFE as bits 0, 1, 2: shifts, not selects (vector loops)
    err = np.int64(not ok) | (np.int64(not inside) << 1) | (np.int64(not safe) << 2)
    return mpicomp_qsgd_round(v, a if safe else _ZERO, s, u), err


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_quantize(x, idx, dense, norm, scales, sidx, key, out, lo, hi):
    """Write the code of x[i] (or x[idx[i]]) at scale scales[sidx[i]] to out[i]; return an error mask."""
    o = out[lo:hi]
    ks = sidx[lo:hi]
    s0, s1 = scales[0], scales[scales.size - 1]
    err = 0
    if dense and scales.size == 2:
        xs = x[lo:hi]
        for j in range(o.size):
            s, inside = mpicomp_qsgd_scale_of_two(s0, s1, ks[j])
            u = mpicomp_uniform(key, lo + j)
            o[j], e = mpicomp_qsgd_ms_code(xs[j], norm, s, inside, s0, u)
            err |= e
    else:
        for j in range(o.size):
            i = lo + j if dense else idx[lo + j]
            s, inside = mpicomp_qsgd_scale_at(scales, ks[j])
            o[j], e = mpicomp_qsgd_ms_code(x[i], norm, s, inside, s0, mpicomp_uniform(key, i))
            err |= e
    return err


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_value(c, norm, s, nr, limit):
    """Return (((c * norm) / s) / nr in float32, True iff |c| > limit) for an int64 code sum."""
    return ((np.float32(c) * norm) / s) / nr, (c > limit) | (c < -limit)


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_dequantize(codes, norm, levels, nranks, limit, out, lo, hi):
    """Write out[i] = ((codes[i] * norm) / levels) / nranks in float32; return an error mask."""
    s = np.float32(levels)
    nr = np.float32(nranks)
    cs = codes[lo:hi]
    o = out[lo:hi]
    bad = 0
    for j in range(o.size):
        o[j], far = mpicomp_qsgd_value(np.int64(cs[j]), norm, s, nr, limit)
        bad |= np.int64(far)
    return ERR_RANGE if bad else 0


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_dequantize_packed(stream, width, shift, norm, levels, nranks, limit, out, lo, hi):
    """As mpicomp_qsgd_dequantize for codes[i] = (code i of ``stream``, ``width`` bits) - shift.

    The code sums come straight from the ring's packed result; ``lo`` is a multiple of 8.
    """
    s = np.float32(levels)
    nr = np.float32(nranks)
    tmp = np.empty(_bits.BLOCK, np.uint32)
    bad = 0
    for b in range(lo, hi, _bits.BLOCK):
        o = out[b : min(hi, b + _bits.BLOCK)]
        _bits.mpicomp_bits_unpack_block(stream, (b * width) >> 3, width, o.size, tmp)
        for j in range(o.size):
            o[j], far = mpicomp_qsgd_value(np.int64(tmp[j]) - shift, norm, s, nr, limit)
            bad |= np.int64(far)
    return ERR_RANGE if bad else 0


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_ms_value(c, s, inside, norm, nr, limit):
    """Return (((c * norm) / s) / nr, error mask) for an int64 code sum c at scale s."""
    err = (np.int64(not inside) << 1) | (np.int64((c > limit) | (c < -limit)) << 3)
    return ((np.float32(c) * norm) / s) / nr, err


@nb.njit(inline="always", cache=True)
def _ms_dequantize(cs, shift, ks, norm, scales, nr, limit, o):
    """o[j] = the value of code sum cs[j] - shift at scale index ks[j]; return the error mask."""
    s0, s1 = scales[0], scales[scales.size - 1]
    err = 0
    if scales.size == 2:
        for j in range(o.size):
            s, inside = mpicomp_qsgd_scale_of_two(s0, s1, ks[j])
            o[j], e = mpicomp_qsgd_ms_value(np.int64(cs[j]) - shift, s, inside, norm, nr, limit)
            err |= e
    else:
        for j in range(o.size):
            s, inside = mpicomp_qsgd_scale_at(scales, ks[j])
            o[j], e = mpicomp_qsgd_ms_value(np.int64(cs[j]) - shift, s, inside, norm, nr, limit)
            err |= e
    return err


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_dequantize(codes, sidx, norm, scales, nranks, limit, out, lo, hi):
    """Write out[i] = ((codes[i] * norm) / scales[sidx[i]]) / nranks in float32; return an error mask."""
    nr = np.float32(nranks)
    return _ms_dequantize(codes[lo:hi], 0, sidx[lo:hi], norm, scales, nr, limit, out[lo:hi])


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_dequantize_packed(
    stream, width, shift, sidx, norm, scales, nranks, limit, out, lo, hi
):
    """As mpicomp_qsgd_multiscale_dequantize for codes[i] = (code i of ``stream``) - shift."""
    nr = np.float32(nranks)
    tmp = np.empty(_bits.BLOCK, np.uint32)
    err = 0
    for b in range(lo, hi, _bits.BLOCK):
        o = out[b : min(hi, b + _bits.BLOCK)]
        _bits.mpicomp_bits_unpack_block(stream, (b * width) >> 3, width, o.size, tmp)
        ks = sidx[b : b + o.size]
        err |= _ms_dequantize(tmp, shift, ks, norm, scales, nr, limit, o)
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


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
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


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_quantize_chunks(x, idx, dense, norm, levels, key, out, n):
    """Run mpicomp_qsgd_quantize over all n elements in parallel chunks; return the error mask."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_quantize(x, idx, dense, norm, levels, key, out, lo, hi)
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_index_chunks(x, idx, dense, norm, scales, out, n):
    """Run mpicomp_qsgd_multiscale_index over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_multiscale_index(x, idx, dense, norm, scales, out, lo, hi)
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_quantize_chunks(x, idx, dense, norm, scales, sidx, key, out, n):
    """Run mpicomp_qsgd_multiscale_quantize over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_multiscale_quantize(
            x, idx, dense, norm, scales, sidx, key, out, lo, hi
        )
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_dequantize_chunks(codes, norm, levels, nranks, limit, out, n):
    """Run mpicomp_qsgd_dequantize over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_dequantize(codes, norm, levels, nranks, limit, out, lo, hi)
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_dequantize_chunks(codes, sidx, norm, scales, nranks, limit, out, n):
    """Run mpicomp_qsgd_multiscale_dequantize over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_multiscale_dequantize(
            codes, sidx, norm, scales, nranks, limit, out, lo, hi
        )
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_dequantize_packed_chunks(
    stream, width, shift, norm, levels, nranks, limit, out, n
):
    """Run mpicomp_qsgd_dequantize_packed over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_dequantize_packed(
            stream, width, shift, norm, levels, nranks, limit, out, lo, hi
        )
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_dequantize_packed_chunks(
    stream, width, shift, sidx, norm, scales, nranks, limit, out, n
):
    """Run mpicomp_qsgd_multiscale_dequantize_packed over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_multiscale_dequantize_packed(
            stream, width, shift, sidx, norm, scales, nranks, limit, out, lo, hi
        )
    return _or_all(res)


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_grandk_scatter(vals, idx, ratio, out):
    """Write out[idx[j]] = vals[j] * ratio (float32); out is zero elsewhere already."""
    for j in range(idx.size):
        out[idx[j]] = vals[j] * ratio


@nb.njit(cache=True, nogil=True, error_model="numpy")
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


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_grandk_compact(mask, out):
    """Write the positions of the nonzero bytes of mask, in increasing order, to out."""
    j = 0
    for i in range(mask.size):
        if mask[i]:
            out[j] = i
            j += 1


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_grandk_sort(picks):
    """Sort the coordinates ``picks`` in place (the short path when k is far below n)."""
    picks.sort()


# --- launchers: the numba backend's ``qsgd`` family (the same signatures on every backend) ---


def _over(kernel, chunks, n, *args):
    """Call ``kernel`` on [0, n) directly for one chunk or less, else its parallel driver."""
    if n <= CHUNK:
        return kernel(*args, 0, n)
    return chunks(*args, n)


def sumsq(x, idx, dense) -> float:
    """Return the float64 sum of squares of x (``dense``) or of x[idx], in CHUNK order."""
    n = x.size if dense else idx.size
    return _over(mpicomp_qsgd_sumsq, mpicomp_qsgd_sumsq_chunks, n, x, idx, dense)


def quantize(x, idx, dense, norm, levels, key, out) -> int:
    """Write the codes of x (``dense``) or x[idx] into ``out``; return an error mask."""
    args = (x, idx, dense, norm, levels, key, out)
    return _over(mpicomp_qsgd_quantize, mpicomp_qsgd_quantize_chunks, out.size, *args)


def multiscale_index(x, idx, dense, norm, scales, out) -> int:
    """Write each element's scale index into uint8 ``out``; return an error mask."""
    args = (x, idx, dense, norm, scales, out)
    return _over(
        mpicomp_qsgd_multiscale_index, mpicomp_qsgd_multiscale_index_chunks, out.size, *args
    )


def multiscale_quantize(x, idx, dense, norm, scales, sidx, key, out) -> int:
    """Write the codes at the shared scale indices ``sidx`` into ``out``; return an error mask."""
    args = (x, idx, dense, norm, scales, sidx, key, out)
    return _over(
        mpicomp_qsgd_multiscale_quantize, mpicomp_qsgd_multiscale_quantize_chunks, out.size, *args
    )


def dequantize(codes, norm, levels, nranks, limit, out) -> int:
    """Write out = ((codes * norm) / levels) / nranks in float32; return an error mask."""
    args = (codes, norm, levels, nranks, limit, out)
    return _over(mpicomp_qsgd_dequantize, mpicomp_qsgd_dequantize_chunks, out.size, *args)


def dequantize_packed(stream, width, shift, norm, levels, nranks, limit, out) -> int:
    """As ``dequantize`` for codes[i] = (the ``width``-bit code i of ``stream``) - shift."""
    args = (stream, width, shift, norm, levels, nranks, limit, out)
    return _over(
        mpicomp_qsgd_dequantize_packed, mpicomp_qsgd_dequantize_packed_chunks, out.size, *args
    )


def multiscale_dequantize(codes, sidx, norm, scales, nranks, limit, out) -> int:
    """Write out = ((codes * norm) / scales[sidx]) / nranks in float32; return an error mask."""
    args = (codes, sidx, norm, scales, nranks, limit, out)
    return _over(
        mpicomp_qsgd_multiscale_dequantize,
        mpicomp_qsgd_multiscale_dequantize_chunks,
        out.size,
        *args,
    )


def multiscale_dequantize_packed(stream, width, shift, sidx, norm, scales, nranks, limit, out):
    """As ``multiscale_dequantize`` for codes read from a packed ``stream`` (less ``shift``)."""
    args = (stream, width, shift, sidx, norm, scales, nranks, limit, out)
    return _over(
        mpicomp_qsgd_multiscale_dequantize_packed,
        mpicomp_qsgd_multiscale_dequantize_packed_chunks,
        out.size,
        *args,
    )


# Compiled under the cache directory's lock, one process at a time (mpicomp/_numba_cache.py).
guard(globals())
