"""What every codec shares: the contract of each aggregation kind, parameter checks and
the registry behind ``mpicomp.codec``.

A codec's ``aggregation`` says how the collective layer combines what ranks send, and
which protocol the codec implements: the kind's module in ``mpicomp.reduction`` defines
both, and ``CompressedComm`` picks its reduction path from that kind alone. Codecs compute through the kernel backend record
``self.kernels`` (``mpicomp.kernels.backend()`` when the codec was made) for NumPy
arrays, and never import a backend's modules.
"""

from __future__ import annotations

import inspect
import math
from typing import ClassVar

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
    """Return ``value`` if it is a number in the interval; raise naming ``name`` otherwise:
    TypeError for what is not a number (a str such as ``"4"``, a bool), ValueError for a
    number out of the interval (or not integral where ``integer``).

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
        raise TypeError(f"{name} must be {kind} in {allowed}, got {value!r}")
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
    #: False for a codec that sends its input as it is (``none``): nothing to choose
    #: between compressing and the float32 fallback.
    compresses: ClassVar[bool] = True
    #: Whether ``CompressedComm`` keeps error-feedback residuals unless told otherwise.
    feedback_default: ClassVar[bool] = False
    #: Whether it computes through mpicomp's kernel backends (a numba twin and a CUDA
    #: twin, byte for byte); False for PowerSGD's matrix products (BLAS, cuBLAS).
    on_kernels: ClassVar[bool] = True
    #: False where training under an adaptive optimizer (Adam, AdamW, Adagrad...)
    #: through it was measured to fall far behind float32 (docs/choosing.md, "With
    #: AdamW"): mpicomp.torch's optimizers warn, and point to ``adam_warmup``.
    trains_adaptive: ClassVar[bool] = True

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
    # Biased: what a payload does not carry is lost unless it is fed back next step.
    feedback_default = True
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

    def decode_gathered(self, payloads, numel: int):
        """Return ``decode_sum(payloads, numel)`` of payloads a collective gathered: each
        of a flat array of ``numel`` elements. A codec may check these with fewer reads
        of the device than ``decode`` makes of any payload (top-k's knows their headers
        from their lengths)."""
        return self.decode_sum(payloads, numel)

    def decode_flat(self, payload, numel: int):
        """Return ``decode(payload).reshape(-1)`` of a payload a collective brought, of a
        flat array of ``numel`` elements made with this codec's parameters: the same
        bytes (-0.0 kept), its checks read with the caller's ``readback.batch`` where the
        codec can defer them (its header known from its length), at once otherwise.

        Raises:
            PayloadError: the payload is corrupt, or of another shape or parameters.
        """
        return self.decode(payload, numel=numel).reshape(-1)

    def _sum_gathered(self, payloads, numel: int):
        """Return zeros of ``numel`` float32 on the first payload's device with each
        payload added in order (``_add_gathered``): the loop of a ``decode_gathered``
        whose checks are deferred.

        A corrupt payload decodes to garbage until the caller's batch reads its checks,
        which raise then: NumPy's warnings about that garbage would come first, so they
        are off while the payloads are added.
        """
        xp = backend_of(payloads[0], self.kernels).xp if payloads else self.kernels.xp
        total = xp.zeros(numel, dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            for p in payloads:
                self._add_gathered(p, total)
        return total

    def _add_gathered(self, payload, total) -> None:
        """Add the decode of a gathered payload of a flat array into ``total``, its
        checks registered with the caller's batch (``_decode_flat``'s)."""
        total += self._decode_flat(payload, total.size)

    def decode_local(self, payload, shape):
        """Return ``decode(payload)`` of a payload this process's ``encode`` just made of
        an array of ``shape`` (error feedback's own decode); a codec may trust it."""
        return self.decode(payload)


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
