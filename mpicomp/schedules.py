"""What each schedule of a call costs: its messages and bytes, and a latency-bandwidth time.

A call of n elements over N ranks runs one schedule (``mpicomp.options.SCHEDULES``).
:func:`cost` counts the messages and bytes along its critical path: per exchange step,
the largest message any rank sends or receives in it (each rank sends and receives at
once, so a step lasts as long as its largest message). With a ``Network`` of ``alpha``
seconds per message and ``beta`` bytes per second per rank, the predicted time is

    t = messages * alpha + bytes / beta

(Hockney's model, as used for MPI collectives by Thakur, Rabenseifner and Gropp 2005).
:func:`predict` adds where the ranks are (a ``Topology`` of hosts, two ``Network`` s:
within a host and between hosts) and each codec's measured compute (``mpicomp.model``),
and covers the hierarchical schedules (``"hier:ring"`` and so on: reduce within the
host uncompressed, compress between hosts); :func:`choose` returns the cheapest.
The counts follow docs/collectives.md: the rings and the direct schedule exactly (the
largest chunk at every step), MPI's own collectives as MPICH runs large messages
(``Allreduce``: reduce-scatter then allgather, 2 log2 N messages and 2(N-1)/N of the
bytes; ``Allgatherv`` and ``Alltoallv``: N - 1 steps). ``cost`` counts no compression
time; ``predict`` does (docs/collectives.md, "Choosing a schedule").
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
    if kind == "sum" and codec.name == "none":
        return call + _mpi_allreduce(4 * numel, N)
    if kind == "sum":  # fp16: collectives.float16's ring (MPI has no float16 sum)
        C = -(-numel // N) if numel else 0
        return call + Cost(2 * (N - 1), 2 * (N - 1) * codec.wire_dtype.itemsize * C)
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


# -- where the ranks are, what each schedule then costs, and the cheapest ---------------

#: The prefix of a hierarchical schedule: ``"hier:ring"`` reduces within each host, then
#: runs the ring between hosts (docs/collectives.md, "Hierarchy").
HIER = "hier:"

#: The uncompressed MPI_Allreduce of float32 that every codec can fall back to.
FLOAT32 = "float32"


@dataclass(frozen=True)
class Topology:
    """Where a communicator's ranks are: ``hosts`` hosts holding ``per_host`` ranks each
    (the most any host holds when they differ; ``even`` says whether all hold the same,
    ``ranks`` how many there are then).

    The flat schedules' costs assume ranks placed by host in blocks (ranks 0..R-1 on
    the first host, as mpiexec and srun place them by default): a ring then sends one
    message per host and step over the host's link.

    Raises:
        ValueError: fewer than one host or one rank per host.
    """

    hosts: int = 1
    per_host: int = 1
    even: bool = True
    ranks: int = 0  # all ranks, when hosts hold different numbers (0: hosts * per_host)

    def __post_init__(self):
        if self.hosts < 1 or self.per_host < 1:
            raise ValueError(f"a topology needs hosts >= 1 and per_host >= 1, got {self}")

    @property
    def nranks(self) -> int:
        return self.ranks or self.hosts * self.per_host

    @property
    def hierarchical(self) -> bool:
        """Whether the hierarchical schedules can run: several hosts of several ranks,
        every host the same number (each local rank leads one shard between hosts)."""
        return self.hosts > 1 and self.per_host > 1 and self.even


def schedules_of(codec, topology: Topology) -> tuple[str, ...]:
    """Return the schedules ``schedule="auto"`` chooses among for ``codec``: its own
    (``mpicomp.options.SCHEDULES``), the hierarchical ones where ``topology`` allows (not
    for fp16's sum), and the float32 MPI_Allreduce (``none``: only its allreduce)."""
    from mpicomp.options import SCHEDULES

    flat = SCHEDULES[codec.aggregation]
    if codec.name == "none":
        return flat
    # fp16's float16 sum is a whole-tensor ring of its own; no hierarchy was built for it.
    sums = codec.aggregation == "sum"
    hier = tuple(HIER + s for s in flat) if topology.hierarchical and not sums else ()
    return (*flat, *hier, FLOAT32)


def payload_bytes(speed, numel: int) -> int:
    """Return the predicted payload of a gather codec for ``numel`` elements: the
    measured bits per element of ``speed`` (``mpicomp.model.Speed``) and one header."""
    from mpicomp.codecs._wire import header_size

    return header_size(1) + math.ceil(speed.bits * numel / 8)


def _alltoall_bytes(schedule: str, codec, numel: int, nranks: int, payload: int | None) -> int:
    """The bytes of ``cost`` that every rank sends to every other at once (the direct
    schedule's codes, the sharded push): with R ranks per host, R such streams share a
    host's link, where a ring's one neighbour does not."""
    N = nranks
    if N == 1:
        return 0
    if schedule == "direct":
        coded = codec.num_coordinates(numel) if getattr(codec, "sparse", False) else numel
        span = 1 if codec.aggregation == "majority" else 2 * codec.bound
        return (N - 1) * packed_size(_chunk(coded, N), span.bit_length())
    if schedule == "sharded":
        return -(-(N - 1) * payload // N)
    return 0


def _decode_sum(codec, speed, numel: int, count: int) -> float:
    """Seconds to add ``count`` decoded payloads of ``numel`` elements (``decode_sum``):
    one decode for a codec that sums before decoding (FFT's spectra), else one each."""
    return speed.decode * numel * (1 if getattr(codec, "sums_before_decoding", False) else count)


def compute_seconds(schedule: str, codec, speed, numel: int, nranks: int) -> float:
    """Return one rank's encode and decode seconds in a call of ``schedule`` (a flat
    one) over ``numel`` elements and ``nranks`` ranks, at ``speed``'s seconds per element."""
    n, N = numel, nranks
    if schedule == FLOAT32 or codec.name == "none":
        return 0.0
    if schedule == "allgather":
        return speed.encode * n + _decode_sum(codec, speed, n, N)
    if schedule == "sharded":
        shard = -(-n // N)
        # Push every shard (one encode of n), the owner sums N pushes and encodes its
        # average, then every pulled shard is decoded (n in all).
        return speed.encode * (n + shard) + _decode_sum(codec, speed, shard, N) + speed.decode * n
    return (speed.encode + speed.decode) * n


def predict(schedule: str, codec, numel: int, topology: Topology, model) -> float:
    """Return the predicted seconds of one call of ``codec`` over ``numel`` elements by
    ``schedule`` (flat, ``"hier:..."`` or ``"float32"``) on ``topology`` with ``model``'s
    networks and speeds (``mpicomp.model.Model``).

    Flat schedules run over the network between hosts when there are several (the
    slowest link of each step), else within the host; their all-to-all bytes share a
    host's link R ways. ``float32`` on several hosts of several ranks is modelled as
    MPI libraries run it there: reduce within the host, all-reduce between hosts,
    broadcast within. A hierarchical schedule: the agreement over all ranks, a float32
    reduce-scatter within the host, the flat schedule between hosts on each local
    rank's 1/R shard (the R shards share the host's link), an allgather within the host.

    Raises:
        ValueError: a schedule the codec or the topology does not have; a codec ``model``
            has no speed for.
    """
    topo, N, R, H = topology, topology.nranks, topology.per_host, topology.hosts
    speed = model.speed(codec)
    wide = model.inter if H > 1 else model.intra
    if schedule.startswith(HIER):
        if not topo.hierarchical:
            raise ValueError(f"schedule {schedule!r} needs several hosts of as many ranks each")
        inner, shard = schedule[len(HIER) :], -(-numel // R)
        payload = payload_bytes(speed, shard) if codec.aggregation == "gather" else None
        between = cost(inner, codec, shard, H, payload)
        between = Cost(between.messages, R * between.bytes)  # R shards over one link
        within = Cost(R - 1, (R - 1) * 4 * shard)  # reduce-scatter, then the allgather
        return (
            model.inter.time(_small(AGREEMENT_BYTES, N) + between)
            + 2 * model.intra.time(within)
            + compute_seconds(inner, codec, speed, shard, H)
        )
    if (schedule == FLOAT32 or codec.name == "none") and H > 1 and R > 1:
        nbytes = 4 * numel
        head = _small(AGREEMENT_BYTES, N)
        return (
            model.inter.time(head + _mpi_allreduce(nbytes, H))
            + model.intra.time(_mpi_allreduce(nbytes, R))
            + compute_seconds(schedule, codec, speed, numel, N)
        )
    payload = payload_bytes(speed, numel) if codec.aggregation == "gather" else None
    c = cost(schedule, codec, numel, N, payload)
    shared = (R - 1) * _alltoall_bytes(schedule, codec, numel, N, payload) if H > 1 else 0
    return wide.time(c) + shared / wide.beta + compute_seconds(schedule, codec, speed, numel, N)


def choose(codec, numel: int, topology: Topology, model) -> tuple[str, dict[str, float]]:
    """Return the cheapest of ``schedules_of(codec, topology)`` for ``numel`` elements,
    and every candidate's predicted seconds (ties go to the earlier candidate: the
    codec's default first). The same inputs give the same choice on every rank."""
    times = {s: predict(s, codec, numel, topology, model) for s in schedules_of(codec, topology)}
    return min(times, key=times.__getitem__), times
