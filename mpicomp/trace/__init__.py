"""HDF5 traces: one event per collective call per rank, written by rank 0.

A ``Tracer`` is two parts: a recorder (``mpicomp.trace.recorder``) keeps each rank's
events in preallocated NumPy structured arrays (no Python object per event) and times
each call's phases; a writer (``mpicomp.trace.writer``) gathers them to rank 0 every
``flush_every`` calls and at ``close()``, and rank 0 appends them to resizable datasets.
Reading is ``mpicomp.trace.report``; the format both follow is ``mpicomp.trace.format``
(described in docs/trace-format.md).
"""

from __future__ import annotations

import os

from mpicomp.collectives import _wait
from mpicomp.reduction.clock import NO_CLOCK
from mpicomp.trace.recorder import Recorder
from mpicomp.trace.writer import Writer


def check_options(path, level: int, flush_every: int | None) -> None:
    """Raise what ``Tracer(comm, path, level=level, flush_every=flush_every)`` would
    raise for these arguments (a CompressedComm checks them before its first message).
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"trace path must be a str or os.PathLike, got {path!r}")
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(f"trace level must be 1 or 2, got {level!r}")
    if flush_every is not None:
        if isinstance(flush_every, bool) or not isinstance(flush_every, int):
            raise TypeError(f"flush_every must be an int or None, got {flush_every!r}")
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1 or None, got {flush_every!r}")


class Tracer(Recorder):
    """Record one event per collective call per rank; rank 0 writes them to HDF5.

    A ``Recorder`` (``begin``, ``record``, the phase marks, ``end``) that hands what it
    recorded to a ``Writer`` (``mpicomp.trace.writer``).

    Every method but ``record`` and the phase marks is collective over ``comm``: all
    ranks create, end calls, flush and close in the same order (``CompressedComm``
    does, since every rank makes the same calls).

    Start times (``t_start``, and each step's ``t_end``) are seconds since an epoch all
    ranks share: the end of a barrier when the tracer is made (on one node the ranks'
    clocks then agree to microseconds; across nodes to the barrier's skew).

    Args:
        comm: an ``mpi4py.MPI.Comm``; ``CompressedComm`` passes its private duplicate.
        path: the HDF5 file rank 0 creates (an existing file is replaced); None keeps
            no file (events only go to ``on_call``).
        level: 1 records events only; 2 also every exchange step into ``/steps``.
        flush_every: gather to rank 0 and append to the file every this many calls
            (None: only at ``close``); rows of earlier flushes survive a crash.
        attrs: run attributes for the root group (str, int, float or bool values).
        on_call: called with each finished call's event as a dict (the columns of
            ``/events``, names as given, not cut), in the thread that ran the call; an
            exception it raises is logged to ``mpicomp`` and ignored.
        timeout: seconds each of its messages (the barrier when made, each flush's
            gather) may wait before this rank reports what it waits for and aborts the
            job, as the collectives'; None: ``MPICOMP_TIMEOUT``, unset or 0: off.
            ``CompressedComm`` passes its own.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike, or ``flush_every`` not an int.
        ValueError: ``level`` not 1 or 2, or ``flush_every`` < 1.
        TypeError, ValueError: ``timeout`` (or ``MPICOMP_TIMEOUT``) is not a number of
            seconds >= 0.
        OSError: rank 0 could not create the file (on every rank).
    """

    def __init__(
        self,
        comm,
        path,
        *,
        level: int = 1,
        flush_every: int | None = 100,
        attrs=None,
        on_call=None,
        timeout=None,
    ):
        check_options(path, level, flush_every)
        timeout = _wait.resolve_timeout(timeout)
        if on_call is not None and not callable(on_call):
            raise TypeError(f"on_call must be callable, got {on_call!r}")
        self.path = None if path is None else os.fspath(path)
        self.level = level
        self.flush_every = flush_every
        self._closed = False
        super().__init__(comm, level, flush_every or 128, on_call, timeout)
        self._writer = None  # no file: events only go to on_call
        if self.path is None:
            return
        self._writer = Writer(
            comm,
            self.path,
            level=level,
            flush_every=flush_every,
            attrs=attrs or {},
            epoch=self.epoch,
            timeout=timeout,
        )
        _wait.on_abort(self.save_local)

    # -- one call: begin, record and the phase marks are the recorder's ------------

    def end(self) -> None:
        """Finish the current call's event; flush when ``flush_every`` calls are waiting."""
        super().end()
        if self._writer is None:  # no file: nothing is kept
            self.clear()
        elif self.flush_every is not None and self.waiting >= self.flush_every:
            self.flush()

    # -- writing: the writer's -----------------------------------------------------

    def flush(self) -> None:
        """Gather every rank's waiting rows to rank 0 and append them to the file."""
        if self._closed:
            raise RuntimeError(f"tracer of {self.path!r} is closed")
        self.drop_open()  # a call that raised: its steps never become an event
        if self._writer is None:
            return
        events, steps = self.pending()
        self.clear()  # the views stay valid: nothing records during a flush
        self._writer.write(events, steps if self.level >= 2 else None)

    def save_local(self) -> str | None:
        """Write this rank's unflushed events to ``<path>.rank<r>.h5``; return that path.

        Rank-local (no messages), for a job about to abort: a timeout calls it before
        MPI_Abort, when the usual gather to rank 0 is impossible. The side file has the
        trace's format and attributes, plus ``aborted = True`` and ``rank``; None when
        nothing was pending.
        """
        if self._closed or self._writer is None:
            return None
        events, steps = self.pending()
        if events.size == 0:
            return None
        return self._writer.save_local(events, steps if steps.size else None)

    def close(self) -> None:
        """Flush the last rows and stamp the end time. Safe to call twice."""
        if self._closed:
            return
        _wait.remove_abort_hook(self.save_local)
        self.flush()
        self._closed = True
        self.refuse(f"tracer of {self.path!r} is closed")
        if self._writer is not None:
            self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Tracer({self.path!r}, level={self.level}, flush_every={self.flush_every})"


__all__ = ["NO_CLOCK", "Tracer"]
