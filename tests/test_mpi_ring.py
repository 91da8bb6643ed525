"""The width-growing ring all-reduce across real ranks: exact sums, majorities and minima
against NumPy references built from every rank's codes, the exact traced bytes, and errors
raised on every rank. Run with ``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi``."""

import math

import numpy as np
import pytest

from conftest import bounded_codes, bounded_length, gather_all, ring_chunks, ring_traffic, world
from mpicomp.collectives.ring import PackedSums, ring_allreduce_bounded, ring_allreduce_min
from mpicomp.collectives.traffic import Traffic

# Symbolic lengths depend on the world size N: "N-1" is shorter than the ring, "8N+1" leaves
# trailing chunks empty; the numbers sit on and around the 8-element chunk alignment.
LENGTHS = [0, 1, 7, 8, 9, 63, 64, 65, 1001, "N-1", "8N+1"]
BOUNDS = [(1, np.int8), (7, np.int8), (127, np.int8), (32767, np.int16)]


# Ranks share the cores: one kernel thread each (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_numba_thread_per_rank")


def _check_sum(comm, codes, bound):
    before = codes.copy()
    total = ring_allreduce_bounded(comm, codes, bound)
    expected = gather_all(comm, codes).astype(np.int64).sum(axis=0)
    assert total.dtype == np.int64
    assert total.shape == codes.shape
    np.testing.assert_array_equal(total, expected)
    np.testing.assert_array_equal(codes, before)  # the input is left alone


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("bound,dtype", BOUNDS)
def test_bounded_sum_is_the_exact_sum_of_every_ranks_codes(n, bound, dtype, chunk_align):
    comm = world()
    _check_sum(comm, bounded_codes(comm, bounded_length(n, comm.size), bound, dtype), bound)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 9, "N-1", 1001])
@pytest.mark.parametrize("sign", [1, -1], ids=["all+bound", "all-bound"])
@pytest.mark.parametrize("bound,dtype", BOUNDS)
def test_bounded_sum_is_exact_with_every_code_at_the_bound(n, sign, bound, dtype):
    comm = world()
    _check_sum(comm, np.full(bounded_length(n, comm.size), sign * bound, dtype=dtype), bound)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [0, 9, 1001, "N-1"])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16])
def test_bounded_sum_takes_any_integer_dtype_and_strided_input(n, dtype):
    comm = world()
    n = bounded_length(n, comm.size)
    bound = 100
    rng = np.random.default_rng([comm.rank, n, 1])
    low = 0 if np.dtype(dtype).kind == "u" else -bound
    base = rng.integers(low, bound + 1, 2 * n).astype(dtype)
    codes = base[::2]  # not contiguous
    total = ring_allreduce_bounded(comm, codes, bound)
    np.testing.assert_array_equal(total, gather_all(comm, codes).astype(np.int64).sum(axis=0))


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("bound", [1, 7, 255])
def test_unsigned_sum_is_the_exact_sum(n, bound, chunk_align):
    comm = world()
    n = bounded_length(n, comm.size)
    rng = np.random.default_rng([comm.rank, n, bound, 2])
    codes = rng.integers(0, bound + 1, n).astype(np.uint8)
    if n:
        codes[-1] = bound
    traffic = Traffic()
    total = ring_allreduce_bounded(comm, codes, bound, signed=False, recorder=traffic)
    np.testing.assert_array_equal(total, gather_all(comm, codes).astype(np.int64).sum(axis=0))
    sent, recv, _ = ring_traffic(
        n,
        comm.size,
        comm.rank,
        chunk_align,
        lambda i: math.ceil(math.log2(i * bound + 1)),
        math.ceil(math.log2(comm.size * bound + 1)),
    )
    assert (traffic.sent, traffic.recv) == (sent, recv)


