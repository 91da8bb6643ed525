"""Reliability across ranks: NaN/Inf policies, float64 overflow, debug-mode call checks,
failed calls that leave residuals alone, odd inputs, and checkpoints that replay exactly."""

import numpy as np
import pytest
from test_mpi_comm import reference_average

import mpicomp
from conftest import gather_all, gradient_like, world
from mpicomp.comm import NonFiniteWarning, RankError

N = 1003
POLICY_CODECS = ["none", "fp16", "qsgd_maxnorm", "signsgd", "threelc"]


def _bad_rank(comm):
    # The last rank: never rank 0, so messages cannot pass by naming rank 0 alone.
    return comm.size - 1


def _residuals(cc):
    return cc.state_dict()["residuals"]


def _assert_same_residuals(before, after):
    assert sorted(before) == sorted(after)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", POLICY_CODECS)
def test_raise_errors_on_every_rank_in_the_same_step(name):
    comm = world()
    bad = _bad_rank(comm)
    x = gradient_like(N, seed=comm.rank)
    if comm.rank == bad:
        x[5] = np.nan
    with mpicomp.CompressedComm(comm, name, min_numel=0) as cc:
        expected = ValueError if comm.rank == bad else RankError
        match = "NaN or Inf" if comm.rank == bad else rf"rank\(s\) {bad}: .* NaN or Inf"
        with pytest.raises(expected, match=match):
            cc.allreduce(x, name="w")
        # The communicator stays usable; the failed call took no step on any rank.
        good = gradient_like(N, seed=comm.rank)
        y = cc.allreduce(good, name="w")
        assert cc.state_dict()["step"] == 1
    np.testing.assert_array_equal(gather_all(comm, y)[0], y)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", POLICY_CODECS)
def test_skip_step_returns_zeros_and_warns_on_every_rank(name):
    comm = world()
    bad = _bad_rank(comm)
    with mpicomp.CompressedComm(comm, name, min_numel=0, nonfinite="skip_step") as cc:
        cc.allreduce(gradient_like(N, seed=comm.rank), name="w")  # residuals become nonzero
        before = _residuals(cc)
        x = gradient_like(N, seed=10 + comm.rank)
        x[7] = np.inf if comm.rank == bad else x[7]
        with pytest.warns(NonFiniteWarning, match=rf"rank\(s\) {bad}: gradient 'w'"):
            y = cc.allreduce(x.reshape(17, 59), name="w")
        assert y.shape == (17, 59) and y.dtype == np.float32
        assert not y.any()
        _assert_same_residuals(before, _residuals(cc))
    if name == "threelc":
        assert any(v.any() for v in before.values())  # the check above compared something


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", POLICY_CODECS)
def test_zero_sends_the_nan_as_zero(name):
    comm = world()
    bad = _bad_rank(comm)
    x = gradient_like(N, seed=20 + comm.rank)
    if comm.rank == bad:
        x[[3, 500]] = [np.nan, -np.inf]
    with mpicomp.CompressedComm(comm, name, min_numel=0, nonfinite="zero") as cc:
        y = cc.allreduce(x, name="w")
    assert np.isnan(x[3]) == (comm.rank == bad)  # the caller's array is left as it was
    inputs = gather_all(comm, np.where(np.isfinite(x), x, np.float32(0)))
    expected = reference_average(name, inputs)
    if name == "none":
        np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-9)
    elif name == "fp16":
        # float16 partial sums round at each hop (as in test_mpi_comm).
        atol = comm.size * 2.0**-11 * np.abs(inputs).sum(axis=0).max()
        np.testing.assert_allclose(y, expected, rtol=0, atol=atol)
    else:
        np.testing.assert_array_equal(y, expected)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["none", "threelc"])
@pytest.mark.parametrize("policy", ["raise", "skip_step", "zero"])
def test_float64_beyond_float32_is_nonfinite_not_a_silent_inf(name, policy):
    comm = world()
    bad = _bad_rank(comm)
    x = gradient_like(N, seed=30 + comm.rank).astype(np.float64)
    if comm.rank == bad:
        x[9] = 1e39
    with mpicomp.CompressedComm(comm, name, min_numel=0, nonfinite=policy) as cc:
        if policy == "raise":
            expected = ValueError if comm.rank == bad else RankError
            match = "beyond float32's range" if comm.rank == bad else rf"rank\(s\) {bad}"
            with pytest.raises(expected, match=match):
                cc.allreduce(x, name="w")
            return
        if policy == "skip_step":
            with pytest.warns(NonFiniteWarning, match=rf"rank\(s\) {bad}"):
                y = cc.allreduce(x, name="w")
            assert y.dtype == np.float64 and not y.any()
            return
        y = cc.allreduce(x, name="w")
    assert y.dtype == np.float64
    zeroed = np.where(np.abs(x) > 3.4e38, 0.0, x).astype(np.float32)
    expected = reference_average(name, gather_all(comm, zeroed))
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sharded", [False, True])
def test_a_failed_gather_call_leaves_every_residual_alone(sharded):
    comm = world()
    bad = _bad_rank(comm)
    with mpicomp.CompressedComm(comm, "threelc", min_numel=0, sharded=sharded) as cc:
        cc.allreduce(gradient_like(N, seed=comm.rank), name="w")
        before = cc.state_dict()
        x = gradient_like(N, seed=40 + comm.rank)
        if comm.rank == bad:
            x[0] = np.nan
        with pytest.raises(ValueError if comm.rank == bad else RankError):
            cc.allreduce(x, name="w")
        after = cc.state_dict()
    _assert_same_residuals(before["residuals"], after["residuals"])
    _assert_same_residuals(before["server_residuals"], after["server_residuals"])
    assert any(v.any() for v in before["residuals"].values())


