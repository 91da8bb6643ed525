"""FastSGD kernels (paper 004 §3): exact per-bucket sum of |v|, threshold filter, logarithm
quantization against a table of thresholds, adaptive delta-key bit stream, and the
validating decoders.

Every kernel is a plain per-bucket / per-element loop without fastmath. The sum of |v| is
exact (integer bins per float32 exponent, then one round-to-nearest-even to float32), so it
does not depend on the summation order; L is found by comparing |v| with the float64
thresholds sum / b^L (b^L by repeated float64 multiplication), never through libm's log.
The CUDA twins (same names, same docstrings) therefore give the same bytes.

Body layout (little-endian; see docs/codecs/fastsgd.md)::

    prefix  0 f64 base | 8 u32 bucket | 12 u8 tau | 13 u8 flag_bits | 14 u16 reserved (0)
    bucket  0 f32 sum | 4 u32 d | 8 u32 key_bytes | 12 u8 W | 13 d x u8 L code | key bit stream
"""

import math

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

PREFIX_BYTES = 16
BUCKET_HEAD_BYTES = 13
SIGN_BIT = 0x80
MAX_TAU = 127
MAX_FLAG_BITS = 5
# Largest bucket: keys and counts fit u32 and the worst-case key stream,
# bucket * (flag_bits + 29) bits, fits the u32 key_bytes field.
MAX_BUCKET = 1 << 29

# Error codes of mpicomp_fastsgd_scan and mpicomp_fastsgd_decode (0 = valid).
OK = 0
ERR_TRUNCATED = 1  # a bucket header or its codes/key bytes run past the body
ERR_TRAILING = 2  # bytes left after the last bucket
ERR_SUM = 3  # sum is negative, NaN, Inf, or 0 with values kept
ERR_COUNT = 4  # more values kept than the bucket holds
ERR_WIDTH = 5  # W too large for the bucket, or inconsistent with the count / key bytes
ERR_CODE = 6  # an L code above tau
ERR_KEY_BITS = 7  # the key stream ends before the last key
ERR_KEY_ORDER = 8  # a key outside the bucket or not strictly increasing
ERR_KEY_FLAG = 9  # a length flag that is not the smallest one for its delta
ERR_KEY_TAIL = 10  # key stream longer than needed, non-zero padding, or W not the widest delta

# Integer bins of the exact sum: bin e holds mantissas of exponent field e (0 shares bin 1);
# carries move up to 56 bins above 254 for a bucket of 2^29 values below 2^24 each.
_NBINS = 320
_FLT_MAX_BITS = 0x7F7FFFFF
# Histogram slots: bit lengths 0..32 of the deltas.
_HIST = 33
# Threshold table size: L = 0..127 and sentinels, so the L search takes 7 fixed steps.
_QSIZE = 128
# Values per chunk of the encoder's kept-index gather (a small L1-resident scratch).
_CHUNK = 4096
_EXP_MASK = np.uint32(0x7F800000)
_MANT_MASK = np.uint32(0x007FFFFF)
_IMPLICIT = np.uint32(0x00800000)


@nb.njit(cache=True)
def mpicomp_fastsgd_powers(base, tau):
    """Return b^L for L = 0..tau as float64, each the previous one times b (no libm pow)."""
    p = np.empty(tau + 1, np.float64)
    p[0] = 1.0
    for L in range(1, tau + 1):
        p[L] = p[L - 1] * np.float64(base)
    return p


