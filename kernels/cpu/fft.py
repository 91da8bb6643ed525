"""FFT sparsification kernels (the FFT sparsification paper): float16 rounding, the passes
of a blocked real FFT, spectrum magnitudes, top-k selection, bitmap with prefix-sum packing, the range-based
N-bit float and its bit stream.

Floats are handled as their IEEE-754 bit patterns (uint32 views, int64 arithmetic),
so a CUDA twin (planned) can give the same bytes for the same spectrum. Bit streams are
LSB-first: bit b lives in byte b // 8 at position b % 8; code i of width N takes
stream bits [i*N, (i+1)*N), its least significant bit first.

The blocked ("four-step") real FFT of n = 2M values views x as M complex values
z[j] = x[2j] + i x[2j+1], laid out as an (n1, n2) matrix with n1 * n2 = M. The caller
runs the column and row transforms (scipy.fft, batched and multi-threaded); the
kernels here do what lies between them: the twiddle factors, and the real-FFT split
of the complex spectrum (post) or its inverse (pre), which also transposes, so that
the spectrum comes out, and goes in, in natural frequency order.

NaN/Inf, in x or in a spectrum, only set the error codes and flags on which the codec
refuses x (integer tests of bit patterns, or NaN*0 sums); N-bit codes decode below Inf,
so no NaN is sent or decoded, and which NaN an operation returns never matters here.
"""

import math

import numba as nb
import numpy as np

from mpicomp.kernels.fft import (
    DECODE_COUNT,
    DECODE_NEGATIVE_ZERO,
    DECODE_OK,
    DECODE_OVERFLOW,
    DECODE_PADDING,
    FP16_NONFINITE,
    FP16_OK,
    FP16_OVERFLOW,
    MAX_MANTISSA,
)
from mpicomp.kernels.numba_cache import guard

from .floatbits import bits_float, float_bits

_ABS = 0x7FFFFFFF
_EXP_INF = 0x7F800000  # the bit pattern of +Inf: every finite magnitude is below it
_FP16_MIN_NORMAL = 0x38800000  # 2**-14
_FP16_MAX = 0x477FE000  # 65504.0
# Elements per task of the parallel loops (bins: a multiple of 8, whole bitmap bytes).
_CHUNK = 1 << 16
# Groups of eight N-bit codes (N bytes each) per task of the parallel bit packers.
_GROUPS = 1 << 12
# Tasks (each with its own 2**16-bin histogram) of the radix select.
_SELECT_TASKS = 8


@nb.njit(inline="always", cache=True)
def _fp16_code(a, r):
    """Return the error code of one |x| bit pattern ``a`` whose rounding is ``r``."""
    if a >= _EXP_INF:
        return FP16_NONFINITE
    if r > _FP16_MAX:
        return FP16_OVERFLOW
    return FP16_OK


