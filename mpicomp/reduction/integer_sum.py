"""The ``"integer_sum"`` kind (QSGD-MaxNorm): a MaxAllReduce of block norms, [a MinAllReduce
of scale indices], an exact sum of bounded integer codes by the width-growing ring or the
direct reduce-scatter, then dequantize."""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mpicomp.codecs.arrays import result_range
from mpicomp.collectives.maxallreduce import max_allreduce
from mpicomp.collectives.ring import ring_allreduce_min
from mpicomp.kernels import backend_of
from mpicomp.kernels.bits import packed_size
from mpicomp.kernels.readback import batch, read, value_of
from mpicomp.reduction._cost import (
    AGREEMENT_BYTES,
    NOTHING,
    Cost,
    bounded,
    chunk,
    direct_alltoall,
    mpi_allreduce,
    small,
)
from mpicomp.reduction._kind import Kind, bounded_schedules
from mpicomp.reduction.agreement import (
    Call,
    agree,
    device,
    down_by_chunks,
    encode_here,
    landed,
    landing,
    up,
)
from mpicomp.reduction.rows import Rows, check_row, grouped


@runtime_checkable
class IntegerSumCodec(Protocol):
    """``aggregation = "integer_sum"``: integer codes in [-bound, bound] against norms per
    block (``blocks``) shared by MaxAllReduce, summed exactly on the width-growing ring.

    ``shapes`` are the tensors a flat input holds end to end (a fused bucket): blocks do
    not cross them unless the codec is told to. ``multiscale`` says the codec is also a
    ``ScaleIndexCodec``, ``sparse`` that it is a ``SparseCoordinatesCodec``; their methods
    then take the extra arguments those name.
    """

    name: str
    aggregation: str
    bound: int
    multiscale: bool
    sparse: bool

    def local_norm(self, x) -> float: ...

    def local_norms(self, x, shapes=None) -> Any: ...

    def blocks(self, numel: int, shapes=None) -> Any: ...

    def quantize(self, x, norm, step: int = 0, stream: int = 0, shapes=None) -> Any: ...

    def dequantize_packed(
        self, data, n: int, width: int, offset: int, norm, nranks: int = 1, shape=None, shapes=None
    ) -> Any: ...

    def dequantize_span(
        self, data, width: int, offset: int, norm, numel: int, span, nranks: int = 1, shapes=None
    ) -> Any: ...


@runtime_checkable
class ScaleIndexCodec(IntegerSumCodec, Protocol):
    """Refinement: ranks also share one scale index per coordinate (MinAllReduce of
    ``scale_index``, ``index_bits`` each); ``quantize`` and the dequantizers take it."""

    index_bits: int
    index_dtype: np.dtype

    def scale_index(self, x, norm, shapes=None) -> Any: ...


@runtime_checkable
class SparseCoordinatesCodec(IntegerSumCodec, Protocol):
    """Refinement: only ``coordinates(numel, step)`` are quantized, the same on every rank;
    ``local_norm``, ``scale_index``, ``quantize`` and the dequantizers take ``step``
    (``dequantize_packed`` the full ``shape``, ``dequantize_span`` the ``codes`` in the span)."""

    def coordinates(self, numel: int, step: int = 0) -> Any: ...


def _shapes(call: Call, numel: int):
    """Return the shapes of the tensors the call's flat input holds end to end, or None
    (one tensor) where the call names none or others (a hierarchy's shard of a bucket)."""
    shapes = getattr(call, "shapes", None)
    if not shapes or sum(math.prod(s) for s in shapes) != numel:
        return None
    return shapes


def _norms_of(call: Call, codec, shapes, at):
    """Return ``norms(flat)``: this rank's block norms on the host. The norms and the
    kernel's error mask come back in one read; a refused input raises there."""

    def norms(flat):
        with batch("encode"):
            out = codec.local_norms(flat, shapes=shapes, **at)
            device = getattr(backend_of(out, call.kernels), "device", None)
            host = read(device, out, "integer_sum: block norms")
        return value_of(host)

    return norms


