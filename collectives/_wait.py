"""Timeouts for the collectives: nonblocking calls, one wait loop, abort on expiry.

Every MPI call of mpicomp is made here (``tests/test_architecture.py`` fails on one made
elsewhere). Without a timeout (the default) the collectives make blocking MPI calls.
With one (``timeout=`` seconds, or the environment variable ``MPICOMP_TIMEOUT``), each
message is a nonblocking call whose requests go to ``wait_all``. ``issue`` and
``Exchange`` make that choice for every collective, in one place: they are the frames
that call MPI, so a collective reaches the library through them and nothing else.
Callers hand ``issue`` the MPI functions themselves, a blocking one and its nonblocking
twin (``MPI.Comm.Allreduce, MPI.Comm.Iallreduce``), as ``mpi4py.util.pkl5`` does.
``wait_all`` polls ``MPI.Request.Testall``
with a sleep that backs off from 10 us to 1 ms, so a waiting rank does not burn a core,
and when the timeout passes it writes to stderr what this rank was waiting for and
calls ``comm.Abort``: the whole job stops with that message instead of hanging.

The timeout bounds each wait (one message or one step of a ring), not a whole call.
Every rank must have it on or every rank off (the values may differ): MPI does not
match a blocking collective with a nonblocking one. ``issue_nonblocking`` is for the
one check that runs before the ranks have agreed on that (a CompressedComm's
configuration): nonblocking whatever the timeout. A ``Timeout`` is a resolved timeout
that also names the caller's call (a CompressedComm's op and tensor), which each report
of a wait under it then says.

A frame here that moves buffers calls ``ready`` on them just before the MPI call (a
device kernel may still be writing them); ``tests/test_mpi_architecture.py`` counts
frames up to there.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import numpy as np

from mpicomp.kernels import backend_of

# By name: mpicomp/_log.py gives this logger its rank filter.
log = logging.getLogger("mpicomp")

#: The environment variable that sets the default timeout, in seconds (unset or 0: off).
ENV = "MPICOMP_TIMEOUT"

#: The error code passed to ``MPI_Abort`` when a wait times out (mpiexec exits with it).
ABORT_CODE = 14

_FIRST_SLEEP = 1e-5  # seconds: a message that is almost there costs one short nap
_LAST_SLEEP = 1e-3  # the backoff ceiling: how late an idle rank notices completion


class Timeout(float):
    """A resolved timeout in seconds that also names the caller's call it bounds
    (``during``, e.g. ``"reduce_scatter of 'fsdp:layer1'"``), for the report of any wait
    it reaches: it travels wherever a timeout goes, so the collectives pass the caller's
    words on without knowing the caller."""

    def __new__(cls, seconds: float, during: str):
        self = super().__new__(cls, seconds)
        self.during = during
        return self


def resolve_timeout(timeout=None) -> float:
    """Return the timeout in seconds from ``timeout`` or ``MPICOMP_TIMEOUT``; 0.0 when off.

    A resolved value resolves to itself (0.0 stays off; a ``Timeout`` keeps its words), so
    it can be handed on to any function that resolves again without ``MPICOMP_TIMEOUT``
    being read a second time: ranks must all wait blocking or all nonblocking, whatever
    their environments say.

    Raises:
        TypeError: ``timeout`` is neither None nor a real number.
        ValueError: ``timeout`` or ``MPICOMP_TIMEOUT`` is negative, NaN or not a number.
    """
    if isinstance(timeout, Timeout):
        return timeout
    if timeout is None:
        raw = os.environ.get(ENV)
        if not raw:
            return 0.0
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{ENV} must be a number of seconds, got {raw!r}") from None
        what = f"{ENV}={raw!r}"
    else:
        if isinstance(timeout, (bool, np.bool_)) or not isinstance(
            timeout, (int, float, np.integer, np.floating)
        ):
            raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
        value = float(timeout)
        what = f"timeout={timeout!r}"
    if math.isnan(value) or value < 0:
        raise ValueError(f"{what} must be >= 0 seconds (0: off)")
    return value


def no_expiry(timeout=None) -> float:
    """Return the timeout of a wait that also covers another rank's local work (rank 0
    writing a file, every rank compiling and timing a codec): with a timeout set it is
    nonblocking like every other call (ranks must all wait alike) but never expires;
    without, 0.0 (blocking)."""
    return math.inf if resolve_timeout(timeout) else 0.0


def poll(requests, timeout: float, testall: Callable, clock=time.monotonic, sleep=time.sleep):
    """Poll ``testall(requests)`` until it is true or ``timeout`` seconds pass.

    Returns:
        (done, elapsed): whether every request completed, and the seconds waited.
    """
    start = clock()
    pause = _FIRST_SLEEP
    while True:
        if testall(requests):
            return True, clock() - start
        elapsed = clock() - start
        if elapsed >= timeout:
            return False, elapsed
        sleep(min(pause, timeout - elapsed))
        pause = min(2 * pause, _LAST_SLEEP)


def timeout_message(comm, op: str, detail: str, timeout: float, elapsed: float) -> str:
    """Return the report of a timed-out wait: who, in which call (and in which of the
    caller's calls, a ``Timeout``'s ``during``), waiting for what."""
    during = getattr(timeout, "during", "")
    where = f"{op} ({during})" if during else op
    return (
        f"mpicomp: rank {comm.Get_rank()} of {comm.Get_size()} timed out in {where} after "
        f"{elapsed:.3g} s (timeout {timeout:g} s): {detail}. Another rank skipped this call, "
        f"called a different one or is stuck; aborting the job (MPI_Abort, error code "
        f"{ABORT_CODE}). Set {ENV} the same on every rank (unset or 0: no timeout)."
    )


def ready(*buffers) -> None:
    """Wait until the device work that wrote ``buffers`` is done, before MPI reads them.

    A buffer is an array or a buffer spec (``[array, ...]``); NumPy arrays need nothing.
    Kernels run asynchronously on a GPU, and MPI does not wait for them: without this a
    CUDA-aware library may send bytes a kernel has not yet written.
    """
    for b in buffers:
        a = b[0] if isinstance(b, (list, tuple)) and b else b
        if a is None or isinstance(a, (np.ndarray, np.generic, int, float)):
            continue
        try:
            record = backend_of(a)
        except TypeError:  # not an array (a datatype, a count)
            continue
        sync = getattr(record, "synchronize", None)
        if sync is not None:
            sync()
            return  # one device per call: one synchronize covers every buffer


def issue(
    comm, blocking, nonblocking, *args, timeout: float | None, name: str, detail, **kwargs
) -> None:
    """Call ``blocking(comm, *args, **kwargs)``, or with a timeout
    ``nonblocking(comm, *args, **kwargs)`` waited on by ``wait_all``.

    Args:
        comm: the communicator.
        blocking, nonblocking: an MPI collective and its nonblocking twin, the functions
            of ``mpi4py.MPI.Comm`` (e.g. ``MPI.Comm.Allreduce, MPI.Comm.Iallreduce``).
        *args, **kwargs: the call's arguments.
        timeout: seconds (already resolved), or 0/None for the blocking call.
        name, detail: the collective and what it waits for, reported on timeout
            (``wait_all``'s ``op`` and ``detail``).
    """
    ready(*args)
    if not timeout:
        blocking(comm, *args, **kwargs)
        return
    wait_all(comm, [nonblocking(comm, *args, **kwargs)], timeout, name, detail)


def issue_nonblocking(
    comm, nonblocking, *args, timeout: float | None, name: str, detail, **kwargs
) -> None:
    """Call ``nonblocking(comm, *args, **kwargs)`` and wait for it (``wait_all``: with
    ``timeout`` if set), whatever the timeout: for a check whose ranks may differ in
    their timeout (a blocking collective never matches a nonblocking one)."""
    ready(*args)
    wait_all(comm, [nonblocking(comm, *args, **kwargs)], timeout, name, detail)


def send_receive(
    comm, sends, dest: int, receives, source: int, tag: int, timeout: float | None, op: str, detail
) -> None:
    """Receive each buffer of ``receives`` from ``source`` while sending each of ``sends``
    to ``dest``, in order, all with ``tag``: one Irecv or Isend per buffer, waited on
    together (``wait_all``, with ``timeout`` if set). For a step whose message is split
    into several (``allgather_bytes_ring``)."""
    ready(*sends)
    requests = [comm.Irecv(buf, source, tag) for buf in receives]
    requests += [comm.Isend(buf, dest, tag) for buf in sends]
    wait_all(comm, requests, timeout, op, detail)


def dup(comm, *, timeout: float | None, name: str):
    """Return a duplicate of ``comm`` (collective): ``Dup``, or with a timeout ``Idup``
    waited on by ``wait_all``."""
    if not timeout:
        return comm.Dup()
    new, request = comm.Idup()
    wait_all(comm, [request], timeout, name, f"duplicating a communicator of {comm.size} ranks")
    return new


def split(comm, color: int, key: int, *, timeout: float | None, name: str):
    """Return ``comm.Split(color, key)`` (collective). MPI has no nonblocking split: with
    a timeout, a barrier under it first, so a rank that never comes stops the job there."""
    _arrived(comm, timeout, name, "splitting a communicator")
    return comm.Split(color, key)


def split_type(comm, kind: int, key: int, *, timeout: float | None, name: str):
    """Return ``comm.Split_type(kind, key)`` (collective; ``kind`` e.g.
    ``MPI.COMM_TYPE_SHARED``), after a barrier under the timeout as ``split``."""
    _arrived(comm, timeout, name, "splitting a communicator by host")
    return comm.Split_type(kind, key)


def _arrived(comm, timeout: float | None, name: str, before: str) -> None:
    """With a timeout: an Ibarrier waited on under it (every rank has come); else nothing."""
    if timeout:
        detail = f"every rank, before {before} (an Ibarrier of {comm.size} ranks)"
        wait_all(comm, [comm.Ibarrier()], timeout, name, detail)


class Exchange:
    """One step of a ring or pairwise schedule, called as ``exchange(sendbuf, dest,
    recvbuf, source, phase, step)``: send ``sendbuf`` to ``dest`` while receiving
    ``recvbuf`` from ``source``, one ``Sendrecv``, or with a timeout an Irecv/Isend pair
    waited on by ``wait_all`` (``phase`` and ``step`` name the wait in its report).

    A callable object rather than a closure: the cores take it as a parameter (blocking
    or not, one algorithm) and it is itself the frame that calls MPI.
    """

    __slots__ = ("comm", "timeout", "op", "tag")

    def __init__(self, comm, timeout: float | None, op: str, tag: int):
        """``timeout``: seconds (already resolved) or None; ``op``: the collective, as
        reported on timeout; ``tag``: the collective's messages' tag."""
        self.comm, self.timeout, self.op, self.tag = comm, timeout, op, tag

    def __call__(self, sendbuf, dest: int, recvbuf, source: int, phase: str, step: int) -> None:
        comm, tag = self.comm, self.tag
        ready(sendbuf)  # a kernel may still be writing a device buffer
        if not self.timeout:
            comm.Sendrecv(sendbuf, dest, tag, recvbuf, source, tag)
            return
        requests = [comm.Irecv(recvbuf, source, tag), comm.Isend(sendbuf, dest, tag)]
        wait_all(
            comm,
            requests,
            self.timeout,
            self.op,
            lambda: (
                f"{phase} step {step} of {comm.Get_size() - 1}: receiving {recvbuf.nbytes} "
                f"bytes from rank {source} and sending {sendbuf.nbytes} bytes to rank {dest}"
            ),
        )


def wait_all(comm, requests, timeout: float | None, op: str, detail) -> None:
    """Wait for ``requests``; on timeout report to stderr and abort the job.

    Args:
        comm: the communicator the requests belong to (``comm.Abort`` stops the job).
        requests: a list of ``MPI.Request``.
        timeout: seconds, or None to wait without a limit (``MPI.Request.Waitall``).
        op: the collective, e.g. ``"ring_allreduce_bounded"``.
        detail: what this rank waits for (phase, step, peers, bytes), a string or a
            callable returning one, called only on timeout.
    """
    from mpi4py import MPI

    if not timeout:
        MPI.Request.Waitall(requests)
        return
    done, elapsed = poll(requests, timeout, MPI.Request.Testall)
    if not done:
        expire(comm, op, detail, timeout, elapsed)


#: Called (rank-locally, no messages) just before a timeout aborts the job: MPI_Abort
#: ends the process without running ``atexit`` handlers, so whoever holds unsaved
#: state (the HDF5 tracer) registers here.
_ABORT_HOOKS: list = []


def on_abort(hook) -> None:
    """Register ``hook()`` to run on this rank before a timeout aborts the job."""
    _ABORT_HOOKS.append(hook)


def remove_abort_hook(hook) -> None:
    """Unregister a hook added by ``on_abort`` (no error if it is not there)."""
    if hook in _ABORT_HOOKS:
        _ABORT_HOOKS.remove(hook)


def expire(comm, op: str, detail, timeout: float, elapsed: float) -> None:
    """Log the timeout report (CRITICAL: on stderr even where logging is not set up), run
    the abort hooks, abort the job through ``comm``."""
    text = detail() if callable(detail) else detail
    log.critical("%s", timeout_message(comm, op, text, timeout, elapsed))
    for hook in list(_ABORT_HOOKS):
        try:
            hook()
        except Exception:  # a failing hook must not stop the abort
            log.exception("mpicomp: abort hook %r failed", hook)
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()  # MPI_Abort kills the process: nothing buffered survives it
    comm.Abort(ABORT_CODE)
    # Some MPI libraries return from MPI_Abort (MPICH can, before its launcher ends the
    # ranks): nothing of the caller may run on after it with buffers never filled.
    os._exit(ABORT_CODE)