@nb.njit(cache=True, nogil=True)
def _round_fp16_span(x, out):
    """Round x into out (see ``mpicomp_fft_round_fp16``); return the error code.

    Parallel tasks pass slices: a loop from index 0 is one LLVM can vectorize (from a
    variable start, numba's negative-index wraparound makes it five times slower).
    """
    xf = x.view(np.float32)
    worst = 0
    for i in range(x.size):
        b = np.int64(x[i])
        a = b & _ABS
        # Normal float16 range: keep 10 of 23 mantissa bits, ties to even (add just
        # under half an ulp plus the kept lsb, clear the dropped bits; a carry bumps
        # the exponent). Below it, float16 subnormals are multiples of 2**-24, the
        # ulp of 0.5: adding and removing 0.5 rounds |x| to one, ties to even.
        r = (a + 0xFFF + ((a >> 13) & 1)) & 0x7FFFE000
        sub = np.int64(float_bits((abs(xf[i]) + np.float32(0.5)) - np.float32(0.5)))
        r = r if a >= _FP16_MIN_NORMAL else sub
        out[i] = np.uint32(r | (b & 0x80000000))
        # Overflow leaves a rounded magnitude above float16's largest; so must NaN/Inf,
        # whose rounding can wrap past bit 31 (0x7FFFF000 and above): count a itself.
        worst = max(worst, a if a >= _EXP_INF else r)
    if worst <= _FP16_MAX:
        return FP16_OK
    for i in range(x.size):  # rare: find which error comes first
        a = np.int64(x[i]) & _ABS
        code = _fp16_code(a, (a + 0xFFF + ((a >> 13) & 1)) & 0x7FFFE000)
        if code != FP16_OK:
            return code
    return FP16_OK


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_round_fp16(x, out):
    """Round float32 bit patterns ``x`` to float16 precision (nearest-even) into ``out``.

    Returns FP16_OK, FP16_NONFINITE (NaN/Inf in ``x``) or FP16_OVERFLOW (|x| rounds
    beyond float16's largest finite value, 65504), whichever comes first in ``x``.
    """
    n = x.size
    nchunks = (n + _CHUNK - 1) // _CHUNK
    errs = np.zeros(nchunks, np.int64)
    for c in nb.prange(nchunks):
        lo, hi = c * _CHUNK, min(n, (c + 1) * _CHUNK)
        errs[c] = _round_fp16_span(x[lo:hi], out[lo:hi])
    for c in range(nchunks):
        if errs[c] != FP16_OK:
            return errs[c]
    return FP16_OK


@nb.njit(cache=True, nogil=True)
def mpicomp_fft_magnitude(spec, mag2):
    """Write |X|^2 = re*re + im*im (float32) of interleaved ``spec``; return False on NaN/Inf."""
    acc = np.float32(0)
    for i in range(mag2.size):
        re = spec[2 * i]
        im = spec[2 * i + 1]
        acc += re * np.float32(0) + im * np.float32(0)  # NaN*0 and Inf*0 are NaN
        mag2[i] = re * re + im * im
    return acc == acc


@nb.njit(inline="always", cache=True)
def _unit(w_hi, w_lo, shift, j):
    """Return exp(-2 pi i j / n) as (re, im) in float64, from the two tables of the caller.

    w_hi[:, h] = exp(-2 pi i h 2^shift / n) and w_lo[:, l] = exp(-2 pi i l / n), as rows of
    real and imaginary parts: one complex product of two entries, accurate to a few
    float64 ulps.
    """
    h = j >> shift
    lo = j & ((1 << shift) - 1)
    hr, hi = w_hi[0, h], w_hi[1, h]
    lr, li = w_lo[0, lo], w_lo[1, lo]
    return hr * lr - hi * li, hr * li + hi * lr


