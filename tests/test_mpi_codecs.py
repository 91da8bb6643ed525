"""Codecs across real MPI ranks: payloads survive transport byte for byte, shared
randomness is shared, and aggregated results match NumPy references built from
every rank's input. Run with ``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi``."""

import numpy as np
import pytest

import mpicomp
from conftest import gather_all, gradient_like, world

GATHER = ["none", "fp16", "topk", "signsgd", "threelc", "fft", "fastsgd"]
N = 10_007  # not divisible by 2, 3, 4, 5 or 8


def _allgather_payloads(comm, payload):
    """Allgatherv of variable-length uint8 payloads; returns one array per rank."""
    from mpi4py import MPI

    sizes = np.empty(comm.size, dtype=np.int64)
    comm.Allgather(np.array([payload.size], dtype=np.int64), sizes)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    buf = np.empty(int(sizes.sum()), dtype=np.uint8)
    comm.Allgatherv(payload, [buf, sizes, displs, MPI.BYTE])
    return [buf[d : d + s] for d, s in zip(displs, sizes, strict=True)]


@pytest.mark.mpi
@pytest.mark.parametrize("name", GATHER)
def test_gathered_payloads_decode_to_the_mean_of_every_ranks_decode(name):
    comm = world()
    codec = mpicomp.codec(name)
    x = gradient_like(N, seed=100 + comm.rank)
    payload = codec.encode(x)
    mine = codec.decode(payload)
    gathered = _allgather_payloads(comm, payload)
    np.testing.assert_array_equal(gathered[comm.rank], payload)
    mean = np.mean([codec.decode(p) for p in gathered], axis=0, dtype=np.float64)
    # Reference: every rank's own decode, moved by a plain float32 Allgather.
    reference = gather_all(comm, mine).astype(np.float64).mean(axis=0)
    np.testing.assert_array_equal(mean, reference)
    if name == "none":
        np.testing.assert_allclose(mean, gather_all(comm, x).astype(np.float64).mean(axis=0))
    # Every rank holds the same result.
    np.testing.assert_array_equal(gather_all(comm, mean)[0], mean)


@pytest.mark.mpi
@pytest.mark.parametrize("name", GATHER)
def test_same_input_gives_the_same_bytes_on_every_rank(name):
    comm = world()
    payload = mpicomp.codec(name).encode(gradient_like(N, seed=7))
    for p in _allgather_payloads(comm, payload):
        np.testing.assert_array_equal(p, payload)


@pytest.mark.mpi
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_integer_sum_over_ranks_is_the_mean_of_dequantized_codes(bits):
    from mpi4py import MPI

    comm = world()
    codec = mpicomp.codec("qsgd_maxnorm", bits=bits)
    x = gradient_like(N, seed=200 + comm.rank)
    norm = np.array([codec.local_norm(x)], dtype=np.float32)
    comm.Allreduce(MPI.IN_PLACE, norm, op=MPI.MAX)
    all_x = gather_all(comm, x)
    assert norm[0] == np.float32(max(np.linalg.norm(v.astype(np.float64)) for v in all_x))
    codes = codec.quantize(x, float(norm[0]), step=3, stream=comm.rank)
    assert np.abs(codes).max() <= codec.bound
    total = codes.astype(np.int32)
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    all_codes = gather_all(comm, codes).astype(np.int64)
    np.testing.assert_array_equal(total, all_codes.sum(axis=0))
    avg = codec.dequantize(total, float(norm[0]), nranks=comm.size)
    per_rank = np.mean([codec.dequantize(c, float(norm[0])) for c in all_codes], axis=0)
    np.testing.assert_allclose(avg, per_rank, rtol=1e-6, atol=1e-9)
    # Unbiased across ranks: the averaged error is small against the spread of one rank.
    mean_x = all_x.astype(np.float64).mean(axis=0)
    step_size = float(norm[0]) / codec.levels
    assert np.abs(avg - mean_x).max() <= step_size + 1e-6


@pytest.mark.mpi
def test_grandk_coordinates_are_identical_on_every_rank():
    comm = world()
    codec = mpicomp.codec("grandk_maxnorm", bits=4, seed=11)
    for step in range(3):
        idx = codec.coordinates(N, step)
        np.testing.assert_array_equal(gather_all(comm, idx)[0], idx)


@pytest.mark.mpi
def test_signsgd_majority_of_summed_votes_matches_reference():
    from mpi4py import MPI

    comm = world()
    codec = mpicomp.codec("signsgd", tie="negative")
    x = gradient_like(N, seed=300 + comm.rank)
    counts = codec.votes(x).astype(np.int32)
    comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    bits = codec.majority(counts, comm.size)
    positive = (gather_all(comm, x) > 0).sum(axis=0)
    expected = np.where(2 * positive > comm.size, 1.0, -1.0).astype(np.float32)
    np.testing.assert_array_equal(codec.expand(bits, N), expected)
    np.testing.assert_array_equal(gather_all(comm, bits)[0], bits)


def _fp16_ring_reference(inputs):
    """The float16 sum of every rank's row, as the fp16 ring makes it: chunk c of
    ceil(n/N) elements summed in rank order c+1, ..., N-1, 0, ..., c, each addition in
    float32 rounded to float16."""
    nranks, n = inputs.shape
    width = -(-n // nranks)
    halves = inputs.astype(np.float16)
    total = np.empty(n, np.float16)
    for c in range(nranks):
        lo, hi = min(n, c * width), min(n, (c + 1) * width)
        acc = halves[(c + 1) % nranks, lo:hi]
        for r in range(2, nranks + 1):
            with np.errstate(over="ignore"):
                acc = (acc.astype(np.float32) + halves[(c + r) % nranks, lo:hi]).astype(np.float16)
        total[lo:hi] = acc
    return total


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 3, 4097, N])
def test_fp16_ring_sum_matches_the_ring_order_reference_bit_for_bit(n):
    comm = world()
    x = gradient_like(n, seed=300 + comm.rank) * np.float32(50)
    with mpicomp.CompressedComm(comm, "fp16", min_numel=0) as cc:
        y = cc.allreduce(x, name="w")
    total = _fp16_ring_reference(gather_all(comm, x))
    expected = total.astype(np.float32) / np.float32(comm.size)
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(gather_all(comm, y)[0], y)


@pytest.mark.mpi
def test_fp16_ring_sum_that_overflows_float16_raises_on_every_rank():
    from mpicomp.errors import RankError

    comm = world()
    x = np.full(100, 40000.0, np.float32)
    with mpicomp.CompressedComm(comm, "fp16", min_numel=0) as cc:
        if comm.size == 1:
            assert cc.allreduce(x, name="w")[0] == 40000.0
            return
        with pytest.raises(RankError, match="overflows float16"):
            cc.allreduce(x, name="w")
