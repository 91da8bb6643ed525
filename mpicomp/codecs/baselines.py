"""Baselines every comparison needs: no compression, float16, and top-k sparsification."""

from __future__ import annotations

import math

import numpy as np

from mpicomp._backend import as_gradient
from mpicomp.codecs import _wire
from mpicomp.codecs._base import Codec, check_number, register
from mpicomp.errors import PayloadError
from mpicomp.kernels.cpu import topk as _k
from mpicomp.kernels.cpu.checks import mpicomp_all_finite

_FP16_MAX = float(np.finfo(np.float16).max)


class _Dense(Codec):
    """A dense array on the wire, summed by MPI: ``wire_dtype`` says which."""

    aggregation = "sum"
    wire_dtype: np.dtype
    refuses_nonfinite = False  # `none` carries floats as they are, NaN included

    def __init__(self):
        super().__init__()

    def to_wire(self, x):
        """Return ``x`` as the array MPI sums."""
        return as_gradient(x).astype(self.wire_dtype, copy=False)

    def from_wire(self, total, nranks: int = 1, shape=None):
        """Return the float32 average over ``nranks`` of the summed wire array."""
        out = np.asarray(total).astype(np.float32) / np.float32(nranks)
        return out.reshape(shape) if shape is not None else out

    def encode(self, x) -> np.ndarray:
        """Return the payload of ``x``: header + the wire values, little-endian."""
        x = as_gradient(x)
        wire = self.to_wire(x).astype(self.wire_dtype.newbyteorder("<"), copy=False)
        return _wire.pack(self.name, x.shape, wire.reshape(-1).view(np.uint8))

    def decode(self, payload, numel: int | None = None) -> np.ndarray:
        """Return the float32 array carried by ``payload``."""
        shape, _, body = _wire.unpack(self.name, payload, numel=numel)
        size = self.wire_dtype.itemsize
        if body.size != size * _wire.numel_of(shape):
            raise PayloadError(
                f"{self.name} payload body is {body.size} bytes, shape {shape} needs {size} per element"
            )
        out = body.view(self.wire_dtype.newbyteorder("<")).astype(np.float32).reshape(shape)
        if self.refuses_nonfinite and out.size and not mpicomp_all_finite(out.reshape(-1)):
            raise PayloadError(f"{self.name} payload holds NaN or Inf, which its encoder refuses")
        return out


@register
class NoCompression(_Dense):
    """float32 as it is: the baseline every ratio is measured against."""

    name = "none"
    wire_dtype = np.dtype(np.float32)


@register
class Float16(_Dense):
    """Round to float16 on the wire; a value beyond float16's range is an error, not an Inf."""

    name = "fp16"
    wire_dtype = np.dtype(np.float16)
    refuses_nonfinite = True

    def to_wire(self, x):
        """Return ``x`` rounded to float16.

        Raises:
            ValueError: ``x`` holds NaN/Inf, or a value float16 cannot hold (|x| > 65504).
        """
        x = as_gradient(x)
        amax = float(np.abs(x).max()) if x.size else 0.0
        if not math.isfinite(amax):
            raise ValueError("fp16: input holds NaN or Inf")
        if amax > _FP16_MAX:
            raise ValueError(
                f"fp16: max |x| = {amax:.6g} overflows float16 (max {_FP16_MAX:g}); "
                "scale the gradient or use codec 'none'"
            )
        return x.astype(np.float16)


@register
class TopK(Codec):
    """Keep the k = ceil(ratio * n) largest magnitudes, as (index, value) pairs.

    Body: uint64 k, then k uint32 indices (uint64 when n > 2**32), strictly
    increasing, then k float32 values; all little-endian. Ties in magnitude keep
    the lower index (a stable sort), so every rank and re-run keeps the same set.
    """

    name = "topk"
    aggregation = "gather"

    def __init__(self, ratio: float = 0.01):
        ratio = check_number("ratio", ratio, 0.0, 1.0, lo_open=True)
        super().__init__(ratio=ratio)

    def kept(self, n: int) -> int:
        """Return how many of ``n`` elements are kept."""
        return min(n, math.ceil(self.params["ratio"] * n))

    @staticmethod
    def _index_dtype(n: int):
        return np.dtype("<u4") if n <= 1 << 32 else np.dtype("<u8")

    def encode(self, x) -> np.ndarray:
        """Return the payload of ``x``'s top-k entries.

        Raises:
            ValueError: ``x`` holds NaN or Inf.
        """
        x = as_gradient(x)
        flat = x.reshape(-1)
        n, k = flat.size, self.kept(flat.size)
        if n and not mpicomp_all_finite(flat):
            raise ValueError("topk: input holds NaN or Inf")
        if k == n:
            idx = np.arange(n, dtype=np.int64)
        else:
            # argpartition on -|x| picks a top-k set; its ties are arbitrary, so
            # re-select the boundary magnitude with a stable rule (lowest index first).
            mag = np.abs(flat)
            thresh = np.partition(mag, n - k)[n - k]
            above = np.flatnonzero(mag > thresh)
            at = np.flatnonzero(mag == thresh)[: k - above.size]
            idx = np.union1d(above, at)
        idt = self._index_dtype(n)
        body = np.empty(8 + k * (idt.itemsize + 4), dtype=np.uint8)
        body[:8] = np.array([k], dtype="<u8").view(np.uint8)
        body[8 : 8 + k * idt.itemsize] = idx.astype(idt).view(np.uint8)
        body[8 + k * idt.itemsize :] = flat[idx].astype("<f4").view(np.uint8)
        return _wire.pack(self.name, x.shape, body)

    def decode(self, payload, numel: int | None = None) -> np.ndarray:
        """Return the dense float32 array of ``payload`` (zeros where nothing was kept)."""
        shape, _, body = _wire.unpack(self.name, payload, numel=numel)
        n = _wire.numel_of(shape)
        if body.size < 8:
            raise PayloadError(f"topk payload body truncated: {body.size} bytes")
        k = int(body[:8].view("<u8")[0])
        idt = self._index_dtype(n)
        if k > n or body.size != 8 + k * (idt.itemsize + 4):
            raise PayloadError(f"topk payload holds k={k} for n={n} in a {body.size}-byte body")
        idx = body[8 : 8 + k * idt.itemsize].view(idt)
        vals = body[8 + k * idt.itemsize :].view("<f4")
        out = np.zeros(n, dtype=np.float32)
        err = _k.mpicomp_topk_scatter(idx, vals, n, out)
        if err == 1:
            raise PayloadError("topk payload indices are out of range or not increasing")
        if err == 2:
            raise PayloadError("topk payload holds a NaN or Inf value")
        return out.reshape(shape)
