"""Bit-width-growing ring all-reduce of bounded integer codes (the all-reducible signSGD
paper §3, generalized).

A ring reduce-scatter followed by a ring allgather, over N chunks of the vector. A
partial sum over i ranks of codes bounded by ``bound`` needs only
ceil(log2(2*i*bound + 1)) bits (ceil(log2(i*bound + 1)) for unsigned codes), so the
message of reduce-scatter step i is packed at exactly that width: the width grows
along the ring instead of being fixed at the width of the full sum. With
``majority``, the owner of each chunk turns the vote counts into one decision bit per
element and the allgather moves 1 bit per element (signSGD with majority vote).
``ring_allreduce_min`` runs the same ring at a constant width with MIN as the combine.

All values travel in an unsigned domain: a signed code c becomes c + bound, so a partial
over i ranks is its signed sum plus i*bound, in [0, 2*i*bound]; adding the next rank's
shifted code keeps that invariant, and the owner subtracts N*bound at the end.

The layout is ``bounded.Chunks``. Schedule: at reduce-scatter step i (1..N-1) rank r
sends its partial of chunk (r-i) mod N to r+1 and receives chunk (r-i-1) mod N from
r-1; after N-1 steps rank r owns chunk r. At allgather step j (1..N-1) it sends chunk
(r-j+1) mod N and receives chunk (r-j) mod N, forwarding the packed bytes unchanged
(``bounded.reduce_scatter_allgather``): every rank takes the same 2*(N-1) steps.

Callers should pass a communicator of their own (``CompressedComm`` keeps a ``Dup()``):
messages use a fixed tag and would otherwise be matched against the user's.

With a timeout (``timeout=`` or ``MPICOMP_TIMEOUT``, see ``_wait``) each step is an
Irecv/Isend pair and the agreement an Iallreduce, waited on by ``_wait.wait_all``;
without one they are the blocking Sendrecv and Allreduce.

``ring_allreduce_bounded`` and ``ring_allreduce_min`` check their arguments and agree on
them across ranks (one Allreduce, and a min/max pass over the codes) before the ring
runs; with ``checked=False`` they run the same ring for a caller that has agreed already
(``CompressedComm``: one agreement per call).

The ring's reduce-scatter, ``reduce_scatter``, runs every ring (the float16 and float32
sums of ``float_ring.py`` too); what moves is the caller's, through a *values* object
(``_Sums``, ``_Votes``, ``_Minima``). ``ring_allreduce_bounded`` is
``bounded.allreduce_bounded`` with these steps bound (the direct schedule binds its
own); it and ``ring_allreduce_min`` call the core (``bounded.reduce_scatter_allgather``),
and the core calls ``exchange``, the ``_wait.Exchange`` that calls MPI: three frames
from the public function to the library.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np

from mpicomp.collectives._wait import Exchange, resolve_timeout
from mpicomp.collectives.bounded import (
    Chunks,
    PackedSums,
    Plan,
    ReduceScatter,
    agree,
    all_present,
    allreduce_bounded,
    bits_for,
    decided,
    min_claim,
    reduce_scatter_allgather,
    reduce_scatter_bounded,
)
from mpicomp.kernels import backend_of
from mpicomp.kernels.bits import packed_size as _packed

# PackedSums: what ``ring_allreduce_bounded(..., packed=True)`` returns, named here too.
__all__ = [
    "PackedSums",
    "reduce_scatter",
    "ring_allreduce_bounded",
    "ring_allreduce_min",
    "ring_reduce_scatter_bounded",
]

_TAG = 0x3C3  # one tag for both phases: MPI keeps messages between two ranks in order

_RS = "reduce_scatter"


# --- the ring's reduce-scatter ------------------------------------------------------------


def reduce_scatter(values, chunks: Chunks, out) -> Iterator:
    """Yield the ring's reduce-scatter steps for ``bounded.reduce_scatter_allgather``;
    at the end this rank's chunk, reduced over all ranks, is in its place in ``out``.

    The values stay with the caller: the steps ask ``values`` for them one chunk
    [lo, hi) at a time (fused kernels, no full-length temporary), through

    - ``values.width(i)``: bits per element of a partial over i ranks (reduce-scatter
      step i); ``values.final_width``: bits per element of the result;
    - ``values.pack(lo, hi, width, scratch)``: this rank's values of [lo, hi) at
      ``width`` bits; ``values.combine(stream, width, lo, hi, out_width, scratch)``: the
      partials received in ``stream`` combined with this rank's, at ``out_width`` bits.
      Both return the bytes to send: ``scratch`` filled, or a view of the caller's own
      memory that holds them (a sum kept in place);
    - ``values.finish(stream, width, lo, hi, out)``: this rank's chunk, reduced over all
      ranks, written into its place in ``out`` (``stream`` None on a ring of one).

    Rank r talks to (r+1) % N and (r-1) % N only; ``chunks.chunk * values.final_width``
    must be a multiple of 8 (chunks start on whole bytes).
    """
    n, size, rank = chunks.n, chunks.size, chunks.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    if size == 1:
        start, stop = chunks.region(rank, values.final_width)
        values.finish(None, 0, 0, n, out[start:stop])
        return
    # Buffers for the whole call, sized for the widest step: no allocation inside the loop.
    xp = backend_of(out).xp
    longest = min(chunks.chunk, n)
    widest = max(values.width(i) for i in range(1, size))
    scratch = xp.empty(_packed(longest, widest), dtype=np.uint8)
    recvbuf = xp.empty(_packed(longest, widest), dtype=np.uint8)

    lo, hi = chunks.span(rank - 1)
    width = values.width(1)
    message = values.pack(lo, hi, width, scratch[: _packed(hi - lo, width)])
    for i in range(1, size):  # after step N-1 rank r owns chunk r
        width = values.width(i)
        r_lo, r_hi = chunks.span(rank - i - 1)
        received = recvbuf[: _packed(r_hi - r_lo, width)]
        yield message, right, received, left, _RS, i, width
        if i < size - 1:  # the chunk just completed over i+1 ranks is the next one sent
            nxt = values.width(i + 1)
            to = scratch[: _packed(r_hi - r_lo, nxt)]
            message = values.combine(received, width, r_lo, r_hi, nxt, to)
        else:  # r_lo, r_hi is this rank's own chunk, now reduced over every rank
            start, stop = chunks.region(rank, values.final_width)
            values.finish(received, width, r_lo, r_hi, out[start:stop])


# --- what travels -------------------------------------------------------------------------


class _Packed:
    """Integer codes packed at each step's width; the owner packs the result at
    ``final_width`` the way ``combine`` packs a partial (``pack`` alone on a ring of one)."""

    final_width: int

    def finish(self, stream, width, lo, hi, out) -> None:
        if stream is None:
            self.pack(lo, hi, self.final_width, out)
        else:
            self.combine(stream, width, lo, hi, self.final_width, out)


class _Sums(_Packed):
    """Bounded codes: shifted into [0, span] as they are packed, so a partial over i
    ranks lies in [0, i*span] and travels at bits_for(i*span) bits."""

    def __init__(self, codes, p: Plan, be, ready):
        self.codes, self.p, self.bits, self.ready = codes, p, be.bits, ready
        self.final_width = p.final_width

    def width(self, i: int) -> int:
        return bits_for(i * self.p.span)

    def pack(self, lo, hi, width, scratch):
        self.ready(lo, hi)
        self.bits.pack_shifted(self.codes[lo:hi], self.p.shift, width, scratch)
        return scratch

    def combine(self, stream, width, lo, hi, out_width, scratch):
        self.ready(lo, hi)
        self.bits.add_repack(stream, width, self.codes[lo:hi], self.p.shift, out_width, scratch)
        return scratch


class _Votes(_Sums):
    """Votes (0 or 1) counted as sums; the owner turns its chunk's counts into decisions."""

    def __init__(self, codes, p: Plan, be, ready, fname: str):
        super().__init__(codes, p, be, ready)
        self.xp, self.fname = be.xp, fname

    def finish(self, stream, width, lo, hi, out) -> None:
        self.ready(lo, hi)
        if stream is None:
            counts = self.codes[lo:hi].astype(np.int64)
        else:
            counts = self.xp.empty(hi - lo, dtype=np.int64)
            self.bits.add_unpack(stream, width, self.codes[lo:hi], 0, counts)
        decided(self.p, counts, lo, out, self.fname)


