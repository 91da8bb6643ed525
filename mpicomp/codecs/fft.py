"""FFT-based gradient sparsification with a range-based N-bit float (paper 002).

The gradient, flattened and optionally rounded to float16, goes through a real FFT
(the kernel backend's: on the CPU NumPy's, or a blocked transform for large tensors);
the ceil((1 - theta) * (n//2 + 1)) frequencies of largest magnitude are kept, marked
in a bitmap and packed densely with a prefix sum (§3.2); their real and imaginary
parts travel as range-based N-bit floats (§3.2.1, Alg. 1). The receiver scatters
them into a zero spectrum and inverts the FFT. Body layout: docs/codecs.md.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from mpicomp._arrays import as_gradient, residual_view
from mpicomp.codecs import _wire
from mpicomp.codecs._base import GatherCodecBase, check_number, register
from mpicomp.errors import PayloadError
from mpicomp.kernels import backend_of
from mpicomp.kernels import fft as _k

# eps (float32 bit pattern), m, N, reserved, k: the fixed part of the body.
_BODY = struct.Struct("<IBBHQ")
BODY_FIXED = _BODY.size  # 16


def num_bins(n: int) -> int:
    """Return the length of the real FFT of ``n`` values (0 for an empty array)."""
    return n // 2 + 1 if n else 0


def body_size(n: int, k: int, bits: int) -> int:
    """Return the body size in bytes for ``n`` elements, ``k`` kept frequencies, ``bits`` N."""
    return BODY_FIXED + (num_bins(n) + 7) // 8 + (2 * k * bits + 7) // 8


@register
class FFTCodec(GatherCodecBase):
    """Keep the largest frequencies of the gradient's real FFT as range-based N-bit floats.

    A biased codec: wrap it in ``ErrorFeedback`` to send later what it drops.
    """

    name = "fft"
    fused_feedback = True
    # decode_sum adds the spectra and inverts once: N payloads cost about one decode.
    sums_before_decoding = True

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
            residual: None, or the error-feedback memory: a C-contiguous float32 array
                of the shape of ``x`` holding a half spectrum R, packed (see
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
        kernels = backend_of(x, self.kernels)
        xp, fk = kernels.xp, kernels.fft
        flat = x.reshape(-1)
        r = None if residual is None else residual_view(residual, x, "fft")
        n, bits = flat.size, self.params["bits"]
        nbins, kept = num_bins(n), self.kept(n)
        body = xp.empty(body_size(n, kept, bits), dtype=np.uint8)
        m, pbase = _k.MAX_MANTISSA, 1
        if n:
            own = False
            if self.params["fp16"]:
                rounded = xp.empty(n, dtype=np.float32)
                err = fk.round_fp16(flat.view(np.uint32), rounded.view(np.uint32))
                if err == _k.FP16_NONFINITE:
                    raise ValueError("fft: input holds NaN or Inf")
                if err == _k.FP16_OVERFLOW:
                    raise ValueError("fft: a value overflows float16 (|x| > 65504); use fp16=False")
                flat, own = rounded, True
            spec, mag2, ok = fk.rfft(flat, own)
            if not ok:
                raise ValueError("fft: input holds NaN or Inf (or its spectrum overflows float32)")
            if r is not None and not fk.add_residual(spec, r, mag2):
                raise ValueError("fft: the spectrum of x + residual holds NaN or Inf")
            # Bins strictly above the k-th largest magnitude are kept; ties at it go
            # to the lowest frequency index (inside the kernel), so the set is deterministic.
            thresh = np.float32(-np.inf) if kept == nbins else fk.kth_largest(mag2, kept)
            dense = xp.empty(2 * kept, dtype=np.uint32)
            hist = xp.zeros(256, dtype=np.int64)
            bitmap = body[BODY_FIXED : BODY_FIXED + (nbins + 7) // 8]
            vmax = fk.select_pack(
                spec.view(np.uint32), mag2, np.float32(thresh), kept, bitmap, dense, hist
            )
            m, pbase = fk.choose_range(hist, vmax, bits)
            codes = body[BODY_FIXED + (nbins + 7) // 8 :]
            fk.quantize_pack(dense, vmax, pbase, _k.MAX_MANTISSA - m, bits, codes)
            if r is not None:
                fk.residual(spec, bitmap, vmax, pbase, _k.MAX_MANTISSA - m, bits, r)
        fixed = _BODY.pack(pbase << (_k.MAX_MANTISSA - m), m, bits, 0, kept)
        body[:BODY_FIXED] = xp.asarray(np.frombuffer(fixed, dtype=np.uint8))
        return _wire.pack(self.name, x.shape, body, kernels=self.kernels)

    def decode(self, payload, numel: int | None = None) -> np.ndarray:
        """Return the float32 gradient of ``payload``, in its original shape.

        Raises:
            PayloadError: the payload is truncated, corrupted, inconsistent, or not fft's.
        """
        shape, n, spec = self._spectrum(payload, numel, None)
        return self._inverse(backend_of(spec, self.kernels), spec, n).reshape(shape)

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
        kernels = self.kernels if not payloads else backend_of(payloads[0], self.kernels)
        if not kernels.fft.sum_spectra(numel):
            return super().decode_sum(payloads, numel)
        spec = None
        for p in payloads:
            _, _, spec = self._spectrum(p, numel, spec)
        if spec is None:
            return kernels.xp.zeros(numel, dtype=np.float32)
        return self._inverse(kernels, spec, numel)

    def _spectrum(self, payload, numel, spec):
        """Validate ``payload``; add its kept frequencies to ``spec`` (None: a new zero one).

        Returns (shape, n, spec): ``spec`` is the interleaved float32 half spectrum.
        """
        shape, flags, body = _wire.unpack(self.name, payload, numel=numel, kernels=self.kernels)
        k = backend_of(body, self.kernels)
        n = _wire.numel_of(shape)
        nbins = num_bins(n)
        if flags != 0:
            raise PayloadError(f"fft payload has unknown flags {flags:#x}")
        if body.size < BODY_FIXED:
            raise PayloadError(f"fft payload body truncated: {body.size} < {BODY_FIXED} bytes")
        eps_bits, m, bits, reserved, kept = _BODY.unpack_from(
            k.to_host(body[:BODY_FIXED], why="fft decode: body fields"), 0
        )
        if not 4 <= bits <= 16 or m > _k.MAX_MANTISSA or reserved != 0:
            raise PayloadError(f"fft payload holds bits={bits}, m={m}, reserved={reserved}")
        if kept > nbins or body.size != body_size(n, kept, bits):
            raise PayloadError(
                f"fft payload holds k={kept} of {nbins} frequencies with N={bits} in a "
                f"{body.size}-byte body; expected {body_size(n, min(kept, nbins), bits)} bytes"
            )
        shift = _k.MAX_MANTISSA - m
        pbase = eps_bits >> shift
        if eps_bits >= 0x7F800000 or pbase == 0 or (pbase << shift) != eps_bits:
            raise PayloadError(f"fft payload range eps={eps_bits:#010x} is invalid for m={m}")
        if spec is None:
            spec = k.xp.zeros(2 * nbins, dtype=np.float32)
        if n == 0:
            return shape, n, spec
        dense = k.xp.empty(2 * kept, dtype=np.float32)
        bitmap = body[BODY_FIXED : BODY_FIXED + (nbins + 7) // 8]
        err = k.fft.unpack_dequantize(
            body[BODY_FIXED + bitmap.size :], pbase, shift, bits, dense.view(np.uint32)
        )
        if err != _k.DECODE_OK:
            raise PayloadError(f"fft payload codes are invalid: {_DECODE_ERRORS[err]}")
        err = k.fft.scatter(bitmap, dense, kept, spec)
        if err != _k.DECODE_OK:
            raise PayloadError(f"fft payload bitmap is invalid: {_DECODE_ERRORS[err]}")
        return shape, n, spec

    @staticmethod
    def _inverse(kernels, spec: np.ndarray, n: int) -> np.ndarray:
        """Return the flat float32 inverse transform of ``spec`` (on backend ``kernels``),
        refusing overflow."""
        if n == 0:
            return kernels.xp.zeros(0, dtype=np.float32)
        out = kernels.fft.irfft(spec, n)
        # Finite codes can still sum past float32's range in the inverse transform;
        # no encoder makes such a payload, so it is refused rather than returned as Inf.
        if not kernels.fft.all_finite(out):
            raise PayloadError("fft payload decodes to values beyond float32's range")
        return out


_DECODE_ERRORS = {
    _k.DECODE_NEGATIVE_ZERO: "a sign bit on a zero magnitude",
    _k.DECODE_OVERFLOW: "a code decodes beyond float32's range",
    _k.DECODE_PADDING: "nonzero padding bits",
    _k.DECODE_COUNT: "its popcount differs from k",
}
