"""QSGD-MaxNorm kernels (the unbiased quantizers paper §3.1-3.4): norms, stochastic codes,
scale indices, reconstruction and the shared GlobalRandK coordinates.

All arithmetic on values is float32 in a fixed order (no fastmath), so the CUDA twin built
with --fmad=false gives the same codes: a = |v| / norm; y = a * s; l = floor(y); the
code is l + 1 iff u < y - l, u the counter-based uniform of (key, element index).
``norm`` is the norm of the element's block: ``norms[b]`` for starts[b] <= i <
starts[b + 1] (kernels/qsgd.py); a block norm that is not a finite float32 >= 0 sets
ERR_NORM.
Error results are bit masks: ERR_VALUE (NaN/Inf, or |v| above the norm bound),
ERR_INDEX (a scale index outside the scale set), ERR_UNSAFE (a scale index whose
scale would push a code past s_min), ERR_RANGE (a code sum outside ±limit), ERR_NORM.

The element kernels work on a range [lo, hi) in one thread; the ``*_chunks`` drivers run
them over CHUNK-element chunks in parallel (same bytes, any thread count). Their loops
are branch-free and run from 0 over slices so that they vectorize (RNG included); the
``*_dequantize_packed`` kernels read the ring's bit-packed sums directly (bits.py).
They use error_model="numpy": no divisor is ever 0, and Python's zero-division check
per element would keep the divisions from vectorizing.
"""

import numba as nb
import numpy as np

from mpicomp.kernels.numba_cache import guard
from mpicomp.kernels.qsgd import CHUNK, ERR_NORM, ERR_OVERFLOW, ERR_RANGE, ERR_VALUE
from mpicomp.kernels.qsgd import F32_MAX as _F32_MAX
from mpicomp.kernels.qsgd import LIMIT as _LIMIT

from . import bits as _bits
from .rng import mpicomp_bits, mpicomp_uniform

_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_NO_SCALE = np.empty(0, np.uint8)  # the single-scale kernels' scale indices: none
_NO_LEVELS = np.empty(0, np.float32)
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
# loading vectors. Errors accumulate as integer ORs, so the loops stay branch-free. A
# ``_run`` helper works on a range inside one block, against that block's norm (a
# scalar, so the loop vectorizes); the kernels walk the blocks of their range.


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_block_at(starts, regular, i):
    """Return the block of element i: i // regular, or the b with starts[b] <= i < starts[b + 1]."""
    if regular > 0:
        return i // regular
    lo = np.int64(0)
    hi = np.int64(starts.size - 1)  # starts[lo] <= i < starts[hi]
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if starts[mid] <= i:
            lo = mid
        else:
            hi = mid
    return lo


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_norm_bad(norm):
    """Return ERR_NORM unless ``norm`` is a finite float32 >= 0 (NaN fails), else 0."""
    return 0 if (norm >= _ZERO) & (norm <= _F32_MAX) else ERR_NORM


@nb.njit(inline="always", cache=True)
def _block_end(starts, b, hi):
    return min(hi, starts[b + 1])


@nb.njit(cache=True, nogil=True, error_model="numpy")
def _quantize_run(x, idx, dense, norm, s, key, out, lo, hi):
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


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_quantize(x, idx, dense, norms, starts, regular, levels, key, out, lo, hi):
    """Write the code of x[i] (or x[idx[i]]) against its block's norm to out[i], lo <= i < hi; return an error mask.

    The uniform of an element is drawn at its index in x, so a GlobalRandK coordinate
    gets the same rounding noise whatever K is.
    """
    s = np.float32(levels)
    err = 0
    b = mpicomp_qsgd_block_at(starts, regular, lo)
    while lo < hi:
        end = _block_end(starts, b, hi)
        norm = norms[b]
        err |= mpicomp_qsgd_norm_bad(norm) | _quantize_run(
            x, idx, dense, norm, s, key, out, lo, end
        )
        lo, b = end, b + 1
    return err


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
def _index_run(x, idx, dense, norm, scales, out, lo, hi):
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


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_index(x, idx, dense, norms, starts, regular, scales, out, lo, hi):
    """Write the index of the finest safe scale of x[i] (or x[idx[i]]) to out[i]; return an error mask."""
    err = 0
    b = mpicomp_qsgd_block_at(starts, regular, lo)
    while lo < hi:
        end = _block_end(starts, b, hi)
        norm = norms[b]
        err |= mpicomp_qsgd_norm_bad(norm) | _index_run(x, idx, dense, norm, scales, out, lo, end)
        lo, b = end, b + 1
    return err


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
def _ms_quantize_run(x, idx, dense, norm, scales, sidx, key, out, lo, hi):
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


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_quantize(
    x, idx, dense, norms, starts, regular, scales, sidx, key, out, lo, hi
):
    """Write the code of x[i] (or x[idx[i]]) at scale scales[sidx[i]] to out[i]; return an error mask."""
    err = 0
    b = mpicomp_qsgd_block_at(starts, regular, lo)
    while lo < hi:
        end = _block_end(starts, b, hi)
        norm = norms[b]
        err |= mpicomp_qsgd_norm_bad(norm)
        err |= _ms_quantize_run(x, idx, dense, norm, scales, sidx, key, out, lo, end)
        lo, b = end, b + 1
    return err


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_value(c, norm, s, nr, limit):
    """Return (((c * norm) / s) / nr in float32, True iff |c| > limit) for an int64 code sum."""
    return ((np.float32(c) * norm) / s) / nr, (c > limit) | (c < -limit)


