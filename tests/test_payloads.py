"""What every codec with a byte payload promises, whatever bytes it is given."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpicomp
from conftest import gradient_like
from mpicomp.codecs import _wire

PAYLOAD_CODECS = ["none", "fp16", "topk", "signsgd", "threelc", "fft", "fastsgd"]
SHAPES = [(), (0,), (1,), (2,), (5,), (8,), (13,), (3, 5), (2, 3, 4), (1000,)]


@pytest.fixture(params=PAYLOAD_CODECS, scope="module")
def codec(request):
    return mpicomp.codec(request.param)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_returns_float32_of_the_input_shape(codec, shape):
    x = gradient_like(math.prod(shape), seed=3).reshape(shape)
    p = codec.encode(x)
    assert p.dtype == np.uint8 and p.ndim == 1
    y = codec.decode(p)
    assert y.shape == shape and y.dtype == np.float32
    assert np.all(np.isfinite(y))


def test_encoding_is_deterministic(codec):
    x = gradient_like(4099, seed=4)
    np.testing.assert_array_equal(codec.encode(x), codec.encode(x.copy()))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_is_a_value_error(codec, bad):
    x = gradient_like(100, seed=5)
    x[37] = bad
    if codec.name == "none":
        pytest.skip("'none' sends float32 as it is; the NaN policy lives in CompressedComm")
    with pytest.raises(ValueError, match="NaN|Inf|finite"):
        codec.encode(x)


def test_every_truncation_is_a_payload_error(codec):
    p = codec.encode(gradient_like(999, seed=6))
    for cut in sorted({0, 1, 15, 16, 23, 24, 25, p.size // 2, p.size - 1}):
        with pytest.raises(mpicomp.PayloadError):
            codec.decode(p[:cut])


def test_every_single_byte_change_is_a_payload_error(codec):
    p = codec.encode(gradient_like(999, seed=7))
    rng = np.random.default_rng(0)
    positions = set(range(min(p.size, 40))) | set(rng.integers(0, p.size, 60).tolist())
    for pos in sorted(positions):
        q = p.copy()
        q[pos] ^= np.uint8(1 << int(rng.integers(0, 8)))
        with pytest.raises(mpicomp.PayloadError):
            codec.decode(q)


@pytest.mark.parametrize("other", PAYLOAD_CODECS)
def test_another_codecs_payload_is_a_payload_error(codec, other):
    if other == codec.name:
        return
    p = mpicomp.codec(other).encode(gradient_like(64, seed=8))
    with pytest.raises(mpicomp.PayloadError, match=f"not {codec.name!r}"):
        codec.decode(p)


@given(data=st.binary(max_size=300))
def test_random_bytes_are_a_payload_error(codec, data):
    with pytest.raises(mpicomp.PayloadError):
        codec.decode(np.frombuffer(data, dtype=np.uint8))


@given(body=st.binary(max_size=200), n=st.integers(0, 500), flags=st.integers(0, 255))
def test_random_bodies_behind_a_valid_header_never_crash(codec, body, n, flags):
    # The header and checksum are right, so only the codec's own body checks stand
    # between these bytes and its kernels: they must decode or raise PayloadError.
    p = _wire.pack(codec.name, (n,), np.frombuffer(body, dtype=np.uint8), flags=flags)
    try:
        y = codec.decode(p)
    except mpicomp.PayloadError:
        return
    assert y.shape == (n,) and y.dtype == np.float32 and np.all(np.isfinite(y))


GATHER_CODECS = ["topk", "threelc", "fft", "fastsgd"]


@pytest.mark.parametrize("name", GATHER_CODECS)
@pytest.mark.parametrize("place", ["numpy", "host-backed"])
def test_decode_flat_gives_decodes_bytes_and_defers_its_checks(name, place):
    """``decode_flat`` of a flat array's payload: ``decode``'s bytes (-0.0 kept, where
    ``decode_gathered``'s zeros-plus-add would make it +0.0), its checks read with the
    caller's batch on a device, and every single-byte change still a PayloadError."""
    import _device_arrays as D

    from mpicomp.kernels.readback import batch

    D.install()
    codec = mpicomp.codec(name, **({"ratio": 1.0} if name == "topk" else {}))
    x = gradient_like(999, seed=8)
    x[::7] = -0.0
    p = codec.encode(x)
    want = codec.decode(p).reshape(-1)
    if name == "topk":  # every value kept, its -0.0s too
        assert np.signbit(want[::7]).all()
    put, get = (D.to_device, D.to_host) if place == "host-backed" else (np.asarray, np.asarray)
    dev = mpicomp.kernels.backend(D.BACKEND).device
    before = sum(dev.sync_reasons.values())
    with batch("test"):
        got = codec.decode_flat(put(p), x.size)
    assert get(got).tobytes() == want.tobytes()
    if place == "host-backed":
        assert sum(dev.sync_reasons.values()) - before == 1  # the batch's one transfer
    rng = np.random.default_rng(1)
    for pos in sorted(set(rng.integers(0, p.size, 12).tolist()) | {0, p.size - 1}):
        q = p.copy()
        q[pos] ^= 0x5A
        with pytest.raises(mpicomp.PayloadError), np.errstate(all="ignore"):
            with batch("test"):
                codec.decode_flat(put(q), x.size)
