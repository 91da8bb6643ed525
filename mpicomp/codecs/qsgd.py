"""QSGD-MaxNorm and its relatives (the unbiased quantizers paper §3.1-3.4): summable integer codes.

Every rank quantizes its gradient against shared norms into integer codes in
[-bound, bound]; a ring reduce sums the codes exactly and ``dequantize`` turns the sum
back into the average gradient. The norms are per block of ``block`` consecutive
elements (``_qsgd_blocks``): each rank's L2 norm of each block, their elementwise max
over ranks by a MaxAllReduce (``block=0``: one norm per tensor, the paper's ‖w‖).
The multi-scale variants also share one scale index per coordinate (the elementwise
MIN over ranks of ``scale_index``); the GlobalRandK variants quantize only K
coordinates drawn from (seed, step), the same on every rank. There is no payload:
these codecs are ``aggregation = "integer_sum"``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from mpicomp.codecs._base import Codec, check_number, register
from mpicomp.codecs._qsgd_blocks import Blocks, Cuts, member_sizes
from mpicomp.codecs.arrays import (
    NORM,
    Unencodable,
    all_finite,
    array_module,
    as_gradient,
    is_array,
)
from mpicomp.kernels import backend_of, place
from mpicomp.kernels import qsgd as _k
from mpicomp.kernels.readback import when
from mpicomp.kernels.rng import key as _rng_key

DEFAULT_K = 10000  # the paper's K for all its GlobalRandK experiments (§5)
DEFAULT_BLOCK = 128  # elements per norm (docs/codecs.md, "Block norms": the measurement)
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


def _span_of(name: str, span, numel: int) -> tuple[int, int]:
    """Return ``span`` as (a, b), checking it is a pair with 0 <= a <= b <= numel."""
    if isinstance(span, (str, bytes)) or not hasattr(span, "__len__") or len(span) != 2:
        raise TypeError(f"{name} must be a pair (start, stop), got {span!r}")
    a = check_number(name, span[0], 0, numel, integer=True)
    return a, check_number(name, span[1], a, numel, integer=True)


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


def _is_one(norm) -> bool:
    """Whether ``norm`` is one number for every block (not an array of block norms)."""
    return not is_array(norm) or (isinstance(norm, np.ndarray) and norm.size == 1)


def _norm_array(norm, count: int):
    """Return block norms ``norm`` as a flat float32 array, checking its length (and, on
    the host, its values: the kernels refuse a bad one on a device, ERR_NORM)."""
    if norm.ndim != 1 or norm.size != count:
        raise ValueError(
            f"norm holds {norm.size} values in shape {norm.shape}; this x has {count} blocks "
            "(one norm per block, or one number for all)"
        )
    if norm.dtype.kind not in "fiu":
        raise TypeError(f"norm must be a numeric array, got dtype {norm.dtype}")
    if isinstance(norm, np.ndarray):
        wide = norm.astype(np.float64)
        if not np.all((wide >= 0.0) & (wide <= _F32_MAX)):  # also False for NaN
            raise ValueError("norm must hold finite float32 numbers >= 0, one per block")
    return norm.astype(np.float32, copy=False)


def _raise(err: int, values: np.ndarray, norm) -> None:
    """Turn a kernel error mask into the ValueError that says what went wrong."""
    if err & _k.ERR_NORM:
        raise ValueError("norm must hold finite float32 numbers >= 0, one per block")
    if err & _k.ERR_OVERFLOW:
        raise Unencodable("the norm of a block of x overflows float32", NORM)
    if err & _k.ERR_VALUE:
        if not all_finite(values):
            raise ValueError("x holds NaN or Inf")
        if _is_one(norm):
            raise ValueError(
                f"norm {float(_norm(norm))!r} is below max|x|: it must bound every |x| (1e-6 slack)"
            )
        raise ValueError(
            "a block's norm is below max|x| in its block: each must bound every |x| of its "
            "block (1e-6 slack)"
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


def _check(err, values, norm) -> None:
    """Raise what kernel error mask ``err`` says (``values()``: what was coded, for the
    message): now, or when the read batch holding ``err`` closes."""
    when(err, lambda e: _raise(e, values(), norm) if e else None)


def _sumsq_norm(kernels, flat: np.ndarray, idx: np.ndarray | None) -> float:
    dense = idx is None
    ss = kernels.qsgd.sumsq(flat, _NO_INDEX if dense else idx, dense)
    if not math.isfinite(ss):
        raise ValueError("x holds NaN or Inf")
    norm = math.sqrt(ss)
    if norm > _F32_MAX:  # no finite float32 norm bounds x
        raise Unencodable(f"the norm of x, {norm:.6g}, overflows float32", NORM)
    return float(np.float32(norm))


def _check_block(block) -> int:
    if block is None:
        return 0
    return check_number("block", block, 0, None, integer=True)


def _check_per_tensor(per_tensor) -> bool:
    if not isinstance(per_tensor, (bool, np.bool_)):
        raise ValueError(f"per_tensor must be True or False, got {per_tensor!r}")
    return bool(per_tensor)


class _Coded(NamedTuple):
    """One input as the kernels take it: ``flat`` x on the device of ``kernels``, the
    ``index`` of its codes (``dense``: all of x, in order), their number ``n``, and the
    (norms, starts, regular) of their blocks."""

    flat: object
    kernels: object
    index: object
    dense: bool
    n: int
    blocks: tuple

    def values(self):
        """Return the values the codes are of (for error messages)."""
        return self.flat if self.dense else self.flat[self.index]


class _MaxNorm(Codec):
    """What the four codecs share: ``bits``, ``block``, ``per_tensor``, ``seed``, levels,
    the code dtype, and the blocks that share a norm.

    The coded vector of x (``numel`` elements) is x itself, or GlobalRandK's
    x[coordinates] (``_picks``); its blocks follow from ``shapes`` (the tensors x holds
    end to end) and ``step`` (which coordinates).
    """

    aggregation = "integer_sum"
    multiscale = False  # a ScaleIndexCodec (mpicomp.codecs._base)
    sparse = False  # a SparseCoordinatesCodec

    def _setup(self, bits, seed, block, per_tensor, **more):
        bits = check_number("bits", bits, 2, 16, integer=True)
        block = _check_block(block)
        per_tensor = _check_per_tensor(per_tensor)
        seed = check_number("seed", seed, 0, 2**64 - 1, integer=True)
        super().__init__(bits=bits, **more, block=block, per_tensor=per_tensor, seed=seed)
        self.levels = _levels(bits)
        self.bound = self.levels
        self.code_dtype = np.dtype(np.int8 if bits <= 8 else np.int16)
        self._cuts = Cuts()

    def _key(self, step, stream) -> np.uint64:
        step = _counter("step", step)
        stream = _counter("stream", stream, COORDINATE_STREAM - 1)
        return _rng_key(self.params["seed"], step, stream)

    def _limit(self, nranks) -> tuple[int, np.int64]:
        nranks = check_number("nranks", nranks, 1, None, integer=True)
        return nranks, np.int64(nranks * self.bound)

    def _picks(self, kernels, numel: int, step):
        """Return the coordinates the codes belong to; None: all of x, in order."""
        return None

    def _coded(self, numel: int) -> int:
        """Return how many codes x of ``numel`` elements has."""
        return numel

    def _segments(self, kernels, numel: int, shapes, step) -> tuple[int, ...]:
        """Return the sizes of the tensors the coded vector holds end to end: one unless
        ``per_tensor`` and ``shapes`` name several."""
        sizes = member_sizes(numel, shapes)
        if len(sizes) == 1 or not self.params["per_tensor"]:
            return (self._coded(numel),)
        idx = self._picks(kernels, numel, step)
        if idx is None:
            return sizes
        # The selected coordinates of each tensor (one host read on a device).
        ends = kernels.xp.asarray(np.cumsum(sizes, dtype=np.int64))
        at = kernels.to_host(kernels.xp.searchsorted(idx, ends), why="qsgd: picks per tensor")
        return tuple(int(c) for c in np.diff(at, prepend=0))

    def _blocks(self, kernels, numel: int, shapes, step) -> Blocks:
        """Return the blocks of the coded vector of x on ``kernels``' device."""
        segments = self._segments(kernels, numel, shapes, step)
        return self._cuts.on(kernels, segments, self.params["block"])

    def _against(self, kernels, norm, numel: int, shapes, step):
        """Return (float32 norms, their blocks) on ``kernels``' device: one block over all
        for one number, else ``norm`` as the norms of the codec's blocks."""
        if _is_one(norm):
            one = self._cuts.on(kernels, (self._coded(numel),), 0)
            return kernels.xp.full(1, _norm(norm), dtype=np.float32), one
        blocks = self._blocks(kernels, numel, shapes, step)
        return kernels.xp.asarray(_norm_array(norm, blocks.count)), blocks

    def _coded_input(self, x, norm, shapes, step) -> _Coded:
        """Return x as the kernels code it against ``norm`` (None: the codec's blocks)."""
        flat = _flat(x)
        k = backend_of(flat, self.kernels)
        idx = self._picks(k, flat.size, step)
        if norm is None:
            b = self._blocks(k, flat.size, shapes, step)
            blocks = (None, b.pieces, b.first)
        else:
            norms, b = self._against(k, norm, flat.size, shapes, step)
            blocks = (norms, b.starts, b.regular)
        if idx is None:
            return _Coded(flat, k, _NO_INDEX, True, flat.size, blocks)
        return _Coded(flat, k, idx, False, idx.size, blocks)

    def _local_norms(self, x, shapes, step=0):
        a = self._coded_input(x, None, shapes, step)
        _, pieces, first = a.blocks
        out = a.kernels.xp.empty(first.size - 1, dtype=np.float32)
        err = a.kernels.qsgd.block_norms(a.flat, a.index, a.dense, pieces, first, out)
        _check(err, a.values, out)
        return out

    def _host_blocks(self, numel: int, shapes, step=0) -> np.ndarray:
        numel = check_number("numel", numel, 0, None, integer=True)
        starts = np.array(self._blocks(self.kernels, numel, shapes, step).starts, np.int64)
        starts.flags.writeable = False
        return starts

    def _quantize(self, x, norm, key, shapes, step=0):
        a = self._coded_input(x, norm, shapes, step)
        out = a.kernels.xp.empty(a.n, dtype=self.code_dtype)
        args = (*a.blocks, self.levels, key, out)
        err = a.kernels.qsgd.quantize(a.flat, a.index, a.dense, *args)
        _check(err, a.values, norm)
        return out

    def _dequantize(
        self, launcher, sums, n, norm, nranks, numel, shapes, step, scaled=False, base=0
    ):
        """Return the n float32 ((sum * norm) / s) / nranks, norm each sum's block's, s the
        levels (``scaled``: the level of each sum's scale index), by the qsgd launcher of
        that name given the arguments ``sums`` before the norms (the first: where they are).
        Sum j is code ``base`` + j of the coded vector of a tensor of ``numel`` elements."""
        nranks, limit = self._limit(nranks)
        k = backend_of(sums[0], self.kernels)
        norms, b = self._against(k, norm, numel, shapes, step)
        out = k.xp.empty(n, dtype=np.float32)
        levels = self._scales_on(k) if scaled else self.levels
        args = (norms, b.starts, b.regular, levels, nranks, limit, out, base)
        err = getattr(k.qsgd, launcher)(*sums, *args)
        _check(err, lambda: out, norm)
        return out

    def _values(self, codes, norm, nranks, numel, shapes, step=0):
        """Return the float32 ((codes * norm) / s) / nranks, norm each code's block's."""
        args = (norm, nranks, numel, shapes, step)
        return self._dequantize("dequantize", (codes,), codes.size, *args)

    def _values_packed(self, data, n, width, offset, norm, nranks, numel, shapes, step=0):
        """As ``_values`` for the n code sums bit-packed in ``data``."""
        data, n, width, offset = _packed_sums(data, n, width, offset)
        args = (norm, nranks, numel, shapes, step)
        return self._dequantize("dequantize_packed", (data, width, offset), n, *args)

    def _span_codes(self, kernels, numel: int, a: int, b: int, step, codes):
        """Return (lo, hi, coordinates): the codes of elements a <= i < b are codes lo <= j
        < hi of the coded vector, at ``coordinates`` (None: x itself, lo = a and hi = b)."""
        return a, b, None

    def _span(
        self, data, width, offset, norm, sidx, numel, span, nranks, shapes, step=0, codes=None
    ):
        """Return elements a <= i < b (``span``) of the dequantized tensor of ``numel``
        elements from the packed sums of the codes among them alone; ``sidx``: the whole
        coded vector's scale indices (None: one scale)."""
        numel = check_number("numel", numel, 0, None, integer=True)
        a, b = _span_of("span", span, numel)
        k = backend_of(data, self.kernels) if is_array(data) else self.kernels
        lo, hi, where = self._span_codes(k, numel, a, b, step, codes)
        data, n, width, offset = _packed_sums(data, hi - lo, width, offset)
        args = (norm, nranks, numel, shapes, step)
        if sidx is None:
            vals = self._dequantize("dequantize_packed", (data, width, offset), n, *args, base=lo)
        else:
            sidx = _int_array(sidx, "scale_index", self._coded(numel), signed=False)[lo:hi]
            sums = (data, width, offset, sidx)
            launcher = "multiscale_dequantize_packed"
            vals = self._dequantize(launcher, sums, n, *args, scaled=True, base=lo)
        if where is None:
            return vals
        out = k.xp.zeros(b - a, dtype=np.float32)
        if n:  # scaled as _scatter scales the whole tensor: by numel / K
            k.qsgd.grandk_scatter(vals, where[lo:hi] - a, np.float32(numel / where.size), out)
        return out