@nb.njit(inline="always", cache=True)
def _values(cs, shift, norm, s, nr, limit, o):
    """o[j] = the value of code sum cs[j] - shift; return ERR_RANGE if one is beyond limit."""
    bad = 0
    for j in range(o.size):
        o[j], far = mpicomp_qsgd_value(np.int64(cs[j]) - shift, norm, s, nr, limit)
        bad |= np.int64(far)
    return ERR_RANGE if bad else 0


@nb.njit(inline="always", cache=True)
def mpicomp_qsgd_ms_value(c, s, inside, norm, nr, limit):
    """Return (((c * norm) / s) / nr, error mask) for an int64 code sum c at scale s."""
    err = (np.int64(not inside) << 1) | (np.int64((c > limit) | (c < -limit)) << 3)
    return ((np.float32(c) * norm) / s) / nr, err


@nb.njit(inline="always", cache=True)
def _ms_values(cs, shift, ks, norm, scales, nr, limit, o):
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


@nb.njit(inline="always", cache=True)
def _values_by_block(cs, shift, ks, norms, starts, regular, s, scales, nr, limit, o, lo):
    """o[j] = the value of code sum cs[j] - shift for o the elements lo <= i < lo + o.size
    of the coded vector, each against its block's norm: at scale scales[ks[j]]
    (multi-scale), or s where ks is empty."""
    err = 0
    hi = lo + o.size
    b = mpicomp_qsgd_block_at(starts, regular, lo)
    at = lo
    while at < hi:
        end = _block_end(starts, b, hi)
        norm = norms[b]
        j, k = at - lo, end - lo
        err |= mpicomp_qsgd_norm_bad(norm)
        if ks.size:
            err |= _ms_values(cs[j:k], shift, ks[j:k], norm, scales, nr, limit, o[j:k])
        else:
            err |= _values(cs[j:k], shift, norm, s, nr, limit, o[j:k])
        at, b = end, b + 1
    return err


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_dequantize(
    codes, norms, starts, regular, levels, nranks, limit, out, base, lo, hi
):
    """Write out[i] = ((codes[i] * norm) / levels) / nranks in float32, norm the block of
    element base + i (codes and out start at element ``base``); return an error mask."""
    s = np.float32(levels)
    nr = np.float32(nranks)
    cs, o = codes[lo:hi], out[lo:hi]
    return _values_by_block(
        cs, 0, _NO_SCALE, norms, starts, regular, s, _NO_LEVELS, nr, limit, o, base + lo
    )