@nb.njit(cache=True, nogil=True)
def _twiddle_row(row, w_hi, w_lo, shift, step, sign):
    """Multiply complex row[j] (interleaved float32) by the table's unit root number
    step * j, conjugated when sign < 0."""
    for j in range(row.size // 2):
        wr, wi = _unit(w_hi, w_lo, shift, step * j)
        wi *= sign
        re, im = np.float64(row[2 * j]), np.float64(row[2 * j + 1])
        row[2 * j] = np.float32(re * wr - im * wi)
        row[2 * j + 1] = np.float32(re * wi + im * wr)


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_twiddle(b, w_hi, w_lo, shift, inverse):
    """Multiply b[k1, j2] by exp(-+2 pi i j2 k1 / M) in place, M = b.size (four-step twiddle).

    The tables hold powers of exp(-2 pi i / 2M) (see ``_unit``), so the factor is entry
    2 j2 k1 (< 2M: no reduction needed); ``inverse`` conjugates it. Rows go to a
    function of their own, indexed from 0 (see ``_round_fp16_span``).
    """
    sign = -1.0 if inverse else 1.0
    for k1 in nb.prange(b.shape[0]):
        _twiddle_row(b[k1].view(np.float32), w_hi, w_lo, shift, 2 * k1, sign)


@nb.njit(cache=True, nogil=True)
def _post_run(z, zm, w_hi, w_lo, shift, k0, spec, mag2):
    """X[k0 + j] for j < z.size from z[j] = Z[k0 + j] and zm[j] = Z[M - k0 - j] (see
    ``mpicomp_fft_real_post``); return 0 when all are finite (NaN otherwise)."""
    acc = np.float32(0)
    for j in range(z.size):
        zr, zi = np.float64(z[j].real), np.float64(z[j].imag)
        mr, mi = np.float64(zm[j].real), np.float64(zm[j].imag)
        er, ei = 0.5 * (zr + mr), 0.5 * (zi - mi)
        o_r, o_i = 0.5 * (zi + mi), 0.5 * (mr - zr)
        wr, wi = _unit(w_hi, w_lo, shift, k0 + j)
        re = np.float32(er + (wr * o_r - wi * o_i))
        im = np.float32(ei + (wr * o_i + wi * o_r))
        spec[2 * j] = re
        spec[2 * j + 1] = im
        acc += re * np.float32(0) + im * np.float32(0)  # NaN*0 and Inf*0 are NaN
        mag2[j] = re * re + im * im
    return acc


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_real_post(z, w_hi, w_lo, shift, spec, mag2):
    """Turn the M-point complex FFT ``z`` of x[2j] + i x[2j+1] into the rfft of x.

    With E = (Z[k] + conj Z[M-k]) / 2 and O = (Z[k] - conj Z[M-k]) / 2i (the transforms
    of the even and odd samples), X[k] = E + exp(-2 pi i k / 2M) O for k = 0..M, computed
    in float64 and rounded once to float32 into interleaved ``spec``; ``mag2`` gets
    re*re + im*im in float32. Chunks read z forwards and backwards (Z[M-k] = back[k-1]).
    Returns False when a value is NaN or Inf.
    """
    m = z.size
    back = z[::-1]
    nchunks = (m + _CHUNK - 1) // _CHUNK
    acc = np.zeros(nchunks, np.float32)
    for c in nb.prange(nchunks):
        lo = max(c * _CHUNK, 1)  # k = 0 pairs Z[0] with itself: below
        hi = min(m, (c + 1) * _CHUNK)
        acc[c] = _post_run(
            z[lo:hi], back[lo - 1 : hi - 1], w_hi, w_lo, shift, lo, spec[2 * lo : 2 * hi],
            mag2[lo:hi],
        )  # fmt: skip
    first = _post_run(z[0:1], z[0:1], w_hi, w_lo, shift, 0, spec[0:2], mag2[0:1])
    # X[M] = E[0] - O[0], real.
    re = np.float32(np.float64(z[0].real) - np.float64(z[0].imag))
    spec[2 * m] = re
    spec[2 * m + 1] = np.float32(0)
    mag2[m] = re * re
    return acc.sum() == 0 and first == 0 and re * np.float32(0) == 0


@nb.njit(cache=True, nogil=True)
def _pre_run(x, xm, w_hi, w_lo, shift, k0, z):
    """Z[k0 + j] into z[j] from x[j] = X[k0 + j] and xm[j] = X[M - k0 - j] (complex64)."""
    for j in range(z.size):
        xr, xi = np.float64(x[j].real), np.float64(x[j].imag)
        mr, mi = np.float64(xm[j].real), np.float64(xm[j].imag)
        er, ei = 0.5 * (xr + mr), 0.5 * (xi - mi)
        dr, di = 0.5 * (xr - mr), 0.5 * (xi + mi)
        wr, wi = _unit(w_hi, w_lo, shift, k0 + j)
        o_r, o_i = wr * dr + wi * di, wr * di - wi * dr  # conj(w) * d
        z[j] = np.complex64(complex(er - o_i, ei + o_r))


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_real_pre(spec, w_hi, w_lo, shift, z):
    """The inverse of ``mpicomp_fft_real_post``: from the half spectrum X[0..M] (interleaved
    float32 ``spec``) write z[k] = E + i O for k < M, where E = (X[k] + conj X[M-k]) / 2
    and O = exp(+2 pi i k / 2M) (X[k] - conj X[M-k]) / 2.

    The inverse M-point FFT of z (normalized by 1/M) is then x[2j] + i x[2j+1]. As in
    ``numpy.fft.irfft``, the imaginary parts of X[0] and X[M] are ignored.
    """
    m = z.size
    xs = spec.view(np.complex64)
    back = xs[::-1]  # back[k] = X[M - k]: the mirror runs read backwards
    nchunks = (m + _CHUNK - 1) // _CHUNK
    for c in nb.prange(nchunks):
        lo = max(c * _CHUNK, 1)  # k = 0: below
        hi = min(m, (c + 1) * _CHUNK)
        _pre_run(xs[lo:hi], back[lo:hi], w_hi, w_lo, shift, lo, z[lo:hi])
    ends = np.zeros(2, np.complex64)  # X[0] and X[M] without their imaginary parts
    ends[0] = xs[0].real
    ends[1] = xs[m].real
    _pre_run(ends[0:1], ends[1:2], w_hi, w_lo, shift, 0, z[0:1])


@nb.njit(cache=True, nogil=True)
def _histogram(u, level, prefix, hist):
    """Count the top 16 bits of u (level 0), or the low 16 bits of those whose top is ``prefix``."""
    if level == 0:
        for i in range(u.size):
            hist[np.int64(u[i]) >> 16] += 1
    else:
        for i in range(u.size):
            v = np.int64(u[i])
            if (v >> 16) == prefix:
                hist[v & 0xFFFF] += 1


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_kth_largest(mag2, k):
    """Return the k-th largest of the non-negative float32 ``mag2`` (1 <= k <= size).

    The value ``numpy.partition(mag2, size - k)[size - k]`` gives, found by a radix
    select on the bit patterns (monotonic for non-negative floats): a histogram of the
    top 16 bits picks the bin, a histogram of the low 16 bits inside it the value.
    """
    u = mag2.view(np.uint32)
    n = u.size
    ntasks = min((n + _CHUNK - 1) // _CHUNK, _SELECT_TASKS)
    hist = np.zeros((ntasks, 1 << 16), np.int64)
    prefix = np.int64(0)
    above = np.int64(0)
    for level in range(2):
        hist[:] = 0
        for t in nb.prange(ntasks):
            _histogram(u[t * n // ntasks : (t + 1) * n // ntasks], level, prefix, hist[t])
        # Walk down from the top bin until k values lie at or above it.
        b = (1 << 16) - 1
        while True:
            cnt = np.int64(0)
            for t in range(ntasks):
                cnt += hist[t, b]
            if above + cnt >= k:
                break
            above += cnt
            b -= 1
        prefix = b if level == 0 else (prefix << 16) | b
    return bits_float(np.uint32(prefix))


@nb.njit(cache=True, nogil=True)
def _count_at(mag2, thresh):
    """Return (bins above ``thresh``, bins equal to it)."""
    greater = 0
    equal = 0
    for i in range(mag2.size):
        greater += mag2[i] > thresh
        equal += mag2[i] == thresh
    return greater, equal


@nb.njit(cache=True, nogil=True)
def _pack_span(spec, mag2, thresh, ties, bitmap, re, im, hist):
    """Pack one chunk (starting on a bitmap byte) as ``mpicomp_fft_select_pack`` does,
    taking its first ``ties`` bins at the threshold; return the largest kept |part| bits."""
    nbins = mag2.size
    loc = 0
    byte = 0
    vmax = 0
    for i in range(nbins):
        m2 = mag2[i]
        keep = m2 > thresh
        if not keep and m2 == thresh and ties > 0:
            keep = True
            ties -= 1
        if keep:
            r = np.int64(spec[2 * i])
            m = np.int64(spec[2 * i + 1])
            re[loc] = spec[2 * i]
            im[loc] = spec[2 * i + 1]
            loc += 1
            byte |= 1 << (i & 7)
            for a in (r & _ABS, m & _ABS):
                vmax = max(vmax, a)
                if a != 0:
                    hist[a >> 23] += 1
        if (i & 7) == 7 or i == nbins - 1:
            bitmap[i >> 3] = np.uint8(byte)
            byte = 0
    return vmax


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_select_pack(spec, mag2, thresh, k, bitmap, dense, hist):
    """Mark the k bins with mag2 > thresh, then mag2 == thresh by index; pack them densely.

    ``spec`` and ``dense`` are uint32 views: kept real parts go to dense[0:k] and
    imaginary parts to dense[k:2k], in bin order (the prefix sum of the bitmap).
    ``bitmap`` gets bit i (LSB-first) for each kept bin, padding bits zero.
    ``hist`` counts the float32 exponents of the nonzero kept parts. Returns the
    bit pattern of the largest kept |part|.

    Chunks of bins run in parallel: a first pass counts each chunk's bins above and
    at the threshold, a prefix sum over the chunks gives each its first dense slot
    and its share of the ties (lowest chunks first), a second pass packs.
    """
    nbins = mag2.size
    nchunks = (nbins + _CHUNK - 1) // _CHUNK
    greater = np.zeros(nchunks, np.int64)
    equal = np.zeros(nchunks, np.int64)
    for c in nb.prange(nchunks):
        greater[c], equal[c] = _count_at(mag2[c * _CHUNK : (c + 1) * _CHUNK], thresh)
    ties = k - greater.sum()  # bins at the threshold still to take, lowest index first
    first = np.empty(nchunks + 1, np.int64)
    first[0] = 0
    for c in range(nchunks):
        take = min(equal[c], ties)
        ties -= take
        equal[c] = take
        first[c + 1] = first[c] + greater[c] + take
    hists = np.zeros((nchunks, 256), np.int64)
    vmaxes = np.zeros(nchunks, np.int64)
    for c in nb.prange(nchunks):
        lo, hi = c * _CHUNK, min(nbins, (c + 1) * _CHUNK)
        a, b = first[c], first[c + 1]
        vmaxes[c] = _pack_span(
            spec[2 * lo : 2 * hi], mag2[lo:hi], thresh, equal[c], bitmap[lo >> 3 : (hi + 7) >> 3],
            dense[a:b], dense[k + a : k + b], hists[c],
        )  # fmt: skip
    for c in range(nchunks):
        for e in range(256):
            hist[e] += hists[c, e]
    return vmaxes.max() if nchunks else 0


@nb.njit(cache=True, nogil=True)
def mpicomp_fft_eps_squared(eps_bits):
    """Return the square of the float32 with bit pattern ``eps_bits``, in float64."""
    e = eps_bits >> 23
    mant = eps_bits & 0x7FFFFF
    v = math.ldexp(float(mant | 0x800000), e - 150) if e > 0 else math.ldexp(float(mant), -149)
    return v * v


@nb.njit(cache=True, nogil=True)
def mpicomp_fft_choose_range(hist, vmax, bits):
    """Pick (m, pbase) of the N-bit float: the largest code covers ``vmax``, m minimizes the error.

    For each m in 23..0, pbase = max(1, (vmax >> (23-m)) - (2**(N-1) - 2)) makes the
    largest magnitude code 2**(N-1)-1 decode to vmax truncated to m mantissa bits.
    The squared error of the values in ``hist`` (float32 exponent counts) is bounded
    per exponent bin: 2**(2(e-127-m)) above eps's binade, eps**2 within it, 4**(e-126)
    below it (flushed to zero). The m with the smallest bound wins, ties to the larger m.
    """
    q = (1 << (bits - 1)) - 1
    best_m = MAX_MANTISSA
    best_pbase = 1
    best_err = np.inf
    for m in range(MAX_MANTISSA, -1, -1):
        shift = MAX_MANTISSA - m
        pbase = max(1, (vmax >> shift) - q + 1)
        eps_bits = pbase << shift
        ee = eps_bits >> 23
        eps2 = mpicomp_fft_eps_squared(eps_bits)
        err = 0.0
        for e in range(256):
            c = hist[e]
            if c == 0:
                continue
            if e > ee:
                b2 = math.ldexp(1.0, 2 * (e - 127 - m))
            elif e == ee:
                b2 = eps2
            else:
                b2 = math.ldexp(1.0, 2 * (e - 126))
            err += float(c) * b2
        if err < best_err:
            best_err = err
            best_m = m
            best_pbase = pbase
    return best_m, best_pbase


@nb.njit(inline="always", cache=True)
def mpicomp_fft_nbit_encode(v, vmax, pbase, shift, bits):
    """Return the N-bit code of float32 bit pattern ``v`` (the FFT sparsification paper,
    Alg. 1; sign bit on top)."""
    a = v & _ABS
    if a > vmax:  # Alg. 1 lines 2-3: clamp to max
        a = vmax
    top = a >> shift  # line 4
    if top < pbase:  # below eps: flush to zero (code 0)
        return 0
    return ((v >> 31) << (bits - 1)) | (top - pbase + 1)  # line 5


@nb.njit(inline="always", cache=True)
def mpicomp_fft_nbit_decode(code, pbase, shift, bits):
    """Return the float32 bit pattern of an N-bit code, or -1 for a code no encoder makes."""
    mag = code & ((1 << (bits - 1)) - 1)
    sign = code >> (bits - 1)
    if mag == 0:
        return -1 if sign else 0
    p = (mag + pbase - 1) << shift  # Alg. 1 lines 6-7
    if p >= _EXP_INF:
        return -2
    return (sign << 31) | p


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_quantize_pack(values, vmax, pbase, shift, bits, out):
    """Encode float32 bit patterns ``values`` as N-bit codes packed LSB-first into ``out``.

    Eight codes fill exactly N bytes, so each group of eight is written on its own
    (and groups run in parallel).
    """
    n = values.size
    ngroups = (n + 7) // 8
    for t in nb.prange((ngroups + _GROUPS - 1) // _GROUPS):
        for g in range(t * _GROUPS, min(ngroups, (t + 1) * _GROUPS)):
            acc = 0
            nacc = 0
            pos = g * bits
            for i in range(g * 8, min(n, g * 8 + 8)):
                code = mpicomp_fft_nbit_encode(np.int64(values[i]), vmax, pbase, shift, bits)
                acc |= code << nacc
                nacc += bits
                while nacc >= 8:
                    out[pos] = np.uint8(acc & 0xFF)
                    acc >>= 8
                    nacc -= 8
                    pos += 1
            if nacc > 0:
                out[pos] = np.uint8(acc & 0xFF)


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_unpack_dequantize(stream, pbase, shift, bits, out):
    """Decode ``out.size`` N-bit codes from ``stream`` (exactly ceil(size*N/8) bytes) into ``out``.

    ``out`` is a uint32 view. Returns DECODE_OK, DECODE_NEGATIVE_ZERO (sign bit on a
    zero magnitude), DECODE_OVERFLOW (a code beyond float32's range) or DECODE_PADDING
    (nonzero bits after the last code); of several bad codes, the first one's error.
    """
    n = out.size
    mask = (1 << bits) - 1
    ngroups = (n + 7) // 8
    ntasks = (ngroups + _GROUPS - 1) // _GROUPS
    errs = np.zeros(ntasks, np.int64)
    for t in nb.prange(ntasks):
        for g in range(t * _GROUPS, min(ngroups, (t + 1) * _GROUPS)):
            acc = 0
            nacc = 0
            pos = g * bits
            for i in range(g * 8, min(n, g * 8 + 8)):
                while nacc < bits:
                    acc |= np.int64(stream[pos]) << nacc
                    pos += 1
                    nacc += 8
                p = mpicomp_fft_nbit_decode(acc & mask, pbase, shift, bits)
                if p < 0 and errs[t] == DECODE_OK:
                    errs[t] = DECODE_NEGATIVE_ZERO if p == -1 else DECODE_OVERFLOW
                out[i] = np.uint32(max(p, 0))
                acc >>= bits
                nacc -= bits
    for t in range(ntasks):
        if errs[t] != DECODE_OK:
            return errs[t]
    used = (n * bits) & 7
    if used and (np.int64(stream[stream.size - 1]) >> used) != 0:
        return DECODE_PADDING
    return DECODE_OK


def unpack_dequantize(stream, pbase, shift, bits, out, *, count=None):
    """``mpicomp_fft_unpack_dequantize`` of the first ``count`` codes (default
    ``out.size``; clamped to it) into ``out[:count]``: the CUDA twin's keyword, where the
    count is a payload's field read on the device (a number or a 1-element array here)."""
    n = out.size
    if count is not None:
        n = min(max(int(np.asarray(count).reshape(-1)[0]), 0), out.size)
    return mpicomp_fft_unpack_dequantize(stream, pbase, shift, bits, out[:n])


@nb.njit(cache=True, nogil=True)
def _scatter_span(bitmap, re, im, spec):
    """Add re[j] and im[j] to the j-th bin set in ``bitmap`` (one chunk, from bin 0)."""
    loc = 0
    for i in range(spec.size // 2):
        if (bitmap[i >> 3] >> (i & 7)) & 1:
            spec[2 * i] += re[loc]
            spec[2 * i + 1] += im[loc]
            loc += 1


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_scatter(bitmap, dense, k, spec):
    """Add dense[0:k] (real) and dense[k:2k] (imag) to the bins set in ``bitmap``.

    ``spec`` is an interleaved float32 spectrum of nbins = spec.size // 2 bins: zeroed
    for one payload, or the running sum of earlier payloads. Returns DECODE_OK,
    DECODE_COUNT (the bitmap does not hold exactly k bits) or DECODE_PADDING (bits set
    past the last bin); ``spec`` is left untouched unless DECODE_OK.
    """
    nbins = spec.size // 2
    nchunks = (nbins + _CHUNK - 1) // _CHUNK
    counts = np.zeros(nchunks + 1, np.int64)
    for c in nb.prange(nchunks):
        cnt = 0
        for j in range(c * (_CHUNK >> 3), min(bitmap.size, (c + 1) * (_CHUNK >> 3))):
            b = np.int64(bitmap[j])
            if j == bitmap.size - 1 and nbins & 7:
                b &= (1 << (nbins & 7)) - 1
            # Popcount of a byte: three steps of the classic bit-parallel sum.
            b = (b & 0x55) + ((b >> 1) & 0x55)
            b = (b & 0x33) + ((b >> 2) & 0x33)
            cnt += (b & 0x0F) + (b >> 4)
        counts[c + 1] = cnt
    for c in range(nchunks):
        counts[c + 1] += counts[c]
    if counts[nchunks] != k:
        return DECODE_COUNT
    used = nbins & 7
    if used and (np.int64(bitmap[bitmap.size - 1]) >> used) != 0:
        return DECODE_PADDING
    for c in nb.prange(nchunks):
        lo, hi = c * _CHUNK, min(nbins, (c + 1) * _CHUNK)
        a, b = counts[c], counts[c + 1]
        _scatter_span(
            bitmap[lo >> 3 : (hi + 7) >> 3], dense[a:b], dense[k + a : k + b], spec[2 * lo : 2 * hi]
        )
    return DECODE_OK


# Error feedback in the frequency domain. The residual R of an n-value gradient is the
# half spectrum packed into n float32 values: the interleaved spectrum without the
# imaginary parts of bin 0 and (even n) of bin n/2, which the real FFT makes 0, so
# r[0] = Re R[0] and r[j] = spec[j + 1] for 1 <= j < n. Bins 1..(n-1)//2 have both parts
# in r; bin 0 and the even-n Nyquist bin only their real part.


@nb.njit(cache=True, nogil=True)
def _add_span(spec, r, mag2):
    """Add interleaved ``r`` to ``spec`` and write |X|^2 of the sums (one chunk, from 0);
    return 0 when all are finite (NaN otherwise)."""
    acc = np.float32(0)
    for j in range(mag2.size):
        re = spec[2 * j] + r[2 * j]
        im = spec[2 * j + 1] + r[2 * j + 1]
        spec[2 * j] = re
        spec[2 * j + 1] = im
        acc += re * np.float32(0) + im * np.float32(0)  # NaN*0 and Inf*0 are NaN
        mag2[j] = re * re + im * im
    return acc


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_add_residual(spec, r, mag2):
    """Add the packed residual ``r`` (n values, layout above) to the half spectrum ``spec``.

    ``spec`` is the interleaved float32 rfft of n values (n // 2 + 1 bins); ``mag2`` gets
    re*re + im*im of the sums. Returns False when a sum is NaN or Inf.
    """
    n = r.size
    full = (n - 1) // 2  # bins 1..full have both parts in r
    nchunks = (full + _CHUNK - 1) // _CHUNK
    acc = np.zeros(nchunks, np.float32)
    for c in nb.prange(nchunks):
        lo = 1 + c * _CHUNK
        hi = min(full + 1, lo + _CHUNK)
        acc[c] = _add_span(spec[2 * lo : 2 * hi], r[2 * lo - 1 : 2 * hi - 1], mag2[lo:hi])
    ends = np.zeros(2, np.float32)  # a bin with its real part only
    ends[0] = r[0]
    first = _add_span(spec[0:2], ends, mag2[0:1])
    last = np.float32(0)
    if n % 2 == 0:
        ends[0] = r[n - 1]
        last = _add_span(spec[n : n + 2], ends, mag2[n // 2 : n // 2 + 1])
    return acc.sum() == 0 and first == 0 and last == 0


@nb.njit(inline="always", cache=True)
def _quantization_error(v, vmax, pbase, shift, bits):
    """Return v minus its N-bit float decoded (what the payload fails to carry of v)."""
    code = mpicomp_fft_nbit_encode(np.int64(float_bits(v)), vmax, pbase, shift, bits)
    p = mpicomp_fft_nbit_decode(code, pbase, shift, bits)  # >= 0: an encoder's code
    return v - bits_float(np.uint32(p))


@nb.njit(cache=True, nogil=True)
def _residual_span(spec, bitmap, i0, vmax, pbase, shift, bits, out):
    """Write into interleaved ``out`` what the payload leaves of bins i0.. of ``spec``."""
    for j in range(out.size // 2):
        re = spec[2 * j]
        im = spec[2 * j + 1]
        i = i0 + j
        if (bitmap[i >> 3] >> (i & 7)) & 1:
            re = _quantization_error(re, vmax, pbase, shift, bits)
            im = _quantization_error(im, vmax, pbase, shift, bits)
        out[2 * j] = re
        out[2 * j + 1] = im


@nb.njit(parallel=True, cache=True, nogil=True)
def mpicomp_fft_residual(spec, bitmap, vmax, pbase, shift, bits, r):
    """Write the new packed residual (layout above) of the spectrum ``spec`` into ``r``.

    A bin not set in ``bitmap`` keeps its value; a kept one keeps the error of its
    N-bit floats (``vmax``, ``pbase``, ``shift``, ``bits`` as in
    ``mpicomp_fft_quantize_pack``), so residual + decoded payload = ``spec``.
    """
    n = r.size
    full = (n - 1) // 2
    nchunks = (full + _CHUNK - 1) // _CHUNK
    for c in nb.prange(nchunks):
        lo = 1 + c * _CHUNK
        hi = min(full + 1, lo + _CHUNK)
        _residual_span(
            spec[2 * lo : 2 * hi], bitmap, lo, vmax, pbase, shift, bits, r[2 * lo - 1 : 2 * hi - 1]
        )
    ends = np.empty(2, np.float32)
    _residual_span(spec[0:2], bitmap, 0, vmax, pbase, shift, bits, ends)
    r[0] = ends[0]
    if n % 2 == 0:
        _residual_span(spec[n : n + 2], bitmap, n // 2, vmax, pbase, shift, bits, ends)
        r[n - 1] = ends[0]


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
