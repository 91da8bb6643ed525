"""Plain NumPy references of the QSGD-MaxNorm family (the unbiased quantizers paper
§3.1-3.4, docs/codecs.md): the counter-based RNG, norms, codes, scale indices, GlobalRandK coordinates, the blocks
that share a norm and a whole averaged call. None of them calls the library's kernels."""

import math

import numpy as np

M64 = (1 << 64) - 1
GOLDEN, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
STEP_MUL, STREAM_MUL = 0xD6E8FEB86659FD93, 0xA0761D6478BD642F
COORDINATE_STREAM = M64
CHUNK = 1 << 16  # elements per piece of a norm's sum (docs/codecs.md)


def ref_mix(z):
    """splitmix64 finalizer on Python ints or numpy uint64 arrays (wrapping)."""
    if isinstance(z, int):
        z = ((z ^ (z >> 30)) * M1) & M64
        z = ((z ^ (z >> 27)) * M2) & M64
        return z ^ (z >> 31)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(M2)
    return z ^ (z >> np.uint64(31))


def ref_key(seed, step, stream):
    k = ref_mix(seed ^ ((step * STEP_MUL) & M64))
    return ref_mix(k ^ ((stream * STREAM_MUL) & M64))


def ref_bits(key, index):
    index = np.asarray(index, dtype=np.uint64)
    return ref_mix(np.uint64(key) + (index + np.uint64(1)) * np.uint64(GOLDEN))


def ref_uniform(key, index):
    return (ref_bits(key, index) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)


def ref_norm(x):
    return float(np.float32(math.sqrt(float(np.sum(x.astype(np.float64) ** 2)))))


def ref_unit(x, norm):
    """a = |x| / norm in float32, clamped to 1 (0 where norm is 0); ``norm`` one number or
    one per element."""
    norm = np.broadcast_to(np.asarray(norm, np.float32), np.shape(x))
    safe = np.where(norm > 0, norm, np.float32(1))
    return np.where(norm > 0, np.minimum(np.abs(x) / safe, np.float32(1)), np.float32(0))


def ref_codes(x, a, s, u):
    """Stochastic rounding of a * s: floor, plus one with probability of the fraction."""
    y = a * np.float32(s)
    low = np.floor(y)
    code = (low + (u < y - low)).astype(np.int64)
    return np.where(x < 0, -code, code)


def ref_quantize(x, norm, bits, seed, step, stream, index=None):
    """Codes of x (or x[index]); ``norm`` one number, or one per code."""
    index = np.arange(x.size) if index is None else index
    v = x.reshape(-1)[index]
    u = ref_uniform(ref_key(seed, step, stream), index)
    return ref_codes(v, ref_unit(v, norm), 2 ** (bits - 1) - 1, u)


def ref_scale_index(v, norm, levels):
    """Eq. (11): the largest scale s with |v| / norm * s <= s_min (index 0 = s_min)."""
    a = ref_unit(v, norm)
    idx = np.zeros(v.size, np.int64)
    for k, s in enumerate(levels):
        idx[a * np.float32(s) <= np.float32(levels[0])] = k
    return idx


def ref_ms_quantize(v, norm, levels, sidx, seed, step, stream, index):
    u = ref_uniform(ref_key(seed, step, stream), index)
    s = np.array(levels, np.float32)[sidx]
    return ref_codes(v, ref_unit(v, norm), s, u)


def ref_coordinates(n, k, seed, step):
    """Floyd's algorithm: for j = n-k..n-1 take t = bits * (j+1) >> 64 unless taken, then j."""
    key = ref_key(seed, step, COORDINATE_STREAM)
    bits = ref_bits(key, np.arange(n - k, n))
    chosen = set()
    for j, b in zip(range(n - k, n), bits.tolist(), strict=True):
        t = (b * (j + 1)) >> 64
        chosen.add(j if t in chosen else t)
    return np.array(sorted(chosen), dtype=np.int64)


def levels_of(bits):
    return 2 ** (bits - 1) - 1


# ---------------------------------------------------------------- block norms


def ref_segments(sizes, per_tensor=True, coords=None):
    """The tensors of the coded vector end to end: ``sizes`` (one when not per_tensor), or
    for GlobalRandK (``coords``) how many selected coordinates fall in each tensor."""
    if coords is None:
        return list(sizes) if per_tensor else [sum(sizes)]
    if not per_tensor:
        return [coords.size]
    ends = np.cumsum(sizes)
    return [int(np.sum((coords >= e - s) & (coords < e))) for s, e in zip(sizes, ends, strict=True)]


def ref_cut(segments, block):
    """Block starts (and the end) of ``segments`` cut every ``block`` elements, the last of
    each segment shorter, none across a segment's end; ``block`` 0: a block per segment."""
    starts, at = [0], 0
    for size in segments:
        if size:
            step = block or size
            starts += [at + min(j, size) for j in range(step, size + step, step)]
            at += size
    return np.array(starts, np.int64)


def ref_sumsq(v):
    """The float64 sum of squares in the documented order: 8 lanes (element j to lane
    j % 8, the tail of fewer than 8 to lane 0), each added in order, the lanes as
    ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))."""
    sq = v.astype(np.float64) ** 2
    full = sq.size - sq.size % 8
    lanes = [np.cumsum(sq[lane:full:8])[-1] if full else 0.0 for lane in range(8)]
    if sq.size > full:
        lanes[0] = np.cumsum(np.concatenate([[lanes[0]], sq[full:]]))[-1]
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
        (lanes[4] + lanes[5]) + (lanes[6] + lanes[7])
    )


def ref_block_norms(v, starts):
    """float32 sqrt of each block's sum of squares: its pieces (CHUNK elements from the
    block's start) in ``ref_sumsq``'s order, added in order from 0."""
    out = []
    for lo, hi in zip(starts[:-1], starts[1:], strict=True):
        total = 0.0
        for p in range(lo, hi, CHUNK):
            total += ref_sumsq(v[p : min(hi, p + CHUNK)])
        out.append(np.float32(math.sqrt(total)))
    return np.array(out, np.float32)


def per_element(norms, starts):
    """Each element's block norm."""
    return np.repeat(np.asarray(norms, np.float32), np.diff(starts))


def ref_average(inputs, bits, block, step=0, shapes=None, per_tensor=True, seed=0):
    """What an all-reduce of qsgd_maxnorm returns from every rank's input (rows of
    ``inputs``, rank order): each rank's block norms, their max over ranks, codes by
    rank (stream = rank), their exact sum, ((sum * norm) / s) / N in float32."""
    nranks, n = inputs.shape
    sizes = [math.prod(s) for s in shapes] if shapes else [n]
    starts = ref_cut(ref_segments(sizes, per_tensor), block)
    norms = np.max([ref_block_norms(x, starts) for x in inputs], axis=0)
    each = per_element(norms, starts)
    total = sum(ref_quantize(x, each, bits, seed, step, r) for r, x in enumerate(inputs))
    s = np.float32(levels_of(bits))
    return ((total.astype(np.float32) * each) / s) / np.float32(nranks)
