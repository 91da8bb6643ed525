"""Allgather of variable-length byte payloads (sparse FFT, 3LC, FastSGD, top-k).

Both variants take the same steps: every rank announces its payload size (one Allgather
of an int64; -1 means "my input is not a 1-D uint8 array", so a bad input raises the
same ValueError on every rank instead of leaving the others waiting: the sizes are the
check's gathered rows, read by ``agreement.settle``), then the bytes
move into one receive buffer, rank after rank, and every rank gets one view per rank.
Both are one body, ``_allgather``, with the variant bound; it makes the MPI calls
itself, through ``_wait.issue`` (the ring's steps through ``_by_ring`` and
``_wait.send_receive``), and the helpers around it only prepare and check.

- ``allgather_bytes``: the bytes move in one ``Allgatherv``; the MPI library picks the
  algorithm. Traces record the logical bytes (what this rank contributes and what it
  gets from the others), not the library's internal traffic.
- ``allgather_bytes_ring``: the same result by a hand-written ring, N-1 steps, each
  forwarding to the right neighbour the payload received from the left one in the
  step before. Traces record the exact bytes of each step.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from mpi4py import MPI

from mpicomp.collectives._wait import issue, resolve_timeout, send_receive
from mpicomp.collectives.agreement import settle
from mpicomp.kernels import backend_of

# Bytes one message may carry: the 32-bit count of MPI before version 4 (mpi4py >= 4
# calls the MPI-4 large-count routines where the library has them). Tests shrink both.
_COUNT_LIMIT = np.iinfo(np.int64).max if MPI.Get_version() >= (4, 0) else 2**31 - 1
# Bytes per ring message: a step's payload is split into messages of at most this.
_RING_CHUNK = 2**31 - 1
_TAG = 0x4147  # ring messages; run on a communicator of your own (comm.Dup())


def _payload_problem(payload) -> TypeError | None:
    """Return why ``payload`` is not a 1-D uint8 array, or None."""
    try:
        xp = backend_of(payload).xp
    except TypeError:
        xp = None
    if xp is None or not isinstance(payload, xp.ndarray):
        return TypeError(f"payload must be a 1-D uint8 array, got {type(payload).__name__}")
    if payload.dtype != np.uint8 or payload.ndim != 1:
        return TypeError(
            f"payload must be a 1-D uint8 array, got dtype {payload.dtype} shape {payload.shape}"
        )
    return None


def _announced(comm, payload) -> tuple[np.ndarray, np.ndarray, TypeError | None]:
    """Return this rank's size message, the buffer of every rank's, and why its payload
    is invalid (-1 and the error when it is, its size and None when not)."""
    problem = _payload_problem(payload)
    mine = np.array([-1 if problem else payload.size], dtype=np.int64)
    return mine, np.empty(comm.size, dtype=np.int64), problem


def _sizes_detail(comm) -> str:
    return f"sizes (an Iallgather of 8 bytes from each of {comm.size} ranks)"


def _received(comm, payload, sizes, problem, recorder, op: str):
    """Check every rank's announced ``sizes``; return (payload, receive buffer,
    displacements), the payload contiguous. Raise on every rank if one rank's input
    is bad."""
    if recorder is not None:
        recorder.record(f"{op}.sizes", 1, 8 if comm.size > 1 else 0, 8 * (comm.size - 1), 64)
    # The sizes are every rank's row of the check: -1 marks a rank at fault.
    settle(np.flatnonzero(sizes < 0).tolist(), problem, partial(_invalid, op), own=False)
    xp = backend_of(payload).xp
    displs = np.zeros(comm.size, dtype=np.int64)
    np.cumsum(sizes[:-1], out=displs[1:])
    buf = xp.empty(int(sizes.sum()), dtype=np.uint8)
    return xp.ascontiguousarray(payload), buf, displs


def _invalid(op: str, bad: list[int]) -> ValueError:
    """The error of every rank when the ranks ``bad`` passed an invalid payload."""
    who = f"rank {bad[0]}" if len(bad) == 1 else f"ranks {', '.join(map(str, bad))}"
    return ValueError(f"{op}: {who} passed an invalid payload (not a 1-D uint8 array)")


def _views(buf, sizes, displs) -> list[np.ndarray]:
    """Return one view of ``buf`` per rank."""
    return [buf[d : d + s] for d, s in zip(displs.tolist(), sizes.tolist(), strict=True)]


def _by_ring(comm, payload, buf, sizes, displs, recorder, op: str, timeout) -> None:
    """Move the bytes around a ring: N-1 steps, each a nonblocking send and receive."""
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    chunk = min(_RING_CHUNK, _COUNT_LIMIT)
    buf[displs[rank] : displs[rank] + sizes[rank]] = payload
    for step in range(1, size):
        # Send what arrived in the step before (own payload first); receive the block
        # one rank further left. Sizes are known, so each side knows its message count.
        out, into = (rank - step + 1) % size, (rank - step) % size
        send = buf[displs[out] : displs[out] + sizes[out]]
        recv = buf[displs[into] : displs[into] + sizes[into]]
        send_receive(
            comm,
            [send[lo : lo + chunk] for lo in range(0, send.size, chunk)],
            right,
            [recv[lo : lo + chunk] for lo in range(0, recv.size, chunk)],
            left,
            _TAG,
            timeout,
            op,
            lambda step=step, got=recv.size, put=send.size: (
                f"data step {step} of {size - 1}: receiving {got} bytes from rank "
                f"{left} and sending {put} bytes to rank {right}"
            ),
        )
        if recorder is not None:
            recorder.record(f"{op}.data", step, int(send.size), int(recv.size), 8)


def _allgather(
    op: str, by_ring: bool, comm, payload, *, recorder=None, timeout=None
) -> list[np.ndarray]:
    """The one body of ``allgather_bytes`` and ``allgather_bytes_ring``: each is it with
    its name and data movement bound (a ``partial``, no frame of its own)."""
    timeout = resolve_timeout(timeout)
    call = partial(issue, comm, timeout=timeout, name=op)  # every message of this call
    mine, sizes, problem = _announced(comm, payload)
    call(MPI.Comm.Allgather, MPI.Comm.Iallgather, mine, sizes, detail=_sizes_detail(comm))
    payload, buf, displs = _received(comm, payload, sizes, problem, recorder, op)
    if by_ring:
        _by_ring(comm, payload, buf, sizes, displs, recorder, op, timeout)
        return _views(buf, sizes, displs)
    total = buf.size
    if total > _COUNT_LIMIT:
        raise ValueError(
            f"{op}: the payloads total {total} bytes, more than MPI %d.%d can count "
            f"({_COUNT_LIMIT}); use allgather_bytes_ring, which splits messages" % MPI.Get_version()
        )
    detail = (
        f"data (an Iallgatherv sending {payload.nbytes} bytes, receiving {buf.nbytes} "
        f"bytes from {comm.size} ranks)"
    )
    recvspec = [buf, sizes, displs, MPI.BYTE]
    call(MPI.Comm.Allgatherv, MPI.Comm.Iallgatherv, payload, recvspec, detail=detail)
    if recorder is not None:
        own = int(sizes[comm.rank])
        recorder.record(f"{op}.data", 1, own if comm.size > 1 else 0, total - own, 8)
    return _views(buf, sizes, displs)


#: ``allgather_bytes(comm, payload, *, recorder=None, timeout=None) -> list[np.ndarray]``
allgather_bytes = partial(_allgather, "allgather", False)
allgather_bytes.__doc__ = """Gather every rank's byte payload on every rank: sizes, then one Allgatherv.

    Args:
        comm: an ``mpi4py.MPI.Intracomm``.
        payload: this rank's bytes, a 1-D uint8 array (any length, zero included).
        recorder: gets ``record("allgather.sizes", 1, 8, 8*(N-1), 64)`` and
            ``record("allgather.data", 1, own size, sum of the others' sizes, 8)``.
        timeout: seconds each message may wait before this rank reports what it waits
            for and aborts the job (``comm.Abort``); None: ``MPICOMP_TIMEOUT``, unset or
            0: off.

    Returns:
        One uint8 view per rank, in rank order (this rank's own included), all into
        one new receive buffer.

    Raises:
        ValueError: on every rank, when some rank's payload is not a 1-D uint8 array
            (those ranks are named; on them the local TypeError is the cause), or the
            total exceeds what this MPI can count (2**31-1 bytes before MPI 4).
    """

#: ``allgather_bytes_ring(comm, payload, *, recorder=None, timeout=None) -> list[np.ndarray]``
allgather_bytes_ring = partial(_allgather, "allgather_ring", True)
allgather_bytes_ring.__doc__ = """Gather every rank's byte payload on every rank by a hand-written ring.

    The same arguments, result and checks as ``allgather_bytes``, without the count
    limit (ring messages are split at ``_RING_CHUNK`` bytes). The recorder gets
    ``record("allgather_ring.sizes", 1, 8, 8*(N-1), 64)`` and, for each step
    i = 1..N-1, ``record("allgather_ring.data", i, sent, received, 8)`` with the exact
    bytes: rank r sends the payload of rank (r-i+1) mod N and receives that of (r-i) mod N.
    """
