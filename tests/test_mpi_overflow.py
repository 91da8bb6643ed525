"""No silent overflow near float32's limit (3.4e38): every codec gives the finite mean of
finite inputs, or raises the same error on every rank (skips the call under
``nonfinite="skip_step"``), and the next call goes on as if the failed one had not run.

Each codec's limit is where its own float32 arithmetic overflows for one large element
(the same one on every rank, the rest noise of 1e-3), found by experiment at 2 to 4 ranks:
the sum of N values for most codecs, the dequantization's code sum times the norm for
QSGD (codes up to s = 2^(bits-1) - 1), float16's 65520 for fp16's sum, and FFT's inverse
transform, which adds 2k kept frequencies before it divides (docs/reliability.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

import mpicomp
from conftest import gather_all, world
from mpicomp.comm import NonFiniteWarning, RankError
from mpicomp.errors import PayloadError

FLT_MAX = float(np.finfo(np.float32).max)
SHAPE = (48, 64)  # a matrix PowerSGD factors; 3,072 elements for every codec
AT = (3, 5)  # the large element
FFT_KEPT = mpicomp.codec("fft").kept(math.prod(SHAPE))  # 231 of 1,537 frequencies


@dataclass(frozen=True)
class Case:
    """A codec whose float32 arithmetic overflows for one element beyond ``limit(N)``
    (on every rank of N); ``error`` is what every rank raises past it."""

    name: str
    params: dict = field(default_factory=dict)
    limit: Callable[[int], float] = lambda n: FLT_MAX / n  # the float32 sum over ranks
    error: type = RankError
    margin: float = 0.03  # how far below and above the limit the tests go
    skips: bool = True  # skip_step skips the call (else it raises ``error`` too)
    slack: float = 1.05  # how much larger than near 1 the error may be below the limit

    @property
    def id(self) -> str:
        return "-".join([self.name, *(f"{k}={v}" for k, v in self.params.items())])


def _qsgd(levels: int):
    """Codes up to ``levels`` on each rank: dequantization overflows when the code sum
    times the norm does, before it divides by levels * N."""
    return lambda n: FLT_MAX / (levels * n)


CASES = [
    Case("none"),
    Case("fp16", limit=lambda n: 65520.0 / n),  # float16 rounds sums from 65520 to Inf
    Case("qsgd_maxnorm", {"bits": 2}, _qsgd(1)),
    Case("qsgd_maxnorm", {"bits": 4}, _qsgd(7)),
    Case("qsgd_maxnorm", {"bits": 8}, _qsgd(127)),
    Case("qsgd_maxnorm_multiscale", {}, _qsgd(127)),
    Case("grandk_maxnorm", {}, _qsgd(127)),  # k = 10,000 >= n: every coordinate
    Case("grandk_maxnorm_multiscale", {}, _qsgd(127)),
    Case("threelc"),
    Case("topk"),
    # The shard's owner averages the pushes before it compresses them again.
    Case("threelc", {"sharded": True}),
    Case("topk", {"sharded": True}),
    Case("fastsgd"),
    Case("powersgd"),  # start_iter=1000: plain float32 averages first
    Case("powersgd", {"start_iter": 0}),  # the Q factor's sum
    Case("powersgd", {"start_iter": 0, "rank": 2}),
    # The inverse transform adds the kept frequencies (each about the element's size)
    # before it divides by n, whatever N: its own payload is refused (PayloadError, under
    # skip_step too). It keeps frequencies by |X|^2 in float32, Inf past 1.8e19: they tie,
    # the lowest are kept, and the error grows (0.70 to 0.85 of the largest value here).
    Case(
        "fft",
        {"fp16": False},
        lambda n: FLT_MAX / (2 * FFT_KEPT),
        PayloadError,
        margin=0.1,
        skips=False,
        slack=1.3,
    ),
]
# Never past float32: signSGD sends signs and a mean |x| (float64); fft with fp16 (its
# default) refuses |x| > 65504, where no spectrum of a few thousand values overflows.
NO_OVERFLOW = {"signsgd": FLT_MAX, "fft": 65504.0}


def _spiked(comm, value: float, seed: int = 0) -> np.ndarray:
    """Return this rank's noise of 1e-3 with ``value`` at ``AT`` (on every rank)."""
    rng = np.random.default_rng(1000 * seed + comm.rank)
    x = (rng.standard_normal(SHAPE) * 1e-3).astype(np.float32)
    x[AT] = value
    return x


def _error(y, mean) -> float:
    return float(np.abs(y - mean).max() / np.abs(mean).max())


def _two_calls(comm, name, params, x) -> list:
    """Return two calls' averages of ``x`` by a new CompressedComm (error feedback and
    warm starts at work in the second)."""
    with mpicomp.CompressedComm(comm, name, min_numel=0, **params) as cc:
        return [cc.allreduce(x, name="w") for _ in range(2)]


