"""Recording a trace: one event per collective call of this rank (and at level 2 one row per
exchange step) in memory, and each call's phase clock.

``Recorder`` keeps its rows in preallocated NumPy structured arrays (no Python object per
event), in the columns of ``mpicomp.trace.format``, until its owner takes them
(``mpicomp.trace.Tracer`` hands them to ``mpicomp.trace.writer``). It sends no message
after the barrier that fixes its epoch, and touches no file.
"""

from __future__ import annotations

from time import perf_counter

import numpy as np

from mpicomp._log import log
from mpicomp.trace.format import (
    CODEC_LEN,
    EVENT_DTYPE,
    NAME_LEN,
    OP_LEN,
    SCHEDULE_LEN,
    STEP_DTYPE,
)


def _fixed(text: str, length: int) -> bytes:
    """Return ``text`` as UTF-8 cut to ``length`` bytes without splitting a character."""
    raw = text.encode("utf-8")
    if len(raw) <= length:
        return raw
    return raw[:length].decode("utf-8", "ignore").encode("utf-8")


def _grown(array: np.ndarray, used: int) -> np.ndarray:
    """Return a copy of ``array`` with twice the rows, its first ``used`` rows kept."""
    bigger = np.empty(max(2 * array.size, 16), dtype=array.dtype)
    bigger[:used] = array[:used]
    return bigger


class Recorder:
    """Keep this rank's events of collective calls, and at level 2 their exchange steps.

    Start times (``t_start``, and each step's ``t_end``) are seconds since ``epoch``: the
    end of a barrier on ``comm`` when the recorder is made, which all ranks share.

    Args:
        comm: an ``mpi4py.MPI.Comm``; making the recorder is collective over it (the
            barrier), nothing after that is.
        level: 1 records events only; 2 also every exchange step.
        rows: events the first buffer holds (16 times as many steps); both grow by
            doubling.
        on_call: called with each finished call's event as a dict, or None (see
            ``mpicomp.trace.Tracer``).
        timeout: seconds the barrier may wait (the collectives' ``timeout``; None:
            ``MPICOMP_TIMEOUT``).
    """

    def __init__(self, comm, level: int, rows: int, on_call=None, timeout=None):
        from mpicomp.collectives import plain  # MPI only once a recorder is made

        self.level = level
        self._rank = comm.Get_rank()
        self._on_call = on_call
        self._events = np.empty(rows, dtype=EVENT_DTYPE)
        self._steps = np.empty(16 * rows if level >= 2 else 0, dtype=STEP_DTYPE)
        self._n = 0  # events waiting to be taken
        self._ns = 0  # steps waiting to be taken
        self._call = 0  # this rank's events so far: the ``call`` column
        self._open = False  # a call has begun and not ended
        self._refused = None  # why begin() is refused (closed), or None
        self._call_steps = 0  # where the open call's steps start (dropped if it fails)
        self._also = None
        self._sent = self._recv = 0
        plain.barrier(comm, timeout=timeout)  # the shared epoch of start times
        #: ``perf_counter()`` at the end of the barrier: the zero of the start times.
        self.epoch = perf_counter()

    # -- one call ----------------------------------------------------------------

    def begin(
        self,
        step: int,
        op: str,
        codec: str,
        name: str,
        numel: int,
        also=None,
        schedule: str = "",
        predicted: float = float("nan"),
    ) -> None:
        """Start the event of one collective call; starts its clock.

        ``also``: another recorder (``record(op, step, sent, recv, bits)``) that gets
        every exchange step of this call too. ``schedule`` and ``predicted``: how the
        call moves its bytes and the seconds a model predicted for it. A call begun and
        never ended (it raised) is dropped with its steps.

        Raises:
            RuntimeError: the recorder was closed (``refuse``).
        """
        if self._refused is not None:
            raise RuntimeError(self._refused)
        self.drop_open()
        self._open = True
        self._call_steps = self._ns
        self._also = also
        self._meta = (step, op, codec, name, numel, schedule, predicted)
        self._sent = self._recv = 0
        self._t_encode = self._t_comm = self._t_decode = 0.0
        self._t0 = self._last = perf_counter()
        self._t_start = self._t0 - self.epoch

    def record(self, op: str, step: int, sent: int, recv: int, bits: int = 0) -> None:
        """Add one exchange step of the current call (the collectives' recorder hook)."""
        self._sent += sent
        self._recv += recv
        if self.level >= 2:
            if self._ns == self._steps.size:
                self._steps = _grown(self._steps, self._ns)
            done = perf_counter() - self.epoch
            self._steps[self._ns] = (self._call, self._rank, op, step, sent, recv, bits, done)
            self._ns += 1
        if self._also is not None:
            self._also.record(op, step, sent, recv, bits)

    def encoded(self) -> None:
        """Charge the time since the last mark to the encode phase."""
        now = perf_counter()
        self._t_encode += now - self._last
        self._last = now

    def communicated(self) -> None:
        """Charge the time since the last mark to the comm phase."""
        now = perf_counter()
        self._t_comm += now - self._last
        self._last = now

    def decoded(self) -> None:
        """Charge the time since the last mark to the decode phase."""
        now = perf_counter()
        self._t_decode += now - self._last
        self._last = now

    def end(self) -> None:
        """Finish the current call's event and hand it to ``on_call``.

        Raises:
            RuntimeError: no call has begun.
        """
        total = perf_counter() - self._t0
        if not self._open:
            raise RuntimeError("tracer: end() without begin()")
        step, op, codec, name, numel, schedule, predicted = self._meta
        if self._n == self._events.size:
            self._events = _grown(self._events, self._n)
        self._events[self._n] = (
            self._call,
            step,
            self._rank,
            _fixed(op, OP_LEN),
            _fixed(codec, CODEC_LEN),
            _fixed(name, NAME_LEN),
            numel,
            4 * numel,
            self._sent,
            self._recv,
            self._t_encode,
            self._t_comm,
            self._t_decode,
            total,
            self._t_start,
            _fixed(schedule, SCHEDULE_LEN),
            predicted,
        )
        self._n += 1
        self._call += 1
        self._open = False
        self._also = None
        if self._on_call is not None:
            self._report(self._events[self._n - 1], op, codec, name, schedule)

    def _report(self, row, op: str, codec: str, name: str, schedule: str) -> None:
        """Hand one event to ``on_call`` as a dict of Python values."""
        event = {k: row[k].item() for k in EVENT_DTYPE.names}
        event.update(op=op, codec=codec, name=name, schedule=schedule)
        try:
            self._on_call(event)
        except Exception:  # user code must not break the collective path
            log.exception("on_call raised for %s %r", op, name)

    # -- the rows waiting --------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Events recorded and not yet cleared."""
        return self._n

    def pending(self) -> tuple[np.ndarray, np.ndarray]:
        """Return the events and steps waiting, as views of the buffers (valid until the
        next ``begin``)."""
        return self._events[: self._n], self._steps[: self._ns]

    def clear(self) -> None:
        """Forget the rows waiting (they were written, or there is no file to keep)."""
        self._n = self._ns = 0

    def drop_open(self) -> None:
        """Drop the steps of a call begun and never ended (it raised): no event has them."""
        if self._open:
            self._ns = self._call_steps
            self._open = False

    def refuse(self, why: str) -> None:
        """Make every later ``begin`` raise RuntimeError(``why``) (a closed tracer)."""
        self._refused = why
