"""Push/pull through shard owners (3LC's parameter-server design, the 3LC paper §2-3, on MPI).

Rank s serves shard s of the flat tensor. *Push*: every rank sends its compressed
shard s to rank s (one Alltoallv of variable-length byte payloads). The owner
averages the N payloads of its shard and compresses the result once; *pull*: an
allgather of the owners' payloads. Each rank receives about 2·(N−1)/N of one
compressed tensor instead of the N−1 whole payloads of an allgather. This module
moves bytes; what is compressed, and with which residual, is the caller's:
``push_pull`` runs the whole exchange and calls back the caller's ``owner`` for the
owner's step, as the ring takes ``majority=``.

With a timeout (``timeout=`` or ``MPICOMP_TIMEOUT``, see ``_wait``) the messages are
Ialltoall, Iallreduce and Ialltoallv calls waited on by ``_wait.wait_all``.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from mpi4py import MPI

from mpicomp.collectives._wait import issue, resolve_timeout
from mpicomp.collectives.agreement import TOP, Form, settle
from mpicomp.collectives.allgather import _COUNT_LIMIT, allgather_bytes
from mpicomp.errors import RankError
from mpicomp.kernels import backend_of

_OP = "alltoall_bytes"
# The count check: the most bytes any rank sends or receives (one Allreduce(MAX)).
_COUNTS = Form(moved=TOP)


def shard_bounds(n: int, nshards: int) -> list[tuple[int, int]]:
    """Return [start, stop) of each of ``nshards`` near-equal contiguous shards of ``n`` elements."""
    base, extra = divmod(n, nshards)
    bounds, start = [], 0
    for s in range(nshards):
        stop = start + base + (1 if s < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _is_bytes(p) -> bool:
    """Return True for a 1-D uint8 array, on the host or a device."""
    try:
        backend_of(p)
    except TypeError:
        return False
    return p.dtype == np.uint8 and p.ndim == 1


def _module(p):
    """Return the array module of ``p`` (NumPy, CuPy)."""
    return backend_of(p).xp


def alltoall_bytes(comm, payloads, *, recorder=None, timeout=None) -> list[np.ndarray]:
    """Send ``payloads[d]`` to rank d; return the payload each rank sent here, in rank order.

    Sizes go first (one Alltoall of int64), then one Alltoallv. A rank whose input is
    not N 1-D uint8 arrays announces size -1, and every rank raises the same ValueError.
    ``timeout``: seconds each message may wait before this rank reports what it waits
    for and aborts the job (``comm.Abort``); None: ``MPICOMP_TIMEOUT``, unset or 0: off.

    Raises:
        ValueError: a rank's payloads are malformed (named), or a size overflows MPI's counts.
    """
    # Every message of a call: on comm, under the timeout, named ``alltoall_bytes``.
    call = partial(issue, comm, timeout=resolve_timeout(timeout), name=_OP)
    size = comm.size
    ok = (
        isinstance(payloads, (list, tuple))
        and len(payloads) == size
        and all(_is_bytes(p) for p in payloads)
        and len({_module(p) for p in payloads}) <= 1
    )
    send_sizes = np.array([p.size for p in payloads] if ok else [-1] * size, dtype=np.int64)
    recv_sizes = np.empty(size, dtype=np.int64)
    detail = f"sizes (an Ialltoall of int64 over all {size} ranks)"
    call(MPI.Comm.Alltoall, MPI.Comm.Ialltoall, send_sizes, recv_sizes, detail=detail)
    # The sizes are every rank's row of the check: -1 marks a rank at fault. The same
    # message on every rank, the bad rank included.
    settle(
        np.flatnonzero(recv_sizes < 0).tolist(),
        None,
        lambda bad: ValueError(
            f"alltoall_bytes: rank(s) {bad} did not pass {size} 1-D uint8 payloads (one per rank)"
        ),
    )
    # Decided on a value every rank shares, so all raise or none does.
    moved = int(max(send_sizes.sum(), recv_sizes.sum()))
    local = _COUNTS.reduced(comm.rank, size, moved=moved)
    largest = np.empty_like(local)
    detail = f"the count check (an Iallreduce of 8 bytes over all {size} ranks)"
    call(MPI.Comm.Allreduce, MPI.Comm.Iallreduce, local, largest, op=MPI.MAX, detail=detail)
    most = _COUNTS.tally(largest, size).top("moved")
    if most > _COUNT_LIMIT:
        raise ValueError(
            f"alltoall_bytes: a rank moves {most} bytes, more than this MPI's "
            f"count limit {_COUNT_LIMIT}; use smaller buckets"
        )
    xp = _module(payloads[0]) if size else np
    send = xp.concatenate(payloads) if size else np.empty(0, np.uint8)
    sdispl = np.concatenate([[0], np.cumsum(send_sizes)[:-1]])
    rdispl = np.concatenate([[0], np.cumsum(recv_sizes)[:-1]])
    recv = xp.empty(int(recv_sizes.sum()), dtype=np.uint8)
    sendspec = [send, send_sizes, sdispl, MPI.BYTE]
    recvspec = [recv, recv_sizes, rdispl, MPI.BYTE]
    detail = (
        f"push (an Ialltoallv sending {send.nbytes} bytes, receiving {recv.nbytes}, "
        f"over all {size} ranks)"
    )
    call(MPI.Comm.Alltoallv, MPI.Comm.Ialltoallv, sendspec, recvspec, detail=detail)
    if recorder is not None:
        me = comm.rank
        recorder.record("sharded.sizes", 1, 8 * (size - 1), 8 * (size - 1), 64)
        sent = int(send_sizes.sum() - send_sizes[me])
        got = int(recv_sizes.sum() - recv_sizes[me])
        recorder.record("sharded.push", 1, sent, got, 8)
    return [recv[d : d + s] for d, s in zip(rdispl, recv_sizes, strict=True)]


def push_pull(comm, pushed, owner, *, recorder=None, timeout=None) -> list:
    """Push each shard's payloads to its owner, let every owner make one payload of them,
    and pull every owner's payload to every rank.

    ``alltoall_bytes(comm, pushed)``, then ``owner(received)`` on every rank, then
    ``allgather_bytes`` of what the owners made. A rank that failed still takes part
    (with None), so that every rank raises instead of waiting for it.

    Args:
        comm: an ``mpi4py.MPI.Intracomm``.
        pushed: this rank's N payloads, ``pushed[s]`` for owner s (1-D uint8 arrays), or
            None on a rank whose encode failed.
        owner: ``owner(received) -> (payload, None)`` or ``(None, error)``: called on
            every rank with the N payloads pushed to it, in rank order; ``payload`` (1-D
            uint8) is what every rank pulls from this one.
        recorder, timeout: as for ``alltoall_bytes`` and ``allgather_bytes`` (records
            ``"sharded.*"``, then ``"allgather.*"``).

    Returns:
        The owners' payloads, in rank order (uint8 views into one buffer).

    Raises:
        RankError: on every rank, when some rank's push was None or malformed (or too
            large to count); on the other ranks, when an owner failed.
        The owner's error: on the rank whose owner returned one.
    """
    try:
        received = alltoall_bytes(comm, pushed, recorder=recorder, timeout=timeout)
    except ValueError as e:
        raise RankError(str(e)) from e
    pull, error = owner(received)
    try:
        return allgather_bytes(comm, pull, recorder=recorder, timeout=timeout)
    except ValueError as e:
        if error is not None:
            raise error from None
        raise RankError(str(e)) from e
