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

Layout, the same on every rank: N chunks, chunk c = [c*C, min(n, (c+1)*C)) with C =
ceil(ceil(n/N) / CHUNK_ALIGN) * CHUNK_ALIGN; chunk boundaries are multiples of 8 elements,
so packed chunks concatenate on byte boundaries at any width. Schedule: at
reduce-scatter step i (1..N-1) rank r sends its partial of chunk (r-i) mod N to r+1 and
receives chunk (r-i-1) mod N from r-1; after N-1 steps rank r owns chunk r. At allgather
step j (1..N-1) it sends chunk (r-j+1) mod N and receives chunk (r-j) mod N, forwarding
the packed bytes unchanged. Empty chunks (n small against N) are still exchanged, as
empty messages, so every rank takes the same 2*(N-1) steps.

Callers should pass a communicator of their own (``CompressedComm`` keeps a ``Dup()``):
messages use a fixed tag and would otherwise be matched against the user's.

With a timeout (``timeout=`` or ``MPICOMP_TIMEOUT``, see ``_wait``) each step is an
Irecv/Isend pair and the agreement an Iallreduce, waited on by ``_wait.wait_all``;
without one they are the blocking Sendrecv and Allreduce.

``ring_allreduce_bounded`` and ``ring_allreduce_min`` check their arguments and agree on
them across ranks (one Allreduce, and a min/max pass over the codes) before the ring
runs; with ``checked=False`` they run the same ring for a caller that has agreed already
(``CompressedComm``: one agreement per call).

One core, ``ring_allreduce``, runs every ring (float16 sums in ``float16.py`` too); what
moves is the caller's, through a *values* object (``_Sums``, ``_Votes``, ``_Minima``). A
public function calls the core, and the core calls ``exchange``, the ``_wait.Exchange``
that calls MPI: three frames from the public function to the library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from mpicomp.collectives._wait import Exchange, issue, resolve_timeout
from mpicomp.kernels import backend_of
from mpicomp.kernels.bits import MAX_WIDTH
from mpicomp.kernels.bits import packed_size as _packed

#: Chunk boundaries fall on multiples of this many elements; a multiple of 8, so a packed
#: chunk starts on a byte boundary at any width. Tests raise it to move the chunk edges.
CHUNK_ALIGN = 8

_TAG = 0x3C3  # one tag for both phases: MPI keeps messages between two ranks in order

_RS, _AG = "reduce_scatter", "allgather"


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


# --- the core -----------------------------------------------------------------------------


