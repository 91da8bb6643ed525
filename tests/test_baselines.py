"""none, fp16 and topk against plain NumPy references."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpicomp
from conftest import gradient_like


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


def test_fp16_kernels_round_like_numpy_on_every_float16_boundary():
    from mpicomp.kernels.cpu import fp16 as k

    # Every float16 value and the float32 patterns around each midpoint between two
    # neighbours (ties go to even), both signs; subnormals and zero included.
    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    mids = (halves[:-1] + halves[1:]) / np.float32(2)
    bits = np.concatenate([halves.view(np.uint32), mids.view(np.uint32)])
    near = (bits[:, None].astype(np.int64) + np.arange(-2, 3)).clip(0).astype(np.uint32).reshape(-1)
    x = near.view(np.float32)
    x = np.concatenate([x[np.abs(x) <= 65504], -x[np.abs(x) <= 65504]])
    h16 = np.empty(x.size, np.uint16)
    ok, _ = k.encode(x, h16)
    assert ok
    np.testing.assert_array_equal(h16, x.astype(np.float16).view(np.uint16))
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(every.size, np.float32)
    ok = k.decode(every, out)
    assert not ok  # Inf and NaN patterns are among them
    np.testing.assert_array_equal(
        out.view(np.uint32), every.view(np.float16).astype(np.float32).view(np.uint32)
    )
    for bad in (65504.01, 65520.0, np.inf, np.nan):
        assert not k.encode(np.array([0, bad], np.float32), np.empty(2, np.uint16))[0]


@pytest.mark.parametrize("n", [2_000_003, 3 << 20])
def test_fp16_parallel_chunks_and_checksum_match_numpy_and_zlib(n):
    import zlib

    x = gradient_like(n, seed=n) * np.float32(1000)
    c = mpicomp.codec("fp16")
    p = c.encode(x)
    np.testing.assert_array_equal(p[24:].view("<f2"), x.astype(np.float16))
    raw = p.tobytes()
    assert struct_checksum(p) == zlib.adler32(raw[:8] + raw[12:])
    np.testing.assert_array_equal(c.decode(p), x.astype(np.float16).astype(np.float32))
    p[-1] ^= 1
    with pytest.raises(mpicomp.PayloadError, match="checksum"):
        c.decode(p)


def struct_checksum(p):
    return int(p[8:12].view("<u4")[0])


@pytest.mark.parametrize("fallback", [False, True])
def test_topk_large_inputs_match_the_stable_reference_on_both_selection_paths(
    fallback, monkeypatch
):
    from mpicomp.kernels.cpu import topk as k

    if fallback:  # an empty sampled bracket: the exact histogram selection runs
        monkeypatch.setattr(k, "_bracket", lambda u, kept: (1, 0, 0, 0))
    rng = np.random.default_rng(3)
    n = 2_500_003
    cases = [
        gradient_like(n, seed=4),
        np.round(rng.standard_normal(n) * 3).astype(np.float32),  # many exact ties
        np.ones(n, np.float32),
        np.where(np.arange(n) % 1024 == 0, 7, 1).astype(np.float32),  # aliases the sample
    ]
    for x in cases:
        for ratio in (1e-5, 0.01, 0.4):
            expected, idx = reference_topk(x, ratio)
            p = mpicomp.codec("topk", ratio=ratio).encode(x)
            np.testing.assert_array_equal(p[32 : 32 + 4 * idx.size].view("<u4"), idx)
            np.testing.assert_array_equal(p[32 + 4 * idx.size :].view("<f4"), x[idx])
    x = gradient_like(n, seed=5)
    x[n - 7] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        mpicomp.codec("topk").encode(x)


def test_fp16_from_wire_takes_any_dtype_and_kernels_refuse_short_arrays():
    # A float32 sum handed to fp16's from_wire is converted, never reinterpreted as halves.
    from mpicomp.kernels.cpu import checksum, fp16

    out = mpicomp.codec("fp16").from_wire(np.array([1, 2, 3, 4], np.float32), 2)
    np.testing.assert_array_equal(out, np.array([0.5, 1, 1.5, 2], np.float32))
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="equal 1-D sizes"):
        fp16.encode(x, np.empty(4, np.uint16))
    with pytest.raises(ValueError, match="equal 1-D sizes"):
        fp16.decode(np.zeros(8, np.uint16), np.empty(4, np.float32))
    with pytest.raises(ValueError, match="dst has 3 bytes"):
        checksum.adler32(np.zeros(8, np.uint8), 1, dst=np.empty(3, np.uint8))
