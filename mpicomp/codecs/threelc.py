"""3LC (the 3LC paper §3): 3-value quantization with a sparsity multiplier, quartic encoding
(five trits per byte) and zero-run encoding, with error feedback fused into the encode pass.

Body after the common header (see docs/codecs.md, "threelc")::

    0  f32 (little-endian)  M = max|x| * sparsity
    4  u8 x m               quartic bytes, zero-run encoded when header flag bit 0 is set
"""

from __future__ import annotations

from functools import partial

import numpy as np

from mpicomp.codecs import _wire
from mpicomp.codecs._base import GatherCodecBase, check_number, register
from mpicomp.codecs.arrays import as_gradient, residual_view
from mpicomp.errors import PayloadError
from mpicomp.kernels import backend_of
from mpicomp.kernels import threelc as _k
from mpicomp.kernels.readback import batch, read, value_of, when
from mpicomp.kernels.threelc import quartic_length as _quartic_length

# Header flag bit 0: the quartic bytes are zero-run encoded.
FLAG_ZERO_RUN = 1
_SCALE_BYTES = 4


@register
class ThreeLC(GatherCodecBase):
    """3LC: trits in {-1, 0, 1} times one float32 scale M, five trits per byte.

    Args:
        sparsity: the sparsity multiplier s in [1, 2); M = max|x| * s, and a
            larger s maps more values to 0 (the 3LC paper §3.1). 1.0 keeps the
            largest magnitude exactly.
        zero_run: shorten runs of all-zero bytes (the 3LC paper §3.3); False leaves
            the fixed 1.6 bits per value of quartic encoding alone.

    Raises:
        ValueError: ``sparsity`` outside [1, 2) (after rounding to float32), or
            ``zero_run`` not a bool.
    """

    name = "threelc"
    trains_adaptive = False  # under AdamW: docs/choosing.md
    fused_feedback = True

    def __init__(self, sparsity: float = 1.0, zero_run: bool = True):
        sparsity = float(check_number("sparsity", sparsity, 1, 2, hi_open=True))
        # M is computed in float32: an s that rounds up to 2.0 there is out of range.
        if np.float32(sparsity) >= 2:
            raise ValueError(f"sparsity must be a number in [1, 2) (as float32), got {sparsity!r}")
        if not isinstance(zero_run, (bool, np.bool_)):
            raise ValueError(f"zero_run must be a bool, got {zero_run!r}")
        super().__init__(sparsity=sparsity, zero_run=bool(zero_run))
        self._sparsity = np.float32(sparsity)

    def encode(self, x, residual=None) -> np.ndarray:
        """Return the 3LC payload of ``x`` (plus ``residual``, which is updated in place).

        On a device M stays there (the kernels read it from the payload's body) and one
        read brings back what the host needs: the NaN/Inf check and the zero-run length
        (the checksum is written on the device).

        Args:
            x: a float array of any shape (float16/bfloat16/float64 are
                converted to float32 once).
            residual: None, or the error-feedback memory: a C-contiguous float32
                array of the shape of ``x``, on its device. ``x + residual`` is encoded and
                ``residual`` becomes ``(x + residual) - trit * M`` in the same pass.

        Raises:
            ValueError: ``x`` (or ``x + residual``) holds NaN or Inf (``residual`` is
                then unchanged), or ``residual`` does not match ``x``.
        """
        x = as_gradient(x)
        xp, k = self._launchers(x)
        flat = x.reshape(-1)
        use_r = residual is not None
        if use_r:
            r = residual_view(residual, x, "threelc")
        else:
            r = flat[:0]
        n_bytes = _quartic_length(flat.size)
        payload, body = _wire.empty(x.shape, _SCALE_BYTES + n_bytes, xp)
        scale, stream = body[:_SCALE_BYTES], body[_SCALE_BYTES:]
        flags = FLAG_ZERO_RUN if self.params["zero_run"] else 0
        with batch("threelc encode"):
            # M's bytes go straight into the body; a NaN/Inf leaves NaN there, on which
            # the quartic encode writes nothing (the residual is kept).
            _, ok = k.max(flat, r, use_r, self._sparsity, scale)
            when(ok, partial(_refuse_nonfinite, use_r))
            if flags:
                quartic = xp.empty(n_bytes, dtype=np.uint8)
                k.quartic_encode(flat, r, use_r, scale, quartic)
                # The zero-run output is never longer than its input: it fits the body.
                used = k.zero_run_encode(quartic, stream)
            else:
                k.quartic_encode(flat, r, use_r, scale, stream)
                used = n_bytes
        end = _wire.header_size(x.ndim) + _SCALE_BYTES + value_of(used)
        return _wire.seal(self.name, payload[:end], x.shape, flags, kernels=self.kernels)

    def decode(self, payload, numel: int | None = None) -> np.ndarray:
        """Return trit * M as a float32 array of the encoded shape.

        On a device only the header and the checksum are read here; the body's checks
        (M, the zero-run length, the quartic bytes, in that order) come back with the
        caller's ``readback.batch`` (at once without one) and raise then.

        Raises:
            PayloadError: the payload is truncated, corrupted, made by another
                codec, or its body is inconsistent with its shape.
        """
        shape, flags, body = _wire.unpack(
            self.name, payload, known_flags=FLAG_ZERO_RUN, numel=numel, kernels=self.kernels
        )
        return self._decode_body(body, shape, flags).reshape(shape)

    def decode_gathered(self, payloads, numel: int) -> np.ndarray:
        """Return the float32 sum of ``payloads``, each of a flat array of ``numel``
        elements made by this codec's parameters (what the collectives gather): nothing is
        read here; every header (known from the length), checksum, scale and length is
        checked on the device and read with the caller's ``readback.batch``
        (``_wire.unpack_flat``).

        Raises:
            PayloadError: a payload is corrupt, or of an array of another shape.
        """
        return self._sum_gathered(payloads, numel)

    def decode_flat(self, payload, numel: int) -> np.ndarray:
        """``GatherCodecBase.decode_flat``: the header compared on the device, every
        check read with the caller's batch."""
        return self._decode_flat(payload, numel)

    def _decode_flat(self, payload, numel: int) -> np.ndarray:
        flags = FLAG_ZERO_RUN if self.params["zero_run"] else 0
        n_bytes = _quartic_length(numel)
        size = payload.size - _wire.header_size(1) - _SCALE_BYTES
        if flags:
            # A zero-run stream is no longer than its quartic bytes, nor shorter than
            # 1 / MAX_RUN of them.
            fits = n_bytes <= _k.MAX_RUN * size and size <= n_bytes
        else:
            fits = size == n_bytes
        if not fits:  # not a flat tensor's payload: decode says what is wrong
            return self.decode(payload, numel=numel).reshape(-1)
        body = _wire.unpack_flat(self.name, payload, numel, flags=flags, kernels=self.kernels)
        return self._decode_body(body, (numel,), flags)

    def _decode_body(self, body, shape, flags: int) -> np.ndarray:
        """Return the flat decode of a body (of a payload of ``shape`` and ``flags``).

        The checks of what is on the device (M, the zero-run length, the quartic bytes)
        are registered with ``readback.when``, in that order; sizes from the shape are
        checked here, before anything of that size is allocated.
        """
        kernels = backend_of(body, self.kernels)
        xp, k = kernels.xp, kernels.threelc
        device = getattr(kernels, "device", None)
        n = _wire.numel_of(shape)
        n_bytes = _quartic_length(n)
        if body.size < _SCALE_BYTES:
            raise PayloadError(
                f"threelc payload body truncated: {body.size} bytes < {_SCALE_BYTES}-byte scale"
            )
        scale, stream = body[:_SCALE_BYTES], body[_SCALE_BYTES:]
        zero_run = bool(flags & FLAG_ZERO_RUN)
        expanded = partial(_check_expanded, n_bytes=n_bytes, shape=shape)
        # Each byte of a zero-run stream expands to at most MAX_RUN bytes: a body that
        # cannot fill the shape's (a tiny body of a huge shape) is refused before the
        # buffer is allocated, reading its length at once (the payload is corrupt anyway).
        if (stream.size * _k.MAX_RUN < n_bytes) if zero_run else (stream.size != n_bytes):
            with batch("threelc decode"):
                when(_read_scale(device, scale), _check_scale)
                if zero_run:
                    when(k.zero_run_length(stream, n_bytes), expanded)
            raise PayloadError(
                f"threelc payload has {stream.size} quartic bytes, shape {shape} needs {n_bytes}"
            )
        when(_read_scale(device, scale), _check_scale)
        if zero_run:
            quartic = xp.empty(n_bytes, dtype=np.uint8)
            when(k.zero_run_decode(stream, quartic), expanded)
        else:
            quartic = stream
        out = xp.empty(n, dtype=np.float32)
        when(k.quartic_decode(quartic, scale, out), _check_code)
        return out

    def _launchers(self, a):
        """Return the array module and the ``threelc`` launchers of ``a``'s backend."""
        k = backend_of(a, self.kernels)
        return k.xp, k.threelc


