"""``powersgd`` through CompressedComm against a plain NumPy PowerSGD (Vogels et al. 2019,
as PyTorch's DDP hook runs it: warm start, error feedback, plain steps first, thin
tensors uncompressed), at every rank count."""

import zlib

import numpy as np
import pytest
from _devices import REQUIRE_GPU, gpu_present, place

import mpicomp
from conftest import gather_all, world
from mpicomp.errors import RankError

SHAPES = [(32, 24), (24,), (16, 40), (3, 3), (40, 2)]

# NumPy arrays everywhere; CuPy arrays where a GPU is present (the ranks share it).
PLACES = ["host"] + (["gpu"] if gpu_present() or REQUIRE_GPU else [])


def _orthonormal(m: np.ndarray) -> np.ndarray:
    """Gram-Schmidt, one column at a time (a zero column stays zero)."""
    m = m.astype(np.float64)
    for i in range(m.shape[1]):
        norm = np.linalg.norm(m[:, i])
        m[:, i] = m[:, i] / norm if norm > 0 else 0
        for j in range(i + 1, m.shape[1]):
            m[:, j] -= (m[:, i] @ m[:, j]) * m[:, i]
    return m


class Reference:
    """PowerSGD for all ranks at once, in float64: ``step(grads)`` takes every rank's
    flat gradient (tensors of ``shapes`` end to end) and returns the average."""

    def __init__(self, name, shapes, rank=1, start_iter=0, rate=2.0, warm=True, feedback=True):
        self.name, self.shapes, self.rank = name, shapes, rank
        self.start_iter, self.rate, self.warm, self.feedback = start_iter, rate, warm, feedback
        self.calls, self.q, self.errors = 0, None, None

    def _members(self):
        start = 0
        for shape in self.shapes:
            size = int(np.prod(shape))
            n = shape[0] if len(shape) > 1 else 0
            m = size // n if n else 0
            r = min(n, m, self.rank)
            factored = bool(n and m and n * m > self.rate * (n + m) * r)
            yield start, start + size, n, m, (r if factored else 0)
            start += size

    def step(self, grads: list[np.ndarray]) -> np.ndarray:
        n_ranks = len(grads)
        self.calls += 1
        if self.calls <= self.start_iter:
            return np.sum(grads, axis=0, dtype=np.float64) / n_ranks
        if self.errors is None or not self.feedback:
            self.errors = [np.zeros(g.size) for g in grads]
        xs = [g.astype(np.float64) + e for g, e in zip(grads, self.errors, strict=True)]
        members = list(self._members())
        q_size = sum(m * r for _, _, _, m, r in members)
        if self.q is None or not self.warm:
            rng = np.random.default_rng([0, zlib.crc32(self.name.encode())])
            self.q = rng.standard_normal(q_size, dtype=np.float32).astype(np.float64)
        out, new_q, at = np.empty(xs[0].size), np.empty(q_size), 0
        for a, b, n, m, r in members:
            if not r:
                out[a:b] = sum(x[a:b] for x in xs) / n_ranks
                continue
            q = _orthonormal(self.q[at : at + m * r].reshape(m, r))
            p = _orthonormal(sum(x[a:b].reshape(n, m) @ q for x in xs))
            q = sum(x[a:b].reshape(n, m).T @ p for x in xs) / n_ranks
            out[a:b] = (p @ q.T).reshape(-1)
            new_q[at : at + m * r] = q.reshape(-1)
            at += m * r
        self.q = new_q
        self.errors = [x - out for x in xs]
        return out


def _flat(tensors):
    return np.concatenate([t.reshape(-1) for t in tensors])


@pytest.mark.mpi
@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize(
    ("rank", "params"),
    [(1, {}), (2, {}), (4, {"warm_start": False}), (1, {"min_compression_rate": 1.0})],
)
def test_allreduce_many_matches_numpy_powersgd(rank, params, where):
    to_place, to_host, _ = place(where)
    comm = world()
    rng = np.random.default_rng(100 + comm.rank)
    kwargs = {"rank": rank, "start_iter": 1, **params}
    ref = None
    with mpicomp.CompressedComm(comm, "powersgd", bucket_numel=1 << 20, **kwargs) as cc:
        for _ in range(4):
            tensors = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
            got = cc.allreduce_many(
                [to_place(t) for t in tensors], names=[f"t{i}" for i in range(len(SHAPES))]
            )
            got = [to_host(g) for g in got]
            everyone = gather_all(comm, _flat(tensors))
            if ref is None:
                name = "bucket:" + "|".join(f"t{i}" for i in range(len(SHAPES)))
                ref = Reference(
                    name,
                    SHAPES,
                    rank,
                    1,
                    params.get("min_compression_rate", 2.0),
                    params.get("warm_start", True),
                )
            want = ref.step(everyone)
            assert [g.shape for g in got] == SHAPES
            np.testing.assert_allclose(_flat(got), want, rtol=2e-4, atol=2e-5)


