"""FFT sparsification kernels (paper 002): float16 rounding, spectrum magnitudes, top-k
bitmap with prefix-sum packing, the range-based N-bit float and its bit stream.

Floats are handled as their IEEE-754 bit patterns (uint32 views, int64 arithmetic),
so the CUDA twins can give the same bytes for the same spectrum. Bit streams are
LSB-first: bit b lives in byte b // 8 at position b % 8; code i of width N takes
stream bits [i*N, (i+1)*N), its least significant bit first.
"""

import math

import numba as nb
import numpy as np

_ABS = 0x7FFFFFFF
_EXP_INF = 0x7F800000  # the bit pattern of +Inf: every finite magnitude is below it
_FP16_MIN_NORMAL = 0x38800000  # 2**-14
_FP16_MAX = 0x477FE000  # 65504.0
MAX_MANTISSA = 23

FP16_OK = 0
FP16_NONFINITE = 1
FP16_OVERFLOW = 2

DECODE_OK = 0
DECODE_NEGATIVE_ZERO = 1
DECODE_OVERFLOW = 2
DECODE_PADDING = 3
DECODE_COUNT = 4


@nb.njit(cache=True)
def mpicomp_fft_round_fp16(x, out):
    """Round float32 bit patterns ``x`` to float16 precision (nearest-even) into ``out``.

    Returns FP16_OK, FP16_NONFINITE (NaN/Inf in ``x``) or FP16_OVERFLOW (|x| rounds
    beyond float16's largest finite value, 65504).
    """
    for i in range(x.size):
        b = np.int64(x[i])
        a = b & _ABS
        if a >= _EXP_INF:
            return FP16_NONFINITE
        if a >= _FP16_MIN_NORMAL:
            # Keep 10 of 23 mantissa bits, ties to even: add just under half an ulp
            # plus the kept lsb, then clear the dropped bits (a carry bumps the exponent).
            r = (a + 0xFFF + ((a >> 13) & 1)) & 0x7FFFE000
            if r > _FP16_MAX:
                return FP16_OVERFLOW
        else:
            # float16 subnormals are multiples of 2**-24: q = round-half-even(|x| / 2**-24).
            e = a >> 23
            mant = (a & 0x7FFFFF) | (0x800000 if e > 0 else 0)
            shift = (126 - e) if e > 0 else 126  # |x| / 2**-24 = mant / 2**shift
            if shift > 24:
                q = 0
            else:
                q = mant >> shift
                rem = mant & ((1 << shift) - 1)
                half = 1 << (shift - 1)
                if rem > half or (rem == half and (q & 1) == 1):
                    q += 1
            r = 0
            if q > 0:
                hb = 0  # highest set bit of q (q <= 1024)
                while (q >> (hb + 1)) > 0:
                    hb += 1
                r = ((hb + 103) << 23) | ((q << (23 - hb)) & 0x7FFFFF)
        out[i] = np.uint32(r | (b & 0x80000000))
    return FP16_OK


@nb.njit(cache=True)
def mpicomp_fft_magnitude(spec, mag2):
    """Write |X|^2 = re*re + im*im (float32) of interleaved ``spec``; return False on NaN/Inf."""
    acc = np.float32(0)
    for i in range(mag2.size):
        re = spec[2 * i]
        im = spec[2 * i + 1]
        acc += re * np.float32(0) + im * np.float32(0)  # NaN*0 and Inf*0 are NaN
        mag2[i] = re * re + im * im
    return acc == acc


@nb.njit(cache=True)
def mpicomp_fft_select_pack(spec, mag2, thresh, k, bitmap, dense, hist):
    """Mark the k bins with mag2 > thresh, then mag2 == thresh by index; pack them densely.

    ``spec`` and ``dense`` are uint32 views: kept real parts go to dense[0:k] and
    imaginary parts to dense[k:2k], in bin order (the prefix sum of the bitmap).
    ``bitmap`` gets bit i (LSB-first) for each kept bin, padding bits zero.
    ``hist`` counts the float32 exponents of the nonzero kept parts. Returns the
    bit pattern of the largest kept |part|.
    """
    nbins = mag2.size
    greater = 0
    for i in range(nbins):
        if mag2[i] > thresh:
            greater += 1
    ties = k - greater  # bins at the threshold still to take, lowest index first
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
            re = np.int64(spec[2 * i])
            im = np.int64(spec[2 * i + 1])
            dense[loc] = spec[2 * i]
            dense[k + loc] = spec[2 * i + 1]
            loc += 1
            byte |= 1 << (i & 7)
            for a in (re & _ABS, im & _ABS):
                if a > vmax:
                    vmax = a
                if a != 0:
                    hist[a >> 23] += 1
        if (i & 7) == 7 or i == nbins - 1:
            bitmap[i >> 3] = np.uint8(byte)
            byte = 0
    return vmax


