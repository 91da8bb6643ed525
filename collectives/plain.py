"""The library's own MPI collectives (Allreduce, Allgather) behind the same timeout.

``CompressedComm`` makes two MPI calls outside the hand-written collectives: the
float32/float16 ``MPI_Allreduce`` of ``none``/``fp16`` and signSGD's ``MPI_Allgather`` of
the per-rank scales. These wrappers make them with the blocking call when there is no
timeout, or nonblocking and waited on by ``_wait.wait_all`` when there is one.
"""

from __future__ import annotations

from mpi4py import MPI

from mpicomp.collectives._wait import issue, resolve_timeout


def _array(buf):
    """Return the array of a buffer or of a ``[array, datatype]`` buffer spec."""
    return buf[0] if isinstance(buf, (list, tuple)) else buf


def allreduce(comm, sendbuf, recvbuf, op=MPI.SUM, *, timeout=None, recorder=None) -> None:
    """Reduce ``sendbuf`` over ranks with ``op`` into ``recvbuf`` (``MPI_Allreduce``).

    Args:
        comm: an ``mpi4py.MPI.Intracomm``.
        sendbuf, recvbuf: arrays, or ``[array, MPI datatype]`` specs, as for
            ``comm.Allreduce``.
        op: an ``MPI.Op`` (user-defined ones included).
        timeout: seconds to wait before this rank reports what it waits for and aborts
            the job (``comm.Abort``); None: ``MPICOMP_TIMEOUT``, unset or 0: off.
        recorder: gets ``record("mpi.allreduce", 1, nbytes, nbytes, 8 * itemsize)``.
    """
    nbytes = _array(recvbuf).nbytes
    issue(
        comm,
        "Allreduce",
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
        recorder.record("mpi.allreduce", 1, wire, wire, 8 * a.itemsize)


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
        "Allgather",
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