class _Minima(_Packed):
    """Unsigned codes of ``width`` bits, combined by MIN: every step at that width."""

    def __init__(self, codes, width: int, be, ready):
        self.codes, self.final_width, self.bits, self.ready = codes, width, be.bits, ready

    def width(self, i: int) -> int:
        return self.final_width

    def pack(self, lo, hi, width, scratch):
        self.ready(lo, hi)
        self.bits.pack_shifted(self.codes[lo:hi], 0, width, scratch)
        return scratch

    def combine(self, stream, width, lo, hi, out_width, scratch):
        self.ready(lo, hi)
        self.bits.min_repack(stream, width, self.codes[lo:hi], scratch)
        return scratch


# --- public wrappers ----------------------------------------------------------------------


def _bounded_steps(codes, p: Plan, be, chunks: Chunks, out, fname: str, ready) -> Iterator:
    """The ring's reduce-scatter of a bounded sum or majority (``bounded.ReduceScatter``)."""
    values = _Votes(codes, p, be, ready, fname) if p.majority else _Sums(codes, p, be, ready)
    return reduce_scatter(values, chunks, out)


#: ``ring_allreduce_bounded(comm, codes, bound, majority=False, *, signed=True,
#: packed=False, recorder=None, timeout=None, checked=True, kernels=None, ready=None,
#: into=None)``
ring_allreduce_bounded = partial(
    allreduce_bounded, ReduceScatter("ring_allreduce_bounded", "ring", _TAG, _bounded_steps)
)
ring_allreduce_bounded.__doc__ = """Sum bounded integer codes over ranks, or take their majority, on a width-growing ring.

    Args:
        comm: an ``mpi4py.MPI.Comm`` (intracommunicator), best a private ``Dup()``.
        codes: 1-D integer array, the same length on every rank; each |code| <= bound
            (``signed=True``) or 0 <= code <= bound (``signed=False``).
        bound: the largest |code|, >= 1, the same on every rank; the full sum must fit
            32 bits: 2*N*bound < 2**32 (signed) or N*bound < 2**32 (unsigned).
        majority: False (sum); True (signSGD majority: bit = 2*count > N, ties give 0);
            or a callable ``decide(counts_int64_chunk, offset) -> uint8`` returning the
            packed decision bits (LSB-first, ceil(len/8) bytes) of the chunk that starts at
            global index ``offset``. Needs votes: ``signed=False`` and ``bound=1``.
        signed: codes lie in [-bound, bound] when True, in [0, bound] when False.
        packed: return the sums as the ring leaves them, a ``PackedSums`` (no majority),
            instead of unpacking them to int64.
        recorder: None, or an object with ``record(op, step, sent, recv, bits)``; called
            once per step with ops ``"ring.reduce_scatter"`` and ``"ring.allgather"``.
        timeout: seconds each step may wait before this rank reports what it waits for
            and aborts the job (``comm.Abort``); None: ``MPICOMP_TIMEOUT``, unset or 0: off.
        checked: False for a caller whose ranks have agreed already (``CompressedComm``'s
            agreement covers length, bound and mode; its codecs make codes within their
            bound): nothing is checked and no message goes beyond the ring's, so
            ``codes`` must be a contiguous 1-D integer array of one length on every rank.
        kernels: the backend record that computes on NumPy codes (default
            ``mpicomp.kernels.backend()``).
        ready: None, or ``ready(lo, hi)``, called before the schedule first reads
            ``codes[lo:hi]``, in ``Chunks.read_order``: host codes still being copied
            down from a device (``mpicomp.reduction.transport.Staged.ready``).
        into: None, or where the packed result lands (with ``packed`` or
            ``majority``): ``into.buffer(nbytes)`` gives the uint8 buffer the ring
            writes, and ``into.landed(start, stop)`` is told each byte region as it
            becomes final (``mpicomp.reduction.transport.Landing``).

    Returns:
        Without ``majority``: the exact sums, int64, length n, identical on every rank
        (with ``packed``: a ``PackedSums`` holding them).
        With ``majority``: uint8, ceil(n/8) bytes, decision bit i at bit i % 8 of byte
        i // 8, identical on every rank.

    Raises:
        TypeError: codes not an integer array, bound not an integer, majority neither a
            bool nor callable (on the rank at fault; the others raise ValueError).
        ValueError: codes not 1-D, bound < 1, full-sum width above 32 bits, majority with
            signed codes or bound != 1; and on every rank: n, bound or mode differing
            between ranks, or a code outside the bound on any rank.
    """


