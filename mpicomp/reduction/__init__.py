"""How a codec's call is averaged across ranks: one module per aggregation kind.

A codec declares its ``aggregation``; ``kind_of(codec)`` returns that ``Kind``: the
protocol the codec implements and the schedules that move its bytes, each a name and
a ``Schedule`` (``run``, ``cost``). ``plan(codec, name)`` parses a ``schedule=`` string
once into a ``Plan``; ``hier:NAME`` wraps the flat schedule NAME in
``hierarchy.run``, and ``float32`` is ``float_sum``'s MPI sum with codec ``none``.

Adding a schedule is a ``Schedule`` in its kind's module; adding a kind is a module
defining ``KIND`` (its protocol and schedules), listed in ``KINDS`` below
(docs/architecture.md walks through both).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpicomp.reduction import float_sum, gather, hierarchy, integer_sum, low_rank, majority
from mpicomp.reduction._kind import Kind, Schedule

__all__ = ["AUTO", "FLOAT32", "HIER", "KINDS", "Kind", "Plan", "Schedule", "kind_of", "plan"]

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


def all_schedule_names() -> frozenset[str]:
    """Return every name ``schedule=`` takes for some codec."""
    names = {FLOAT32, AUTO}
    for kind in KINDS.values():
        names.update(kind.schedules)
        if kind.hierarchical:
            names.update(HIER + s for s in kind.schedules)
    return frozenset(names)


def candidates(codec, hierarchical: bool) -> tuple[str, ...]:
    """Return what ``schedule="auto"`` chooses among for ``codec``: its own schedules, the
    hierarchical ones where the ranks allow (``hierarchical``) and the kind has them, and
    the float32 MPI_Allreduce (a codec that does not compress: only its own)."""
    kind = kind_of(codec)
    flat = tuple(kind.schedules_of(codec))
    if not codec.compresses:
        return flat
    hier = tuple(HIER + s for s in flat) if hierarchical and kind.hierarchical else ()
    return (*flat, *hier, FLOAT32)


@dataclass(frozen=True)
class Plan:
    """A ``schedule=`` string parsed once: ``name`` as given; ``flat`` the schedule between
    ranks (between hosts when ``hierarchical``); ``schedule`` its ``Schedule`` (float32's
    for ``"float32"``); ``compressed`` False for the float32 fallback."""

    name: str
    flat: str
    schedule: Schedule
    hierarchical: bool = False
    compressed: bool = True

    @property
    def sharded(self) -> bool:
        """Whether shard owners re-compress (and keep residuals of their own)."""
        return self.flat == "sharded"


def plan(codec, name: str) -> Plan:
    """Return the ``Plan`` of ``schedule=name`` for ``codec`` (not ``"auto"``: a plan is
    what one call runs).

    Raises:
        ValueError: a schedule the codec does not have.
    """
    if name == FLOAT32:
        return Plan(name, FLOAT32, float_sum.FLOAT32, compressed=False)
    kind = kind_of(codec)
    flat = name.removeprefix(HIER)
    hierarchical = flat != name
    schedule = kind.schedules_of(codec).get(flat)
    if schedule is None or (hierarchical and not kind.hierarchical):
        raise ValueError(f"codec {codec.name!r} ({kind.name}) has no schedule {name!r}")
    return Plan(name, flat, schedule, hierarchical)
