"""mpicomp/reduction/float_sum.py on one rank: the ``"sum"`` kind's schedules (the MPI
library's all-reduce, mpicomp's float ring, float16 on the ring) and the float32 sum
every codec falls back to: the NaN/Inf policies, one MPI_Allreduce per staging chunk,
and what each schedule costs."""

import numpy as np
import pytest
from mpi4py import MPI

import mpicomp
from mpicomp.collectives.traffic import Traffic
from mpicomp.model.cost import Cost, mpi_allreduce
from mpicomp.reduction import float_sum
from mpicomp.reduction.agreement import Call, Guard, Skipped
from mpicomp.reduction.transport import Transport

KIND = float_sum.KIND


def _x(n=1000, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("schedule", ["allreduce", "ring"])
def test_one_ranks_float32_average_is_its_input(schedule):
    x = _x()
    kept = x.copy()
    out = KIND.schedules[schedule].run(Call(MPI.COMM_SELF), mpicomp.codec("none"), x)
    assert out.dtype == np.float32 and out.tobytes() == kept.tobytes()
    assert x.tobytes() == kept.tobytes()  # summed into a buffer of the call's own


def test_fp16_goes_on_the_wire_as_float16():
    x = _x()
    out = KIND.schedules["allreduce"].run(Call(MPI.COMM_SELF), mpicomp.codec("fp16"), x)
    np.testing.assert_array_equal(out, x.astype(np.float16).astype(np.float32))


def test_the_float32_fallback_is_the_sum_of_codec_none():
    x = _x()
    out = float_sum.FLOAT32.run(Call(MPI.COMM_SELF), mpicomp.codec("none"), x)
    assert out.tobytes() == x.tobytes()
    assert float_sum.FLOAT32.compute(mpicomp.codec("topk"), None, 10**6, 8) == 0.0


def test_a_sum_of_several_staging_chunks_is_one_mpi_allreduce_per_chunk():
    traffic = Traffic()
    call = Call(MPI.COMM_SELF, recorder=traffic, transport=Transport(chunk_bytes=16))
    x = _x(10)  # 40 bytes: chunks of 4, 4 and 2 values
    out = float_sum.run(call, mpicomp.codec("none"), x)
    assert out.tobytes() == x.tobytes()
    sums = [step for op, step, *_ in traffic.steps if op == "mpi.allreduce"]
    assert sums == [1, 2, 3]  # after the agreement's head, one message per chunk


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_nan_or_inf_meets_the_policy(codec):
    x = _x(100)
    x[[3, 50]] = [np.nan, np.inf]
    c = mpicomp.codec(codec)
    with pytest.raises(ValueError, match="gradient 'w' holds NaN or Inf"):
        float_sum.run(Call(MPI.COMM_SELF, guard=Guard("raise", "gradient 'w'")), c, x)
    with pytest.raises(Skipped, match=r"rank\(s\) 0: gradient holds NaN or Inf; call skipped"):
        float_sum.run(Call(MPI.COMM_SELF, guard=Guard("skip_step")), c, x)
    out = float_sum.run(Call(MPI.COMM_SELF, guard=Guard("zero")), c, x)
    want = np.where(np.isfinite(x), x, 0).astype(np.float32)
    if codec == "fp16":
        want = want.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(out, want)


def test_the_ring_schedule_fits_float32_wires_only():
    assert list(KIND.schedules_of(mpicomp.codec("none"))) == ["allreduce", "ring"]
    assert list(KIND.schedules_of(mpicomp.codec("fp16"))) == ["allreduce"]  # its ring already
    assert not KIND.hierarchical


def test_what_each_schedule_costs():
    none, fp16 = mpicomp.codec("none"), mpicomp.codec("fp16")
    assert KIND.schedules["allreduce"].cost(none, 1000, 4) == mpi_allreduce(4000, 4)
    # The float rings: 2(N-1) steps of a chunk of ceil(n/N) values at the wire's width.
    assert KIND.schedules["allreduce"].cost(fp16, 1000, 4) == Cost(6, 6 * 2 * 250)
    assert KIND.schedules["ring"].cost(none, 1000, 4) == Cost(6, 6 * 4 * 250)
    assert KIND.schedules["allreduce"].compute(none, _Speed(), 100, 4) == 0.0
    assert KIND.schedules["allreduce"].compute(fp16, _Speed(), 100, 4) == 300.0


def test_which_schedules_are_the_mpi_librarys_allreduce():
    none, fp16, topk = (mpicomp.codec(n) for n in ("none", "fp16", "topk"))
    assert float_sum.by_mpi_allreduce("float32", topk)
    assert float_sum.by_mpi_allreduce("allreduce", none)
    assert not float_sum.by_mpi_allreduce("ring", none)
    assert not float_sum.by_mpi_allreduce("allreduce", fp16)  # float16 goes by the ring


class _Speed:
    encode, decode = 1.0, 2.0
