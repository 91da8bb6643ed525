"""Finite inputs never give Inf (docs/reliability.md, "Overflow near float32's limit"):
where a result, a wire or a codec's arithmetic cannot hold them, every rank raises (the
rank whose input alone is at fault its ValueError, the others RankError naming it and
the cause), or under ``nonfinite="skip_step"`` every rank returns zeros with a
NonFiniteWarning, and no state moves: the next call equals a fresh CompressedComm's
loaded with the state from before.

- ``allgather(precision="bfloat16")`` of a shard that rounds to Inf in bfloat16;
- ``reduce_scatter`` whose sum (or, for QSGD, mean) overflows the caller's float16 or
  bfloat16, and whose float32 sum overflows (the message says "sum");
- finite input a codec cannot encode (QSGD's norm past float32, float16's range in fp16
  and fft, fft's spectrum, a kept error that takes the input past float32).

Run with ``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/test_mpi_finite_promises.py``, N from 1 to 5."""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
import pytest

import mpicomp
from conftest import gather_all, world
from mpicomp.comm import NonFiniteWarning, RankError

FLT_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(np.uint32(0x7F7F0000).view(np.float32))  # 3.3895e38
# The largest float32 that bfloat16 rounds to its max (ties to even go up to Inf).
BF16_LAST = float(np.uint32(0x7F7F7FFF).view(np.float32))


class Failed(NamedTuple):
    """The bad call of ``_fail_then_continue``: its ``result`` or ``error`` here, and
    every rank's ``outcomes``, (error type, message) or None where it raised nothing."""

    result: object
    error: BaseException | None
    outcomes: list


def _fail_then_continue(comm, codec, call, good, bad, after, policy="raise", **params):
    """Run ``call(cc, x)`` for ``good``, ``bad`` and ``after`` on one CompressedComm;
    return the bad call's ``Failed``. The bad call must change no state (step,
    residuals), and the next call must give a fresh CompressedComm's bits, loaded with
    the state from before it. Every message is sent before anything is asserted: where
    a rank raises alone, the others must not be left waiting."""
    params = {"min_numel": 0, "nonfinite": policy, **params}
    with mpicomp.CompressedComm(comm, codec, **params) as cc:
        call(cc, good)  # residuals in use
        before = cc.state_dict()
        result, error = None, None
        try:
            result = call(cc, bad)
        except Exception as e:  # compared across ranks below and by the callers
            error = e
        state = cc.state_dict()
        got = call(cc, after)
    with mpicomp.CompressedComm(comm, codec, **params) as fresh:
        fresh.load_state_dict(before)
        want = call(fresh, after)
    outcomes = comm.allgather(None if error is None else (type(error).__name__, str(error)))
    assert state["step"] == before["step"]
    for key in ("residuals", "server_residuals"):
        assert sorted(state[key]) == sorted(before[key])
        for k in before[key]:
            np.testing.assert_array_equal(state[key][k], before[key][k])
    np.testing.assert_array_equal(got, want)
    return Failed(result, error, outcomes)


def _same_everywhere(outcomes: list) -> None:
    assert outcomes[0] is not None and outcomes.count(outcomes[0]) == len(outcomes), outcomes


