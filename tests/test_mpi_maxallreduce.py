"""max_allreduce / min_allreduce across real MPI ranks, against NumPy's max/min over
every rank's input (each rank rebuilds the others' from their rank). Run with
``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/test_mpi_maxallreduce.py``."""

import numpy as np
import pytest

from conftest import gather_all, world

DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint64"]
INLINE = 4  # the head carries this many values in these tests (monkeypatched)
LENGTHS = [0, 1, INLINE - 1, INLINE, INLINE + 1, 1000]


def _module():
    from mpicomp.collectives import maxallreduce

    return maxallreduce


@pytest.fixture
def inline(monkeypatch):
    monkeypatch.setattr(_module(), "_INLINE", INLINE)
    return INLINE


def _vector(rank, n, dtype):
    """Rank ``rank``'s input: spread over the dtype's range, signs and extremes included."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng([rank, n, dt.num])
    if dt.kind == "f":
        v = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dt)
        if n > 2:
            v[2] = [-np.inf, np.inf, 0.0][rank % 3]
    else:
        info = np.iinfo(dt)
        v = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
        if n > 2:
            v[2] = [info.min, info.max, 0][rank % 3]
    return v


def _reference(comm, n, dtype, reduce):
    return reduce(np.stack([_vector(r, n, dtype) for r in range(comm.size)]), axis=0)


OPS = {"max": (np.max, "max_allreduce"), "min": (np.min, "min_allreduce")}


@pytest.mark.mpi
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_vector_matches_numpy_over_all_ranks(inline, op, dtype, n):
    comm = world()
    reduce, name = OPS[op]
    x = _vector(comm.rank, n, dtype)
    before = x.copy()
    got = getattr(_module(), name)(comm, x)
    expected = _reference(comm, n, dtype, reduce)
    assert got.dtype == x.dtype and got.shape == (n,)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(x, before)
    assert not np.shares_memory(got, x)


@pytest.mark.mpi
@pytest.mark.parametrize("k", [0, 1, 2, 16])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 17])
def test_every_head_size_gives_the_same_result(monkeypatch, k, n):
    monkeypatch.setattr(_module(), "_INLINE", k)
    comm = world()
    for dtype in ("float32", "uint64"):
        for op, (reduce, name) in OPS.items():
            got = getattr(_module(), name)(comm, _vector(comm.rank, n, dtype))
            np.testing.assert_array_equal(got, _reference(comm, n, dtype, reduce), err_msg=op)


@pytest.mark.mpi
def test_a_strided_vector_is_taken(inline):
    comm = world()
    whole = _vector(comm.rank, 40, "float64")
    got = _module().max_allreduce(comm, whole[::3])
    np.testing.assert_array_equal(got, _reference(comm, 40, "float64", np.max)[::3])


@pytest.mark.mpi
@pytest.mark.parametrize("op", sorted(OPS))
def test_python_scalars_come_back_as_python_scalars(op):
    comm = world()
    reduce, name = OPS[op]
    fn = getattr(_module(), name)
    values = [1.5 * r - 2.25 for r in range(comm.size)]
    got = fn(comm, values[comm.rank])
    assert type(got) is float and got == reduce(values)
    ints = [(-1) ** r * (2**62 + r) for r in range(comm.size)]
    got = fn(comm, ints[comm.rank])
    assert type(got) is int and got == reduce(ints)
    f32 = [np.float32(r) / np.float32(3) for r in range(comm.size)]
    got = fn(comm, f32[comm.rank])
    assert type(got) is np.float32 and got == reduce(f32)


@pytest.mark.mpi
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("n", [3, INLINE + 5])
def test_nan_on_one_rank_is_nan_on_every_rank(inline, op, dtype, n):
    comm = world()
    reduce, name = OPS[op]
    nan_rank = comm.size - 1

    def vector(r):
        v = _vector(r, n, dtype)
        v[0] = np.inf if op == "max" else -np.inf  # NaN must win over the extremes too
        if r == nan_rank:
            v[[0, n - 1]] = -np.nan  # a NaN with the sign bit set
        return v

    got = getattr(_module(), name)(comm, vector(comm.rank))
    expected = reduce(np.stack([vector(r) for r in range(comm.size)]), axis=0)
    assert np.isnan(expected[[0, n - 1]]).all() and not np.isnan(expected[1:-1]).any()
    np.testing.assert_array_equal(got, expected)  # NaN where expected is NaN, equal elsewhere
    assert np.isnan(getattr(_module(), name)(comm, float("nan") if comm.rank == nan_rank else 1.0))


@pytest.mark.mpi
def test_signed_zeros_follow_the_float_order(inline):
    comm = world()
    x = np.array([-0.0 if comm.rank == 0 else 0.0, -0.0], dtype=np.float32)
    hi = _module().max_allreduce(comm, x)
    lo = _module().min_allreduce(comm, x)
    # max(-0, +0) = +0 and min(-0, +0) = -0; -0 alone stays -0.
    assert np.signbit(hi[0]) == (comm.size == 1) and np.signbit(hi[1])
    assert np.signbit(lo[0]) and np.signbit(lo[1])


@pytest.mark.mpi
def test_traced_bytes_are_the_head_and_the_tail(inline):
    from mpicomp.collectives.traffic import Traffic

    comm = world()
    # 8 header slots and INLINE values, int64; on one rank nothing crosses the wire.
    head = 8 * (8 + INLINE) if comm.size > 1 else 0
    tail = 40 if comm.size > 1 else 0
    t = Traffic()
    _module().max_allreduce(comm, np.zeros(INLINE, dtype=np.float32), recorder=t)
    assert t.steps == [("max_allreduce.head", 1, head, head, 64)]
    t = Traffic()
    _module().min_allreduce(comm, np.zeros(INLINE + 10, dtype=np.float32), recorder=t)
    assert t.steps == [
        ("min_allreduce.head", 1, head, head, 64),
        ("min_allreduce.tail", 1, tail, tail, 32),
    ]


def _raises_everywhere(match, fn, *args):
    with pytest.raises(ValueError, match=match) as info:
        fn(*args)
    return info.value


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "lengths",
    [(3, 4), (INLINE, INLINE + 1), (INLINE + 1, INLINE + 2), (0, 1)],
    ids=["both-in-head", "straddling-head", "both-in-tail", "empty"],
)
def test_mismatched_lengths_raise_on_every_rank(inline, lengths):
    comm = world()
    n = lengths[1] if comm.rank == 1 else lengths[0]
    match = rf"disagree on the length of x: from {lengths[0]} to {lengths[1]}"
    _raises_everywhere(match, _module().max_allreduce, comm, np.ones(n, dtype=np.float32))
    # Nothing was left in flight: the next call is right.
    assert _module().max_allreduce(comm, float(comm.rank)) == comm.size - 1


@pytest.mark.mpi(min_size=2)
def test_mismatched_dtypes_raise_on_every_rank(inline):
    comm = world()
    x = np.ones(INLINE + 3, dtype=np.float64 if comm.rank == 1 else np.float32)
    _raises_everywhere(
        r"disagree on the dtype of x: float32 and float64", _module().max_allreduce, comm, x
    )
    y = 1 if comm.rank == 1 else 1.0  # a Python int and a Python float
    _raises_everywhere(r"dtype of x: int64 and float64", _module().min_allreduce, comm, y)


@pytest.mark.mpi(min_size=2)
def test_max_on_some_ranks_and_min_on_others_raise_on_every_rank():
    comm = world()
    fn = _module().min_allreduce if comm.rank == 1 else _module().max_allreduce
    _raises_everywhere("disagree on the operation", fn, comm, np.ones(3))


BAD = {
    "list": [1.0, 2.0],
    "2-d": np.ones((2, 2)),
    "complex": np.ones(2, dtype=np.complex64),
    "bool": True,
    "string": "1.0",
    "huge-int": 2**64,
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_input_on_one_rank_raises_on_every_rank_naming_it(bad):
    comm = world()
    x = BAD[bad] if comm.rank == 1 else np.ones(2)
    err = _raises_everywhere(
        r"_allreduce: rank 1 passed an invalid x", _module().max_allreduce, comm, x
    )
    if comm.rank == 1:
        assert isinstance(err.__cause__, (TypeError, ValueError))
    else:
        assert err.__cause__ is None


@pytest.mark.mpi
def test_bad_inputs_on_several_ranks_name_the_lowest_and_highest():
    comm = world()
    low, high = comm.size // 2, comm.size - 1  # the upper half of the ranks
    x = "bad" if comm.rank >= low else np.ones(2)
    who = f"rank {low}" if low == high else rf"ranks {low} to {high} \(at least two\)"
    _raises_everywhere(f": {who} passed an invalid x", _module().min_allreduce, comm, x)


@pytest.mark.mpi
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_min_allreduce_of_packed_scale_indices(bits):
    from mpicomp.collectives.maxallreduce import min_allreduce
    from mpicomp.collectives.traffic import Traffic

    comm = world()
    n = 1001
    x = np.random.default_rng(comm.rank).integers(0, 2**bits, n).astype(np.uint8)
    t = Traffic()
    got = min_allreduce(comm, x, bits=bits, recorder=t)
    np.testing.assert_array_equal(got, gather_all(comm, x).min(axis=0))
    # Packed at `bits` bits per element: 2 (N-1) chunks of about n/N elements.
    assert t.sent <= 2 * (comm.size - 1) * (-(-n // comm.size) + 8) * bits // 8 + 2 * comm.size