def ring_allreduce(comm, exchange, values, n: int, chunk: int, out, recorder, name: str) -> None:
    """Reduce ``values`` around the ring, then allgather: ``out`` gets the whole result.

    The values stay with the caller: the core asks ``values`` for them one chunk
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

    Args:
        comm: the communicator; rank r talks to (r+1) % N and (r-1) % N only.
        exchange: ``exchange(sendbuf, dest, recvbuf, source, phase, step)``, one step's
            messages (a ``_wait.Exchange``: blocking, or with a timeout).
        values: as above.
        n: the number of values, the same on every rank.
        chunk: C, the elements per chunk: chunk c is [c*C, min(n, (c+1)*C));
            C * final_width must be a multiple of 8 (chunks start on whole bytes).
        out: uint8, packed_size(n, final_width) bytes: receives the result.
        recorder: None, or an object with ``record(op, step, sent, recv, bits)``.
        name: prefix of the traced op names.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    final_width = values.final_width

    def span(c):
        c %= size
        return min(n, c * chunk), min(n, (c + 1) * chunk)

    def region(c):  # chunk c's bytes in ``out``
        lo, hi = span(c)
        start = lo * final_width // 8
        return start, start + _packed(hi - lo, final_width)

    if size == 1:
        start, stop = region(rank)
        values.finish(None, 0, 0, n, out[start:stop])
        return
    # Buffers for the whole call, sized for the widest step: no allocation inside the loop.
    xp = backend_of(out).xp
    longest = min(chunk, n)
    widest = max(values.width(i) for i in range(1, size))
    scratch = xp.empty(_packed(longest, widest), dtype=np.uint8)
    recvbuf = xp.empty(_packed(longest, widest), dtype=np.uint8)

    lo, hi = span(rank - 1)
    width = values.width(1)
    message = values.pack(lo, hi, width, scratch[: _packed(hi - lo, width)])
    for i in range(1, size):  # reduce-scatter: after step N-1 rank r owns chunk r
        width = values.width(i)
        s_lo, s_hi = span(rank - i)
        r_lo, r_hi = span(rank - i - 1)
        sent, got = _packed(s_hi - s_lo, width), _packed(r_hi - r_lo, width)
        exchange(message, right, recvbuf[:got], left, _RS, i)
        if recorder is not None:
            recorder.record(f"{name}.{_RS}", i, sent, got, width)
        if i < size - 1:  # the chunk just completed over i+1 ranks is the next one sent
            nxt = values.width(i + 1)
            to = scratch[: _packed(r_hi - r_lo, nxt)]
            message = values.combine(recvbuf[:got], width, r_lo, r_hi, nxt, to)
        else:  # r_lo, r_hi is this rank's own chunk, now reduced over every rank
            start, stop = region(rank)
            values.finish(recvbuf[:got], width, r_lo, r_hi, out[start:stop])
    for j in range(1, size):  # allgather: forward chunk r-j+1 unchanged, receive r-j in place
        s_start, s_stop = region(rank - j + 1)
        r_start, r_stop = region(rank - j)
        exchange(out[s_start:s_stop], right, out[r_start:r_stop], left, _AG, j)
        if recorder is not None:
            recorder.record(f"{name}.{_AG}", j, s_stop - s_start, r_stop - r_start, final_width)


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

    def __init__(self, codes, p: Plan, be):
        self.codes, self.p, self.bits = codes, p, be.bits
        self.final_width = p.final_width

    def width(self, i: int) -> int:
        return bits_for(i * self.p.span)

    def pack(self, lo, hi, width, scratch):
        self.bits.pack_shifted(self.codes[lo:hi], self.p.shift, width, scratch)
        return scratch

    def combine(self, stream, width, lo, hi, out_width, scratch):
        self.bits.add_repack(stream, width, self.codes[lo:hi], self.p.shift, out_width, scratch)
        return scratch


class _Votes(_Sums):
    """Votes (0 or 1) counted as sums; the owner turns its chunk's counts into decisions."""

    def __init__(self, codes, p: Plan, be, fname: str):
        super().__init__(codes, p, be)
        self.xp, self.fname = be.xp, fname

    def finish(self, stream, width, lo, hi, out) -> None:
        if stream is None:
            counts = self.codes[lo:hi].astype(np.int64)
        else:
            counts = self.xp.empty(hi - lo, dtype=np.int64)
            self.bits.add_unpack(stream, width, self.codes[lo:hi], 0, counts)
        decided(self.p, counts, lo, out, self.fname)


class _Minima(_Packed):
    """Unsigned codes of ``width`` bits, combined by MIN: every step at that width."""

    def __init__(self, codes, width: int, be):
        self.codes, self.final_width, self.bits = codes, width, be.bits

    def width(self, i: int) -> int:
        return self.final_width

    def pack(self, lo, hi, width, scratch):
        self.bits.pack_shifted(self.codes[lo:hi], 0, width, scratch)
        return scratch

    def combine(self, stream, width, lo, hi, out_width, scratch):
        self.bits.min_repack(stream, width, self.codes[lo:hi], scratch)
        return scratch


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


def _min_claim(codes, width, fname: str) -> Claim:
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


