"""``mpicomp.reduction.low_rank.run`` holds no algorithm of its own: a second low-rank
codec, whose steps differ from PowerSGD's, runs through it unchanged (one rank)."""

from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from mpicomp.reduction import low_rank
from mpicomp.reduction.agreement import Call


class RowMeans:
    """A rank-1 low-rank codec unlike PowerSGD: P = M·1 (fixed, nothing kept but a
    count), P̂ = P / |P|, Q = Mᵀ P̂, no error feedback."""

    name = "rowmeans"
    aggregation = "low_rank"
    rank = 1

    def __init__(self):
        self.steps = []  # the steps run called, in order

    def begin(self, kept, shapes, name, feedback):
        self.steps.append("begin")
        return SimpleNamespace(kept=kept, shape=shapes[0], factored=True, x=None, p=None)

    def add_error(self, work, gradient):
        self.steps.append("add_error")
        return gradient

    def compress(self, work, x):
        self.steps.append("compress")
        work.x = x.reshape(work.shape)
        return work.x @ np.ones(work.shape[1], np.float32)

    def project(self, work, p_sum):
        self.steps.append("project")
        work.p = p_sum / np.float32(np.linalg.norm(p_sum))
        return work.x.T @ work.p

    def decompress(self, work, p_sum, q_sum, nranks):
        self.steps.append("decompress")
        return np.outer(work.p, q_sum / np.float32(nranks)).reshape(-1)

    def memorize(self, work, out):
        self.steps.append("memorize")
        work.kept["calls"] = work.kept.get("calls", 0) + 1


def _call(codec, label="w", shapes=((48, 64),)):
    memory = low_rank.KIND.state(codec, SimpleNamespace(error_feedback=False))
    residuals = memory.encoding(label)
    return Call(MPI.COMM_SELF, residuals=residuals, shapes=shapes, label=label), residuals


def test_another_low_rank_codec_runs_through_the_same_run():
    codec = RowMeans()
    assert isinstance(codec, low_rank.LowRankCodec)
    u = np.linspace(1, 2, 48, dtype=np.float32)
    v = np.linspace(-0.5, 1.5, 64, dtype=np.float32)  # v·1 far from 0
    call, residuals = _call(codec)
    out = low_rank.run(call, codec, np.outer(u, v).reshape(-1))
    np.testing.assert_allclose(out.reshape(48, 64), np.outer(u, v), atol=1e-5)
    assert residuals.arrays == {"calls": 1}
    assert codec.steps == ["begin", "add_error", "compress", "project", "decompress", "memorize"]


def test_its_nan_is_refused_before_any_step_after_add_error():
    codec = RowMeans()
    x = np.ones(48 * 64, np.float32)
    x[5] = np.nan
    call, residuals = _call(codec)
    with pytest.raises(ValueError, match="NaN or Inf"):
        low_rank.run(call, codec, x)
    assert codec.steps == ["begin", "add_error"]
    assert residuals.arrays == {}
