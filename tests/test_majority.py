"""mpicomp/reduction/majority.py on one rank: signSGD's votes decided by their owner, by
the ring or the direct schedule, against NumPy (the sign of each element times the mean
magnitude), and what the schedules cost."""

import numpy as np
import pytest
from mpi4py import MPI

import mpicomp
from mpicomp.model.cost import Cost, bounded
from mpicomp.reduction import majority
from mpicomp.reduction.agreement import Call

KIND = majority.KIND


@pytest.mark.parametrize("schedule", ["ring", "direct"])
def test_one_rank_gets_its_signs_times_its_mean_magnitude(schedule):
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    x[:10] = 0  # a vote is x > 0: a zero votes -1
    out = KIND.schedules[schedule].run(Call(MPI.COMM_SELF), mpicomp.codec("signsgd"), x)
    scale = np.float32(np.abs(x).mean(dtype=np.float64))
    want = np.where(x > 0, scale, -scale).astype(np.float32)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert set(np.unique(out).tolist()) == {float(-out.max()), float(out.max())}


def test_a_refused_input_raises_its_error():
    x = np.ones(100, np.float32)
    x[3] = np.inf
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        KIND.schedules["ring"].run(Call(MPI.COMM_SELF), mpicomp.codec("signsgd"), x)


def test_what_the_schedules_cost():
    codec = mpicomp.codec("signsgd")
    for s in ("ring", "direct"):
        # The scales' Allgather (8 bytes a rank: 2 rounds of recursive doubling on 4
        # ranks), then one-bit votes and decisions.
        assert KIND.schedules[s].cost(codec, 1000, 4) == Cost(2, 16) + bounded(s, 1000, 4, 1, True)
    assert KIND.schedules["direct"].alltoall(codec, 1000, 4) == 3 * 256 // 8  # 3 chunks of votes
