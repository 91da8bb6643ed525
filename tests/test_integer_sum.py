"""mpicomp/reduction/integer_sum.py on one rank: QSGD-MaxNorm's codes summed by the ring
or the direct schedule (the same bytes), within one quantization step of the input, a
refused input's error, and what the schedules cost (block norms, scale indices)."""

import numpy as np
import pytest
from mpi4py import MPI

import mpicomp
from mpicomp.collectives.direct import direct_allreduce_bounded
from mpicomp.collectives.ring import ring_allreduce_bounded
from mpicomp.model.cost import Cost, agreement, bounded
from mpicomp.reduction import integer_sum
from mpicomp.reduction.agreement import Call

KIND = integer_sum.KIND


def _x(n=1000, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_the_ring_and_the_direct_schedule_give_the_same_bytes_within_a_step():
    codec = mpicomp.codec("qsgd_maxnorm")  # 8 bits, blocks of 128
    x = _x()
    ring = integer_sum.run(Call(MPI.COMM_SELF), codec, x, collective=ring_allreduce_bounded)
    direct = integer_sum.run(Call(MPI.COMM_SELF), codec, x, collective=direct_allreduce_bounded)
    assert ring.dtype == np.float32 and ring.tobytes() == direct.tobytes()
    block = codec.params["block"]
    for lo in range(0, x.size, block):  # one level: the block's L2 norm over the bound
        step = np.linalg.norm(x[lo : lo + block].astype(np.float64)) / codec.bound
        assert np.abs(ring[lo : lo + block] - x[lo : lo + block]).max() <= step * (1 + 1e-6)
    assert not np.array_equal(ring, x)  # quantized: not the input itself


def test_the_codes_are_drawn_by_the_calls_step():
    codec = mpicomp.codec("qsgd_maxnorm", bits=4)
    x = _x()
    run = KIND.schedules["ring"].run
    again = [run(Call(MPI.COMM_SELF, step=s), codec, x) for s in (0, 0, 1)]
    assert again[0].tobytes() == again[1].tobytes()  # the same step: the same draws
    assert again[0].tobytes() != again[2].tobytes()


def test_a_multiscale_codec_shares_its_scale_indices():
    codec = mpicomp.codec("qsgd_maxnorm_multiscale")
    assert codec.multiscale
    x = _x()
    out = KIND.schedules["direct"].run(Call(MPI.COMM_SELF), codec, x)
    assert out.shape == x.shape and np.isfinite(out).all()
    assert np.abs(out - x).max() < np.abs(x).max()


def test_a_refused_input_raises_its_error():
    x = _x(100)
    x[7] = np.nan
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        KIND.schedules["ring"].run(Call(MPI.COMM_SELF), mpicomp.codec("qsgd_maxnorm"), x)


def test_what_the_schedules_cost():
    one_block = mpicomp.codec("qsgd_maxnorm", bits=4, block=0)  # one norm, in the agreement
    span = 2 * one_block.bound
    for s in ("ring", "direct"):
        assert KIND.schedules[s].cost(one_block, 1000, 4) == bounded(s, 1000, 4, span, False)
        assert KIND.schedules[s].cost(one_block, 1000, 1) == Cost(0, 0)  # one rank sends nothing
    # 8 blocks of 128: their norms go in one more MaxAllReduce of the head's size.
    blocks = mpicomp.codec("qsgd_maxnorm", bits=4, block=128)
    extra = agreement(4)  # a second MaxAllReduce head
    assert KIND.schedules["ring"].cost(blocks, 1000, 4) == extra + bounded(
        "ring", 1000, 4, span, False
    )
    assert (
        KIND.schedules["direct"].alltoall(blocks, 1000, 4) == 3 * 256 * 4 // 8
    )  # 3 chunks of 4-bit codes
