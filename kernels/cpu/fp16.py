"""float32 <-> float16 conversion kernels for the ``fp16`` codec and its MPI sum.

NumPy's astype to and from float16 runs at a tenth of memcpy here. These convert on the
bit patterns with round-to-nearest-even, giving NumPy's bytes exactly, in the same pass
that checks the range (encode: also Adler-32-summing the payload bytes block by block
while they are in cache, ``checksum.block_sums``) or finiteness (decode), and run in
parallel chunks whose results are combined in order: no result depends on the thread
count.

NaN results follow x86 SSE's rule, written out as in fp16.cu rather than left to the
compiler (LLVM may swap an fadd's operands, and ARM prefers signaling NaNs): an operation
on a NaN returns the first NaN operand, quieted; an invalid one (Inf - Inf, Inf / Inf)
returns the default NaN 0xFFC00000. Range checks are integer maxima of bit patterns, where
a NaN is just a pattern above Inf's.
"""

import numba as nb
import numpy as np

from mpicomp.kernels.cpu.checksum import BLOCK, add_block, block_sums, extend
from mpicomp.kernels.numba_cache import guard

# float32 bit patterns (sign cleared).
F16_MAX_BITS = np.uint32(0x477FE000)  # 65504, the largest finite float16
_F16_MIN_NORMAL = np.uint32(0x38800000)  # 2^-14
_HALF_BITS = np.uint32(0x3F000000)  # 0.5: its ulp (2^-24) is the float16 subnormal step
_REBIAS = np.uint32(0xC8000000)  # (15 - 127) << 23, modulo 2^32
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_QUIET = np.uint32(0x00400000)
_DEFAULT_NAN = np.uint32(0xFFC00000)  # x86's NaN of an invalid operation
_TWO_M24 = np.float32(2.0**-24)

# Elements per inner block: BLOCK payload bytes of float16.
HALVES = BLOCK // 2
# Elements per parallel task (a multiple of HALVES); fewer stay on the caller's thread.
CHUNK = 1 << 19