class _Dense:
    """The norms of the dense codecs: of x, per block."""

    def local_norm(self, x) -> float:
        """Return the float32 ‖x‖₂ of this rank (float64 accumulation, fixed order): the
        paper's one norm.

        Raises:
            ValueError: ``x`` holds NaN/Inf, or its norm overflows float32.
        """
        flat = _flat(x)
        return _sumsq_norm(backend_of(flat, self.kernels), flat, None)

    def local_norms(self, x, shapes=None):
        """Return this rank's float32 L2 norm of each block of x (``blocks``), on x's device:
        what the ranks share, elementwise, by a MaxAllReduce.

        Args:
            x: this rank's gradient, any shape and float dtype.
            shapes: the shapes of the tensors x holds end to end (a fused bucket); None: x
                is one tensor. Blocks never cross a tensor's end unless ``per_tensor`` is
                False.

        Raises:
            ValueError: ``x`` holds NaN/Inf, a block's norm overflows float32, or
                ``shapes`` do not hold x.size elements.
        """
        return self._local_norms(x, shapes)

    def blocks(self, numel: int, shapes=None) -> np.ndarray:
        """Return the read-only int64 starts of the blocks of x of ``numel`` elements, and
        the end: block b is starts[b] <= i < starts[b + 1] (``local_norms`` gives one norm
        per block)."""
        return self._host_blocks(numel, shapes)


