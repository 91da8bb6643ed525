"""The library's own MPI collectives (Allreduce, Allgather, Alltoall, Reduce_scatter, Allgatherv,
Bcast, Barrier, and the broadcast, allgather and gather of Python objects) behind the
same timeout.

``CompressedComm`` makes these MPI calls outside the hand-written collectives: the
float32/float16 ``MPI_Allreduce`` of ``none``/``fp16``, signSGD's ``MPI_Allgather`` of
the per-rank scales, and the float32 reduce-scatter and allgather within a host of the
hierarchical schedules; where the hosts are, the model's probe, a trace, the framework
adapters and the tools make their messages through them too. These wrappers make them
(through ``_wait.issue``) with the blocking call when there is no timeout, or
nonblocking and waited on by ``_wait.wait_all`` when there is one.
"""

from __future__ import annotations

import pickle

import numpy as np
from mpi4py import MPI

from mpicomp.collectives._wait import issue, resolve_timeout


def _array(buf):
    """Return the array of a buffer or of a ``[array, datatype]`` buffer spec."""
    return buf[0] if isinstance(buf, (list, tuple)) else buf


def allreduce(
    comm, sendbuf, recvbuf, op=MPI.SUM, *, timeout=None, recorder=None, step: int = 1
) -> None:
    """Reduce ``sendbuf`` over ranks with ``op`` into ``recvbuf`` (``MPI_Allreduce``).

    Args:
        comm: an ``mpi4py.MPI.Intracomm``.
        sendbuf, recvbuf: arrays, or ``[array, MPI datatype]`` specs, as for
            ``comm.Allreduce``.
        op: an ``MPI.Op`` (user-defined ones included).
        timeout: seconds to wait before this rank reports what it waits for and aborts
            the job (``comm.Abort``); None: ``MPICOMP_TIMEOUT``, unset or 0: off.
        recorder: gets ``record("mpi.allreduce", step, nbytes, nbytes, 8 * itemsize)``.
        step: which message of a sum sent in several (chunks) this is, from 1.
    """
    nbytes = _array(recvbuf).nbytes
    issue(
        comm,
        MPI.Comm.Allreduce,
        MPI.Comm.Iallreduce,
        sendbuf,
        recvbuf,
        op=op,
        timeout=resolve_timeout(timeout),
        name="allreduce",
        detail=lambda: f"an Iallreduce of {nbytes} bytes over all {comm.size} ranks",
    )
    if recorder is not None:
        a = _array(sendbuf)
        wire = a.nbytes if comm.size > 1 else 0  # one rank sends nothing
        recorder.record("mpi.allreduce", step, wire, wire, 8 * a.itemsize)


def allgather(comm, sendbuf, recvbuf, *, timeout=None, recorder=None) -> None:
    """Gather every rank's ``sendbuf`` into ``recvbuf``, in rank order (``MPI_Allgather``).

    Args:
        comm: an ``mpi4py.MPI.Intracomm``.
        sendbuf: this rank's block; recvbuf: N blocks of its size, as for ``comm.Allgather``.
        timeout: as for ``allreduce``.
        recorder: gets ``record("mpi.allgather", 1, nbytes, (N-1) * nbytes, 8 * itemsize)``.
    """
    nbytes = _array(sendbuf).nbytes
    issue(
        comm,
        MPI.Comm.Allgather,
        MPI.Comm.Iallgather,
        sendbuf,
        recvbuf,
        timeout=resolve_timeout(timeout),
        name="allgather",
        detail=lambda: f"an Iallgather of {nbytes} bytes from each of {comm.size} ranks",
    )
    if recorder is not None:
        sent = nbytes if comm.size > 1 else 0
        recorder.record(
            "mpi.allgather", 1, sent, (comm.size - 1) * nbytes, 8 * _array(sendbuf).itemsize
        )


def alltoall(comm, sendbuf, recvbuf, *, timeout=None, recorder=None) -> None:
    """Send block d of ``sendbuf`` to rank d; block s of ``recvbuf`` gets rank s's block
    for this rank (``MPI_Alltoall``; N equal blocks each).

    ``recorder`` gets ``record("mpi.alltoall", 1, sent, recv, 8 * itemsize)``: the
    bytes of the blocks that leave this rank, and of those that arrive.
    """
    total = _array(sendbuf).nbytes
    issue(
        comm,
        MPI.Comm.Alltoall,
        MPI.Comm.Ialltoall,
        sendbuf,
        recvbuf,
        timeout=resolve_timeout(timeout),
        name="alltoall",
        detail=lambda: f"an Ialltoall of {total} bytes over {comm.size} ranks",
    )
    if recorder is not None:
        moved = total - total // comm.size
        recorder.record("mpi.alltoall", 1, moved, moved, 8 * _array(sendbuf).itemsize)


def reduce_scatter(comm, sendbuf, recvbuf, counts, *, timeout=None, recorder=None) -> None:
    """Sum ``sendbuf`` over ranks; rank r receives elements of block r, ``counts[r]``
    of them (``MPI_Reduce_scatter``).

    ``recorder`` gets ``record("mpi.reduce_scatter", 1, sent, recv, 8 * itemsize)``: the
    bytes of the other ranks' blocks this rank must send, and of the other ranks'
    contributions to its own block (what a pairwise exchange moves).
    """
    total = _array(sendbuf).nbytes
    issue(
        comm,
        MPI.Comm.Reduce_scatter,
        MPI.Comm.Ireduce_scatter,
        sendbuf,
        recvbuf,
        list(counts),
        MPI.SUM,
        timeout=resolve_timeout(timeout),
        name="reduce_scatter",
        detail=lambda: f"an Ireduce_scatter of {total} bytes over {comm.size} ranks",
    )
    if recorder is not None:
        own = _array(recvbuf).nbytes
        recorder.record(
            "mpi.reduce_scatter", 1, total - own, (comm.size - 1) * own, 8 * recvbuf.itemsize
        )