@intrinsic
def _count_leading_zeros(typingctx, v):
    """LLVM ctlz of a uint64 (64 for 0): one instruction, like CUDA's __clzll."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0))

    return sig, codegen


@nb.njit(inline="always", cache=True)
def mpicomp_fastsgd_bit_length(v):
    """Return the number of bits of the non-negative integer v (0 for 0)."""
    return 64 - np.int64(_count_leading_zeros(np.uint64(v)))


@nb.njit(inline="always", cache=True)
def mpicomp_fastsgd_widths(W, flag_bits, width, flag_of):
    """Fill width[c] = ceil((c+1) W / 2^l) and flag_of[k] = smallest c with width[c] >= k."""
    nflags = 1 << flag_bits
    for c in range(nflags):
        width[c] = ((c + 1) * W + nflags - 1) >> flag_bits
    c = 0
    for k in range(W + 1):
        while width[c] < k:
            c += 1
        flag_of[k] = c


@nb.njit(cache=True)
def mpicomp_fastsgd_abs_sum(xbits, acc):
    """Return (bits of the float32 rounding of sum |x|, saturated; False on NaN/Inf) from x's bits."""
    lo = _NBINS
    hi = 0
    bad = 0
    for i in range(xbits.size):
        u = xbits[i]
        e = np.int64((u & _EXP_MASK) >> np.uint32(23))
        bad |= e == 255
        m = np.uint64(u & _MANT_MASK)
        m = m | np.uint64(0x800000) if e > 0 else m
        e = max(e, 1)  # subnormals: same scale as exponent field 1, no implicit bit
        # Four rows of bins, so that equal exponents in a row do not wait on each other.
        acc[i & 3, e] += m
        lo = min(lo, e)
        hi = max(hi, e)
    if bad:
        for r in range(4):
            for k in range(lo, hi + 1):
                acc[r, k] = 0
        return np.uint32(0), False
    if lo > hi:
        return np.uint32(0), True
    for k in range(lo, hi + 1):
        acc[0, k] += acc[1, k] + acc[2, k] + acc[3, k]
        acc[1, k] = 0
        acc[2, k] = 0
        acc[3, k] = 0
    # Carry upwards until every bin holds one bit: bin e is then bit e - 1 of sum * 2^149.
    top = 0
    e = lo
    while e <= hi or acc[0, e] != 0:
        acc[0, e + 1] += acc[0, e] >> np.uint64(1)
        acc[0, e] &= np.uint64(1)
        if acc[0, e]:
            top = e
        e += 1
    end = e
    # Keep 24 significant bits (fewer below the normal range), round half to even.
    lsb = max(top - 23, 1)
    mant = 0
    for k in range(top, lsb - 1, -1):
        mant = (mant << 1) | np.int64(acc[0, k])
    if lsb > lo:
        half = acc[0, lsb - 1]
        sticky = 0
        for k in range(lo, lsb - 1):
            sticky |= np.int64(acc[0, k])
        if half and (sticky or (mant & 1)):
            mant += 1
    for k in range(lo, end + 1):
        acc[0, k] = 0
    # Exponent field lsb with the implicit bit in mant; a rounding carry moves into the exponent.
    bits = ((lsb - 1) << 23) + mant
    if bits > _FLT_MAX_BITS:
        bits = _FLT_MAX_BITS
    return np.uint32(bits), True


@nb.njit(inline="always", cache=True)
def mpicomp_fastsgd_f32_value(bits):
    """Return the float32 with IEEE bit pattern ``bits`` (finite, non-negative) as a float64."""
    bits = np.int64(bits)
    e = bits >> 23
    m = bits & 0x7FFFFF
    if e == 0:
        return math.ldexp(np.float64(m), -149)
    return math.ldexp(np.float64(m | 0x800000), e - 150)


@nb.njit(inline="always", cache=True)
def mpicomp_fastsgd_thresholds(s, powers, q):
    """Fill q[L] = sum / b^L in float64 for L = 0..tau, and -1 beyond tau."""
    for L in range(q.size):
        q[L] = np.float64(s) / powers[L] if L < powers.size else -1.0


