"""allgather_bytes and its ring variant across real MPI ranks, against payloads every
rank rebuilds from the sender's rank. Run with
``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/test_mpi_allgather.py``."""

import numpy as np
import pytest
from mpi4py import MPI

from conftest import world

# Payload size of rank r in a world of n ranks, per pattern.
SIZES = {
    "edges": lambda r, n: [0, 1, 63, 64, 65, 7][r % 6],
    "empty_on_odd_ranks": lambda r, n: 0 if r % 2 else 100 + r,
    "all_empty": lambda r, n: 0,
    "one_large": lambda r, n: 1 << 20 if r == n - 1 else 3 * r + 5,
    "equal": lambda r, n: 17,
}


def _module():
    from mpicomp.collectives import allgather

    return allgather


def _functions():
    mod = _module()
    return {"allgatherv": mod.allgather_bytes, "ring": mod.allgather_bytes_ring}


def _payload(rank, size):
    """The bytes rank ``rank`` sends: any rank can rebuild them."""
    return np.random.default_rng(1000 + rank).integers(0, 256, size, dtype=np.uint8)


def _expected(comm, sizes):
    return [_payload(r, sizes(r, comm.size)) for r in range(comm.size)]


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for r, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.dtype == np.uint8 and g.ndim == 1, f"rank {r}: {g.dtype} {g.shape}"
        np.testing.assert_array_equal(g, e, err_msg=f"payload of rank {r}")


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["allgatherv", "ring"])
@pytest.mark.parametrize("pattern", sorted(SIZES))
def test_every_rank_gets_every_payload_in_rank_order(kind, pattern):
    comm = world()
    sizes = SIZES[pattern]
    mine = _payload(comm.rank, sizes(comm.rank, comm.size))
    before = mine.copy()
    got = _functions()[kind](comm, mine)
    _assert_same(got, _expected(comm, sizes))
    np.testing.assert_array_equal(mine, before)  # the input is not touched
    # One receive buffer: the views are consecutive, none is the caller's array.
    base = got[0].base
    assert all(g.base is base for g in got) and base is not mine


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", sorted(SIZES))
def test_ring_gives_what_allgatherv_gives(pattern):
    comm = world()
    mine = _payload(comm.rank, SIZES[pattern](comm.rank, comm.size))
    fns = _functions()
    _assert_same(fns["ring"](comm, mine), fns["allgatherv"](comm, mine))


class _Spy(MPI.Intracomm):
    """The communicator itself (the same handle), with the size of every point-to-point
    message noted."""

    def __init__(self, comm):  # MPI.Intracomm.__new__ takes the handle of ``comm``
        self.sends, self.recvs = [], []

    def Isend(self, buf, dest, tag=0):
        self.sends.append(len(buf))
        return super().Isend(buf, dest, tag)

    def Irecv(self, buf, source, tag=0):
        self.recvs.append(len(buf))
        return super().Irecv(buf, source, tag)


def _messages(nbytes, chunk):
    """The message sizes of ``nbytes`` split at ``chunk``: full chunks, then the rest."""
    return [chunk] * (nbytes // chunk) + ([nbytes % chunk] if nbytes % chunk else [])


@pytest.mark.mpi
@pytest.mark.parametrize("chunk", [1, 7, 63, 64, 65, 1000])
def test_ring_splits_steps_into_chunks_at_every_edge(monkeypatch, chunk):
    comm = world()
    monkeypatch.setattr(_module(), "_RING_CHUNK", chunk)

    def sizes(r, n):
        return [0, 63, 64, 65, 129, 1][r % 6]

    spy = _Spy(comm)
    got = _module().allgather_bytes_ring(spy, _payload(comm.rank, sizes(comm.rank, comm.size)))
    _assert_same(got, _expected(comm, sizes))
    n, rank = comm.size, comm.rank
    steps = range(1, n)
    assert spy.sends == [m for i in steps for m in _messages(sizes((rank - i + 1) % n, n), chunk)]
    assert spy.recvs == [m for i in steps for m in _messages(sizes((rank - i) % n, n), chunk)]


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["allgatherv", "ring"])
def test_a_strided_payload_is_taken(kind):
    comm = world()
    whole = _payload(comm.rank, 2 * (40 + comm.rank))
    got = _functions()[kind](comm, whole[::2])
    expected = [_payload(r, 2 * (40 + r))[::2] for r in range(comm.size)]
    _assert_same(got, expected)


