"""mpicomp/call/config.py across ranks: configurations that differ raise on every rank,
naming the fields that differ and the ranks of each value; a rank that failed is named
to the others."""

import pytest

from conftest import world
from mpicomp.call.config import Config, check_same
from mpicomp.collectives.agreement import disagreement
from mpicomp.errors import RankError


@pytest.mark.mpi
def test_the_fields_that_differ_are_named_with_their_ranks():
    comm = world()
    if comm.size < 2:
        pytest.skip("one rank agrees with itself")
    bits = 8 if comm.rank == 0 else 4
    mine = {"codec": {"name": "qsgd_maxnorm", "bits": bits}, "min_numel": 1024}
    said = disagreement(comm, mine, None)
    others = "rank 1" if comm.size == 2 else f"ranks 1-{comm.size - 1}"
    assert said == f"codec.bits: 8 on rank 0, 4 on {others}"
    with pytest.raises(
        RankError, match=f"ranks configured this CompressedComm differently: {said}"
    ):
        check_same(comm, Config(mine), None, "this CompressedComm", None)


@pytest.mark.mpi
def test_a_rank_that_failed_is_named_to_the_others():
    comm = world()
    last = comm.size - 1
    error = TypeError("bits must be an int") if comm.rank == last else None
    raised = TypeError if comm.rank == last else RankError
    with pytest.raises(raised) as e:
        check_same(comm, Config({"codec": "qsgd_maxnorm"}), error, "this CompressedComm", None)
    if comm.rank != last:
        assert (
            f"rank {last} failed making this CompressedComm: TypeError: bits must be an int"
            in str(e.value)
        )


@pytest.mark.mpi
def test_a_failure_is_said_in_the_callers_words():
    comm = world()
    last = comm.size - 1
    error = ValueError("cannot load the state") if comm.rank == last else None
    with pytest.raises(ValueError if comm.rank == last else RankError) as e:
        check_same(comm, None, error, "load", 0, failure=lambda r: f"loading failed on {r}")
    if comm.rank != last:
        assert str(e.value) == f"loading failed on [{last}]: ValueError: cannot load the state"
