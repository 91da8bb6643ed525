"""What every codec shares: the contract of each aggregation kind, parameter checks and
the registry behind ``mpicomp.codec``.

A codec's ``aggregation`` says how the collective layer combines what ranks send, and
which protocol below the codec implements (``PROTOCOLS``): ``CompressedComm`` picks its
reduction path from that kind alone. Codecs compute through the kernel backend record
``self.kernels`` (``mpicomp.kernels.backend()`` when the codec was made) for NumPy
arrays, and never import a backend's modules.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from mpicomp.kernels import backend, backend_of

_REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` reachable as ``mpicomp.codec(cls.name)``."""
    _REGISTRY[cls.name] = cls
    return cls


def check_number(
    name: str, value, lo=None, hi=None, *, integer=False, lo_open=False, hi_open=False
):
    """Return ``value`` if it is a number in the interval, else raise ValueError naming ``name``.

    ``lo``/``hi`` are inclusive unless ``lo_open``/``hi_open``.
    """
    kind = "an integer" if integer else "a number"
    lo_b = "(" if lo_open else "["
    hi_b = ")" if hi_open else "]"
    allowed = f"{lo_b}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{hi_b}"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        and not hasattr(value, "__index__")
    ):
        raise ValueError(f"{name} must be {kind} in {allowed}, got {value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name} must be {kind} in {allowed}, got {value!r}")
        value = int(value)
    elif not math.isfinite(float(value)):
        raise ValueError(f"{name} must be {kind} in {allowed}, got {value!r}")
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi:
        raise ValueError(f"{name} must be {kind} in {allowed}, got {value!r}")
    return value


class Codec:
    """Base of all codecs: a name, an aggregation kind and checked parameters.

    Subclasses set ``name`` and ``aggregation`` and check their parameters in
    ``__init__``; ``params`` holds the checked values (recorded in traces).

    ``aggregation`` tells the collective layer how payloads combine:
    ``"sum"`` (MPI sum of a float array), ``"integer_sum"`` (bounded integer
    codes, ring reduce), ``"majority"`` (sign votes, ring reduce) or
    ``"gather"`` (variable-length byte payloads, allgather).
    """

    name: ClassVar[str]
    aggregation: ClassVar[str]

    def __init__(self, **params):
        self.params = params
        # MPICOMP_KERNELS is read now: the backend of NumPy arrays for this codec's life.
        self.kernels = backend()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"mpicomp.codec({self.name!r}{', ' if args else ''}{args})"


class GatherCodecBase(Codec):
    """Base of the gather codecs: error feedback in ``encode`` off, and the plain
    ``decode_sum`` (decode each payload, add in order) for those without a faster one."""

    aggregation = "gather"
    fused_feedback: ClassVar[bool] = False
    #: ``decode_sum`` of N payloads costs about one ``decode`` (the schedule chooser's
    #: compute model; else N decodes).
    sums_before_decoding: ClassVar[bool] = False

    def decode_sum(self, payloads, numel: int):
        """Return the flat float32 sum of the decoded ``payloads``, added in their order.

        Raises:
            PayloadError: a payload is corrupt, or not of ``numel`` elements.
        """
        xp = self.kernels.xp if not payloads else backend_of(payloads[0], self.kernels).xp
        total = xp.zeros(numel, dtype=np.float32)
        for p in payloads:
            total += self.decode(p, numel=numel).reshape(-1)
        return total


# --- the contract of each aggregation kind ---------------------------------------------
# What the reduction paths (mpicomp/_reduce.py) call, kind by kind. A test checks every
# registered codec against the protocol of its kind (and the refinements its flags claim).


@runtime_checkable
class SumCodec(Protocol):
    """``aggregation = "sum"``: MPI sums the arrays ``to_wire`` makes (float32 or float16);
    ``from_wire`` turns the sum into the average."""

    name: str
    aggregation: str

    def to_wire(self, x) -> Any: ...

    def from_wire(self, total, nranks: int = 1, shape=None, reuse: bool = False) -> Any: ...


