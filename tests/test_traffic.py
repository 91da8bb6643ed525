"""collectives/traffic.py: the plain counter of what a collective reports, bytes sent and
received per exchange step, summed and by phase."""

import numpy as np
from mpi4py import MPI

from mpicomp.collectives import plain
from mpicomp.collectives.ring import ring_allreduce_bounded
from mpicomp.collectives.traffic import Traffic


def test_steps_are_kept_in_order_and_summed_by_op():
    t = Traffic()
    t.record("ring.reduce_scatter", 1, 10, 12, 3)
    t.record("ring.reduce_scatter", 2, 11, 13, 4)
    t.record("ring.allgather", 1, 5, 6)
    assert (t.sent, t.recv) == (26, 31)
    assert t.steps[-1] == ("ring.allgather", 1, 5, 6, 0)  # bits default to 0
    assert t.by_op() == {"ring.reduce_scatter": (21, 25), "ring.allgather": (5, 6)}
    assert Traffic().by_op() == {}


def test_a_collective_reports_into_it():
    t = Traffic()
    total = np.empty(4, np.float32)
    plain.allreduce(MPI.COMM_SELF, np.ones(4, np.float32), total, recorder=t, step=3)
    assert t.steps == [("mpi.allreduce", 3, 0, 0, 32)]  # one rank puts nothing on the wire
    ring_allreduce_bounded(MPI.COMM_SELF, np.array([1, -1, 0]), 1, recorder=t)
    assert set(t.by_op()) == {"mpi.allreduce"}  # a ring of one exchanges nothing
