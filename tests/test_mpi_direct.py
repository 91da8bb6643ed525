"""The direct reduce-scatter across real ranks: the same sums and majorities as the ring,
bit for bit, against NumPy references of every rank's codes; the exact traced bytes of
docs/collectives.md; errors on every rank. Run with ``mpiexec -n N python -m mpi4py -m
pytest --with-mpi -m mpi``."""

import math

import numpy as np
import pytest

from conftest import bounded_codes, bounded_length, direct_traffic, gather_all, world
from mpicomp.collectives.direct import direct_allreduce_bounded
from mpicomp.collectives.ring import ring_allreduce_bounded
from mpicomp.collectives.traffic import Traffic

LENGTHS = [0, 1, 7, 9, 64, 1001, "N-1", "8N+1"]
BOUNDS = [(1, np.int8), (7, np.int8), (127, np.int8), (32767, np.int16)]


# Ranks share the cores: one kernel thread each (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_numba_thread_per_rank")


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("bound,dtype", BOUNDS)
def test_direct_sums_are_the_exact_sums_and_the_rings_packed_stream(n, bound, dtype, chunk_align):
    comm = world()
    codes = bounded_codes(comm, bounded_length(n, comm.size), bound, dtype, 1)
    before = codes.copy()
    total = direct_allreduce_bounded(comm, codes, bound)
    expected = gather_all(comm, codes).astype(np.int64).sum(axis=0)
    packed_direct = direct_allreduce_bounded(comm, codes, bound, packed=True)
    packed_ring = ring_allreduce_bounded(comm, codes, bound, packed=True)
    assert total.dtype == np.int64
    np.testing.assert_array_equal(total, expected)
    np.testing.assert_array_equal(codes, before)  # the input is left alone
    assert packed_direct[1:] == packed_ring[1:]  # n, width, offset
    assert packed_direct.data.tobytes() == packed_ring.data.tobytes()


@pytest.mark.mpi
@pytest.mark.parametrize("n", [0, 9, 1001, "N-1"])
@pytest.mark.parametrize("bound", [1, 3, 255])
def test_direct_unsigned_sums_are_exact(n, bound, chunk_align):
    comm = world()
    n = bounded_length(n, comm.size)
    codes = np.random.default_rng([comm.rank, n, bound]).integers(0, bound + 1, n)
    total = direct_allreduce_bounded(comm, codes.astype(np.int32), bound, signed=False)
    np.testing.assert_array_equal(total, gather_all(comm, codes).sum(axis=0))


@pytest.mark.mpi
@pytest.mark.parametrize("n", [0, 1, 9, 1001, "N-1", "8N+1"])
def test_direct_majority_is_the_papers_vote_and_the_rings_bits(n, chunk_align):
    comm = world()
    n = bounded_length(n, comm.size)
    votes = np.random.default_rng([comm.rank, n, 2]).integers(0, 2, n).astype(np.uint8)
    bits = direct_allreduce_bounded(comm, votes, 1, True, signed=False)
    counts = gather_all(comm, votes).astype(np.int64).sum(axis=0)
    expected = np.packbits(2 * counts > comm.size, bitorder="little")
    assert bits.tobytes() == expected.tobytes()
    assert bits.tobytes() == ring_allreduce_bounded(comm, votes, 1, True, signed=False).tobytes()


@pytest.mark.mpi
@pytest.mark.parametrize("n", [9, 1001, "8N+1"])
def test_direct_majority_calls_decide_as_the_ring_does(n, chunk_align):
    """A tie rule keyed by the global index (as signSGD's random ties are) gives the same
    bits: the owner sees the same counts at the same offset."""
    comm = world()
    n = bounded_length(n, comm.size)
    votes = np.random.default_rng([comm.rank, n, 3]).integers(0, 2, n).astype(np.uint8)
    calls = {"ring": [], "direct": []}

    def rule(log):
        def decide(counts, offset):
            log.append((offset, counts.size, counts.dtype))
            index = np.arange(offset, offset + counts.size)
            return np.packbits((2 * counts > comm.size) | (index % 3 == 0), bitorder="little")

        return decide

    by_ring = ring_allreduce_bounded(comm, votes, 1, rule(calls["ring"]), signed=False)
    direct = direct_allreduce_bounded(comm, votes, 1, rule(calls["direct"]), signed=False)
    assert direct.tobytes() == by_ring.tobytes()
    assert calls["direct"] == calls["ring"]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [0, 5, "N-1", 1001, 10_007])
