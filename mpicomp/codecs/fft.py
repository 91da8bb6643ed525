"""FFT-based gradient sparsification with a range-based N-bit float (paper 002).

The gradient, flattened and optionally rounded to float16, goes through a real FFT;
the ceil((1 - theta) * (n//2 + 1)) frequencies of largest magnitude are kept, marked
in a bitmap and packed densely with a prefix sum (§3.2); their real and imaginary
parts travel as range-based N-bit floats (§3.2.1, Alg. 1). The receiver scatters
them into a zero spectrum and inverts the FFT. Body layout: docs/codecs.md.

Below ``BLOCKED_MIN`` elements the transforms are NumPy's (pocketfft, one call); from
it on, a blocked float32 transform: batched, multi-threaded scipy.fft passes over an
(n1, n2) matrix of the signal, with numba kernels between them (``kernels/cpu/fft.py``).
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import numba
import numpy as np
import scipy.fft

from mpicomp._backend import as_gradient
from mpicomp.codecs import _wire
from mpicomp.codecs._base import Codec, check_number, register
from mpicomp.errors import PayloadError
from mpicomp.kernels.cpu import fft as _k
from mpicomp.kernels.cpu.checks import mpicomp_all_finite

# eps (float32 bit pattern), m, N, reserved, k: the fixed part of the body.
_BODY = struct.Struct("<IBBHQ")
BODY_FIXED = _BODY.size  # 16


# From this many elements on, the blocked transform runs: below it one pocketfft call is
# a millisecond or two, and its float32 bytes are those of numpy.fft.rfft.
BLOCKED_MIN = 1 << 18
# Both sides of the blocked matrix are at least this long (else one NumPy call is used).
_MIN_SIDE = 64


@dataclass(frozen=True)
class _Plan:
    """How the blocked transform splits n = 2 * n1 * n2, and its table of unit roots.

    ``w_hi[:, h]`` and ``w_lo[:, l]`` hold the real and imaginary parts of
    exp(-2 pi i h 2**shift / n) and exp(-2 pi i l / n): their product is that of
    j = h * 2**shift + l.
    """

    n1: int
    n2: int
    shift: int
    w_hi: np.ndarray
    w_lo: np.ndarray


@functools.lru_cache(maxsize=8)
def _plan(n: int) -> _Plan | None:
    """Return the blocked-transform plan of an ``n``-element rfft, or None for NumPy's.

    None below ``BLOCKED_MIN``, for odd n, and when n/2 has no divisor between
    ``_MIN_SIDE`` and its square root (n/2 prime, say).
    """
    if n < BLOCKED_MIN or n % 2:
        return None
    m = n // 2
    n1 = next((d for d in range(math.isqrt(m), _MIN_SIDE - 1, -1) if m % d == 0), None)
    if n1 is None:
        return None
    shift = (n.bit_length() + 1) // 2
    lo = np.arange(1 << shift)
    hi = np.arange(((n - 1) >> shift) + 1) << shift
    w_hi, w_lo = (np.exp(-2j * np.pi * j / n) for j in (hi, lo))
    return _Plan(
        n1, m // n1, shift, np.stack([w_hi.real, w_hi.imag]), np.stack([w_lo.real, w_lo.imag])
    )


def _rfft(flat: np.ndarray, own: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """Return (interleaved float32 half spectrum, |X|^2 in float32, all finite) of ``flat``.

    ``own``: ``flat`` is a scratch copy the transform may overwrite.
    """
    nbins = num_bins(flat.size)
    mag2 = np.empty(nbins, dtype=np.float32)
    plan = _plan(flat.size)
    if plan is None:
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf are caught below
            spec = np.fft.rfft(flat).astype(np.complex64, copy=False).view(np.float32)
        return spec, mag2, _k.mpicomp_fft_magnitude(spec, mag2)
    workers = numba.get_num_threads()
    # Columns of the (n1, n2) matrix, twiddle, then rows: the rows' transform reads the
    # matrix transposed, so the spectrum comes out in natural frequency order.
    z = flat.view(np.complex64).reshape(plan.n1, plan.n2)
    z = scipy.fft.fft(z, axis=0, workers=workers, overwrite_x=own)
    _k.mpicomp_fft_twiddle(z, plan.w_hi, plan.w_lo, plan.shift, False)
    z = scipy.fft.fft(z.T, axis=0, workers=workers)
    spec = np.empty(2 * nbins, dtype=np.float32)
    ok = _k.mpicomp_fft_real_post(z.reshape(-1), plan.w_hi, plan.w_lo, plan.shift, spec, mag2)
    return spec, mag2, ok


def _irfft(spec: np.ndarray, n: int) -> np.ndarray:
    """Return the ``n`` float32 values of the interleaved float32 half spectrum ``spec``."""
    plan = _plan(n)
    if plan is None:
        with np.errstate(invalid="ignore", over="ignore"):  # overflow is caught by callers
            return np.fft.irfft(spec.view(np.complex64), n=n).astype(np.float32, copy=False)
    workers = numba.get_num_threads()
    # The forward steps backwards: Z in natural order is the (n2, n1) transpose of the
    # row transforms' output.
    z = np.empty(n // 2, dtype=np.complex64)
    _k.mpicomp_fft_real_pre(spec, plan.w_hi, plan.w_lo, plan.shift, z)
    z = scipy.fft.ifft(z.reshape(plan.n2, plan.n1), axis=0, workers=workers, overwrite_x=True)
    _k.mpicomp_fft_twiddle(z, plan.w_hi, plan.w_lo, plan.shift, True)
    # Not in place: that would leave the result in the transposed (Fortran) order.
    z = scipy.fft.ifft(z.T, axis=0, workers=workers)
    return np.ascontiguousarray(z).view(np.float32).reshape(-1)


def num_bins(n: int) -> int:
    """Return the length of the real FFT of ``n`` values (0 for an empty array)."""
    return n // 2 + 1 if n else 0


def body_size(n: int, k: int, bits: int) -> int:
    """Return the body size in bytes for ``n`` elements, ``k`` kept frequencies, ``bits`` N."""
    return BODY_FIXED + (num_bins(n) + 7) // 8 + (2 * k * bits + 7) // 8


@register
class FFTCodec(Codec):
    """Keep the largest frequencies of the gradient's real FFT as range-based N-bit floats.

    A biased codec: wrap it in ``ErrorFeedback`` to send later what it drops.
    """

    name = "fft"
    aggregation = "gather"
    fused_feedback = True

    def __init__(self, theta: float = 0.85, bits: int = 10, fp16: bool = True):
        """Check and store the parameters.

        Args:
            theta: fraction of the n//2+1 frequencies dropped, in [0, 1) (paper §4.2: 0.85).
            bits: N, the width of each real or imaginary part, in [4, 16] (paper §4.2: 10).
            fp16: round the gradient to float16 before the FFT (paper §3.1.1: True).

        Raises:
            ValueError: a parameter out of its range.
        """
        theta = check_number("theta", theta, 0.0, 1.0, hi_open=True)
        bits = check_number("bits", bits, 4, 16, integer=True)
        if not isinstance(fp16, (bool, np.bool_)):
            raise ValueError(f"fp16 must be True or False, got {fp16!r}")
        super().__init__(theta=float(theta), bits=bits, fp16=bool(fp16))

    def kept(self, n: int) -> int:
        """Return how many frequencies of an ``n``-element gradient are kept."""
        nbins = num_bins(n)
        # The formula as written, in IEEE double: theta=0.85 with 100 bins keeps 16.
        return min(nbins, math.ceil((1.0 - self.params["theta"]) * nbins))

    def encode(self, x, residual=None) -> np.ndarray:
        """Return the payload of ``x``: header, range parameters, bitmap and N-bit codes.

        Args:
            x: a float array of any shape (float16/bfloat16/float64 are converted to
                float32 once).
            residual: None, or the error-feedback memory: a C-contiguous float32 NumPy
                array of the shape of ``x`` holding a half spectrum R, packed (see
                below). X = rfft(x) + R is encoded (with fp16, x is rounded first) and
                ``residual`` becomes X minus the decoded payload, in the same pass: no
                inverse transform. Packing: the n // 2 + 1 complex bins of an n-value
                rfft carry n real values (the imaginary parts of bin 0 and, for even n,
                of bin n / 2 are 0), so ``r[0]`` = Re R[0] and ``r[1:]`` = the
                interleaved (re, im) parts of R[1], R[2], ..., up to Re R[n/2] for
                even n and Im R[(n-1)/2] for odd n.

        Raises:
            ValueError: ``x`` holds NaN or Inf, or (with fp16) a value float16 cannot
                hold, or its spectrum (plus ``residual``) overflows float32, or
                ``residual`` does not match ``x``.
        """
        x = as_gradient(x)
        flat = x.reshape(-1)
        r = None if residual is None else self._residual_view(residual, x.shape)
        n, bits = flat.size, self.params["bits"]
        nbins, k = num_bins(n), self.kept(n)
        body = np.empty(body_size(n, k, bits), dtype=np.uint8)
        m, pbase = _k.MAX_MANTISSA, 1
        if n:
            own = False
            if self.params["fp16"]:
                rounded = np.empty(n, dtype=np.float32)
                err = _k.mpicomp_fft_round_fp16(flat.view(np.uint32), rounded.view(np.uint32))
                if err == _k.FP16_NONFINITE:
                    raise ValueError("fft: input holds NaN or Inf")
                if err == _k.FP16_OVERFLOW:
                    raise ValueError("fft: a value overflows float16 (|x| > 65504); use fp16=False")
                flat, own = rounded, True
            spec, mag2, ok = _rfft(flat, own)
            if not ok:
                raise ValueError("fft: input holds NaN or Inf (or its spectrum overflows float32)")
            if r is not None and not _k.mpicomp_fft_add_residual(spec, r, mag2):
                raise ValueError("fft: the spectrum of x + residual holds NaN or Inf")
            # Bins strictly above the k-th largest magnitude are kept; ties at it go
            # to the lowest frequency index (inside the kernel), so the set is deterministic.
            thresh = np.float32(-np.inf) if k == nbins else _k.mpicomp_fft_kth_largest(mag2, k)
            dense = np.empty(2 * k, dtype=np.uint32)
            hist = np.zeros(256, dtype=np.int64)
            bitmap = body[BODY_FIXED : BODY_FIXED + (nbins + 7) // 8]
            vmax = _k.mpicomp_fft_select_pack(
                spec.view(np.uint32), mag2, np.float32(thresh), k, bitmap, dense, hist
            )
            m, pbase = _k.mpicomp_fft_choose_range(hist, vmax, bits)
            codes = body[BODY_FIXED + (nbins + 7) // 8 :]
            _k.mpicomp_fft_quantize_pack(dense, vmax, pbase, _k.MAX_MANTISSA - m, bits, codes)
            if r is not None:
                _k.mpicomp_fft_residual(spec, bitmap, vmax, pbase, _k.MAX_MANTISSA - m, bits, r)
        _BODY.pack_into(body, 0, pbase << (_k.MAX_MANTISSA - m), m, bits, 0, k)
        return _wire.pack(self.name, x.shape, body)

    @staticmethod
    def _residual_view(residual, shape: tuple[int, ...]) -> np.ndarray:
        """Return ``residual`` as a flat writable view, checking it matches ``x``."""
        if not isinstance(residual, np.ndarray) or residual.dtype != np.float32:
            raise ValueError(
                f"fft residual must be a float32 NumPy array, got {type(residual).__name__}"
                + (f" of dtype {residual.dtype}" if hasattr(residual, "dtype") else "")
            )
        if residual.shape != shape:
            raise ValueError(f"fft residual has shape {residual.shape}, x has {shape}")
        if not residual.flags.c_contiguous or not residual.flags.writeable:
            raise ValueError("fft residual must be C-contiguous and writeable")
        return residual.reshape(-1)

    def decode(self, payload, numel: int | None = None) -> np.ndarray:
        """Return the float32 gradient of ``payload``, in its original shape.

        Raises:
            PayloadError: the payload is truncated, corrupted, inconsistent, or not fft's.
        """
        shape, n, spec = self._spectrum(payload, numel, None)
        return self._inverse(spec, n).reshape(shape)

    def decode_sum(self, payloads, numel: int) -> np.ndarray:
        """Return the flat float32 sum of the gradients of ``payloads``, added in their order.

        From ``BLOCKED_MIN`` elements on (where the transform dominates), the spectra are
        summed (in float32, payload by payload) and inverted once: the FFT is linear, so
        this is the sum of the decoded payloads up to float32 rounding, at the cost of
        one inverse transform instead of one per payload. Below it, each payload is
        decoded and added, so the sum is bit-identical to decoding them one by one.

        Args:
            payloads: fft payloads, each of ``numel`` elements (any shapes).
            numel: the element count every payload must have.

        Raises:
            PayloadError: a payload is truncated, corrupted, inconsistent, not fft's,
                or not of ``numel`` elements (checked before anything is allocated).
        """
        if _plan(numel) is None:
            total = np.zeros(numel, dtype=np.float32)
            for p in payloads:
                total += self.decode(p, numel=numel).reshape(-1)
            return total
        spec = None
        for p in payloads:
            _, _, spec = self._spectrum(p, numel, spec)
        if spec is None:
            return np.zeros(numel, dtype=np.float32)
        return self._inverse(spec, numel)

    def _spectrum(self, payload, numel, spec):
        """Validate ``payload``; add its kept frequencies to ``spec`` (None: a new zero one).

        Returns (shape, n, spec): ``spec`` is the interleaved float32 half spectrum.
        """
        shape, flags, body = _wire.unpack(self.name, payload, numel=numel)
        n = _wire.numel_of(shape)
        nbins = num_bins(n)
        if flags != 0:
            raise PayloadError(f"fft payload has unknown flags {flags:#x}")
        if body.size < BODY_FIXED:
            raise PayloadError(f"fft payload body truncated: {body.size} < {BODY_FIXED} bytes")
        eps_bits, m, bits, reserved, k = _BODY.unpack_from(body, 0)
        if not 4 <= bits <= 16 or m > _k.MAX_MANTISSA or reserved != 0:
            raise PayloadError(f"fft payload holds bits={bits}, m={m}, reserved={reserved}")
        if k > nbins or body.size != body_size(n, k, bits):
            raise PayloadError(
                f"fft payload holds k={k} of {nbins} frequencies with N={bits} in a "
                f"{body.size}-byte body; expected {body_size(n, min(k, nbins), bits)} bytes"
            )
        shift = _k.MAX_MANTISSA - m
        pbase = eps_bits >> shift
        if eps_bits >= 0x7F800000 or pbase == 0 or (pbase << shift) != eps_bits:
            raise PayloadError(f"fft payload range eps={eps_bits:#010x} is invalid for m={m}")
        if spec is None:
            spec = np.zeros(2 * nbins, dtype=np.float32)
        if n == 0:
            return shape, n, spec
        dense = np.empty(2 * k, dtype=np.float32)
        bitmap = body[BODY_FIXED : BODY_FIXED + (nbins + 7) // 8]
        err = _k.mpicomp_fft_unpack_dequantize(
            body[BODY_FIXED + bitmap.size :], pbase, shift, bits, dense.view(np.uint32)
        )
        if err != _k.DECODE_OK:
            raise PayloadError(f"fft payload codes are invalid: {_DECODE_ERRORS[err]}")
        err = _k.mpicomp_fft_scatter(bitmap, dense, k, spec)
        if err != _k.DECODE_OK:
            raise PayloadError(f"fft payload bitmap is invalid: {_DECODE_ERRORS[err]}")
        return shape, n, spec

    @staticmethod
    def _inverse(spec: np.ndarray, n: int) -> np.ndarray:
        """Return the flat float32 inverse transform of ``spec``, refusing overflow."""
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        out = _irfft(spec, n)
        # Finite codes can still sum past float32's range in the inverse transform;
        # no encoder makes such a payload, so it is refused rather than returned as Inf.
        if not mpicomp_all_finite(out):
            raise PayloadError("fft payload decodes to values beyond float32's range")
        return out


_DECODE_ERRORS = {
    _k.DECODE_NEGATIVE_ZERO: "a sign bit on a zero magnitude",
    _k.DECODE_OVERFLOW: "a code decodes beyond float32's range",
    _k.DECODE_PADDING: "nonzero padding bits",
    _k.DECODE_COUNT: "its popcount differs from k",
}
