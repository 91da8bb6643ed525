"""mpicomp/reduction/gather.py on one rank: variable-length payloads allgathered, or
pushed to shard owners who re-compress (sharded), against NumPy's top-k; error feedback
through the call's residuals; what the schedules cost."""

import numpy as np
import pytest
from mpi4py import MPI

import mpicomp
from mpicomp.model.cost import gathered
from mpicomp.reduction import gather
from mpicomp.reduction.agreement import Call
from mpicomp.reduction.residuals import Encoding, Residuals

KIND = gather.KIND


def _x(n=1000, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _topk(x, k):
    """NumPy's top-k by magnitude: the k largest kept, zeros elsewhere."""
    out = np.zeros_like(x)
    keep = np.argsort(-np.abs(x), kind="stable")[:k]
    out[keep] = x[keep]
    return out


@pytest.mark.parametrize("schedule", ["allgather", "sharded"])
def test_one_rank_gets_its_top_k(schedule):
    codec = mpicomp.codec("topk", ratio=0.1)
    x = _x()
    call = Call(MPI.COMM_SELF, residuals=Encoding(codec))
    out = KIND.schedules[schedule].run(call, codec, x)
    np.testing.assert_array_equal(out, _topk(x, 100))


def test_error_feedback_adds_what_the_last_call_dropped():
    codec = mpicomp.codec("topk", ratio=0.1)
    kept = Residuals(codec, sharded=False)
    x, y = _x(seed=1), _x(seed=2)
    first = gather.allgather(Call(MPI.COMM_SELF, residuals=kept.encoding("w")), codec, x)
    second = gather.allgather(Call(MPI.COMM_SELF, residuals=kept.encoding("w")), codec, y)
    np.testing.assert_array_equal(first, _topk(x, 100))
    np.testing.assert_array_equal(second, _topk(y + (x - first), 100))


def test_a_refused_input_raises_its_error():
    codec = mpicomp.codec("threelc")
    x = _x(100)
    x[0] = np.nan
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        gather.allgather(Call(MPI.COMM_SELF, residuals=Encoding(codec)), codec, x)


def test_what_the_schedules_cost():
    codec = mpicomp.codec("fft")
    for s in ("allgather", "sharded"):
        assert KIND.schedules[s].cost(codec, 10_000, 4, 900) == gathered(s, 4, 900)
    assert KIND.schedules["allgather"].alltoall(codec, 10_000, 4, 900) == 0
    assert KIND.schedules["sharded"].alltoall(codec, 10_000, 4, 900) == 675  # 3/4 of it
    assert KIND.payload and KIND.feedback