class _Multiscale:
    """The scale set of the multi-scale codecs (the unbiased quantizers paper §3.2)."""

    multiscale = True

    def _scales(self, bits, scales) -> tuple[int, ...]:
        bits = check_number("bits", bits, 2, 16, integer=True)
        if scales is None:
            scales = (bits, min(bits + 4, MAX_SCALE_BITS))  # the paper's pairs: (8, 12) ... (2, 6)
        if isinstance(scales, (str, bytes)) or not hasattr(scales, "__iter__"):
            raise TypeError(f"scales must be a sequence of bit widths, got {scales!r}")
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

    def _scale_index(self, x, norm, shapes, step=0) -> np.ndarray:
        a = self._coded_input(x, norm, shapes, step)
        out = a.kernels.xp.empty(a.n, dtype=np.uint8)
        args = (*a.blocks, self._scales_on(a.kernels), out)
        err = a.kernels.qsgd.multiscale_index(a.flat, a.index, a.dense, *args)
        _check(err, a.values, norm)
        return out

    def _ms_quantize(self, x, norm, scale_index, key, shapes, step=0) -> np.ndarray:
        a = self._coded_input(x, norm, shapes, step)
        sidx = _int_array(scale_index, "scale_index", a.n, signed=False)
        out = a.kernels.xp.empty(a.n, dtype=self.code_dtype)
        args = (*a.blocks, self._scales_on(a.kernels), sidx, key, out)
        err = a.kernels.qsgd.multiscale_quantize(a.flat, a.index, a.dense, *args)
        _check(err, a.values, norm)
        return out

    def _ms_values(self, code_sum, norm, scale_index, nranks, numel, shapes, step=0):
        n = self._coded(numel)
        codes = _int_array(code_sum, "code_sum", n, signed=True)
        sidx = _int_array(scale_index, "scale_index", n, signed=False)
        args = (norm, nranks, numel, shapes, step)
        return self._dequantize("multiscale_dequantize", (codes, sidx), n, *args, scaled=True)

    def _ms_values_packed(
        self, data, n, width, offset, norm, scale_index, nranks, numel, shapes, step=0
    ):
        data, n, width, offset = _packed_sums(data, n, width, offset)
        sidx = _int_array(scale_index, "scale_index", n, signed=False)
        sums = (data, width, offset, sidx)
        args = (norm, nranks, numel, shapes, step)
        return self._dequantize("multiscale_dequantize_packed", sums, n, *args, scaled=True)


