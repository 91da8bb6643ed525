"""FastSGD kernels (the FastSGD paper §3): exact per-bucket sum of |v|, threshold filter, logarithm
quantization against a table of thresholds, adaptive delta-key bit stream, and the
validating decoders.

Every kernel is a plain per-bucket / per-element loop without fastmath. The sum of |v| is
exact (integer bins per float32 exponent, then one round-to-nearest-even to float32), so it
does not depend on the summation order; L is found by comparing |v| with the float64
thresholds sum / b^L (b^L by repeated float64 multiplication), never through libm's log.
A CUDA twin written the same way (planned) can therefore give the same bytes.

Body layout (little-endian; see docs/codecs.md, "fastsgd")::

    prefix  0 f64 base | 8 u32 bucket | 12 u8 tau | 13 u8 flag_bits | 14 u16 reserved (0)
    bucket  0 f32 sum | 4 u32 d | 8 u32 key_bytes | 12 u8 W | 13 d x u8 L code | key bit stream
"""

import math

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from mpicomp.kernels.fastsgd import (
    BUCKET_HEAD_BYTES,
    ERR_CODE,
    ERR_COUNT,
    ERR_KEY_BITS,
    ERR_KEY_FLAG,
    ERR_KEY_ORDER,
    ERR_KEY_TAIL,
    ERR_SUM,
    ERR_TRAILING,
    ERR_TRUNCATED,
    ERR_WIDTH,
    OK,
    PREFIX_BYTES,
    SIGN_BIT,
)
from mpicomp.kernels.numba_cache import guard

from .floatbits import bits_float, float_bits

# Integer bins of the exact sum: bin e holds mantissas of exponent field e (0 shares bin 1);
# carries move up to 56 bins above 254 for a bucket of 2^29 values below 2^24 each.
_NBINS = 320
_FLT_MAX_BITS = 0x7F7FFFFF
# Histogram slots: bit lengths 0..32 of the deltas.
_HIST = 33
# Threshold table size: L = 0..127 and sentinels, so the L search takes 7 fixed steps.
_QSIZE = 128
# Cells of the encoder's L table: float32 bit patterns >> _CELL_SHIFT (8 exponent and 8
# mantissa bits), narrower than any base's step once b > 1 + 2^-8 for normal values (not
# for subnormals, whose cells do not shrink with the value: their L is searched for).
_CELL_SHIFT = 15
_EXP_MASK = np.uint32(0x7F800000)
_MANT_MASK = np.uint32(0x007FFFFF)
_IMPLICIT = np.uint32(0x00800000)


@nb.njit(cache=True, nogil=True)
def mpicomp_fastsgd_powers(base, tau):
    """Return b^L for L = 0..tau as float64, each the previous one times b (no libm pow)."""
    p = np.empty(tau + 1, np.float64)
    p[0] = 1.0
    for L in range(1, tau + 1):
        p[L] = p[L - 1] * np.float64(base)
    return p


@intrinsic
def _bswap32(typingctx, v):
    """A uint32 with its bytes reversed (stored on a little-endian CPU: most significant first)."""
    sig = types.uint32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bswap(args[0])

    return sig, codegen


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


