"""The CUDA bit-packing kernels (kernels/cuda/bits.cu), run on the CPU by the emulation, give
the numba twin's bytes: every width, every integer dtype, ragged sizes, unaligned buffers."""

import numpy as np
import pytest
from _devices import device, params

from mpicomp.kernels.bits import MAX_WIDTH, packed_size
from mpicomp.kernels.cpu import record
from mpicomp.kernels.cuda import bits as cuda_bits

# The numba reference runs on int64 codes only: for in-range values its bytes do not
# depend on the code dtype, and each dtype would cost a parallel numba compile (minutes on
# a fresh machine). The CUDA launchers run on every dtype.
REF = record().bits
WIDTHS = range(1, MAX_WIDTH + 1)
DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
# Ragged sizes: not multiples of 8 or 32, one element, none, several blocks of threads.
SIZES = [0, 1, 7, 9, 33, 255, 1027, 4099]


@pytest.fixture(scope="module", autouse=True)
def one_numba_thread():
    """Each parallel numba launch wakes its thread pool, milliseconds a call on a loaded
    machine; one thread gives the same bytes (no result depends on the thread count)."""
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


@pytest.fixture(scope="module", params=params())
def cuda(request):
    return cuda_bits.launchers(device(request.param))


def cases(width):
    """Yield (n, dtype, rng) for ``width``: every size, dtypes rotating with the width."""
    for k, n in enumerate(SIZES):
        yield n, DTYPES[(width + k) % len(DTYPES)], np.random.default_rng([width, n])


def values(rng, n, dtype, lo, hi):
    """Return n int64 values in [lo, hi] ∩ dtype's range with both ends present (or None)."""
    info = np.iinfo(dtype)
    lo, hi = max(lo, int(info.min)), min(hi, int(info.max))
    if lo > hi:
        return None
    v = rng.integers(lo, hi, n, endpoint=True, dtype=np.int64) if n else np.zeros(0, np.int64)
    v[:2] = [lo, hi][:n]
    return v


def stream(rng, n, width, offset=0, extra=0):
    """Return a packed stream of n random ``width``-bit codes at byte ``offset`` of a buffer
    (so unaligned when offset % 4), followed by ``extra`` garbage bytes."""
    codes = values(rng, n, np.uint32, 0, 2**width - 1)
    nbytes = packed_size(n, width)
    buf = rng.integers(0, 256, offset + nbytes + extra, dtype=np.uint8)
    REF.pack(codes.astype(np.uint32), width, buf[offset : offset + nbytes])
    return buf[offset:], codes


def out_bytes(rng, nbytes, offset=0):
    """Return two equal sentinel-filled outputs at byte ``offset`` of their own buffers (so
    unaligned when offset % 4), with spare bytes after: bytes past the stream must stay."""
    base = rng.integers(0, 256, offset + nbytes + 5, dtype=np.uint8)
    return base.copy()[offset:], base.copy()[offset:]


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("width", WIDTHS)
def test_pack_unpack(cuda, width):
    for n, dtype, rng in cases(width):
        for shift in (0, 2 ** (width - 1), -3):
            codes = values(rng, n, dtype, -shift, 2**width - 1 - shift)
            if codes is None:
                continue
            codes = codes.astype(dtype)
            nbytes = packed_size(n, width)
            offset = n % 4
            want, got = out_bytes(rng, nbytes, offset)
            REF.pack_shifted(codes.astype(np.int64), shift, width, want)
            cuda.pack_shifted(codes, shift, width, got)
            same(got, want)
            out_want = np.zeros(n, np.int64)
            out_got = np.ones(n, dtype)
            REF.unpack_shifted(want, width, shift, out_want)
            out_want = out_want.astype(dtype)
            cuda.unpack_shifted(want, width, shift, out_got)
            same(out_got, out_want)
            same(out_got, codes)
            if shift == 0:
                got2, out2 = out_bytes(rng, nbytes, offset)[0], np.ones(n, dtype)
                cuda.pack(codes, width, got2)
                cuda.unpack(got2, width, out2)
                same(got2[:nbytes], want[:nbytes])
                same(out2, codes)


