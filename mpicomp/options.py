"""The options of a CompressedComm, checked once and frozen (``CompressedComm.options``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import numpy as np

from mpicomp._reduce import POLICIES
from mpicomp.codecs._base import check_number
from mpicomp.collectives._wait import resolve_timeout

#: Set and not ``0``: every CompressedComm checks that all ranks make the same call.
DEBUG_ENV = "MPICOMP_DEBUG"

# Biased gather codecs lose what they do not send unless it is fed back next step.
FEEDBACK_DEFAULT = frozenset({"threelc", "topk", "fft", "fastsgd"})


@dataclass(frozen=True)
class Options:
    """What a CompressedComm was asked to do; every field is checked when made.

    The fields are the keyword arguments of ``CompressedComm`` (its docstring says what
    each does), with the defaults that depend on the codec or the environment already
    resolved by ``Options.resolve``: ``error_feedback`` is a bool, ``debug`` a bool,
    ``timeout`` seconds, 0 (off) or None (``MPICOMP_TIMEOUT`` decides at each call).
    ``background`` stays as asked (None: decided by the MPI thread level).

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range, naming it.
    """

    min_numel: int = 1024
    bucket_numel: int = 1 << 22
    error_feedback: bool = False
    sharded: bool = False
    nonfinite: str = "raise"
    debug: bool = False
    timeout: float | None = None
    background: bool | None = None
    trace: str | os.PathLike | None = None
    trace_level: int = 1
    trace_flush_every: int | None = 100

    def __post_init__(self):
        # Frozen: the checked values (plain int and bool) go in through object.__setattr__.
        fix = partial(object.__setattr__, self)
        fix("min_numel", check_number("min_numel", self.min_numel, 0, None, integer=True))
        fix("bucket_numel", check_number("bucket_numel", self.bucket_numel, 1, None, integer=True))
        for flag in ("error_feedback", "sharded", "debug"):
            fix(flag, _checked_bool(flag, getattr(self, flag)))
        if self.background is not None:
            fix("background", _checked_bool("background", self.background, "or None"))
        if not isinstance(self.nonfinite, str):
            raise TypeError(f"nonfinite must be a str, got {type(self.nonfinite).__name__}")
        if self.nonfinite not in POLICIES:
            raise ValueError(f"nonfinite must be one of {POLICIES}, got {self.nonfinite!r}")
        if self.timeout is not None:
            resolve_timeout(self.timeout)
        if self.trace is not None:
            from mpicomp.trace import check_options

            check_options(self.trace, self.trace_level, self.trace_flush_every)

    @classmethod
    def resolve(
        cls, codec, *, error_feedback=None, sharded=False, debug=None, timeout=None, **given
    ) -> Options:
        """Return the options of a CompressedComm of ``codec`` from its keyword arguments.

        Defaults: ``error_feedback`` on for the biased gather codecs (3LC, top-k, FFT,
        FastSGD); ``debug`` from ``MPICOMP_DEBUG``; ``timeout=None`` left to
        ``MPICOMP_TIMEOUT`` at each call, 0 off whatever the environment says.

        Raises:
            ValueError: ``error_feedback`` or ``sharded`` asked of a codec that does not
                gather payloads; any field out of range.
            TypeError: a field of the wrong type.
        """
        if error_feedback is None:
            error_feedback = codec.name in FEEDBACK_DEFAULT
        for what, asked in (("error_feedback", error_feedback), ("sharded", sharded)):
            if asked and codec.aggregation != "gather":
                raise ValueError(
                    f"{what} applies to gather codecs; {codec.name!r} is {codec.aggregation!r}"
                )
        if debug is None:
            debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        if timeout is not None:
            timeout = resolve_timeout(timeout) or 0
        return cls(
            error_feedback=error_feedback, sharded=sharded, debug=debug, timeout=timeout, **given
        )


def _checked_bool(name: str, value, alternative: str = "") -> bool:
    if not isinstance(value, (bool, np.bool_)):
        expected = f"a bool {alternative}".strip()
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    return bool(value)
