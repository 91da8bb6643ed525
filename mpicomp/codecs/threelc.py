"""3LC (paper 001 §3): 3-value quantization with a sparsity multiplier, quartic encoding
(five trits per byte) and zero-run encoding, with error feedback fused into the encode pass.

Body after the common header (see docs/codecs.md, "threelc")::

    0  f32 (little-endian)  M = max|x| * sparsity
    4  u8 x m               quartic bytes, zero-run encoded when header flag bit 0 is set
"""

from __future__ import annotations

import numpy as np

from mpicomp._arrays import as_gradient, residual_view
from mpicomp.codecs import _wire
from mpicomp.codecs._base import GatherCodecBase, check_number, register
from mpicomp.errors import PayloadError
from mpicomp.kernels import backend_of
from mpicomp.kernels import threelc as _k
from mpicomp.kernels.threelc import quartic_length as _quartic_length

# Header flag bit 0: the quartic bytes are zero-run encoded.
FLAG_ZERO_RUN = 1
_SCALE_BYTES = 4


@register
class ThreeLC(GatherCodecBase):
    """3LC: trits in {-1, 0, 1} times one float32 scale M, five trits per byte.

    Args:
        sparsity: the sparsity multiplier s in [1, 2); M = max|x| * s, and a
            larger s maps more values to 0 (paper 001 §3.1). 1.0 keeps the
            largest magnitude exactly.
        zero_run: shorten runs of all-zero bytes (paper 001 §3.3); False leaves
            the fixed 1.6 bits per value of quartic encoding alone.

    Raises:
        ValueError: ``sparsity`` outside [1, 2) (after rounding to float32), or
            ``zero_run`` not a bool.
    """

    name = "threelc"
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

        Args:
            x: a float array of any shape (float16/bfloat16/float64 are
                converted to float32 once).
            residual: None, or the error-feedback memory: a C-contiguous float32
                array of the shape of ``x``, on its device. ``x + residual`` is encoded and
                ``residual`` becomes ``(x + residual) - trit * M`` in the same pass.

        Raises:
            ValueError: ``x`` (or ``x + residual``) holds NaN or Inf, or
                ``residual`` does not match ``x``.
        """
        x = as_gradient(x)
        xp, k = self._launchers(x)
        flat = x.reshape(-1)
        use_r = residual is not None
        if use_r:
            r = residual_view(residual, x, "threelc")
        else:
            r = flat[:0]
        scale, ok = k.max(flat, r, use_r, self._sparsity)
        if not ok:
            what = "x + residual" if use_r else "x"
            raise ValueError(f"threelc cannot encode {what}: it contains NaN or Inf")
        scale = np.float32(scale)
        n_bytes = _quartic_length(flat.size)
        body = xp.empty(_SCALE_BYTES + n_bytes, dtype=np.uint8)
        body[:_SCALE_BYTES] = xp.asarray(np.array([scale], dtype="<f4").view(np.uint8))
        flags = 0
        if self.params["zero_run"]:
            quartic = xp.empty(n_bytes, dtype=np.uint8)
            k.quartic_encode(flat, r, use_r, scale, quartic)
            # The zero-run output is never longer than its input, so it fits in place.
            used = k.zero_run_encode(quartic, body[_SCALE_BYTES:])
            body = body[: _SCALE_BYTES + used]
            flags = FLAG_ZERO_RUN
        else:
            k.quartic_encode(flat, r, use_r, scale, body[_SCALE_BYTES:])
        return _wire.pack(self.name, x.shape, body, flags=flags, kernels=self.kernels)

    def decode(self, payload, numel: int | None = None) -> np.ndarray:
        """Return trit * M as a float32 array of the encoded shape.

        Raises:
            PayloadError: the payload is truncated, corrupted, made by another
                codec, or its body is inconsistent with its shape.
        """
        shape, flags, body = _wire.unpack(
            self.name, payload, known_flags=FLAG_ZERO_RUN, numel=numel, kernels=self.kernels
        )
        xp, k = self._launchers(body)
        n = _wire.numel_of(shape)
        n_bytes = _quartic_length(n)
        if body.size < _SCALE_BYTES:
            raise PayloadError(
                f"threelc payload body truncated: {body.size} bytes < {_SCALE_BYTES}-byte scale"
            )
        scale = (
            backend_of(body, self.kernels)
            .to_host(body[:_SCALE_BYTES], why="threelc decode: scale")
            .view("<f4")[0]
        )
        if not np.isfinite(scale) or np.signbit(scale):
            raise PayloadError(f"threelc payload scale M = {scale!r} is not finite and >= +0")
        stream = body[_SCALE_BYTES:]
        if flags & FLAG_ZERO_RUN:
            # Validate before allocating: the buffer size comes from the shape, and
            # the body must expand to exactly that many bytes.
            expanded = k.zero_run_length(stream, n_bytes)
            if expanded != n_bytes:
                got = f"more than {n_bytes}" if expanded < 0 else str(expanded)
                raise PayloadError(
                    f"threelc payload zero-run body expands to {got} bytes, "
                    f"shape {shape} needs {n_bytes}"
                )
            quartic = xp.empty(n_bytes, dtype=np.uint8)
            if not k.zero_run_decode(stream, quartic):
                raise PayloadError("threelc payload zero-run body is inconsistent")
        else:
            if stream.size != n_bytes:
                raise PayloadError(
                    f"threelc payload has {stream.size} quartic bytes, shape {shape} needs {n_bytes}"
                )
            quartic = stream
        out = xp.empty(n, dtype=np.float32)
        code = k.quartic_decode(quartic, scale, out)
        if code == _k.ERR_BYTE:
            raise PayloadError("threelc payload holds a quartic byte above 242")
        if code == _k.ERR_PAD:
            raise PayloadError("threelc payload has a non-zero digit in a pad position")
        if code == _k.ERR_ZERO_SCALE:
            raise PayloadError("threelc payload has M = 0 but non-zero trits")
        return out.reshape(shape)

    def _launchers(self, a):
        """Return the array module and the ``threelc`` launchers of ``a``'s backend."""
        k = backend_of(a, self.kernels)
        return k.xp, k.threelc
