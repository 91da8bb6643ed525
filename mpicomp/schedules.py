"""What each schedule of a call costs: its messages and bytes, and a latency-bandwidth time.

A call of n elements over N ranks runs one schedule (``mpicomp.options.SCHEDULES``).
:func:`cost` counts the messages and bytes along its critical path: per exchange step,
the largest message any rank sends or receives in it (each rank sends and receives at
once, so a step lasts as long as its largest message). With a ``Network`` of ``alpha``
seconds per message and ``beta`` bytes per second per rank, the predicted time is

    t = messages * alpha + bytes / beta

(Hockney's model, as used for MPI collectives by Thakur, Rabenseifner and Gropp 2005).
The counts follow docs/collectives.md: the rings and the direct schedule exactly (the
largest chunk at every step), MPI's own collectives as MPICH runs large messages
(``Allreduce``: reduce-scatter then allgather, 2 log2 N messages and 2(N-1)/N of the
bytes; ``Allgatherv`` and ``Alltoallv``: N - 1 steps). Compression time is not counted:
it is the same for every schedule of a codec, within a factor (docs/collectives.md,
"Direct reduce-scatter", measures the difference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpicomp.kernels.bits import packed_size

AGREEMENT_BYTES = 192  # the MaxAllReduce head every call sends first


@dataclass(frozen=True)
class Cost:
    """The critical path of one call: ``messages`` in sequence and the ``bytes`` they carry."""

    messages: int
    bytes: int

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.messages + other.messages, self.bytes + other.bytes)


@dataclass(frozen=True)
class Network:
    """A latency-bandwidth model: ``alpha`` seconds per message, ``beta`` bytes per second
    each rank sends (and receives) at once.

    Raises:
        ValueError: alpha negative or beta not positive (or either not finite).
    """

    alpha: float
    beta: float

    def __post_init__(self):
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"alpha must be a finite number of seconds >= 0, got {self.alpha!r}")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta must be a finite bytes per second > 0, got {self.beta!r}")

    def time(self, cost: Cost) -> float:
        """Return the predicted seconds of ``cost``."""
        return cost.messages * self.alpha + cost.bytes / self.beta


def _log2(nranks: int) -> int:
    return (nranks - 1).bit_length()  # ceil(log2 N); 0 for one rank


def _small(nbytes: int, nranks: int) -> Cost:
    """An allreduce or allgather of a few bytes: recursive doubling, log2 N rounds."""
    return Cost(_log2(nranks), _log2(nranks) * nbytes)


def _mpi_allreduce(nbytes: int, nranks: int) -> Cost:
    """MPI_Allreduce of ``nbytes``: reduce-scatter and allgather by recursive halving and
    doubling (2 log2 N messages, 2(N-1)/N of the bytes)."""
    if nranks == 1:
        return Cost(0, 0)
    return Cost(2 * _log2(nranks), -(-2 * (nranks - 1) * nbytes // nranks))


def _chunk(numel: int, nranks: int) -> int:
    """The largest chunk of the ring's layout (docs/collectives.md, "Chunks")."""
    from mpicomp.collectives.ring import chunk_size

    return min(numel, chunk_size(numel, nranks)) if numel else 0


def bounded(schedule: str, numel: int, nranks: int, span: int, majority: bool) -> Cost:
    """The exchange of ``numel`` codes in [0, span] (shifted), summed or voted over
    ``nranks`` by the ``"ring"`` or ``"direct"`` schedule."""
    N = nranks
    if N == 1:
        return Cost(0, 0)
    C = _chunk(numel, N)
    final = 1 if majority else (N * span).bit_length()
    gather = (N - 1) * packed_size(C, final)
    if schedule == "ring":
        widths = [(i * span).bit_length() for i in range(1, N)]
        return Cost(2 * (N - 1), sum(packed_size(C, w) for w in widths) + gather)
    if schedule == "direct":
        # The owner receives N - 1 chunks; a rank sends N - 1 (each at most C elements).
        return Cost(2 * (N - 1), (N - 1) * packed_size(C, span.bit_length()) + gather)
    raise ValueError(f"bounded codes are summed by 'ring' or 'direct', not {schedule!r}")


def gathered(schedule: str, nranks: int, payload: int, pulled: int | None = None) -> Cost:
    """The exchange of payloads of ``payload`` bytes per rank by ``"allgather"`` or
    ``"sharded"`` (push of payload/N bytes per owner, pull of ``pulled`` bytes per owner's
    re-compressed average, default ``payload``/N)."""
    N = nranks
    if N == 1:
        return Cost(0, 0)
    sizes = _small(8, N)
    if schedule == "allgather":
        return sizes + Cost(N - 1, (N - 1) * payload)
    if schedule == "sharded":
        pulled = -(-payload // N) if pulled is None else pulled
        push = Cost(N - 1, 8 * (N - 1)) + _small(8, N) + Cost(N - 1, -(-(N - 1) * payload // N))
        return push + sizes + Cost(N - 1, (N - 1) * pulled)
    raise ValueError(f"payloads are exchanged by 'allgather' or 'sharded', not {schedule!r}")


def cost(schedule: str, codec, numel: int, nranks: int, payload: int | None = None) -> Cost:
    """Return the critical path of one ``CompressedComm`` call of ``codec`` by ``schedule``.

    Args:
        schedule: one of the codec's schedules (``mpicomp.options.SCHEDULES``), or
            ``"float32"``: the uncompressed MPI_Allreduce of float32 any codec falls back
            to (below ``min_numel``).
        codec: a made codec (``mpicomp.codec(...)``).
        numel: elements of the tensor.
        nranks: ranks of the communicator.
        payload: gather codecs: the bytes of one rank's payload (required).

    Raises:
        ValueError: a schedule the codec does not have, or a gather codec without payload.
    """
    from mpicomp.options import SCHEDULES

    N = nranks
    call = _small(AGREEMENT_BYTES, N)  # every call agrees first
    if schedule == "float32":
        return call + _mpi_allreduce(4 * numel, N)
    kind = codec.aggregation
    if schedule not in SCHEDULES[kind]:
        raise ValueError(f"codec {codec.name!r} ({kind}) has no schedule {schedule!r}")
    if kind == "sum":
        return call + _mpi_allreduce(codec.wire_dtype.itemsize * numel, N)
    if kind == "gather":
        if payload is None:
            raise ValueError(f"{codec.name}: the cost of a gather schedule needs payload bytes")
        return call + gathered(schedule, N, payload)
    if kind == "majority":
        return call + _small(8, N) + bounded(schedule, numel, N, 1, True)
    coded = codec.num_coordinates(numel) if codec.sparse else numel
    total = call + bounded(schedule, coded, N, 2 * codec.bound, False)
    if codec.multiscale and codec.index_bits:
        # The scale index MIN runs on the constant-width ring under either schedule.
        C = _chunk(coded, N)
        total += Cost(2 * (N - 1), 2 * (N - 1) * packed_size(C, codec.index_bits))
    return total