def _to_share(norms) -> tuple[float, object]:
    """Return what this rank's host block ``norms`` (None: its encode failed) send: the
    agreement's value and the vector for the MaxAllReduce.

    One block rides in the agreement's value; a rank with several sends +inf there (never
    a norm), and then every rank sends its vector through one MaxAllReduce (which raises
    on every rank if the ranks cut different blocks).
    """
    count = 0 if norms is None else norms.size
    if not count:
        return 0.0, norms
    return (float(norms[0]) if count == 1 else math.inf), norms


def run(call: Call, codec, flat, *, collective, rows=None, mean: bool = True):
    """Average QSGD-MaxNorm codes, their sum made by ``collective`` (the ring's or the
    direct schedule's ``*_allreduce_bounded``); with ``rows`` (a
    ``*_reduce_scatter_bounded``), return this rank's row instead (``scatter``).

    The agreement and the collectives are called from here: a gradient reaches MPI in
    six frames (tests/test_mpi_architecture.py)."""
    comm, clock, step = call.comm, call.clock, call.step
    dev = device(flat)
    shapes = _shapes(call, flat.size)
    at = {"step": step} if codec.sparse else {}  # GlobalRandK: K coordinates drawn per step
    norms, flat, err, bad = encode_here(call, _norms_of(call, codec, shapes, at), flat)
    clock.encoded()
    value, norms = _to_share(norms)
    norm = largest = agree(call, flat.size, err, value, nonfinite=bad)
    if norm == math.inf:  # norms of several blocks: their max over ranks
        norms = max_allreduce(comm, norms, **call.io)
        largest = float(norms.max(initial=0.0))
        norm = up(dev, norms)
    clock.communicated()
    # After the agreement every rank's codes (and scale indices) have one length and lie
    # within their bounds by construction: the collectives trust it (no second agreement).
    extra = ()
    if codec.multiscale:
        sidx = codec.scale_index(flat, norm, shapes=shapes, **at)
        clock.encoded()
        if codec.index_bits:
            sent, ready = down_by_chunks(call, dev, sidx, "index")
            sidx = ring_allreduce_min(
                comm,
                sent,
                codec.index_bits,
                dtype=codec.index_dtype,
                checked=False,
                kernels=call.kernels,
                ready=ready,
                **call.io,
            )
            clock.communicated()
        extra = (up(dev, sidx).astype(codec.index_dtype, copy=False),)
    stream = call.stream + comm.rank
    codes = codec.quantize(flat, norm, *extra, step=step, stream=stream, shapes=shapes)
    clock.encoded()
    if rows is not None:
        return _row(call, codec, rows, mean, (dev, shapes, at, flat, norm, extra, codes, largest))
    # The sums stay packed as the schedule left them; dequantize_packed unpacks as it goes.
    sent, ready = down_by_chunks(call, dev, codes, "codes")
    into = landing(call, dev, "sums")
    data, n, width, offset = collective(
        comm,
        sent,
        codec.bound,
        packed=True,
        checked=False,
        kernels=call.kernels,
        ready=ready,
        into=into,
        **call.io,
    )
    clock.communicated()
    if codec.sparse:
        at = {"shape": flat.shape, **at}
    out = codec.dequantize_packed(
        landed(into, dev, data),
        n,
        width,
        offset,
        norm,
        *extra,
        nranks=comm.size,
        shapes=shapes,
        **at,
    )
    clock.decoded()
    return out


def scatter(call: Call, codec, flat, *, collective, mean: bool = True):
    """Return this rank's row (``reduction.rows``) of the average (``mean``) or sum of
    QSGD-MaxNorm codes: ``run``'s first phase, then ``collective``'s reduce-scatter
    alone (``*_reduce_scatter_bounded``) over the codes grouped by the row they fall in.

    The owner dequantizes its row's sums alone (``dequantize_span``: each element against
    the whole tensor's block norms, found by its index in the tensor): every element of the
    row has the bits ``run`` gives it in the same call.
    """
    return run(call, codec, flat, collective=None, rows=collective, mean=mean)


