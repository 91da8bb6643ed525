"""The ``"majority"`` kind (signSGD with majority vote): one vote per element summed by
the ring or the direct reduce-scatter, each chunk decided by its owner, a ±mean scale."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from mpicomp.codecs.arrays import result_range
from mpicomp.collectives import plain
from mpicomp.kernels import backend_of
from mpicomp.reduction._cost import Cost, bounded, direct_alltoall, small
from mpicomp.reduction._kind import Kind, bounded_schedules
from mpicomp.reduction.agreement import (
    Call,
    agree,
    device,
    down_by_chunks,
    encode_here,
    landed,
    landing,
    raise_result_overflow,
    up,
)
from mpicomp.reduction.rows import Rows, grouped, summed


@runtime_checkable
class MajorityCodec(Protocol):
    """``aggregation = "majority"``: one vote per element (``bound = 1``), summed on the
    ring; each chunk's owner decides with ``majority``; ``expand`` makes the result."""

    name: str
    aggregation: str
    bound: int

    def votes_and_scale(self, x) -> tuple[Any, float]: ...

    def majority(self, counts, nranks: int, step: int = 0, offset: int = 0) -> Any: ...

    def expand(self, bits, n: int, scale: float = 1.0) -> Any: ...


def run(call: Call, codec, flat, *, collective, rows=None, mean: bool = True):
    """Average signs: the votes summed by ``collective`` (the ring's or the direct
    schedule's ``*_allreduce_bounded``), the majority decided by each chunk's owner;
    with ``rows`` (a ``*_reduce_scatter_bounded``), this rank's row instead
    (``scatter``). The agreement and the collectives are called from here: a gradient
    reaches MPI in six frames (tests/test_mpi_architecture.py)."""
    comm, clock, step = call.comm, call.clock, call.step
    dev = device(flat)
    found, flat, err, bad = encode_here(call, codec.votes_and_scale, flat)
    votes, scale = found if err is None else (None, 0.0)
    clock.encoded()
    agree(call, flat.size, err, nonfinite=bad)
    # Every rank's mean |x|, summed in rank order: the same float on every rank.
    scales = np.empty(comm.size, dtype=np.float64)
    plain.allgather(comm, np.array([scale], dtype=np.float64), scales, **call.io)
    scale = float(scales.sum() / comm.size)
    if rows is not None:
        return _row(call, codec, rows, mean, dev, flat, votes, scale)

    def decide(counts, offset):
        return codec.majority(counts, comm.size, step=step, offset=offset)

    # The owners' majority decisions run inside the exchange: charged to comm.
    sent, ready = down_by_chunks(call, dev, votes, "votes")
    into = landing(call, dev, "decisions")
    bits = collective(
        comm,
        sent,
        1,
        majority=decide,
        signed=False,
        checked=False,
        kernels=call.kernels,
        ready=ready,
        into=into,
        **call.io,
    )
    clock.communicated()
    out = codec.expand(landed(into, dev, bits), flat.size, scale)
    clock.decoded()
    return out


def scatter(call: Call, codec, flat, *, collective, mean: bool = True):
    """Return this rank's row (``reduction.rows``) of the majority (times N for the sum):
    ``run``'s votes, ``collective``'s reduce-scatter alone (``*_reduce_scatter_bounded``)
    over rows padded to a multiple of 8 votes, the owner deciding its row with the
    tie-breaks ``run`` draws for the same elements."""
    return run(call, codec, flat, collective=None, rows=collective, mean=mean)


def _row(call: Call, codec, collective, mean: bool, dev, flat, votes, scale: float):
    """``scatter``'s second phase, from ``run``'s votes and agreed scale."""
    comm, clock, step = call.comm, call.clock, call.step
    # The row holds ±scale (times N for a sum), the same on every rank.
    if scale * (1 if mean else comm.size) > result_range(call.dtype).limit:
        raise_result_overflow(call, codec, summed(mean))
    rows = Rows.of(comm, flat.size)
    xp = backend_of(votes, call.kernels).xp
    laid, chunk = grouped(xp, votes, [rows.span(r)[0] for r in range(rows.size)] + [flat.size])

    def decide(counts, offset):  # offset: the chunk's start among the padded rows
        return codec.majority(
            counts, comm.size, step=step, offset=offset // max(chunk, 1) * rows.width
        )

    sent, ready = down_by_chunks(call, dev, laid, "votes", chunk)
    bits = collective(
        comm,
        sent,
        1,
        majority=decide,
        chunk=chunk,
        signed=False,
        kernels=call.kernels,
        ready=ready,
        **call.io,
    )
    clock.communicated()
    a, b = rows.own
    out = rows.fill(xp, codec.expand(up(dev, bits), b - a, scale if mean else scale * comm.size))
    clock.decoded()
    return out


def _cost(schedule: str, codec, numel: int, nranks: int, payload=None) -> Cost:
    return small(8, nranks) + bounded(schedule, numel, nranks, 1, True)


def _direct_alltoall(codec, numel: int, nranks: int, payload=None) -> int:
    return direct_alltoall(numel, nranks, 1)


KIND = Kind("majority", MajorityCodec, bounded_schedules(run, _cost, _direct_alltoall, scatter))