@nb.njit(cache=True, nogil=True)
def mpicomp_fastsgd_abs_sum(xbits, acc):
    """Return (bits of the float32 rounding of sum |x|, saturated; False on NaN/Inf) from x's bits.

    Exact: two int64 fixed-point sums cover the 2 * width binades below the largest
    |x| (width = 40 - bit_length(size), so neither can overflow), in a loop without
    branches or scattered writes; a bucket holding smaller nonzero values takes the
    per-exponent bins instead. Either way the bins ``acc`` are rounded once.
    """
    n = xbits.size
    amax = np.uint32(0)
    for i in range(n):
        amax = max(amax, xbits[i] & np.uint32(0x7FFFFFFF))
    if amax >= _EXP_MASK:
        return np.uint32(0), False
    if amax == 0:
        return np.uint32(0), True
    width = 40 - mpicomp_fastsgd_bit_length(n)
    w0 = max(np.int64(amax >> np.uint32(23)) - width + 1, 1)
    w1 = max(w0 - width, 1)
    s0 = 0
    s1 = 0
    rest = 0
    for i in range(n):
        u = np.int64(xbits[i]) & 0x7FFFFFFF
        e = u >> 23
        m = (u & 0x7FFFFF) | (0x800000 if e > 0 else 0)
        e = max(e, 1)  # subnormals: same scale as exponent field 1, no implicit bit
        d0 = e - w0
        d1 = e - w1
        s0 += m << max(d0, 0) if d0 >= 0 else 0
        s1 += m << max(d1, 0) if d0 < 0 and d1 >= 0 else 0
        rest |= d1 < 0 and m != 0
    if rest:
        return _abs_sum_binned(xbits, acc)
    acc[0, w0] += np.uint64(s0)
    acc[0, w1] += np.uint64(s1)
    return _round_bins(acc, w1, w0)


@nb.njit(cache=True, nogil=True)
def _abs_sum_binned(xbits, acc):
    """``mpicomp_fastsgd_abs_sum`` through one bin per float32 exponent (any values)."""
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
    return _round_bins(acc, lo, hi)


@nb.njit(cache=True, nogil=True)
def _round_bins(acc, lo, hi):
    """Return (float32 bits of sum_e acc[0, e] * 2^(e - 150), saturated; True); clear the bins.

    Bins lo..hi hold the sum (any uint64 each); the carries may run up to 63 bins above hi.
    """
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


@nb.njit(inline="always", cache=True)
def _put_bits(words, pos, acc, nacc, field, nbits):
    """Append the ``nbits`` (<= 33) low bits of ``field`` to an MSB-first bit stream.

    ``acc`` holds the ``nacc`` (< 32) pending bits; once 32 are pending they go to
    words[pos] with their bytes reversed (so memory holds them most significant
    byte first). Branch-free: words[pos] is always written, and kept only when full
    (``words`` has a spare slot). Returns (pos, acc, nacc).
    """
    acc = (acc << np.uint64(nbits)) | np.uint64(field)
    nacc += nbits
    full = nacc >= 32
    nacc -= 32 if full else 0
    words[pos] = _bswap32(np.uint32((acc >> np.uint64(nacc)) & np.uint64(0xFFFFFFFF)))
    pos += full
    return pos, acc, nacc


@nb.njit(cache=True, nogil=True)
def _filter(x, qtau, kept):
    """List in kept[:d] the indices i with |x[i]| >= qtau (in float64); return d."""
    d = 0
    # Branch-free compaction: a dropped index is overwritten by the next one.
    for i in range(x.size):
        kept[d] = i
        d += np.float64(abs(x[i])) >= qtau
    return d


@nb.njit(cache=True, nogil=True)
def _widest_gap(kept):
    """Return the largest delta between successive kept indices, the first counted from 0."""
    widest = np.int64(kept[0]) if kept.size else 0
    for j in range(1, kept.size):
        widest = max(widest, np.int64(kept[j]) - np.int64(kept[j - 1]))
    return widest


