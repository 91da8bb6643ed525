"""3LC kernels (the 3LC paper §3): max pass, 3-value quantization + quartic encoding with
fused error feedback, zero-run encoding and the validating decoders.

Every kernel is a plain per-element or per-byte loop in float32 without fastmath, so
a CUDA twin (planned; same names) can give the same bytes. They are serial on
purpose: written this way LLVM vectorizes them to near memory bandwidth on one core,
numba's parfor lowering measured slower per thread, and MPI jobs usually run a rank
per core already, where extra threads only oversubscribe.
"""

import numba as nb
import numpy as np

from mpicomp.kernels.cpu.floatbits import bits_float, float_bits
from mpicomp.kernels.numba_cache import guard
from mpicomp.kernels.threelc import (
    ERR_BYTE,
    ERR_PAD,
    ERR_ZERO_SCALE,
    MAX_QUARTIC,
    MAX_RUN,
    OK,
    RUN_BASE,
    ZERO_BYTE,
)

_ABS_MASK = np.uint32(0x7FFFFFFF)
_EXP_MASK = np.uint32(0x7F800000)
_FLT_MAX = np.float32(3.4028235e38)
_HALF = np.float32(0.5)
_SIGN = np.uint32(0x80000000)


#: M's 4 bytes when ``max`` met NaN/Inf: a quiet NaN, on which ``quartic_encode`` writes nothing.
_NOT_ENCODABLE = np.array([0x7FC00000], "<u4").view(np.uint8)


def _scale_of(scale):
    """Return M as np.float32: ``scale`` itself, or the float32 of its 4 (little-endian)
    bytes, as ``max`` writes them and a payload holds them."""
    if isinstance(scale, np.ndarray) and scale.ndim == 1:
        if scale.dtype != np.uint8 or scale.size != 4:
            raise ValueError("threelc: scale must be a float or its 4 uint8 bytes")
        return np.frombuffer(scale.tobytes(), "<f4")[0]
    return np.float32(scale)


def mpicomp_threelc_max(x, r, use_r, s, scale=None):
    """Return (M, ok): M = max|x + r| * s in float32 (clamped to FLT_MAX); ok False on NaN/Inf
    (M then 0). ``scale``, 4 uint8, receives M's bytes (little-endian; a quiet NaN when not ok)."""
    m, ok = _max(x, r, use_r, s)
    if scale is not None:
        if scale.dtype != np.uint8 or scale.size != 4:
            raise ValueError("threelc: scale must be 4 uint8 bytes")
        scale[:] = np.array([m], "<f4").view(np.uint8) if ok else _NOT_ENCODABLE
    return m, ok


@nb.njit(cache=True)
def _max(x, r, use_r, s):
    # |v| is ordered as the uint32 pattern of v with the sign cleared: an integer max
    # that vectorizes, and NaN/Inf are exactly the patterns >= 0x7F800000 (whichever NaN
    # x + r makes, it only fails the check: the codec then refuses x).
    top = np.uint32(0)
    for i in range(x.size):
        v = x[i] + r[i] if use_r else x[i]
        top = max(top, np.float32(v).view(np.uint32) & _ABS_MASK)
    if top >= _EXP_MASK:
        return np.float32(0), False
    scale = np.uint32(top).view(np.float32) * np.float32(s)
    # max|x| * s can overflow for s > 1; FLT_MAX still bounds every |x| (trits stay exact).
    if scale > _FLT_MAX:
        scale = _FLT_MAX
    return scale, True


def mpicomp_threelc_quartic_encode(x, r, use_r, scale, out):
    """Write byte j = sum_k (trit[k*L + j] + 1) * 3^(4-k) to out[j]; set r = (x + r) - trit*M.
    M: a float or its 4 bytes (``max``'s); a NaN M (x + r not finite) writes nothing."""
    _quartic_encode(x, r, use_r, _scale_of(scale), out)


