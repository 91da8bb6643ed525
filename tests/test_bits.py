"""Arbitrary-width bit packing against a plain NumPy bit-by-bit reference."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpicomp.kernels.bits import packed_size
from mpicomp.kernels.cpu.bits import mpicomp_bits_pack, mpicomp_bits_unpack


def reference_pack(codes, width):
    bits = (codes.astype(np.uint64)[:, None] >> np.arange(width, dtype=np.uint64)) & 1
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")


@pytest.mark.parametrize("width", [1, 2, 3, 5, 8, 11, 16, 17, 31, 32])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1001])
def test_pack_matches_reference_and_round_trips(width, n):
    codes = np.random.default_rng(width * 1000 + n).integers(0, 2**width, n, dtype=np.uint64)
    codes = codes.astype(np.uint32)
    out = np.zeros(packed_size(n, width), dtype=np.uint8)
    mpicomp_bits_pack(codes, width, out)
    assert out.size == (n * width + 7) // 8
    np.testing.assert_array_equal(out, reference_pack(codes, width))
    back = np.empty(n, dtype=np.uint32)
    mpicomp_bits_unpack(out, width, back)
    np.testing.assert_array_equal(back, codes)


@given(n=st.integers(0, 10**5), width=st.integers(1, 32), seed=st.integers(0, 2**32 - 1))
def test_pack_round_trip_any_length(n, width, seed):
    codes = np.random.default_rng(seed).integers(0, 2**width, n, dtype=np.uint64).astype(np.uint32)
    out = np.empty(packed_size(n, width), dtype=np.uint8)
    mpicomp_bits_pack(codes, width, out)
    back = np.empty(n, dtype=np.uint32)
    mpicomp_bits_unpack(out, width, back)
    np.testing.assert_array_equal(back, codes)


def test_rng_key_from_python_gives_the_same_draws_as_inside_numba():
    from mpicomp.kernels.cpu import rng

    key = rng.mpicomp_key(7, 3, 1)  # a Python int, typed int64 or uint64 by numba on the way back
    inside = rng.uniform_array(7, 3, 1, 4096)
    outside = np.array([rng.mpicomp_uniform(key, i) for i in range(4096)], np.float32)
    np.testing.assert_array_equal(inside, outside)
    top_bits = np.array([rng.mpicomp_bits(key, i) >> 63 for i in range(4096)])
    assert 1800 < top_bits.sum() < 2300


# ---------------------------------------------------------------- fused ring kernels

from mpicomp.kernels.cpu import bits as _bits  # noqa: E402

# Several parallel tasks with a short last one, a block edge inside a task, tiny tails.
FUSED_LENGTHS = [0, 5, 8, 37, _bits.BLOCK + 13, 2 * _bits.TASK + _bits.BLOCK + 21]


def _codes(n, lo, hi, dtype, seed):
    return np.random.default_rng(seed).integers(lo, hi + 1, n).astype(dtype)


@pytest.mark.parametrize("n", FUSED_LENGTHS)
@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 9, 12, 15, 16, 17, 32])
def test_pack_shifted_and_unpack_shifted_match_reference(n, width):
    shift = (2**width - 1) // 2
    # the narrowest dtype that holds [-shift, 2**width - 1 - shift], as the codecs' codes
    dtype = np.int8 if width < 8 else np.int16 if width < 16 else np.int64
    codes = _codes(n, -shift, 2**width - 1 - shift, dtype, width)
    out = np.full(packed_size(n, width), 0xAA, dtype=np.uint8)
    _bits.mpicomp_bits_pack_shifted(codes, shift, width, out)
    np.testing.assert_array_equal(out, reference_pack(codes.astype(np.int64) + shift, width))
    back = np.empty(n, dtype=np.int64)
    _bits.mpicomp_bits_unpack_shifted(out, width, shift, back)
    np.testing.assert_array_equal(back, codes)


@pytest.mark.parametrize("n", FUSED_LENGTHS)
@pytest.mark.parametrize("width,out_width", [(1, 2), (2, 3), (3, 3), (8, 9), (9, 10), (15, 16)])
def test_add_repack_and_add_unpack_are_one_ring_step(n, width, out_width):
    bound = 3 if width < 8 else 100
    partial = _codes(n, 0, 2**width - 1, np.uint32, n + width)
    room = 2**out_width - 1 - partial.astype(np.int64)  # keep every sum inside out_width
    mine = np.minimum(_codes(n, -bound, bound, np.int16, n), room - bound).astype(np.int16)
    mine = np.maximum(mine, -bound)
    stream = reference_pack(partial, width)
    expected = partial.astype(np.int64) + mine + bound
    expected = np.where(expected < 2**out_width, expected, 0)
    mine = (expected - partial.astype(np.int64) - bound).astype(np.int16)
    out = np.full(packed_size(n, out_width), 0x55, dtype=np.uint8)
    _bits.mpicomp_bits_add_repack(stream, width, mine, bound, out_width, out)
    np.testing.assert_array_equal(out, reference_pack(expected, out_width))
    sums = np.empty(n, dtype=np.int64)
    _bits.mpicomp_bits_add_unpack(stream, width, mine, bound, sums)
    np.testing.assert_array_equal(sums, expected)


@pytest.mark.parametrize("n", FUSED_LENGTHS)
@pytest.mark.parametrize("width", [1, 2, 5])
def test_min_repack_is_the_elementwise_minimum(n, width):
    theirs = _codes(n, 0, 2**width - 1, np.uint32, n)
    mine = _codes(n, 0, 2**width - 1, np.uint8, n + 1)
    out = np.empty(packed_size(n, width), dtype=np.uint8)
    _bits.mpicomp_bits_min_repack(reference_pack(theirs, width), width, mine, out)
    np.testing.assert_array_equal(out, reference_pack(np.minimum(theirs, mine), width))


def test_unpack_reads_nothing_past_a_stream_cut_to_its_exact_size():
    # A stream that ends exactly where its last code does: the word reads must stop there.
    for width in range(1, 33):
        for n in (8, 9, 16, 24, 31, 40):
            codes = _codes(n, 0, 2**width - 1, np.int64, width).astype(np.uint32)
            stream = reference_pack(codes, width).copy()  # its own buffer, nothing after it
            back = np.empty(n, dtype=np.uint32)
            mpicomp_bits_unpack(stream, width, back)
            np.testing.assert_array_equal(back, codes)
