"""mpicomp/call/same_call.py across ranks (``debug=True``): ranks that describe the same
call pass; a rank that calls another tensor, or with another configuration, is named
on every rank; a rank that refused its input is left out; a rank closing is said."""

import pytest

from conftest import world
from mpicomp.call.same_call import CLOSING, check_same_call
from mpicomp.errors import PeerClosed, RankError


@pytest.mark.mpi
def test_the_same_call_everywhere_passes():
    comm = world()
    check_same_call(comm, "allreduce('w', 4096 float32)", "codec=topk", None)
    # A rank that refused its input takes part with None: the others still pass.
    call = None if comm.rank == comm.size - 1 else "allreduce('w', 8 float32)"
    check_same_call(comm, call, "codec=topk", 5.0)


@pytest.mark.mpi
@pytest.mark.parametrize("timeout", [None, 0])  # 0 as the option gives it: off, not 0 s
def test_another_tensor_on_one_rank_is_named_on_every_rank(timeout):
    comm = world()
    if comm.size < 2:
        pytest.skip("one rank makes the same call as itself")
    last = comm.size - 1
    name = "fc.bias" if comm.rank == last else "fc.weight"
    with pytest.raises(RankError) as e:
        check_same_call(comm, f"allreduce({name!r}, 64 float32)", "codec=topk", timeout)
    assert str(e.value) == (
        f"rank {last} called allreduce('fc.bias', 64 float32) "
        "while rank 0 called allreduce('fc.weight', 64 float32)"
    )


@pytest.mark.mpi
def test_another_configuration_is_said_with_the_call():
    comm = world()
    if comm.size < 2:
        pytest.skip("one rank makes the same call as itself")
    config = "codec=topk ratio=0.5" if comm.rank == 1 else "codec=topk ratio=0.1"
    with pytest.raises(
        RankError, match=r"rank 1 called allreduce\('w'\) with codec=topk ratio=0.5 "
    ):
        check_same_call(comm, "allreduce('w')", config, None)


@pytest.mark.mpi
def test_a_rank_closing_makes_the_callers_raise_peer_closed():
    comm = world()
    if comm.size < 2:
        pytest.skip("no other rank to close")
    if comm.rank == 0:
        with pytest.raises(RankError, match=r"rank 0 called close\(\)"):
            check_same_call(comm, CLOSING, "codec=none", None)
    else:
        with pytest.raises(PeerClosed, match="rank 0 closed this CompressedComm while this rank"):
            check_same_call(comm, "allreduce('w')", "codec=none", None)
