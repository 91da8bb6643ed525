"""Codecs across real MPI ranks: payloads survive transport byte for byte, shared
randomness is shared, and aggregated results match NumPy references built from
every rank's input. Run with ``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi``."""

import math

import numpy as np
import pytest
from _qsgd_ref import (
    per_element,
    ref_average,
    ref_block_norms,
    ref_cut,
    ref_ms_quantize,
    ref_quantize,
    ref_scale_index,
)

import mpicomp
from conftest import gather_all, gather_payloads, gradient_like, ring_order_sum, world

GATHER = ["none", "fp16", "topk", "signsgd", "threelc", "fft", "fastsgd"]
N = 10_007  # not divisible by 2, 3, 4, 5 or 8


@pytest.mark.mpi
@pytest.mark.parametrize("name", GATHER)
def test_gathered_payloads_decode_to_the_mean_of_every_ranks_decode(name):
    comm = world()
    codec = mpicomp.codec(name)
    x = gradient_like(N, seed=100 + comm.rank)
    payload = codec.encode(x)
    mine = codec.decode(payload)
    gathered = gather_payloads(comm, payload)
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
    for p in gather_payloads(comm, payload):
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
    """The float16 sum of every rank's row as the fp16 ring makes it: each addition in
    float32 rounded to float16."""

    def add(acc, nxt):
        with np.errstate(over="ignore"):
            return (acc.astype(np.float32) + nxt).astype(np.float16)

    return ring_order_sum(inputs.astype(np.float16), add)


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


# ---- QSGD-MaxNorm with norms per block ---------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("block", [0, 1, 64, 1000])
def test_qsgd_block_norms_max_over_ranks_match_the_numpy_reference(block):
    from mpicomp.collectives.maxallreduce import max_allreduce

    comm = world()
    codec = mpicomp.codec("qsgd_maxnorm", block=block)
    x = gradient_like(N, seed=400 + comm.rank) * np.float32(1 + comm.rank)
    starts = ref_cut([N], block)
    np.testing.assert_array_equal(codec.blocks(N), starts)
    shared = max_allreduce(comm, codec.local_norms(x))
    want = np.max([ref_block_norms(v, starts) for v in gather_all(comm, x)], axis=0)
    np.testing.assert_array_equal(shared, want)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "bits, block, per_tensor, schedule",
    [
        (2, 64, True, None),
        (4, 1024, True, "direct"),
        (8, 1000, False, None),
        (3, 0, True, None),
        (4, 0, False, "direct"),
    ],
)
def test_qsgd_blocks_average_like_the_numpy_reference(bits, block, per_tensor, schedule):
    """CompressedComm over N ranks, one tensor and one fused bucket of four (blocks do
    not cross them unless per_tensor=False): the plain NumPy reference, bit for bit."""
    comm = world()
    shapes = [(3000,), (40, 50), (1,), (777,)]
    params = {"bits": bits, "block": block, "per_tensor": per_tensor}
    xs = [
        gradient_like(math.prod(s), seed=500 + 10 * comm.rank + i).reshape(s) * np.float32(3**i)
        for i, s in enumerate(shapes)
    ]
    opts = {"min_numel": 0, "bucket_numel": 10_000, "schedule": schedule}
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", **params, **opts) as cc:
        one = cc.allreduce(xs[0], name="w")  # step 0
        ys = cc.allreduce_many(xs, names=["a", "b", "c", "d"])  # one bucket, step 1
    want = ref_average(gather_all(comm, xs[0]), bits, block, step=0)
    np.testing.assert_array_equal(one, want)
    flat = np.concatenate([x.reshape(-1) for x in xs])
    want = ref_average(gather_all(comm, flat), bits, block, 1, shapes, per_tensor)
    got = np.concatenate([y.reshape(-1) for y in ys])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(gather_all(comm, got)[0], got)
    for y, x in zip(ys, xs, strict=True):
        assert y.shape == x.shape


@pytest.mark.mpi
@pytest.mark.parametrize(
    "name", ["qsgd_maxnorm_multiscale", "grandk_maxnorm", "grandk_maxnorm_multiscale"]
)
def test_qsgd_variants_average_block_by_block_like_the_reference(name):
    """The other three codecs through CompressedComm with small blocks, against every
    rank's block norms (MaxAllReduce by NumPy), codes and scale indices (MIN by NumPy)."""
    comm = world()
    params = {"bits": 3, "block": 50}
    if name.startswith("grandk"):
        params["k"] = 0.4
    x = gradient_like(N, seed=600 + comm.rank)
    with mpicomp.CompressedComm(comm, name, min_numel=0, **params) as cc:
        got = cc.allreduce(x, name="w")
    inputs = gather_all(comm, x)
    codec = mpicomp.codec(name, **params)
    at = {"step": 0} if name.startswith("grandk") else {}
    starts = ref_cut([codec.num_coordinates(N) if at else N], 50)
    idx = codec.coordinates(N, 0) if at else np.arange(N)
    norms = np.max([ref_block_norms(v[idx], starts) for v in inputs], axis=0)
    each = per_element(norms, starts)
    if name.endswith("multiscale"):
        levels = codec.scale_levels
        sidx = np.min([ref_scale_index(v[idx], each, levels) for v in inputs], axis=0)
        codes = [
            ref_ms_quantize(v[idx], each, levels, sidx, 0, 0, r, idx) for r, v in enumerate(inputs)
        ]
        s = np.array(levels, np.float32)[sidx]
    else:
        codes = [ref_quantize(v, each, 3, 0, 0, r, index=idx) for r, v in enumerate(inputs)]
        s = np.float32(codec.levels)
    total = np.sum(codes, axis=0)
    vals = ((total.astype(np.float32) * each) / s) / np.float32(comm.size)
    want = np.zeros(N, np.float32)
    want[idx] = vals * np.float32(N / idx.size) if at else vals
    np.testing.assert_array_equal(got, want)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "params, what",
    [({"block": -1}, "block"), ({"block": 0.5}, "block"), ({"per_tensor": "no"}, "per_tensor")],
)
def test_bad_block_parameters_are_refused_on_every_rank(params, what):
    comm = world()
    with pytest.raises(ValueError, match=what):
        mpicomp.CompressedComm(comm, "qsgd_maxnorm", **params)
    comm.Barrier()  # every rank raised and reached this line


@pytest.mark.mpi(min_size=2)
def test_ranks_with_other_blocks_raise_on_every_rank():
    from mpicomp.errors import RankError

    comm = world()
    block = 64 if comm.rank == 0 else 1024
    with pytest.raises(RankError, match="codec.block: 64 on rank 0"):
        mpicomp.CompressedComm(comm, "qsgd_maxnorm", block=block, min_numel=0)