#: ``ring_reduce_scatter_bounded(comm, codes, bound, majority=False, *, chunk, signed=True,
#: recorder=None, timeout=None, kernels=None)``: the ring's reduce-scatter alone, for
#: agreed codes (``bounded.reduce_scatter_bounded``); rank r gets chunk r.
ring_reduce_scatter_bounded = partial(
    reduce_scatter_bounded,
    ReduceScatter("ring_reduce_scatter_bounded", "ring", _TAG, _bounded_steps),
)


def ring_allreduce_min(
    comm,
    codes,
    width,
    *,
    dtype=np.int64,
    recorder=None,
    timeout=None,
    checked=True,
    kernels=None,
    ready=None,
):
    """Take the elementwise minimum over ranks of unsigned codes, ``width`` bits on the wire.

    Args:
        comm: an ``mpi4py.MPI.Comm`` (intracommunicator), best a private ``Dup()``.
        codes: 1-D integer array, the same length on every rank, each in [0, 2**width).
        width: bits per code, 1..32, the same on every rank.
        dtype: integer dtype of the result; it must hold every code (default int64).
        recorder: None, or an object with ``record(op, step, sent, recv, bits)``; called
            once per step with ops ``"ring_min.reduce_scatter"`` and ``"ring_min.allgather"``.
        timeout, checked, kernels, ready: as for ``ring_allreduce_bounded`` (unchecked codes must
            be contiguous, 1-D, of one length, each in [0, 2**width)).

    Returns:
        array of ``dtype`` (int64 by default) of length n, the minima, identical on every rank.

    Raises:
        TypeError: codes not an integer array, width not an integer (on the rank at
            fault; the others raise ValueError).
        ValueError: codes not 1-D, width outside 1..32; and on every rank: n or width
            differing between ranks, or a code outside [0, 2**width) on any rank.
    """
    fname = "ring_allreduce_min"
    timeout = resolve_timeout(timeout)
    if checked:
        codes, width = agree(comm, fname, min_claim(codes, width, fname), timeout)
    be = backend_of(codes, kernels)
    chunks = Chunks.of(comm, codes.size)
    out = be.xp.empty(_packed(chunks.n, width), dtype=np.uint8)
    exchange = Exchange(comm, timeout, fname, _TAG)
    steps = reduce_scatter(_Minima(codes, width, be, ready or all_present), chunks, out)
    reduce_scatter_allgather(exchange, chunks, steps, out, width, recorder, "ring_min")
    result = be.xp.empty(chunks.n, dtype=dtype)
    be.bits.unpack_shifted(out, width, 0, result)
    return result
