"""The ``"sum"`` kind: the float arrays a codec puts on the wire are summed over ranks
(``none``'s float32, ``fp16``'s float16), and the uncompressed float32 sum every codec
falls back to (``schedule="float32"``, below ``min_numel``).

Two schedules: ``"allreduce"`` (float32: the MPI library's MPI_Allreduce; float16:
mpicomp's ring, as MPI has no float16 sum) and ``"ring"`` (mpicomp's ring at the wire's
width, ``collectives.float_ring``), which ``schedule="auto"`` picks where it measures
faster than the MPI library's all-reduce."""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Protocol, runtime_checkable

import numpy as np
from mpi4py import MPI

from mpicomp.codecs.arrays import all_finite, result_range, zero_nonfinite
from mpicomp.collectives import plain
from mpicomp.collectives.float_ring import allreduce_float16, allreduce_float32
from mpicomp.kernels import backend_of
from mpicomp.kernels.readback import batch, read, value_of
from mpicomp.reduction._cost import Cost, mpi_allreduce
from mpicomp.reduction._kind import Kind, Schedule
from mpicomp.reduction.agreement import (
    Call,
    agree,
    causes,
    device,
    down,
    encode_here,
    raise_nonfinite,
    raise_overflow,
    up,
)
from mpicomp.reduction.rows import Rows, check_row
from mpicomp.reduction.transport import CHUNK_BYTES, chunk_bounds

_F32_MAX = float(np.finfo(np.float32).max)


@runtime_checkable
class SumCodec(Protocol):
    """``aggregation = "sum"``: MPI sums the arrays ``to_wire`` makes (float32 or float16);
    ``from_wire`` turns the sum into the average. ``compresses`` is False for ``none``."""

    name: str
    aggregation: str
    compresses: bool

    def to_wire(self, x) -> Any: ...

    def from_wire(self, total, nranks: int = 1, shape=None, reuse: bool = False) -> Any: ...


def run(call: Call, codec, flat, ring: bool = False):
    """Average by the sum over ranks of ``codec.to_wire`` (float32 as it is, or float16):
    MPI_Allreduce for float32, unless ``ring``; mpicomp's ring for float16.

    ``none`` sends its input unchecked: a NaN/Inf on any rank reaches every rank's
    sum, so one pass over the sum tells every rank the same; only then does each
    rank look at its own input (and, under ``"zero"``, the sum is made again).

    A float32 sum of more than one staging chunk (``mpicomp.reduction.transport.chunk_bounds``)
    is one MPI_Allreduce per chunk, in order, on every path, so that ranks staging
    through host memory and ranks that are not send the same messages; staged, its
    copies overlap the chunks' MPI (``Transport.exchange_in_chunks``).
    """
    clock = call.clock
    dev = device(flat)
    wire, flat, err, bad = encode_here(call, codec.to_wire, flat)
    clock.encoded()
    agree(call, flat.size, err, nonfinite=bad)
    # Through collectives.plain: blocking, or nonblocking under MPICOMP_TIMEOUT.
    mpi_sum = partial(plain.allreduce, call.comm, op=MPI.SUM, **call.io)
    bounds = chunk_bounds(wire.size, wire.itemsize, _chunk_bytes(call))
    for again in (False, True):
        if wire.dtype == np.float16:
            # MPI has no float16 sum: mpicomp's ring, in place (this call's own buffer).
            total = down(call, dev, wire, "wire")
            allreduce_float16(call.comm, total, kernels=call.kernels, **call.io)
            finite = _finite(call, total)
        elif ring:
            total = down(call, dev, wire, "wire")
            if total is wire:  # the ring sums in place: never into the caller's array
                total = total.copy()
            allreduce_float32(call.comm, total, kernels=call.kernels, **call.io)
            finite = _finite(call, total)
        elif len(bounds) > 1 and dev is not None and not call.transport.direct:
            # Each chunk's host sum is checked as it arrives: the same values, the same
            # answer as one pass over the whole.
            check = partial(_finite, call)
            total, finite = call.transport.exchange_in_chunks(dev, wire, bounds, mpi_sum, check)
        else:
            send = down(call, dev, wire, "wire")
            total = backend_of(send, call.kernels).xp.empty_like(send)
            for i, (lo, hi) in enumerate(bounds):
                mpi_sum(send[lo:hi], total[lo:hi], step=i + 1)
            finite = _finite(call, total)
        clock.communicated()
        if finite:
            break
        if again:
            raise_overflow(call, codec, "the sum over ranks")
        wire = codec.to_wire(_zeroed(call, codec, flat, wire.dtype))
    # The sum is this call's own buffer (wherever it is, or just copied up): averaged in place.
    out = codec.from_wire(up(dev, total), call.comm.size, reuse=True)
    clock.decoded()
    return out