@pytest.mark.mpi
def test_the_widest_bound_that_fits_32_bits_is_still_exact():
    comm = world()
    n = 77
    rng = np.random.default_rng([comm.rank, 3])
    runs = []  # every collective first, then the asserts: a failing rank must not desync
    for signed, bound in [
        (True, (2**32 - 1) // (2 * comm.size)),
        (False, (2**32 - 1) // comm.size),
    ]:
        low = -bound if signed else 0
        codes = rng.integers(low, bound + 1, n, dtype=np.int64)
        codes[:4] = [low, bound, low, bound]
        traffic = Traffic()
        total = ring_allreduce_bounded(comm, codes, bound, signed=signed, recorder=traffic)
        runs.append((total, gather_all(comm, codes).sum(axis=0), traffic))
    for total, expected, traffic in runs:
        np.testing.assert_array_equal(total, expected)
        assert all(bits == 32 for op, *_, bits in traffic.steps if op == "ring.allgather")


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS + [10_007])
def test_majority_is_the_papers_vote_of_every_rank(n, chunk_align):
    comm = world()
    n = bounded_length(n, comm.size)
    votes = np.random.default_rng([comm.rank, n, 4]).integers(0, 2, n).astype(np.uint8)
    bits = ring_allreduce_bounded(comm, votes, 1, majority=True, signed=False)
    counts = gather_all(comm, votes).astype(np.int64).sum(axis=0)
    expected = np.packbits(2 * counts > comm.size, bitorder="little")
    assert bits.dtype == np.uint8
    assert bits.size == (n + 7) // 8
    np.testing.assert_array_equal(bits, expected)


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS)
def test_majority_with_a_callable_lets_the_chunk_owner_break_ties(n, chunk_align):
    comm = world()
    size = comm.size
    n = bounded_length(n, size)
    votes = np.random.default_rng([comm.rank, n, 5]).integers(0, 2, n).astype(np.int32)
    calls = []

    def decide(counts, offset):
        calls.append((offset, counts.size, counts.dtype))
        index = offset + np.arange(counts.size)
        bit = (2 * counts > size) | ((2 * counts == size) & (index % 3 == 0))
        return np.packbits(bit, bitorder="little")

    bits = ring_allreduce_bounded(comm, votes, 1, majority=decide, signed=False)
    counts = gather_all(comm, votes).astype(np.int64).sum(axis=0)
    index = np.arange(n)
    expected = (2 * counts > size) | ((2 * counts == size) & (index % 3 == 0))
    np.testing.assert_array_equal(bits, np.packbits(expected, bitorder="little"))
    lo, hi = ring_chunks(n, size, chunk_align)[comm.rank]
    assert calls == [(lo, hi - lo, np.dtype(np.int64))]  # once, by the owner, on its chunk


@pytest.mark.mpi
@pytest.mark.parametrize("n", [0, 5, "N-1", 1001, 10_007])
def test_signsgd_majority_traffic_equals_the_formula_exactly(n, chunk_align):
    comm = world()
    size = comm.size
    n = bounded_length(n, size)
    votes = np.random.default_rng([comm.rank, n, 6]).integers(0, 2, n).astype(np.uint8)
    traffic = Traffic()
    ring_allreduce_bounded(comm, votes, 1, majority=True, signed=False, recorder=traffic)
    # sum_{i=1}^{N-1} packed(len(chunk sent at i), ceil(log2(i+1))) + sum_j ceil(len/8)
    sent, recv, total = ring_traffic(
        n, size, comm.rank, chunk_align, lambda i: math.ceil(math.log2(i + 1)), 1
    )
    totals = np.array([traffic.sent, traffic.recv], dtype=np.int64)
    comm.Allreduce(totals.copy(), totals)  # before any assert: a failing rank must not desync
    assert (traffic.sent, traffic.recv) == (sent, recv)
    assert totals.tolist() == [total, total]
    expected_steps = [
        ("ring.reduce_scatter", i, math.ceil(math.log2(i + 1))) for i in range(1, size)
    ]
    expected_steps += [("ring.allgather", j, 1) for j in range(1, size)]
    assert [(op, step, bits) for op, step, _, _, bits in traffic.steps] == expected_steps


