"""Writing a trace: every rank's rows gathered to rank 0, which appends them to one HDF5 file.

``Writer`` creates the file (the run's attributes, resizable datasets in the columns of
``mpicomp.trace.format``), appends the rows it is given at each ``write`` and stamps the
end time at ``close``; ``save_local`` is the rank-local side file of a job about to
abort. h5py is imported when a file is first opened. What the rows are and when they are
written is ``mpicomp.trace``'s (the ``Tracer``); reading them is ``mpicomp.trace.report``.
"""

from __future__ import annotations

import datetime
import sys
import time
from time import perf_counter

import numpy as np

from mpicomp._version import __version__
from mpicomp.trace.format import (
    EVENT_DTYPE,
    EVENTS,
    FORMAT_VERSION,
    STEP_DTYPE,
    STEPS,
    VERSION_ATTR,
    import_h5py,
)

# HDF5 chunks hold about one flush (flush_every x ranks events, 8x that many steps):
# each flush then compresses new chunks once, instead of recompressing a partial one.
_CHUNK_MIN, _CHUNK_MAX = 16, 8192


def _writable(path: str, mode: str):
    """Open ``path`` for rank 0's writes without HDF5 file locking.

    A reader (``mpicomp trace summary`` while the job runs) holds a shared lock that
    would make a locking writer fail, and with it the training job.
    """
    return import_h5py().File(path, mode, locking=False)


class Writer:
    """Rank 0's HDF5 file of a trace; every method but ``save_local`` is collective.

    Args:
        comm: an ``mpi4py.MPI.Comm``; its rank 0 writes.
        path: the file rank 0 creates now (an existing file is replaced).
        level: 1 keeps ``/events``; 2 also ``/steps``.
        flush_every: calls between writes (None: only at close), for the chunk size
            and the ``flush_every`` attribute.
        attrs: attributes of the root group, beside the run's own.
        epoch: the ``perf_counter()`` that start times count from (``epoch_unix``).
        timeout: seconds each message may wait (resolved: None is none).

    Raises:
        OSError: rank 0 could not create the file (on every rank).
    """

    def __init__(
        self, comm, path: str, *, level: int, flush_every, attrs: dict, epoch: float, timeout
    ):
        self.path = path
        self.level = level
        self.flush_every = flush_every
        self._comm = comm
        self._timeout = timeout
        self._rank = comm.Get_rank()
        self._attrs = self._run_attrs(attrs, epoch)
        self._collective_error(self._create, path, self._attrs, what="create")

    def write(self, events: np.ndarray, steps: np.ndarray | None) -> None:
        """Gather every rank's ``events`` and ``steps`` (None at level 1) to rank 0 and
        append them to the file."""
        from mpi4py import MPI

        counts = np.array([events.size, 0 if steps is None else steps.size], dtype=np.int64)
        every = np.empty((self._comm.Get_size(), 2), dtype=np.int64) if self._rank == 0 else None
        self._issue(MPI.Comm.Gather, MPI.Comm.Igather, counts, every, "row counts (an Igather)")
        events = self._gather(events, None if every is None else every[:, 0])
        if steps is not None:
            steps = self._gather(steps, None if every is None else every[:, 1])
        self._collective_error(self._append, self.path, events, steps, what="write")

    def save_local(self, events: np.ndarray, steps: np.ndarray | None) -> str:
        """Write this rank's ``events`` and ``steps`` to ``<path>.rank<r>.h5`` (no
        messages); return that path. The side file has the trace's format and
        attributes, plus ``aborted = True`` and ``rank``."""
        side = f"{self.path}.rank{self._rank}.h5"
        self._create(side, dict(self._attrs, aborted=True, rank=self._rank))
        self._append(side, events, steps)
        return side

    def close(self) -> None:
        """Stamp the end time on the file."""
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._collective_error(self._stamp, stamp, what="close")

    # -- internals ---------------------------------------------------------------

    def _issue(self, blocking, nonblocking, sendbuf, recvbuf, what: str) -> None:
        """Gather to rank 0 under the timeout: ``blocking`` or ``nonblocking``, the MPI
        functions (``_wait.issue``)."""
        from mpicomp.collectives._wait import issue

        detail = f"{what} of the trace {self.path!r} to rank 0"
        issue(
            self._comm,
            blocking,
            nonblocking,
            sendbuf,
            recvbuf,
            root=0,
            timeout=self._timeout,
            name="trace",
            detail=detail,
        )

    def _gather(self, rows: np.ndarray, counts):
        """Return every rank's ``rows`` on rank 0 in rank order (None elsewhere)."""
        from mpi4py import MPI

        send = [rows.view(np.uint8), MPI.BYTE]
        rows_of = "rows (an Igatherv)"
        if self._rank != 0:
            self._issue(MPI.Comm.Gatherv, MPI.Comm.Igatherv, send, None, rows_of)
            return None
        out = np.empty(int(counts.sum()), dtype=rows.dtype)
        sizes = counts * rows.dtype.itemsize
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        recv = [out.view(np.uint8), sizes, displs, MPI.BYTE]
        self._issue(MPI.Comm.Gatherv, MPI.Comm.Igatherv, send, recv, rows_of)
        # Rank order from Gatherv; a stable sort by call makes rows (call, rank) ordered.
        return out[np.argsort(out["call"], kind="stable")]

    def _collective_error(self, fn, *args, what: str) -> None:
        """Run ``fn`` on rank 0 and raise on every rank if it failed there."""
        from mpicomp.collectives import plain
        from mpicomp.collectives._wait import no_expiry

        error = None
        if self._rank == 0:
            try:
                fn(*args)
            except Exception as e:  # reported to every rank below, then re-raised here
                error = e
        failed = np.array([error is not None], dtype=np.int8)
        # Waits for rank 0's write: a slow filesystem is no peer that stopped.
        plain.bcast(self._comm, failed, 0, timeout=no_expiry(self._timeout))
        if error is not None:
            raise error
        if failed[0]:
            raise OSError(f"rank 0 could not {what} the trace file {self.path!r} (see its error)")

    def _run_attrs(self, extra: dict, epoch: float) -> dict:
        from mpi4py import MPI

        vendor, version = MPI.get_vendor()
        attrs = {
            VERSION_ATTR: FORMAT_VERSION,
            "mpicomp_version": __version__,
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
            "epoch_unix": time.time() - (perf_counter() - epoch),
        }
        attrs.update(extra)
        return attrs

    def _create(self, path: str, attrs: dict) -> None:
        with _writable(path, "w") as f:
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

    def _append(self, path: str, events: np.ndarray, steps) -> None:
        # Open, append, close: between writes the file on disk is complete and closed,
        # so a job that dies leaves a readable file and readers never need SWMR.
        with _writable(path, "a") as f:
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
