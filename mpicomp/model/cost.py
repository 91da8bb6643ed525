"""What each schedule of a call costs: its messages and bytes, and a latency-bandwidth time.

A call of n elements over N ranks runs one schedule of its codec's aggregation kind
(``mpicomp.reduction``, where each kind prices its own). :func:`cost` counts the messages and bytes along its critical path: per exchange step,
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

from mpicomp.codecs._wire import header_size
from mpicomp.reduction import AUTO, FLOAT32, Plan, kind_of, parse, plan
from mpicomp.reduction._cost import (
    AGREEMENT_BYTES,
    Cost,
    agreement,
    bounded,
    gathered,
    mpi_allreduce,
)

__all__ = [
    "AGREEMENT_BYTES",
    "FLOAT32",
    "Cost",
    "Network",
    "Topology",
    "bounded",
    "cheapest",
    "choose",
    "compute_seconds",
    "cost",
    "gathered",
    "payload_bytes",
    "predict",
    "schedules_of",
]


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


def _plan(schedule: str | Plan, codec) -> Plan:
    """Return ``schedule`` as a plan of ``codec`` (a name is parsed by ``mpicomp.reduction``)."""
    return schedule if isinstance(schedule, Plan) else plan(codec, schedule)


def cost(schedule: str | Plan, codec, numel: int, nranks: int, payload: int | None = None) -> Cost:
    """Return the critical path of one ``CompressedComm`` call of ``codec`` by ``schedule``.

    Args:
        schedule: one of the codec's flat schedules (``mpicomp.reduction``; a name or its
            ``Plan``), or ``"float32"``: the uncompressed MPI_Allreduce of float32 any
            codec falls back to (below ``min_numel``).
        codec: a made codec (``mpicomp.codec(...)``).
        numel: elements of the tensor.
        nranks: ranks of the communicator.
        payload: gather codecs: the bytes of one rank's payload (required).

    Raises:
        ValueError: a schedule the codec does not have (a hierarchical one: ``predict``),
            or a gather codec without payload.
    """
    chosen = _plan(schedule, codec)
    kind = kind_of(codec)
    if chosen.hierarchical:
        raise ValueError(
            f"codec {codec.name!r} ({kind.name}) has no schedule {chosen.name!r} between "
            "ranks on one level (predict covers the hierarchical schedules)"
        )
    if chosen.compressed and kind.payload and payload is None:
        raise ValueError(f"{codec.name}: the cost of a {kind.name} schedule needs payload bytes")
    # Every call agrees first; then the schedule's own messages.
    return agreement(nranks) + chosen.schedule.cost(codec, numel, nranks, payload)


# -- where the ranks are, what each schedule then costs, and the cheapest ---------------


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
    (``mpicomp.reduction``), the hierarchical ones where ``topology`` allows (not for
    fp16's sum), and the float32 MPI_Allreduce (``none``: MPI_Allreduce or mpicomp's
    float32 ring)."""
    return tuple(p.name for p in parse(codec, AUTO).candidates(topology.hierarchical))


def payload_bytes(speed, numel: int) -> int:
    """Return the predicted payload of a gather codec for ``numel`` elements: the
    measured bits per element of ``speed`` (``mpicomp.model.Speed``) and one header."""
    return header_size(1) + math.ceil(speed.bits * numel / 8)


def _alltoall_bytes(chosen: Plan, codec, numel: int, nranks: int, payload: int | None) -> int:
    """The bytes of ``cost`` that every rank sends to every other at once (the direct
    schedule's codes, the sharded push): with R ranks per host, R such streams share a
    host's link, where a ring's one neighbour does not."""
    if nranks == 1:
        return 0
    return chosen.schedule.alltoall(codec, numel, nranks, payload)


def compute_seconds(schedule: str | Plan, codec, speed, numel: int, nranks: int) -> float:
    """Return one rank's encode and decode seconds in a call of ``schedule`` (a flat
    one, a name or its ``Plan``) over ``numel`` elements and ``nranks`` ranks, at
    ``speed``'s seconds per element (none for the float32 sum)."""
    return _plan(schedule, codec).schedule.compute(codec, speed, numel, nranks)