@pytest.mark.mpi
@pytest.mark.parametrize("n", [0, 9, "N-1", 1001])
@pytest.mark.parametrize("bound", [7, 32767])
def test_signed_bounded_traffic_equals_the_formula_exactly(n, bound, chunk_align):
    comm = world()
    size = comm.size
    n = bounded_length(n, size)
    codes = np.random.default_rng([comm.rank, n, 7]).integers(-bound, bound + 1, n)
    traffic = Traffic()
    ring_allreduce_bounded(comm, codes, bound, recorder=traffic)
    widths = [math.ceil(math.log2(2 * i * bound + 1)) for i in range(1, size + 1)]
    sent, recv, total = ring_traffic(
        n, size, comm.rank, chunk_align, lambda i: widths[i - 1], widths[-1]
    )
    totals = np.array([traffic.sent, traffic.recv], dtype=np.int64)
    comm.Allreduce(totals.copy(), totals)  # before any assert: a failing rank must not desync
    assert (traffic.sent, traffic.recv) == (sent, recv)
    assert [bits for op, *_, bits in traffic.steps if op == "ring.reduce_scatter"] == widths[:-1]
    assert totals.tolist() == [total, total]


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(
    "width,dtype", [(1, np.uint8), (3, np.int64), (8, np.uint8), (32, np.uint32)]
)
def test_min_is_the_elementwise_minimum_of_every_ranks_codes(n, width, dtype, chunk_align):
    comm = world()
    n = bounded_length(n, comm.size)
    rng = np.random.default_rng([comm.rank, n, width])
    codes = rng.integers(0, 2**width, n, dtype=np.uint64).astype(dtype)
    traffic = Traffic()
    low = ring_allreduce_min(comm, codes, width, recorder=traffic)
    expected = gather_all(comm, codes).astype(np.int64).min(axis=0, initial=2**width)
    assert low.dtype == np.int64
    np.testing.assert_array_equal(low, expected)
    sent, recv, _ = ring_traffic(n, comm.size, comm.rank, chunk_align, lambda i: width, width)
    assert (traffic.sent, traffic.recv) == (sent, recv)
    assert {op for op, *_ in traffic.steps} <= {"ring_min.reduce_scatter", "ring_min.allgather"}


def _unpack_reference(data, n, width):
    """Unpack n LSB-first codes of ``width`` bits with NumPy, bit by bit."""
    bits = np.unpackbits(np.asarray(data, dtype=np.uint8), bitorder="little")[: n * width]
    weights = np.left_shift(np.int64(1), np.arange(width, dtype=np.int64))
    return bits.reshape(n, width).astype(np.int64) @ weights if n else np.zeros(0, np.int64)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [0, 9, "8N+1", 1001, 3 * 65536 + 13])
@pytest.mark.parametrize(
    "bound,dtype,signed",
    [(1, np.int8, True), (127, np.int8, True), (1, np.uint8, False), (32767, np.int16, True)],
)
def test_packed_sums_are_the_exact_sums_as_the_ring_left_them(n, bound, dtype, signed):
    """packed=True: the allgathered stream itself, at the full sum's width, shifted."""
    comm = world()
    n = bounded_length(n, comm.size)
    rng = np.random.default_rng([comm.rank, n, bound, 5])
    codes = rng.integers(-bound if signed else 0, bound + 1, n).astype(dtype)
    total = ring_allreduce_bounded(comm, codes, bound, signed=signed, packed=True)
    plain = ring_allreduce_bounded(comm, codes, bound, signed=signed)
    expected = gather_all(comm, codes).astype(np.int64).sum(axis=0)
    span = (2 if signed else 1) * bound
    assert isinstance(total, PackedSums)
    assert total.n == n and total.width == math.ceil(math.log2(comm.size * span + 1))
    assert total.offset == (comm.size * bound if signed else 0)
    assert total.data.dtype == np.uint8 and total.data.size == (n * total.width + 7) // 8
    unpacked = _unpack_reference(total.data, n, total.width) - total.offset
    np.testing.assert_array_equal(unpacked, expected)
    np.testing.assert_array_equal(plain, expected)


