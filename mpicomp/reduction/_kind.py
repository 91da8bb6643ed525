"""What an aggregation kind is: the codec methods it calls and the schedules it runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from mpicomp.collectives.direct import direct_allreduce_bounded, direct_reduce_scatter_bounded
from mpicomp.collectives.ring import ring_allreduce_bounded, ring_reduce_scatter_bounded
from mpicomp.reduction.residuals import Kept, Stateless


def _encode_and_decode(codec, speed, numel: int, nranks: int) -> float:
    return (speed.encode + speed.decode) * numel


def _none(codec, numel: int, nranks: int, payload: int | None) -> int:
    return 0


def _stateless(codec, options) -> Kept:
    return Stateless()


def _any(codec) -> bool:
    return True


class Schedule(NamedTuple):
    """One way to move a kind's bytes.

    ``run(call, codec, flat)`` averages ``flat`` over ``call.comm`` (``reduction.agreement.Call``);
    ``cost(codec, numel, nranks, payload)`` is its critical path after the agreement
    (``Cost``); ``compute(codec, speed, numel, nranks)`` one rank's encode and decode
    seconds at ``speed`` (``mpicomp.model.Speed``); ``alltoall(...)`` the bytes every rank
    sends to every other at once (they share a host's link; 0 for a ring); ``fits(codec)``
    whether a codec of the kind has it (all, unless the schedule says otherwise);
    ``scatter(call, codec, flat, mean=True)`` its first phase alone, the reduce-scatter:
    this rank's row (``reduction.rows``) of the average, or the sum (None: the kind has
    no reduce-scatter).
    """

    run: Callable
    cost: Callable
    compute: Callable = _encode_and_decode
    alltoall: Callable = _none
    fits: Callable = _any
    scatter: Callable | None = None


@dataclass(frozen=True)
class Kind:
    """An aggregation kind: ``name`` (what codecs declare as ``aggregation``), the
    ``protocol`` its codecs implement, its ``schedules`` (the default first),
    ``hierarchical`` whether ``"hier:NAME"`` runs them between hosts, ``shaped`` whether
    its bytes depend on the tensors' shapes (not only their sizes), ``payload`` whether
    their cost needs a payload's bytes, ``feedback`` whether error feedback applies;
    ``state(codec, options)`` makes what a CompressedComm keeps per tensor across calls
    (``mpicomp.reduction.residuals``: ``Stateless``, ``Residuals``, ``Memory``); ``alone(codec,
    x)``, where a kind's codecs have neither ``encode`` nor integer codes, returns the
    (encode, decode, wire bytes) closures of one rank's share (timings, bits per element)."""

    name: str
    protocol: type
    schedules: dict[str, Schedule] = field(default_factory=dict)
    hierarchical: bool = True
    shaped: bool = False
    payload: bool = False
    feedback: bool = False
    state: Callable[..., Kept] = _stateless
    alone: Callable | None = None

    @property
    def default(self) -> str:
        return next(iter(self.schedules))

    def schedules_of(self, codec) -> dict[str, Schedule]:
        """Return the schedules ``codec`` has (those that fit it), the default first."""
        return {name: s for name, s in self.schedules.items() if s.fits(codec)}


def bounded_schedules(run, cost, alltoall, scatter) -> dict[str, Schedule]:
    """Return the two schedules of bounded codes (QSGD's, signSGD's votes): ``run`` with
    the width-growing ring's sum or the direct reduce-scatter's as its ``collective``,
    ``cost(schedule, ...)`` of each; ``alltoall`` prices the direct one's all-to-all;
    ``scatter`` with the same schedule's reduce-scatter alone."""
    ring, direct = ring_allreduce_bounded, direct_allreduce_bounded
    return {
        "ring": Schedule(
            partial(run, collective=ring),
            partial(cost, "ring"),
            scatter=partial(scatter, collective=ring_reduce_scatter_bounded),
        ),
        "direct": Schedule(
            partial(run, collective=direct),
            partial(cost, "direct"),
            alltoall=alltoall,
            scatter=partial(scatter, collective=direct_reduce_scatter_bounded),
        ),
    }