class _GlobalRandK:
    """K coordinates per (seed, step), the same on every rank (the unbiased quantizers
    paper §3.3-3.4)."""

    sparse = True

    def _check_k(self, k):
        if isinstance(k, (float, np.floating)):
            if not (0.0 < k <= 1.0):
                raise ValueError(f"k must be a count >= 1 or a fraction in (0, 1], got {k!r}")
            return float(k)
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"k must be a count >= 1 or a fraction in (0, 1], got {k!r}")
        if k < 1:
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

    def _coded(self, numel: int) -> int:
        return self.num_coordinates(numel)

    def coordinates(self, numel: int, step: int = 0) -> np.ndarray:
        """Return the sorted int64 coordinates selected at ``step`` (read-only, cached).

        Floyd's algorithm on the counter-based RNG of (seed, step, COORDINATE_STREAM):
        every rank and every re-run draws the same set, a uniform K-subset. They are
        host arrays; a device gradient's are drawn on its device (the same values).
        """
        return self._picks(self.kernels, numel, step)

    def _picks(self, kernels, numel: int, step: int) -> np.ndarray:
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

    def _span_codes(self, kernels, numel: int, a: int, b: int, step, codes):
        picks = self._picks(kernels, numel, step)
        if codes is not None:
            return (*_span_of("codes", codes, picks.size), picks)
        # The codes of the coordinates in [a, b): one read of two numbers on a device.
        at = kernels.xp.searchsorted(picks, kernels.xp.asarray(np.array([a, b], np.int64)))
        lo, hi = (int(v) for v in kernels.to_host(at, why="qsgd: codes of a span"))
        return lo, hi, picks

    def local_norm(self, x, step: int = 0) -> float:
        """Return the float32 ‖x[coordinates]‖₂ of this rank (float64 accumulation): the
        paper's one norm.

        Raises:
            ValueError: a selected element is NaN/Inf, or the norm overflows float32.
        """
        flat = _flat(x)
        k = backend_of(flat, self.kernels)
        return _sumsq_norm(k, flat, self._picks(k, flat.size, step))

    def local_norms(self, x, step: int = 0, shapes=None):
        """Return this rank's float32 L2 norm of each block of x[coordinates] (``blocks``:
        blocks of the K selected values, in their order), on x's device.

        Raises:
            ValueError: a selected element is NaN/Inf, a block's norm overflows float32,
                or ``shapes`` do not hold x.size elements.
        """
        return self._local_norms(x, shapes, step)

    def blocks(self, numel: int, shapes=None, step: int = 0) -> np.ndarray:
        """Return the read-only int64 starts of the blocks of the K codes of a tensor of
        ``numel`` elements at ``step``, and the end (K)."""
        return self._host_blocks(numel, shapes, step)

    def _full(self, codes, shape, step, n=None) -> tuple:
        """Return (the kernels of ``codes``, the full tensor's shape and size, the
        coordinates the codes belong to), checking ``n`` codes are K when given."""
        k = backend_of(codes, self.kernels) if is_array(codes) else self.kernels
        if shape is None:
            raise ValueError("shape is required: the shape (or numel) of the full tensor")
        shape = _out_shape(shape, None)
        numel = math.prod(shape)
        idx = self._picks(k, numel, step)
        if n is not None and n != idx.size:
            raise ValueError(f"code_sum holds {n} elements, expected {idx.size}")
        return k, shape, numel, idx


