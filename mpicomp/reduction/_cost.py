"""What a schedule's messages cost: the critical path of one call as messages and bytes.

Each aggregation kind prices its own schedules with these pieces (``Schedule.cost``);
``mpicomp.model.cost`` turns a cost into seconds (docs/collectives.md, "Choosing a
schedule"). Counts follow MPICH for MPI's own collectives on large messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpicomp.collectives.bounded import chunk_size
from mpicomp.kernels.bits import packed_size

AGREEMENT_BYTES = 192  # the MaxAllReduce head every call sends first


@dataclass(frozen=True)
class Cost:
    """The critical path of one call: ``messages`` in sequence and the ``bytes`` they carry."""

    messages: int
    bytes: int

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.messages + other.messages, self.bytes + other.bytes)


NOTHING = Cost(0, 0)


def log2(nranks: int) -> int:
    return (nranks - 1).bit_length()  # ceil(log2 N); 0 for one rank


def small(nbytes: int, nranks: int) -> Cost:
    """An allreduce or allgather of a few bytes: recursive doubling, log2 N rounds."""
    return Cost(log2(nranks), log2(nranks) * nbytes)


def agreement(nranks: int) -> Cost:
    """The agreement every call begins with (one MaxAllReduce of the head)."""
    return small(AGREEMENT_BYTES, nranks)


def mpi_allreduce(nbytes: int, nranks: int) -> Cost:
    """MPI_Allreduce of ``nbytes``: reduce-scatter and allgather by recursive halving and
    doubling (2 log2 N messages, 2(N-1)/N of the bytes)."""
    if nranks == 1:
        return NOTHING
    return Cost(2 * log2(nranks), -(-2 * (nranks - 1) * nbytes // nranks))


def chunk(numel: int, nranks: int) -> int:
    """The largest chunk of the ring's layout (docs/collectives.md, "Chunks")."""
    return min(numel, chunk_size(numel, nranks)) if numel else 0


def bounded(schedule: str, numel: int, nranks: int, span: int, majority: bool) -> Cost:
    """The exchange of ``numel`` codes in [0, span] (shifted), summed or voted over
    ``nranks`` by the ``"ring"`` or ``"direct"`` schedule."""
    N = nranks
    if N == 1:
        return NOTHING
    C = chunk(numel, N)
    final = 1 if majority else (N * span).bit_length()
    gather = (N - 1) * packed_size(C, final)
    if schedule == "ring":
        widths = [(i * span).bit_length() for i in range(1, N)]
        return Cost(2 * (N - 1), sum(packed_size(C, w) for w in widths) + gather)
    if schedule == "direct":
        # The owner receives N - 1 chunks; a rank sends N - 1 (each at most C elements).
        return Cost(2 * (N - 1), (N - 1) * packed_size(C, span.bit_length()) + gather)
    raise ValueError(f"bounded codes are summed by 'ring' or 'direct', not {schedule!r}")


def direct_alltoall(numel: int, nranks: int, span: int) -> int:
    """The bytes the direct schedule sends from every rank to every other at once."""
    return (nranks - 1) * packed_size(chunk(numel, nranks), span.bit_length())


def gathered(schedule: str, nranks: int, payload: int, pulled: int | None = None) -> Cost:
    """The exchange of payloads of ``payload`` bytes per rank by ``"allgather"`` or
    ``"sharded"`` (push of payload/N bytes per owner, pull of ``pulled`` bytes per owner's
    re-compressed average, default ``payload``/N)."""
    N = nranks
    if N == 1:
        return NOTHING
    sizes = small(8, N)
    if schedule == "allgather":
        return sizes + Cost(N - 1, (N - 1) * payload)
    if schedule == "sharded":
        pulled = -(-payload // N) if pulled is None else pulled
        push = Cost(N - 1, 8 * (N - 1)) + small(8, N) + Cost(N - 1, -(-(N - 1) * payload // N))
        return push + sizes + Cost(N - 1, (N - 1) * pulled)
    raise ValueError(f"payloads are exchanged by 'allgather' or 'sharded', not {schedule!r}")