@pytest.mark.mpi(min_size=2)
def test_skip_step_in_allreduce_many_skips_every_tensor():
    comm = world()
    bad = _bad_rank(comm)
    names = ["a", "b", "c", "d"]
    sizes = [300, 200, 2000, 100]  # buckets [a, b], [c], [d] with bucket_numel=600
    opts = {"min_numel": 0, "bucket_numel": 600, "nonfinite": "skip_step"}
    with mpicomp.CompressedComm(comm, "topk", ratio=0.1, **opts) as cc:
        first = [gradient_like(n, seed=comm.rank + i) for i, n in enumerate(sizes)]
        cc.allreduce_many(first, names)
        before = _residuals(cc)
        grads = [gradient_like(n, seed=50 + comm.rank + i) for i, n in enumerate(sizes)]
        if comm.rank == bad:
            grads[2][11] = np.nan  # the middle bucket: the one before has already updated
        with pytest.warns(NonFiniteWarning, match=rf"rank\(s\) {bad}: gradient 'c'"):
            out = cc.allreduce_many(grads, names)
        assert [o.shape for o in out] == [(n,) for n in sizes]
        assert not any(o.any() for o in out)
        _assert_same_residuals(before, _residuals(cc))


@pytest.mark.mpi(min_size=2)
def test_debug_names_the_rank_that_called_with_another_name():
    comm = world()
    bad = _bad_rank(comm)
    name = "fc2.bias" if comm.rank == bad else "fc1.bias"
    with mpicomp.CompressedComm(comm, "none", debug=True) as cc:
        msg = rf"rank {bad} called allreduce\('fc2.bias', 10 float32\) while rank 0 called allreduce\('fc1.bias', 10 float32\)$"  # noqa: E501
        with pytest.raises(RankError, match=msg):
            cc.allreduce(np.ones(10, np.float32), name=name)
        y = cc.allreduce(np.ones(10, np.float32), name="fc1.bias")  # still usable
    np.testing.assert_array_equal(y, np.ones(10, np.float32))


@pytest.mark.mpi(min_size=2)
def test_debug_from_the_environment_catches_a_dtype_that_plain_mode_lets_through(monkeypatch):
    comm = world()
    bad = _bad_rank(comm)
    x = np.ones(10, np.float64 if comm.rank == bad else np.float32)
    with mpicomp.CompressedComm(comm, "none") as cc:
        cc.allreduce(x, name="w")  # plain mode: sizes and names agree, so it goes through
    monkeypatch.setenv("MPICOMP_DEBUG", "1")
    with mpicomp.CompressedComm(comm, "none") as cc:
        assert cc.options.debug
        with pytest.raises(RankError, match=rf"rank {bad} called allreduce\('w', 10 float64\)"):
            cc.allreduce(x, name="w")


@pytest.mark.mpi(min_size=2)
def test_a_different_codec_is_named_when_made_and_debug_lets_a_refused_input_report_itself():
    comm = world()
    bad = _bad_rank(comm)
    bits = 6 if comm.rank == bad else 4
    match = rf"configured this CompressedComm differently: codec.bits: .*6 on rank {bad}"
    with pytest.raises(RankError, match=match):
        mpicomp.CompressedComm(comm, "qsgd_maxnorm", bits=bits, debug=True)
    with mpicomp.CompressedComm(comm, "none", debug=True) as cc:
        x = np.ones(10, np.int32 if comm.rank == bad else np.float32)
        with pytest.raises(TypeError if comm.rank == bad else RankError, match="dtype|failed"):
            cc.allreduce(x, name="w")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["none", "threelc", "qsgd_maxnorm"])
def test_odd_inputs_average_like_plain_ones(name):
    comm = world()
    wide = gradient_like(2 * N, seed=comm.rank).reshape(2, N)
    strided = wide[:, ::2]  # not contiguous: copied once at the API edge
    assert not strided.flags.c_contiguous
    with mpicomp.CompressedComm(comm, name, min_numel=0) as cc:
        y = cc.allreduce(strided, name="w")
        empty = cc.allreduce(np.zeros((0, 3), np.float32), name="e")
        scalar = cc.allreduce(np.float32(comm.rank), name="s")
    flat = np.ascontiguousarray(strided).reshape(-1)
    expected = reference_average(name, gather_all(comm, flat)).reshape(strided.shape)
    if name == "none":
        np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-9)
    else:
        np.testing.assert_array_equal(y, expected)
    assert empty.shape == (0, 3)
    assert np.shape(scalar) == ()
    if name == "none":
        assert scalar == np.float32(np.arange(comm.size).sum() / comm.size)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "name, params", [("threelc", {}), ("topk", {"ratio": 0.05}), ("threelc", {"sharded": True})]
)
def test_a_restored_checkpoint_replays_the_same_steps(name, params):
    comm = world()
    names = ["w1", "w2"]

    def grads(step):
        return [gradient_like(n, seed=100 * step + 10 * comm.rank + n) for n in (N, 2 * N)]

    with mpicomp.CompressedComm(comm, name, min_numel=0, **params) as cc:
        for step in range(2):
            cc.allreduce_many(grads(step), names)
        state = cc.state_dict()
        first = [cc.allreduce_many(grads(step), names) for step in (2, 3, 4)]
    with mpicomp.CompressedComm(comm, name, min_numel=0, **params) as fresh:
        fresh.load_state_dict(state)
        again = [fresh.allreduce_many(grads(step), names) for step in (2, 3, 4)]
    for a, b in zip(first, again, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    assert any(v.any() for v in state["residuals"].values())