def _scatter(kernels, vals, shape: tuple[int, ...], idx):
    """Return zeros of ``shape`` with vals * (n / K) at the coordinates ``idx``."""
    n = math.prod(shape)
    out = kernels.xp.zeros(n, dtype=np.float32)
    if idx.size:
        kernels.qsgd.grandk_scatter(vals, idx, np.float32(n / idx.size), out)
    return out.reshape(shape)


@register
class QSGDMaxNorm(_Dense, _MaxNorm):
    """QSGD-MaxNorm (the unbiased quantizers paper §3.1): r-bit stochastic codes against
    block norms, the max over ranks.

    Args:
        bits: r in [2, 16]; codes lie in [-s, s] with s = 2^(r-1) - 1 levels.
        block: elements per norm (blocks of x, the last of each tensor shorter), or 0 (or
            None) for one norm per tensor, the paper's.
        per_tensor: blocks restart at each tensor of a fused bucket (``shapes``); False
            cuts the bucket as one vector (``block=0``: one norm for the whole bucket).
        seed: seed of the counter-based rounding noise (with step and stream).
    """

    name = "qsgd_maxnorm"

    def __init__(self, bits=8, block=DEFAULT_BLOCK, per_tensor=True, seed=0):
        self._setup(bits, seed, block, per_tensor)

    def quantize(self, x, norm, step: int = 0, stream: int = 0, shapes=None) -> np.ndarray:
        """Return the codes of ``x`` (flattened, ``code_dtype``) against the shared norms.

        Args:
            x: this rank's gradient, any shape and float dtype.
            norm: the max over ranks of ``local_norms`` (one per block), or one number for
                every element (the paper's ‖w‖, e.g. from ``local_norm``); 0 gives zero codes.
            step: the training step; stream: this rank (independent rounding noise).
            shapes: the tensors x holds end to end, as for ``local_norms``.

        Raises:
            ValueError: NaN/Inf in ``x``, some |x| > its norm * (1 + 1e-6), or ``norm``
                not one finite float32 >= 0 per block.
        """
        return self._quantize(x, norm, self._key(step, stream), shapes)

    def dequantize(self, code_sum, norm, nranks: int = 1, shape=None, shapes=None) -> np.ndarray:
        """Return the float32 average ((code_sum * norm) / s) / nranks, reshaped to ``shape``.

        Raises:
            TypeError: ``code_sum`` is not a signed integer array.
            ValueError: wrong length for ``shape``, or |code_sum| > nranks * s.
        """
        n = code_sum.size if is_array(code_sum) else 0
        codes = _int_array(code_sum, "code_sum", n, signed=True)
        shape = _out_shape(shape, n)
        return self._values(codes, norm, nranks, n, shapes).reshape(shape)

    def dequantize_packed(
        self, data, n: int, width: int, offset: int, norm, nranks: int = 1, shape=None, shapes=None
    ) -> np.ndarray:
        """Return ``dequantize`` of the n code sums packed in ``data``, unpacking as it goes.

        Sum i is (the ``width``-bit code i of ``data``, LSB-first) - ``offset``: what
        ``ring_allreduce_bounded(..., packed=True)`` returns, as (data, n, width, offset).

        Raises:
            TypeError: ``data`` is not a 1-D uint8 array.
            ValueError: too few bytes, width outside 1..32, or |sum| > nranks * s.
        """
        shape = _out_shape(shape, n)
        out = self._values_packed(data, n, width, offset, norm, nranks, n, shapes)
        return out.reshape(shape)

    def dequantize_span(
        self, data, width: int, offset: int, norm, numel: int, span, nranks: int = 1, shapes=None
    ) -> np.ndarray:
        """Return elements a <= i < b (``span``) of ``dequantize_packed`` of a tensor of
        ``numel`` elements, from the packed sums of those elements alone (a reduce-scatter's
        row): sum j of ``data`` is element a + j's.

        ``norm`` and ``shapes`` are the whole tensor's: each element is found in its block by
        its index in the tensor, so the b - a float32 values have the whole tensor's bits.

        Raises:
            TypeError, ValueError: as ``dequantize_packed``; ``span`` not a pair with
                0 <= a <= b <= numel.
        """
        return self._span(data, width, offset, norm, None, numel, span, nranks, shapes)