@pytest.mark.parametrize("width", WIDTHS)
def test_add_repack_add_unpack(cuda, width):
    for n, dtype, rng in cases(width):
        for out_width in sorted({width, min(MAX_WIDTH, width + 1), MAX_WIDTH}):
            src, codes = stream(rng, n, width, offset=(n + out_width) % 4, extra=3)
            shift = 2 ** (out_width - 1) // 2
            # Every sum code + mine + shift must fit in out_width bits.
            mine = values(rng, n, dtype, -shift, 2**out_width - 2**width - shift)
            if mine is None:
                continue
            mine = mine.astype(dtype)
            nbytes = packed_size(n, out_width)
            want, got = out_bytes(rng, nbytes, out_width % 4)
            REF.add_repack(src, width, mine.astype(np.int64), shift, out_width, want)
            cuda.add_repack(src, width, mine, shift, out_width, got)
            same(got, want)
            for out_dtype in (np.int64, dtype):
                sums_want, sums_got = np.zeros(n, np.int64), np.ones(n, out_dtype)
                REF.add_unpack(src, width, mine.astype(np.int64), shift, sums_want)
                sums_want = sums_want.astype(out_dtype)  # wraps as a store into out_dtype
                cuda.add_unpack(src, width, mine, shift, sums_got)
                same(sums_got, sums_want)


@pytest.mark.parametrize("width", WIDTHS)
def test_min_repack(cuda, width):
    for n, dtype, rng in cases(width):
        src, codes = stream(rng, n, width, offset=n % 4, extra=n % 3)
        # mine >= 0, any size: the twin compares its uint32 truncation with the code.
        mine = values(rng, n, dtype, 0, 2**40).astype(dtype)
        if n > 4:
            mine[2:4] = codes[2:4]
        nbytes = packed_size(n, width)
        want, got = out_bytes(rng, nbytes, (n + 1) % 4)
        REF.min_repack(src, width, mine.astype(np.int64), want)
        cuda.min_repack(src, width, mine, got)
        same(got, want)


@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.bool_])
def test_ring_chain(cuda, dtype):
    """A ring's steps end to end: widths growing, int64 sums out, as collectives/ring.py runs."""
    rng = np.random.default_rng(7)
    n, bound, ranks = 3001, 1 if dtype == np.bool_ else 3, 5
    signed = dtype == np.int64
    shift = bound if signed else 0
    lo = -bound if signed else 0
    mine = [rng.integers(lo, bound, n, endpoint=True).astype(dtype) for _ in range(ranks)]
    span = 2 * bound if signed else bound
    streams = {}
    for name, k in (("want", REF), ("got", cuda)):
        width = (span).bit_length()
        s = np.empty(packed_size(n, width), np.uint8)
        k.pack_shifted(mine[0], shift, width, s)
        for r in range(1, ranks):
            out_width = ((r + 1) * span).bit_length()
            out = np.empty(packed_size(n, out_width), np.uint8)
            k.add_repack(s, width, mine[r], shift, out_width, out)
            s, width = out, out_width
        sums = np.empty(n, np.int64)
        k.unpack_shifted(s, width, ranks * shift, sums)
        streams[name] = (s, sums)
    same(streams["got"][0], streams["want"][0])
    same(streams["got"][1], streams["want"][1])
    np.testing.assert_array_equal(streams["got"][1], np.sum(mine, axis=0, dtype=np.int64))


def test_rejects(cuda):
    with pytest.raises(ValueError, match="width"):
        cuda.pack(np.zeros(3, np.int64), 33, np.zeros(16, np.uint8))
    with pytest.raises(ValueError, match="bytes"):
        cuda.pack(np.zeros(9, np.int64), 8, np.zeros(8, np.uint8))
    with pytest.raises(TypeError, match="integer"):
        cuda.pack(np.zeros(3, np.float32), 8, np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        cuda.unpack(np.zeros(8, np.uint8), 8, np.zeros(16, np.int64)[::2])
