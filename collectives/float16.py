"""Sum of float16 arrays over ranks on a ring (MPI has no float16 type).

MPICH reduces a user-defined op by recursive doubling: the whole vector log2(N) times
through a Python callback. This ring, a reduce-scatter then an allgather, sends
2(N-1)/N of it. Chunk c = [c*C, (c+1)*C), C = ceil(n/N), is summed in the rank order
c+1, c+2, ..., N-1, 0, ..., c, each addition in float32 rounded to float16 (Inf on
overflow), ending at rank c, which passes it on: every rank gets the same bits.

It is ``ring.ring_allreduce``, the core of the integer rings, at 16 bits per element
every step: the partial sums stay in ``buf`` (``_Halves``), so messages go out of it
and the allgather fills it in place.
"""

from __future__ import annotations

import numpy as np

from mpicomp.collectives._wait import Exchange, resolve_timeout
from mpicomp.collectives.ring import ring_allreduce
from mpicomp.kernels import backend_of

_TAG = 0x1F16  # run on a communicator of your own (comm.Dup())
_OP = "fp16 sum"


class _Halves:
    """float16 bits (uint16) summed in place: each partial sum is kept in ``halves``,
    so what a step sends is a view of it, never a copy."""

    final_width = 16

    def __init__(self, halves, add):
        self.halves, self.raw, self.add = halves, halves.view(np.uint8), add

    def width(self, i: int) -> int:
        return 16

    def pack(self, lo, hi, width, scratch):
        return self.raw[2 * lo : 2 * hi]

    def combine(self, stream, width, lo, hi, out_width, scratch):
        self.add(stream.view(np.uint16), self.halves[lo:hi])
        return self.raw[2 * lo : 2 * hi]

    def finish(self, stream, width, lo, hi, out) -> None:
        if stream is not None:  # ``out`` is this chunk of ``halves`` itself
            self.add(stream.view(np.uint16), self.halves[lo:hi])


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
    exchange = Exchange(comm, resolve_timeout(timeout), _OP, _TAG)
    halves = buf.reshape(-1).view(np.uint16)
    values = _Halves(halves, backend_of(buf, kernels).fp16.add)
    n = halves.size
    chunk = -(-n // comm.Get_size())  # ceil(n/N): at 16 bits every chunk starts on a byte
    ring_allreduce(comm, exchange, values, n, chunk, values.raw, recorder, "fp16")