@nb.njit(cache=True, nogil=True)
def _encode_levels(xbits, kept, q, qdown, ltab, c_lo, base, codes):
    """Write codes[j] = sign | L of each kept value xbits[kept[j]] (see the L table above).

    The table serves normal values only: a cell of exponent field 0 is not 2^-8 of its
    value wide but [c, c + 1) * 2^-134 (all of [0, 2^-134) for c = 0), so it can hold
    any number of thresholds. A subnormal value's L comes from the 7-step search over
    q instead (``mpicomp_fastsgd_log_level``), exact and bounded; such values are rare.

    Kept in its own function (as is ``_encode_keys``): inside the bucket encoder's
    larger body LLVM keeps its loop state in memory and runs it twice as slowly.
    """
    if base >= 1.0 + 2.0**-7:
        # Normal cells are narrower than a step of b: at most one threshold inside a cell,
        # so one comparison corrects the cell's L (qdown[L] = q[L - 1], qdown[0] = inf).
        qdown[0] = np.inf
        qdown[1:] = q[: qdown.size - 1]
        for j in range(kept.size):
            u = np.int64(xbits[kept[j]])
            ua = u & 0x7FFFFFFF
            a = np.float64(bits_float(np.uint32(ua)))
            if ua < _IMPLICIT:
                L = mpicomp_fastsgd_log_level(q, a)
            else:
                L = np.int64(ltab[(ua >> _CELL_SHIFT) - c_lo])
                L -= qdown[L] <= a
            codes[j] = np.uint8(L | ((u >> 31) << 7))
    else:
        for j in range(kept.size):
            u = np.int64(xbits[kept[j]])
            ua = u & 0x7FFFFFFF
            a = np.float64(bits_float(np.uint32(ua)))
            if ua < _IMPLICIT:
                L = mpicomp_fastsgd_log_level(q, a)
            else:
                L = np.int64(ltab[(ua >> _CELL_SHIFT) - c_lo])
                while L > 0 and q[L - 1] <= a:
                    L -= 1
            codes[j] = np.uint8(L | ((u >> 31) << 7))


@nb.njit(cache=True, nogil=True)
def _encode_keys(kept, flag_bits, W, width, flag_of, fhead, flen, words):
    """Append each kept index's (flag, delta) to words (see ``_put_bits``); return (pos, acc, nacc)."""
    # Per delta bit length: the (flag, 0) field and its length, flag then delta bits.
    for b in range(W + 1):
        c = flag_of[b]
        fhead[b] = c << width[c]
        flen[b] = flag_bits + width[c]
    pos = 0
    bits = np.uint64(0)
    nbits = 0
    prev = 0
    if flag_bits + W > 32:  # a field too wide for one _put_bits: flag and delta apart
        for j in range(kept.size):
            i = np.int64(kept[j])
            delta = i - prev
            prev = i
            c = flag_of[mpicomp_fastsgd_bit_length(delta)]
            pos, bits, nbits = _put_bits(words, pos, bits, nbits, c, flag_bits)
            pos, bits, nbits = _put_bits(words, pos, bits, nbits, delta, width[c])
    else:
        for j in range(kept.size):
            i = np.int64(kept[j])
            delta = i - prev
            prev = i
            b = mpicomp_fastsgd_bit_length(delta)
            pos, bits, nbits = _put_bits(words, pos, bits, nbits, fhead[b] | delta, flen[b])
    return pos, bits, nbits


