"""mpicomp/call/intake.py: what a call takes in (read and converted to flat float32 when
made, or refused with its error for every rank to hear of), how small tensors are
fused into buckets, and results given back in the caller's framework, shape and dtype."""

import _device_arrays as D
import numpy as np
import pytest

from mpicomp.call.intake import Gpu, Tensor, buckets, check_numel, take, take_many


@pytest.mark.parametrize(
    "sizes, limit, expected",
    [
        ([], 10, []),
        ([3, 3, 3], 10, [[0, 1, 2]]),
        ([3, 3, 5], 10, [[0, 1], [2]]),
        ([3, 20, 3, 3], 10, [[0], [1], [2, 3]]),
        ([10, 9, 1], 10, [[0], [1, 2]]),
        ([0, 0, 4], 4, [[0, 1], [2]]),
    ],
)
def test_buckets_group_consecutive_small_tensors(sizes, limit, expected):
    assert buckets(sizes, limit) == expected


def test_an_input_is_taken_as_flat_float32_and_given_back_as_it_came():
    x = np.arange(12, dtype=np.float64).reshape(3, 4) / 7
    t = take(x, "w", Gpu(), named=True)
    assert t.error is None and t.what == "gradient 'w'"
    assert t.flat.dtype == np.float32 and t.flat.shape == (12,)
    np.testing.assert_array_equal(t.flat, x.reshape(-1).astype(np.float32))
    assert t.dtype == "float64" and t.shapes == ((3, 4),) and not t.overflowed
    avg = np.linspace(-1, 1, 12, dtype=np.float32)
    back = t.result(avg)
    assert back.dtype == np.float64 and back.shape == (3, 4)
    np.testing.assert_array_equal(back, avg.astype(np.float64).reshape(3, 4))
    zeros = t.zeros()
    assert zeros.dtype == np.float64 and zeros.shape == (3, 4) and not zeros.any()


def test_float64_beyond_float32_is_marked_overflowed():
    t = take(np.array([1.0, 1e300]), "w", Gpu(), named=False)
    assert t.error is None and t.overflowed and np.isinf(t.flat[1])


@pytest.mark.parametrize(
    "x, name, named, error, words",
    [
        (np.ones(3, np.float32), 7, False, TypeError, "name must be a str"),
        (np.ones(3, np.float32), "", True, ValueError, "pass name="),
        (np.ones(3, np.complex64), "w", False, TypeError, "gradient 'w'"),
        (np.ones(3, np.int32), "w", False, TypeError, "gradient 'w'"),
        # The residual keys of shards and rows: reserved, with or without error feedback.
        (np.ones(3, np.float32), "w#shards#shard0", True, ValueError, "holds '#shard'"),
        (np.ones(3, np.float32), "w#shard@0/2", False, ValueError, "holds '#shard'"),
    ],
)
def test_a_refused_input_keeps_its_error_for_the_call_to_raise(x, name, named, error, words):
    t = take(x, name, Gpu(), named)
    assert isinstance(t.error, error) and words in str(t.error)
    assert t.flat.size == 0 and t.flat.dtype == np.float32


def test_the_shapes_a_bucket_holds_must_add_up_to_its_size():
    t = take(np.ones(10, np.float32), "b", Gpu(), named=False, shapes=[(2, 3), (4,)])
    assert t.error is None and t.shapes == ((2, 3), (4,))
    t = take(np.ones(10, np.float32), "b", Gpu(), named=False, shapes=[(2, 3)])
    assert isinstance(t.error, ValueError) and "hold 6 elements" in str(t.error)


def test_sizes_beyond_the_limit_are_refused_from_the_shape_alone():
    class Huge:  # a shape and nothing else: converting it would fail loudly
        shape = (1 << 20, 1 << 20)

    with pytest.raises(ValueError, match="has 1099511627776 elements; one call carries at most"):
        check_numel(Huge(), 1 << 32, "gradient 'w'")
    check_numel(np.ones(4), 4)  # at the limit: taken


def test_many_inputs_are_taken_together_or_refused_with_the_reason():
    a, b = np.ones(3, np.float32), np.full(5, 2.0, np.float64)
    tensors, refused = take_many([a, b], None, Gpu(), named=False)
    assert refused is None and [t.name for t in tensors] == ["#0", "#1"]
    bucket = Tensor.fused(tensors)
    assert bucket.name == "bucket:#0|#1" and bucket.dtype == "float32/float64"
    np.testing.assert_array_equal(bucket.flat, np.r_[a, b.astype(np.float32)])
    assert bucket.shapes == ((3,), (5,))
    for arrays, names, words in [
        (a, None, "for one array use allreduce"),
        ({"w": a}, None, "for a dict d"),
        ([a, b], ["w"], "1 names for 2 arrays"),
        ([a, b], ["w", "w"], "given more than once: ['w']"),
        ([a, b.astype(np.complex64)], None, "gradient '#1'"),
    ]:
        tensors, refused = take_many(arrays, names, Gpu(), named=False)
        assert tensors == [] and words in str(refused.error), (words, refused.error)


def test_host_and_device_arrays_do_not_mix_in_one_call():
    D.install()
    tensors, refused = take_many(
        [np.ones(3, np.float32), D.to_device(np.ones(3))], None, Gpu(), False
    )
    assert tensors == [] and "host arrays or device arrays, not both" in str(refused.error)


def test_device_gradients_stay_on_the_first_ones_gpu():
    D.install()
    gpu = Gpu()
    with D.gpu(1):
        assert take(D.to_device(np.ones(3, np.float32)), "a", gpu, False).error is None
    with D.gpu(0):
        t = take(D.to_device(np.ones(3, np.float32)), "b", gpu, False)
    assert isinstance(t.error, TypeError)
    assert "is on GPU 0; this CompressedComm works on GPU 1" in str(t.error)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_jax_input_gets_the_float32_average_back_in_its_dtype_and_place(dtype):
    jax = pytest.importorskip("jax", reason="JAX is optional: pip install jax")
    from conftest import gradient_like

    x = jax.numpy.zeros((3, 5), dtype=dtype)
    avg = gradient_like(15, seed=1)
    y = take(x, "w", Gpu(), named=False).result(avg)
    assert isinstance(y, jax.Array) and y.sharding == x.sharding
    assert y.shape == (3, 5) and y.dtype == x.dtype
    want = avg.reshape(3, 5).astype(np.asarray(x).dtype)
    assert np.asarray(y).tobytes() == want.tobytes()