@nb.njit(cache=True)
def _quartic_encode(x, r, use_r, scale, out):
    # mpicomp_threelc_max's NaN mark: x + r is not finite, nothing is written (no NaN
    # reaches r or out). Otherwise x + r is finite.
    scale = np.float32(scale)
    if scale != scale:
        return
    n = x.size
    L = out.size
    for j in range(L):
        byte = 0
        for k in range(5):
            i = k * L + j
            digit = 0  # the pad value
            if i < n:
                v = x[i] + r[i] if use_r else x[i]
                digit = 1
                # round-half-to-even(v / M) for |v / M| <= 1: exactly +-0.5 rounds to 0.
                if scale > np.float32(0):
                    q = v / scale
                    if q > _HALF:
                        digit = 2
                    elif q < -_HALF:
                        digit = 0
                if use_r:
                    if digit == 2:
                        r[i] = v - scale
                    elif digit == 0:
                        r[i] = v + scale
                    else:
                        r[i] = v
            byte = byte * 3 + digit
        out[j] = np.uint8(byte)


@nb.njit(cache=True)
def mpicomp_threelc_zero_run_encode(src, dst):
    """Write src with each run of k bytes 121 (2 <= k <= 14) replaced by 243 + k - 2; return length."""
    L = src.size
    i = 0
    k = 0
    while i < L:
        b = src[i]
        if b == ZERO_BYTE:
            j = i + 1
            while j < L and j - i < MAX_RUN and src[j] == ZERO_BYTE:
                j += 1
            run = j - i
            dst[k] = np.uint8(ZERO_BYTE if run == 1 else RUN_BASE + run - 2)
            i = j
        else:
            dst[k] = b
            i += 1
        k += 1
    return k


@nb.njit(cache=True)
def mpicomp_threelc_zero_run_length(src, limit):
    """Return the zero-run-decoded length of src, or -1 as soon as it exceeds ``limit``."""
    total = 0
    for i in range(src.size):
        b = np.int64(src[i])
        total += b - (RUN_BASE - 2) if b >= RUN_BASE else 1
        if total > limit:
            return -1
    return total


@nb.njit(nogil=True, cache=True)
def mpicomp_threelc_zero_run_decode(src, dst):
    """Expand codes 243..255 of src into 2..14 bytes 121 in dst (what falls past dst is
    dropped, the rest of dst is 121); return the length of the whole expansion."""
    L = dst.size
    # Runs are most of a sparse tensor's bytes: fill with 121 first (a vectorized
    # memset), then the loop only skips over them and writes the other bytes.
    dst[:] = np.uint8(ZERO_BYTE)
    k = 0
    for i in range(src.size):
        b = np.int64(src[i])
        if b >= RUN_BASE:
            k += b - (RUN_BASE - 2)
        else:
            if k < L:
                dst[k] = np.uint8(b)
            k += 1
    return k


@nb.njit(inline="always", cache=True)
def _digit(b, k):
    """Return base-3 digit k (k = 0 is the 3^4 digit) of quartic byte b."""
    if k == 0:
        return b // 81
    if k == 1:
        return b // 27 % 3
    if k == 2:
        return b // 9 % 3
    if k == 3:
        return b // 3 % 3
    return b % 3


@nb.njit(inline="always", cache=True)
def _div(x, magic):
    """Return x // d for x < 3d, d in (81, 27, 9, 3), as (x * magic) >> 16 in uint32
    (magic = 810, 2428, 7282, 21846; exact on that range): 32-bit SIMD lanes."""
    return np.uint32(np.uint32(x * np.uint32(magic)) >> np.uint32(16))


@nb.njit(inline="always", cache=True)
def _trit_value(d, scale):
    # -M as a flip of the sign bit, as in threelc.cu: numba's -x is 0 - x, whose result
    # for a NaN M the compiler would pick.
    neg = bits_float(float_bits(np.float32(scale)) ^ _SIGN)
    return scale if d == 2 else (neg if d == 0 else np.float32(0))


