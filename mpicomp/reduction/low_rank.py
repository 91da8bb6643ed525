"""The ``"low_rank"`` kind (PowerSGD): two float32 sums per call, one of every matrix's
P factor (with the tensors that go uncompressed), one of its Q factor, each one fused
``MPI_Allreduce`` for all tensors of a bucket (``codecs.powersgd`` for the algorithm)."""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import numpy as np
from mpi4py import MPI

from mpicomp.codecs.arrays import all_finite, array_module
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
from mpicomp.reduction.residuals import Memory


@runtime_checkable
class LowRankCodec(Protocol):
    """``aggregation = "low_rank"``: ``layout(shapes)`` says which tensors are factored
    at which rank; ``orthogonalize`` and ``first_q`` are the algorithm's own steps;
    ``start_iter`` plain calls come first, ``warm_start`` reuses Q."""

    name: str
    aggregation: str
    start_iter: int
    warm_start: bool

    def layout(self, shapes) -> Any: ...

    def orthogonalize(self, matrix) -> None: ...

    def first_q(self, name: str, layout, xp) -> Any: ...


def run(call: Call, codec, flat):
    """Average ``flat`` (the tensors of ``call.shapes``) by PowerSGD's two rounds."""
    comm, clock, memory = call.comm, call.clock, call.residuals.arrays
    done = int(memory["calls"][0]) if "calls" in memory else 0
    # Plain float32 averages first, as the hook's start_powerSGD_iter (no error kept).
    plain = done < codec.start_iter
    dev = device(flat)
    xp = array_module(flat)
    layout = codec.layout(call.shapes or ((flat.size,),))
    kept = call.residuals.feedback

    def first_round(f):
        """This rank's P factors (and its uncompressed tensors) of ``f`` + its error."""
        if plain:
            if not all_finite(f):
                raise ValueError("NaN or Inf")
            return f, f
        error, q = memory.get("error") if kept else None, memory.get("q")
        _check_sizes(call.label, error, f.size, q, layout.q_size)
        x = f + error if error is not None else f
        if not all_finite(x):
            if error is None or not all_finite(f):
                raise ValueError("NaN or Inf")
            what = f"{call.label!r} plus its kept error"
            raise ValueError(_overflow(call, what, kept=True, factors=False))
        q = (
            q.copy()
            if q is not None and codec.warm_start
            else codec.first_q(call.label, layout, xp)
        )
        wire = xp.empty(layout.p_size + layout.u_size, np.float32)
        p_at, q_at = 0, 0
        for k in layout.compressed:
            factor = q[q_at : q_at + k.m * k.r].reshape(k.m, k.r)
            codec.orthogonalize(factor)
            matrix = x[k.start : k.stop].reshape(k.n, k.m)
            wire[p_at : p_at + k.n * k.r] = (matrix @ factor).reshape(-1)
            p_at, q_at = p_at + k.n * k.r, q_at + k.m * k.r
        for k in layout.uncompressed:
            wire[p_at : p_at + k.stop - k.start] = x[k.start : k.stop]
            p_at += k.stop - k.start
        return wire, x

    found, flat, err, bad = encode_here(call, first_round, flat)
    clock.encoded()
    agree(call, flat.size, err, nonfinite=bad)
    wire, x = found
    total = _sum(call, dev, wire, "p", factors=not plain)
    clock.communicated()
    if plain:
        total /= np.float32(comm.size)
        memory["calls"] = np.array([done + 1], np.float32)
        clock.decoded()
        return total
    out = xp.empty(flat.size, np.float32)
    qs = xp.empty(layout.q_size, np.float32)
    p_at, q_at = 0, 0
    for k in layout.compressed:
        p = total[p_at : p_at + k.n * k.r].reshape(k.n, k.r)
        codec.orthogonalize(p)  # the sum is orthogonalized as it is (no division)
        matrix = x[k.start : k.stop].reshape(k.n, k.m)
        qs[q_at : q_at + k.m * k.r] = (matrix.T @ p).reshape(-1)
        p_at, q_at = p_at + k.n * k.r, q_at + k.m * k.r
    for k in layout.uncompressed:
        out[k.start : k.stop] = total[p_at : p_at + k.stop - k.start] / np.float32(comm.size)
        p_at += k.stop - k.start
    clock.encoded()
    q = _sum(call, dev, qs, "q", factors=True)
    q /= np.float32(comm.size)
    clock.communicated()
    p_at, q_at = 0, 0
    for k in layout.compressed:
        p = total[p_at : p_at + k.n * k.r].reshape(k.n, k.r)
        factor = q[q_at : q_at + k.m * k.r].reshape(k.m, k.r)
        out[k.start : k.stop] = (p @ factor.T).reshape(-1)
        p_at, q_at = p_at + k.n * k.r, q_at + k.m * k.r
    # New arrays, never written into the kept ones: a rolled-back call puts those back.
    if kept:
        memory["error"] = x - out
    memory["q"] = q
    memory["calls"] = np.array([done + 1], np.float32)
    clock.decoded()
    return out


def _sum(call: Call, dev, wire, slot: str, factors: bool):
    """Return the float32 sum over ranks of ``wire`` (one MPI_Allreduce), on its device
    (``factors``: it holds factors, not a plain call's gradients; for the message)."""
    send = down(call, dev, wire, slot)
    total = backend_of(send, call.kernels).xp.empty_like(send)
    plain.allreduce(call.comm, send, total, MPI.SUM, **call.io)
    total = up(dev, total)
    if not all_finite(total):  # finite inputs can still sum past float32, alike everywhere
        kept = factors and call.residuals.feedback
        what = "the sum over ranks"
        raise_overflow(call, None, what, _overflow(call, what, kept, factors))
    return total


def _overflow(call: Call, what: str, kept: bool, factors: bool = True) -> str:
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
    return f"powersgd: {what} overflows float32 although every input was finite ({why}): {hint}"


def _check_sizes(name: str, error, numel: int, q, q_size: int) -> None:
    """Refuse a tensor whose kept error or Q is of another layout than this call's."""
    if (error is not None and error.size != numel) or (q is not None and q.size != q_size):
        raise ValueError(
            f"powersgd: tensor {name!r} had another layout (sizes or shapes) before; give "
            "each tensor its own name, or forget(name) after changing it"
        )


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
    """Return (encode, decode, wire bytes) closures of one rank's share of a call on ``x``
    (viewed as ``shape[0]`` rows, a 1-D one as a near-square matrix): its factors and
    their rebuild, for timings and the bits per element."""
    numel = x.size
    matrix = matrix_view(x)
    layout = codec.layout([matrix.shape])
    xp = array_module(x)
    state = {}
    if not layout.compressed:  # too small or too thin to factor: sent as it is
        return (lambda: state.update(x=x.copy())), (lambda: state["x"]), (lambda: 4 * numel)

    def enc():
        q = codec.first_q("alone", layout, xp).reshape(matrix.shape[1], -1)
        codec.orthogonalize(q)
        p = matrix @ q
        codec.orthogonalize(p)
        state.update(p=p, q=matrix.T @ p)

    def dec():
        return (state["p"] @ state["q"].T).reshape(x.shape)

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
