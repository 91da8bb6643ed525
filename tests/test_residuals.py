"""mpicomp/reduction/residuals.py: what a CompressedComm keeps per tensor across calls
(nothing, error-feedback residuals, a low-rank codec's arrays), what one call may move of
it and puts back when it fails or is rolled back, and the checkpoint check."""

import numpy as np
import pytest

import mpicomp
from mpicomp.reduction.residuals import (
    NO_RESIDUALS,
    Encoding,
    Memory,
    Residuals,
    Stateless,
    check_state,
    rollback,
    shard_key,
)


def _x(n=64, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_stateless_encodes_plainly_and_keeps_nothing():
    codec = mpicomp.codec("topk", ratio=0.25)
    kept = Stateless(Encoding(codec))
    assert not kept.named and kept.state_dict() == ({}, {})
    x = _x()
    assert kept.encoding("w").encode(x).tobytes() == codec.encode(x).tobytes()
    assert Stateless().encoding("w") is NO_RESIDUALS


def test_residuals_keep_what_the_payload_did_not_carry():
    codec = mpicomp.codec("topk", ratio=0.25)
    kept = Residuals(codec, sharded=False)
    x, y = _x(seed=1), _x(seed=2)
    first = kept.encoding("w").encode(x)
    residual = x - codec.decode(first)  # NumPy: what top-k dropped
    second = kept.encoding("w").encode(y)
    assert second.tobytes() == codec.encode(y + residual).tobytes()
    workers, owners = kept.state_dict()
    np.testing.assert_allclose(workers["w"], y + residual - codec.decode(second), atol=1e-7)
    assert owners == {}


def test_a_failed_step_puts_back_every_residual_it_moved():
    codec = mpicomp.codec("topk", ratio=0.25)
    kept = Residuals(codec, sharded=False)
    kept.encoding("w").encode(_x(seed=1))
    before = kept.state_dict()[0]["w"]
    # Two calls of one name in a step (the second snapshot in a buffer of its own).
    calls = [kept.encoding("w"), kept.encoding("w", private=True), kept.encoding("new")]
    for call, seed in zip(calls, (2, 3, 4), strict=True):
        call.encode(_x(seed=seed))
    rollback(calls)
    workers, _ = kept.state_dict()
    assert set(workers) == {"w"}  # a residual born in the step is dropped again
    np.testing.assert_array_equal(workers["w"], before)


def test_a_sharded_call_keeps_a_residual_per_shard_and_the_owner_one_per_tensor():
    codec = mpicomp.codec("threelc")
    kept = Residuals(codec, sharded=True)
    call = kept.encoding("w", owners=2)
    call.push(_x(32, seed=1), 0)
    call.push(_x(32, seed=2), 1)
    call.pull(_x(32, seed=3))
    workers, owners = kept.state_dict()
    assert set(workers) == {shard_key("w", 0), shard_key("w", 1)} == {"w#shard0", "w#shard1"}
    assert set(owners) == {"w"}
    kept.forget("w")
    assert kept.state_dict() == ({}, {})


def test_a_sharded_call_that_fails_moves_nothing():
    kept = Residuals(mpicomp.codec("threelc"), sharded=True)
    call = kept.encoding("w", owners=2)
    call.push(_x(32, seed=1), 0)
    call.pull(_x(32, seed=3))
    call.restore()
    assert kept.state_dict() == ({}, {})


def test_residuals_survive_a_checkpoint():
    codec = mpicomp.codec("topk", ratio=0.25)
    kept = Residuals(codec, sharded=True)
    kept.encoding("w").encode(_x(seed=1))
    saved = kept.state_dict()
    again = Residuals(codec, sharded=True)
    again.load_state_dict(*saved)
    y = _x(seed=2)
    assert again.encoding("w").encode(y).tobytes() == kept.encoding("w").encode(y).tobytes()


def test_memory_keeps_arrays_by_name_and_a_call_replaces_them():
    memory = Memory(feedback=True)
    call = memory.encoding("w")
    assert call.feedback and call.arrays == {}
    call.arrays["q"] = np.ones(3, np.float32)
    later = memory.encoding("w")
    assert list(later.arrays) == ["q"]
    later.arrays["q"] = np.zeros(3, np.float32)  # replaced, never written into
    later.restore()
    np.testing.assert_array_equal(memory.encoding("w").arrays["q"], np.ones(3))
    flat, owners = memory.state_dict()
    assert list(flat) == ["w#q"] and owners == {}
    other = Memory(feedback=True)
    other.load_state_dict(flat, {})
    np.testing.assert_array_equal(other.encoding("w").arrays["q"], np.ones(3))
    other.forget("w")
    assert other.state_dict() == ({}, {})


def test_a_checkpoint_is_checked_whole_before_anything_is_loaded():
    w = np.array([1.0, 2.0])  # float64: converted as a gradient is
    good = {"step": np.array(3), "residuals": {"w": w}, "server_residuals": {}}
    step, workers, owners = check_state(good)
    assert step == 3 and workers["w"].dtype == np.float32 and owners == {}
    for state, error, words in [
        ([], TypeError, "state must be what CompressedComm.state_dict() returned"),
        ({**good, "step": True}, TypeError, "state['step'] must be an integer"),
        ({**good, "step": -1}, ValueError, "state['step'] must be >= 0"),
        ({**good, "residuals": [1.0]}, TypeError, "state['residuals'] must be a dict"),
        ({**good, "residuals": {"w": [1.0]}}, TypeError, "residual 'w' of state['residuals']"),
        (
            {**good, "server_residuals": {"b": np.array([np.nan], np.float32)}},
            ValueError,
            "residual 'b' of state['server_residuals'] holds NaN or Inf",
        ),
    ]:
        with pytest.raises(error) as e:
            check_state(state)
        assert words in str(e.value), (words, e.value)