@nb.njit(cache=True)
def mpicomp_fft_eps_squared(eps_bits):
    """Return the square of the float32 with bit pattern ``eps_bits``, in float64."""
    e = eps_bits >> 23
    mant = eps_bits & 0x7FFFFF
    v = math.ldexp(float(mant | 0x800000), e - 150) if e > 0 else math.ldexp(float(mant), -149)
    return v * v


@nb.njit(cache=True)
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
    """Return the N-bit code of float32 bit pattern ``v`` (paper 002 Alg. 1, sign bit on top)."""
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


@nb.njit(cache=True)
def mpicomp_fft_quantize_pack(values, vmax, pbase, shift, bits, out):
    """Encode float32 bit patterns ``values`` as N-bit codes packed LSB-first into ``out``.

    Eight codes fill exactly N bytes, so each group of eight is written on its own.
    """
    n = values.size
    for g in range((n + 7) // 8):
        acc = 0
        nacc = 0
        pos = g * bits
        for i in range(g * 8, min(n, g * 8 + 8)):
            acc |= mpicomp_fft_nbit_encode(np.int64(values[i]), vmax, pbase, shift, bits) << nacc
            nacc += bits
            while nacc >= 8:
                out[pos] = np.uint8(acc & 0xFF)
                acc >>= 8
                nacc -= 8
                pos += 1
        if nacc > 0:
            out[pos] = np.uint8(acc & 0xFF)


@nb.njit(cache=True)
def mpicomp_fft_unpack_dequantize(stream, pbase, shift, bits, out):
    """Decode ``out.size`` N-bit codes from ``stream`` (exactly ceil(size*N/8) bytes) into ``out``.

    ``out`` is a uint32 view. Returns DECODE_OK, DECODE_NEGATIVE_ZERO (sign bit on a
    zero magnitude), DECODE_OVERFLOW (a code beyond float32's range) or DECODE_PADDING
    (nonzero bits after the last code).
    """
    n = out.size
    mask = (1 << bits) - 1
    for g in range((n + 7) // 8):
        acc = 0
        nacc = 0
        pos = g * bits
        for i in range(g * 8, min(n, g * 8 + 8)):
            while nacc < bits:
                acc |= np.int64(stream[pos]) << nacc
                pos += 1
                nacc += 8
            p = mpicomp_fft_nbit_decode(acc & mask, pbase, shift, bits)
            if p == -1:
                return DECODE_NEGATIVE_ZERO
            if p == -2:
                return DECODE_OVERFLOW
            out[i] = np.uint32(p)
            acc >>= bits
            nacc -= bits
    used = (n * bits) & 7
    if used and (np.int64(stream[stream.size - 1]) >> used) != 0:
        return DECODE_PADDING
    return DECODE_OK


@nb.njit(cache=True)
def mpicomp_fft_scatter(bitmap, dense, k, spec):
    """Scatter dense[0:k] (real) and dense[k:2k] (imag) to the bins set in ``bitmap``.

    ``spec`` is the zeroed interleaved float32 spectrum of nbins = spec.size // 2 bins.
    Returns DECODE_OK, DECODE_COUNT (the bitmap does not hold exactly k bits) or
    DECODE_PADDING (bits set past the last bin).
    """
    nbins = spec.size // 2
    loc = 0
    for i in range(nbins):
        if (bitmap[i >> 3] >> (i & 7)) & 1:
            if loc == k:
                return DECODE_COUNT
            spec[2 * i] = dense[loc]
            spec[2 * i + 1] = dense[k + loc]
            loc += 1
    if loc != k:
        return DECODE_COUNT
    used = nbins & 7
    if used and (np.int64(bitmap[bitmap.size - 1]) >> used) != 0:
        return DECODE_PADDING
    return DECODE_OK