@register
class QSGDMaxNormMultiscale(_Dense, _Multiscale, _MaxNorm):
    """QSGD-MaxNorm with several scales (the unbiased quantizers paper §3.2), shared by an
    elementwise MIN.

    Per coordinate the finest scale s_k in the set with |v| / norm * s_k <= s_min, so
    every code still fits in ``bits``. Index 0 is the coarsest scale (s_min) and
    indices grow with the scale, so the MIN over ranks is safe for every rank.

    Args:
        bits: r in [2, 16] of the coarsest scale, s_min = 2^(r-1) - 1: the code width.
        scales: bit widths b in [bits, 24] of the scale set (levels 2^(b-1) - 1 each);
            ``bits`` always belongs to it. Default (bits, bits + 4), as the paper's
            two-scale runs (8, 12), (6, 10), (4, 8), (2, 6).
        block, per_tensor: the blocks of the norms, as ``qsgd_maxnorm``'s.
        seed: seed of the counter-based rounding noise.
    """

    name = "qsgd_maxnorm_multiscale"

    def __init__(self, bits=8, scales=None, block=DEFAULT_BLOCK, per_tensor=True, seed=0):
        self._setup(bits, seed, block, per_tensor, scales=self._scales(bits, scales))
        self._init_scales()

    def scale_index(self, x, norm, shapes=None) -> np.ndarray:
        """Return this rank's uint8 scale index per element (MIN over ranks to share).

        Raises:
            ValueError: NaN/Inf in ``x``, or some |x| > its norm * (1 + 1e-6).
        """
        return self._scale_index(x, norm, shapes)

    def quantize(
        self, x, norm, scale_index, step: int = 0, stream: int = 0, shapes=None
    ) -> np.ndarray:
        """Return the codes of ``x`` at the shared scale indices, in [-s_min, s_min].

        Raises:
            ValueError: NaN/Inf in ``x``, |x| above the norm bound, or an index outside
                the set or finer than this rank's own choice.
        """
        return self._ms_quantize(x, norm, scale_index, self._key(step, stream), shapes)

    def dequantize(
        self, code_sum, norm, scale_index, nranks: int = 1, shape=None, shapes=None
    ) -> np.ndarray:
        """Return the float32 average ((code_sum * norm) / s_index) / nranks, reshaped.

        Raises:
            TypeError: ``code_sum``/``scale_index`` are not integer arrays.
            ValueError: wrong lengths, an index outside the set, |code_sum| > nranks * s_min.
        """
        n = code_sum.size if is_array(code_sum) else 0
        out = self._ms_values(code_sum, norm, scale_index, nranks, n, shapes)
        return out.reshape(_out_shape(shape, out.size))

    def dequantize_packed(
        self, data, n, width, offset, norm, scale_index, nranks=1, shape=None, shapes=None
    ) -> np.ndarray:
        """Return ``dequantize`` of the n code sums packed in ``data`` (see QSGDMaxNorm)."""
        shape = _out_shape(shape, n)
        args = (norm, scale_index, nranks, n, shapes)
        return self._ms_values_packed(data, n, width, offset, *args).reshape(shape)

    def dequantize_span(
        self, data, width, offset, norm, scale_index, numel, span, nranks=1, shapes=None
    ) -> np.ndarray:
        """Return elements a <= i < b (``span``) of ``dequantize_packed``, from the packed
        sums of those elements alone (see QSGDMaxNorm); ``scale_index`` is the whole tensor's."""
        args = (norm, scale_index, numel, span, nranks, shapes)
        return self._span(data, width, offset, *args)


