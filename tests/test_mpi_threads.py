"""The kernels' thread count across ranks: the ranks of a host divide its CPUs, every rank
takes part in the decision whatever its environment, and CompressedComm keeps it."""

import threading

import numba
import pytest

from mpicomp.call import threads


def _count(n: int, what: str) -> str:
    """``n`` and ``what``, plural unless one, as the decision says them ("2 CPUs")."""
    return f"{n} {what}" + ("" if n == 1 else "s")


def _on_this_host(world) -> int:
    from mpi4py import MPI

    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


@pytest.mark.mpi
def test_ranks_on_a_host_divide_its_cpus(monkeypatch):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    local = _on_this_host(world)
    pool = numba.config.NUMBA_NUM_THREADS
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cpus", lambda: set(range(8 * local)))  # 8 each, shared
    got = threads.decide(world)
    assert got.threads == min(8, pool), got
    ranks = _count(local, "rank")
    assert got.why.endswith(f"{8 * local} CPUs / {ranks} on this host"), got
    # Bound to a core of its own, a rank shares it with no one.
    monkeypatch.setattr(threads, "cpus", lambda: {world.rank})
    alone = (
        "1 CPU / 1 rank on this host"
        if local == 1
        else f"1 CPU / 1 rank of {local} on this host using them"
    )
    assert threads.decide(world) == (1, alone)


@pytest.mark.mpi
def test_numba_num_threads_set_on_one_rank_only_still_decides_on_every_rank(monkeypatch):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    pool = numba.config.NUMBA_NUM_THREADS
    if world.rank == 0:
        monkeypatch.setenv("NUMBA_NUM_THREADS", str(pool))
    else:
        monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    got = threads.decide(world)  # a rank skipping the split would leave the others waiting
    if world.rank == 0:
        assert got == (pool, f"NUMBA_NUM_THREADS={pool}")
    else:
        assert "on this host" in got.why and "NUMBA_NUM_THREADS" not in got.why
    world.Barrier()


@pytest.mark.mpi
def test_a_compressed_comm_keeps_the_decision_of_its_ranks(monkeypatch):
    import numpy as np
    from mpi4py import MPI

    import mpicomp

    world = MPI.COMM_WORLD
    local = _on_this_host(world)
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cpus", lambda: set(range(local)))  # one CPU each
    monkeypatch.setattr(threads, "_decided", None)
    monkeypatch.setattr(threads, "_applied", threading.local())
    before = numba.get_num_threads()
    try:
        x = np.ones(5000, np.float32)
        with mpicomp.CompressedComm(world, "qsgd_maxnorm") as cc:
            cpus, ranks = _count(local, "CPU"), _count(local, "rank")
            assert cc.threads == (1, f"{cpus} / {ranks} on this host")
            assert threads.kept() == cc.threads and numba.get_num_threads() == 1
            cc.allreduce(x, name="w")
    finally:
        numba.set_num_threads(before)
