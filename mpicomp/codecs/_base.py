"""What every codec shares: parameter checks and the registry behind ``mpicomp.codec``."""

from __future__ import annotations

import math
from typing import ClassVar

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

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"mpicomp.codec({self.name!r}{', ' if args else ''}{args})"


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
    return cls(**params)


def available() -> list[str]:
    """Return the names of all codecs, sorted."""
    return sorted(_REGISTRY)
