"""The ``"low_rank"`` kind (PowerSGD): two float32 sums per call, one of every matrix's
P factor (with the tensors that go uncompressed), one of its Q factor, each one fused
``MPI_Allreduce`` for all tensors of a bucket (``codecs.powersgd`` for the algorithm)."""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

from mpi4py import MPI

from mpicomp.codecs.arrays import KEPT, Unencodable, all_finite
from mpicomp.collectives import plain
from mpicomp.kernels import backend_of
from mpicomp.reduction._cost import Cost, mpi_allreduce
from mpicomp.reduction._kind import Kind, Schedule
from mpicomp.reduction.agreement import (
    Call,
    agree,
    device,
    down,
    encode_here,
    raise_overflow,
    up,
)
from mpicomp.reduction.residuals import LowRankState, Memory


@runtime_checkable
class LowRankCodec(Protocol):
    """``aggregation = "low_rank"``: each call sums two float32 wires over ranks, the
    second computed from the first's sum (PowerSGD: P = Δ Q, then Q = Δᵀ P̂).

    ``run`` calls, on every rank: ``begin(kept, shapes, name, feedback)`` for the call's
    work (``kept``: the tensor's arrays kept across calls, a dict; ``work.factored``
    False makes the call one plain float32 sum); ``add_error(work, gradient)`` for Δ
    (``gradient`` itself where nothing is added); ``compress(work, x)`` for the first
    wire; ``project(work, p_sum)`` for the second; ``decompress(work, p_sum, q_sum,
    nranks)`` for the average (``q_sum`` None in a plain call); ``memorize(work, out)``
    last, which puts new arrays into ``kept``, never writes into the old ones (a call
    that fails puts those back). ``rank`` sizes the factors in the cost model.
    """

    name: str
    aggregation: str
    rank: int

    def begin(self, kept: dict | None, shapes, name: str, feedback: bool) -> Any: ...

    def add_error(self, work, gradient) -> Any: ...

    def compress(self, work, x) -> Any: ...

    def project(self, work, p_sum) -> Any: ...

    def decompress(self, work, p_sum, q_sum, nranks: int) -> Any: ...

    def memorize(self, work, out) -> None: ...


def _compress(call: Call, codec, work):
    """Return ``compress(flat)``: this rank's first wire of ``flat``, its input refused
    where Δ (``flat`` plus the kept error) holds NaN or Inf."""

    def compress(flat):
        x = codec.add_error(work, flat)
        if not all_finite(x):
            if x is flat or not all_finite(flat):
                raise ValueError("NaN or Inf")
            what = f"{call.label!r} plus its kept error"
            raise Unencodable(_overflow(call, codec, what, kept=True, factors=False), KEPT)
        return codec.compress(work, x)

    return compress


def run(call: Call, codec, flat):
    """Average ``flat`` (the tensors of ``call.shapes``) by the codec's two rounds: the
    sum of every rank's first wire, then of its second, made from that sum (one plain
    sum where the call is not factored)."""
    comm, clock = call.comm, call.clock
    kept: LowRankState = call.residuals
    dev = device(flat)
    work = codec.begin(kept.arrays, call.shapes or ((flat.size,),), call.label, kept.feedback)
    wire, flat, err, bad = encode_here(call, _compress(call, codec, work), flat)
    clock.encoded()
    agree(call, flat.size, err, nonfinite=bad)
    p_sum = _sum(call, codec, dev, wire, "p", factors=work.factored)
    clock.communicated()
    q_sum = None
    if work.factored:
        wire = codec.project(work, p_sum)
        clock.encoded()
        q_sum = _sum(call, codec, dev, wire, "q", factors=True)
        clock.communicated()
    out = codec.decompress(work, p_sum, q_sum, comm.size)
    codec.memorize(work, out)
    clock.decoded()
    return out


def _sum(call: Call, codec, dev, wire, slot: str, factors: bool):
    """Return the float32 sum over ranks of ``wire`` (one MPI_Allreduce), on its device
    (``factors``: it holds factors, not a plain call's gradients; for the message)."""
    send = down(call, dev, wire, slot)
    total = backend_of(send, call.kernels).xp.empty_like(send)
    plain.allreduce(call.comm, send, total, MPI.SUM, **call.io)
    total = up(dev, total)
    if not all_finite(total):  # finite inputs can still sum past float32, alike everywhere
        kept = factors and call.residuals.feedback
        what = "the sum over ranks"
        raise_overflow(call, codec, what, _overflow(call, codec, what, kept, factors))
    return total


def _overflow(call: Call, codec, what: str, kept: bool, factors: bool = True) -> str:
    """Return the message for ``what`` overflowing float32 although every input was
    finite (``kept``: error feedback added its kept error to each rank's input;
    ``factors``: the factors overflowed, which sum a matrix's rows or columns)."""
    why = "values near its limit, 3.4e38" + (
        ", or a matrix whose rows or columns sum past it" if factors else ""
    )
    hint = "scale the gradients down (e.g. a loss scale) or use codec 'none'"
    if kept:
        hint += (
            "; each rank's input includes the error kept from earlier calls (error "
            f"feedback): forget({call.label!r}) drops it"
        )
    return f"{codec.name}: {what} overflows float32 although every input was finite ({why}): {hint}"


def _side(numel: int) -> int:
    """The side of the square matrix the cost model assumes for ``numel`` elements."""
    return math.isqrt(max(numel - 1, 0)) + 1 if numel else 0


def _cost(codec, numel: int, nranks: int, payload=None) -> Cost:
    # Without shapes, a square matrix: P and Q of side x rank floats each.
    side = _side(numel)
    factor = 4 * side * min(side, codec.rank)
    return mpi_allreduce(factor, nranks) + mpi_allreduce(factor, nranks)


def _state(codec, options) -> Memory:
    return Memory(feedback=options.error_feedback)


def alone(codec, x):
    """Return (encode, decode, wire bytes) closures of one rank's share of a factored
    call on ``x`` (viewed as ``shape[0]`` rows, a 1-D one as a near-square matrix): its
    two wires and the rebuild from them, for timings and the bits per element."""
    matrix = matrix_view(x)
    work = codec.begin(None, [matrix.shape], "alone", feedback=False)
    state = {}

    def enc():
        p = codec.compress(work, matrix.reshape(-1))
        state.update(p=p, q=codec.project(work, p))

    def dec():
        return codec.decompress(work, state["p"], state["q"], 1).reshape(x.shape)

    return enc, dec, lambda: 4 * (state["p"].size + state["q"].size)


def matrix_view(x):
    """Return ``x`` as this kind factors it: ``shape[0]`` rows, a 1-D one as a near-square
    matrix (what a flat benchmark gradient stands for)."""
    rows = x.shape[0] if x.ndim > 1 else _divisor_near_sqrt(x.size)
    return x.reshape(rows, -1)


def _divisor_near_sqrt(n: int) -> int:
    for d in range(math.isqrt(n), 0, -1):
        if n % d == 0:
            return d
    return 1


KIND = Kind(
    "low_rank",
    LowRankCodec,
    {"allreduce": Schedule(run, _cost)},
    hierarchical=False,  # a host's shard of a bucket is no matrix
    shaped=True,  # matrices: (100, 500) and (500, 100) send factors of other sizes
    feedback=True,
    state=_state,
    alone=alone,
)
