"""Where a CompressedComm's ranks are and what each call runs: the hosts, the model that
predicts schedules' times, the communicators of the hierarchical schedules, and the
plan of a call of n elements (parsed once per size, the same on every rank)."""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from mpicomp.call.config import Config
from mpicomp.collectives import plain
from mpicomp.collectives._wait import resolve_timeout, split
from mpicomp.model.cost import Topology, cheapest, predict
from mpicomp.model.probe import host_comm, resolve, topology
from mpicomp.reduction import FLOAT32, Auto, Plan, plan
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


def place(comm, local_comm, model, codec, schedule: Plan | Auto, *, timeout=None) -> Placement:
    """Find the hosts, make the hierarchical schedules' communicators and the model, as
    ``schedule`` asks (collective over ``comm``; a problem raises on every rank).
    ``timeout``: seconds each message may wait (None: ``MPICOMP_TIMEOUT``)."""
    hier, auto = schedule.hierarchical, schedule.chooses
    timeout = resolve_timeout(timeout)
    # Whether to split at all must not hang on one rank's argument: model= given on
    # some ranks only still makes every rank take part (rank 0's model is used).
    flag = np.array([model is not None], np.int32)
    plain.allreduce(comm, MPI.IN_PLACE, flag, MPI.MAX, timeout=timeout)
    given = bool(flag[0])
    if not (given or hier or auto):
        return Placement(Topology(1, comm.size))  # nothing to choose, no model to predict with
    node = host_comm(comm, local_comm, timeout=timeout)
    try:
        topo = topology(comm, node, timeout=timeout)
        if hier and not auto and not topo.hierarchical:
            raise ValueError(
                f"schedule={schedule.name!r} needs several hosts holding as many ranks "
                f"each; here {topo.hosts} host(s), up to {topo.per_host} rank(s) each"
                + ("" if topo.even else " (not the same on every host)")
            )
        made = resolve(comm, node, codec, model, timeout=timeout) if auto or given else None
    except BaseException:
        node.Free()
        raise
    if hier and topo.hierarchical:
        cross = split(comm, node.rank, comm.rank, timeout=timeout, name="hosts")
        return Placement(topo, made, Hosts(node, cross))
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

    def __init__(self, codec, schedule: Plan | Auto, placement: Placement, config: Config):
        self._codec = codec
        self._schedule = schedule
        self._placement = placement
        self._config = config
        self._plans: dict[tuple[int, bool], Planned] = {}
        # Below min_numel, and a warm-up step: the float32 sum (a codec that does not
        # compress runs its own schedule).
        self._uncompressed = plan(codec, FLOAT32) if codec.compresses else schedule
        self._candidates = (
            schedule.candidates(placement.topology.hierarchical) if schedule.chooses else ()
        )

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
        chosen = self._schedule if compress else self._uncompressed
        predicted = math.nan
        if chosen.chooses:
            chosen, times = cheapest(self._candidates, codec, numel, where.topology, where.model)
            predicted = times[chosen]
        elif where.model is not None:
            predicted = predict(chosen, codec, numel, where.topology, where.model)
        run = chosen.schedule.run
        if chosen.hierarchical:
            run = partial(run_by_host, inner=run, hosts=where.hosts)
        return Planned(chosen, run, predicted, self._config.with_fields(run=chosen.name))
