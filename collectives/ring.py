"""Bit-width-growing ring all-reduce of bounded integer codes (paper 003 §3, generalized).

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from mpicomp.collectives._wait import issue, resolve_timeout, sendrecv
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


def _ring_allreduce(
    comm,
    exchange: Callable,
    n: int,
    be,
    width_of_step: Callable[[int], int],
    pack_mine: Callable,
    combine: Callable,
    finish: Callable,
    final_width: int,
    recorder,
    name: str,
):
    """Reduce this rank's values around the ring; return the packed allgathered result.

    The values stay with the caller: the core only asks for them through the callbacks,
    which run fused kernels on one chunk [lo, hi) at a time (no full-length temporary).

    Args:
        comm: the communicator; rank r talks to (r+1) % N and (r-1) % N only.
        exchange: ``exchange(sendbuf, dest, recvbuf, source, phase, step)`` moves one
            step's messages (``exchanger`` builds it: blocking or with a timeout).
        n: the number of values, the same on every rank.
        be: the kernel backend record owning the values.
        width_of_step: bits per element of a partial over i ranks (reduce-scatter step i).
        pack_mine: ``pack_mine(lo, hi, width, out_uint8)`` packs this rank's values.
        combine: ``combine(stream, width, lo, hi, out_width, out_uint8)`` packs the
            partials received in ``stream`` (``width`` bits) combined with this rank's.
        finish: ``finish(stream, width, lo, hi, out_uint8)`` writes the owned chunk,
            reduced over all ranks, into ``out`` at ``final_width`` bits per element;
            ``stream`` is None on a ring of one (this rank's values are the result).
        final_width: bits per element of the allgather phase.
        recorder: None, or an object with ``record(op, step, sent, recv, bits)``.
        name: prefix of the traced op names.

    Returns:
        uint8 array of packed_size(n, final_width) bytes: the whole reduced vector.
    """
    xp = be.xp
    size, rank = comm.Get_size(), comm.Get_rank()
    C = chunk_size(n, size)
    longest = min(C, n)
    right, left = (rank + 1) % size, (rank - 1) % size

    def span(c):
        c %= size
        return min(n, c * C), min(n, (c + 1) * C)

    # Chunk c of the result starts at byte c*C*final_width/8: C is a multiple of 8.
    out = xp.empty(_packed(n, final_width), dtype=np.uint8)

    def region(c):
        lo, hi = span(c)
        start = lo * final_width // 8
        return start, start + _packed(hi - lo, final_width)

    # Buffers for the whole call, sized for the widest step: no allocation inside the loop.
    widest = max((width_of_step(i) for i in range(1, size)), default=0)
    sendbuf = xp.empty(_packed(longest, widest), dtype=np.uint8)
    recvbuf = xp.empty(_packed(longest, widest), dtype=np.uint8)

    if size > 1:
        lo, hi = span(rank - 1)
        width = width_of_step(1)
        pack_mine(lo, hi, width, sendbuf[: _packed(hi - lo, width)])
    else:
        start, stop = region(rank)
        finish(None, 0, 0, n, out[start:stop])
    for i in range(1, size):
        width = width_of_step(i)
        s_lo, s_hi = span(rank - i)
        r_lo, r_hi = span(rank - i - 1)
        sent, got = _packed(s_hi - s_lo, width), _packed(r_hi - r_lo, width)
        exchange(sendbuf[:sent], right, recvbuf[:got], left, _RS, i)
        if recorder is not None:
            recorder.record(f"{name}.{_RS}", i, sent, got, width)
        if i < size - 1:  # the chunk just completed over i+1 ranks is the next one sent
            nxt = width_of_step(i + 1)
            combine(recvbuf[:got], width, r_lo, r_hi, nxt, sendbuf[: _packed(r_hi - r_lo, nxt)])
        else:  # r_lo, r_hi is this rank's own chunk, now reduced over every rank
            start, stop = region(rank)
            finish(recvbuf[:got], width, r_lo, r_hi, out[start:stop])

    allgather_chunks(comm, exchange, out, region, final_width, recorder, name)
    return out


def allgather_chunks(comm, exchange: Callable, out, region: Callable, width: int, recorder, name):
    """Complete ``out`` around the ring: this rank holds chunk r of it, packed in place.

    At step j (1..N-1) rank r forwards chunk (r - j + 1) mod N to r + 1 unchanged and
    receives chunk (r - j) mod N from r - 1 into its place; ``region(c)`` gives the
    [start, stop) bytes of chunk c in ``out``, ``width`` its bits per element (traced).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    for j in range(1, size):
        s_start, s_stop = region(rank - j + 1)
        r_start, r_stop = region(rank - j)
        exchange(out[s_start:s_stop], right, out[r_start:r_stop], left, _AG, j)
        if recorder is not None:
            recorder.record(f"{name}.{_AG}", j, s_stop - s_start, r_stop - r_start, width)


def exchanger(comm, timeout: float | None, op: str, tag: int = _TAG) -> Callable:
    """Return ``exchange(sendbuf, dest, recvbuf, source, phase, step)``: one step's
    ``Sendrecv`` (with a timeout, an Irecv/Isend pair that reports what it waited for)."""

    def exchange(sendbuf, dest, recvbuf, source, phase, step):
        sendrecv(
            comm,
            sendbuf,
            dest,
            recvbuf,
            source,
            tag,
            timeout=timeout,
            name=op,
            detail=lambda: (
                f"{phase} step {step} of {comm.Get_size() - 1}: receiving {recvbuf.nbytes} "
                f"bytes from rank {source} and sending {sendbuf.nbytes} bytes to rank {dest}"
            ),
        )

    return exchange


# --- argument checks, agreed across ranks -------------------------------------------------


def _as_codes(codes, fname: str, kernels=None):
    """Return ``codes`` as a contiguous 1-D integer array of its backend, and the backend."""
    try:
        be = backend_of(codes, kernels)
    except TypeError:  # a list or another sequence: made a NumPy array
        codes = np.asarray(codes)
        be = backend_of(codes, kernels)
    codes = be.xp.asarray(codes)
    if not np.issubdtype(codes.dtype, np.integer):
        raise TypeError(f"{fname}: codes must have an integer dtype, got {codes.dtype!r}")
    if codes.ndim != 1:
        raise ValueError(f"{fname}: codes must be 1-D, got shape {codes.shape!r}")
    return be.xp.ascontiguousarray(codes), be


def _as_int(value, what: str, fname: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fname}: {what} must be an integer, got {value!r}")
    return int(value)


def _extremes(codes) -> tuple[int, int]:
    """Return (min, max) of ``codes`` as Python ints; (0, 0) when empty."""
    if codes.size == 0:
        return 0, 0
    return int(codes.min()), int(codes.max())


_I64 = np.iinfo(np.int64)


def _agree(comm, fname, err, n, param, pname, mode, lo, hi, allowed, timeout=None):
    """Check, in one Allreduce(MAX) of 10 int64, what every rank must agree on.

    Agreed: no rank rejected its arguments (``err``), equal n, equal ``param`` (bound or
    width), equal mode, and every code of every rank inside ``allowed`` = (min, max). The
    same ValueError is raised on every rank where another rank is at fault.
    """
    rank = comm.Get_rank()
    vec = np.zeros(10, dtype=np.int64)
    if err is not None:
        vec[8] = rank + 1  # MAX names the highest rank at fault
    else:
        out_of_range = lo < allowed[0] or hi > allowed[1]
        # Extremes may exceed int64 (uint64 codes): clip, they are only compared to allowed.
        hi, lo = min(hi, int(_I64.max)), max(lo, -int(_I64.max))
        vec[:8] = [n, -n, param, -param, mode, -mode, hi, -lo]
        vec[9] = rank + 1 if out_of_range else 0
    detail = f"agreement (an Iallreduce of {vec.nbytes} bytes over all {comm.Get_size()} ranks)"
    issue(
        comm, "Allreduce", MPI.IN_PLACE, vec, op=MPI.MAX, timeout=timeout, name=fname, detail=detail
    )
    if err is not None:
        raise err
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


# --- public wrappers ----------------------------------------------------------------------

_MODE_SIGNED, _MODE_UNSIGNED, _MODE_MAJORITY = 0, 1, 2


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
    args = (majority, signed, packed, fname, timeout)
    x, b, be = bounded_arguments(comm, codes, bound, *args, checked, kernels)
    return _bounded(comm, x, b, majority, signed, packed, recorder, timeout, be, fname)


def bounded_arguments(
    comm, codes, bound, majority, signed, packed, fname: str, timeout, checked, kernels
):
    """Return (codes, bound, kernel backend record) of a bounded sum or majority.

    With ``checked``, the arguments are checked and agreed on across ranks (one Allreduce
    of 10 int64), and codes come back as a contiguous 1-D array; a problem raises what
    ``ring_allreduce_bounded`` documents, on every rank. Without, they come back as given.
    """
    if not checked:
        return codes, bound, backend_of(codes, kernels)
    size = comm.Get_size()
    err, x, be, n, b, lo, hi, mode = None, None, None, 0, 0, 0, 0, _MODE_SIGNED
    try:
        x, be = _as_codes(codes, fname)
        n = x.size
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
    _agree(comm, fname, err, n, b, "bound", mode, lo, hi, allowed, timeout)
    return x, b, backend_of(x, kernels)


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


def _bounded(comm, x, b, majority, signed, packed, recorder, timeout, be, fname):
    """The width-growing ring of ``ring_allreduce_bounded`` over agreed arguments."""
    size = comm.Get_size()
    p = plan(size, b, majority, signed, be.xp)
    # Codes travel shifted into [0, span]; the kernels add the shift as they read them.
    shift, final_width = p.shift, p.final_width
    xp = be.xp
    bits = be.bits

    def pack_mine(lo, hi, width, out):
        bits.pack_shifted(x[lo:hi], shift, width, out)

    def combine(stream, width, lo, hi, out_width, out):
        bits.add_repack(stream, width, x[lo:hi], shift, out_width, out)

    if p.majority:

        def finish(stream, width, lo, hi, out):
            if stream is None:
                counts = x[lo:hi].astype(np.int64)
            else:
                counts = xp.empty(hi - lo, dtype=np.int64)
                bits.add_unpack(stream, width, x[lo:hi], 0, counts)
            decided(p, counts, lo, out, fname)

    else:

        def finish(stream, width, lo, hi, out):
            if stream is None:
                pack_mine(lo, hi, final_width, out)
            else:
                combine(stream, width, lo, hi, final_width, out)

    result = _ring_allreduce(
        comm,
        exchanger(comm, timeout, fname),
        x.size,
        be,
        lambda i: bits_for(i * p.span),
        pack_mine,
        combine,
        finish,
        final_width,
        recorder,
        "ring",
    )
    return unpacked(result, x.size, p, size, packed, be)


def _paper_majority(xp, nranks: int):
    """Return paper 003's rule: bit = 1 where more than half of ``nranks`` voted +1."""

    def decide(counts, offset):
        return xp.packbits(2 * counts > nranks, bitorder="little")

    return decide


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
    if not checked:
        return _minimum(
            comm, codes, width, dtype, recorder, timeout, backend_of(codes, kernels), fname
        )
    err, n, w, lo, hi = None, 0, 0, 0, 0
    try:
        x, be = _as_codes(codes, fname)
        n = x.size
        w = _as_int(width, "width", fname)
        if not 1 <= w <= MAX_WIDTH:
            raise ValueError(f"{fname}: width must lie in [1, {MAX_WIDTH}], got {w!r}")
        lo, hi = _extremes(x)
    except (TypeError, ValueError) as exc:
        err = exc
    _agree(comm, fname, err, n, w, "width", 0, lo, hi, (0, 2**w - 1), timeout)
    return _minimum(comm, x, w, dtype, recorder, timeout, backend_of(x, kernels), fname)


def _minimum(comm, x, w, dtype, recorder, timeout, be, fname):
    """The constant-width MIN ring of ``ring_allreduce_min`` over agreed arguments."""
    bits = be.bits

    def pack_mine(lo, hi, width, out):
        bits.pack_shifted(x[lo:hi], 0, width, out)

    def smallest(stream, width, lo, hi, out_width, out):
        bits.min_repack(stream, width, x[lo:hi], out)

    def finish(stream, width, lo, hi, out):
        if stream is None:
            pack_mine(lo, hi, w, out)
        else:
            smallest(stream, width, lo, hi, w, out)

    packed = _ring_allreduce(
        comm,
        exchanger(comm, timeout, fname),
        x.size,
        be,
        lambda i: w,
        pack_mine,
        smallest,
        finish,
        w,
        recorder,
        "ring_min",
    )
    result = be.xp.empty(x.size, dtype=dtype)
    bits.unpack_shifted(packed, w, 0, result)
    return result
