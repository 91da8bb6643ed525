"""Sums of float arrays over ranks on mpicomp's ring: float16 (MPI has no float16 sum)
and float32 (where the ring moves bytes faster than the MPI library's all-reduce).

MPICH reduces a user-defined op by recursive doubling: the whole vector log2(N) times
through a Python callback, so float16 needs a ring of its own. For float32, MPI_Allreduce
sends the same 2(N-1)/N of the bytes in fewer messages, but on some networks (TCP with a
link per host, measured in docs/performance.md) its algorithm reaches less of the links
than a ring does; ``schedule="auto"`` measures both (``mpicomp.model.probe``).

Both are a reduce-scatter then an allgather. Chunk c = [c*C, (c+1)*C), C = ceil(n/N), is
summed in the rank order c+1, c+2, ..., N-1, 0, ..., c, each addition one IEEE addition
(float16: in float32, rounded to float16, Inf on overflow), ending at rank c, which
passes it on: every rank gets the same bits.

It is the integer rings' reduce-scatter (``ring.reduce_scatter``) and core
(``bounded.reduce_scatter_allgather``), at 16 or 32 bits per element every step: the
partial sums stay in ``buf`` (``_InPlace``), so messages go out of it and the allgather
fills it in place.
"""

from __future__ import annotations

import numpy as np

from mpicomp.collectives._wait import Exchange, resolve_timeout
from mpicomp.collectives.bounded import Chunks, reduce_scatter_allgather
from mpicomp.collectives.ring import reduce_scatter
from mpicomp.kernels import backend_of

_TAG = 0x1F16  # run on a communicator of your own (comm.Dup())


class _InPlace:
    """Floats (as their bits: uint16 or float32) summed in place by ``add(stream,
    partial)``: each partial sum is kept in ``values``, so what a step sends is a view
    of it, never a copy."""

    def __init__(self, values, add):
        self.values, self.raw, self.add = values, values.view(np.uint8), add
        self.final_width = 8 * values.itemsize

    def width(self, i: int) -> int:
        return self.final_width

    def _bytes(self, lo, hi):
        size = self.values.itemsize
        return self.raw[size * lo : size * hi]

    def pack(self, lo, hi, width, scratch):
        return self._bytes(lo, hi)

    def combine(self, stream, width, lo, hi, out_width, scratch):
        self.add(stream.view(self.values.dtype), self.values[lo:hi])
        return self._bytes(lo, hi)

    def finish(self, stream, width, lo, hi, out) -> None:
        if stream is not None:  # ``out`` is this chunk of ``values`` itself
            self.add(stream.view(self.values.dtype), self.values[lo:hi])


def _flat(buf, dtype, fname: str):
    """Return ``buf`` as a 1-D view (the sum happens in it), or raise what is wrong."""
    if buf.dtype != dtype:
        raise TypeError(f"{fname}: buf must be {np.dtype(dtype).name}, got {buf.dtype}")
    if not buf.flags.c_contiguous:  # reshape would copy, and the sum land in the copy
        raise ValueError(f"{fname}: buf must be C-contiguous (it is summed in place)")
    return buf.reshape(-1)


def _chunks(comm, values: _InPlace) -> Chunks:
    # ceil(n/N) elements a chunk: at 16 or 32 bits every chunk starts on a byte
    n = values.values.size
    return Chunks.of(comm, n, -(-n // comm.Get_size()))


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
    halves = _flat(buf, np.float16, "allreduce_float16").view(np.uint16)
    values = _InPlace(halves, backend_of(buf, kernels).fp16.add)
    # The core straight from here: a gradient reaches MPI in at most six frames.
    exchange = Exchange(comm, resolve_timeout(timeout), "fp16 sum", _TAG)
    chunks = _chunks(comm, values)
    steps = reduce_scatter(values, chunks, values.raw)
    width = values.final_width
    reduce_scatter_allgather(exchange, chunks, steps, values.raw, width, recorder, "fp16")


def allreduce_float32(comm, buf, *, recorder=None, timeout=None, kernels=None) -> None:
    """Sum the float32 array ``buf`` over the ranks of ``comm``, in place, on the ring.

    Arguments as ``allreduce_float16``; traced as ``"f32.reduce_scatter"`` and
    ``"f32.allgather"``, 32 bits per element. A NumPy or device array (its backend's
    ``add``); the sum is the same bits on every rank.
    """
    xp = backend_of(buf, kernels).xp
    flat = _flat(buf, np.float32, "allreduce_float32")
    values = _InPlace(flat, lambda stream, partial: xp.add(partial, stream, out=partial))
    exchange = Exchange(comm, resolve_timeout(timeout), "float32 sum", _TAG)
    chunks = _chunks(comm, values)
    steps = reduce_scatter(values, chunks, values.raw)
    width = values.final_width
    reduce_scatter_allgather(exchange, chunks, steps, values.raw, width, recorder, "f32")
