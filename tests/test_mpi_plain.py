"""collectives/plain.py across ranks: the library's own MPI collectives give what NumPy
computes from every rank's input, blocking (no timeout) or nonblocking and waited on
(a timeout), and report the bytes a rank moves."""

import numpy as np
import pytest
from mpi4py import MPI

from conftest import world
from mpicomp.collectives import plain
from mpicomp.collectives.traffic import Traffic

TIMEOUTS = [None, 30.0]


def _mine(comm, n=5):
    return np.arange(n, dtype=np.float64) + 10.0 * comm.rank


@pytest.mark.mpi
@pytest.mark.parametrize("timeout", TIMEOUTS)
def test_sums_and_gathers_are_numpys(timeout):
    comm = world()
    every = np.stack([np.arange(5, dtype=np.float64) + 10.0 * r for r in range(comm.size)])
    total, t = np.empty(5), Traffic()
    plain.allreduce(comm, _mine(comm), total, timeout=timeout, recorder=t)
    np.testing.assert_array_equal(total, every.sum(axis=0))
    wire = 40 if comm.size > 1 else 0
    assert t.steps == [("mpi.allreduce", 1, wire, wire, 64)]
    most = np.array([comm.rank], np.int32)
    plain.allreduce(comm, MPI.IN_PLACE, most, MPI.MAX, timeout=timeout)
    assert most.tolist() == [comm.size - 1]
    gathered = np.empty((comm.size, 5))
    plain.allgather(comm, _mine(comm), gathered, timeout=timeout)
    np.testing.assert_array_equal(gathered, every)


@pytest.mark.mpi
@pytest.mark.parametrize("timeout", TIMEOUTS)
def test_reduce_scatter_and_allgatherv_split_and_join_by_counts(timeout):
    comm = world()
    counts = [r + 1 for r in range(comm.size)]  # rank r owns r + 1 elements
    n = sum(counts)
    every = np.stack([np.arange(n, dtype=np.float32) * (r + 1) for r in range(comm.size)])
    mine = np.empty(counts[comm.rank], np.float32)
    plain.reduce_scatter(comm, every[comm.rank].copy(), mine, counts, timeout=timeout)
    lo = sum(counts[: comm.rank])
    np.testing.assert_array_equal(mine, every.sum(axis=0)[lo : lo + counts[comm.rank]])
    joined, t = np.empty(n, np.float32), Traffic()
    plain.allgatherv(comm, mine, joined, counts, timeout=timeout, recorder=t)
    np.testing.assert_array_equal(joined, every.sum(axis=0))
    own = 4 * counts[comm.rank]
    assert t.steps == [("mpi.allgatherv", 1, own if comm.size > 1 else 0, 4 * n - own, 32)]


@pytest.mark.mpi
@pytest.mark.parametrize("timeout", TIMEOUTS)
def test_broadcasts_and_objects(timeout):
    comm = world()
    root = comm.size - 1
    buf = np.full(3, comm.rank, np.int64)
    plain.bcast(comm, buf, root, timeout=timeout)
    assert buf.tolist() == [root] * 3
    plain.barrier(comm, timeout=timeout)
    obj = {"rank": comm.rank, "text": "x" * comm.rank}
    assert plain.bcast_object(comm, obj, root, timeout=timeout) == {
        "rank": root,
        "text": "x" * root,
    }
    every = [{"rank": r, "text": "x" * r} for r in range(comm.size)]
    assert plain.allgather_object(comm, obj, timeout=timeout) == every
    at_root = plain.gather_object(comm, obj, root, timeout=timeout)
    assert at_root == (every if comm.rank == root else None)