@register
class GRandKMaxNorm(_GlobalRandK, _MaxNorm):
    """GlobalRandK-MaxNorm (the unbiased quantizers paper §3.3): QSGD-MaxNorm on K shared
    random coordinates.

    The quantized vector is the selected sub-vector, so the shared norms are the max over
    ranks of the norms of its blocks; ``dequantize`` scales by n / K, so the result is
    unbiased.

    Args:
        bits: r in [2, 16]; codes lie in [-s, s], s = 2^(r-1) - 1.
        k: an int K >= 1 (min(K, numel) coordinates) or a float fraction in (0, 1]
            (ceil(k * numel) coordinates). Default 10000, the paper's.
        block, per_tensor: the blocks of the norms, over the K selected values in order.
        seed: seed of the coordinates (stream 2^64 - 1) and of the rounding noise.
    """

    name = "grandk_maxnorm"

    def __init__(self, bits=8, k=DEFAULT_K, block=DEFAULT_BLOCK, per_tensor=True, seed=0):
        self._setup(bits, seed, block, per_tensor, k=self._check_k(k))
        self._coords = OrderedDict()

    def quantize(self, x, norm, step: int = 0, stream: int = 0, shapes=None) -> np.ndarray:
        """Return the K codes of x[coordinates(x.size, step)] against the shared norms.

        Raises:
            ValueError: a selected element is NaN/Inf or above its norm bound.
        """
        return self._quantize(x, norm, self._key(step, stream), shapes, step)

    def dequantize(
        self, code_sum, norm, nranks: int = 1, shape=None, step: int = 0, shapes=None
    ) -> np.ndarray:
        """Return the full float32 tensor: zeros, and (((c * norm) / s) / nranks) * (n / K) at the coordinates.

        Args:
            shape: the full tensor's shape (or numel); required.
            step: the step the codes were quantized at.

        Raises:
            ValueError: no shape, K codes expected, or |code_sum| > nranks * s.
        """
        k, shape, numel, idx = self._full(code_sum, shape, step)
        codes = _int_array(code_sum, "code_sum", idx.size, signed=True)
        vals = self._values(codes, norm, nranks, numel, shapes, step)
        return _scatter(k, vals, shape, idx)

    def dequantize_packed(
        self, data, n, width, offset, norm, nranks=1, shape=None, step=0, shapes=None
    ) -> np.ndarray:
        """Return ``dequantize`` of the K code sums packed in ``data`` (see QSGDMaxNorm)."""
        k, shape, numel, idx = self._full(data, shape, step, n)
        vals = self._values_packed(data, n, width, offset, norm, nranks, numel, shapes, step)
        return _scatter(k, vals, shape, idx)

    def dequantize_span(
        self,
        data,
        width,
        offset,
        norm,
        numel,
        span,
        nranks=1,
        step=0,
        shapes=None,
        codes=None,
    ) -> np.ndarray:
        """Return elements a <= i < b (``span``) of ``dequantize_packed`` of a tensor of
        ``numel`` elements: zeros, and the rescaled average at the coordinates in the span.

        ``data`` holds the packed sums of those coordinates' codes alone, in order: codes
        lo <= j < hi of the K, given as ``codes=(lo, hi)`` where the caller knows them (else
        found from the coordinates: a read of two numbers where they are on a device).

        Raises:
            TypeError, ValueError: as ``dequantize_packed``; ``span`` or ``codes`` not a
                pair within the tensor or the K codes.
        """
        args = (norm, None, numel, span, nranks, shapes, step, codes)
        return self._span(data, width, offset, *args)