def _traced(kind, s, rank, n):
    """The records of docs/collectives.md when rank ``rank`` of ``n`` sends ``s[rank]``
    bytes: the sizes, then the data."""
    op = {"allgatherv": "allgather", "ring": "allgather_ring"}[kind]
    sizes = (f"{op}.sizes", 1, 8 if n > 1 else 0, 8 * (n - 1), 64)  # N = 1: nothing sent
    if kind == "allgatherv":  # the logical bytes: this rank's payload, the others'
        return [sizes, (f"{op}.data", 1, s[rank] if n > 1 else 0, sum(s) - s[rank], 8)]
    # The exact bytes of each step i: the payload of rank r-i+1 out, that of r-i in.
    steps = range(1, n)
    return [sizes] + [(f"{op}.data", i, s[(rank - i + 1) % n], s[(rank - i) % n], 8) for i in steps]


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["allgatherv", "ring"])
@pytest.mark.parametrize("pattern", ["edges", "one_large", "all_empty"])
def test_traced_bytes_are_the_documented_bytes(kind, pattern):
    from mpicomp.collectives.traffic import Traffic

    comm = world()
    n, rank = comm.size, comm.rank
    s = [SIZES[pattern](r, n) for r in range(n)]
    t = Traffic()
    _functions()[kind](comm, _payload(rank, s[rank]), recorder=t)
    assert t.steps == _traced(kind, s, rank, n)
    # Over the whole ring a rank sends every payload but its right neighbour's, and
    # receives every payload but its own.
    if kind == "ring":
        assert t.by_op().get("allgather_ring.data", (0, 0)) == (
            sum(s) - s[(rank + 1) % n] if n > 1 else 0,
            sum(s) - s[rank],
        )


@pytest.mark.mpi
def test_a_total_beyond_the_count_limit_raises_on_every_rank_and_the_ring_still_works(
    monkeypatch,
):
    comm = world()
    mod = _module()
    monkeypatch.setattr(mod, "_COUNT_LIMIT", 100)

    def sizes(r, n):
        return 101 if r == 0 else 30

    mine = _payload(comm.rank, sizes(comm.rank, comm.size))
    with pytest.raises(ValueError, match=r"total \d+ bytes, more than .* \(100\)"):
        mod.allgather_bytes(comm, mine)
    # Ring messages are split at the count limit.
    spy = _Spy(comm)
    _assert_same(mod.allgather_bytes_ring(spy, mine), _expected(comm, sizes))
    assert max(spy.sends + spy.recvs, default=0) <= 100  # rank 0's 101 bytes go as 100 + 1


BAD = {
    "float32": np.zeros(4, dtype=np.float32),
    "2-d": np.zeros((2, 2), dtype=np.uint8),
    "bytes": b"abcd",
    "none": None,
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["allgatherv", "ring"])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_payload_on_one_rank_raises_on_every_rank_naming_it(kind, bad):
    comm = world()
    payload = BAD[bad] if comm.rank == 1 else _payload(comm.rank, 10)
    fn = _functions()[kind]
    with pytest.raises(ValueError, match=r": rank 1 passed an invalid payload") as info:
        fn(comm, payload)
    if comm.rank == 1:
        assert isinstance(info.value.__cause__, TypeError)
    else:
        assert info.value.__cause__ is None
    # Nothing was left in flight: the next call on the same communicator is right.
    sizes = SIZES["edges"]
    _assert_same(fn(comm, _payload(comm.rank, sizes(comm.rank, comm.size))), _expected(comm, sizes))


@pytest.mark.mpi
def test_bad_payloads_on_several_ranks_are_all_named():
    comm = world()
    bad_ranks = [r for r in range(comm.size) if r % 2 == 0]  # rank 0 at least
    payload = BAD["float32"] if comm.rank in bad_ranks else _payload(comm.rank, 3)
    who = (
        f"rank {bad_ranks[0]}" if len(bad_ranks) == 1 else "ranks " + ", ".join(map(str, bad_ranks))
    )
    with pytest.raises(ValueError, match=f": {who} passed an invalid payload"):
        _module().allgather_bytes(comm, payload)