def _refuse_nonfinite(use_r: bool, ok: bool) -> None:
    if not ok:
        what = "x + residual" if use_r else "x"
        raise ValueError(f"threelc cannot encode {what}: it contains NaN or Inf")


def _read_scale(device, scale):
    """Return M of the body's 4 bytes: at once, or later with the caller's batch."""
    return read(device, scale, "threelc decode: scale", lambda host: host.view("<f4")[0])


def _check_scale(scale) -> None:
    if not np.isfinite(scale) or np.signbit(scale):
        raise PayloadError(f"threelc payload scale M = {scale!r} is not finite and >= +0")


def _check_expanded(expanded: int, n_bytes: int, shape) -> None:
    if expanded != n_bytes:
        got = f"more than {n_bytes}" if expanded < 0 or expanded > n_bytes else str(expanded)
        raise PayloadError(
            f"threelc payload zero-run body expands to {got} bytes, shape {shape} needs {n_bytes}"
        )


def _check_code(code: int) -> None:
    if code == _k.ERR_BYTE:
        raise PayloadError("threelc payload holds a quartic byte above 242")
    if code == _k.ERR_PAD:
        raise PayloadError("threelc payload has a non-zero digit in a pad position")
    if code == _k.ERR_ZERO_SCALE:
        raise PayloadError("threelc payload has M = 0 but non-zero trits")