def agree(comm, fname: str, claim: Claim, timeout=None) -> tuple[Any, int]:
    """Check, in one Allreduce(MAX) of 10 int64, what every rank must agree on; return
    the agreed (codes, bound or width).

    Agreed: no rank rejected its arguments, equal n, equal bound (width), equal mode,
    and every code of every rank inside ``claim.allowed``. A rank whose own arguments
    are invalid raises its error after taking part; the others raise ValueError, the
    same on every rank.
    """
    rank = comm.Get_rank()
    vec = np.zeros(10, dtype=np.int64)
    param, pname, allowed = claim.param, claim.pname, claim.allowed
    if claim.err is not None:
        vec[8] = rank + 1  # MAX names the highest rank at fault
    else:
        n, lo, hi = claim.codes.size, claim.lo, claim.hi
        out_of_range = lo < allowed[0] or hi > allowed[1]
        # Extremes may exceed int64 (uint64 codes): clip, they are only compared to allowed.
        hi, lo = min(hi, int(_I64.max)), max(lo, -int(_I64.max))
        vec[:8] = [n, -n, param, -param, claim.mode, -claim.mode, hi, -lo]
        vec[9] = rank + 1 if out_of_range else 0
    detail = f"agreement (an Iallreduce of {vec.nbytes} bytes over all {comm.Get_size()} ranks)"
    issue(
        comm, "Allreduce", MPI.IN_PLACE, vec, op=MPI.MAX, timeout=timeout, name=fname, detail=detail
    )
    if claim.err is not None:
        raise claim.err
    if vec[8]:
        raise ValueError(f"{fname}: rank {vec[8] - 1} rejected its arguments (see its error)")
    if vec[0] != -vec[1]:
        raise ValueError(f"{fname}: ranks disagree on the length of codes: {-vec[1]} vs {vec[0]}")
    if vec[2] != -vec[3]:
        raise ValueError(f"{fname}: ranks disagree on {pname}: {-vec[3]} vs {vec[2]}")
    if vec[4] != -vec[5]:
        raise ValueError(f"{fname}: ranks disagree on signed/majority")
    if vec[9]:
        raise ValueError(
            f"{fname}: codes lie in [{-vec[7]}, {vec[6]}] across ranks (rank {vec[9] - 1} "
            f"among them), outside the allowed [{allowed[0]}, {allowed[1]}] for {pname}={param}"
        )
    return claim.codes, param


# --- public wrappers ----------------------------------------------------------------------


def ring_allreduce_bounded(
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
):
    """Sum bounded integer codes over ranks, or take their majority, on a width-growing ring.

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
    fname = "ring_allreduce_bounded"
    timeout = resolve_timeout(timeout)
    size = comm.Get_size()
    if checked:
        claim = bounded_claim(codes, bound, majority, signed, packed, size, fname)
        codes, bound = agree(comm, fname, claim, timeout)
    be = backend_of(codes, kernels)
    p = plan(size, bound, majority, signed, be.xp)
    n = codes.size
    out = be.xp.empty(_packed(n, p.final_width), dtype=np.uint8)
    values = _Votes(codes, p, be, fname) if p.majority else _Sums(codes, p, be)
    exchange = Exchange(comm, timeout, fname, _TAG)
    ring_allreduce(comm, exchange, values, n, chunk_size(n, size), out, recorder, "ring")
    return unpacked(out, n, p, size, packed, be)


def ring_allreduce_min(
    comm, codes, width, *, dtype=np.int64, recorder=None, timeout=None, checked=True, kernels=None
):
    """Take the elementwise minimum over ranks of unsigned codes, ``width`` bits on the wire.

    Args:
        comm: an ``mpi4py.MPI.Comm`` (intracommunicator), best a private ``Dup()``.
        codes: 1-D integer array, the same length on every rank, each in [0, 2**width).
        width: bits per code, 1..32, the same on every rank.
        dtype: integer dtype of the result; it must hold every code (default int64).
        recorder: None, or an object with ``record(op, step, sent, recv, bits)``; called
            once per step with ops ``"ring_min.reduce_scatter"`` and ``"ring_min.allgather"``.
        timeout, checked, kernels: as for ``ring_allreduce_bounded`` (unchecked codes must
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
        codes, width = agree(comm, fname, _min_claim(codes, width, fname), timeout)
    be = backend_of(codes, kernels)
    n = codes.size
    out = be.xp.empty(_packed(n, width), dtype=np.uint8)
    exchange = Exchange(comm, timeout, fname, _TAG)
    chunk = chunk_size(n, comm.Get_size())
    ring_allreduce(comm, exchange, _Minima(codes, width, be), n, chunk, out, recorder, "ring_min")
    result = be.xp.empty(n, dtype=dtype)
    be.bits.unpack_shifted(out, width, 0, result)
    return result
