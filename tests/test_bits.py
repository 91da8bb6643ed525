"""Arbitrary-width bit packing against a plain NumPy bit-by-bit reference."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpicomp.kernels.cpu.bits import mpicomp_bits_pack, mpicomp_bits_unpack, packed_size


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
