"""The options of a CompressedComm, checked once and frozen (``CompressedComm.options``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import numpy as np

from mpicomp._env import env_flag
from mpicomp.codecs._base import check_number
from mpicomp.collectives._wait import resolve_timeout
from mpicomp.reduction import AUTO, all_schedule_names, kind_of, schedule_names
from mpicomp.reduction.agreement import POLICIES

#: On (1, true...: ``mpicomp._env.env_flag``): every CompressedComm checks that all
#: ranks make the same call.
DEBUG_ENV = "MPICOMP_DEBUG"

__all__ = ["AUTO", "DEBUG_ENV", "Options"]


@dataclass(frozen=True)
class Options:
    """What a CompressedComm was asked to do; every field is checked when made.

    The fields are the keyword arguments of ``CompressedComm`` (its docstring says what
    each does), with the defaults that depend on the codec or the environment already
    resolved by ``Options.resolve``: ``error_feedback`` is a bool, ``debug`` a bool,
    ``timeout`` seconds or 0 (off; ``MPICOMP_TIMEOUT`` is read once, by ``resolve``).
    ``background`` stays as asked (None: decided by the MPI thread level).

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range, naming it.
    """

    min_numel: int = 1024
    bucket_numel: int = 1 << 22
    error_feedback: bool = False
    sharded: bool = False
    schedule: str = "allreduce"
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
        if not isinstance(self.schedule, str):
            raise TypeError(f"schedule must be a str or None, got {type(self.schedule).__name__}")
        if self.schedule not in all_schedule_names():
            raise ValueError(f"schedule: no schedule named {self.schedule!r}")
        if self.sharded != (self.schedule == "sharded"):
            raise ValueError(
                f"sharded={self.sharded} contradicts schedule={self.schedule!r} "
                "(sharded=True is schedule='sharded')"
            )
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
        cls,
        codec,
        *,
        error_feedback=None,
        sharded=False,
        schedule=None,
        debug=None,
        timeout=None,
        **given,
    ) -> Options:
        """Return the options of a CompressedComm of ``codec`` from its keyword arguments.

        Defaults: ``error_feedback`` the codec's ``feedback_default`` (on for the biased
        codecs 3LC, top-k, FFT, FastSGD and PowerSGD); ``schedule`` the codec's first (``sharded`` when
        ``sharded=True``); ``debug`` from ``MPICOMP_DEBUG``; ``timeout=None`` left to
        ``MPICOMP_TIMEOUT``, read once here; 0 off whatever the environment says.

        Raises:
            ValueError: ``error_feedback`` or ``sharded`` asked of a codec that does not
                gather payloads; a schedule the codec has not; any field out of range;
                ``MPICOMP_DEBUG`` neither on nor off.
            TypeError: a field of the wrong type.
        """
        sharded = _checked_bool("sharded", sharded)
        if error_feedback is None:
            error_feedback = codec.feedback_default
        error_feedback = _checked_bool("error_feedback", error_feedback, "or None")
        kind = kind_of(codec)
        allowed = {
            "error_feedback": (kind.feedback, "gather and low-rank codecs"),
            "sharded": ("sharded" in kind.schedules, "gather codecs"),
        }
        for what, asked in (("error_feedback", error_feedback), ("sharded", sharded)):
            applies, to = allowed[what]
            if asked and not applies:
                raise ValueError(f"{what} applies to {to}; {codec.name!r} is {kind.name!r}")
        schedule = _schedule(codec, schedule, sharded)
        if debug is None:
            debug = env_flag(DEBUG_ENV)
        # MPICOMP_TIMEOUT is read here, once: a rank whose environment changed later
        # would otherwise mix blocking and nonblocking calls with the others and hang.
        timeout = resolve_timeout(timeout) or 0
        return cls(
            error_feedback=error_feedback,
            sharded=schedule == "sharded",
            schedule=schedule,
            debug=debug,
            timeout=timeout,
            **given,
        )


def _schedule(codec, asked, sharded) -> str:
    """Return the schedule of ``codec`` asked for (None: its default, or ``sharded``)."""
    names = schedule_names(codec)
    if asked is None:
        return "sharded" if sharded is True else names[0]
    if not isinstance(asked, str):
        raise TypeError(f"schedule must be a str or None, got {type(asked).__name__}")
    if asked not in names:
        raise ValueError(
            f"schedule={asked!r}: codec {codec.name!r} ({kind_of(codec).name}) runs "
            f"{' or '.join(map(repr, names))}"
        )
    if sharded is True and asked != "sharded":
        raise ValueError(f"sharded=True contradicts schedule={asked!r}")
    return asked


def _checked_bool(name: str, value, alternative: str = "") -> bool:
    if not isinstance(value, (bool, np.bool_)):
        expected = f"a bool {alternative}".strip()
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    return bool(value)
