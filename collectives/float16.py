"""Sum of float16 arrays over ranks on a ring (MPI has no float16 type).

MPICH reduces a user-defined op by recursive doubling: the whole vector log2(N) times
through a Python callback. This ring, a reduce-scatter then an allgather, sends
2(N-1)/N of it. Chunk c = [c*C, (c+1)*C), C = ceil(n/N), is summed in the rank order
c+1, c+2, ..., N-1, 0, ..., c, each addition in float32 rounded to float16 (Inf on
overflow), ending at rank c, which passes it on: every rank gets the same bits.
"""

from __future__ import annotations

import numpy as np

from mpicomp.collectives._wait import resolve_timeout, sendrecv
from mpicomp.kernels import backend_of

_TAG = 0x1F16  # run on a communicator of your own (comm.Dup())
_OP = "fp16 sum"


def allreduce_float16(comm, buf, *, recorder=None, timeout=None, kernels=None) -> None:
    """Sum the float16 array ``buf`` over the ranks of ``comm``, in place.

    Args:
        comm: an ``mpi4py.MPI.Intracomm``; every rank brings an array of the same size.
        buf: a contiguous float16 array (any shape); it holds the sum on return.
        recorder: gets ``record("fp16.reduce_scatter", i, ...)`` and
            ``record("fp16.allgather", j, ...)`` per step, 16 bits per element.
        timeout: seconds each step may wait before this rank reports what it waits for
            and aborts the job (``comm.Abort``); None: ``MPICOMP_TIMEOUT``, unset or 0: off.
        kernels: the kernel backend record for NumPy arrays (default
            ``mpicomp.kernels.backend()``).
    """
    timeout = resolve_timeout(timeout)
    add = backend_of(buf, kernels).fp16.add
    size, rank = comm.Get_size(), comm.Get_rank()
    bits = buf.reshape(-1).view(np.uint16)
    n = bits.size
    width = -(-n // size)
    right, left = (rank + 1) % size, (rank - 1) % size

    def span(c):
        c %= size
        return min(n, c * width), min(n, (c + 1) * width)

    def exchange(send, recv, phase, step):
        sendrecv(
            comm,
            send,
            right,
            recv,
            left,
            _TAG,
            timeout=timeout,
            name=_OP,
            detail=lambda: (
                f"{phase} step {step} of {size - 1}: receiving {recv.nbytes} bytes from "
                f"rank {left} and sending {send.nbytes} bytes to rank {right}"
            ),
        )
        if recorder is not None:
            recorder.record(f"fp16.{phase}", step, send.nbytes, recv.nbytes, 16)

    recv = backend_of(buf, kernels).xp.empty(width if size > 1 else 0, np.uint16)
    for i in range(1, size):  # reduce-scatter: after step N-1 rank r holds chunk r summed
        (s_lo, s_hi), (r_lo, r_hi) = span(rank - i), span(rank - i - 1)
        got = recv[: r_hi - r_lo]
        exchange(bits[s_lo:s_hi], got, "reduce_scatter", i)
        add(got, bits[r_lo:r_hi])
    for j in range(1, size):  # allgather of the summed chunks, in place
        (s_lo, s_hi), (r_lo, r_hi) = span(rank - j + 1), span(rank - j)
        exchange(bits[s_lo:s_hi], bits[r_lo:r_hi], "allgather", j)