def _assert_as_accurate_as_near_one(comm, name, params, x, slack=1.05):
    """``x``'s averages are finite and as close to the float64 mean as those of ``x``
    scaled by a power of two to near 1 (the codec's usual error; ``slack`` times it),
    call by call."""
    k = math.floor(math.log2(float(np.abs(x).max())))
    small = x * np.float32(2.0**-k)  # exact
    mean = gather_all(comm, x).astype(np.float64).mean(axis=0)
    got = _two_calls(comm, name, params, x)
    usual = _two_calls(comm, name, params, small)
    for y, y_small in zip(got, usual, strict=True):
        assert np.isfinite(y).all() and y.any()
        assert _error(y, mean) <= slack * _error(y_small, mean * 2.0**-k) + 1e-6


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_just_below_the_limit_the_mean_is_finite_and_as_accurate_as_usual(case):
    comm = world()
    value = (1 - case.margin) * case.limit(comm.size)
    x = _spiked(comm, value)
    _assert_as_accurate_as_near_one(comm, case.name, case.params, x, case.slack)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("name", "top"), NO_OVERFLOW.items())
def test_codecs_without_an_overflow_are_finite_at_their_largest_input(name, top):
    comm = world()
    rng = np.random.default_rng(comm.rank)
    x = rng.uniform(0.5, 1.0, SHAPE) * rng.choice([-1.0, 1.0], SHAPE)
    x = (x * top).astype(np.float32)
    x[AT] = top
    _assert_as_accurate_as_near_one(comm, name, {}, x)


def _fail_then_continue(comm, case, policy):
    """Run a good call, one past the limit, and another good one; return the failing
    call's (result, exception), the last call's average, and what a fresh
    CompressedComm loaded with the state before the failure gives (a failed or
    skipped call changes neither the residuals nor the step)."""
    params = {"min_numel": 0, "nonfinite": policy, **case.params}
    value = (1 + case.margin) * case.limit(comm.size)  # so is the mean: finite
    after = _spiked(comm, 1.0, seed=2)
    with mpicomp.CompressedComm(comm, case.name, **params) as cc:
        cc.allreduce(_spiked(comm, 1.0, seed=1), name="w")  # residuals and Q in use
        before = cc.state_dict()
        result, error = None, None
        try:
            result = cc.allreduce(_spiked(comm, value), name="w")
        except Exception as e:  # compared across ranks by the callers
            error = e
        state = cc.state_dict()
        got = cc.allreduce(after, name="w")
    assert state["step"] == before["step"]
    for key in ("residuals", "server_residuals"):
        assert sorted(state[key]) == sorted(before[key])
        for k in before[key]:
            np.testing.assert_array_equal(state[key][k], before[key][k])
    with mpicomp.CompressedComm(comm, case.name, **params) as fresh:
        fresh.load_state_dict(before)
        want = fresh.allreduce(after, name="w")
    return result, error, got, want


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_past_the_limit_every_rank_raises_the_same_error_and_goes_on(case):
    comm = world()
    _, error, got, want = _fail_then_continue(comm, case, "raise")
    outcomes = comm.allgather(None if error is None else (type(error).__name__, str(error)))
    assert outcomes[0] is not None and outcomes.count(outcomes[0]) == comm.size, outcomes
    assert isinstance(error, case.error)
    assert any(s in str(error) for s in ("overflows float", "beyond float32's range"))
    np.testing.assert_array_equal(got, want)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_past_the_limit_skip_step_gives_zeros_on_every_rank_and_goes_on(case):
    comm = world()
    if case.skips:
        with pytest.warns(NonFiniteWarning, match="overflows float"):
            result, error, got, want = _fail_then_continue(comm, case, "skip_step")
        assert error is None
        assert result.shape == SHAPE and result.dtype == np.float32 and not result.any()
    else:
        _, error, got, want = _fail_then_continue(comm, case, "skip_step")
        assert isinstance(error, case.error)
        assert comm.allgather(type(error).__name__) == [case.error.__name__] * comm.size
    np.testing.assert_array_equal(got, want)


def test_every_registered_codec_is_checked():
    assert set(mpicomp.codecs.available()) == {c.name for c in CASES} | set(NO_OVERFLOW)