@nb.njit(nogil=True, cache=True)
def mpicomp_threelc_quartic_decode_span(src, scale, out, L, lo, hi):
    """Write out[k*L + j] = (digit k of src[j] - 1) * M for j in [lo, hi), all five
    partitions valid there (5 stores per byte, one read of src)."""
    blk = src[lo:hi]
    o0 = out[lo:hi]
    o1 = out[L + lo : L + hi]
    o2 = out[2 * L + lo : 2 * L + hi]
    o3 = out[3 * L + lo : 3 * L + hi]
    o4 = out[4 * L + lo : 4 * L + hi]
    for j in range(blk.size):
        b = np.uint32(blk[j])
        d0 = _div(b, 810)
        r = np.uint32(b - d0 * np.uint32(81))
        d1 = _div(r, 2428)
        r = np.uint32(r - d1 * np.uint32(27))
        d2 = _div(r, 7282)
        r = np.uint32(r - d2 * np.uint32(9))
        d3 = _div(r, 21846)
        d4 = np.uint32(r - d3 * np.uint32(3))
        o0[j] = _trit_value(d0, scale)
        o1[j] = _trit_value(d1, scale)
        o2[j] = _trit_value(d2, scale)
        o3[j] = _trit_value(d3, scale)
        o4[j] = _trit_value(d4, scale)


# Quartic bytes per parallel task of the decoder (five times as many floats written).
DECODE_CHUNK = 1 << 17


@nb.njit(parallel=True, nogil=True, cache=True)
def _decode_full(src, scale, out, L, full):
    for c in nb.prange((full + DECODE_CHUNK - 1) // DECODE_CHUNK):
        lo = np.int64(c) * DECODE_CHUNK  # prange indices are unsigned
        mpicomp_threelc_quartic_decode_span(src, scale, out, L, lo, min(full, lo + DECODE_CHUNK))


def mpicomp_threelc_quartic_decode(src, scale, out):
    """Write out[k*L + j] = (digit k of src[j] - 1) * M; return an error code (0 if valid).
    M: a float or its 4 bytes (a payload's). Nothing is written on error."""
    # Plain Python around two kernels: a cached njit function must not call the parallel
    # _decode_full (see bits.py).
    scale = _scale_of(scale)
    code, full = _quartic_decode_serial(src, scale, out)
    if full:
        _decode_full(src, np.float32(scale), out, src.size, full)
    return code


@nb.njit(nogil=True, cache=True)
def _quartic_decode_serial(src, scale, out):
    """Validate, decode all but the bytes left to _decode_full; return (code, full).

    ``full`` > 0: bytes [0, full) are for the caller to decode in parallel."""
    n = out.size
    L = src.size
    scale = np.float32(scale)
    # Validate first (the bytes are a fifth of the output): nothing is written on error.
    top = np.uint8(0)
    for j in range(L):
        top = max(top, src[j])
    if top > MAX_QUARTIC:
        return ERR_BYTE, 0
    for i in range(n, 5 * L):
        k = i // L
        if _digit(np.int32(src[i - k * L]), k) != 0:
            return ERR_PAD, 0
    if scale == np.float32(0):
        # Encoding emits only zero trits when M = 0: every real position holds digit 1.
        for j in range(L):
            b = np.int32(src[j])
            for k in range(5):
                if k * L + j < n and _digit(b, k) != 1:
                    return ERR_ZERO_SCALE, 0
    # Bytes whose five digits all land in out (all but the last few, or all but a
    # tiny tensor's) in parallel chunks; the rest one digit at a time.
    full = max(0, min(L, n - 4 * L))
    if full <= DECODE_CHUNK:
        mpicomp_threelc_quartic_decode_span(src, scale, out, L, 0, full)
    for j in range(full, L):
        b = np.int32(src[j])
        for k in range(5):
            if k * L + j < n:
                out[k * L + j] = _trit_value(_digit(b, k), scale)
    return OK, full if full > DECODE_CHUNK else 0


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
