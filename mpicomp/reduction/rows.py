"""The layout of a reduce-scatter: the flat input as ``size`` equal rows, zero-padded at
the end, rank r owning row r (the layout FSDP2 reduce-scatters in).

A row is S = ceil(n / size) elements; row r holds elements [r*S, min(n, (r+1)*S)) and
is padded with zeros to S. Every kind's reduce-scatter (``Schedule.scatter``) returns
this rank's row; bounded codes travel in chunks of ``grouped`` (a multiple of 8 codes,
so packed chunks start on whole bytes).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mpicomp.codecs.arrays import (
    BFLOAT16,
    Unencodable,
    all_finite,
    result_range,
    within,
)
from mpicomp.collectives import plain
from mpicomp.kernels import backend_of
from mpicomp.reduction.agreement import (
    Call,
    agree,
    device,
    down,
    flagged,
    raise_result_overflow,
    up,
)

#: The allgather's wire precisions: the shard's float32, or bfloat16 (rounded to
#: nearest, ties to even, on every rank alike).
PRECISIONS = ("float32", "bfloat16")


class Rows(NamedTuple):
    """n elements as ``size`` rows of ``width`` elements, seen from rank ``rank``."""

    n: int
    size: int
    rank: int

    @classmethod
    def of(cls, comm, n: int) -> Rows:
        return cls(n, comm.Get_size(), comm.Get_rank())

    @property
    def width(self) -> int:
        """S, the elements of a row: ceil(n / size)."""
        return -(-self.n // self.size)

    def span(self, r: int) -> tuple[int, int]:
        """Return [lo, hi), the elements of row r (hi - lo < S for the last rows)."""
        s = self.width
        return min(self.n, r * s), min(self.n, (r + 1) * s)

    def spans(self) -> list[tuple[int, int]]:
        return [self.span(r) for r in range(self.size)]

    @property
    def own(self) -> tuple[int, int]:
        return self.span(self.rank)

    def padded(self, xp, flat):
        """Return ``flat`` as ``size * S`` elements, zeros after n (a copy when padded)."""
        total = self.size * self.width
        if flat.size == total:
            return flat
        out = xp.zeros(total, dtype=flat.dtype)
        out[: flat.size] = flat
        return out

    def fill(self, xp, row):
        """Return this rank's ``row`` (its hi - lo values) padded with zeros to S."""
        if row.size == self.width:
            return row
        out = xp.zeros(self.width, dtype=row.dtype)
        out[: row.size] = row
        return out


def summed(mean: bool) -> str:
    """Return how messages name a row of the average (``mean``) or of the sum over ranks."""
    return f"a row of the {'average' if mean else 'sum'} over ranks"


def check_row(call: Call, codec, row, risky: bool, mean: bool) -> None:
    """Raise on every rank where some owner's float32 ``row`` (of the average, or the sum:
    ``mean``) is not finite or holds what the caller's dtype (``call.dtype``) cannot:
    only where ``risky`` (decided alike on every rank, from agreed values) do the owners
    check their rows and tell every rank, one byte each."""
    if risky and flagged(call, not within(row, result_range(call.dtype).limit, call.kernels)):
        raise_result_overflow(call, codec, summed(mean))


def grouped(xp, codes, starts: list[int]):
    """Return (codes laid out as ``len(starts) - 1`` chunks of C, C): chunk r holds
    ``codes[starts[r]:starts[r+1]]`` then zeros, C the longest group rounded up to a
    multiple of 8 (the bounded collectives' byte-aligned chunks)."""
    counts = np.diff(starts)
    chunk = 8 * -(-int(counts.max(initial=0)) // 8)
    out = xp.zeros(chunk * (len(starts) - 1), dtype=codes.dtype)
    for r, (lo, hi) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        out[r * chunk : r * chunk + hi - lo] = codes[lo:hi]
    return out, chunk


def to_bfloat16(xp, flat):
    """Return float32 ``flat`` rounded to bfloat16, as the uint16 of its upper half
    (round to nearest, ties to even; finite input)."""
    bits = flat.view(np.uint32)
    odd = (bits >> np.uint32(16)) & np.uint32(1)
    return ((bits + np.uint32(0x7FFF) + odd) >> np.uint32(16)).astype(np.uint16)


def from_bfloat16(xp, halves):
    """Return the float32 values of bfloat16 ``halves`` (uint16)."""
    return (halves.astype(np.uint32) << np.uint32(16)).view(np.float32)


def allgather(call: Call, codec, flat, *, numel: int, precision: str):
    """Return every rank's row end to end, the first ``numel`` elements (the inverse of
    a reduce-scatter): one MPI_Allgather at ``precision``, the same bits on every rank
    (this rank's own row rounded alike under bfloat16). A NaN/Inf in any rank's row, or
    under bfloat16 a value that rounds to Inf, raises on every rank before anything
    moves (there is no step to skip)."""
    dev = device(flat)
    guard, error, cause = call.guard, None, 0
    # One pass, as a NaN/Inf check alone; a second only for a row that fails it.
    if not within(flat, result_range(precision).limit, call.kernels):
        error, cause = guard.error(), guard.cause
        if all_finite(flat, call.kernels):
            error = guard.error(Unencodable("allgather it with precision='float32'", BFLOAT16))
            cause = error.code
    call.clock.encoded()
    agree(call, flat.size, error, nonfinite=cause)
    xp = backend_of(flat, call.kernels).xp
    wire = flat if precision == "float32" else to_bfloat16(xp, flat)
    send = down(call, dev, wire, "wire")
    recv = backend_of(send, call.kernels).xp.empty(call.comm.size * send.size, send.dtype)
    plain.allgather(call.comm, send, recv, **call.io)
    call.clock.communicated()
    out = up(dev, recv)
    if precision != "float32":
        out = from_bfloat16(xp, out)
    call.clock.decoded()
    return out[:numel]
