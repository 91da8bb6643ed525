"""FastSGD (the FastSGD paper §3): reciprocal mapper, logarithm quantization and threshold
filter for the values, adaptive delta-key binary encoding for the keys, applied per bucket.

Body after the common header (see docs/codecs.md, "fastsgd")::

    prefix (16 bytes)  f64 base | u32 bucket | u8 tau | u8 flag_bits | u16 reserved (0)
    per bucket         f32 sum | u32 d | u32 key_bytes | u8 W | d x u8 L code | key bit stream
"""

from __future__ import annotations

import math

import numpy as np

from mpicomp.codecs import _wire
from mpicomp.codecs._base import GatherCodecBase, check_number, register
from mpicomp.codecs.arrays import as_gradient
from mpicomp.errors import PayloadError
from mpicomp.kernels import backend_of, place
from mpicomp.kernels import fastsgd as _k
from mpicomp.kernels.readback import batch, ignored, read, value_of, when

# The largest base keeps sum / b^tau well inside float64 for every float32 sum.
MAX_BASE = 16.0
# Keeps about half of a dense gradient (docs/codecs.md, "fastsgd", has the table).
DEFAULT_BUCKET = 1 << 17
_PREFIX = np.dtype(
    [("base", "<f8"), ("bucket", "<u4"), ("tau", "u1"), ("flag_bits", "u1"), ("reserved", "<u2")]
)

_DECODE_ERRORS = {
    _k.ERR_TRUNCATED: "a bucket runs past the end of the body",
    _k.ERR_TRAILING: "bytes follow the last bucket",
    _k.ERR_SUM: "a bucket sum is negative, NaN or Inf, or 0 with values kept",
    _k.ERR_COUNT: "a bucket keeps more values than it holds",
    _k.ERR_WIDTH: "a bucket's key width W or key byte count is inconsistent",
    _k.ERR_CODE: "an L code exceeds tau",
    _k.ERR_KEY_BITS: "a key stream ends before its last key",
    _k.ERR_KEY_ORDER: "a key is outside its bucket or not strictly increasing",
    _k.ERR_KEY_FLAG: "a length flag is not the smallest one for its delta",
    _k.ERR_KEY_TAIL: "a key stream has extra bytes, non-zero padding, or the wrong W",
}