def predict(schedule: str | Plan, codec, numel: int, topology: Topology, model) -> float:
    """Return the predicted seconds of one call of ``codec`` over ``numel`` elements by
    ``schedule`` (flat, ``"hier:..."`` or ``"float32"``; a name or its ``Plan``) on
    ``topology`` with ``model``'s
    networks and speeds (``mpicomp.model.Model``).

    Flat schedules run over the network between hosts when there are several (the
    slowest link of each step), else within the host; their all-to-all bytes share a
    host's link R ways. ``float32`` on several hosts of several ranks is modelled as
    MPI libraries run it there: reduce within the host, all-reduce between hosts,
    broadcast within. A hierarchical schedule: the agreement over all ranks, a float32
    reduce-scatter within the host, the flat schedule between hosts on each local
    rank's 1/R shard (the R shards share the host's link), an allgather within the host.
    MPI_Allreduce's bytes between hosts take ``model.mpi_allreduce`` times their
    predicted time (its measured efficiency against the link; mpicomp's rings run at
    the measured link).

    Raises:
        ValueError: a schedule the codec or the topology does not have; a codec ``model``
            has no speed for.
    """
    chosen = _plan(schedule, codec)
    topo, N, R, H = topology, topology.nranks, topology.per_host, topology.hosts
    speed = model.speed(codec)
    wide = model.inter if H > 1 else model.intra
    if chosen.hierarchical:
        if not topo.hierarchical:
            raise ValueError(f"schedule {chosen.name!r} needs several hosts of as many ranks each")
        inner, shard = plan(codec, chosen.flat), -(-numel // R)
        payload = payload_bytes(speed, shard) if kind_of(codec).payload else None
        between = cost(inner, codec, shard, H, payload)
        between = Cost(between.messages, R * between.bytes)  # R shards over one link
        within = Cost(R - 1, (R - 1) * 4 * shard)  # reduce-scatter, then the allgather
        return (
            model.inter.time(agreement(N) + between)
            + 2 * model.intra.time(within)
            + compute_seconds(inner, codec, speed, shard, H)
        )
    if chosen.mpi_allreduce:
        # The MPI library's all-reduce at its measured efficiency; on several hosts of
        # several ranks as MPI libraries run it there: reduce within the host,
        # all-reduce between hosts, broadcast within.
        nbytes, nested = 4 * numel, H > 1 and R > 1
        within = model.intra.time(mpi_allreduce(nbytes, R)) if nested else 0.0
        between = wide.time(mpi_allreduce(nbytes, H if nested else N))
        return wide.time(agreement(N)) + model.mpi_allreduce * between + within
    payload = payload_bytes(speed, numel) if kind_of(codec).payload else None
    c = cost(chosen, codec, numel, N, payload)
    shared = (R - 1) * _alltoall_bytes(chosen, codec, numel, N, payload) if H > 1 else 0
    return wide.time(c) + shared / wide.beta + compute_seconds(chosen, codec, speed, numel, N)


def cheapest(
    plans: tuple[Plan, ...], codec, numel: int, topology: Topology, model
) -> tuple[Plan, dict[Plan, float]]:
    """Return the cheapest of ``plans`` for ``numel`` elements and every plan's predicted
    seconds (ties go to the earlier plan). The same inputs give the same choice on
    every rank."""
    times = {p: predict(p, codec, numel, topology, model) for p in plans}
    return min(times, key=times.__getitem__), times


def choose(codec, numel: int, topology: Topology, model) -> tuple[str, dict[str, float]]:
    """Return the name of the cheapest of ``schedules_of(codec, topology)`` for ``numel``
    elements, and every candidate's predicted seconds by name (ties go to the earlier
    candidate: the codec's default first). The same inputs give the same choice on
    every rank."""
    plans = parse(codec, AUTO).candidates(topology.hierarchical)
    chosen, times = cheapest(plans, codec, numel, topology, model)
    return chosen.name, {p.name: t for p, t in times.items()}