@nb.njit(cache=True, nogil=True)
def mpicomp_fastsgd_encode_bucket(
    x, xbits, powers, flag_bits, out, acc, q, qdown, width, flag_of, fhead, flen, kept, ltab, words
):
    """Write bucket x (xbits: its bits) to out: header, signed L codes, (flag, delta) bits
    MSB-first. Returns the bytes written, or -1 when x holds NaN or Inf.

    One pass sums |x| exactly (from memory); the bucket is then in cache for the
    threshold filter, which lists the kept indices, and for the codes and keys.
    L = the smallest L with sum / b^L <= |v| comes from a table over float32 cells
    (bit pattern >> 15: 8 exponent and 8 mantissa bits): ltab holds L at each cell's
    lower end, and the few thresholds inside a cell are then checked one by one. A
    subnormal |v| (exponent field 0, cells not scaled to the value) is searched for.
    """
    sbits, ok = mpicomp_fastsgd_abs_sum(xbits, acc)
    if not ok:
        return -1
    s = mpicomp_fastsgd_f32_value(sbits)
    tau = powers.size - 1
    d = 0
    if s > 0.0:
        mpicomp_fastsgd_thresholds(s, powers, q)
        d = _filter(x, q[tau], kept)
    W = mpicomp_fastsgd_bit_length(_widest_gap(kept[:d]))
    _put_u32(out, 0, sbits)
    _put_u32(out, 4, d)
    out[12] = np.uint8(W)
    if d == 0:
        _put_u32(out, 8, 0)
        return BUCKET_HEAD_BYTES
    mpicomp_fastsgd_widths(W, flag_bits, width, flag_of)
    # Kept magnitudes lie in [float32(q[tau]), sum]: only those cells get an entry.
    c_lo = np.int64(float_bits(np.float32(q[tau]))) >> _CELL_SHIFT
    c_hi = np.int64(sbits) >> _CELL_SHIFT
    L = mpicomp_fastsgd_log_level(q, np.float64(bits_float(np.uint32(c_lo << _CELL_SHIFT))))
    for c in range(c_lo, c_hi + 1):
        a_lo = np.float64(bits_float(np.uint32(c << _CELL_SHIFT)))
        while L > 0 and q[L - 1] <= a_lo:
            L -= 1
        ltab[c - c_lo] = L
    code_pos = BUCKET_HEAD_BYTES
    _encode_levels(xbits, kept[:d], q, qdown, ltab, c_lo, powers[1], out[code_pos : code_pos + d])
    pos, bits, nbits = _encode_keys(kept[:d], flag_bits, W, width, flag_of, fhead, flen, words)
    # The last partial word, zero-padded to whole bytes.
    words[pos] = _bswap32(np.uint32((bits << np.uint64(32 - nbits)) & np.uint64(0xFFFFFFFF)))
    key_bytes = 4 * pos + (nbits + 7) // 8
    key_pos = code_pos + d
    out[key_pos : key_pos + key_bytes] = words.view(np.uint8)[:key_bytes]
    pos = key_pos + key_bytes
    _put_u32(out, 8, key_bytes)
    return pos


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fastsgd_encode(x, xbits, bucket, powers, flag_bits, scratch, cap, sizes):
    """Encode bucket k into scratch[k*cap:(k+1)*cap] and its byte count into sizes[k].

    Returns False when x holds NaN or Inf. ``cap`` is ``bucket_capacity(bucket, flag_bits)``.
    """
    n = x.size
    nb_ = sizes.size
    ngroups = min(nb_, 256)
    bad = np.zeros(max(ngroups, 1), np.uint8)
    for g in nb.prange(ngroups):
        acc = np.zeros((4, _NBINS + 1), np.uint64)
        q = np.empty(_QSIZE, np.float64)
        width = np.empty(1 << flag_bits, np.int64)
        flag_of = np.empty(_HIST, np.int64)
        qdown = np.empty(_QSIZE, np.float64)
        fhead = np.empty(_HIST, np.int64)
        flen = np.empty(_HIST, np.int64)
        blen = min(bucket, n)
        kept = np.empty(blen, np.int32)
        ltab = np.empty(1 << (32 - _CELL_SHIFT), np.uint8)
        wmax = mpicomp_fastsgd_bit_length(max(blen - 1, 0))
        words = np.empty((blen * (flag_bits + wmax) + 31) // 32 + 1, np.uint32)
        for k in range(g * nb_ // ngroups, (g + 1) * nb_ // ngroups):
            start = k * bucket
            stop = min(n, start + bucket)
            m = mpicomp_fastsgd_encode_bucket(
                x[start:stop], xbits[start:stop], powers, flag_bits,
                scratch[k * cap : (k + 1) * cap], acc, q, qdown, width, flag_of, fhead, flen,
                kept, ltab, words,
            )  # fmt: skip
            bad[g] |= m < 0
            sizes[k] = max(m, 0)
    return bad.sum() == 0


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fastsgd_assemble(scratch, cap, sizes, offsets, body):
    """Copy bucket k's sizes[k] bytes from scratch[k*cap:] to body[offsets[k]:]."""
    for k in nb.prange(sizes.size):
        body[offsets[k] : offsets[k] + sizes[k]] = scratch[k * cap : k * cap + sizes[k]]


@nb.njit(cache=True, nogil=True)
def mpicomp_fastsgd_scan(body, n, bucket, flag_bits, offsets, sums):
    """Walk the bucket headers, check every length against the body; fill offsets and sums; return an error code.

    On an error every bucket from the failing one on is left empty (its offset and the
    next equal, its sum 0), so the decode may run before the error is read: it reads
    only the buckets the walk checked.
    """
    size = body.size
    pos = PREFIX_BYTES
    nb_ = offsets.size - 1
    for k in range(nb_):
        blen = min(n - k * bucket, bucket)
        err = _check_bucket(body, pos, blen, flag_bits)
        if err != OK:
            offsets[k:] = pos
            sums[k:] = 0
            return err
        offsets[k] = pos
        sums[k] = _get_u32(body, pos)
        pos += BUCKET_HEAD_BYTES + _get_u32(body, pos + 4) + _get_u32(body, pos + 8)
    offsets[nb_] = pos
    if pos != size:
        return ERR_TRAILING
    return OK


@nb.njit(inline="always", cache=True)
def _check_bucket(body, pos, blen, flag_bits):
    """Return the error code of the bucket header at ``pos`` of a bucket of ``blen`` values
    (OK when it and its codes and key bytes lie inside the body)."""
    size = body.size
    if size - pos < BUCKET_HEAD_BYTES:
        return ERR_TRUNCATED
    sbits = _get_u32(body, pos)
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
    if size - pos - BUCKET_HEAD_BYTES < d + kbytes:
        return ERR_TRUNCATED
    return OK


@nb.njit(cache=True, nogil=True)
def mpicomp_fastsgd_decode_bucket(
    body, pos, end, sbits, powers, flag_bits, out, q, vals, width, least, accumulate
):
    """Scatter one bucket's +-float32(sum / b^L) at its decoded keys into its slice out
    (zeroed first, or added to when ``accumulate``); return an error code.

    A bucket shorter than its header is one a failed scan left empty (``scan``): nothing
    of it is read.
    """
    if not accumulate:
        out[:] = 0
    if end - pos < BUCKET_HEAD_BYTES:
        return ERR_TRUNCATED
    d = _get_u32(body, pos + 4)
    if d == 0:
        return OK
    W = np.int64(body[pos + 12])
    tau = powers.size - 1
    code_pos = pos + BUCKET_HEAD_BYTES
    codes = body[code_pos : code_pos + d]
    # Keys before the first code above tau decode first: their errors come first.
    first_bad = d
    for j in range(d):
        if (codes[j] & 0x7F) > tau:
            first_bad = j
            break
    mpicomp_fastsgd_thresholds(mpicomp_fastsgd_f32_value(sbits), powers, q)
    # The float32 value of every code byte (codes above tau never reach the scatter).
    for code in range(256):
        v = np.float32(q[min(code & 0x7F, tau)])
        # v is finite (scan refuses a NaN/Inf sum): -v is exact, and adds of such values
        # reach Inf at worst, never a NaN whose bits the compiler would choose.
        vals[code] = -v if code & SIGN_BIT else v
    mpicomp_fastsgd_widths(W, flag_bits, width, least)
    # least[c]: the smallest delta flag c may carry (the widths below c are too narrow).
    least[0] = 0
    for c in range(1, 1 << flag_bits):
        least[c] = 1 << width[c - 1]
    err = _decode_keys(
        body[code_pos + d : end],
        codes,
        first_bad,
        flag_bits,
        W,
        width,
        least,
        vals,
        out,
        accumulate,
    )
    if err == OK and first_bad < d:
        return ERR_CODE
    return err


@nb.njit(cache=True, nogil=True)
def _decode_keys(stream, codes, d, flag_bits, W, width, least, vals, out, accumulate):
    """Decode d (flag, delta) keys from ``stream`` and scatter vals[codes[j]] at them;
    return an error code (the checks of ``mpicomp_fastsgd_decode_bucket``).

    A 64-bit window, refilled 32 bits at a time, always holds a whole field while the
    stream lasts. A function of its own: inlined into the bucket decoder, LLVM keeps
    the window state in memory.
    """
    blen = out.size
    end = stream.size
    avail = end * 8
    fmask = np.uint64((1 << flag_bits) - 1)
    need = flag_bits + W
    pos = 0
    used = 0
    acc = np.uint64(0)
    nacc = 0
    key = -1  # the first key's delta counts from 0 and may be 0
    maxdelta = 0
    for j in range(d):
        while nacc < need and pos < end:
            if nacc <= 32 and pos + 4 <= end:
                word = (
                    (np.uint64(stream[pos]) << np.uint64(24))
                    | (np.uint64(stream[pos + 1]) << np.uint64(16))
                    | (np.uint64(stream[pos + 2]) << np.uint64(8))
                    | np.uint64(stream[pos + 3])
                )
                acc = (acc << np.uint64(32)) | word
                pos += 4
                nacc += 32
            else:
                acc = (acc << np.uint64(8)) | np.uint64(stream[pos])
                pos += 1
                nacc += 8
        if used + flag_bits > avail:
            return ERR_KEY_BITS
        c = np.int64((acc >> np.uint64(nacc - flag_bits)) & fmask)
        w = width[c]
        used += flag_bits + w
        if used > avail:
            return ERR_KEY_BITS
        nacc -= flag_bits + w
        delta = np.int64((acc >> np.uint64(nacc)) & ((np.uint64(1) << np.uint64(w)) - np.uint64(1)))
        key += delta if j else delta + 1
        if delta < least[c] or (j > 0 and delta == 0) or key >= blen:
            if delta < least[c]:
                return ERR_KEY_FLAG
            return ERR_KEY_ORDER
        maxdelta = max(maxdelta, delta)
        if accumulate:
            out[key] += vals[codes[j]]
        else:
            out[key] = vals[codes[j]]
    if d < codes.size:
        return OK  # a bad code follows: the caller reports it
    # The stream must end in its last byte, padded with zero bits, and W must be exact.
    if avail - used >= 8 or (acc & np.uint64((1 << nacc) - 1)) != 0 or pos != end:
        return ERR_KEY_TAIL
    if mpicomp_fastsgd_bit_length(maxdelta) != W:
        return ERR_KEY_TAIL
    return OK


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fastsgd_decode(
    body, n, bucket, powers, flag_bits, offsets, sums, out, errs, accumulate
):
    """Scatter +-float32(sum / b^L) at the decoded keys of each bucket into out; set errs[k].

    ``out`` need not be zeroed: each bucket's slice is zeroed first, unless
    ``accumulate``, where the values are added to it (a scatter-add, in key order).
    """
    nb_ = offsets.size - 1
    ngroups = min(nb_, 256)
    for g in nb.prange(ngroups):
        q = np.empty(_QSIZE, np.float64)
        vals = np.empty(256, np.float32)
        width = np.empty(1 << flag_bits, np.int64)
        least = np.empty(_HIST, np.int64)
        for k in range(g * nb_ // ngroups, (g + 1) * nb_ // ngroups):
            start = k * bucket
            errs[k] = mpicomp_fastsgd_decode_bucket(
                body, offsets[k], offsets[k + 1], sums[k], powers, flag_bits,
                out[start : min(n, start + bucket)], q, vals, width, least, accumulate,
            )  # fmt: skip


# --- launcher of the numba backend's ``fastsgd`` family (the same signature on every backend) ---


def encode(x, bucket, powers, flag_bits, scratch, cap, sizes) -> bool:
    """Encode float32 ``x`` bucket by bucket into ``cap``-byte slots of ``scratch``, each
    bucket's byte count into ``sizes``; return False if ``x`` holds NaN or Inf."""
    return mpicomp_fastsgd_encode(
        x, x.view(np.uint32), bucket, powers, flag_bits, scratch, cap, sizes
    )


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
