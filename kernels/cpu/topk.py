"""Top-k sparsification kernels: select by magnitude threshold; validate and scatter back.

Selection never sorts x. |x| is ordered like the uint32 bit pattern of x with the sign
cleared. Every 1024th element guesses a bracket [low, high] around the k-th largest
pattern; one pass then collects, in index order, the (index, value) of every pattern
above high and the (index, pattern) candidates inside the bracket, and finds the max
(NaN/Inf are the patterns >= 0x7F800000). The exact threshold T (the k-th largest) is
chosen among the candidates, and a merge writes every |x| > T plus, of those equal to
T, the lowest indices: the stable rule. Should the bracket miss, a histogram of the top
bits (exponent + 3 mantissa bits) finds T's bin instead, then a candidates pass and a
gather pass. Passes run in CHUNK-element chunks in parallel, combined in index order:
the payload never depends on the thread count or on the sample.
"""

import math

import numba as nb
import numpy as np

from mpicomp.kernels.numba_cache import guard

_ABS = np.uint32(0x7FFFFFFF)
# Histogram bin of a magnitude: its bit pattern >> SHIFT (8 exponent + 3 mantissa bits).
SHIFT = 20
NBINS = 1 << (31 - SHIFT)
# Bins from here on hold NaN and Inf (patterns >= 0x7F800000).
NONFINITE_BIN = 0x7F800000 >> SHIFT
# Elements per parallel task.
CHUNK = 1 << 20
# Elements per group of the bracket pass.
_GROUP = 64
# Sub-histograms per chunk: neighbours in the same bin do not wait on each other's store.
_WAYS = 4


@nb.njit(inline="always", cache=True)
def _nchunks(n):
    return (n + CHUNK - 1) // CHUNK


@nb.njit(parallel=True, nogil=True, cache=True)
def mpicomp_topk_histogram(u):
    """Return the (chunks, NBINS) int64 histograms of (u & 0x7FFFFFFF) >> SHIFT per chunk."""
    n = u.size
    hists = np.zeros((_nchunks(n), NBINS), np.int64)
    for c in nb.prange(hists.shape[0]):
        lo = np.int64(c) * CHUNK  # prange indices are unsigned
        hi = min(n, lo + CHUNK)
        sub = np.zeros(_WAYS * NBINS, np.uint32)
        blk = u[lo:hi]
        whole = blk.size - blk.size % _WAYS
        for i in range(0, whole, _WAYS):
            sub[(blk[i] & _ABS) >> SHIFT] += 1
            sub[NBINS + ((blk[i + 1] & _ABS) >> SHIFT)] += 1
            sub[2 * NBINS + ((blk[i + 2] & _ABS) >> SHIFT)] += 1
            sub[3 * NBINS + ((blk[i + 3] & _ABS) >> SHIFT)] += 1
        for i in range(whole, blk.size):
            sub[(blk[i] & _ABS) >> SHIFT] += 1
        for w in range(_WAYS):
            for b in range(NBINS):
                hists[c, b] += sub[w * NBINS + b]
    return hists


@nb.njit(parallel=True, nogil=True, cache=True)
def mpicomp_topk_candidates(u, hists, bin_):
    """Return (indices, patterns |x|) of the elements in histogram bin ``bin_``, in index order."""
    n = u.size
    starts = np.zeros(hists.shape[0] + 1, np.int64)
    for c in range(hists.shape[0]):
        starts[c + 1] = starts[c] + hists[c, bin_]
    idx = np.empty(starts[-1], np.int64)
    bits = np.empty(starts[-1], np.uint32)
    want = np.uint32(bin_)  # compared with unsigned patterns: no mixed-sign promotion
    for c in nb.prange(hists.shape[0]):
        lo = np.int64(c) * CHUNK
        hi = min(n, lo + CHUNK)
        at = starts[c]
        blk = u[lo:hi]  # a zero-based view: no negative-index checks in the loop
        for i in range(blk.size):
            a = blk[i] & _ABS
            if a >> SHIFT == want:
                idx[at] = lo + i
                bits[at] = a
                at += 1
    return idx, bits


@nb.njit(nogil=True, cache=True)
def mpicomp_topk_bracket_chunk(blk, first, low, high, cand_idx, cand_bits, top_idx, top_val):
    """Scan ``blk`` (elements first.. of x, as uint32 patterns): return (max |x| pattern,
    #(pattern > high), #(low <= pattern <= high)). The former go to top_* as (index,
    value), the latter to cand_* as (index, pattern), in index order, while they fit."""
    top = np.uint32(0)
    over = 0
    at = 0
    # Groups of _GROUP: a branch-free pass finds the max and whether any element reaches
    # low (SIMD, uint32 lanes); only such groups (a few percent) are walked one by one.
    for g in range(0, blk.size, _GROUP):
        grp = blk[g : min(g + _GROUP, blk.size)]
        gmax = np.uint32(0)
        for i in range(grp.size):
            gmax = max(gmax, np.uint32(grp[i] & _ABS))
        top = max(top, gmax)
        if gmax < low:
            continue
        for i in range(grp.size):
            a = grp[i] & _ABS
            if a > high:
                if over < top_idx.size:
                    top_idx[over] = first + g + i
                    top_val[over] = np.uint32(grp[i]).view(np.float32)
                over += 1
            elif a >= low:
                if at < cand_idx.size:
                    cand_idx[at] = first + g + i
                    cand_bits[at] = a
                at += 1
    return top, over, at