@pytest.mark.parametrize(
    "bound,signed,majority",
    [(1, False, True), (1, False, False), (7, True, False), (32767, True, False)],
    ids=["votes", "unsigned", "bound7", "bound32767"],
)
def test_direct_traffic_equals_the_formula_exactly(n, bound, signed, majority, chunk_align):
    comm = world()
    size = comm.size
    n = bounded_length(n, size)
    lowest = -bound if signed else 0
    codes = np.random.default_rng([comm.rank, n, 4]).integers(lowest, bound + 1, n)
    traffic = Traffic()
    direct_allreduce_bounded(comm, codes, bound, majority, signed=signed, recorder=traffic)
    span = 2 * bound if signed else bound
    code_width = math.ceil(math.log2(span + 1))
    sum_width = 1 if majority else math.ceil(math.log2(size * span + 1))
    sent, recv, total = direct_traffic(n, size, comm.rank, chunk_align, code_width, sum_width)
    totals = np.array([traffic.sent, traffic.recv], dtype=np.int64)
    comm.Allreduce(totals.copy(), totals)  # before any assert: a failing rank must not desync
    assert (traffic.sent, traffic.recv) == (sent, recv)
    assert totals.tolist() == [total, total]
    expected_steps = [("direct.alltoall", k, code_width) for k in range(1, size)]
    expected_steps += [("direct.allgather", j, sum_width) for j in range(1, size)]
    assert [(op, step, bits) for op, step, _, _, bits in traffic.steps] == expected_steps


@pytest.mark.mpi
def test_direct_lengths_that_differ_between_ranks_raise_on_every_rank():
    comm = world()
    if comm.size < 2:
        pytest.skip("needs two ranks")
    codes = np.zeros(10 + (comm.rank == 1), dtype=np.int8)
    with pytest.raises(ValueError, match="direct_allreduce_bounded: ranks disagree on the length"):
        direct_allreduce_bounded(comm, codes, 7)
    # The communicator is clean afterwards: the next call works.
    np.testing.assert_array_equal(
        direct_allreduce_bounded(comm, np.ones(5, np.int8), 7), np.full(5, comm.size)
    )


@pytest.mark.mpi
def test_direct_code_beyond_the_bound_on_one_rank_raises_on_every_rank():
    comm = world()
    codes = np.zeros(17, dtype=np.int8)
    if comm.rank == comm.size - 1:
        codes[3] = 8
    with pytest.raises(ValueError, match=r"outside the allowed \[-7, 7\]"):
        direct_allreduce_bounded(comm, codes, 7)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.uint8, np.uint64, np.int64])
def test_unsigned_and_wide_codes_sum_exactly_as_on_the_ring(dtype):
    """Any integer dtype: the owner's int64 sums take its own codes too (uint64 cannot
    be added to int64 in place without a cast)."""
    comm = world()
    codes = np.random.default_rng(comm.rank).integers(0, 6, 203).astype(dtype)
    want = np.sum(gather_all(comm, codes).astype(np.int64), axis=0)
    for run in (direct_allreduce_bounded, ring_allreduce_bounded):
        got = run(comm, codes, 5, signed=False)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
        # into= receives the packed stream: refused where unpacked sums are asked for
        with pytest.raises(ValueError, match="into= holds the packed result"):
            run(comm, codes, 5, signed=False, checked=False, into=object())