@nb.njit(inline="always", cache=True)
def _packed_values(
    stream, width, shift, ks, norms, starts, regular, s, scales, nr, limit, out, base, lo, hi
):
    """_values_by_block of the code sums read from ``stream`` (``width`` bits, less
    ``shift``), a bits BLOCK at a time, out[i] being element base + i; ``lo`` is a
    multiple of 8."""
    tmp = np.empty(_bits.BLOCK, np.uint32)
    err = 0
    for b in range(lo, hi, _bits.BLOCK):
        o = out[b : min(hi, b + _bits.BLOCK)]
        _bits.mpicomp_bits_unpack_block(stream, (b * width) >> 3, width, o.size, tmp)
        kb = ks[b : b + o.size]
        at = base + b
        err |= _values_by_block(tmp, shift, kb, norms, starts, regular, s, scales, nr, limit, o, at)
    return err


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_dequantize_packed(
    stream, width, shift, norms, starts, regular, levels, nranks, limit, out, base, lo, hi
):
    """As mpicomp_qsgd_dequantize for codes[i] = (code i of ``stream``, ``width`` bits) - shift.

    The code sums come straight from the ring's packed result; ``lo`` is a multiple of 8.
    """
    s, nr, ks, scales = np.float32(levels), np.float32(nranks), _NO_SCALE, _NO_LEVELS
    return _packed_values(
        stream, width, shift, ks, norms, starts, regular, s, scales, nr, limit, out, base, lo, hi
    )


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_dequantize(
    codes, sidx, norms, starts, regular, scales, nranks, limit, out, base, lo, hi
):
    """Write out[i] = ((codes[i] * norm) / scales[sidx[i]]) / nranks in float32, norm the
    block of element base + i; return an error mask."""
    nr = np.float32(nranks)
    cs, ks, o = codes[lo:hi], sidx[lo:hi], out[lo:hi]
    at = base + lo
    return _values_by_block(cs, 0, ks, norms, starts, regular, _ONE, scales, nr, limit, o, at)


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_dequantize_packed(
    stream, width, shift, sidx, norms, starts, regular, scales, nranks, limit, out, base, lo, hi
):
    """As mpicomp_qsgd_multiscale_dequantize for codes[i] = (code i of ``stream``) - shift."""
    nr, s = np.float32(nranks), _ONE
    return _packed_values(
        stream, width, shift, sidx, norms, starts, regular, s, scales, nr, limit, out, base, lo, hi
    )


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_piece_sums(x, idx, dense, pieces, part, lo, hi):
    """Write part[p] = mpicomp_qsgd_sumsq of piece p (pieces[p] <= i < pieces[p + 1]), lo <= p < hi."""
    for p in range(lo, hi):
        part[p] = mpicomp_qsgd_sumsq(x, idx, dense, pieces[p], pieces[p + 1])


