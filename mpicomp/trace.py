"""HDF5 traces: one event per collective call per rank, written by rank 0.

``Tracer`` keeps events in preallocated NumPy structured arrays (no Python object per
event), gathers them to rank 0 every ``flush_every`` calls and at ``close()``, and
rank 0 appends them to resizable datasets. Reading is ``mpicomp.trace_report``; the
format both follow is ``mpicomp.trace_format`` (described in docs/trace-format.md).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from time import perf_counter

import numpy as np

from mpicomp._log import log
from mpicomp.collectives import _wait
from mpicomp.trace_format import (
    CODEC_LEN,
    EVENT_DTYPE,
    EVENTS,
    FORMAT_VERSION,
    NAME_LEN,
    OP_LEN,
    SCHEDULE_LEN,
    STEP_DTYPE,
    STEPS,
    VERSION_ATTR,
    import_h5py,
)

# HDF5 chunks hold about one flush (flush_every x ranks events, 8x that many steps):
# each flush then compresses new chunks once, instead of recompressing a partial one.
_CHUNK_MIN, _CHUNK_MAX = 16, 8192


class _NoClock:
    """The phase clock of an untraced call: every mark does nothing."""

    __slots__ = ()

    def encoded(self) -> None:
        pass

    def communicated(self) -> None:
        pass

    def decoded(self) -> None:
        pass


# Shared by every untraced call: three empty method calls, no clock reads.
NO_CLOCK = _NoClock()


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


def _writable(path: str, mode: str):
    """Open ``path`` for rank 0's writes without HDF5 file locking.

    A reader (``mpicomp trace summary`` while the job runs) holds a shared lock that
    would make a locking writer fail, and with it the training job.
    """
    return import_h5py().File(path, mode, locking=False)


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


class Tracer:
    """Record one event per collective call per rank; rank 0 writes them to HDF5.

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

    Raises:
        TypeError: ``path`` is not a str or os.PathLike, or ``flush_every`` not an int.
        ValueError: ``level`` not 1 or 2, or ``flush_every`` < 1.
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
    ):
        check_options(path, level, flush_every)
        if on_call is not None and not callable(on_call):
            raise TypeError(f"on_call must be callable, got {on_call!r}")
        self.path = None if path is None else os.fspath(path)
        self._on_call = on_call
        self.level = level
        self.flush_every = flush_every
        self._comm = comm
        self._rank = comm.Get_rank()
        self._events = np.empty(flush_every or 128, dtype=EVENT_DTYPE)
        self._steps = np.empty(16 * (flush_every or 128) if level >= 2 else 0, dtype=STEP_DTYPE)
        self._n = 0  # events waiting for the next flush
        self._ns = 0  # steps waiting for the next flush
        self._call = 0  # this rank's events so far: the ``call`` column
        self._open = False  # a call has begun and not ended
        self._call_steps = 0  # where the open call's steps start (dropped if it fails)
        self._closed = False
        self._also = None
        self._sent = self._recv = 0
        comm.Barrier()  # the shared epoch of start times
        self._epoch = perf_counter()
        self._attrs = self._run_attrs(attrs or {})
        if self.path is None:
            return
        self._collective_error(self._create, self._attrs, what="create")
        _wait.on_abort(self.save_local)

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
        """
        if self._closed:
            raise RuntimeError(f"tracer of {self.path!r} is closed")
        if self._open:
            self._ns = self._call_steps
        self._open = True
        self._call_steps = self._ns
        self._also = also
        self._meta = (step, op, codec, name, numel, schedule, predicted)
        self._sent = self._recv = 0
        self._t_encode = self._t_comm = self._t_decode = 0.0
        self._t0 = self._last = perf_counter()
        self._t_start = self._t0 - self._epoch

    def record(self, op: str, step: int, sent: int, recv: int, bits: int = 0) -> None:
        """Add one exchange step of the current call (the collectives' recorder hook)."""
        self._sent += sent
        self._recv += recv
        if self.level >= 2:
            if self._ns == self._steps.size:
                self._steps = _grown(self._steps, self._ns)
            done = perf_counter() - self._epoch
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
        """Finish the current call's event; flush when ``flush_every`` calls are waiting."""
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
        if self.path is None:  # no file: nothing is kept
            self._n = 0
            self._ns = self._call_steps
        elif self.flush_every is not None and self._n >= self.flush_every:
            self.flush()

    def _report(self, row, op: str, codec: str, name: str, schedule: str) -> None:
        """Hand one event to ``on_call`` as a dict of Python values."""
        event = {k: row[k].item() for k in EVENT_DTYPE.names}
        event.update(op=op, codec=codec, name=name, schedule=schedule)
        try:
            self._on_call(event)
        except Exception:  # user code must not break the collective path
            log.exception("on_call raised for %s %r", op, name)

    # -- writing -----------------------------------------------------------------

    def flush(self) -> None:
        """Gather every rank's waiting rows to rank 0 and append them to the file."""
        if self._closed:
            raise RuntimeError(f"tracer of {self.path!r} is closed")
        if self._open:  # a call that raised: its steps never become an event
            self._ns = self._call_steps
            self._open = False
        if self.path is None:
            return
        counts = np.array([self._n, self._ns], dtype=np.int64)
        every = np.empty((self._comm.Get_size(), 2), dtype=np.int64) if self._rank == 0 else None
        self._comm.Gather(counts, every, root=0)
        events = self._gather(self._events[: self._n], None if every is None else every[:, 0])
        steps = None
        if self.level >= 2:
            steps = self._gather(self._steps[: self._ns], None if every is None else every[:, 1])
        self._n = self._ns = 0
        self._collective_error(self._append, events, steps, what="write")

    def save_local(self) -> str | None:
        """Write this rank's unflushed events to ``<path>.rank<r>.h5``; return that path.

        Rank-local (no messages), for a job about to abort: a timeout calls it before
        MPI_Abort, when the usual gather to rank 0 is impossible. The side file has the
        trace's format and attributes, plus ``aborted = True`` and ``rank``; None when
        nothing was pending.
        """
        if self._closed or self._n == 0 or self.path is None:
            return None
        side = f"{self.path}.rank{self._rank}.h5"
        attrs = dict(self._attrs, aborted=True, rank=self._rank)
        saved = self.path
        try:
            self.path = side
            self._create(attrs)
            self._append(self._events[: self._n], self._steps[: self._ns] if self._ns else None)
        finally:
            self.path = saved
        return side

    def close(self) -> None:
        """Flush the last rows and stamp the end time. Safe to call twice."""
        if self._closed:
            return
        _wait.remove_abort_hook(self.save_local)
        self.flush()
        self._closed = True
        if self.path is None:
            return
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._collective_error(self._stamp, stamp, what="close")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Tracer({self.path!r}, level={self.level}, flush_every={self.flush_every})"

    # -- internals ---------------------------------------------------------------

    def _gather(self, rows: np.ndarray, counts):
        """Return every rank's ``rows`` on rank 0 in rank order (None elsewhere)."""
        from mpi4py import MPI

        send = [rows.view(np.uint8), MPI.BYTE]
        if self._rank != 0:
            self._comm.Gatherv(send, None, root=0)
            return None
        out = np.empty(int(counts.sum()), dtype=rows.dtype)
        sizes = counts * rows.dtype.itemsize
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self._comm.Gatherv(send, [out.view(np.uint8), sizes, displs, MPI.BYTE], root=0)
        # Rank order from Gatherv; a stable sort by call makes rows (call, rank) ordered.
        return out[np.argsort(out["call"], kind="stable")]

    def _collective_error(self, fn, *args, what: str) -> None:
        """Run ``fn`` on rank 0 and raise on every rank if it failed there."""
        error = None
        if self._rank == 0:
            try:
                fn(*args)
            except Exception as e:  # reported to every rank below, then re-raised here
                error = e
        failed = np.array([error is not None], dtype=np.int8)
        self._comm.Bcast(failed, root=0)
        if error is not None:
            raise error
        if failed[0]:
            raise OSError(f"rank 0 could not {what} the trace file {self.path!r} (see its error)")

    def _run_attrs(self, extra: dict) -> dict:
        from mpi4py import MPI

        import mpicomp

        vendor, version = MPI.get_vendor()
        attrs = {
            VERSION_ATTR: FORMAT_VERSION,
            "mpicomp_version": mpicomp.__version__,
            "mpi_library_version": MPI.Get_library_version().replace("\0", "").strip(),
            "mpi_vendor": f"{vendor} {'.'.join(map(str, version))}",
            "world_size": self._comm.Get_size(),
            "trace_level": self.level,
            "flush_every": self.flush_every or 0,
            "command_line": " ".join(sys.argv),
            "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
            # rank 0's wall clock at the epoch of t_start (Unix seconds)
            "epoch_unix": time.time() - (perf_counter() - self._epoch),
        }
        attrs.update(extra)
        return attrs

    def _create(self, attrs: dict) -> None:
        with _writable(self.path, "w") as f:
            for key, value in attrs.items():
                f.attrs[key] = value
            rows = (self.flush_every or 1024) * self._comm.Get_size()
            tables = [(EVENTS, EVENT_DTYPE, rows)]
            if self.level >= 2:
                tables.append((STEPS, STEP_DTYPE, 8 * rows))
            for name, dtype, chunk in tables:
                f.create_dataset(
                    name,
                    shape=(0,),
                    maxshape=(None,),
                    dtype=dtype,
                    chunks=(min(max(chunk, _CHUNK_MIN), _CHUNK_MAX),),
                    compression="gzip",
                    compression_opts=4,
                )

    def _append(self, events: np.ndarray, steps) -> None:
        # Open, append, close: between flushes the file on disk is complete and closed,
        # so a job that dies leaves a readable file and readers never need SWMR.
        with _writable(self.path, "a") as f:
            for name, rows in ((EVENTS, events), (STEPS, steps)):
                if rows is None or rows.size == 0:
                    continue
                dset = f[name]
                start = dset.shape[0]
                dset.resize((start + rows.size,))
                dset[start:] = rows
            f.flush()

    def _stamp(self, stamp: str) -> None:
        with _writable(self.path, "a") as f:
            f.attrs["end_time"] = stamp


__all__ = ["NO_CLOCK", "Tracer"]