@register
class FastSGD(GatherCodecBase):
    """FastSGD: per bucket, sign and L = ceil(log_b(sum|v| / |v|)) in one byte for each
    |v| >= sum|v| / b^tau, keys as adaptive-width deltas.

    Decoding gives sign(v) * sum / b^L: never larger than |v|, and above |v| / b (up to
    float32 rounding). Dropped values decode to 0; the codec is biased, so pair it with
    ``ErrorFeedback``.

    Args:
        base: the logarithm base b in (1, 16]; the FastSGD paper §4.2 recommends about 1.1.
        tau: the threshold tau, an integer in [1, 127]: values below sum / b^tau are
            dropped and L <= tau fits 7 bits beside the sign. The paper's 128 does
            not fit its own byte; 127 is the nearest that does.
        flag_bits: the length-flag size l, an integer in [1, 5]; 2^l delta widths
            (the FastSGD paper Table VI recommends 2).
        bucket: elements per bucket, an integer in [0, 2**29]; each bucket has its
            own sum and key stream. 0 is one bucket for the whole tensor (the paper's
            exact algorithm), which keeps almost nothing of a large dense gradient,
            as the threshold grows with the bucket's sum. The default 2**17 keeps
            about half of a dense gradient.

    Raises:
        ValueError: a parameter outside its range.
    """

    name = "fastsgd"

    def __init__(
        self,
        base: float = 1.1,
        tau: int = 127,
        flag_bits: int = 2,
        bucket: int = DEFAULT_BUCKET,
    ):
        base = float(check_number("base", base, 1, MAX_BASE, lo_open=True))
        tau = check_number("tau", tau, 1, _k.MAX_TAU, integer=True)
        flag_bits = check_number("flag_bits", flag_bits, 1, _k.MAX_FLAG_BITS, integer=True)
        bucket = check_number("bucket", bucket, 0, _k.MAX_BUCKET, integer=True)
        super().__init__(base=base, tau=tau, flag_bits=flag_bits, bucket=bucket)
        self._powers = {}  # place (backend, GPU) -> b^L for L = 0..tau, on that device

    def encode(self, x) -> np.ndarray:
        """Return the FastSGD payload of ``x``.

        Args:
            x: a float array of any shape (float16/bfloat16/float64 are converted
                to float32 once).

        Raises:
            ValueError: ``x`` holds NaN or Inf, or ``bucket`` is 0 and ``x`` has
                more than 2**29 elements.
        """
        x = as_gradient(x)
        kernels = backend_of(x, self.kernels)
        xp, k = kernels.xp, kernels.fastsgd
        flat = x.reshape(-1)
        n = flat.size
        p = self.params
        bucket = self._bucket_length(p["bucket"], n)
        if bucket is None:
            raise ValueError(
                f"fastsgd with bucket=0 takes at most {_k.MAX_BUCKET} elements, got {n}; set bucket"
            )
        nbuckets = -(-n // bucket) if n else 0
        # Each bucket is encoded into its own slot of a scratch buffer sized for the worst
        # case (only the bytes written are touched), then the slots are packed in order.
        cap = _k.bucket_capacity(min(bucket, n), p["flag_bits"])
        scratch = xp.empty(nbuckets * cap, np.uint8)
        sizes = xp.empty(nbuckets, np.int64)
        powers = self._powers_on(kernels, p["base"], p["tau"])
        # The NaN/Inf flag and the body's length come back in one read.
        with batch("fastsgd encode"):
            ok = k.encode(flat, bucket, powers, p["flag_bits"], scratch, cap, sizes)
            when(ok, _refuse_nonfinite)
            # offsets[i] = PREFIX_BYTES + sizes[:i].sum(); its last entry ends the body.
            offsets = xp.empty(nbuckets + 1, np.int64)
            offsets[:1] = 0
            xp.cumsum(sizes, out=offsets[1:])
            offsets += _k.PREFIX_BYTES
            device = getattr(kernels, "device", None)
            end = read(device, offsets[-1:], "fastsgd encode: body length", _first_int)
        payload, body = _wire.empty(x.shape, value_of(end), xp)
        body[: _k.PREFIX_BYTES] = xp.asarray(self._prefix().view(np.uint8))
        k.assemble(scratch, cap, sizes, offsets[:-1], body)
        return _wire.seal(self.name, payload, x.shape, kernels=self.kernels)

    def decode(self, payload, numel: int | None = None) -> np.ndarray:
        """Return the float32 array of ``payload``: sign * sum / b^L where kept, 0 elsewhere.

        The base, tau, flag size and bucket come from the payload, so any FastSGD
        codec decodes any FastSGD payload.

        Raises:
            PayloadError: the payload is truncated, corrupted, made by another
                codec, or its body is inconsistent with its shape.
        """
        shape, n, scan = self._scan(payload, numel)
        out = scan[0].xp.empty(n, np.float32)  # every bucket zeroes its own slice
        self._scatter(scan, out, accumulate=False)
        return out.reshape(shape)

    def decode_sum(self, payloads, numel: int) -> np.ndarray:
        """Return the flat float32 sum of the arrays of ``payloads``, added in their order.

        Each payload's kept values are added where they belong (a scatter-add), so
        the sum is bit-identical to adding the decoded arrays one by one, without
        making them.

        Args:
            payloads: FastSGD payloads, each of ``numel`` elements (any shapes).
            numel: the element count every payload must have.

        Raises:
            PayloadError: a payload is truncated, corrupted, made by another codec,
                inconsistent, or not of ``numel`` elements (checked before anything
                is allocated).
        """
        scans = [self._scan(p, numel)[2] for p in payloads]
        out = (scans[0][0] if scans else self.kernels).xp.zeros(numel, np.float32)
        for scan in scans:
            self._scatter(scan, out, accumulate=True)
        return out

    def decode_local(self, payload, shape) -> np.ndarray:
        """Return ``decode(payload)`` of a payload this process's ``encode`` just made of
        an array of ``shape``: trusted, nothing of it is checked or read."""
        n = math.prod(shape)
        body = payload[_wire.header_size(len(shape)) :]
        kernels = backend_of(body, self.kernels)
        out = kernels.xp.empty(n, np.float32)
        with ignored():
            self._scatter(self._scan_own(kernels, body, n, checked=False), out, False, False)
        return out.reshape(shape)

    def decode_gathered(self, payloads, numel: int) -> np.ndarray:
        """Return ``decode_sum(payloads, numel)`` of payloads of flat arrays made with this
        codec's parameters (what the collectives gather: the parameters are agreed): each
        header and prefix is known from its length and compared on its device. Nothing is
        read here: the checksums, the bucket scans' errors and the decodes' errors are read
        with the caller's ``readback.batch`` (at once without one) and raise then, a
        payload's in that order. A scan that fails leaves the buckets it did not check
        empty, so the decode that runs before its error is read reads none of them.

        Raises:
            PayloadError: a payload is corrupt, or of another shape or parameters.
        """
        return self._sum_gathered(payloads, numel)

    def decode_flat(self, payload, numel: int) -> np.ndarray:
        """``GatherCodecBase.decode_flat``: the header and prefix compared on the device,
        the scan's and the decode's errors read with the caller's batch (a failed scan
        leaves the buckets it did not check empty, so the decode reads none of them)."""
        prefix = self._prefix().tobytes()
        body = _wire.unpack_flat(self.name, payload, numel, prefix, kernels=self.kernels)
        kernels = backend_of(body, self.kernels)
        out = kernels.xp.empty(numel, np.float32)  # every bucket writes its own slice
        self._scatter(self._scan_own(kernels, body, numel), out, accumulate=False)
        return out

    def _add_gathered(self, payload, total) -> None:
        """Add the values of a gathered ``payload`` into ``total`` (a scatter-add)."""
        prefix = self._prefix().tobytes()
        body = _wire.unpack_flat(self.name, payload, total.size, prefix, kernels=self.kernels)
        scan = self._scan_own(backend_of(body, self.kernels), body, total.size)
        self._scatter(scan, total, accumulate=True)

    def _scan_own(self, kernels, body, n: int, checked: bool = True):
        """``_scan`` of a body whose prefix holds this codec's parameters."""
        p = self.params
        bucket = self._bucket_length(p["bucket"], n)
        return self._scan_body(
            kernels, body, n, bucket, p["flag_bits"], p["base"], p["tau"], checked
        )

    def _scan(self, payload, numel):
        """Check ``payload``'s header, prefix and bucket headers (no allocation beyond a
        constant times its size); return (shape, n, what ``_scatter`` needs)."""
        shape, _, body = _wire.unpack(self.name, payload, numel=numel, kernels=self.kernels)
        kernels = backend_of(body, self.kernels)
        n = _wire.numel_of(shape)
        if body.size < _k.PREFIX_BYTES:
            raise PayloadError(
                f"fastsgd payload body truncated: {body.size} bytes < {_k.PREFIX_BYTES}-byte prefix"
            )
        pre = kernels.to_host(body[: _k.PREFIX_BYTES], why="fastsgd decode: prefix").view(_PREFIX)[
            0
        ]
        base, tau, flag_bits = float(pre["base"]), int(pre["tau"]), int(pre["flag_bits"])
        if not 1.0 < base <= MAX_BASE or not 1 <= tau <= _k.MAX_TAU:
            raise PayloadError(f"fastsgd payload has base={base!r}, tau={tau}: out of range")
        if not 1 <= flag_bits <= _k.MAX_FLAG_BITS or pre["reserved"] != 0:
            raise PayloadError(
                f"fastsgd payload prefix corrupted: flag_bits={flag_bits}, "
                f"reserved={int(pre['reserved'])}"
            )
        param = int(pre["bucket"])
        bucket = self._bucket_length(param, n) if param <= _k.MAX_BUCKET else None
        if bucket is None:
            raise PayloadError(f"fastsgd payload bucket {param} is impossible for shape {shape}")
        with batch("fastsgd scan"):  # its error, before anything is decoded
            return shape, n, self._scan_body(kernels, body, n, bucket, flag_bits, base, tau)

    def _scan_body(self, kernels, body, n, bucket, flag_bits, base, tau, checked=True):
        """Scan the bucket headers of ``body`` (its error checked with ``when`` unless not
        ``checked``); return what ``_scatter`` needs."""
        nbuckets = -(-n // bucket) if n else 0
        # Every bucket takes at least its header: bound the per-bucket arrays by the body.
        if nbuckets * _k.BUCKET_HEAD_BYTES > body.size - _k.PREFIX_BYTES:
            raise PayloadError(
                f"fastsgd payload body of {body.size} bytes cannot hold {nbuckets} buckets"
            )
        offsets = kernels.xp.empty(nbuckets + 1, np.int64)
        sums = kernels.xp.empty(nbuckets, np.uint32)
        err = kernels.fastsgd.scan(body, n, bucket, flag_bits, offsets, sums)
        if checked:
            when(err, _refuse_stream)
        powers = (
            self._powers_on(kernels, base, tau)
            if (base, tau) == (self.params["base"], self.params["tau"])
            else kernels.fastsgd.powers(base, tau)
        )
        return kernels, body, n, bucket, powers, flag_bits, offsets, sums

    @staticmethod
    def _scatter(scan, out, accumulate: bool, checked: bool = True) -> None:
        """Write (or add) the values of a ``_scan``ned payload into ``out``; PayloadError
        when its keys or codes are inconsistent (when the caller's batch reads them)."""
        kernels, body, n, bucket, powers, flag_bits, offsets, sums = scan
        errs = kernels.xp.zeros(sums.size, np.int64)
        kernels.fastsgd.decode(
            body, n, bucket, powers, flag_bits, offsets, sums, out, errs, accumulate
        )
        if checked:
            device = getattr(kernels, "device", None)
            when(read(device, errs, "fastsgd decode: corrupt buckets"), _refuse_buckets)

    def _powers_on(self, kernels, base: float, tau: int):
        """Return this codec's table b^L on ``kernels``' device, made at its first use."""
        at = place(kernels)
        table = self._powers.get(at)
        if table is None:
            table = self._powers[at] = kernels.fastsgd.powers(base, tau)
        return table

    def _prefix(self) -> np.ndarray:
        p = self.params
        return np.array([(p["base"], p["bucket"], p["tau"], p["flag_bits"], 0)], dtype=_PREFIX)

    @staticmethod
    def _bucket_length(param: int, n: int) -> int | None:
        """Return the elements per bucket for parameter ``param`` (None if n is too large)."""
        if param:
            return param
        if n > _k.MAX_BUCKET:
            return None
        return max(n, 1)


def _first_int(host) -> int:
    return int(host[0])


def _refuse_nonfinite(ok: bool) -> None:
    if not ok:
        raise ValueError("fastsgd cannot encode x: it contains NaN or Inf")


def _refuse_stream(err: int) -> None:
    if err:
        raise PayloadError(f"fastsgd payload is inconsistent: {_DECODE_ERRORS[err]}")


def _refuse_buckets(errs: np.ndarray) -> None:
    bad = np.flatnonzero(errs)
    if bad.size:
        k = int(bad[0])
        raise PayloadError(
            f"fastsgd payload is inconsistent in bucket {k}: {_DECODE_ERRORS[int(errs[k])]}"
        )
