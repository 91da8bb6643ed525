"""How a codec's call is averaged across ranks: one module per aggregation kind.

A codec declares its ``aggregation``; ``kind_of(codec)`` returns that ``Kind``: the
protocol the codec implements and the schedules that move its bytes, each a name and
a ``Schedule`` (``run``, ``cost``). ``parse(codec, name)`` reads a ``schedule=`` string
once, into a ``Plan`` (``plan``) or for ``"auto"`` an ``Auto`` of candidate plans;
``hier:NAME`` wraps the flat schedule NAME in ``hierarchy.run``, and ``float32`` is
``float_sum``'s MPI sum with codec ``none``. No module outside this package compares
schedule names: they read plans (``tests/test_architecture.py``).

Adding a schedule is a ``Schedule`` in its kind's module; adding a kind is a module
defining ``KIND`` (its protocol and schedules), listed in ``KINDS`` below
(docs/architecture.md walks through both).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpicomp.reduction import float_sum, gather, hierarchy, integer_sum, low_rank, majority
from mpicomp.reduction._kind import Kind, Schedule

__all__ = [
    "AUTO",
    "FLOAT32",
    "HIER",
    "KINDS",
    "SHARDED",
    "Auto",
    "Kind",
    "Plan",
    "Schedule",
    "kind_of",
    "parse",
    "plan",
    "sharded",
]

#: Every aggregation kind, by the name codecs declare.
KINDS: dict[str, Kind] = {
    k.name: k for k in (float_sum.KIND, integer_sum.KIND, majority.KIND, gather.KIND, low_rank.KIND)
}

#: ``schedule="auto"``: per call, the schedule the model predicts to be cheapest.
AUTO = "auto"
#: The uncompressed MPI_Allreduce of float32 that every codec can fall back to.
FLOAT32 = "float32"
#: The prefix of a hierarchical schedule (``"hier:ring"``).
HIER = hierarchy.PREFIX
#: The schedule of shard owners (``gather``'s), which ``sharded=True`` asks for.
SHARDED = "sharded"


def kind_of(codec) -> Kind:
    """Return the aggregation kind of ``codec``.

    Raises:
        ValueError: a codec of an aggregation kind nobody registered.
    """
    kind = KINDS.get(getattr(codec, "aggregation", None))
    if kind is None:
        raise ValueError(
            f"codec {codec!r} declares aggregation {getattr(codec, 'aggregation', None)!r}; "
            f"the kinds are {', '.join(KINDS)}"
        )
    return kind


def schedule_names(codec) -> tuple[str, ...]:
    """Return every ``schedule=`` a codec takes, its default first."""
    kind = kind_of(codec)
    flat = tuple(kind.schedules_of(codec))
    hier = tuple(HIER + s for s in flat) if kind.hierarchical else ()
    return (*flat, *hier, FLOAT32, AUTO)


def all_schedule_names() -> tuple[str, ...]:
    """Return every name ``schedule=`` takes for some codec, in the order tables show
    them: the flat schedules (kind by kind), the hierarchical ones, ``float32``,
    ``auto``."""
    flat = dict.fromkeys(s for kind in KINDS.values() for s in kind.schedules)
    hier = dict.fromkeys(
        HIER + s
        for s in flat
        for kind in KINDS.values()
        if kind.hierarchical and s in kind.schedules
    )
    return (*flat, *hier, FLOAT32, AUTO)


@dataclass(frozen=True)
class Plan:
    """A ``schedule=`` string parsed once: ``name`` as given; ``flat`` the schedule between
    ranks (between hosts when ``hierarchical``); ``schedule`` its ``Schedule`` (float32's
    for ``"float32"``); ``compressed`` False for the float32 fallback; ``mpi_allreduce``
    whether it is the MPI library's MPI_Allreduce of float32 (whose measured efficiency
    the cost model applies)."""

    name: str
    flat: str
    schedule: Schedule
    hierarchical: bool = False
    compressed: bool = True
    mpi_allreduce: bool = False

    @property
    def sharded(self) -> bool:
        """Whether shard owners re-compress (and keep residuals of their own)."""
        return self.flat == SHARDED

    @property
    def chooses(self) -> bool:
        """False: a plan is what one call runs (``Auto`` chooses one per call)."""
        return False


@dataclass(frozen=True)
class Auto:
    """``schedule="auto"`` parsed: per call, the cheapest of ``candidates`` by the model.
    ``own``: the codec's schedules; ``hier``: their hierarchical plans (empty where the
    kind has none); ``fallback``: the float32 sum (empty for a codec that does not
    compress)."""

    own: tuple[Plan, ...]
    hier: tuple[Plan, ...] = ()
    fallback: tuple[Plan, ...] = ()
    name = AUTO
    sharded = False  # a choice of the plans, no shard owners of its own

    @property
    def hierarchical(self) -> bool:
        """Whether some candidate runs by host (the hosts' communicators are needed)."""
        return bool(self.hier)

    @property
    def chooses(self) -> bool:
        return True

    def candidates(self, hierarchical: bool) -> tuple[Plan, ...]:
        """Return what is chosen among, in order (ties go to the earlier): the codec's
        own, the hierarchical ones where the ranks allow (``hierarchical``), float32."""
        return (*self.own, *(self.hier if hierarchical else ()), *self.fallback)


def candidates(codec, hierarchical: bool) -> tuple[str, ...]:
    """Return the names ``schedule="auto"`` chooses among for ``codec`` (``Auto.candidates``)."""
    return tuple(p.name for p in parse(codec, AUTO).candidates(hierarchical))


def plan(codec, name: str) -> Plan:
    """Return the ``Plan`` of ``schedule=name`` for ``codec`` (not ``"auto"``: a plan is
    what one call runs).

    Raises:
        ValueError: a schedule the codec does not have.
    """
    if name == FLOAT32:
        return Plan(name, FLOAT32, float_sum.FLOAT32, compressed=False, mpi_allreduce=True)
    kind = kind_of(codec)
    flat = name.removeprefix(HIER)
    hierarchical = flat != name
    schedule = kind.schedules_of(codec).get(flat)
    if schedule is None or (hierarchical and not kind.hierarchical):
        raise ValueError(f"codec {codec.name!r} ({kind.name}) has no schedule {name!r}")
    mpi = not hierarchical and float_sum.by_mpi_allreduce(flat, codec)
    return Plan(name, flat, schedule, hierarchical, mpi_allreduce=mpi)


def parse(codec, name: str) -> Plan | Auto:
    """Return what ``schedule=name`` asks of ``codec``: its ``Plan``, or for ``"auto"``
    the ``Auto`` of its candidates. The one place a schedule's name is read.

    Raises:
        ValueError: a schedule the codec does not have.
    """
    if name != AUTO:
        return plan(codec, name)
    kind = kind_of(codec)
    own = tuple(plan(codec, s) for s in kind.schedules_of(codec))
    if not codec.compresses:
        return Auto(own)
    hier = tuple(plan(codec, HIER + p.flat) for p in own) if kind.hierarchical else ()
    return Auto(own, hier, (plan(codec, FLOAT32),))


def sharded(codec) -> Plan | None:
    """Return the plan ``sharded=True`` stands for (``CompressedComm(sharded=True)`` is
    ``schedule="sharded"``), or None for a codec without shard owners."""
    return plan(codec, SHARDED) if SHARDED in kind_of(codec).schedules_of(codec) else None
