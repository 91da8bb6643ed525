"""The CUDA Adler-32 kernel (kernels/cuda/checksum.cu), run on the CPU by the emulation, gives
the numba twin's (and zlib's) value, and the copy its bytes: ragged and unaligned spans,
running values, all-0xFF bytes (the largest sums), one host synchronization a call."""

import zlib

import numpy as np
import pytest

from mpicomp.kernels.checksum import BASE
from mpicomp.kernels.cpu import record
from mpicomp.kernels.cuda import checksum as cuda_checksum

REF = record().checksum
# Ragged sizes, both sides of the twin's 4096-byte zlib shortcut, several grid strides.
SIZES = [0, 1, 3, 4, 5, 31, 257, 4096, 4097, 20011]
VALUES = [1, 0, 0xFFF0FFF0, (BASE - 1) << 16 | (BASE - 1), 0x12345678 % (BASE << 16)]


@pytest.fixture(scope="module")
def cuda(dev):
    return cuda_checksum.launchers(dev)


def data(n, seed, kind):
    rng = np.random.default_rng([n, seed])
    if kind == "ff":
        return np.full(n, 255, np.uint8)
    return rng.integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["random", "ff"])
@pytest.mark.parametrize("offset", [0, 1])
def test_adler32(dev, cuda, n, kind, offset):
    """Values agree for spans at every alignment (offset into a buffer), with and without
    the copy; the copy equals src and bytes around it stay."""
    buf = data(n + offset + 2, offset, kind)
    src = buf[offset : offset + n]
    for value in VALUES:
        want = REF.adler32(src, value)
        syncs = dev.syncs
        got = cuda.adler32(src, value)
        assert dev.syncs - syncs == (1 if n else 0)
        assert type(got) is int and got == want
        if value in (0, 1) or value == VALUES[-1]:
            assert got == zlib.adler32(src.tobytes(), value)
    for dst_offset in {0, (offset + 1) % 4}:
        base = np.random.default_rng(n).integers(0, 256, n + 4, dtype=np.uint8)
        dst_w, dst_g = base.copy()[dst_offset : dst_offset + n], base.copy()
        dst_g = dst_g[dst_offset : dst_offset + n]
        assert cuda.adler32(src, 7, dst=dst_g) == REF.adler32(src, 7, dst=dst_w)
        assert dst_g.tobytes() == dst_w.tobytes() == src.tobytes()


def test_continues_and_combines(cuda):
    """A checksum continued span by span equals the whole, as the wire format uses it."""
    x = data(9001, 1, "random")
    whole = cuda.adler32(x)
    value = 1
    for lo, hi in [(0, 13), (13, 4000), (4000, 4001), (4001, 9001)]:
        value = cuda.adler32(x[lo:hi], value)
    assert value == whole == REF.adler32(x) == zlib.adler32(x.tobytes())


def test_rejects(cuda):
    with pytest.raises(ValueError, match="dst"):
        cuda.adler32(np.zeros(5, np.uint8), dst=np.zeros(4, np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        cuda.adler32(np.zeros(5, np.float32))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 1])
def test_adler32_into_writes_the_checksum_where_it_lies_with_no_read(dev, cuda, n, offset):
    """The checksum finished on the device (a payload's field) equals the twin's and
    zlib's, little-endian, with and without the copy, and nothing comes to the host."""
    buf = data(n + offset + 8, offset, "random")
    src = buf[offset : offset + n]
    for value in VALUES:
        got, want = np.zeros(6, np.uint8), np.zeros(6, np.uint8)
        syncs = dev.syncs
        cuda.adler32_into(src, value, got[1:5])
        assert dev.syncs == syncs
        REF.adler32_into(src, value, want[1:5])
        assert got.tobytes() == want.tobytes()
        assert int.from_bytes(got[1:5].tobytes(), "little") == zlib.adler32(src.tobytes(), value)
        assert got[0] == got[5] == 0  # nothing written around the field
    dst = np.zeros(n + 2, np.uint8)
    cuda.adler32_into(src, 3, got[1:5], dst=dst[1 : n + 1])
    assert dst[1 : n + 1].tobytes() == src.tobytes() and dst[0] == dst[-1] == 0
    with pytest.raises(ValueError, match="4 uint8"):
        cuda.adler32_into(src, 1, np.zeros(3, np.uint8))