@pytest.mark.mpi
def test_packed_sums_refuse_majority():
    comm = world()
    with pytest.raises(ValueError, match="packed"):
        ring_allreduce_bounded(
            comm, np.zeros(5, np.uint8), 1, majority=True, signed=False, packed=True
        )


@pytest.mark.mpi
@pytest.mark.parametrize("n", [0, 9, 3 * 65536 + 13])
def test_min_returns_the_dtype_asked_for(n):
    comm = world()
    codes = np.random.default_rng([comm.rank, n]).integers(0, 4, n).astype(np.uint8)
    low = ring_allreduce_min(comm, codes, 2, dtype=np.uint8)
    assert low.dtype == np.uint8
    expected = gather_all(comm, codes).min(axis=0, initial=3)
    np.testing.assert_array_equal(low, expected)


# --- errors: raised on every rank, never a hang --------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_lengths_that_differ_between_ranks_raise_on_every_rank():
    comm = world()
    codes = np.zeros(10 + comm.rank, dtype=np.int8)
    with pytest.raises(ValueError, match=rf"length of codes: 10 vs {9 + comm.size}"):
        ring_allreduce_bounded(comm, codes, 1)
    with pytest.raises(ValueError, match="length of codes"):
        ring_allreduce_min(comm, codes.astype(np.uint8), 4)
    # Nothing was left in flight: the next call on the same communicator is right.
    ok = ring_allreduce_bounded(comm, np.ones(10, dtype=np.int8), 1)
    np.testing.assert_array_equal(ok, np.full(10, comm.size))


@pytest.mark.mpi(min_size=2)
def test_bounds_that_differ_between_ranks_raise_on_every_rank():
    comm = world()
    codes = np.zeros(20, dtype=np.int8)
    with pytest.raises(ValueError, match=rf"disagree on bound: 1 vs {comm.size}"):
        ring_allreduce_bounded(comm, codes, 1 + comm.rank)
    with pytest.raises(ValueError, match="disagree on width"):
        ring_allreduce_min(comm, codes.astype(np.uint8), 3 + comm.rank)
    with pytest.raises(ValueError, match="disagree on signed/majority"):
        ring_allreduce_bounded(comm, codes, 1, signed=comm.rank == 0)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "call,bad",
    [
        (lambda comm, c: ring_allreduce_bounded(comm, c, 7), 8),
        (lambda comm, c: ring_allreduce_bounded(comm, c, 7), -8),
        (lambda comm, c: ring_allreduce_bounded(comm, c, 7, signed=False), -1),
        (lambda comm, c: ring_allreduce_bounded(comm, c, 1, True, signed=False), 2),
        (lambda comm, c: ring_allreduce_min(comm, c, 3), 8),
    ],
    ids=["above", "below", "negative-unsigned", "vote-of-2", "min-too-wide"],
)
def test_a_code_beyond_the_bound_on_one_rank_raises_on_every_rank(call, bad):
    comm = world()
    codes = np.zeros(33, dtype=np.int16)
    if comm.rank == comm.size - 1:
        codes[17] = bad
    with pytest.raises(
        ValueError, match=rf"\(rank {comm.size - 1} among them\), outside the allowed"
    ):
        call(comm, codes)


