"""Hierarchy, a wrapper around a flat schedule: reduce within each host uncompressed,
run the flat schedule between hosts on each local rank's shard, share within the host
(``schedule="hier:NAME"``; docs/collectives.md, "Hierarchy")."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from mpi4py import MPI

from mpicomp.codecs.arrays import all_finite, array_module, zero_nonfinite
from mpicomp.collectives import plain
from mpicomp.collectives.sharded import shard_bounds
from mpicomp.errors import RankError
from mpicomp.kernels.readback import batch
from mpicomp.reduction.agreement import Call, Skipped, agree, device, down, raise_overflow, up

#: The prefix of a hierarchical schedule: ``"hier:ring"`` reduces within each host, then
#: runs the ring between hosts.
PREFIX = "hier:"


@dataclass(frozen=True)
class Hosts:
    """The communicators of the hierarchical schedules: ``node`` the ranks of this host,
    ``cross`` the ranks holding the same local rank on every host (one per host)."""

    node: object
    cross: object

    def free(self) -> None:
        self.node.Free()
        self.cross.Free()


# What a local rank's exchange between hosts ended with, the worst one decides.
_DONE, _SKIPPED, _FAILED = 0, 1, 2


def run(call: Call, codec, flat, *, inner, hosts: Hosts):
    """Reduce within the host, compress between hosts, share within the host.

    After the agreement over every rank (NaN/Inf and sizes, as every path), the R ranks
    of a host sum their float32 gradients by one ``MPI_Reduce_scatter``: local rank i
    holds shard i of the host's sum. Local rank i then runs the compressed path
    ``inner`` (a flat schedule's ``run``) on that shard with local rank i of every other
    host (``hosts.cross``): R exchanges between hosts at once, each of 1/R of the tensor.
    Their average over H hosts, times H/N, is the average over all N ranks; an
    ``MPI_Allgatherv`` within the host gives every rank the whole tensor.

    Raises:
        as every path; a host's sum that overflows float32 raises on every rank (RankError,
        or a skip under ``"skip_step"``), and a failure or skip in one exchange between
        hosts reaches every rank (one byte per rank within each host, before the
        allgather).
    """
    comm, clock, guard = call.comm, call.clock, call.guard
    dev = device(flat)
    bad = not all_finite(flat, call.kernels)
    if bad and guard.policy == "zero":
        flat, bad = zero_nonfinite(flat), False
    clock.encoded()
    agree(call, flat.size, guard.error() if bad else None, nonfinite=guard.cause if bad else 0)
    node = hosts.node
    bounds = shard_bounds(flat.size, node.size)
    counts = [b - a for a, b in bounds]
    a, b = bounds[node.rank]
    src = down(call, dev, flat, "hier.in")
    mine = array_module(src).empty(b - a, dtype=np.float32)
    plain.reduce_scatter(node, src, mine, counts, **call.io)
    # Finite inputs can still sum past float32 on a host: every rank must know before any
    # shard goes between hosts (one byte over all ranks), as the flat float32 sum does.
    overflowed = np.empty(1, dtype=np.int8)
    flag = np.array([not all_finite(mine, call.kernels)], dtype=np.int8)
    plain.allreduce(comm, flag, overflowed, MPI.MAX, **call.io)
    clock.communicated()
    if overflowed[0]:
        message = f"{codec.name}: the sum over a host's ranks overflows float32"
        raise_overflow(call, codec, "", message)
    inner_call = replace(
        call,
        comm=hosts.cross,
        stream=node.rank * hosts.cross.size,
        shapes=_pieces(call.shapes, a, b),
    )
    status, error, avg = _DONE, None, None
    try:
        # The inner call's deferred checks (gathered and pulled payloads) are read here,
        # so that a failure counts in this host's outcome, not after the allgather.
        with batch("hierarchy: between hosts"):
            avg = inner(inner_call, codec, up(dev, mine))
    except Skipped as e:
        status, error = _SKIPPED, e
    except Exception as e:  # whatever it is, this host's other ranks must hear of it
        status, error = _FAILED, e
    # Each exchange between hosts ends alike on every host: the worst outcome within the
    # host is the same on every rank, and decides for all.
    worst = np.empty(1, dtype=np.int8)
    plain.allreduce(node, np.array([status], dtype=np.int8), worst, MPI.MAX, **call.io)
    if worst[0] == _FAILED:
        if status == _FAILED:
            raise error
        raise RankError("another rank of this host failed between hosts (see its error)")
    if worst[0] == _SKIPPED:
        raise error if status == _SKIPPED else Skipped([], f"{guard.what}: call skipped")
    # The mean over hosts of the hosts' sums, times H/N: the mean over all ranks.
    avg *= np.float32(hosts.cross.size / comm.size)
    part = down(call, dev, avg, "hier.out")
    out = array_module(part).empty(flat.size, dtype=np.float32)
    plain.allgatherv(node, part, out, counts, **call.io)
    out = up(dev, out)
    clock.communicated()
    return out


def _pieces(shapes, lo: int, hi: int) -> tuple:
    """Return the parts of the tensors of ``shapes`` (end to end) that lie in [lo, hi),
    as 1-D shapes: a shard's own members, so that a codec keeping tensors apart (QSGD's
    norms per tensor) does so on the shard too."""
    out, start = [], 0
    for shape in shapes:
        stop = start + math.prod(shape)
        if min(stop, hi) > max(start, lo):
            out.append((min(stop, hi) - max(start, lo),))
        start = stop
    return tuple(out)