@nb.njit(parallel=True, nogil=True, cache=True)
def mpicomp_topk_bracket(u, low, high, cand_idx, cand_bits, count, top_idx, top_val, above):
    """``mpicomp_topk_bracket_chunk`` per chunk c, in parallel, into the c-th equal slices
    of cand_* and top_* (their sizes are multiples of the chunk count). Set above[c] and
    count[c] (more than a slice holds: it overflowed); return the max pattern (>=
    0x7F800000: NaN or Inf)."""
    n = u.size
    nch = above.size
    ccap = cand_idx.size // nch
    tcap = top_idx.size // nch
    lo_t = np.uint32(low)
    hi_t = np.uint32(high)
    tops = np.zeros(nch, np.uint32)
    for c in nb.prange(nch):
        lo = np.int64(c) * CHUNK
        cb = np.int64(c) * ccap
        tb = np.int64(c) * tcap
        # A call, not inlined code: numba optimizes a prange body's loops less well.
        tops[c], above[c], count[c] = mpicomp_topk_bracket_chunk(
            u[lo : min(n, lo + CHUNK)],
            lo,
            lo_t,
            hi_t,
            cand_idx[cb : cb + ccap],
            cand_bits[cb : cb + ccap],
            top_idx[tb : tb + tcap],
            top_val[tb : tb + tcap],
        )
    return tops.max()


@nb.njit(nogil=True, cache=True)
def mpicomp_topk_merge(top_idx, top_val, cand_idx, cand_bits, x, thresh, ties, out_idx, out_val):
    """Merge, in index order, every (index, value) of top_* with the candidates whose
    pattern is > ``thresh`` and the first ``ties`` equal to it, into out_*."""
    t = np.uint32(thresh)
    i = 0
    k = 0
    for j in range(cand_idx.size):
        a = cand_bits[j]
        if a < t or (a == t and ties == 0):
            continue
        if a == t:
            ties -= 1
        c = cand_idx[j]
        while i < top_idx.size and top_idx[i] < c:
            out_idx[k] = top_idx[i]
            out_val[k] = top_val[i]
            i += 1
            k += 1
        out_idx[k] = c
        out_val[k] = x[c]
        k += 1
    while i < top_idx.size:
        out_idx[k] = top_idx[i]
        out_val[k] = top_val[i]
        i += 1
        k += 1


@nb.njit(parallel=True, nogil=True, cache=True)
def mpicomp_topk_gather(x, u, above, cand_idx, cand_bits, thresh, ties, out_idx, out_val):
    """Write the kept (index, value) pairs, in index order, to ``out_idx`` and ``out_val``.

    Kept: every |x| pattern > ``thresh``, and the first ``ties`` (in index order) equal to
    it. ``above[c]`` counts chunk c's patterns above every candidate; the candidates
    (index order) hold all the others >= ``thresh``: from them each chunk learns how many
    it keeps, hence where it writes, before any chunk reads x.
    """
    n = u.size
    nch = above.size
    above = above.copy()
    equal = np.zeros(nch, np.int64)
    for j in range(cand_idx.size):
        c = cand_idx[j] // CHUNK
        if cand_bits[j] > thresh:
            above[c] += 1
        elif cand_bits[j] == thresh:
            equal[c] += 1
    starts = np.zeros(nch, np.int64)
    take = np.zeros(nch, np.int64)
    left = ties
    at = 0
    for c in range(nch):
        take[c] = min(equal[c], left)
        left -= take[c]
        starts[c] = at
        at += above[c] + take[c]
    t = np.uint32(thresh)
    for c in nb.prange(nch):
        lo = np.int64(c) * CHUNK
        hi = min(n, lo + CHUNK)
        k = starts[c]
        m = above[c] + take[c]
        mpicomp_topk_gather_chunk(
            x[lo:hi], u[lo:hi], lo, t, take[c], out_idx[k : k + m], out_val[k : k + m]
        )


@nb.njit(nogil=True, cache=True)
def mpicomp_topk_gather_chunk(x, u, first, thresh, room, out_idx, out_val):
    """Write (first + i, x[i]) for patterns > thresh, and for the first ``room`` equal to it."""
    k = 0
    for i in range(u.size):
        a = u[i] & _ABS
        if a >= thresh:
            if a == thresh:
                if room == 0:
                    continue
                room -= 1
            out_idx[k] = first + i
            out_val[k] = x[i]
            k += 1


