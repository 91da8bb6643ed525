"""QSGD-MaxNorm and its relatives (paper 000 §3.1-3.4): summable integer codes.

Every rank quantizes its gradient against a shared norm ‖w‖ (the max over ranks of
‖g‖₂, from a MaxAllReduce) into integer codes in [-bound, bound]; a ring reduce sums
the codes exactly and ``dequantize`` turns the sum back into the average gradient.
The multi-scale variants also share one scale index per coordinate (the elementwise
MIN over ranks of ``scale_index``); the GlobalRandK variants quantize only K
coordinates drawn from (seed, step), the same on every rank. There is no payload:
these codecs are ``aggregation = "integer_sum"``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from fractions import Fraction

import numpy as np

from mpicomp._arrays import all_finite, array_module, as_gradient, is_array
from mpicomp.codecs._base import Codec, check_number, register
from mpicomp.kernels import backend_of, place
from mpicomp.kernels import qsgd as _k
from mpicomp.kernels.rng import key as _rng_key

DEFAULT_K = 10000  # the paper's K for all its GlobalRandK experiments (§5)
MAX_SCALE_BITS = 24  # 2^(b-1) - 1 levels stay exact in float32 up to here
COORDINATE_STREAM = 2**64 - 1  # RNG stream of the GlobalRandK coordinates; ranks use 0, 1, ...
_NO_INDEX = np.empty(0, dtype=np.int64)
_F32_MAX = float(np.finfo(np.float32).max)
_CACHE = 8  # (numel, step) coordinate sets a GlobalRandK codec keeps ...
_CACHE_BYTES = 64 << 20  # ... within this many bytes (the newest is always kept)


def _levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def _flat(x) -> np.ndarray:
    """Return ``x`` as a flat contiguous float32 array (a view where possible)."""
    return as_gradient(x).reshape(-1)


def _norm(norm) -> np.float32:
    """Return the shared norm as float32, checking it is a finite number >= 0."""
    if isinstance(norm, np.ndarray) and norm.size == 1:
        norm = norm.reshape(-1)[0]
    if isinstance(norm, bool) or not isinstance(norm, (int, float, np.integer, np.floating)):
        raise TypeError(f"norm must be a number, got {type(norm).__name__}")
    try:
        value = float(norm)
    except OverflowError:
        value = math.inf
    if not (0.0 <= value <= _F32_MAX):  # also False for NaN
        raise ValueError(f"norm must be a finite float32 number >= 0, got {norm!r}")
    return np.float32(value)


def _counter(name: str, value, hi: int = 2**64 - 1) -> np.uint64:
    return np.uint64(check_number(name, value, 0, hi, integer=True))


def _int_array(a, name: str, n: int, signed: bool) -> np.ndarray:
    """Return ``a`` as a contiguous 1-D integer array of length ``n``."""
    if not is_array(a):
        raise TypeError(f"{name} must be an integer array, got {type(a).__name__}")
    kinds = "i" if signed else "iu"
    if a.dtype.kind not in kinds:
        what = "a signed integer" if signed else "an integer"
        raise TypeError(f"{name} must be {what} array, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size != n:
        raise ValueError(f"{name} holds {a.size} elements, expected {n}")
    return array_module(a).ascontiguousarray(a)


def _packed_sums(data, n: int, width: int, offset: int) -> tuple[np.ndarray, int, int, int]:
    """Check a bit-packed stream of n code sums (code i - ``offset``, ``width`` bits each)."""
    if not is_array(data) or data.dtype != np.uint8 or data.ndim != 1:
        raise TypeError("packed code sums must be a 1-D uint8 array")
    n = check_number("n", n, 0, None, integer=True)
    width = check_number("width", width, 1, 32, integer=True)
    offset = check_number("offset", offset, 0, 2**32 - 1, integer=True)
    if data.size < (n * width + 7) // 8:
        raise ValueError(f"{data.size} bytes cannot hold {n} code sums of {width} bits")
    return array_module(data).ascontiguousarray(data), n, width, offset


def _out_shape(shape, n: int | None) -> tuple[int, ...]:
    """Return ``shape`` as a tuple (``(n,)`` when None), checking it holds ``n`` elements."""
    if shape is None:
        return (n,)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
        raise ValueError(f"shape must be non-negative integers, got {shape!r}")
    numel = math.prod(int(d) for d in shape)
    if n is not None and numel != n:
        raise ValueError(f"shape {shape} holds {numel} elements, the codes {n}")
    return tuple(int(d) for d in shape)


def _raise(err: int, values: np.ndarray, norm) -> None:
    """Turn a kernel error mask into the ValueError that says what went wrong."""
    if err & _k.ERR_VALUE:
        if not all_finite(values):
            raise ValueError("x holds NaN or Inf")
        raise ValueError(
            f"norm {float(norm)!r} is below max|x|: it must bound every |x| (1e-6 slack)"
        )
    if err & _k.ERR_INDEX:
        raise ValueError("scale_index holds a value outside the scale set")
    if err & _k.ERR_UNSAFE:
        raise ValueError(
            "scale_index picks a scale too fine for some |x| / norm: pass the elementwise MIN "
            "over ranks of scale_index(x, norm) computed with this same norm"
        )
    if err & _k.ERR_RANGE:
        raise ValueError("code_sum holds a value beyond nranks * bound: wrong nranks or codes")


def _sumsq_norm(kernels, flat: np.ndarray, idx: np.ndarray | None) -> float:
    dense = idx is None
    ss = kernels.qsgd.sumsq(flat, _NO_INDEX if dense else idx, dense)
    if not math.isfinite(ss):
        raise ValueError("x holds NaN or Inf")
    norm = math.sqrt(ss)
    if norm > _F32_MAX:  # no finite float32 norm bounds x
        raise ValueError(f"the norm of x, {norm:.6g}, overflows float32")
    return float(np.float32(norm))


class _MaxNorm(Codec):
    """What the four codecs share: ``bits``, ``seed``, levels and the code dtype."""

    aggregation = "integer_sum"
    multiscale = False  # a ScaleIndexCodec (mpicomp.codecs._base)
    sparse = False  # a SparseCoordinatesCodec

    def _setup(self, bits, seed, **more):
        bits = check_number("bits", bits, 2, 16, integer=True)
        seed = check_number("seed", seed, 0, 2**64 - 1, integer=True)
        super().__init__(bits=bits, **more, seed=seed)
        self.levels = _levels(bits)
        self.bound = self.levels
        self.code_dtype = np.dtype(np.int8 if bits <= 8 else np.int16)

    def _key(self, step, stream) -> np.uint64:
        step = _counter("step", step)
        stream = _counter("stream", stream, COORDINATE_STREAM - 1)
        return _rng_key(self.params["seed"], step, stream)

    def _limit(self, nranks) -> tuple[int, np.int64]:
        nranks = check_number("nranks", nranks, 1, None, integer=True)
        return nranks, np.int64(nranks * self.bound)

    def _dequantize_packed(self, data, n, width, offset, norm, nranks) -> np.ndarray:
        norm = _norm(norm)
        data, n, width, offset = _packed_sums(data, n, width, offset)
        nranks, limit = self._limit(nranks)
        k = backend_of(data, self.kernels)
        out = k.xp.empty(n, dtype=np.float32)
        err = k.qsgd.dequantize_packed(data, width, offset, norm, self.levels, nranks, limit, out)
        if err:
            _raise(err, out, norm)
        return out


class _Multiscale:
    """The scale set of the multi-scale codecs (paper 000 §3.2)."""

    multiscale = True

    def _scales(self, bits, scales) -> tuple[int, ...]:
        bits = check_number("bits", bits, 2, 16, integer=True)
        if scales is None:
            scales = (bits, min(bits + 4, MAX_SCALE_BITS))  # the paper's pairs: (8, 12) ... (2, 6)
        if isinstance(scales, (str, bytes)) or not hasattr(scales, "__iter__"):
            raise ValueError(f"scales must be a sequence of bit widths, got {scales!r}")
        widths = {check_number("scales", b, bits, MAX_SCALE_BITS, integer=True) for b in scales}
        return tuple(sorted(widths | {bits}))

    def _init_scales(self) -> None:
        self.scale_levels = tuple(_levels(b) for b in self.params["scales"])
        self.n_scales = len(self.scale_levels)
        self.index_bits = (self.n_scales - 1).bit_length()
        self.index_dtype = np.dtype(np.uint8)
        self._scales = {}  # place (backend, GPU) -> the levels as float32, on that device

    def _scales_on(self, kernels):
        """Return the scale set's levels as a float32 array of ``kernels``' device."""
        at = place(kernels)
        scales = self._scales.get(at)
        if scales is None:
            host = np.array(self.scale_levels, dtype=np.float32)
            scales = self._scales[at] = kernels.xp.asarray(host)
        return scales

    def _scale_index(self, flat, idx, norm) -> np.ndarray:
        norm = _norm(norm)
        dense = idx is None
        k = backend_of(flat, self.kernels)
        out = k.xp.empty(flat.size if dense else idx.size, dtype=np.uint8)
        index = _NO_INDEX if dense else idx
        err = k.qsgd.multiscale_index(flat, index, dense, norm, self._scales_on(k), out)
        if err:
            _raise(err, flat if dense else flat[idx], norm)
        return out

    def _ms_quantize(self, flat, idx, norm, scale_index, key) -> np.ndarray:
        norm = _norm(norm)
        dense = idx is None
        n = flat.size if dense else idx.size
        sidx = _int_array(scale_index, "scale_index", n, signed=False)
        k = backend_of(flat, self.kernels)
        out = k.xp.empty(n, dtype=self.code_dtype)
        index = _NO_INDEX if dense else idx
        scales = self._scales_on(k)
        err = k.qsgd.multiscale_quantize(flat, index, dense, norm, scales, sidx, key, out)
        if err:
            _raise(err, flat if dense else flat[idx], norm)
        return out

    def _ms_dequantize(self, code_sum, norm, scale_index, nranks, n=None) -> np.ndarray:
        norm = _norm(norm)
        if n is None:
            n = code_sum.size if is_array(code_sum) else 0
        codes = _int_array(code_sum, "code_sum", n, signed=True)
        sidx = _int_array(scale_index, "scale_index", n, signed=False)
        nranks, limit = self._limit(nranks)
        k = backend_of(codes, self.kernels)
        out = k.xp.empty(n, dtype=np.float32)
        scales = self._scales_on(k)
        err = k.qsgd.multiscale_dequantize(codes, sidx, norm, scales, nranks, limit, out)
        if err:
            _raise(err, out, norm)
        return out

    def _ms_dequantize_packed(self, data, n, width, offset, norm, scale_index, nranks):
        norm = _norm(norm)
        data, n, width, offset = _packed_sums(data, n, width, offset)
        sidx = _int_array(scale_index, "scale_index", n, signed=False)
        nranks, limit = self._limit(nranks)
        k = backend_of(data, self.kernels)
        out = k.xp.empty(n, dtype=np.float32)
        args = (data, width, offset, sidx, norm, self._scales_on(k), nranks, limit, out)
        err = k.qsgd.multiscale_dequantize_packed(*args)
        if err:
            _raise(err, out, norm)
        return out


class _GlobalRandK:
    """K coordinates per (seed, step), the same on every rank (paper 000 §3.3-3.4)."""

    sparse = True

    def _check_k(self, k):
        if isinstance(k, (float, np.floating)):
            if not (0.0 < k <= 1.0):
                raise ValueError(f"k must be a count >= 1 or a fraction in (0, 1], got {k!r}")
            return float(k)
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a count >= 1 or a fraction in (0, 1], got {k!r}")
        return int(k)

    def num_coordinates(self, numel: int) -> int:
        """Return K for a tensor of ``numel`` elements: min(k, numel), or ceil(k * numel)."""
        numel = check_number("numel", numel, 0, None, integer=True)
        k = self.params["k"]
        if isinstance(k, float):
            # k as the decimal it was written as (repr is the shortest round-trip form), in
            # exact arithmetic: 0.1 * 5000 is 500 and 0.3 * 10 is 3, never one more
            return math.ceil(Fraction(repr(k)) * numel)
        return min(k, numel)

    def coordinates(self, numel: int, step: int = 0) -> np.ndarray:
        """Return the sorted int64 coordinates selected at ``step`` (read-only, cached).

        Floyd's algorithm on the counter-based RNG of (seed, step, COORDINATE_STREAM):
        every rank and every re-run draws the same set, a uniform K-subset. They are
        host arrays; a device gradient's are drawn on its device (the same values).
        """
        return self._coordinates(self.kernels, numel, step)

    def _coordinates(self, kernels, numel: int, step: int) -> np.ndarray:
        """Return ``coordinates(numel, step)`` as an array of backend ``kernels``."""
        k = self.num_coordinates(numel)
        step = _counter("step", step)
        at = (place(kernels), numel, int(step))
        hit = self._coords.get(at)
        if hit is not None:
            self._coords.move_to_end(at)
            return hit
        key = _rng_key(self.params["seed"], step, COORDINATE_STREAM)
        mask = kernels.xp.zeros(numel, dtype=np.uint8)
        picks = kernels.xp.empty(k, dtype=np.int64)
        kernels.qsgd.grandk_select(np.int64(numel), np.int64(k), key, mask, picks)
        if 256 * k < numel:  # few picks: sorting them beats scanning the mask
            kernels.qsgd.grandk_sort(picks)
        else:
            kernels.qsgd.grandk_compact(mask, picks)
        if isinstance(picks, np.ndarray):  # device arrays have no read-only flag
            picks.flags.writeable = False
        self._coords[at] = picks
        # local_norm, scale_index, quantize and dequantize of one step share a draw; keep
        # a few recent ones, within a memory budget, and always the newest
        while len(self._coords) > 1 and (
            len(self._coords) > _CACHE
            or sum(a.nbytes for a in self._coords.values()) > _CACHE_BYTES
        ):
            self._coords.popitem(last=False)
        return picks

    def local_norm(self, x, step: int = 0) -> float:
        """Return the float32 ‖x[coordinates]‖₂ of this rank (float64 accumulation).

        Raises:
            ValueError: a selected element is NaN/Inf, or the norm overflows float32.
        """
        flat = _flat(x)
        k = backend_of(flat, self.kernels)
        return _sumsq_norm(k, flat, self._coordinates(k, flat.size, step))

    def _full(self, shape, step, kernels) -> tuple[tuple[int, ...], np.ndarray]:
        """Return the full tensor's shape and the coordinates its codes belong to (on the
        device of ``kernels``)."""
        if shape is None:
            raise ValueError("shape is required: the shape (or numel) of the full tensor")
        shape = _out_shape(shape, None)
        return shape, self._coordinates(kernels, math.prod(shape), step)


def _scatter(kernels, vals, shape: tuple[int, ...], idx):
    """Return zeros of ``shape`` with vals * (n / K) at the coordinates ``idx``."""
    n = math.prod(shape)
    out = kernels.xp.zeros(n, dtype=np.float32)
    if idx.size:
        kernels.qsgd.grandk_scatter(vals, idx, np.float32(n / idx.size), out)
    return out.reshape(shape)


@register
class QSGDMaxNorm(_MaxNorm):
    """QSGD-MaxNorm (paper 000 §3.1): r-bit stochastic codes against the max norm over ranks.

    Args:
        bits: r in [2, 16]; codes lie in [-s, s] with s = 2^(r-1) - 1 levels.
        seed: seed of the counter-based rounding noise (with step and stream).
    """

    name = "qsgd_maxnorm"

    def __init__(self, bits: int = 8, seed: int = 0):
        self._setup(bits, seed)

    def local_norm(self, x) -> float:
        """Return the float32 ‖x‖₂ of this rank (float64 accumulation, fixed order).

        Raises:
            ValueError: ``x`` holds NaN/Inf, or its norm overflows float32.
        """
        flat = _flat(x)
        return _sumsq_norm(backend_of(flat, self.kernels), flat, None)

    def quantize(self, x, norm, step: int = 0, stream: int = 0) -> np.ndarray:
        """Return the codes of ``x`` (flattened, ``code_dtype``) against the shared ``norm``.

        Args:
            x: this rank's gradient, any shape and float dtype.
            norm: the max over ranks of ``local_norm``; 0 gives all-zero codes.
            step: the training step; stream: this rank (independent rounding noise).

        Raises:
            ValueError: NaN/Inf in ``x``, or some |x| > norm * (1 + 1e-6).
        """
        flat = _flat(x)
        norm = _norm(norm)
        k = backend_of(flat, self.kernels)
        out = k.xp.empty(flat.size, dtype=self.code_dtype)
        err = k.qsgd.quantize(
            flat, _NO_INDEX, True, norm, self.levels, self._key(step, stream), out
        )
        if err:
            _raise(err, flat, norm)
        return out

    def dequantize(self, code_sum, norm, nranks: int = 1, shape=None) -> np.ndarray:
        """Return the float32 average ((code_sum * norm) / s) / nranks, reshaped to ``shape``.

        Raises:
            TypeError: ``code_sum`` is not a signed integer array.
            ValueError: wrong length for ``shape``, or |code_sum| > nranks * s.
        """
        norm = _norm(norm)
        n = code_sum.size if is_array(code_sum) else 0
        codes = _int_array(code_sum, "code_sum", n, signed=True)
        shape = _out_shape(shape, n)
        nranks, limit = self._limit(nranks)
        k = backend_of(codes, self.kernels)
        out = k.xp.empty(n, dtype=np.float32)
        err = k.qsgd.dequantize(codes, norm, self.levels, nranks, limit, out)
        if err:
            _raise(err, out, norm)
        return out.reshape(shape)

    def dequantize_packed(
        self, data, n: int, width: int, offset: int, norm, nranks: int = 1, shape=None
    ) -> np.ndarray:
        """Return ``dequantize`` of the n code sums packed in ``data``, unpacking as it goes.

        Sum i is (the ``width``-bit code i of ``data``, LSB-first) - ``offset``: what
        ``ring_allreduce_bounded(..., packed=True)`` returns, as (data, n, width, offset).

        Raises:
            TypeError: ``data`` is not a 1-D uint8 array.
            ValueError: too few bytes, width outside 1..32, or |sum| > nranks * s.
        """
        shape = _out_shape(shape, n)
        return self._dequantize_packed(data, n, width, offset, norm, nranks).reshape(shape)


@register
class QSGDMaxNormMultiscale(_Multiscale, _MaxNorm):
    """QSGD-MaxNorm with several scales (paper 000 §3.2), shared by an elementwise MIN.

    Per coordinate the finest scale s_k in the set with |v| / norm * s_k <= s_min, so
    every code still fits in ``bits``. Index 0 is the coarsest scale (s_min) and
    indices grow with the scale, so the MIN over ranks is safe for every rank.

    Args:
        bits: r in [2, 16] of the coarsest scale, s_min = 2^(r-1) - 1: the code width.
        scales: bit widths b in [bits, 24] of the scale set (levels 2^(b-1) - 1 each);
            ``bits`` always belongs to it. Default (bits, bits + 4), as the paper's
            two-scale runs (8, 12), (6, 10), (4, 8), (2, 6).
        seed: seed of the counter-based rounding noise.
    """

    name = "qsgd_maxnorm_multiscale"

    def __init__(self, bits: int = 8, scales=None, seed: int = 0):
        self._setup(bits, seed, scales=self._scales(bits, scales))
        self._init_scales()

    def local_norm(self, x) -> float:
        """Return the float32 ‖x‖₂ of this rank (float64 accumulation, fixed order)."""
        flat = _flat(x)
        return _sumsq_norm(backend_of(flat, self.kernels), flat, None)

    def scale_index(self, x, norm) -> np.ndarray:
        """Return this rank's uint8 scale index per element (MIN over ranks to share).

        Raises:
            ValueError: NaN/Inf in ``x``, or some |x| > norm * (1 + 1e-6).
        """
        return self._scale_index(_flat(x), None, norm)

    def quantize(self, x, norm, scale_index, step: int = 0, stream: int = 0) -> np.ndarray:
        """Return the codes of ``x`` at the shared scale indices, in [-s_min, s_min].

        Raises:
            ValueError: NaN/Inf in ``x``, |x| above the norm bound, or an index outside
                the set or finer than this rank's own choice.
        """
        flat = _flat(x)
        return self._ms_quantize(flat, None, norm, scale_index, self._key(step, stream))

    def dequantize(self, code_sum, norm, scale_index, nranks: int = 1, shape=None) -> np.ndarray:
        """Return the float32 average ((code_sum * norm) / s_index) / nranks, reshaped.

        Raises:
            TypeError: ``code_sum``/``scale_index`` are not integer arrays.
            ValueError: wrong lengths, an index outside the set, |code_sum| > nranks * s_min.
        """
        out = self._ms_dequantize(code_sum, norm, scale_index, nranks)
        return out.reshape(_out_shape(shape, out.size))

    def dequantize_packed(
        self, data, n: int, width: int, offset: int, norm, scale_index, nranks: int = 1, shape=None
    ) -> np.ndarray:
        """Return ``dequantize`` of the n code sums packed in ``data`` (see QSGDMaxNorm)."""
        shape = _out_shape(shape, n)
        out = self._ms_dequantize_packed(data, n, width, offset, norm, scale_index, nranks)
        return out.reshape(shape)


@register
class GRandKMaxNorm(_GlobalRandK, _MaxNorm):
    """GlobalRandK-MaxNorm (paper 000 §3.3): QSGD-MaxNorm on K shared random coordinates.

    The quantized vector is the selected sub-vector, so the shared norm is the max over
    ranks of ‖x[coordinates]‖₂; ``dequantize`` scales by n / K, so the result is unbiased.

    Args:
        bits: r in [2, 16]; codes lie in [-s, s], s = 2^(r-1) - 1.
        k: an int K >= 1 (min(K, numel) coordinates) or a float fraction in (0, 1]
            (ceil(k * numel) coordinates). Default 10000, the paper's.
        seed: seed of the coordinates (stream 2^64 - 1) and of the rounding noise.
    """

    name = "grandk_maxnorm"

    def __init__(self, bits: int = 8, k=DEFAULT_K, seed: int = 0):
        self._setup(bits, seed, k=self._check_k(k))
        self._coords = OrderedDict()

    def quantize(self, x, norm, step: int = 0, stream: int = 0) -> np.ndarray:
        """Return the K codes of x[coordinates(x.size, step)] against the shared ``norm``.

        Raises:
            ValueError: a selected element is NaN/Inf or above the norm bound.
        """
        flat = _flat(x)
        norm = _norm(norm)
        k = backend_of(flat, self.kernels)
        idx = self._coordinates(k, flat.size, step)
        out = k.xp.empty(idx.size, dtype=self.code_dtype)
        err = k.qsgd.quantize(flat, idx, False, norm, self.levels, self._key(step, stream), out)
        if err:
            _raise(err, flat[idx], norm)
        return out

    def dequantize(self, code_sum, norm, nranks: int = 1, shape=None, step: int = 0) -> np.ndarray:
        """Return the full float32 tensor: zeros, and (((c * norm) / s) / nranks) * (n / K) at the coordinates.

        Args:
            shape: the full tensor's shape (or numel); required.
            step: the step the codes were quantized at.

        Raises:
            ValueError: no shape, K codes expected, or |code_sum| > nranks * s.
        """
        k = backend_of(code_sum, self.kernels) if is_array(code_sum) else self.kernels
        shape, idx = self._full(shape, step, k)
        norm = _norm(norm)
        codes = _int_array(code_sum, "code_sum", idx.size, signed=True)
        nranks, limit = self._limit(nranks)
        vals = k.xp.empty(idx.size, dtype=np.float32)
        err = k.qsgd.dequantize(codes, norm, self.levels, nranks, limit, vals)
        if err:
            _raise(err, vals, norm)
        return _scatter(k, vals, shape, idx)

    def dequantize_packed(
        self, data, n: int, width: int, offset: int, norm, nranks: int = 1, shape=None, step=0
    ) -> np.ndarray:
        """Return ``dequantize`` of the K code sums packed in ``data`` (see QSGDMaxNorm)."""
        k = backend_of(data, self.kernels) if is_array(data) else self.kernels
        shape, idx = self._full(shape, step, k)
        if n != idx.size:
            raise ValueError(f"code_sum holds {n} elements, expected {idx.size}")
        vals = self._dequantize_packed(data, n, width, offset, norm, nranks)
        return _scatter(k, vals, shape, idx)


@register
class GRandKMaxNormMultiscale(_GlobalRandK, _Multiscale, _MaxNorm):
    """GlobalRandK-MaxNorm multi-scale (paper 000 §3.4): §3.2's scales on K shared coordinates.

    Args:
        bits: r in [2, 16] of the coarsest scale (the code width).
        scales: bit widths in [bits, 24] of the scale set; default (bits, bits + 4).
        k: an int count >= 1 or a float fraction in (0, 1]; default 10000.
        seed: seed of the coordinates and of the rounding noise.
    """

    name = "grandk_maxnorm_multiscale"

    def __init__(self, bits: int = 8, scales=None, k=DEFAULT_K, seed: int = 0):
        self._setup(bits, seed, scales=self._scales(bits, scales), k=self._check_k(k))
        self._init_scales()
        self._coords = OrderedDict()

    def scale_index(self, x, norm, step: int = 0) -> np.ndarray:
        """Return this rank's uint8 scale index for each of the K selected elements."""
        flat = _flat(x)
        idx = self._coordinates(backend_of(flat, self.kernels), flat.size, step)
        return self._scale_index(flat, idx, norm)

    def quantize(self, x, norm, scale_index, step: int = 0, stream: int = 0) -> np.ndarray:
        """Return the K codes of the selected elements at the shared scale indices."""
        flat = _flat(x)
        idx = self._coordinates(backend_of(flat, self.kernels), flat.size, step)
        return self._ms_quantize(flat, idx, norm, scale_index, self._key(step, stream))

    def dequantize(
        self, code_sum, norm, scale_index, nranks: int = 1, shape=None, step: int = 0
    ) -> np.ndarray:
        """Return the full float32 tensor: zeros, and the rescaled average at the coordinates."""
        k = backend_of(code_sum, self.kernels) if is_array(code_sum) else self.kernels
        shape, idx = self._full(shape, step, k)
        vals = self._ms_dequantize(code_sum, norm, scale_index, nranks, idx.size)
        return _scatter(k, vals, shape, idx)

    def dequantize_packed(
        self,
        data,
        n: int,
        width: int,
        offset: int,
        norm,
        scale_index,
        nranks: int = 1,
        shape=None,
        step: int = 0,
    ) -> np.ndarray:
        """Return ``dequantize`` of the K code sums packed in ``data`` (see QSGDMaxNorm)."""
        k = backend_of(data, self.kernels) if is_array(data) else self.kernels
        shape, idx = self._full(shape, step, k)
        if n != idx.size:
            raise ValueError(f"code_sum holds {n} elements, expected {idx.size}")
        vals = self._ms_dequantize_packed(data, n, width, offset, norm, scale_index, nranks)
        return _scatter(k, vals, shape, idx)