def _row(call: Call, codec, collective, mean: bool, encoded: tuple):
    """``scatter``'s second phase, from what ``run`` encoded."""
    comm, clock = call.comm, call.clock
    dev, shapes, at, flat, norm, extra, codes, largest = encoded
    # Dequantizing multiplies a sum (at most N times the bound) by the largest norm
    # (then n / K for GlobalRandK, N for a sum): only where that could overflow float32,
    # or the caller's dtype (a bound on the row too), do the owners tell every rank
    # whether their row did (one byte each), as the all-reduce's check of its average,
    # the same on every rank, does.
    sparse = flat.size / max(codes.size, 1) if codec.sparse else 1.0
    risky = largest * comm.size * codec.bound * sparse * (1 if mean else comm.size)
    risky = risky * (1 + 1e-6) > result_range(call.dtype).limit
    rows = Rows.of(comm, flat.size)
    be = backend_of(codes, call.kernels)
    if codec.sparse:  # the codes of row r: the sorted coordinates that fall in it
        where = be.to_host(codec.coordinates(flat.size, call.step), why="coordinates")
        starts = np.searchsorted(
            where, [min(flat.size, r * rows.width) for r in range(rows.size + 1)]
        )
        starts = starts.tolist()
    else:
        starts = [rows.span(r)[0] for r in range(rows.size)] + [flat.size]
    laid, chunk = grouped(be.xp, codes, starts)
    sent, ready = down_by_chunks(call, dev, laid, "codes", chunk)
    data, _, width, offset = collective(
        comm, sent, codec.bound, chunk=chunk, kernels=call.kernels, ready=ready, **call.io
    )
    clock.communicated()
    if codec.sparse:  # this row's codes: lo <= j < hi of the K
        at = {"codes": (starts[comm.rank], starts[comm.rank + 1]), **at}
    # The packed sums of this row's codes (then the chunk's zero padding), decoded alone.
    span = {"numel": flat.size, "span": rows.own, "nranks": comm.size, "shapes": shapes}
    mine = codec.dequantize_span(up(dev, data), width, offset, norm, *extra, **span, **at)
    row = rows.fill(be.xp, mine)
    if not mean:
        row = row * np.float32(comm.size)
    check_row(call, codec, row, risky, mean)
    clock.decoded()
    return row


def _coded(codec, numel: int) -> int:
    return codec.num_coordinates(numel) if codec.sparse else numel


def _norms(codec, numel: int, nranks: int) -> Cost:
    """The block norms' MaxAllReduce, for one tensor of ``numel`` elements (a bucket's
    members add a block each at most); nothing where one norm rides in the agreement.

    Its head is as long as the agreement's; norms past the head's 16 go in a second
    Allreduce, as MPICH runs it: recursive doubling up to 2 KiB, else reduce-scatter and
    allgather (2 log2 N messages, 2 (N-1)/N of the bytes).
    """
    block = codec.params.get("block", 0)
    count = -(-_coded(codec, numel) // block) if block else 1
    if count <= 1 or nranks == 1:
        return NOTHING
    total = small(AGREEMENT_BYTES, nranks)
    tail = 4 * max(0, count - 16)
    if tail:
        total += small(tail, nranks) if tail <= 2048 else mpi_allreduce(tail, nranks)
    return total


def _cost(schedule: str, codec, numel: int, nranks: int, payload=None) -> Cost:
    coded = _coded(codec, numel)
    total = _norms(codec, numel, nranks) + bounded(schedule, coded, nranks, 2 * codec.bound, False)
    if codec.multiscale and codec.index_bits and nranks > 1:
        # The scale index MIN runs on the constant-width ring under either schedule.
        N, C = nranks, chunk(coded, nranks)
        total += Cost(2 * (N - 1), 2 * (N - 1) * packed_size(C, codec.index_bits))
    return total


def _direct_alltoall(codec, numel: int, nranks: int, payload=None) -> int:
    return direct_alltoall(_coded(codec, numel), nranks, 2 * codec.bound)


KIND = Kind(
    "integer_sum", IntegerSumCodec, bounded_schedules(run, _cost, _direct_alltoall, scatter)
)