@nb.njit(inline="always", cache=True)
def _to_half(u):
    """Return the float16 bits of float32 bits ``u`` (|x| <= 65504), rounded to nearest even."""
    a = u & _ABS
    # Subnormal or zero: adding 0.5 rounds |x| to a multiple of 2^-24 in hardware.
    sub = np.float32(np.uint32(a).view(np.float32) + np.float32(0.5)).view(np.uint32) - _HALF_BITS
    # Normal: rebias the exponent, round the 13 dropped bits half to even; a carry out of
    # the mantissa correctly bumps the exponent.
    norm = (a + _REBIAS + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    h = sub if a < _F16_MIN_NORMAL else norm
    return np.uint16(h | ((u >> np.uint32(16)) & np.uint32(0x8000)))


@nb.njit(inline="always", cache=True)
def _to_half_any(u):
    """``_to_half`` for any float32: beyond float16's range gives Inf, NaN a quiet NaN."""
    a = u & _ABS
    h = np.uint32(_to_half(u))
    big = np.uint32(0x7C00) if a <= np.uint32(0x7F800000) else np.uint32(0x7E00) | (a >> 13)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    return np.uint16(h if a < np.uint32(0x47800000) else (big & np.uint32(0x7FFF)) | sign)


@nb.njit(inline="always", cache=True)
def _to_single(h16):
    """Return the float32 bits of float16 bits ``h16`` (NaN payloads kept, as NumPy does)."""
    h = np.uint32(h16)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    e = (h >> np.uint32(10)) & np.uint32(0x1F)
    m = h & np.uint32(0x3FF)
    normal = ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
    special = np.uint32(0x7F800000) | (m << np.uint32(13))
    sub = np.float32(np.float32(m) * _TWO_M24).view(np.uint32)  # exact: m < 2^10
    bits = sub if e == 0 else (special if e == 31 else normal)
    return np.uint32(bits | sign)


@nb.njit(inline="always", cache=True)
def _isnan(f):
    """Return True if float32 bits ``f`` are a NaN."""
    return (f & _ABS) > _INF


@nb.njit(inline="always", cache=True)
def _nan_x86(r, a, b):
    """Return float32 bits ``r`` of an operation on bits a, b, its NaN made by x86's rule:
    a NaN operand gives the first one, quieted; else the default NaN (invalid op)."""
    # A NaN operand makes r a NaN: one test of r, then selects (the loops still vectorize).
    first = a if _isnan(a) else (b if _isnan(b) else _DEFAULT_NAN)
    return np.uint32(first | _QUIET if _isnan(r) else r)


@nb.njit(inline="always", cache=True)
def _add_x86(a, b):
    """Return the bits of a + b (float32 bits) with x86's NaN rule, a first (fp16.cu)."""
    s = np.uint32(a).view(np.float32) + np.uint32(b).view(np.float32)
    return _nan_x86(np.float32(s).view(np.uint32), a, b)


@nb.njit(inline="always", cache=True)
def _div_x86(a, by):
    """Return the bits of a / by (float32 bits a, float32 by) with x86's NaN rule (fp16.cu)."""
    q = np.uint32(a).view(np.float32) / by
    return _nan_x86(np.float32(q).view(np.uint32), a, np.float32(by).view(np.uint32))


@nb.njit(inline="always", cache=True)
def _encode_span(x, h16, h8, want_sum, lo, hi):
    """Convert x[lo:hi] into h16; return (max |x| bits, s1, s2 of the bytes h8[2lo:2hi])."""
    top = np.uint32(0)
    s1 = np.int64(0)
    s2 = np.int64(0)
    for start in range(lo, hi, HALVES):
        stop = min(start + HALVES, hi)
        src = x[start:stop]
        dst = h16[start:stop]
        for i in range(src.size):
            u = src[i]
            # NaN is a pattern above 65504's: it only fails the check (h16 is garbage then).
            top = max(top, u & _ABS)
            dst[i] = _to_half(u)
        if want_sum:
            bsum, wsum = block_sums(h8[2 * start : 2 * stop])
            s1, s2 = add_block(s1, s2, 2 * (stop - start), bsum, wsum)
    return top, s1, s2


@nb.njit(nogil=True, cache=True)
def mpicomp_fp16_decode(h16, scale, out):
    """Write ``out`` = float32 of float16 bits ``h16`` (uint16), divided by ``scale``
    (float32; 1 leaves NaN payloads as NumPy does). Return False if some value is NaN/Inf.
    """
    special = np.uint32(0)
    by = np.float32(scale)  # a new name: re-typing `scale` would widen it to float64
    divide = by != np.float32(1)
    # One flat loop: LLVM vectorizes it (fused with the checksum's blocks it did not).
    for i in range(h16.size):
        h = h16[i]
        special |= np.uint32((h & np.uint16(0x7C00)) == np.uint16(0x7C00))
        f = _to_single(h)
        out[i] = np.uint32(_div_x86(f, by) if divide else f).view(np.float32)
    return special == 0


@nb.njit(nogil=True, cache=True)
def mpicomp_fp16_encode(x, h16, h8, want_sum):
    """Round float32 bits ``x`` (uint32) to float16 bits in ``h16`` (uint16).

    Returns (ok, sum): ok is False when some |x| > 65504 or is NaN/Inf (``h16`` is then
    garbage); sum is the Adler-32 from 0 of ``h8`` (h16's bytes) when ``want_sum``.
    """
    top, s1, s2 = _encode_span(x, h16, h8, want_sum, 0, x.size)
    return top <= F16_MAX_BITS, extend(0, s1, s2, 2 * x.size)


@nb.njit(parallel=True, nogil=True, cache=True)
def mpicomp_fp16_encode_chunks(x, h16, h8, want_sum):
    """``mpicomp_fp16_encode`` over CHUNK-element chunks in parallel."""
    n = x.size
    nchunks = (n + CHUNK - 1) // CHUNK
    tops = np.empty(nchunks, np.uint32)
    part1 = np.empty(nchunks, np.int64)
    part2 = np.empty(nchunks, np.int64)
    for c in nb.prange(nchunks):
        lo = np.int64(c) * CHUNK  # prange indices are unsigned
        tops[c], part1[c], part2[c] = _encode_span(x, h16, h8, want_sum, lo, min(n, lo + CHUNK))
    value = np.int64(0)
    for c in range(nchunks):
        value = extend(value, part1[c], part2[c], 2 * min(CHUNK, n - c * CHUNK))
    return tops.max() <= F16_MAX_BITS, value


@nb.njit(parallel=True, nogil=True, cache=True)
def mpicomp_fp16_decode_chunks(h16, scale, out):
    """``mpicomp_fp16_decode`` over CHUNK-element chunks in parallel."""
    n = h16.size
    nchunks = (n + CHUNK - 1) // CHUNK
    ok = np.empty(nchunks, np.bool_)
    for c in nb.prange(nchunks):
        lo = np.int64(c) * CHUNK
        hi = min(n, lo + CHUNK)
        ok[c] = mpicomp_fp16_decode(h16[lo:hi], scale, out[lo:hi])
    return ok.all()


@nb.njit(nogil=True, cache=True)
def mpicomp_fp16_add(a, b):
    """b = float16(float32(a) + float32(b)) on float16 bits (uint16), elementwise: the sum
    MPI's float16 reduction made (Inf where it overflows, NaNs by x86's rule: above).
    Returns nothing."""
    for i in range(b.size):
        b[i] = _to_half_any(_add_x86(_to_single(a[i]), _to_single(b[i])))


@nb.njit(parallel=True, nogil=True, cache=True)
def mpicomp_fp16_add_chunks(a, b):
    """``mpicomp_fp16_add`` over CHUNK-element chunks in parallel."""
    n = b.size
    for c in nb.prange((n + CHUNK - 1) // CHUNK):
        lo = np.int64(c) * CHUNK
        hi = min(n, lo + CHUNK)
        mpicomp_fp16_add(a[lo:hi], b[lo:hi])


def add(a, b) -> None:
    """Set float16-bits array ``b`` (uint16) to float16(float32(a) + float32(b))."""
    _same_size("fp16 add", a, b)
    (mpicomp_fp16_add_chunks if b.size > CHUNK else mpicomp_fp16_add)(a, b)


@nb.njit(nogil=True, cache=True)
def mpicomp_fp16_all_finite(h):
    """Return True if no float16 bits of ``h`` (uint16) are NaN or Inf (exponent all ones)."""
    top = np.uint16(0)
    for i in range(h.size):
        top = max(top, np.uint16(h[i] & np.uint16(0x7C00)))  # uint16 lanes: SIMD
    return top != np.uint16(0x7C00)


_NO_BYTES = np.empty(0, np.uint8)


def _same_size(what: str, a, b) -> None:
    # The kernels index both arrays by one counter: a short one would be written past.
    if a.ndim != 1 or b.ndim != 1 or a.size != b.size:
        raise ValueError(f"{what}: arrays of shapes {a.shape} and {b.shape}, need equal 1-D sizes")


def encode(x, h16, h8=None):
    """Round float32 ``x`` to float16 bits in uint16 ``h16`` (same size), in one pass.

    Args:
        x: 1-D contiguous float32 array.
        h16: 1-D contiguous uint16 array of x's size.
        h8: None, or the uint8 view of ``h16``: its Adler-32 from 0 is computed too.

    Returns:
        (ok, sum): ok is False when some |x| > 65504 or is NaN/Inf (``h16`` is then
        garbage); sum is the Adler-32 (0 when ``h8`` is None).
    """
    _same_size("fp16 encode", x, h16)
    if h8 is not None and h8.size != 2 * h16.size:
        raise ValueError(f"fp16 encode: h8 has {h8.size} bytes, h16 needs {2 * h16.size}")
    u = x.view(np.uint32)
    run = mpicomp_fp16_encode_chunks if x.size > CHUNK else mpicomp_fp16_encode
    ok, value = run(u, h16, _NO_BYTES if h8 is None else h8, h8 is not None)
    return bool(ok), int(value)


def decode(h16, out, scale=1.0) -> bool:
    """Write ``out`` (float32) = float16 bits ``h16`` (uint16) as float32, / ``scale``.

    Returns:
        False when some value is NaN/Inf.
    """
    _same_size("fp16 decode", h16, out)
    run = mpicomp_fp16_decode_chunks if h16.size > CHUNK else mpicomp_fp16_decode
    return bool(run(h16, np.float32(scale), out))


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