@nb.njit(cache=True)
def mpicomp_fastsgd_plan_bucket(x, xbits, powers, flag_bits, acc, hist, width, flag_of):
    """Return (sum bits, ok, d, W, key stream bits) of one bucket x (xbits: its bits)."""
    # Buckets come in as slices: indices from 0 compile to tighter loops than from start.
    sbits, ok = mpicomp_fastsgd_abs_sum(xbits, acc)
    s = mpicomp_fastsgd_f32_value(sbits)
    d = 0
    maxdelta = 0
    if ok and s > 0.0:
        qtau = s / powers[powers.size - 1]
        prev = 0
        # Branch-free: a dropped value adds 0 to the slot of its gap.
        for i in range(x.size):
            keep = np.float64(abs(x[i])) >= qtau
            delta = i - prev
            hist[mpicomp_fastsgd_bit_length(delta)] += keep
            maxdelta = max(maxdelta, delta if keep else 0)
            prev = i if keep else prev
            d += keep
    W = mpicomp_fastsgd_bit_length(maxdelta)
    mpicomp_fastsgd_widths(W, flag_bits, width, flag_of)
    total = 0
    for b in range(W + 1):
        total += hist[b] * (flag_bits + width[flag_of[b]])
    hist[:] = 0
    return sbits, ok, d, W, total


