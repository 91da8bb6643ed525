"""FFT-based gradient sparsification with a range-based N-bit float (the FFT sparsification paper).

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

from mpicomp.codecs import _wire
from mpicomp.codecs._base import GatherCodecBase, check_number, register
from mpicomp.codecs.arrays import (
    FLOAT16,
    KEPT,
    SPECTRUM,
    Unencodable,
    as_gradient,
    residual_view,
)
from mpicomp.errors import PayloadError
from mpicomp.kernels import backend_of
from mpicomp.kernels import fft as _k
from mpicomp.kernels.readback import Later, batch, read, when

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
    trains_adaptive = False  # under AdamW: docs/choosing.md
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
        xp = kernels.xp
        flat = x.reshape(-1)
        r = None if residual is None else residual_view(residual, x, "fft")
        n, bits = flat.size, self.params["bits"]
        nbins, kept = num_bins(n), self.kept(n)
        payload, body = _wire.empty(x.shape, body_size(n, kept, bits), xp)
        # On a device every flag and the values each step hands the next (which stay
        # there) come back in one read at the end of this block (the checksum is written
        # on the device): the checks run then, in the order below, and the residual is
        # written only if they pass. On the host each runs where it is registered.
        with batch("fft encode"):
            if n:
                self._encode_body(kernels, flat, r, nbins, kept, bits, body)
            else:
                body[:BODY_FIXED] = xp.asarray(_fixed_bytes(1, _k.MAX_MANTISSA, bits, kept))
            _wire.seal(self.name, payload, x.shape, kernels=self.kernels)
        return payload

    def _encode_body(self, kernels, flat, r, nbins, kept, bits, body) -> None:
        """Write the body of a non-empty ``flat`` (and the new residual ``r``), registering
        the refusals of its input with the caller's batch."""
        xp, fk = kernels.xp, kernels.fft
        n, own = flat.size, False
        if self.params["fp16"]:
            rounded = xp.empty(n, dtype=np.float32)
            when(fk.round_fp16(flat.view(np.uint32), rounded.view(np.uint32)), _refuse_fp16)
            flat, own = rounded, True
        spec, mag2, ok = fk.rfft(flat, own)
        when(ok, _refuse_spectrum)
        if r is not None:
            ok = fk.add_residual(spec, r, mag2)
            when(ok, _refuse_residual_sum)
        # Bins strictly above the k-th largest magnitude are kept; ties at it go
        # to the lowest frequency index (inside the kernel), so the set is deterministic.
        thresh = np.float32(-np.inf) if kept == nbins else fk.kth_largest(mag2, kept)
        if not isinstance(thresh, Later):
            thresh = np.float32(thresh)
        dense = xp.empty(2 * kept, dtype=np.uint32)
        hist = xp.zeros(256, dtype=np.int64)
        bitmap = body[BODY_FIXED : BODY_FIXED + (nbins + 7) // 8]
        vmax = fk.select_pack(spec.view(np.uint32), mag2, thresh, kept, bitmap, dense, hist)
        rng = fk.choose_range(hist, vmax, bits)
        on_device = isinstance(rng, Later)
        if on_device:  # (m, pbase) stay on the device: the kernels read them there
            m, pbase = rng.array[0:1], rng.array[1:2]
        else:
            m, pbase = rng
        shift = _k.MAX_MANTISSA - m
        codes = body[BODY_FIXED + (nbins + 7) // 8 :]
        fk.quantize_pack(dense, vmax, pbase, shift, bits, codes)
        if r is not None:
            # After the checks: a refused input leaves the residual as it was.
            when(ok, lambda _: fk.residual(spec, bitmap, vmax, pbase, shift, bits, r))
        if not on_device:
            body[:BODY_FIXED] = xp.asarray(_fixed_bytes(pbase << shift, m, bits, kept))
        else:  # the range's fields written where they are
            fixed = xp.asarray(_fixed_bytes(0, 0, bits, kept))
            fixed[0:4] = (pbase << shift).astype("<u4").view(np.uint8)
            fixed[4:5] = m.astype(np.uint8)
            body[:BODY_FIXED] = fixed

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
        fixed = k.to_host(body[:BODY_FIXED], why="fft decode: body fields")
        pbase, shift, bits, kept = _check_fields(fixed, n, body.size)
        if spec is None:
            spec = k.xp.zeros(2 * nbins, dtype=np.float32)
        if n == 0:
            return shape, n, spec
        dense = k.xp.empty(2 * kept, dtype=np.float32)
        bitmap = body[BODY_FIXED : BODY_FIXED + (nbins + 7) // 8]
        err = k.fft.unpack_dequantize(
            body[BODY_FIXED + bitmap.size :], pbase, shift, bits, dense.view(np.uint32)
        )
        when(err, _refuse_codes)
        when(k.fft.scatter(bitmap, dense, kept, spec), _refuse_bitmap)
        return shape, n, spec

    def decode_gathered(self, payloads, numel: int) -> np.ndarray:
        """Return ``decode_sum(payloads, numel)`` of payloads the collectives gathered, each
        of a flat array of ``numel`` elements.

        On a device nothing is read before the result: a payload's header is known from
        its length and checked there (``_wire.unpack_flat``), its fixed fields are read by
        the kernels from the payload (clamped to what ``numel`` allows), and every check
        (header, checksum, fields, codes, bitmap, the inverse's range) is read with the
        caller's ``readback.batch`` and raises then, in ``decode_sum``'s order, with its
        messages. A payload too short or too long for any body of ``numel`` elements is
        decoded by ``decode_sum``'s path, which says what is wrong.

        Raises:
            PayloadError: a payload is corrupt, or of an array of another shape.
        """
        kernels = self.kernels if not payloads else backend_of(payloads[0], self.kernels)
        if getattr(kernels, "device", None) is None or not payloads or numel == 0:
            return self.decode_sum(payloads, numel)
        xp = kernels.xp
        nbins = num_bins(numel)
        summed = kernels.fft.sum_spectra(numel)
        total = spec = None
        # A corrupt payload decodes to garbage until the batch reads its checks, which
        # raise then: NumPy's warnings about that garbage would come first.
        with np.errstate(over="ignore", invalid="ignore"):
            for p in payloads:
                if spec is None or not summed:
                    spec = xp.zeros(2 * nbins, dtype=np.float32)
                self._add_flat(kernels, p, numel, spec)
                if not summed:
                    out = self._inverse(kernels, spec, numel)
                    total = out if total is None else total + out
            return self._inverse(kernels, spec, numel) if summed else total

    def decode_flat(self, payload, numel: int) -> np.ndarray:
        """``GatherCodecBase.decode_flat``: on a device, ``decode_gathered``'s checks of
        one payload, read with the caller's batch; on the host, ``decode``'s."""
        kernels = backend_of(payload, self.kernels)
        if getattr(kernels, "device", None) is None or numel == 0:
            return self.decode(payload, numel=numel).reshape(-1)
        spec = kernels.xp.zeros(2 * num_bins(numel), dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # garbage until checks raise
            self._add_flat(kernels, payload, numel, spec)
            return self._inverse(kernels, spec, numel)

    def _add_flat(self, kernels, payload, n: int, spec) -> None:
        """Add the kept frequencies of ``payload``, of a flat array of ``n`` elements, to
        ``spec`` on its device, its checks registered with the caller's batch."""
        nbins = num_bins(n)
        nmap = (nbins + 7) // 8
        ncodes = payload.size - _wire.header_size(1) - BODY_FIXED - nmap
        if not 0 <= ncodes <= (2 * nbins * 16 + 7) // 8:  # no body of n elements
            self._spectrum(payload, n, spec)
            return
        body = _wire.unpack_flat(self.name, payload, n, kernels=self.kernels)
        xp, fk = kernels.xp, kernels.fft
        fixed = body[:BODY_FIXED]
        got = read(kernels.device, fixed, "fft payload: body fields")
        when(got, lambda host: _check_fields(host, n, body.size))
        fixed = fixed.copy()  # aligned for the views below
        m = fixed[4:5].astype(np.int64)
        shift = xp.clip(_k.MAX_MANTISSA - m, 0, _k.MAX_MANTISSA)
        pbase = fixed[0:4].view("<u4").astype(np.int64) >> shift
        bits = fixed[5:6].astype(np.int64)
        kept = xp.minimum(fixed[8:16].view("<u8"), np.uint64(nbins)).astype(np.int64)
        dense = xp.empty(2 * nbins, dtype=np.float32)
        bitmap = body[BODY_FIXED : BODY_FIXED + nmap]
        codes = body[BODY_FIXED + nmap :]
        err = fk.unpack_dequantize(codes, pbase, shift, bits, dense.view(np.uint32), count=2 * kept)
        when(err, _refuse_codes)
        when(fk.scatter(bitmap, dense, kept, spec), _refuse_bitmap)

    @staticmethod
    def _inverse(kernels, spec: np.ndarray, n: int) -> np.ndarray:
        """Return the flat float32 inverse transform of ``spec`` (on backend ``kernels``),
        refusing overflow."""
        if n == 0:
            return kernels.xp.zeros(0, dtype=np.float32)
        out = kernels.fft.irfft(spec, n)
        # Finite codes can still sum past float32's range in the inverse transform;
        # no encoder makes such a payload, so it is refused rather than returned as Inf.
        when(kernels.fft.all_finite(out), _refuse_overflow)
        return out


def _fixed_bytes(eps_bits: int, m: int, bits: int, kept: int) -> np.ndarray:
    """Return the body's fixed part (eps's bits, m, N, reserved 0, k) on the host."""
    return np.frombuffer(_BODY.pack(eps_bits, m, bits, 0, kept), dtype=np.uint8).copy()


def _check_fields(fixed, n: int, size: int) -> tuple[int, int, int, int]:
    """Return (pbase, shift, bits, k) of a body's fixed part ``fixed`` (on the host), for a
    body of ``size`` bytes of ``n`` elements.

    Raises:
        PayloadError: the fields are invalid or do not match the body's size.
    """
    eps_bits, m, bits, reserved, kept = _BODY.unpack_from(np.asarray(fixed, np.uint8), 0)
    nbins = num_bins(n)
    if not 4 <= bits <= 16 or m > _k.MAX_MANTISSA or reserved != 0:
        raise PayloadError(f"fft payload holds bits={bits}, m={m}, reserved={reserved}")
    if kept > nbins or size != body_size(n, kept, bits):
        raise PayloadError(
            f"fft payload holds k={kept} of {nbins} frequencies with N={bits} in a "
            f"{size}-byte body; expected {body_size(n, min(kept, nbins), bits)} bytes"
        )
    shift = _k.MAX_MANTISSA - m
    pbase = eps_bits >> shift
    if eps_bits >= 0x7F800000 or pbase == 0 or (pbase << shift) != eps_bits:
        raise PayloadError(f"fft payload range eps={eps_bits:#010x} is invalid for m={m}")
    return pbase, shift, bits, kept


def _refuse_codes(err: int) -> None:
    if err != _k.DECODE_OK:
        raise PayloadError(f"fft payload codes are invalid: {_DECODE_ERRORS[err]}")


def _refuse_bitmap(err: int) -> None:
    if err != _k.DECODE_OK:
        raise PayloadError(f"fft payload bitmap is invalid: {_DECODE_ERRORS[err]}")


def _refuse_overflow(finite: bool) -> None:
    if not finite:
        raise PayloadError("fft payload decodes to values beyond float32's range")


def _refuse_fp16(err: int) -> None:
    if err == _k.FP16_NONFINITE:
        raise ValueError("fft: input holds NaN or Inf")
    if err == _k.FP16_OVERFLOW:
        raise Unencodable("fft: a value overflows float16 (|x| > 65504); use fp16=False", FLOAT16)


# NaN/Inf in x fail these too: a caller that must tell them apart checks x (the
# reduction's encode does).
def _refuse_spectrum(ok: bool) -> None:
    if not ok:
        message = "fft: input holds NaN or Inf (or its spectrum overflows float32)"
        raise Unencodable(message, SPECTRUM)


def _refuse_residual_sum(ok: bool) -> None:
    if not ok:
        raise Unencodable("fft: the spectrum of x + residual holds NaN or Inf", KEPT)


_DECODE_ERRORS = {
    _k.DECODE_NEGATIVE_ZERO: "a sign bit on a zero magnitude",
    _k.DECODE_OVERFLOW: "a code decodes beyond float32's range",
    _k.DECODE_PADDING: "nonzero padding bits",
    _k.DECODE_COUNT: "its popcount differs from k",
}
