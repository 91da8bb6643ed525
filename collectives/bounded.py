"""What the bounded schedules share (``ring.py``, ``direct.py``): the chunk layout, the
core that runs a reduce-scatter and then the ring allgather, how a bounded sum or
majority travels (``Plan``), and the checks its ranks agree on.

Layout, the same on every rank and schedule: N chunks, chunk c = [c*C, min(n, (c+1)*C))
with C = ceil(ceil(n/N) / CHUNK_ALIGN) * CHUNK_ALIGN; chunk boundaries are multiples of 8
elements, so packed chunks concatenate on byte boundaries at any width. Rank c owns
chunk c. Empty chunks (n small against N) are still exchanged, as empty messages, so
every rank takes the same steps.

The core, ``reduce_scatter_allgather``, calls the exchange of every step itself: a
schedule gives it its reduce-scatter as an iterator of steps (``ring.reduce_scatter``,
``direct``'s alltoall), which packs and combines between them. ``allreduce_bounded`` is
the one body of ``ring_allreduce_bounded`` and ``direct_allreduce_bounded``: each is it
with the schedule's ``ReduceScatter`` bound (a ``partial``, no frame of its own), so the
body, the core and the ``_wait`` frame are the three frames from a schedule to MPI. The
float rings (``float_ring.py``) run the same core with the ring's steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from mpicomp.collectives._wait import Exchange, issue, resolve_timeout
from mpicomp.collectives.agreement import RANK, SAME, SPAN, Form, settle
from mpicomp.kernels import backend_of
from mpicomp.kernels.bits import MAX_WIDTH
from mpicomp.kernels.bits import packed_size as _packed

#: Chunk boundaries fall on multiples of this many elements; a multiple of 8, so a packed
#: chunk starts on a byte boundary at any width. Tests raise it to move the chunk edges.
CHUNK_ALIGN = 8

_AG = "allgather"


class PackedSums(NamedTuple):
    """The result of ``ring_allreduce_bounded(..., packed=True)``, as the ring left it.

    Sum i is (the ``width``-bit code i of ``data``, LSB-first) - ``offset``: hand it to a
    decoder that unpacks as it goes (``QSGDMaxNorm.dequantize_packed``) instead of
    unpacking n int64 sums first.
    """

    data: Any  # uint8, packed_size(n, width) bytes
    n: int
    width: int
    offset: int


# --- layout -------------------------------------------------------------------------------


def bits_for(max_value: int) -> int:
    """Return ceil(log2(max_value + 1)): the bits that hold every integer in [0, max_value]."""
    return int(max_value).bit_length()


def chunk_size(n: int, nranks: int) -> int:
    """Return C, the elements per chunk: ceil(n/N) rounded up to a multiple of CHUNK_ALIGN."""
    align = CHUNK_ALIGN
    if align <= 0 or align % 8:
        raise ValueError(f"CHUNK_ALIGN must be a positive multiple of 8, got {align!r}")
    per_rank = -(-n // nranks)
    return align * -(-per_rank // align)


class Chunks(NamedTuple):
    """The N chunks of n elements, as rank ``rank`` of ``size`` sees them: chunk c is
    [c*chunk, min(n, (c+1)*chunk)), owned by rank c."""

    n: int
    size: int
    rank: int
    chunk: int

    @classmethod
    def of(cls, comm, n: int, chunk: int | None = None) -> Chunks:
        """Return the layout of n elements over ``comm``; ``chunk`` default ``chunk_size``."""
        size = comm.Get_size()
        return cls(n, size, comm.Get_rank(), chunk_size(n, size) if chunk is None else chunk)

    def span(self, c: int) -> tuple[int, int]:
        """Return [lo, hi), the elements of chunk c (taken mod N)."""
        c %= self.size
        return min(self.n, c * self.chunk), min(self.n, (c + 1) * self.chunk)

    def read_order(self) -> list[tuple[int, int]]:
        """Return the chunks' spans in the order this rank's reduce-scatter first reads
        its own codes of them, on either schedule: chunk r-1, r-2, ..., and its own chunk
        r last (a staged caller copies them down in this order, ``ready=``)."""
        return [self.span(self.rank - k) for k in range(1, self.size + 1)]

    def region(self, c: int, width: int) -> tuple[int, int]:
        """Return [start, stop), the bytes of chunk c in a stream packed at ``width`` bits
        (chunk * width is a multiple of 8: every chunk starts on a byte)."""
        lo, hi = self.span(c)
        start = lo * width // 8
        return start, start + _packed(hi - lo, width)


# --- the core -----------------------------------------------------------------------------


def reduce_scatter_allgather(
    exchange,
    chunks: Chunks,
    reduce_scatter: Iterator,
    out,
    width: int,
    recorder,
    name: str,
    landed=None,
) -> None:
    """Run the steps of ``reduce_scatter``, then the ring allgather: ``out`` gets the result.

    Args:
        exchange: ``exchange(sendbuf, dest, recvbuf, source, phase, step)``, one step's
            messages (a ``_wait.Exchange``: blocking, or with a timeout).
        chunks: the layout.
        reduce_scatter: an iterator of steps ``(sendbuf, dest, recvbuf, source, phase,
            step, bits)``: each is exchanged (and recorded) here before the iterator
            resumes and uses what arrived in ``recvbuf``; when it ends, this rank's
            chunk, reduced over every rank, is in its place in ``out``.
        out: uint8, the result packed at ``width`` bits per element
            (``packed_size(n, width)`` bytes); the allgather fills the other chunks.
        recorder: None, or an object with ``record(op, step, sent, recv, bits)``: gets
            ``"{name}.{phase}"`` for each step, then ``"{name}.allgather"``.
        name: prefix of the traced op names.
        landed: None, or ``landed(start, stop)``, called for each byte region of ``out``
            as it becomes final (this rank's chunk, then each chunk the allgather
            brings): a staged caller copies it up meanwhile (``Landing``).
    """
    # The steps' loop is run_steps's, written out: one frame fewer from a gradient to MPI.
    for sendbuf, dest, recvbuf, source, phase, step, bits in reduce_scatter:
        exchange(sendbuf, dest, recvbuf, source, phase, step)
        if recorder is not None:
            recorder.record(f"{name}.{phase}", step, sendbuf.nbytes, recvbuf.nbytes, bits)
    size, rank = chunks.size, chunks.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    if landed is not None:
        landed(*chunks.region(rank, width))
    for j in range(1, size):  # forward chunk r-j+1 unchanged, receive r-j in place
        s_start, s_stop = chunks.region(rank - j + 1, width)
        r_start, r_stop = chunks.region(rank - j, width)
        exchange(out[s_start:s_stop], right, out[r_start:r_stop], left, _AG, j)
        if recorder is not None:
            recorder.record(f"{name}.{_AG}", j, s_stop - s_start, r_stop - r_start, width)
        if landed is not None:
            landed(r_start, r_stop)


def run_steps(exchange, steps: Iterator, recorder, name: str) -> None:
    """Exchange (and record) every step of a reduce-scatter alone
    (``reduce_scatter_bounded``; ``reduce_scatter_allgather`` runs the same loop)."""
    for sendbuf, dest, recvbuf, source, phase, step, bits in steps:
        exchange(sendbuf, dest, recvbuf, source, phase, step)
        if recorder is not None:
            recorder.record(f"{name}.{phase}", step, sendbuf.nbytes, recvbuf.nbytes, bits)


# --- bounded sums and majorities, whatever the schedule -----------------------------------


class Plan(NamedTuple):
    """How a bounded sum or majority travels, whatever the schedule.

    Codes go on the wire shifted by ``shift`` into [0, ``span``]; the sum over N ranks
    is packed at ``final_width`` bits (1 for majority decisions); ``decide`` (majority
    only) turns a chunk's int64 vote counts into its packed decision bits.
    """

    majority: bool
    shift: int
    span: int
    final_width: int
    decide: Callable | None


def plan(size: int, b: int, majority, signed: bool, xp) -> Plan:
    """Return the ``Plan`` of a call over ``size`` ranks with bound ``b``."""
    voting = bool(callable(majority) or majority)
    span = 2 * b if signed else b
    decide = None
    if voting:
        decide = majority if callable(majority) else _paper_majority(xp, size)
    return Plan(voting, b if signed else 0, span, 1 if voting else bits_for(size * span), decide)


def decided(p: Plan, counts, offset: int, out, fname: str) -> None:
    """Write the owner's decision bits of a chunk's ``counts`` (from ``offset``) into ``out``."""
    bits = p.decide(counts, offset)
    bits = backend_of(out).xp.asarray(bits, dtype=np.uint8).reshape(-1)
    if bits.size != out.size:
        raise ValueError(
            f"{fname}: decide returned {bits.size} bytes for {counts.size} elements, "
            f"expected {out.size}"
        )
    out[...] = bits


def unpacked(result, n: int, p: Plan, size: int, packed: bool, be):
    """Return what a bounded call gives back from its allgathered ``result`` stream."""
    if p.majority:
        return result
    offset = size * p.shift
    if packed:
        return PackedSums(result, n, p.final_width, offset)
    sums = be.xp.empty(n, dtype=np.int64)
    be.bits.unpack_shifted(result, p.final_width, offset, sums)
    return sums


def _paper_majority(xp, nranks: int):
    """Return the all-reducible signSGD paper's rule: bit = 1 where more than half of
    ``nranks`` voted +1."""

    def decide(counts, offset):
        return xp.packbits(2 * counts > nranks, bitorder="little")

    return decide


def prepared(comm, codes, bound, majority, signed, packed, timeout, checked, kernels, fname):
    """Return (codes, ``Plan``, backend record) of a bounded sum or majority, its
    arguments checked and agreed across ranks first unless ``checked`` is False (the
    arguments and errors of ``ring.ring_allreduce_bounded``)."""
    size = comm.Get_size()
    if checked:
        claim = bounded_claim(codes, bound, majority, signed, packed, size, fname)
        codes, bound = agree(comm, fname, claim, timeout)
    be = backend_of(codes, kernels)
    return codes, plan(size, bound, majority, signed, be.xp), be


def all_present(lo: int, hi: int) -> None:
    """``ready`` of codes that are all in memory already (host codes; a direct transport)."""


class ReduceScatter(NamedTuple):
    """What a bounded schedule brings to ``allreduce_bounded``: its public name (in errors
    and timeout reports), the prefix of its trace records, its messages' tag, and
    ``steps(codes, plan, backend, chunks, out, fname, ready)``, which returns the iterator
    of its reduce-scatter steps (``reduce_scatter_allgather``'s ``reduce_scatter``) and
    calls ``ready(lo, hi)`` before it first reads ``codes[lo:hi]`` (codes still coming
    down from a device: ``mpicomp.reduction.transport.Staged``)."""

    fname: str
    trace: str
    tag: int
    steps: Callable


def allreduce_bounded(
    schedule: ReduceScatter,
    comm,
    codes,
    bound,
    majority=False,
    *,
    signed=True,
    packed=False,
    recorder=None,
    timeout=None,
    checked=True,
    kernels=None,
    ready=None,
    into=None,
):
    """Sum bounded integer codes over ranks, or take their majority, by ``schedule``'s
    reduce-scatter and the ring allgather: ``ring_allreduce_bounded`` (its docstring
    holds the arguments, result and errors) and ``direct_allreduce_bounded``."""
    fname = schedule.fname
    timeout = resolve_timeout(timeout)
    codes, p, be = prepared(
        comm, codes, bound, majority, signed, packed, timeout, checked, kernels, fname
    )
    if into is not None and not (packed or p.majority):
        raise ValueError(f"{fname}: into= holds the packed result: needs packed or majority")
    chunks = Chunks.of(comm, codes.size)
    nbytes = _packed(chunks.n, p.final_width)
    out = be.xp.empty(nbytes, dtype=np.uint8) if into is None else into.buffer(nbytes)
    exchange = Exchange(comm, timeout, fname, schedule.tag)
    steps = schedule.steps(codes, p, be, chunks, out, fname, ready or all_present)
    landed = None if into is None else into.landed
    reduce_scatter_allgather(
        exchange, chunks, steps, out, p.final_width, recorder, schedule.trace, landed
    )
    return unpacked(out, chunks.n, p, chunks.size, packed, be)


def reduce_scatter_bounded(
    schedule: ReduceScatter,
    comm,
    codes,
    bound,
    majority=False,
    *,
    chunk: int,
    signed=True,
    recorder=None,
    timeout=None,
    kernels=None,
    ready=None,
):
    """The first phase of ``allreduce_bounded`` alone: rank r gets chunk r of the sum
    (or majority) over ranks, chunks of ``chunk`` elements (a multiple of 8).

    For callers that have agreed already (``CompressedComm``; ``checked=False``): the
    codes are a contiguous 1-D integer array of ``size * chunk`` elements on every
    rank, within ``bound``. Returns this rank's chunk as a ``PackedSums`` (``n`` =
    ``chunk``), or with ``majority`` its packed decision bits (``chunk / 8`` bytes).
    Traced as the schedule's reduce-scatter steps, without the allgather's.
    """
    if chunk % 8 or codes.size != comm.Get_size() * chunk:
        raise ValueError(
            f"{schedule.fname}: a reduce-scatter needs size * chunk codes with chunk a "
            f"multiple of 8; got {codes.size} codes, chunk {chunk}"
        )
    timeout = resolve_timeout(timeout)
    codes, p, be = prepared(
        comm, codes, bound, majority, signed, False, timeout, False, kernels, schedule.fname
    )
    chunks = Chunks.of(comm, codes.size, chunk)
    out = be.xp.empty(_packed(chunks.n, p.final_width), dtype=np.uint8)
    exchange = Exchange(comm, timeout, schedule.fname, schedule.tag)
    steps = schedule.steps(codes, p, be, chunks, out, schedule.fname, ready or all_present)
    run_steps(exchange, steps, recorder, schedule.trace)
    start, stop = chunks.region(chunks.rank, p.final_width)
    mine = out[start:stop]
    if p.majority:
        return mine
    return PackedSums(mine, chunk, p.final_width, comm.Get_size() * p.shift)


# --- argument checks, agreed across ranks -------------------------------------------------

_MODE_SIGNED, _MODE_UNSIGNED, _MODE_MAJORITY = 0, 1, 2
_I64 = np.iinfo(np.int64)


class Claim(NamedTuple):
    """What one rank brings to the agreement of a checked call: its arguments as checked
    here (codes a contiguous 1-D integer array), or the error they raised."""

    codes: Any
    param: int  # the bound or the width
    pname: str  # "bound" or "width", for the messages
    mode: int
    lo: int  # the smallest and largest code
    hi: int
    allowed: tuple[int, int]  # the range every code must lie in
    err: Exception | None


def _as_codes(codes, fname: str):
    """Return ``codes`` as a contiguous 1-D integer array of its backend."""
    try:
        xp = backend_of(codes).xp
    except TypeError:  # a list or another sequence: made a NumPy array
        codes = np.asarray(codes)
        xp = backend_of(codes).xp
    codes = xp.asarray(codes)
    if not np.issubdtype(codes.dtype, np.integer):
        raise TypeError(f"{fname}: codes must have an integer dtype, got {codes.dtype!r}")
    if codes.ndim != 1:
        raise ValueError(f"{fname}: codes must be 1-D, got shape {codes.shape!r}")
    return xp.ascontiguousarray(codes)


def _as_int(value, what: str, fname: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fname}: {what} must be an integer, got {value!r}")
    return int(value)


def _extremes(codes) -> tuple[int, int]:
    """Return (min, max) of ``codes`` as Python ints; (0, 0) when empty."""
    if codes.size == 0:
        return 0, 0
    return int(codes.min()), int(codes.max())


def bounded_claim(codes, bound, majority, signed, packed, size: int, fname: str) -> Claim:
    """Check the arguments of a bounded sum or majority on this rank, without messages;
    ``agree`` then compares them across ranks."""
    err, x, b, lo, hi, mode = None, None, 0, 0, 0, _MODE_SIGNED
    try:
        x = _as_codes(codes, fname)
        b = _as_int(bound, "bound", fname)
        if b < 1:
            raise ValueError(f"{fname}: bound must be >= 1, got {b!r}")
        if not (isinstance(majority, (bool, np.bool_)) or callable(majority)):
            raise TypeError(f"{fname}: majority must be a bool or a callable, got {majority!r}")
        if callable(majority) or majority:
            if packed:
                raise ValueError(f"{fname}: packed=True returns sums, not majority decisions")
            if signed or b != 1:
                raise ValueError(
                    f"{fname}: majority needs unsigned votes (signed=False, bound=1), "
                    f"got signed={signed!r}, bound={b!r}"
                )
            mode = _MODE_MAJORITY
        elif not signed:
            mode = _MODE_UNSIGNED
        top = (2 if signed else 1) * size * b
        if bits_for(top) > MAX_WIDTH:
            raise ValueError(
                f"{fname}: sums of bound={b} over N={size} ranks need {bits_for(top)} bits, "
                f"more than {MAX_WIDTH}; use bound <= {(2**MAX_WIDTH - 1) // (top // b)}"
            )
        lo, hi = _extremes(x)
    except (TypeError, ValueError) as exc:
        err = exc
    allowed = (-b, b) if signed else (0, b)
    return Claim(x, b, "bound", mode, lo, hi, allowed, err)


def min_claim(codes, width, fname: str) -> Claim:
    """Check the arguments of a minimum on this rank, without messages."""
    err, x, w, lo, hi = None, None, 0, 0, 0
    try:
        x = _as_codes(codes, fname)
        w = _as_int(width, "width", fname)
        if not 1 <= w <= MAX_WIDTH:
            raise ValueError(f"{fname}: width must lie in [1, {MAX_WIDTH}], got {w!r}")
        lo, hi = _extremes(x)
    except (TypeError, ValueError) as exc:
        err = exc
    return Claim(x, w, "width", 0, lo, hi, (0, 2**w - 1), err)


# What a checked call's ranks agree on: one Allreduce(MAX) of these 10 int64. A rank
# whose arguments were rejected brings only ``failed``.
_ARGUMENTS = Form(numel=SAME, param=SAME, mode=SAME, codes=SPAN, failed=RANK, outside=RANK)


def agree(comm, fname: str, claim: Claim, timeout=None) -> tuple[Any, int]:
    """Check, in one Allreduce(MAX) of 10 int64 (``_ARGUMENTS``), what every rank must
    agree on; return the agreed (codes, bound or width).

    Agreed: no rank rejected its arguments, equal n, equal bound (width), equal mode,
    and every code of every rank inside ``claim.allowed``. A rank whose own arguments
    are invalid raises its error after taking part; the others raise ValueError, the
    same on every rank.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    param, pname, allowed = claim.param, claim.pname, claim.allowed
    if claim.err is not None:
        vec = _ARGUMENTS.reduced(rank, size, failed=True)
    else:
        lo, hi = claim.lo, claim.hi
        outside = lo < allowed[0] or hi > allowed[1]
        # Extremes may exceed int64 (uint64 codes): clip, they are only compared to allowed.
        span = (max(lo, -int(_I64.max)), min(hi, int(_I64.max)))
        n = claim.codes.size
        vec = _ARGUMENTS.reduced(
            rank, size, numel=n, param=param, mode=claim.mode, codes=span, outside=outside
        )
    detail = f"agreement (an Iallreduce of {vec.nbytes} bytes over all {size} ranks)"
    issue(
        comm,
        MPI.Comm.Allreduce,
        MPI.Comm.Iallreduce,
        MPI.IN_PLACE,
        vec,
        op=MPI.MAX,
        timeout=timeout,
        name=fname,
        detail=detail,
    )
    tally = _ARGUMENTS.tally(vec, size)
    settle(
        tally.ranks("failed"),
        claim.err,
        lambda r: ValueError(f"{fname}: rank {r[-1]} rejected its arguments (see its error)"),
    )
    if not tally.agrees("numel"):
        lo, hi = tally.span("numel")
        raise ValueError(f"{fname}: ranks disagree on the length of codes: {lo} vs {hi}")
    if not tally.agrees("param"):
        lo, hi = tally.span("param")
        raise ValueError(f"{fname}: ranks disagree on {pname}: {lo} vs {hi}")
    if not tally.agrees("mode"):
        raise ValueError(f"{fname}: ranks disagree on signed/majority")
    if outside := tally.ranks("outside"):
        lo, hi = tally.span("codes")
        raise ValueError(
            f"{fname}: codes lie in [{lo}, {hi}] across ranks (rank {outside[-1]} "
            f"among them), outside the allowed [{allowed[0]}, {allowed[1]}] for {pname}={param}"
        )
    return claim.codes, param