@pytest.mark.mpi
def test_one_matrix_without_error_feedback_matches_numpy():
    comm = world()
    rng = np.random.default_rng(7 + comm.rank)
    ref = Reference("w", [(48, 64)], rank=2, start_iter=2, feedback=False)
    with mpicomp.CompressedComm(comm, "powersgd", rank=2, start_iter=2, error_feedback=False) as cc:
        for _ in range(5):
            w = rng.standard_normal((48, 64)).astype(np.float32)
            got = cc.allreduce(w, name="w")
            want = ref.step(gather_all(comm, w.reshape(-1)))
            np.testing.assert_allclose(got.reshape(-1), want, rtol=2e-4, atol=2e-5)
        assert not any(k.endswith("#error") for k in cc.state_dict()["residuals"])


@pytest.mark.mpi
def test_a_low_rank_gradient_is_averaged_exactly_and_steps_roll_back():
    """A rank-1 gradient (the same direction on every rank) is rebuilt exactly by rank-1
    factors; a rolled-back step leaves the factors and errors as they were."""
    comm = world()
    u = np.linspace(1, 2, 64, dtype=np.float32)
    v = np.linspace(-1, 1, 32, dtype=np.float32)
    w = np.outer(u, v) * (comm.rank + 1)
    with mpicomp.CompressedComm(comm, "powersgd", start_iter=0) as cc:
        avg = cc.allreduce(w, name="w")
        np.testing.assert_allclose(avg, np.outer(u, v) * (comm.size + 1) / 2, rtol=1e-4, atol=1e-5)
        before = cc.state_dict()["residuals"]
        snapshots = []
        cc.start(w * 3, name="w", snapshots=snapshots).wait()
        cc.rollback(snapshots)
        after = cc.state_dict()["residuals"]
        assert sorted(before) == sorted(after)
        for key in before:
            np.testing.assert_array_equal(before[key], after[key])


@pytest.mark.mpi
def test_shapes_that_do_not_hold_the_buffer_raise_on_every_rank():
    comm = world()
    odd = comm.size - 1
    x = np.ones(100, np.float32)
    with mpicomp.CompressedComm(comm, "powersgd", start_iter=0) as cc:
        shapes = [(10, 9)] if comm.rank == odd else [(10, 10)]
        if comm.rank == odd:
            with pytest.raises(ValueError, match="hold 90 elements"):
                cc.start(x, name="b", shapes=shapes).wait()
        elif comm.size > 1:
            with pytest.raises(RankError):
                cc.start(x, name="b", shapes=shapes).wait()
        assert cc.allreduce(x.reshape(10, 10), name="c").shape == (10, 10)  # still in step


@pytest.mark.mpi
def test_nan_on_one_rank_raises_on_every_rank():
    comm = world()
    bad = comm.size - 1
    w = np.ones((16, 16), np.float32)
    if comm.rank == bad:
        w[3, 4] = np.nan
    with mpicomp.CompressedComm(comm, "powersgd", start_iter=0) as cc:
        error = ValueError if comm.rank == bad else RankError
        with pytest.raises(error):
            cc.allreduce(w, name="w")


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"rank": 0}, "rank"),
        ({"start_iter": -1}, "start_iter"),
        ({"min_compression_rate": -1}, "min_compression_rate"),
        ({"warm_start": 1}, "warm_start"),
    ],
)
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(ValueError, match=match):
        mpicomp.codec("powersgd", **params)


# -- through mpicomp.torch's DDP hook (the optimizer: test_mpi_torch.py, byte for byte) ---

torch = pytest.importorskip("torch")
from test_mpi_torch import (  # noqa: E402
    _ddp_train,
    _model,
    _same_on_every_rank,
)

import mpicomp.torch as mt  # noqa: E402


@pytest.mark.mpi
def test_the_ddp_hook_with_powersgd_keeps_every_rank_identical(gloo):
    comm = world()
    state = mt.HookState(comm, "powersgd", start_step=1, min_numel=16, start_iter=0)
    ours = _ddp_train(_model(), state, 4)
    assert _same_on_every_rank(comm, ours)
    uncompressed = _ddp_train(_model(), mt.HookState(comm, "none"), 4)
    assert ours.tobytes() != uncompressed.tobytes()  # the codec did act
    assert np.abs(ours - uncompressed).max() < 0.5
