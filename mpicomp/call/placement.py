"""Where a CompressedComm's ranks are and what each call runs: the hosts, the model that
predicts schedules' times, the communicators of the hierarchical schedules, and the
plan of a call of n elements (parsed once per size, the same on every rank)."""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

from mpi4py import MPI

from mpicomp.call.config import Config
from mpicomp.model.cost import Topology, choose, predict
from mpicomp.model.probe import host_comm, resolve, topology
from mpicomp.reduction import AUTO, FLOAT32, HIER, Plan, kind_of, plan
from mpicomp.reduction.hierarchy import Hosts
from mpicomp.reduction.hierarchy import run as run_by_host


class Placement(NamedTuple):
    """Where the ranks are: ``topology``, the ``model`` (or None) and the hierarchical
    schedules' ``hosts`` communicators (or None)."""

    topology: Topology
    model: object = None
    hosts: Hosts | None = None

    def free(self) -> None:
        if self.hosts is not None:
            self.hosts.free()


def place(comm, local_comm, model, codec, schedule: str) -> Placement:
    """Find the hosts, make the hierarchical schedules' communicators and the model, as
    ``schedule`` asks (collective over ``comm``; a problem raises on every rank)."""
    hier = schedule.startswith(HIER) or (schedule == AUTO and kind_of(codec).hierarchical)
    # Whether to split at all must not hang on one rank's argument: model= given on
    # some ranks only still makes every rank take part (rank 0's model is used).
    given = comm.allreduce(model is not None, op=MPI.LOR)
    if not (given or hier or schedule == AUTO):
        return Placement(Topology(1, comm.size))  # nothing to choose, no model to predict with
    node = host_comm(comm, local_comm)
    try:
        topo = topology(comm, node)
        if schedule.startswith(HIER) and not topo.hierarchical:
            raise ValueError(
                f"schedule={schedule!r} needs several hosts holding as many ranks "
                f"each; here {topo.hosts} host(s), up to {topo.per_host} rank(s) each"
                + ("" if topo.even else " (not the same on every host)")
            )
        made = resolve(comm, node, codec, model) if schedule == AUTO or given else None
    except BaseException:
        node.Free()
        raise
    if hier and topo.hierarchical:
        return Placement(topo, made, Hosts(node, comm.Split(node.rank, comm.rank)))
    node.Free()
    return Placement(topo, made)


class Planned(NamedTuple):
    """What one call runs: its ``plan``, the ``run`` function, the ``predicted`` seconds
    (NaN without a model) and the ``config`` it agrees on (the CompressedComm's and the
    schedule it runs)."""

    plan: Plan
    run: object
    predicted: float
    config: Config


class Planner:
    """The plan of a call by its size: under ``"auto"`` the cheapest schedule by the
    model, the same on every rank (same model, same size); else the one asked."""

    def __init__(self, codec, schedule: str, placement: Placement, config: Config):
        self._codec = codec
        self._schedule = schedule
        self._placement = placement
        self._config = config
        self._plans: dict[tuple[int, bool], Planned] = {}

    def plan(self, numel: int, compress: bool = True) -> Planned:
        """Return what a call of ``numel`` elements runs (``compress=False``: the float32
        sum, as below ``min_numel``)."""
        key = (numel, compress)
        found = self._plans.get(key)
        if found is None:
            found = self._plans[key] = self._make(numel, compress)
        return found

    def _make(self, numel: int, compress: bool) -> Planned:
        codec, where = self._codec, self._placement
        name = self._schedule if compress or not codec.compresses else FLOAT32
        predicted = math.nan
        if name == AUTO:
            name, times = choose(codec, numel, where.topology, where.model)
            predicted = times.get(name, math.nan)
        elif where.model is not None:
            predicted = predict(name, codec, numel, where.topology, where.model)
        chosen = plan(codec, name)
        run = chosen.schedule.run
        if chosen.hierarchical:
            run = partial(run_by_host, inner=run, hosts=where.hosts)
        return Planned(chosen, run, predicted, self._config.with_fields(run=name))