@nb.njit(cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_block_norms(part, first, out):
    """Write out[b] = float32(sqrt(the sums of block b's pieces, added in order)); return an error mask.

    ERR_VALUE for a sum that is NaN/Inf (the input held one), ERR_OVERFLOW for a norm
    beyond float32; out[b] is 0 then.
    """
    err = 0
    for b in range(out.size):
        total = 0.0
        for p in range(first[b], first[b + 1]):
            total += part[p]
        norm = np.sqrt(total)
        finite = np.isfinite(total)
        fits = norm <= np.float64(_F32_MAX)
        err |= (0 if finite else ERR_VALUE) | (ERR_OVERFLOW if finite and not fits else 0)
        out[b] = np.float32(norm) if finite and fits else _ZERO
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
def mpicomp_qsgd_piece_sums_chunks(x, idx, dense, pieces, part, n):
    """Run mpicomp_qsgd_piece_sums over all n pieces in parallel."""
    for p in nb.prange(n):
        part[p] = mpicomp_qsgd_sumsq(x, idx, dense, pieces[p], pieces[p + 1])


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_quantize_chunks(x, idx, dense, norms, starts, regular, levels, key, out, n):
    """Run mpicomp_qsgd_quantize over all n elements in parallel chunks; return the error mask."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_quantize(
            x, idx, dense, norms, starts, regular, levels, key, out, lo, hi
        )
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_index_chunks(x, idx, dense, norms, starts, regular, scales, out, n):
    """Run mpicomp_qsgd_multiscale_index over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_multiscale_index(
            x, idx, dense, norms, starts, regular, scales, out, lo, hi
        )
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_quantize_chunks(
    x, idx, dense, norms, starts, regular, scales, sidx, key, out, n
):
    """Run mpicomp_qsgd_multiscale_quantize over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_multiscale_quantize(
            x, idx, dense, norms, starts, regular, scales, sidx, key, out, lo, hi
        )
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_dequantize_chunks(
    codes, norms, starts, regular, levels, nranks, limit, out, base, n
):
    """Run mpicomp_qsgd_dequantize over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_dequantize(
            codes, norms, starts, regular, levels, nranks, limit, out, base, lo, hi
        )
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_dequantize_chunks(
    codes, sidx, norms, starts, regular, scales, nranks, limit, out, base, n
):
    """Run mpicomp_qsgd_multiscale_dequantize over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_multiscale_dequantize(
            codes, sidx, norms, starts, regular, scales, nranks, limit, out, base, lo, hi
        )
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_dequantize_packed_chunks(
    stream, width, shift, norms, starts, regular, levels, nranks, limit, out, base, n
):
    """Run mpicomp_qsgd_dequantize_packed over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        res[c] = mpicomp_qsgd_dequantize_packed(
            stream, width, shift, norms, starts, regular, levels, nranks, limit, out, base, lo, hi
        )
    return _or_all(res)


@nb.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def mpicomp_qsgd_multiscale_dequantize_packed_chunks(
    stream, width, shift, sidx, norms, starts, regular, scales, nranks, limit, out, base, n
):
    """Run mpicomp_qsgd_multiscale_dequantize_packed over all n elements in parallel chunks."""
    res = np.empty(_nchunks(n), np.int64)
    for c in nb.prange(res.size):
        lo, hi = _chunk(c, n)
        args = (stream, width, shift, sidx, norms, starts, regular, scales, nranks, limit, out)
        res[c] = mpicomp_qsgd_multiscale_dequantize_packed(*args, base, lo, hi)
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


def block_norms(x, idx, dense, pieces, first, out) -> int:
    """Write the float32 L2 norm of each block of x (``dense``) or x[idx] into ``out``;
    return an error mask (ERR_VALUE: NaN/Inf, ERR_OVERFLOW: a norm beyond float32).

    Block b adds its pieces first[b] <= p < first[b + 1], piece p the elements
    pieces[p] <= i < pieces[p + 1] (kernels/qsgd.py).
    """
    part = np.empty(pieces.size - 1, np.float64)
    if pieces[-1] <= CHUNK:
        mpicomp_qsgd_piece_sums(x, idx, dense, pieces, part, 0, part.size)
    else:
        mpicomp_qsgd_piece_sums_chunks(x, idx, dense, pieces, part, part.size)
    return mpicomp_qsgd_block_norms(part, first, out)


def quantize(x, idx, dense, norms, starts, regular, levels, key, out) -> int:
    """Write the codes of x (``dense``) or x[idx] into ``out``, each against its block's
    norm (norms[b] for starts[b] <= i < starts[b + 1]); return an error mask."""
    args = (x, idx, dense, norms, starts, regular, levels, key, out)
    return _over(mpicomp_qsgd_quantize, mpicomp_qsgd_quantize_chunks, out.size, *args)


def multiscale_index(x, idx, dense, norms, starts, regular, scales, out) -> int:
    """Write each element's scale index into uint8 ``out``; return an error mask."""
    args = (x, idx, dense, norms, starts, regular, scales, out)
    return _over(
        mpicomp_qsgd_multiscale_index, mpicomp_qsgd_multiscale_index_chunks, out.size, *args
    )


def multiscale_quantize(x, idx, dense, norms, starts, regular, scales, sidx, key, out) -> int:
    """Write the codes at the shared scale indices ``sidx`` into ``out``; return an error mask."""
    args = (x, idx, dense, norms, starts, regular, scales, sidx, key, out)
    return _over(
        mpicomp_qsgd_multiscale_quantize, mpicomp_qsgd_multiscale_quantize_chunks, out.size, *args
    )


def dequantize(codes, norms, starts, regular, levels, nranks, limit, out, base=0) -> int:
    """Write out = ((codes * norm) / levels) / nranks in float32, norm each block's; return an error mask.

    codes[i] and out[i] are element ``base`` + i of the coded vector: its block's norm
    (a row of the whole tensor decodes alone).
    """
    args = (codes, norms, starts, regular, levels, nranks, limit, out, np.int64(base))
    return _over(mpicomp_qsgd_dequantize, mpicomp_qsgd_dequantize_chunks, out.size, *args)


def dequantize_packed(
    stream, width, shift, norms, starts, regular, levels, nranks, limit, out, base=0
) -> int:
    """As ``dequantize`` for codes[i] = (the ``width``-bit code i of ``stream``) - shift."""
    args = (stream, width, shift, norms, starts, regular, levels, nranks, limit, out)
    args += (np.int64(base),)
    return _over(
        mpicomp_qsgd_dequantize_packed, mpicomp_qsgd_dequantize_packed_chunks, out.size, *args
    )


def multiscale_dequantize(
    codes, sidx, norms, starts, regular, scales, nranks, limit, out, base=0
) -> int:
    """Write out = ((codes * norm) / scales[sidx]) / nranks in float32, element i of them
    element ``base`` + i of the coded vector; return an error mask."""
    args = (codes, sidx, norms, starts, regular, scales, nranks, limit, out, np.int64(base))
    return _over(
        mpicomp_qsgd_multiscale_dequantize,
        mpicomp_qsgd_multiscale_dequantize_chunks,
        out.size,
        *args,
    )


def multiscale_dequantize_packed(
    stream, width, shift, sidx, norms, starts, regular, scales, nranks, limit, out, base=0
) -> int:
    """As ``multiscale_dequantize`` for codes read from a packed ``stream`` (less ``shift``)."""
    args = (stream, width, shift, sidx, norms, starts, regular, scales, nranks, limit, out)
    args += (np.int64(base),)
    return _over(
        mpicomp_qsgd_multiscale_dequantize_packed,
        mpicomp_qsgd_multiscale_dequantize_packed_chunks,
        out.size,
        *args,
    )


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