@nb.njit(parallel=True, cache=True)
def mpicomp_fastsgd_plan(x, xbits, bucket, powers, flag_bits, sums, counts, widths, key_bits):
    """Per bucket: exact sum of |v|, kept count d, widest-delta width W, key stream bits; False on NaN/Inf."""
    n = x.size
    nb_ = sums.size
    ngroups = min(nb_, 256)
    bad = np.zeros(max(ngroups, 1), np.uint8)
    for g in nb.prange(ngroups):
        acc = np.zeros((4, _NBINS + 1), np.uint64)
        hist = np.zeros(_HIST, np.int64)
        width = np.empty(1 << flag_bits, np.int64)
        flag_of = np.empty(_HIST, np.int64)
        for k in range(g * nb_ // ngroups, (g + 1) * nb_ // ngroups):
            start = k * bucket
            stop = min(n, start + bucket)
            sbits, ok, d, W, total = mpicomp_fastsgd_plan_bucket(
                x[start:stop], xbits[start:stop], powers, flag_bits, acc, hist, width, flag_of
            )
            bad[g] |= not ok
            sums[k] = sbits
            counts[k] = d
            widths[k] = W
            key_bits[k] = total
    return bad.sum() == 0


@nb.njit(inline="always", cache=True)
def _put_u32(body, pos, v):
    v = np.uint32(v)
    for t in range(4):
        body[pos + t] = np.uint8((v >> np.uint32(8 * t)) & np.uint32(0xFF))


@nb.njit(inline="always", cache=True)
def _get_u32(body, pos):
    v = np.int64(0)
    for t in range(4):
        v |= np.int64(body[pos + t]) << (8 * t)
    return v


@nb.njit(inline="always", cache=True)
def mpicomp_fastsgd_log_level(q, a):
    """Return the smallest L with q[L] <= a (q non-increasing, 128 entries): ceil(log_b(sum / a))."""
    L = 0
    step = _QSIZE >> 1
    while step:
        L += step if q[L + step - 1] > a else 0
        step >>= 1
    return L


@nb.njit(cache=True)
def mpicomp_fastsgd_encode_bucket(
    x, sbits, d, W, pos, end, powers, flag_bits, body, q, width, flag_of, kept, stream
):
    """Write bucket x into body[pos:end]: header, signed L codes, (flag, delta) bits MSB-first."""
    key_pos = pos + BUCKET_HEAD_BYTES + d
    key_bytes = end - key_pos
    _put_u32(body, pos, sbits)
    _put_u32(body, pos + 4, d)
    _put_u32(body, pos + 8, key_bytes)
    body[pos + 12] = np.uint8(W)
    if d == 0:
        return
    mpicomp_fastsgd_thresholds(mpicomp_fastsgd_f32_value(sbits), powers, q)
    mpicomp_fastsgd_widths(W, flag_bits, width, flag_of)
    qtau = q[powers.size - 1]
    # A field of l + w <= 34 bits joins at most 7 pending bits: this many bytes flush it.
    flushes = (7 + flag_bits + W) // 8
    code_pos = pos + BUCKET_HEAD_BYTES
    prev = 0
    acc = np.uint64(0)
    nacc = 0
    out = 0
    chunk = kept.size
    for first in range(0, x.size, chunk):
        # Gather the kept indices of a chunk without branches, then work on those only.
        m = 0
        for i in range(first, min(x.size, first + chunk)):
            kept[m] = i
            m += np.float64(abs(x[i])) >= qtau
        for j in range(m):
            i = kept[j]
            v = x[i]
            L = mpicomp_fastsgd_log_level(q, np.float64(abs(v)))
            body[code_pos] = np.uint8(L | SIGN_BIT if v < 0 else L)
            code_pos += 1
            delta = i - prev
            prev = i
            c = flag_of[mpicomp_fastsgd_bit_length(delta)]
            w = width[c]
            # Flag then delta, most significant bit first. The stream buffer has a spare byte
            # for the store of a flush step that has no full byte to write.
            acc = (
                (acc << np.uint64(flag_bits + w))
                | (np.uint64(c) << np.uint64(w))
                | np.uint64(delta)
            )
            nacc += flag_bits + w
            for _ in range(flushes):
                full = nacc >= 8
                stream[out] = np.uint8((acc >> np.uint64(max(nacc - 8, 0))) & np.uint64(0xFF))
                out += full
                nacc -= 8 if full else 0
    if nacc > 0:
        stream[out] = np.uint8((acc << np.uint64(8 - nacc)) & np.uint64(0xFF))
    body[key_pos:end] = stream[:key_bytes]


@nb.njit(parallel=True, cache=True)
def mpicomp_fastsgd_encode(x, bucket, powers, flag_bits, sums, counts, widths, offsets, body):
    """Write each bucket: sum, d, key bytes, W, signed L codes, then (flag, delta) bits MSB-first."""
    n = x.size
    nb_ = sums.size
    ngroups = min(nb_, 256)
    for g in nb.prange(ngroups):
        kfirst = g * nb_ // ngroups
        klast = (g + 1) * nb_ // ngroups
        q = np.empty(_QSIZE, np.float64)
        width = np.empty(1 << flag_bits, np.int64)
        flag_of = np.empty(_HIST, np.int64)
        most = 0
        for k in range(kfirst, klast):
            most = max(most, offsets[k + 1] - offsets[k])
        stream = np.empty(most + 1, np.uint8)
        kept = np.empty(_CHUNK, np.int64)
        for k in range(kfirst, klast):
            start = k * bucket
            mpicomp_fastsgd_encode_bucket(
                x[start : min(n, start + bucket)], sums[k], counts[k], widths[k],
                offsets[k], offsets[k + 1], powers, flag_bits, body, q, width, flag_of, kept, stream,
            )  # fmt: skip


@nb.njit(cache=True)
def mpicomp_fastsgd_scan(body, n, bucket, flag_bits, offsets, sums):
    """Walk the bucket headers, check every length against the body; fill offsets and sums; return an error code."""
    size = body.size
    pos = PREFIX_BYTES
    nb_ = offsets.size - 1
    for k in range(nb_):
        offsets[k] = pos
        blen = min(n - k * bucket, bucket)
        if size - pos < BUCKET_HEAD_BYTES:
            return ERR_TRUNCATED
        sbits = _get_u32(body, pos)
        sums[k] = sbits
        d = _get_u32(body, pos + 4)
        kbytes = _get_u32(body, pos + 8)
        W = np.int64(body[pos + 12])
        if sbits >= 0x7F800000:  # negative (sign bit), Inf or NaN
            return ERR_SUM
        if d > blen:
            return ERR_COUNT
        if d > 0 and sbits == 0:
            return ERR_SUM
        if W > mpicomp_fastsgd_bit_length(blen - 1):
            return ERR_WIDTH
        # Each key takes between l and l + W bits.
        if d == 0 and (W != 0 or kbytes != 0):
            return ERR_WIDTH
        if kbytes * 8 < d * flag_bits or kbytes > (d * (flag_bits + W) + 7) // 8:
            return ERR_WIDTH
        pos += BUCKET_HEAD_BYTES
        if size - pos < d + kbytes:
            return ERR_TRUNCATED
        pos += d + kbytes
    offsets[nb_] = pos
    if pos != size:
        return ERR_TRAILING
    return OK


@nb.njit(cache=True)
def mpicomp_fastsgd_decode_bucket(body, pos, end, sbits, powers, flag_bits, out, q, width, flag_of):
    """Scatter one bucket's +-float32(sum / b^L) at its decoded keys into its slice out; return an error code."""
    blen = out.size
    d = _get_u32(body, pos + 4)
    if d == 0:
        return OK
    W = np.int64(body[pos + 12])
    tau = powers.size - 1
    mpicomp_fastsgd_thresholds(mpicomp_fastsgd_f32_value(sbits), powers, q)
    mpicomp_fastsgd_widths(W, flag_bits, width, flag_of)
    fmask = np.uint64((1 << flag_bits) - 1)
    need = flag_bits + W
    code_pos = pos + BUCKET_HEAD_BYTES
    key_pos = code_pos + d
    avail = (end - key_pos) * 8
    used = 0
    acc = np.uint64(0)
    nacc = 0
    key = 0
    maxdelta = 0
    for j in range(d):
        code = np.int64(body[code_pos + j])
        mag = code & 0x7F
        if mag > tau:
            return ERR_CODE
        # Keep at least one whole (flag, delta) field in acc while the stream lasts.
        if nacc < need:
            while nacc <= 56 and key_pos < end:
                acc = (acc << np.uint64(8)) | np.uint64(body[key_pos])
                key_pos += 1
                nacc += 8
        if used + flag_bits > avail:
            return ERR_KEY_BITS
        c = np.int64((acc >> np.uint64(nacc - flag_bits)) & fmask)
        w = width[c]
        if used + flag_bits + w > avail:
            return ERR_KEY_BITS
        used += flag_bits + w
        nacc -= flag_bits + w
        delta = np.int64((acc >> np.uint64(nacc)) & ((np.uint64(1) << np.uint64(w)) - np.uint64(1)))
        if flag_of[mpicomp_fastsgd_bit_length(delta)] != c:
            return ERR_KEY_FLAG
        if j > 0 and delta == 0:
            return ERR_KEY_ORDER
        key += delta
        if key >= blen:
            return ERR_KEY_ORDER
        maxdelta = max(maxdelta, delta)
        val = np.float32(q[mag])
        out[key] = -val if code & SIGN_BIT else val
    # The stream must end in its last byte, padded with zero bits, and W must be exact.
    if avail - used >= 8 or (acc & np.uint64((1 << nacc) - 1)) != 0 or key_pos != end:
        return ERR_KEY_TAIL
    if mpicomp_fastsgd_bit_length(maxdelta) != W:
        return ERR_KEY_TAIL
    return OK


@nb.njit(parallel=True, cache=True)
def mpicomp_fastsgd_decode(body, n, bucket, powers, flag_bits, offsets, sums, out, errs):
    """Scatter +-float32(sum / b^L) at the decoded keys of each bucket into zeroed out; set errs[k]."""
    nb_ = offsets.size - 1
    ngroups = min(nb_, 256)
    for g in nb.prange(ngroups):
        q = np.empty(_QSIZE, np.float64)
        width = np.empty(1 << flag_bits, np.int64)
        flag_of = np.empty(_HIST, np.int64)
        for k in range(g * nb_ // ngroups, (g + 1) * nb_ // ngroups):
            start = k * bucket
            errs[k] = mpicomp_fastsgd_decode_bucket(
                body, offsets[k], offsets[k + 1], sums[k], powers, flag_bits,
                out[start : min(n, start + bucket)], q, width, flag_of,
            )  # fmt: skip
