"""Baselines every comparison needs: no compression, float16, and top-k sparsification."""

from __future__ import annotations

import math

import numpy as np

from mpicomp.codecs import _wire
from mpicomp.codecs._base import Codec, GatherCodecBase, check_number, register
from mpicomp.codecs.arrays import FLOAT16, Unencodable, array_module, as_gradient
from mpicomp.errors import PayloadError
from mpicomp.kernels import backend_of
from mpicomp.kernels.readback import batch, ignored, when

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

    def from_wire(self, total, nranks: int = 1, shape=None, reuse: bool = False):
        """Return the float32 average over ``nranks`` of the summed wire array; with
        ``reuse``, a float32 ``total`` the caller owns is divided in place (no second
        buffer of the tensor's size to allocate and fault in)."""
        xp = array_module(total)
        total = xp.asarray(total)
        if total.dtype != np.float32:
            total, reuse = total.astype(np.float32), True
        out = total if reuse else xp.empty(total.shape, np.float32)
        xp.divide(total, np.float32(nranks), out=out)  # one pass: no astype copy first
        return out.reshape(shape) if shape is not None else out

    def encode(self, x) -> np.ndarray:
        """Return the payload of ``x``: header + the wire values, little-endian."""
        x = as_gradient(x)
        wire = self.to_wire(x).astype(self.wire_dtype.newbyteorder("<"), copy=False)
        # pack copies the bytes and checksums them in one pass.
        return _wire.pack(self.name, x.shape, wire.reshape(-1).view(np.uint8), kernels=self.kernels)

    def decode(self, payload, numel: int | None = None) -> np.ndarray:
        """Return the float32 array carried by ``payload``."""
        # The checksum is summed in the pass that reads the body (verify below).
        shape, _, body = _wire.unpack(
            self.name, payload, numel=numel, verify=False, kernels=self.kernels
        )
        n = _wire.numel_of(shape)
        if body.size != self.wire_dtype.itemsize * n:
            raise PayloadError(
                f"{self.name} payload body is {body.size} bytes, shape {shape} needs "
                f"{self.wire_dtype.itemsize} per element"
            )
        out = backend_of(body, self.kernels).xp.empty(n, np.float32)
        when(self._read_body(body, out, payload), self._refuse_nonfinite)
        return out.reshape(shape)

    def _refuse_nonfinite(self, finite: bool) -> None:
        if not finite:
            raise PayloadError(f"{self.name} payload holds NaN or Inf, which its encoder refuses")

    def _read_body(self, body, out, payload) -> bool:
        """Fill float32 ``out`` from the validated-size ``body``, verify the payload's
        checksum on the way; return False if the codec refuses what it read."""
        adler32 = backend_of(body, self.kernels).checksum.adler32
        body_sum = adler32(body, 0, dst=out.view(np.uint8))
        _wire.verify(self.name, payload, body_sum, kernels=self.kernels)
        return True


@register
class NoCompression(_Dense):
    """float32 as it is: the baseline every ratio is measured against."""

    name = "none"
    wire_dtype = np.dtype(np.float32)
    compresses = False


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
        k = backend_of(x, self.kernels)
        out = k.xp.empty(x.shape, np.float16)
        ok, _ = k.fp16.encode(x.reshape(-1), out.reshape(-1).view(np.uint16))
        if not ok:
            self._check_range(x, k)
        return out

    def from_wire(self, total, nranks: int = 1, shape=None, reuse: bool = False):
        """Return the float32 average over ``nranks`` of the summed float16 array
        (``reuse``: as for ``none``, when ``total`` is float32)."""
        total = array_module(total).asarray(total)
        if total.dtype != np.float16:
            return super().from_wire(total, nranks, shape, reuse)  # any other dtype
        k = backend_of(total, self.kernels)
        out = k.xp.empty(total.shape, np.float32)
        with ignored():  # its NaN/Inf flag is not returned (the collectives check the sum)
            k.fp16.decode(total.reshape(-1).view(np.uint16), out.reshape(-1), nranks)
        return out.reshape(shape) if shape is not None else out

    def encode(self, x) -> np.ndarray:
        """Return the payload of ``x``: header + float16 values, little-endian.

        Raises:
            ValueError: as ``to_wire``.
        """
        x = as_gradient(x)
        k = backend_of(x, self.kernels)
        # One pass rounds into the payload, checks the range and sums the checksum.
        payload, body = _wire.empty(x.shape, 2 * x.size, k.xp)
        ok, body_sum = k.fp16.encode(x.reshape(-1), body.view(np.uint16), body)
        if not ok:
            self._check_range(x, k)
        return _wire.seal(self.name, payload, x.shape, body_sum=body_sum, kernels=self.kernels)

    def _read_body(self, body, out, payload) -> bool:
        k = backend_of(body, self.kernels)
        _wire.verify(self.name, payload, k.checksum.adler32(body, 0), kernels=self.kernels)
        return k.fp16.decode(body.view("<u2"), out)

    @staticmethod
    def _check_range(x, k) -> None:
        """Raise the ValueError that ``x`` (which float16 cannot hold, launchers ``k``) deserves."""
        amax = (
            float(k.to_host(k.xp.abs(x).max(), why="fp16 encode: max |x| of a refused input"))
            if x.size
            else 0.0
        )
        if not math.isfinite(amax):
            raise ValueError("fp16: input holds NaN or Inf")
        if amax > _FP16_MAX:
            raise Unencodable(
                f"fp16: max |x| = {amax:.6g} overflows float16 (max {_FP16_MAX:g}); "
                "scale the gradient or use codec 'none'",
                FLOAT16,
            )