# -- PowerSGD's norms: entries near 1e19 once made every column zero ------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("signs", [False, True], ids=["positive", "signs"])
def test_powersgd_of_huge_entries_is_the_usual_result_scaled(rank, signs):
    """60 x 50 matrices of entries near 1e18 to 1e30, whose squares overflow float32,
    three calls (warm start, error feedback): the same bits, scaled, as for the same
    matrices near 1 (whose accuracy test_mpi_powersgd.py checks), not zeros."""
    comm = world()
    rng = np.random.default_rng(comm.rank)
    xs = [rng.uniform(0.5, 1.5, (60, 50)).astype(np.float32) for _ in range(3)]
    if signs:
        xs = [x * rng.choice([-1, 1], x.shape).astype(np.float32) for x in xs]

    def calls(scale):
        with mpicomp.CompressedComm(comm, "powersgd", rank=rank, start_iter=0) as cc:
            return [cc.allreduce(x * np.float32(scale), name="w") for x in xs]

    usual = calls(1.0)
    assert all(y.any() for y in usual)
    for k in (60, 63, 66, 100):  # 1.2e18, 9.2e18, 7.4e19, 1.3e30
        for y, y_usual in zip(calls(2.0**k), usual, strict=True):
            np.testing.assert_array_equal(y, y_usual * np.float32(2.0**k))


@pytest.mark.mpi(min_size=2)
def test_powersgd_kept_error_that_overflows_with_the_gradient_is_named():
    """A kept error near the limit plus a gradient of its sign: the rank raises that its
    input plus its kept error overflows, the others RankError, and nothing is kept."""
    comm = world()
    rng = np.random.default_rng(comm.rank)
    big = (rng.uniform(0.5, 1.0, (48, 64)) * rng.choice([-1, 1], (48, 64))).astype(np.float32)
    with mpicomp.CompressedComm(comm, "powersgd", start_iter=0) as cc:
        cc.allreduce(big * np.float32(5e37 if comm.rank == 0 else 1.0), name="w")
        before = cc.state_dict()["residuals"]
        kept = before["w#error"].reshape(48, 64)
        push = np.zeros((48, 64), np.float32)
        if comm.rank == 0:
            at = np.unravel_index(np.abs(kept).argmax(), kept.shape)
            push[at] = np.copysign(FLT_MAX, kept[at])
            with pytest.raises(ValueError, match=r"'w' plus its kept error overflows float32"):
                cc.allreduce(push, name="w")
        else:
            with pytest.raises(RankError, match=r"rank\(s\) 0: gradient 'w' holds values that"):
                cc.allreduce(push, name="w")
        after = cc.state_dict()["residuals"]
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def _gram_schmidt(codec, matrix):
    """PowerSGD's orthogonalization before it scaled the matrix (the bits to keep)."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i]
        norm = np.sqrt(np.sum(col * col))
        if codec.epsilon:
            col /= norm + np.float32(codec.epsilon)
        else:
            col *= np.where(norm > 0, 1 / np.maximum(norm, np.float32(1e-30)), 0)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest -= (col @ rest)[None, :] * col[:, None]


@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
def test_orthogonalize_keeps_its_bits_and_is_orthonormal_at_any_scale(epsilon):
    codec = mpicomp.codec("powersgd", epsilon=epsilon)
    rng = np.random.default_rng(0)
    for n, r in [(1, 1), (7, 2), (64, 4), (300, 3)]:
        for scale in (1e-9, 1e-3, 1.0, 1e3, 1e9):
            m = (rng.standard_normal((n, r)) * scale).astype(np.float32)
            want = m.copy()
            _gram_schmidt(codec, want)
            codec.orthogonalize(m)
            np.testing.assert_array_equal(m, want)
    # Squares past float32 (1e19, 1e30, 3e38) or below its normal range (1e-20, 1e-40;
    # there epsilon, larger than the norms, shrinks the columns as it should).
    for scale in (1e19, 1e30) if epsilon else (1e19, 1e30, 1e-20, 1e-40):
        m = (rng.standard_normal((60, 3)) * scale).astype(np.float32)
        codec.orthogonalize(m)
        np.testing.assert_allclose(m.T @ m, np.eye(3), atol=1e-5)
    m = rng.uniform(-3.4e38, 3.4e38, (60, 3)).astype(np.float32)
    codec.orthogonalize(m)
    np.testing.assert_allclose(m.T @ m, np.eye(3), atol=1e-5)


def test_orthogonalize_on_a_device_gives_the_host_bits_without_reading_back():
    import _device_arrays as dev

    dev.install()
    codec = mpicomp.codec("powersgd")
    rng = np.random.default_rng(1)
    for scale in (1e-40, 1e-3, 1.0, 1e19, 1e30):
        m = (rng.standard_normal((60, 3)) * scale).astype(np.float32)
        on_device = dev.to_device(m)
        dev.reset_syncs()
        codec.orthogonalize(on_device)
        assert not any(dev.SYNCS.values())  # the scale stays on the device
        codec.orthogonalize(m)
        np.testing.assert_array_equal(dev.to_host(on_device), m)