def _noise(comm, shape, seed: int, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(1000 * seed + comm.rank)
    return (rng.standard_normal(shape) * 1e-3).astype(dtype)


# -- allgather in bfloat16 ------------------------------------------------------------------


def _gather_bfloat16(cc, shard):
    return cc.allgather(shard, name="p", precision="bfloat16")


@pytest.mark.mpi
@pytest.mark.parametrize(
    "value", [3.4e38, -FLT_MAX, float(np.nextafter(np.float32(BF16_LAST), np.float32(np.inf)))]
)
def test_a_bfloat16_allgather_of_a_shard_that_rounds_to_inf_raises_on_every_rank(value):
    comm = world()
    culprit = comm.size - 1
    bad = _noise(comm, 8, seed=1)
    if comm.rank == culprit:
        bad[5] = value
    _, error, _ = _fail_then_continue(
        comm, "none", _gather_bfloat16, _noise(comm, 8, 0), bad, _noise(comm, 8, 2)
    )
    cause = "shard 'p' holds values that round to Inf in bfloat16 (beyond its max, 3.3895e38)"
    if comm.rank == culprit:
        assert isinstance(error, ValueError) and not isinstance(error, RankError)
        assert str(error).startswith(cause) and "precision='float32'" in str(error)
    else:
        assert isinstance(error, RankError)
        assert str(error) == f"rank(s) {culprit}: {cause} in the same call"


@pytest.mark.mpi
def test_a_bfloat16_allgather_keeps_what_rounds_to_its_largest_value():
    comm = world()
    shard = np.array([BF16_LAST, -BF16_MAX, 1.0], np.float32)
    with mpicomp.CompressedComm(comm) as cc:
        out = cc.allgather(shard, name="p", precision="bfloat16")
        np.testing.assert_array_equal(out, np.tile([BF16_MAX, -BF16_MAX, 1.0], comm.size))
        big = np.full(3, 3.4e38, np.float32)  # float32 carries it as it is
        out = cc.allgather(big, precision="float32")
        np.testing.assert_array_equal(out, np.tile(big, comm.size))


# -- reduce_scatter into float16 and bfloat16 -----------------------------------------------

SUMMED = ["none", "fp16", "qsgd_maxnorm", "topk", "signsgd", "threelc"]
# The same on every rank, from 30,000 to 40,000, in steps wider than the kept error (top-k
# keeps the same elements on every rank): at 2 ranks or more every row's sum passes 65,520.
RISING = np.linspace(30000, 40000, 64).astype(np.float16)


def _sum_rows(cc, x):
    return cc.reduce_scatter(x, name="w", op="sum")


def _mean_rows(cc, x):
    return cc.reduce_scatter(x, name="w")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", SUMMED)
def test_a_float16_sum_beyond_float16_raises_on_every_rank_naming_the_sum(codec):
    """FSDP2's float16 gradients of 30,000 to 40,000 on every rank: their sum rounds to Inf
    in float16 (from 65,520), which only a row's owner sees."""
    comm = world()
    args = (_noise(comm, 64, 0, np.float16), RISING, _noise(comm, 64, 2, np.float16))
    _, error, outcomes = _fail_then_continue(comm, codec, _sum_rows, *args)
    _same_everywhere(outcomes)
    assert isinstance(error, RankError)
    assert f"gradient 'w': {codec}: a row of the sum over ranks overflows float16" in str(error)
    assert "average" not in str(error)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", SUMMED)
def test_a_float16_sum_beyond_float16_is_skipped_on_every_rank_under_skip_step(codec):
    comm = world()
    args = (_noise(comm, 64, 0, np.float16), RISING, _noise(comm, 64, 2, np.float16))
    with pytest.warns(NonFiniteWarning, match="a row of the sum over ranks overflows float16"):
        row, error, _ = _fail_then_continue(comm, codec, _sum_rows, *args, policy="skip_step")
    assert error is None
    assert row.dtype == np.float16 and row.shape == (-(-64 // comm.size),) and not row.any()


@pytest.mark.mpi(min_size=2)
def test_a_bfloat16_sum_beyond_bfloat16_raises_though_float32_holds_it():
    """A row's float32 sum between bfloat16's rounding limit (3.3962e38) and float32's
    largest value: finite in float32, Inf in the caller's bfloat16."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    comm = world()
    bfloat16 = ml_dtypes.bfloat16
    top = np.float32(BF16_MAX if comm.rank == 0 else 1e36 / (comm.size - 1))
    bad = np.full(16, top).astype(bfloat16)
    assert 3.3962e38 < gather_all(comm, bad.astype(np.float64)).sum(axis=0)[0] < FLT_MAX
    args = (_noise(comm, 16, 0, bfloat16), bad, _noise(comm, 16, 2, bfloat16))
    _, error, outcomes = _fail_then_continue(comm, "none", _sum_rows, *args)
    _same_everywhere(outcomes)
    assert isinstance(error, RankError)
    assert "a row of the sum over ranks overflows bfloat16" in str(error)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", ["none", "qsgd_maxnorm", "topk"])
def test_a_float32_sum_that_overflows_says_sum_not_average(codec):
    comm = world()
    bad = np.zeros(64, np.float32)
    bad[-1] = 2e38  # on every rank: the sum of the last row overflows float32
    args = (_noise(comm, 64, 0), bad, _noise(comm, 64, 2))
    _, error, outcomes = _fail_then_continue(comm, codec, _sum_rows, *args)
    _same_everywhere(outcomes)
    assert isinstance(error, RankError)
    assert "a row of the sum over ranks overflows float32" in str(error)
    assert "average" not in str(error) and "'w'" in str(error)


def _averaged(cc, x):
    return cc.allreduce(x, name="w")


CALLS = {"allreduce": _averaged, "reduce_scatter": _mean_rows}


@pytest.mark.mpi
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_float16_mean_beyond_float16_raises_or_skips_on_every_rank(call, policy):
    """float16 values of 40,000: 2-bit QSGD decodes each to 0 or its block's norm (about
    452,000) times the ranks that drew it over N, far beyond float16 (65,504)."""
    comm = world()
    call = CALLS[call]
    bad = np.full(256, 40000, np.float16)
    args = (_noise(comm, 256, 0, np.float16), bad, _noise(comm, 256, 2, np.float16))
    what = "overflows float16, the dtype it is returned in"
    if policy == "skip_step":
        with pytest.warns(NonFiniteWarning, match=what):
            result, error, _ = _fail_then_continue(
                comm, "qsgd_maxnorm", call, *args, policy, bits=2
            )
        assert error is None and result.dtype == np.float16 and not result.any()
        return
    _, error, outcomes = _fail_then_continue(comm, "qsgd_maxnorm", call, *args, bits=2)
    _same_everywhere(outcomes)
    assert isinstance(error, RankError) and what in str(error)
    assert "average over ranks" in str(error)


@pytest.mark.mpi
@pytest.mark.parametrize("codec", ["none", "fp16", "topk"])
def test_a_float16_mean_of_large_values_is_their_mean(codec):
    """A mean is at most the largest |x|, which float16 holds: nothing is refused."""
    comm = world()
    x = np.full(64, 65504, np.float16)
    params = {"ratio": 1.0} if codec == "topk" else {}  # every value kept
    with mpicomp.CompressedComm(comm, codec, min_numel=0, **params) as cc:
        row = cc.reduce_scatter(x, name="w")
    width = -(-64 // comm.size)
    mine = min(64, (comm.rank + 1) * width) - min(64, comm.rank * width)  # then padding
    assert row.dtype == np.float16
    np.testing.assert_array_equal(row[:mine], 65504)


# -- finite input a codec cannot encode -------------------------------------------------------

SHAPE = (48, 64)


def _spiked(comm, value, culprit, seed, *, at=(3, 5), count=1):
    """Return this rank's noise; on ``culprit``, ``count`` elements of ``value`` from ``at``."""
    x = _noise(comm, SHAPE, seed)
    if comm.rank == culprit:
        x[at[0], at[1] : at[1] + count] = value
    return x


# (codec, its parameters, the culprit's value and how many elements, the cause named)
UNENCODABLE = {
    "qsgd-norm": ("qsgd_maxnorm", {}, 3e38, 2, "values whose norm overflows float32"),
    "fp16": ("fp16", {}, 1e5, 1, "values beyond float16's range (max 65504)"),
    "fft-fp16": ("fft", {}, 1e5, 1, "values beyond float16's range (max 65504)"),
    "fft-spectrum": ("fft", {"fp16": False}, 3e38, 64, "values whose spectrum overflows float32"),
}


def _unencodable(comm, case, call, policy):
    codec, params, value, count, _ = UNENCODABLE[case]
    culprit = comm.size // 2
    good, after = _spiked(comm, 1.0, culprit, 0), _spiked(comm, 1.0, culprit, 2)
    bad = _spiked(comm, value, culprit, 1, count=count)
    return culprit, _fail_then_continue(
        comm, codec, CALLS[call], good, bad, after, policy, **params
    )


@pytest.mark.mpi
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("policy", ["raise", "zero"])  # nothing to zero: "zero" raises too
@pytest.mark.parametrize("case", UNENCODABLE)
def test_input_a_codec_cannot_encode_raises_naming_the_tensor_and_cause(case, policy, call):
    comm = world()
    cause = UNENCODABLE[case][-1]
    culprit, (_, error, _) = _unencodable(comm, case, call, policy)
    if comm.rank == culprit:
        assert isinstance(error, ValueError) and not isinstance(error, RankError)
        assert str(error).startswith(f"gradient 'w' holds {cause}: ")
    else:
        assert isinstance(error, RankError)
        assert str(error) == f"rank(s) {culprit}: gradient 'w' holds {cause} in the same call"


@pytest.mark.mpi
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("case", UNENCODABLE)
def test_input_a_codec_cannot_encode_is_skipped_on_every_rank_under_skip_step(case, call):
    comm = world()
    cause = UNENCODABLE[case][-1]
    message = f"rank(s) {comm.size // 2}: gradient 'w' holds {cause}; call skipped"
    with pytest.warns(NonFiniteWarning, match=re.escape(message)):
        _, (result, error, _) = _unencodable(comm, case, call, "skip_step")
    assert error is None and result.dtype == np.float32 and not result.any()


KEPT = "values that overflow float32 with the error kept from earlier calls"


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
@pytest.mark.parametrize("codec", ["topk", "fastsgd"])
def test_a_kept_error_that_takes_finite_input_past_float32_is_named_or_skipped(codec, policy):
    """Error feedback keeps what top-k and FastSGD left out of 0.9 * FLT_MAX; a gradient
    of FLT_MAX of its sign then overflows float32 once the kept error is added."""
    comm = world()
    culprit = comm.size - 1
    good = _spiked(comm, 0.9 * FLT_MAX, culprit, 0, at=(0, 0), count=64)
    bad = np.zeros(SHAPE, np.float32)
    after = _spiked(comm, 1.0, culprit, 2)
    params = {"min_numel": 0, "nonfinite": policy}
    with mpicomp.CompressedComm(comm, codec, **params) as probe:
        probe.allreduce(good, name="w")
        kept = probe.state_dict()["residuals"]["w"].reshape(-1)
    if comm.rank == culprit:
        i = int(np.abs(kept).argmax())
        assert abs(kept[i]) > 1e35  # far above half an ulp of FLT_MAX (1e31)
        bad.reshape(-1)[i] = np.copysign(FLT_MAX, kept[i])
    call = CALLS["allreduce"]
    if policy == "skip_step":
        said = f"rank(s) {culprit}: gradient 'w' holds {KEPT}; call skipped"
        with pytest.warns(NonFiniteWarning, match=re.escape(said)):
            result, error, _ = _fail_then_continue(comm, codec, call, good, bad, after, policy)
        assert error is None and not result.any()
    else:
        _, error, _ = _fail_then_continue(comm, codec, call, good, bad, after, policy)
        if comm.rank == culprit:
            assert isinstance(error, ValueError) and not isinstance(error, RankError)
            assert str(error).startswith(f"gradient 'w' holds {KEPT}: error feedback: 'w'")
        else:
            assert isinstance(error, RankError)
            assert str(error) == f"rank(s) {culprit}: gradient 'w' holds {KEPT} in the same call"