@runtime_checkable
class IntegerSumCodec(Protocol):
    """``aggregation = "integer_sum"``: integer codes in [-bound, bound] against a norm
    shared by MaxAllReduce, summed exactly on the width-growing ring.

    ``multiscale`` says the codec is also a ``ScaleIndexCodec``, ``sparse`` that it is a
    ``SparseCoordinatesCodec``; their methods then take the extra arguments those name.
    """

    name: str
    aggregation: str
    bound: int
    multiscale: bool
    sparse: bool

    def local_norm(self, x) -> float: ...

    def quantize(self, x, norm, step: int = 0, stream: int = 0) -> Any: ...

    def dequantize_packed(
        self, data, n: int, width: int, offset: int, norm, nranks: int = 1, shape=None
    ) -> Any: ...


@runtime_checkable
class ScaleIndexCodec(IntegerSumCodec, Protocol):
    """Refinement: ranks also share one scale index per coordinate (MinAllReduce of
    ``scale_index``, ``index_bits`` each); ``quantize`` and ``dequantize_packed`` take it."""

    index_bits: int
    index_dtype: np.dtype

    def scale_index(self, x, norm) -> Any: ...


@runtime_checkable
class SparseCoordinatesCodec(IntegerSumCodec, Protocol):
    """Refinement: only ``coordinates(numel, step)`` are quantized, the same on every rank;
    ``local_norm``, ``scale_index``, ``quantize`` and ``dequantize_packed`` take ``step``
    (and ``dequantize_packed`` the full ``shape``)."""

    def coordinates(self, numel: int, step: int = 0) -> Any: ...


@runtime_checkable
class MajorityCodec(Protocol):
    """``aggregation = "majority"``: one vote per element (``bound = 1``), summed on the
    ring; each chunk's owner decides with ``majority``; ``expand`` makes the result."""

    name: str
    aggregation: str
    bound: int

    def votes_and_scale(self, x) -> tuple[Any, float]: ...

    def majority(self, counts, nranks: int, step: int = 0, offset: int = 0) -> Any: ...

    def expand(self, bits, n: int, scale: float = 1.0) -> Any: ...


@runtime_checkable
class GatherCodec(Protocol):
    """``aggregation = "gather"``: variable-length byte payloads, allgathered (or pushed
    to shard owners); ``decode_sum`` adds decoded payloads in order (``GatherCodecBase``
    gives the plain one). ``fused_feedback``: ``encode(x, residual=r)`` updates the
    error-feedback residual in its own pass."""

    name: str
    aggregation: str
    fused_feedback: bool

    def encode(self, x) -> Any: ...

    def decode(self, payload, numel: int | None = None) -> Any: ...

    def decode_sum(self, payloads, numel: int) -> Any: ...


#: The protocol of each aggregation kind.
PROTOCOLS: dict[str, type] = {
    "sum": SumCodec,
    "integer_sum": IntegerSumCodec,
    "majority": MajorityCodec,
    "gather": GatherCodec,
}


def make(name: str, **params) -> Codec:
    """Return the codec ``name`` made with ``params``.

    Raises:
        ValueError: unknown codec name, or a parameter out of its range.
        TypeError: a parameter the codec does not take.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(available())}") from None
    unknown = [k for k in params if k not in codec_parameters(name)]
    if unknown:
        raise TypeError(
            f"codec {name!r} takes no parameter {', '.join(map(repr, unknown))}; its "
            f"parameters: {', '.join(codec_parameters(name)) or 'none'}"
        )
    return cls(**params)


def codec_parameters(name: str) -> tuple[str, ...]:
    """Return the parameter names codec ``name`` takes (none for an unknown name)."""
    cls = _REGISTRY.get(name)
    if cls is None:
        return ()
    params = inspect.signature(cls.__init__).parameters
    return tuple(p for p in params if p != "self")


def available() -> list[str]:
    """Return the names of all codecs, sorted."""
    return sorted(_REGISTRY)