@register
class TopK(GatherCodecBase):
    """Keep the k = ceil(ratio * n) largest magnitudes, as (index, value) pairs.

    Body: uint64 k, then k uint32 indices (uint64 when n > 2**32), strictly
    increasing, then k float32 values; all little-endian. Ties in magnitude keep
    the lower index (a stable sort), so every rank and re-run keeps the same set.
    """

    name = "topk"

    @property
    def trains_adaptive(self) -> bool:
        # Measured under AdamW: ratio 0.1 trains as float32 does, 0.01 barely (choosing.md)
        return self.params["ratio"] >= 0.1

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
        kernels = backend_of(x, self.kernels)
        flat = x.reshape(-1)
        n, k = flat.size, self.kept(flat.size)
        idt = self._index_dtype(n)
        # The body is written in place: k, then the indices, then the values.
        payload, body = _wire.empty(x.shape, 8 + k * (idt.itemsize + 4), kernels.xp)
        body[:8] = kernels.xp.asarray(np.array([k], dtype="<u8").view(np.uint8))
        idx = body[8 : 8 + k * idt.itemsize].view(idt)
        vals = body[8 + k * idt.itemsize :].view("<f4")
        # The NaN/Inf flag is read once, at the end (the checksum is written on the device).
        with batch("topk encode"):
            if k == n:
                if n and not kernels.topk.all_finite(flat):
                    raise ValueError("topk: input holds NaN or Inf")
                idx[:] = kernels.xp.arange(n, dtype=idt)
                vals[:] = flat
            else:
                when(kernels.topk.select(flat, k, idx, vals), _refuse_nonfinite)
            _wire.seal(self.name, payload, x.shape, kernels=self.kernels)
        return payload

    def decode(self, payload, numel: int | None = None) -> np.ndarray:
        """Return the dense float32 array of ``payload`` (zeros where nothing was kept)."""
        shape, _, body = _wire.unpack(self.name, payload, numel=numel, kernels=self.kernels)
        kernels = backend_of(body, self.kernels)
        n = _wire.numel_of(shape)
        if body.size < 8:
            raise PayloadError(f"topk payload body truncated: {body.size} bytes")
        k = int(kernels.to_host(body[:8], why="topk decode: k").view("<u8")[0])
        if k > n or body.size != self._body_size(n, k):
            raise PayloadError(f"topk payload holds k={k} for n={n} in a {body.size}-byte body")
        return self._scatter(body, n, k).reshape(shape)

    def decode_local(self, payload, shape) -> np.ndarray:
        """Return ``decode(payload)`` of a payload this process's ``encode`` just made of
        an array of ``shape``: trusted, its header is not read."""
        n = math.prod(shape)
        body = payload[_wire.header_size(len(shape)) :]
        with ignored():  # its flag is not needed: nothing to read
            return self._scatter(body, n, self.kept(n), checked=False).reshape(shape)

    def decode_gathered(self, payloads, numel: int) -> np.ndarray:
        """Return the float32 sum of ``payloads``, each of a flat array of ``numel``
        elements (what the collectives gather): k follows from a payload's length, and its
        header and checksum are compared on its device and read with the caller's
        ``readback.batch`` (``_wire.unpack_flat``), nothing in between.

        Raises:
            PayloadError: a payload is corrupt, or of an array of another shape.
        """
        return self._sum_gathered(payloads, numel)

    def decode_flat(self, payload, numel: int) -> np.ndarray:
        """``GatherCodecBase.decode_flat``: the header compared on the device, every
        check read with the caller's batch."""
        return self._decode_flat(payload, numel)

    def _decode_flat(self, payload, numel: int) -> np.ndarray:
        idt = self._index_dtype(numel)
        k, extra = divmod(payload.size - _wire.header_size(1) - 8, idt.itemsize + 4)
        if k < 0 or extra or k > numel:  # not a flat tensor's top-k: decode says what
            return self.decode(payload, numel=numel).reshape(-1)
        head = np.array([k], dtype="<u8").tobytes()
        body = _wire.unpack_flat(self.name, payload, numel, head, kernels=self.kernels)
        return self._scatter(body, numel, k)

    def _body_size(self, n: int, k: int) -> int:
        return 8 + k * (self._index_dtype(n).itemsize + 4)

    def _scatter(self, body, n: int, k: int, checked: bool = True) -> np.ndarray:
        """Return the dense float32 array of the k pairs of ``body`` (n elements)."""
        kernels = backend_of(body, self.kernels)
        idt = self._index_dtype(n)
        idx = body[8 : 8 + k * idt.itemsize].view(idt)
        vals = body[8 + k * idt.itemsize : 8 + k * (idt.itemsize + 4)].view("<f4")
        out = kernels.xp.zeros(n, dtype=np.float32)
        err = kernels.topk.scatter(idx, vals, n, out)
        if checked:
            when(err, _refuse_pairs)
        return out


def _refuse_nonfinite(ok: bool) -> None:
    if not ok:
        raise ValueError("topk: input holds NaN or Inf")


def _refuse_pairs(err: int) -> None:
    if err == 1:
        raise PayloadError("topk payload indices are out of range or not increasing")
    if err == 2:
        raise PayloadError("topk payload holds a NaN or Inf value")
