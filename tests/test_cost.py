"""mpicomp/reduction/_cost.py: the critical path of one call as messages and bytes, by
schedule, against the counts worked out by hand from docs/collectives.md's layout."""

import pytest

from mpicomp.reduction._cost import (
    AGREEMENT_BYTES,
    NOTHING,
    Cost,
    agreement,
    bounded,
    chunk,
    direct_alltoall,
    gathered,
    log2,
    mpi_allreduce,
    small,
)


def test_costs_add_up_and_one_rank_sends_nothing():
    assert Cost(2, 100) + Cost(3, 50) == Cost(5, 150)
    assert NOTHING + Cost(1, 8) == Cost(1, 8)
    assert mpi_allreduce(4000, 1) == NOTHING
    assert bounded("ring", 1000, 1, 2, False) == NOTHING
    assert gathered("allgather", 1, 500) == NOTHING


@pytest.mark.parametrize("nranks, rounds", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4)])
def test_recursive_doubling_takes_ceil_log2_rounds(nranks, rounds):
    assert log2(nranks) == rounds
    assert small(8, nranks) == Cost(rounds, 8 * rounds)
    assert agreement(nranks) == Cost(rounds, AGREEMENT_BYTES * rounds)


def test_mpi_allreduce_sends_2_n_minus_1_over_n_of_the_bytes():
    assert mpi_allreduce(4000, 4) == Cost(4, 6000)  # 2 log2 4 messages, 2 * 3/4 * 4000
    assert mpi_allreduce(1000, 3) == Cost(4, 1334)  # ceil(2 * 2/3 * 1000)


def test_the_chunk_is_the_layouts_largest():
    assert chunk(1000, 4) == 256  # ceil(250 / 8) * 8
    assert chunk(5, 4) == 5  # one chunk holds all: never more than n
    assert chunk(0, 4) == 0


def test_bounded_ring_and_direct_bytes():
    # 1000 codes in [0, 2] on 4 ranks: chunks of 256; the ring's partials over 1, 2, 3
    # ranks take 2, 3, 3 bits (64 + 96 + 96 bytes), the sums over 4 ranks 4 bits, and the
    # allgather forwards 3 chunks of them (3 * 128 bytes).
    assert bounded("ring", 1000, 4, 2, False) == Cost(6, 64 + 96 + 96 + 384)
    # Direct: 3 chunks of one rank's 2-bit codes, then the same allgather.
    assert bounded("direct", 1000, 4, 2, False) == Cost(6, 3 * 64 + 384)
    assert direct_alltoall(1000, 4, 2) == 3 * 64
    # Majority: 1-bit votes, 1-bit decisions (3 * 32 bytes) in the allgather.
    assert bounded("ring", 1000, 4, 1, True) == Cost(6, 32 + 64 + 64 + 96)
    assert bounded("direct", 1000, 4, 1, True) == Cost(6, 3 * 32 + 96)


def test_gathered_payloads():
    # The sizes (recursive doubling of 8 bytes: 2 rounds on 4 ranks), then 3 payloads.
    assert gathered("allgather", 4, 1000) == Cost(2 + 3, 16 + 3000)
    # Sharded: the push's sizes (3 messages of 8 bytes) and its allreduce (2 rounds),
    # 3/4 of the payload pushed; the pull's sizes, 3 owners' averages of 250 bytes.
    push = Cost(3 + 2 + 3, 24 + 16 + 750)
    assert gathered("sharded", 4, 1000) == push + Cost(2 + 3, 16 + 750)
    assert gathered("sharded", 4, 1000, pulled=100) == push + Cost(2 + 3, 16 + 300)


def test_an_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="summed by 'ring' or 'direct', not 'tree'"):
        bounded("tree", 1000, 4, 2, False)
    with pytest.raises(ValueError, match="exchanged by 'allgather' or 'sharded', not 'ring'"):
        gathered("ring", 4, 1000)