def allgatherv(comm, sendbuf, recvbuf, counts, *, timeout=None, recorder=None) -> None:
    """Gather every rank's ``sendbuf`` (``counts[r]`` elements from rank r) into
    ``recvbuf`` end to end, in rank order (``MPI_Allgatherv``).

    ``recorder`` gets ``record("mpi.allgatherv", 1, own, others, 8 * itemsize)``: this
    rank's block, and the other ranks' blocks.
    """
    counts = list(counts)
    displs = [sum(counts[:r]) for r in range(len(counts))]
    total = _array(recvbuf).nbytes
    issue(
        comm,
        MPI.Comm.Allgatherv,
        MPI.Comm.Iallgatherv,
        sendbuf,
        [recvbuf, (counts, displs)],
        timeout=resolve_timeout(timeout),
        name="allgatherv",
        detail=lambda: f"an Iallgatherv of {total} bytes over {comm.size} ranks",
    )
    if recorder is not None:
        own = _array(sendbuf).nbytes if comm.size > 1 else 0
        others = total - _array(sendbuf).nbytes
        recorder.record("mpi.allgatherv", 1, own, others, 8 * recvbuf.itemsize)


def bcast(comm, buf, root: int = 0, *, timeout=None) -> None:
    """Give every rank rank ``root``'s ``buf``, in place (``MPI_Bcast``).

    ``timeout``: as for ``allreduce``.
    """
    nbytes = _array(buf).nbytes
    issue(
        comm,
        MPI.Comm.Bcast,
        MPI.Comm.Ibcast,
        buf,
        root=root,
        timeout=resolve_timeout(timeout),
        name="bcast",
        detail=lambda: f"an Ibcast of {nbytes} bytes from rank {root}",
    )


def barrier(comm, *, timeout=None) -> None:
    """Return when every rank of ``comm`` has called this (``MPI_Barrier``).

    ``timeout``: as for ``allreduce``.
    """
    issue(
        comm,
        MPI.Comm.Barrier,
        MPI.Comm.Ibarrier,
        timeout=resolve_timeout(timeout),
        name="barrier",
        detail=lambda: f"an Ibarrier of {comm.size} ranks",
    )


def bcast_object(comm, obj, root: int = 0, *, timeout=None):
    """Return rank ``root``'s ``obj`` on every rank (pickled: its size, then its bytes,
    two ``bcast`` calls), as ``comm.bcast`` does, behind the same timeout."""
    blob = np.frombuffer(pickle.dumps(obj), np.uint8) if comm.rank == root else None
    size = np.array([0 if blob is None else blob.size], np.int64)
    bcast(comm, size, root, timeout=timeout)
    if blob is None:
        blob = np.empty(int(size[0]), np.uint8)
    bcast(comm, blob, root, timeout=timeout)
    return obj if comm.rank == root else pickle.loads(blob.tobytes())


def allgather_object(comm, obj, *, timeout=None) -> list:
    """Return every rank's ``obj``, in rank order (pickled: their sizes, then their bytes
    by ``allgatherv``), as ``comm.allgather`` does, behind the same timeout."""
    mine = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.empty(comm.size, np.int64)
    allgather(comm, np.array([mine.size], np.int64), sizes, timeout=timeout)
    blobs = np.empty(int(sizes.sum()), np.uint8)
    allgatherv(comm, mine, blobs, sizes.tolist(), timeout=timeout)
    ends = np.cumsum(sizes).tolist()
    return [
        pickle.loads(blobs[e - n : e].tobytes()) for n, e in zip(sizes.tolist(), ends, strict=True)
    ]


def gather_object(comm, obj, root: int = 0, *, timeout=None) -> list | None:
    """Return every rank's ``obj`` on rank ``root``, in rank order, and None elsewhere
    (pickled: their sizes by ``MPI_Gather``, then their bytes by ``MPI_Gatherv``), as
    ``comm.gather`` does, behind the same timeout."""
    timeout = resolve_timeout(timeout)
    mine = np.frombuffer(pickle.dumps(obj), np.uint8)
    at_root = comm.rank == root
    sizes = np.empty(comm.size, np.int64) if at_root else None
    issue(
        comm,
        MPI.Comm.Gather,
        MPI.Comm.Igather,
        np.array([mine.size], np.int64),
        sizes,
        root=root,
        timeout=timeout,
        name="gather",
        detail=lambda: f"the sizes (an Igather of 8 bytes from each of {comm.size} ranks)",
    )
    blobs = np.empty(int(sizes.sum()) if at_root else 0, np.uint8)
    recvspec = [blobs, sizes.tolist(), MPI.BYTE] if at_root else None
    issue(
        comm,
        MPI.Comm.Gatherv,
        MPI.Comm.Igatherv,
        [mine, MPI.BYTE],
        recvspec,
        root=root,
        timeout=timeout,
        name="gather",
        detail=lambda: f"the objects (an Igatherv to rank {root} of {comm.size} ranks)",
    )
    if not at_root:
        return None
    ends = np.cumsum(sizes).tolist()
    return [
        pickle.loads(blobs[e - n : e].tobytes()) for n, e in zip(sizes.tolist(), ends, strict=True)
    ]
