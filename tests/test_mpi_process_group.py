"""mpicomp.torch.init_process_group: torch.distributed's default group on an MPI
communicator's ranks, in its order, and a failure on one rank raised on every rank."""

import pytest

from conftest import end_process_group, world

torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")

import torch.distributed as dist  # noqa: E402

import mpicomp.torch as mt  # noqa: E402
from mpicomp import RankError  # noqa: E402

pytestmark = pytest.mark.mpi
torch.set_num_threads(1)  # ranks share the cores


def test_torch_ranks_are_the_communicators_in_its_order():
    comm = world()
    reversed_ranks = comm.Split(0, comm.size - 1 - comm.rank)
    try:
        mt.init_process_group(reversed_ranks, "gloo", timeout=60)
        try:
            assert dist.get_rank() == reversed_ranks.rank == comm.size - 1 - comm.rank
            assert dist.get_world_size() == comm.size
            t = torch.tensor([float(comm.rank)])  # MPI_COMM_WORLD's rank, reduced by torch
            dist.all_reduce(t)
            assert t.item() == comm.size * (comm.size - 1) / 2
            got = [None] * comm.size
            dist.all_gather_object(got, comm.rank)
            assert got == [comm.size - 1 - r for r in range(comm.size)]
        finally:
            end_process_group()
    finally:
        reversed_ranks.Free()


def test_a_second_start_is_refused_on_every_rank():
    comm = world()
    mt.init_process_group(comm, "gloo", timeout=60)
    try:
        with pytest.raises(RuntimeError, match="already initialized"):
            mt.init_process_group(comm, "gloo")
        assert dist.get_rank() == comm.rank  # the first group is left as it was
    finally:
        end_process_group()


def test_ranks_that_cannot_reach_rank_0_fail_on_every_rank():
    comm = world()
    if comm.size < 2:
        pytest.skip("needs a rank that connects to rank 0")
    # Only rank 0's address counts: the others look for rank 0 where it is not.
    with pytest.raises(RankError if comm.rank == 0 else Exception) as raised:
        mt.init_process_group(comm, "gloo", address="mpicomp-no-such-host.invalid", timeout=2)
    if comm.rank == 0:
        assert "connecting to rank 0's store failed on rank(s) [1" in str(raised.value)
    else:
        assert "mpicomp-no-such-host.invalid" in str(raised.value)
    assert not dist.is_initialized()
    mt.init_process_group(comm, "gloo", timeout=60)  # nothing was left behind
    end_process_group()


def test_a_timeout_that_is_not_seconds_is_refused_on_every_rank():
    comm = world()
    bad = "soon" if comm.rank == comm.size - 1 else 60  # one rank's mistake
    want = TypeError if comm.rank == comm.size - 1 else RankError
    with pytest.raises(want, match="timeout must be a timedelta or seconds, got str"):
        mt.init_process_group(comm, "gloo", timeout=bad)
    assert not dist.is_initialized()


def test_a_communicator_is_required():
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator, got int"):
        mt.init_process_group(3)