@nb.njit(nogil=True, cache=True)
def mpicomp_topk_scatter(indices, values, n, out):
    """Scatter ``values`` at strictly increasing ``indices`` < n into zeroed ``out``.

    Returns 0 on success, 1 if an index is out of range or not increasing, 2 if a
    value is not finite (then ``out`` is incomplete and must be discarded).
    """
    prev = -1
    for j in range(indices.size):
        i = np.int64(indices[j])
        if i <= prev or i >= n:
            return 1
        v = values[j]
        if not np.isfinite(v):
            return 2
        out[i] = v
        prev = i
    return 0


def _threshold(cand_bits, need):
    """Return (T, ties): the need-th largest candidate pattern, and how many equal to it
    are kept (those above it are kept anyway)."""
    thresh = int(np.partition(cand_bits, cand_bits.size - need)[cand_bits.size - need])
    return thresh, need - int(np.count_nonzero(cand_bits > thresh))


# Every SAMPLE-th element guesses a bracket [low, high] around the threshold; SLACK
# standard deviations of the sampled rank keep the true threshold inside it.
SAMPLE = 1024
SLACK = 4


def _bracket(u, k):
    """Return (low, high, candidates, above): patterns that likely hold the k-th largest
    |x| between them, and about how many elements lie in [low, high] and above high."""
    sample = np.sort(u[::SAMPLE] & _ABS)[::-1]
    rank = k / u.size * sample.size
    spread = SLACK * math.sqrt(rank) + 16
    hi_rank, lo_rank = math.floor(rank - spread), math.ceil(rank + spread)
    high = int(sample[hi_rank]) if hi_rank >= 0 else 0x7F800000 - 1
    low = int(sample[lo_rank]) if lo_rank < sample.size else 0
    return low, high, (lo_rank - max(hi_rank, 0)) * SAMPLE, max(hi_rank, 0) * SAMPLE


def _slices(nch, expected):
    """Return the per-chunk room for ``expected`` elements spread unevenly over chunks
    (channels differ in scale): all of them, twice, in any single chunk."""
    return nch * min(CHUNK, 2 * expected + 4096)


def _joined(arrays, count, nch):
    """Return the used heads of the nch equal slices of each array, concatenated."""
    room = arrays[0].size // nch
    keep = np.concatenate([np.arange(c * room, c * room + count[c]) for c in range(nch)])
    return [a[keep] for a in arrays]


def select(x, k, out_idx, out_val):
    """Write the top-``k`` (index, value) pairs of float32 ``x`` into the output arrays.

    Indices come out strictly increasing; of magnitudes tied at the threshold, the lower
    indices are kept. ``0 < k < x.size``. One pass over x collects what lies above a
    sampled bracket and the candidates inside it; the sample only decides the speed:
    when the bracket misses (or a chunk overflows its room), the exact histogram
    selection runs instead.

    Returns:
        False if ``x`` holds NaN or Inf (nothing is written), else True.
    """
    u = x.view(np.uint32)
    nch = (u.size + CHUNK - 1) // CHUNK
    low, high, n_cand, n_top = _bracket(u, k)
    cand_idx = np.empty(_slices(nch, n_cand), np.int64)
    cand_bits = np.empty(cand_idx.size, np.uint32)
    top_idx = np.empty(_slices(nch, n_top), np.int64)
    top_val = np.empty(top_idx.size, np.float32)
    above = np.empty(nch, np.int64)
    count = np.empty(nch, np.int64)
    top = mpicomp_topk_bracket(u, low, high, cand_idx, cand_bits, count, top_idx, top_val, above)
    if top >= 0x7F800000:
        return False
    n_above = int(above.sum())
    fits = count.max() <= cand_idx.size // nch and above.max() <= top_idx.size // nch
    if fits and n_above < k <= n_above + int(count.sum()):
        cand_idx, cand_bits = _joined([cand_idx, cand_bits], count, nch)
        top_idx, top_val = _joined([top_idx, top_val], above, nch)
        thresh, ties = _threshold(cand_bits, k - n_above)
        mpicomp_topk_merge(top_idx, top_val, cand_idx, cand_bits, x, thresh, ties, out_idx, out_val)
        return True
    hists = mpicomp_topk_histogram(u)
    counts = hists.sum(axis=0)
    # The bin of the k-th largest: fewer than k above it, at least k from it up.
    from_bin = np.cumsum(counts[::-1])[::-1]  # from_bin[b] = elements in bins >= b
    bin_ = int(np.flatnonzero(from_bin >= k)[-1])
    above = hists[:, bin_ + 1 :].sum(axis=1)
    cand_idx, cand_bits = mpicomp_topk_candidates(u, hists, bin_)
    thresh, ties = _threshold(cand_bits, k - int(above.sum()))
    mpicomp_topk_gather(x, u, above, cand_idx, cand_bits, thresh, ties, out_idx, out_val)
    return True


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
