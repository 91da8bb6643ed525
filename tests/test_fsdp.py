"""mpicomp.torch.fsdp on one process: what it refuses before any message (arguments,
an uninitialized torch.distributed), and that ``import mpicomp.torch`` leaves
torch.distributed.fsdp unloaded until an FSDP name is used."""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")

import mpicomp.torch as mt  # noqa: E402
import mpicomp.torch.fsdp  # noqa: E402, F401  (the module this file is named after)
from mpicomp import CompressedComm  # noqa: E402


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


def test_the_adapters_take_a_compressed_comm_and_a_name():
    with pytest.raises(TypeError, match="must be a mpicomp.CompressedComm"):
        mt.ReduceScatter(_self(), "layer")
    with pytest.raises(TypeError, match="must be a mpicomp.CompressedComm"):
        mt.AllReduceHook(None, "layer")
    with CompressedComm(_self(), "none") as cc:
        for make in (mt.ReduceScatter, mt.AllReduceHook):
            with pytest.raises(ValueError, match="non-empty str"):
                make(cc, "")
        assert repr(mt.ReduceScatter(cc, "fsdp:0")) == (
            "ReduceScatter('fsdp:0', codec=mpicomp.codec('none'))"
        )


def test_the_all_reduce_hook_on_one_rank_leaves_the_shard_as_it_is():
    with CompressedComm(_self(), "none") as cc:
        hook = mt.AllReduceHook(cc, "hsdp:0")
        shard = torch.linspace(-1, 1, 37, dtype=torch.bfloat16)
        before = shard.clone()
        hook(shard)
        assert shard.dtype == torch.bfloat16 and torch.equal(shard, before)


def test_hsdp_needs_the_mpi_communicator_of_every_rank():
    with CompressedComm(_self(), "none") as cc:
        with pytest.raises(TypeError, match="mpi4py communicator of every rank"):
            mt.compress_hsdp(torch.nn.Linear(2, 2), cc, "none")


def test_host_mesh_needs_torch_distributed_initialized():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group first"):
        mt.host_mesh(_self())
    with pytest.raises(TypeError, match="mpi4py communicator"):
        mt.host_mesh("world")


def test_importing_mpicomp_torch_loads_fsdp_only_when_asked():
    code = (
        "import sys, mpicomp.torch as mt\n"
        "before = 'torch.distributed.fsdp' in sys.modules\n"
        "mt.compress_fsdp\n"
        "print(before, 'torch.distributed.fsdp' in sys.modules, mt.ReduceScatter.__module__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.split() == ["False", "True", "mpicomp.torch.fsdp"]