@pytest.mark.mpi
def test_sums_wider_than_32_bits_raise_naming_bound_and_n():
    comm = world()
    size = comm.size
    signed_bound = (2**32 - 1) // (2 * size) + 1
    with pytest.raises(ValueError, match=rf"bound={signed_bound} over N={size} ranks need 33"):
        ring_allreduce_bounded(comm, np.zeros(5, dtype=np.int64), signed_bound)
    unsigned_bound = (2**32 - 1) // size + 1
    with pytest.raises(ValueError, match=rf"bound={unsigned_bound} over N={size}"):
        ring_allreduce_bounded(comm, np.zeros(5, dtype=np.int64), unsigned_bound, signed=False)
    with pytest.raises(ValueError, match="width must lie in"):
        ring_allreduce_min(comm, np.zeros(5, dtype=np.uint8), 33)


@pytest.mark.mpi
def test_bad_arguments_raise_clear_errors():
    comm = world()
    codes = np.zeros(9, dtype=np.int8)
    with pytest.raises(TypeError, match="integer dtype"):
        ring_allreduce_bounded(comm, codes.astype(np.float32), 1)
    with pytest.raises(TypeError, match="integer dtype"):
        ring_allreduce_bounded(comm, codes.astype(bool), 1, signed=False)
    with pytest.raises(ValueError, match="must be 1-D"):
        ring_allreduce_bounded(comm, codes.reshape(3, 3), 1)
    with pytest.raises(ValueError, match="bound must be >= 1"):
        ring_allreduce_bounded(comm, codes, 0)
    with pytest.raises(TypeError, match="bound must be an integer"):
        ring_allreduce_bounded(comm, codes, 1.0)
    with pytest.raises(ValueError, match="majority needs unsigned votes"):
        ring_allreduce_bounded(comm, codes, 1, majority=True)
    with pytest.raises(ValueError, match="majority needs unsigned votes"):
        ring_allreduce_bounded(comm, codes, 3, majority=True, signed=False)
    with pytest.raises(TypeError, match="majority must be a bool or a callable"):
        ring_allreduce_bounded(comm, codes, 1, majority="yes", signed=False)
    with pytest.raises(ValueError, match="width must lie in"):
        ring_allreduce_min(comm, codes.astype(np.uint8), 0)


@pytest.mark.mpi(min_size=2)
def test_a_bad_argument_on_one_rank_raises_on_every_rank():
    comm = world()
    last = comm.rank == comm.size - 1
    codes = np.zeros(9, dtype=np.float32 if last else np.int8)
    expected = TypeError if last else ValueError
    with pytest.raises(
        expected, match="integer dtype" if last else f"rank {comm.size - 1} rejected"
    ):
        ring_allreduce_bounded(comm, codes, 1)


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["ring", "direct"])
@pytest.mark.parametrize("majority", [False, True])
def test_ready_is_asked_for_each_chunk_before_it_is_read_in_read_order(schedule, majority):
    """``ready=`` (staged codes still coming down) is called for every chunk of this
    rank's codes, first in ``Chunks.read_order`` (what a staged caller copies down in
    that order), and the sums are the NumPy ones."""
    from mpicomp.collectives.bounded import Chunks
    from mpicomp.collectives.direct import direct_allreduce_bounded

    comm = world()
    n = 8 * comm.size * 3 + 5
    rng = np.random.default_rng(comm.rank)
    codes = rng.integers(0 if majority else -3, 2 if majority else 4, n).astype(np.int8)
    asked = []

    def ready(lo, hi):
        asked.append((lo, hi))

    run = ring_allreduce_bounded if schedule == "ring" else direct_allreduce_bounded
    if majority:
        got = run(comm, codes, 1, majority=True, signed=False, checked=False, ready=ready)
        counts = np.sum(gather_all(comm, codes).astype(np.int64), axis=0)
        want = np.packbits(2 * counts > comm.size, bitorder="little")
    else:
        got = run(comm, codes, 3, checked=False, ready=ready)
        want = np.sum(gather_all(comm, codes).astype(np.int64), axis=0)
    np.testing.assert_array_equal(got, want)
    order = Chunks.of(comm, n).read_order()
    first = list(dict.fromkeys(asked))  # each span at its first asking
    assert first == order, (asked, order)
