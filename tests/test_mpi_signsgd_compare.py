"""jobs/signsgd_compare.py across real ranks: the three ways to a signSGD majority (the
width-growing ring, an allgather of packed signs, 1-bit Adam's alltoall + allgather) give
the NumPy majority of every rank's signs, and trace exactly the bytes of their formulas.
Run with ``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi``."""

import json
import math

import numpy as np
import pytest

from conftest import gather_all, ring_chunks, ring_traffic, world

# Symbolic lengths depend on the world size N: "N-1" is shorter than the ring, "8N+1"
# leaves the last chunks empty; the numbers sit on and around whole bytes.
LENGTHS = [0, 1, 7, 8, 9, 63, 65, 1001, 4099, "N-1", "8N+1"]
SCHEMES = ["ring", "allgather", "allgatherv", "alltoall_allgather"]


def _length(n, size):
    return {"N-1": size - 1, "8N+1": 8 * size + 1}.get(n, n)


# Ranks share the cores: one kernel thread each (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_numba_thread_per_rank")


def _run(scheme, comm, x, recorder=None):
    from jobs import signsgd_compare as sc

    if scheme == "allgatherv":
        return sc.by_allgather(comm, x, recorder, library=True)
    return {
        "ring": sc.by_ring,
        "allgather": sc.by_allgather,
        "alltoall_allgather": sc.by_alltoall_allgather,
    }[scheme](comm, x, recorder)


def _numpy_majority(comm, x):
    """bit i = 1 where more than half of all ranks have x[i] > 0 (ties, zeros: 0)."""
    counts = (gather_all(comm, x) > 0).sum(axis=0)
    return np.packbits(2 * counts > comm.size, bitorder="little")


def _traffic_formula(scheme, n, size, rank):
    """Bytes (sent, received) by ``rank``, written out from docs/collectives.md."""
    B = math.ceil(n / 8)
    if size == 1:
        return 0, 0  # one rank: nothing crosses the wire
    if scheme == "ring":  # reduce-scatter at ceil(log2(i+1)) bits, allgather at 1 bit
        sent, recv, _ = ring_traffic(n, size, rank, 8, lambda i: math.ceil(math.log2(i + 1)), 1)
        return sent, recv
    sizes_sent, sizes_recv = 8, 8 * (size - 1)  # one int64 per rank first
    if scheme == "allgather":  # a ring: every step forwards one whole payload
        return sizes_sent + (size - 1) * B, sizes_recv + (size - 1) * B
    if scheme == "allgatherv":  # one Allgatherv: logical bytes, own payload out
        return sizes_sent + B, sizes_recv + (size - 1) * B
    chunk = [math.ceil((hi - lo) / 8) for lo, hi in ring_chunks(n, size, 8)]
    mine, right = chunk[rank], chunk[(rank + 1) % size]
    push = (8 * (size - 1) + B - mine, 8 * (size - 1) + (size - 1) * mine)
    pull = (sizes_sent + B - right, sizes_recv + B - mine)
    return push[0] + pull[0], push[1] + pull[1]


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_gives_the_numpy_majority_and_its_formula_bytes(scheme, n):
    from mpicomp.collectives.traffic import Traffic

    comm = world()
    n = _length(n, comm.size)
    rng = np.random.default_rng([comm.rank, n])
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) < 0.1] = 0  # zero votes -1
    traffic = Traffic()
    got = _run(scheme, comm, x, traffic)
    want = _numpy_majority(comm, x)
    assert got.dtype == np.uint8 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert (traffic.sent, traffic.recv) == _traffic_formula(scheme, n, comm.size, comm.rank)


@pytest.mark.mpi
@pytest.mark.parametrize("scheme", SCHEMES)
def test_ties_give_minus_one_and_one_vote_more_gives_plus_one(scheme):
    comm = world()
    n = 8 * comm.size + 3
    rows = []  # every collective first, then the asserts: a failing rank must not desync
    for ahead in (0, 1):  # ranks below N//2 + ahead vote +1 everywhere
        x = np.full(n, 1.0 if comm.rank < comm.size // 2 + ahead else -1.0, np.float32)
        rows.append((_run(scheme, comm, x), _numpy_majority(comm, x)))
    for got, want in rows:
        np.testing.assert_array_equal(got, want)
    tie, more = (np.unpackbits(g, bitorder="little")[:n] for g, _ in rows)
    # A tie exists only for even N; an odd N's N//2 votes for +1 lose.
    assert not tie.any()
    assert more.all()


@pytest.mark.mpi
def test_all_schemes_agree_on_one_input():
    comm = world()
    x = np.random.default_rng([comm.rank, 7]).laplace(size=3001).astype(np.float32)
    results = [_run(s, comm, x) for s in SCHEMES]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    np.testing.assert_array_equal(results[0], _numpy_majority(comm, x))


@pytest.mark.mpi
@pytest.mark.parametrize("numel", [0, 5, 1001])
def test_measure_rows_match_the_formulas_and_the_reference(numel):
    from jobs.signsgd_compare import FORMULAS, expected_bytes, measure

    comm = world()
    rows = measure(comm, numel, reps=1)
    assert [r["scheme"] for r in rows] == SCHEMES
    for r in rows:
        assert r["ranks"] == comm.size and r["numel"] == numel and r["reps"] == 1
        assert r["decisions_match"] and r["bytes_match"]
        assert r["formula"] == FORMULAS[r["scheme"]]
        most = [_traffic_formula(r["scheme"], numel, comm.size, k) for k in range(comm.size)]
        assert r["bytes_sent_per_rank"] == r["formula_sent_per_rank"] == max(s for s, _ in most)
        assert r["bytes_recv_per_rank"] == r["formula_recv_per_rank"] == max(v for _, v in most)
        assert [expected_bytes(r["scheme"], numel, comm.size, k) for k in range(comm.size)] == most
        assert r["seconds"] > 0
        if numel:
            assert r["recv_bits_per_element"] == pytest.approx(8 * r["bytes_recv_per_rank"] / numel)
        else:
            assert r["recv_bits_per_element"] is None


@pytest.mark.mpi
def test_main_prints_json_on_rank_0_only_and_progress_on_stderr(capsys):
    from jobs.signsgd_compare import main

    comm = world()
    assert main(["--numel", "1K,1.5K", "--reps", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    if comm.rank != 0:
        assert out == "" and err == ""
        return
    rows = json.loads(out)
    assert [(r["numel"], r["scheme"]) for r in rows] == [(1000, s) for s in SCHEMES] + [
        (1500, s) for s in SCHEMES
    ]
    assert "signsgd_compare:" in err


@pytest.mark.mpi
def test_main_prints_a_table_on_rank_0(capsys):
    from jobs.signsgd_compare import main

    comm = world()
    assert main(["--numel", "100", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    if comm.rank == 0:
        assert all(s in out for s in SCHEMES) and "NO" not in out and "WRONG" not in out


def test_bad_arguments_are_refused():
    from jobs.signsgd_compare import expected_bytes, main, measure

    with pytest.raises(SystemExit):
        main(["--reps", "0"])
    with pytest.raises(SystemExit):
        main(["--numel", "1.5"])
    with pytest.raises(ValueError, match="reps"):
        measure(world(), 10, reps=0)
    with pytest.raises(ValueError, match="unknown scheme"):
        expected_bytes("tree", 10, 2, 0)