@register
class GRandKMaxNormMultiscale(_GlobalRandK, _Multiscale, _MaxNorm):
    """GlobalRandK-MaxNorm multi-scale (the unbiased quantizers paper §3.4): §3.2's scales on
    K shared coordinates.

    Args:
        bits: r in [2, 16] of the coarsest scale (the code width).
        scales: bit widths in [bits, 24] of the scale set; default (bits, bits + 4).
        k: an int count >= 1 or a float fraction in (0, 1]; default 10000.
        block, per_tensor: the blocks of the norms, over the K selected values in order.
        seed: seed of the coordinates and of the rounding noise.
    """

    name = "grandk_maxnorm_multiscale"
    trains_adaptive = False  # under AdamW: docs/choosing.md

    def __init__(
        self, bits=8, scales=None, k=DEFAULT_K, block=DEFAULT_BLOCK, per_tensor=True, seed=0
    ):
        scales = self._scales(bits, scales)
        self._setup(bits, seed, block, per_tensor, scales=scales, k=self._check_k(k))
        self._init_scales()
        self._coords = OrderedDict()

    def scale_index(self, x, norm, step: int = 0, shapes=None) -> np.ndarray:
        """Return this rank's uint8 scale index for each of the K selected elements."""
        return self._scale_index(x, norm, shapes, step)

    def quantize(
        self, x, norm, scale_index, step: int = 0, stream: int = 0, shapes=None
    ) -> np.ndarray:
        """Return the K codes of the selected elements at the shared scale indices."""
        key = self._key(step, stream)
        return self._ms_quantize(x, norm, scale_index, key, shapes, step)

    def dequantize(
        self, code_sum, norm, scale_index, nranks: int = 1, shape=None, step: int = 0, shapes=None
    ) -> np.ndarray:
        """Return the full float32 tensor: zeros, and the rescaled average at the coordinates."""
        k, shape, numel, idx = self._full(code_sum, shape, step)
        vals = self._ms_values(code_sum, norm, scale_index, nranks, numel, shapes, step)
        return _scatter(k, vals, shape, idx)

    def dequantize_packed(
        self, data, n, width, offset, norm, scale_index, nranks=1, shape=None, step=0, shapes=None
    ) -> np.ndarray:
        """Return ``dequantize`` of the K code sums packed in ``data`` (see QSGDMaxNorm)."""
        k, shape, numel, idx = self._full(data, shape, step, n)
        args = (norm, scale_index, nranks, numel, shapes, step)
        return _scatter(k, self._ms_values_packed(data, n, width, offset, *args), shape, idx)

    def dequantize_span(
        self,
        data,
        width,
        offset,
        norm,
        scale_index,
        numel,
        span,
        nranks=1,
        step=0,
        shapes=None,
        codes=None,
    ) -> np.ndarray:
        """Return elements a <= i < b (``span``) of ``dequantize_packed`` (see
        GRandKMaxNorm); ``scale_index`` holds the K codes' indices."""
        args = (norm, scale_index, numel, span, nranks, shapes, step, codes)
        return self._span(data, width, offset, *args)
