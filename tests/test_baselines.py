"""none, fp16 and topk against plain NumPy references."""

import math

import numpy as np
import pytest
from conftest import gradient_like
from hypothesis import given
from hypothesis import strategies as st

import mpicomp


def reference_topk(x, ratio):
    """Keep the ceil(ratio*n) largest |x|, ties to the lower index, by a stable sort."""
    flat = x.reshape(-1)
    k = min(flat.size, math.ceil(ratio * flat.size))
    order = np.argsort(-np.abs(flat), kind="stable")[:k]
    out = np.zeros_like(flat)
    out[order] = flat[order]
    return out.reshape(x.shape), np.sort(order)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (2, 3, 4)])
def test_none_is_exact_and_sized(shape):
    x = gradient_like(math.prod(shape), seed=1).reshape(shape)
    c = mpicomp.codec("none")
    p = c.encode(x)
    assert p.size == 16 + 8 * len(shape) + 4 * x.size
    y = c.decode(p)
    assert y.shape == shape and y.dtype == np.float32
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(c.from_wire(c.to_wire(x) * 3, nranks=3), x * 3 / 3)


def test_fp16_rounds_like_numpy_and_refuses_overflow():
    x = gradient_like(1000, seed=2) * np.float32(100)
    c = mpicomp.codec("fp16")
    y = c.decode(c.encode(x))
    np.testing.assert_array_equal(y, x.astype(np.float16).astype(np.float32))
    assert c.encode(x).size == 16 + 8 + 2 * x.size
    with pytest.raises(ValueError, match="overflows float16"):
        c.to_wire(np.array([1.0, 70000.0], np.float32))
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.to_wire(np.array([1.0, np.nan], np.float32))


def test_inputs_of_other_float_dtypes_are_converted_once():
    c = mpicomp.codec("none")
    for dt in (np.float16, np.float64):
        x = np.linspace(-1, 1, 11).astype(dt)
        np.testing.assert_array_equal(c.decode(c.encode(x)), x.astype(np.float32))
    with pytest.raises(TypeError, match="floating-point"):
        c.encode(np.arange(4))
    with pytest.raises(TypeError, match="must be an array"):
        c.encode([1.0, 2.0])


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("n", [0, 1, 5, 999, 10_000])
def test_topk_matches_reference(ratio, n):
    x = gradient_like(n, seed=n)
    c = mpicomp.codec("topk", ratio=ratio)
    p = c.encode(x)
    expected, idx = reference_topk(x, ratio)
    np.testing.assert_array_equal(c.decode(p), expected)
    k = idx.size
    assert p.size == 16 + 8 + 8 + k * (4 + 4)
    body = p[24:]
    assert int(body[:8].view("<u8")[0]) == k
    np.testing.assert_array_equal(body[8 : 8 + 4 * k].view("<u4"), idx)


def test_topk_breaks_magnitude_ties_by_lower_index():
    x = np.array([1, -3, 3, 2, -3, 3], np.float32)
    y = mpicomp.codec("topk", ratio=0.5).decode(mpicomp.codec("topk", ratio=0.5).encode(x))
    np.testing.assert_array_equal(y, [0, -3, 3, 0, -3, 0])


@given(n=st.integers(0, 10**5), seed=st.integers(0, 2**32 - 1), ratio=st.floats(1e-4, 1.0))
def test_topk_property(n, seed, ratio):
    x = gradient_like(n, seed=seed)
    c = mpicomp.codec("topk", ratio=ratio)
    y = c.decode(c.encode(x))
    expected, _ = reference_topk(x, ratio)
    np.testing.assert_array_equal(y, expected)


def test_topk_payload_body_errors():
    from mpicomp.codecs import _wire

    c = mpicomp.codec("topk")

    def body(k, idx, vals):
        return np.concatenate(
            [
                np.array([k], "<u8").view(np.uint8),
                np.array(idx, "<u4").view(np.uint8),
                np.array(vals, "<f4").view(np.uint8),
            ]
        )

    cases = {
        "out of range": body(2, [1, 10], [1.0, 2.0]),
        "not increasing": body(2, [3, 3], [1.0, 2.0]),
        "NaN": body(1, [3], [np.nan]),
        "k=9": body(9, [1], [1.0]),
    }
    for what, b in cases.items():
        with pytest.raises(mpicomp.PayloadError):
            c.decode(_wire.pack("topk", (10,), b))
        assert what


def test_numpy_scalars_and_dlpack_objects_are_accepted():
    c = mpicomp.codec("none")
    assert c.decode(c.encode(np.float32(3.5))).shape == ()

    class Tensor:  # a minimal __dlpack__ producer, like a PyTorch CPU tensor
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(c.decode(c.encode(Tensor(x))), x)


def test_dlpack_producer_of_a_dtype_numpy_lacks_converts_once():
    class Bfloat16Tensor:  # like torch.bfloat16: NumPy refuses its DLPack dtype
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            raise BufferError("unsupported dtype")

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

        def float(self):
            return self.a

    x = np.linspace(-1, 1, 7, dtype=np.float32)
    c = mpicomp.codec("none")
    np.testing.assert_array_equal(c.decode(c.encode(Bfloat16Tensor(x))), x)

    class Opaque(Bfloat16Tensor):
        float = None

    with pytest.raises(TypeError, match="cannot import Opaque through DLPack"):
        c.encode(Opaque(x))
