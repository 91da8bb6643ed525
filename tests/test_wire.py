"""The common payload header: layout, and every way a header can be wrong."""

import struct
import zlib

import numpy as np
import pytest

import mpicomp
from mpicomp.codecs import _wire


def test_header_layout_is_as_documented():
    body = np.arange(10, dtype=np.uint8)
    p = _wire.pack("topk", (3, 4), body, flags=5)
    assert p.dtype == np.uint8 and p.ndim == 1
    assert p.size == 16 + 2 * 8 + 10
    magic, ver, cid, ndim, flags, res, adler, blen = struct.unpack_from("<2sBBBBHII", p.tobytes())
    assert (magic, ver, cid, ndim, flags, res) == (b"MC", 1, 10, 2, 5, 0)
    raw = p.tobytes()
    assert adler == zlib.adler32(raw[:8] + raw[12:]) and blen == 10
    assert struct.unpack_from("<2Q", p.tobytes(), 16) == (3, 4)
    shape, fl, b = _wire.unpack("topk", p, known_flags=0b111)
    assert shape == (3, 4) and fl == 5
    np.testing.assert_array_equal(b, body)


def test_zero_dim_shape_round_trips():
    shape, _, body = _wire.unpack("none", _wire.pack("none", (), np.zeros(4, np.uint8)))
    assert shape == () and body.size == 4 and _wire.numel_of(shape) == 1


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p[:10], "truncated"),
        (lambda p: p[:-1], "length"),
        (lambda p: np.concatenate([p, np.zeros(1, np.uint8)]), "length"),
        (lambda p: _set(p, 0, 0x4E), "magic"),
        (lambda p: _set(p, 2, 9), "version"),
        (lambda p: _set(p, 3, 6), "threelc"),
        (lambda p: _set(p, 3, 200), "200"),
        (lambda p: _set(p, 4, 9), "ndim"),
        (lambda p: _set(p, 6, 1), "reserved"),
        (lambda p: _set(p, p.size - 1, p[-1] ^ 1), "checksum"),
    ],
)
def test_bad_headers_raise_payload_error(mutate, message):
    p = _wire.pack("topk", (5,), np.arange(12, dtype=np.uint8))
    with pytest.raises(mpicomp.PayloadError, match=message):
        _wire.unpack("topk", mutate(p.copy()))


def test_huge_shape_is_refused_before_allocation():
    p = _wire.pack("none", (1 << 30, 1 << 30), np.zeros(0, np.uint8))
    with pytest.raises(mpicomp.PayloadError, match="implausibly large"):
        _wire.unpack("none", p)


@pytest.mark.parametrize(
    "bad", [b"MC\x01", [1, 2, 3], np.zeros(20, np.int8), np.zeros((4, 5), np.uint8)]
)
def test_non_payload_objects_raise_payload_error(bad):
    with pytest.raises(mpicomp.PayloadError, match="1-D uint8"):
        _wire.unpack("topk", bad)


def _set(p, i, v):
    p[i] = v
    return p


def test_undefined_flag_bits_are_corruption():
    p = _wire.pack("topk", (5,), np.zeros(3, np.uint8), flags=0b10)
    assert _wire.unpack("topk", p, known_flags=0b11)[1] == 0b10
    with pytest.raises(mpicomp.PayloadError, match="flags=0x2"):
        _wire.unpack("topk", p, known_flags=0b01)


@pytest.mark.parametrize("shape", [(0, 2**64 - 1), (2**38, 2**38, 0), (0, 2**41)])
def test_empty_shapes_with_huge_dimensions_are_refused(shape):
    p = _wire.pack("none", shape, np.zeros(0, np.uint8))
    with pytest.raises(mpicomp.PayloadError, match="implausibly large"):
        _wire.unpack("none", p)


def test_claimed_shape_reads_the_header_without_validating():
    p = _wire.pack("topk", (3, 4), np.zeros(5, np.uint8))
    assert _wire.claimed_shape(p) == (3, 4)
    assert _wire.claimed_shape(p[:20]) is None  # dims cut off
    bad = p.copy()
    bad[4] = 9
    assert _wire.claimed_shape(bad) is None


def test_reseal_makes_an_edited_payload_pass_the_header_checks():
    p = _wire.pack("topk", (5,), np.arange(12, dtype=np.uint8))
    edited = np.concatenate([p, np.zeros(3, np.uint8)])  # longer body, stale length and checksum
    with pytest.raises(mpicomp.PayloadError):
        _wire.unpack("topk", edited)
    shape, _, body = _wire.unpack("topk", _wire.reseal(edited.copy()))
    assert shape == (5,) and body.size == 15
    kept = _wire.reseal(edited.copy(), length=False)  # checksum only: the length stays wrong
    with pytest.raises(mpicomp.PayloadError, match="does not match header"):
        _wire.unpack("topk", kept)


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 100_003, (1 << 20) + 5, 3 << 20])
def test_adler32_kernels_equal_zlib_alone_and_fused_with_the_copy(n):
    from mpicomp.kernels.checksum import combine
    from mpicomp.kernels.cpu.checksum import adler32

    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    data[: n // 3] = 255  # the largest block sums
    for start in (1, 0, 0xFFF0FFF0):
        assert adler32(data, start) == zlib.adler32(data, start)
        dst = np.empty_like(data)
        assert adler32(data, start, dst=dst) == zlib.adler32(data, start)
        np.testing.assert_array_equal(dst, data)
    half = n // 2
    a, b = data[:half], data[half:]
    assert combine(zlib.adler32(a), zlib.adler32(b, 0), b.size) == zlib.adler32(data)


def test_payloads_written_in_place_and_verified_later_match_pack():
    body = np.arange(300, dtype=np.uint8)
    p, view = _wire.empty((3, 100), body.size)
    view[:] = body
    np.testing.assert_array_equal(
        _wire.seal("topk", p, (3, 100), flags=1), _wire.pack("topk", (3, 100), body, flags=1)
    )
    shape, _, b = _wire.unpack("topk", p, known_flags=1, verify=False)
    _wire.verify("topk", p, zlib.adler32(b, 0))
    p[-1] ^= 1
    _wire.unpack("topk", p, known_flags=1, verify=False)  # the checksum is left to verify
    with pytest.raises(mpicomp.PayloadError, match="checksum"):
        _wire.verify("topk", p, zlib.adler32(p[32:], 0))