def scatter(call: Call, codec, flat, mean: bool = True):
    """Return this rank's row (``reduction.rows``) of the average (``mean``) or sum over
    ranks of ``codec.to_wire``: every rank sends row r of its wire array to rank r (one
    MPI_Alltoall, each value crossing once at the wire's width), and the owner adds the
    N rows in float32, in rank order: the same bits whatever the MPI library.

    NaN/Inf are found before any byte moves: ``none`` checks its input in one pass
    (fp16's ``to_wire`` refuses them itself), and the agreement carries the largest
    |x| over ranks: only where N times it could overflow float32 (for ``mean=False``,
    the caller's float16 or bfloat16) do the owners check their rows, and every rank
    raises alike where one overflowed (``rows.check_row``).
    """
    comm, clock, guard = call.comm, call.clock, call.guard
    dev = device(flat)
    wire, flat, err, bad = encode_here(call, codec.to_wire, flat)
    largest = 0.0
    if err is None:
        largest = _largest(call, flat)
        if not math.isfinite(largest):  # none's input: fp16's to_wire refused it above
            if guard.policy == "zero":
                flat = zero_nonfinite(flat)
                wire, largest = codec.to_wire(flat), _largest(call, flat)
            else:
                bad, err = guard.cause, guard.error()
    clock.encoded()
    largest = agree(call, flat.size, err, largest if not bad else 0.0, nonfinite=bad)
    rows = Rows.of(comm, flat.size)
    xp = backend_of(wire, call.kernels).xp
    # Bytes, as unsigned integers of the wire's width: not every MPI library has a
    # float16 datatype, and an alltoall only moves them.
    raw = np.dtype(f"u{wire.dtype.itemsize}")
    send = down(call, dev, rows.padded(xp, wire), "wire").view(raw)
    recv = backend_of(send, call.kernels).xp.empty_like(send)
    plain.alltoall(call.comm, send, recv, **call.io)
    clock.communicated()
    parts = up(dev, recv).view(wire.dtype).reshape(rows.size, rows.width)
    total = parts[0].astype(np.float32)  # a copy: the sum is this call's own buffer
    for part in parts[1:]:
        total += part
    out = codec.from_wire(total, comm.size, reuse=True) if mean else total
    # A mean is at most the largest |x|, which the caller's dtype holds: only its float32
    # sum can overflow. Each addition rounds: the margin.
    limit = _F32_MAX if mean else result_range(call.dtype).limit
    check_row(call, codec, out, largest * comm.size * (1 + 1e-6) > limit, mean)
    clock.decoded()
    return out


def _largest(call: Call, flat) -> float:
    """Return max |flat| on the host (NaN where it holds a NaN; 0 for no elements): one
    counted read on a device."""
    if not flat.size:
        return 0.0
    be = backend_of(flat, call.kernels)
    with batch("reduce_scatter: max |x|"):  # needed now, for the agreement
        largest = be.xp.max(be.xp.abs(flat)).reshape(1)
        host = read(getattr(be, "device", None), largest, "reduce_scatter: max |x|")
    return float(value_of(host)[0])


def _chunk_bytes(call: Call) -> int:
    """Return the staging chunk of ``call`` (the same on every rank and path)."""
    return call.transport.chunk_bytes if call.transport is not None else CHUNK_BYTES


def _zeroed(call: Call, codec, flat, dtype):
    """Return ``flat`` with its NaN/Inf zeroed, for a second sum under ``"zero"``, after
    a sum that was not finite; raise what the policy makes of it otherwise (the same on
    every rank: one byte per rank says whose input held NaN/Inf)."""
    guard = call.guard
    local = guard.cause if not all_finite(flat) else 0
    every = causes(call, local)
    if not any(every):
        raise_overflow(call, codec, "the sum over ranks", dtype=np.dtype(dtype).name)
    if guard.policy != "zero":
        raise_nonfinite(every, local, guard, None, call.comm)
    return zero_nonfinite(flat) if local else flat


def _finite(call: Call, total) -> bool:
    """Return True if the summed wire array holds no NaN/Inf (float16: one SIMD pass)."""
    if total.dtype == np.float16:
        fp16 = backend_of(total, call.kernels).fp16
        return fp16.all_finite(total.reshape(-1).view(np.uint16))
    return all_finite(total, call.kernels)


def _cost(codec, numel: int, nranks: int, payload=None) -> Cost:
    if codec.wire_dtype == np.float32:
        return mpi_allreduce(4 * numel, nranks)
    return _ring_cost(codec, numel, nranks)


def _ring_cost(codec, numel: int, nranks: int, payload=None) -> Cost:
    # collectives.float_ring: 2(N-1) chunks of n/N at the wire's width.
    N, C = nranks, -(-numel // nranks) if numel else 0
    return Cost(2 * (N - 1), 2 * (N - 1) * codec.wire_dtype.itemsize * C)


def _float32_wire(codec) -> bool:
    return getattr(codec, "wire_dtype", None) == np.float32


def by_mpi_allreduce(schedule: str, codec) -> bool:
    """Return whether ``schedule`` of ``codec`` is the MPI library's MPI_Allreduce (whose
    measured efficiency the chooser applies, ``mpicomp.model.Model.mpi_allreduce``)."""
    if schedule == "float32":
        return True
    wire = getattr(codec, "wire_dtype", None)
    return (
        getattr(codec, "aggregation", None) == KIND.name
        and schedule == "allreduce"
        and wire == np.float32
    )


def _compute(codec, speed, numel: int, nranks: int) -> float:
    return (speed.encode + speed.decode) * numel if codec.compresses else 0.0


def _float32_cost(codec, numel: int, nranks: int, payload=None) -> Cost:
    return mpi_allreduce(4 * numel, nranks)


def _no_compute(codec, speed, numel: int, nranks: int) -> float:
    return 0.0


#: The MPI_Allreduce of float32 any codec can fall back to (``run`` with codec ``none``).
FLOAT32 = Schedule(run, _float32_cost, _no_compute, scatter=scatter)

# fp16's float16 sum is a whole-tensor ring of its own: no hierarchy was built for it.
KIND = Kind(
    "sum",
    SumCodec,
    {
        "allreduce": Schedule(run, _cost, _compute, scatter=scatter),
        # float16 goes by the ring under "allreduce" already
        "ring": Schedule(
            partial(run, ring=True), _ring_cost, _compute, fits=_float32_wire, scatter=scatter
        ),
    },
    hierarchical=False,
)
