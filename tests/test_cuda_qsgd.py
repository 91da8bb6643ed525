"""The CUDA QSGD-MaxNorm kernels (kernels/cuda/qsgd.cu), run on the CPU by the emulation, give
the numba twin's bytes: norms in the twin's summation order, codes from the same counter
draws, scale indices, reconstruction (also from packed ring sums), GlobalRandK coordinates."""

import os

import numpy as np
import pytest
from _devices import placed

from mpicomp.kernels import qsgd as kq
from mpicomp.kernels.bits import packed_size
from mpicomp.kernels.cpu import qsgd as cpu_qsgd
from mpicomp.kernels.cpu import record
from mpicomp.kernels.cuda import qsgd as cuda_qsgd
from mpicomp.kernels.cuda.device import Device

REF = record().qsgd
NO_INDEX = np.empty(0, np.int64)
# Ragged sizes: none, one, not multiples of 8 or 32, more than a bits BLOCK (2048).
SIZES = [0, 1, 7, 9, 33, 255, 1027, 4099]
CODES = [np.int8, np.int16, np.int32, np.int64]
KEY = np.uint64(0x0123456789ABCDEF)


@pytest.fixture(scope="module")
def cuda(dev):
    return cuda_qsgd.launchers(dev)


def levels(bits):
    return 2 ** (bits - 1) - 1


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def gradient(n, seed, spread=3.0):
    """Return n float32 values over many magnitudes (normal, none denormal), signs mixed,
    with zeros, a -0.0 and a few large ones."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * spread)).astype(np.float32)
    if n > 4:
        x[rng.integers(0, n, max(1, n // 50))] = 0.0
        x[1] = -0.0
        x[rng.integers(0, n, max(1, n // 100))] *= np.float32(1e4)
    return x


def coords(n, seed):
    """Return sorted distinct int64 coordinates of [0, n) (about a third of them)."""
    rng = np.random.default_rng(seed)
    return np.flatnonzero(rng.random(n) < 0.35).astype(np.int64)


def ref_sumsq(x, idx, dense):
    """The twin's ``sumsq``; under ThreadSanitizer, its chunk driver spelled out serially
    (numba's OpenMP pool is not instrumented: TSan reports races inside it)."""
    n = x.size if dense else idx.size
    if n <= kq.CHUNK or os.environ.get("MPICOMP_EMULATED_SANITIZE") != "thread":
        return REF.sumsq(x, idx, dense)
    total = 0.0
    for lo in range(0, n, kq.CHUNK):
        total += cpu_qsgd.mpicomp_qsgd_sumsq(x, idx, dense, lo, min(n, lo + kq.CHUNK))
    return total


def norm_of(x, idx=None):
    ss = REF.sumsq(x, NO_INDEX if idx is None else idx, idx is None)
    return np.float32(np.sqrt(ss))


def one(norm, m):
    """The launchers' block arguments for one norm over all m elements."""
    return np.array([norm], np.float32), np.array([0, m], np.int64), 0


def cut(m, block, members=None):
    """Return (starts, pieces, first, regular) of m elements cut every ``block`` (0: one
    block per member) within ``members`` (sizes end to end; default one), as
    kernels/qsgd.py says, written out in plain Python."""
    members = [m] if members is None else members
    starts, at = [0], 0
    for size in members:
        if size == 0:
            continue
        step = block or size
        starts += [min(at + size, at + j) for j in range(step, size + step, step)]
        at += size
    pieces, first = [0], [0]
    for lo, hi in zip(starts[:-1], starts[1:], strict=True):
        pieces[-1:] = [*range(lo, hi, kq.CHUNK), hi]
        first.append(len(pieces) - 1)
    regular = block if block and len([s for s in members if s]) <= 1 else 0
    arrays = (np.array(a, np.int64) for a in (starts, pieces, first))
    return (*arrays, regular)


def block_norms_of(x, idx, dense, starts):
    """The twin's norm of each block of x (or x[idx]) that ``starts`` cuts."""
    m = x.size if dense else idx.size
    _, pieces, first, _ = cut(m, 0, np.diff(starts).tolist())
    out = np.zeros(starts.size - 1, np.float32)
    assert REF.block_norms(x, idx, dense, pieces, first, out) == 0
    return out


# ---- squared norm -------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES + [kq.CHUNK - 1, kq.CHUNK + 77, 2 * kq.CHUNK + 5])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "index"])
def test_sumsq_adds_in_the_twins_order(cuda, n, dense):
    # Many terms of similar size: any other order of the float64 additions changes bits.
    x = gradient(n, n, spread=0.5)
    idx = NO_INDEX if dense else coords(n, n + 1)
    got, want = cuda.sumsq(x, idx, dense), ref_sumsq(x, idx, dense)
    assert np.float64(got).tobytes() == np.float64(want).tobytes()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_sumsq_propagates_nan_and_inf(cuda, bad):
    x = gradient(3000, 5)
    x[1234] = bad
    got, want = cuda.sumsq(x, NO_INDEX, True), REF.sumsq(x, NO_INDEX, True)
    assert np.isnan(got) == np.isnan(want) and (np.isnan(got) or got == want)


def test_sumsq_of_extremes(cuda):
    fmax = np.finfo(np.float32).max
    x = np.array([fmax, -fmax, 1e-30, np.finfo(np.float32).tiny] * 7, np.float32)
    assert cuda.sumsq(x, NO_INDEX, True) == REF.sumsq(x, NO_INDEX, True)


# ---- codes --------------------------------------------------------------------------------


def both(fn_name, cuda, args, out_index):
    """Run launcher ``fn_name`` of both twins on copies of ``args``; return (got, want) pairs:
    the return values and the output argument ``out_index``."""
    a = [np.copy(v) if isinstance(v, np.ndarray) else v for v in args]
    b = [np.copy(v) if isinstance(v, np.ndarray) else v for v in args]
    r1 = getattr(cuda, fn_name)(*a)
    r2 = getattr(REF, fn_name)(*b)
    return (r1, a[out_index]), (r2, b[out_index])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "index"])
@pytest.mark.parametrize("bits", [2, 3, 5, 8, 12, 16])
def test_quantize_matches(cuda, n, dense, bits):
    x = gradient(n, 10 * n + bits)
    idx = NO_INDEX if dense else coords(n, n)
    m = n if dense else idx.size
    norm = norm_of(x, None if dense else idx)
    dtype = CODES[(bits + n) % len(CODES)]
    out = np.zeros(m, dtype)
    key = np.uint64(bits * 7919 + n)
    args = (x, idx, dense, *one(norm, m), levels(bits), key, out)
    (e1, o1), (e2, o2) = both("quantize", cuda, args, 8)
    assert e1 == e2 == 0
    same(o1, o2)


@pytest.mark.parametrize(
    "case", ["max_norm", "short_norm", "zero_norm", "zero_norm_zeros", "nan", "inf", "huge"]
)
def test_quantize_edges_and_errors(cuda, case):
    n = 1000
    x = gradient(n, 3)
    norm = np.float32(np.abs(x).max())  # |x| / norm reaches 1 exactly
    if case == "short_norm":
        norm = norm * np.float32(0.9)
    elif case == "zero_norm":
        norm = np.float32(0)
    elif case == "zero_norm_zeros":
        x[:], norm = 0, np.float32(0)
        x[::7] = -0.0
    elif case == "nan":
        x[17] = np.nan
    elif case == "inf":
        x[500] = -np.inf
    elif case == "huge":
        x[:] = np.finfo(np.float32).max * np.float32(0.5)
        x[::3] *= -1
        norm = np.finfo(np.float32).max
    for dtype in (np.int8, np.int16):
        out = np.zeros(n, dtype)
        args = (x, NO_INDEX, True, *one(norm, n), 127, KEY, out)
        (e1, o1), (e2, o2) = both("quantize", cuda, args, 8)
        assert e1 == e2
        same(o1, o2)
    if case in ("short_norm", "zero_norm", "nan", "inf"):
        assert e2 == kq.ERR_VALUE


def scale_set(widths):
    return np.array([levels(b) for b in sorted(widths)], np.float32)


SCALE_SETS = [(8,), (4, 8), (8, 12), (2, 6), (2, 3, 6, 10, 24), (16, 17, 20, 24)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "index"])
@pytest.mark.parametrize("widths", SCALE_SETS, ids=str)
def test_multiscale_index_matches(cuda, n, dense, widths):
    x = gradient(n, n + len(widths))
    idx = NO_INDEX if dense else coords(n, 3 * n)
    m = n if dense else idx.size
    norm = norm_of(x, None if dense else idx)
    out = np.zeros(m, np.uint8)
    args = (x, idx, dense, *one(norm, m), scale_set(widths), out)
    (e1, o1), (e2, o2) = both("multiscale_index", cuda, args, 7)
    assert e1 == e2 == 0
    same(o1, o2)


def test_multiscale_index_errors(cuda):
    x = gradient(999, 8)
    x[5] = np.nan
    norm = np.float32(np.abs(np.nan_to_num(x)).max() * 0.5)
    out = np.zeros(x.size, np.uint8)
    args = (x, NO_INDEX, True, *one(norm, x.size), scale_set((4, 8, 12)), out)
    (e1, o1), (e2, o2) = both("multiscale_index", cuda, args, 7)
    assert e1 == e2 == kq.ERR_VALUE
    same(o1, o2)


def shared_index(x, idx, dense, blocks, scales):
    """The elementwise MIN over two 'ranks' of the scale index (a valid shared index);
    ``blocks``: the launchers' (norms, starts, regular)."""
    other = x[::-1].copy() * np.float32(0.5)
    m = x.size if dense else idx.size
    a, b = np.zeros(m, np.uint8), np.zeros(m, np.uint8)
    REF.multiscale_index(x, idx, dense, *blocks, scales, a)
    REF.multiscale_index(other, idx, dense, *blocks, scales, b)
    return np.minimum(a, b)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "index"])
@pytest.mark.parametrize("widths", SCALE_SETS, ids=str)
def test_multiscale_quantize_matches(cuda, n, dense, widths):
    x = gradient(n, 5 * n + len(widths))
    idx = NO_INDEX if dense else coords(n, n + 7)
    m = n if dense else idx.size
    norm = norm_of(x, None if dense else idx)
    scales = scale_set(widths)
    sidx = shared_index(x, idx, dense, one(norm, m), scales)
    dtype = np.int8 if widths[0] <= 8 else np.int16
    key = np.uint64(n * 31 + len(widths))
    out = np.zeros(m, dtype)
    args = (x, idx, dense, *one(norm, m), scales, sidx, key, out)
    (e1, o1), (e2, o2) = both("multiscale_quantize", cuda, args, 9)
    assert e1 == e2 == 0
    same(o1, o2)


@pytest.mark.parametrize(
    "sidx_dtype", [np.uint8, np.uint16, np.int32, np.int64, np.uint64, np.int8]
)
@pytest.mark.parametrize("code_dtype", CODES)
def test_multiscale_quantize_bad_indices_and_dtypes(cuda, sidx_dtype, code_dtype):
    # Indices outside the set (ERR_INDEX), too fine for some values (ERR_UNSAFE), values
    # above the norm (ERR_VALUE): the mask and every code as the twin's.
    n = 777
    rng = np.random.default_rng(int(np.dtype(sidx_dtype).itemsize * 10 + len(str(code_dtype))))
    x = gradient(n, 4)
    scales = scale_set((3, 6, 9))
    norm = np.float32(np.abs(x).max() * 0.999)
    info = np.iinfo(sidx_dtype)
    sidx = rng.integers(0, 5, n).astype(sidx_dtype)
    sidx[:3] = [info.max, info.min, 3]
    x[10], sidx[10] = norm * np.float32(0.9), 2  # a * 255 > 3: unsafe
    out = np.zeros(n, code_dtype)
    args = (x, NO_INDEX, True, *one(norm, n), scales, sidx, KEY, out)
    (e1, o1), (e2, o2) = both("multiscale_quantize", cuda, args, 9)
    assert e1 == e2 == kq.ERR_VALUE | kq.ERR_INDEX | kq.ERR_UNSAFE
    same(o1, o2)


# ---- reconstruction -----------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", CODES + [np.uint16])
def test_dequantize_matches(cuda, n, dtype):
    rng = np.random.default_rng(n)
    nranks, bits = 1 + n % 5, 2 + n % 15
    limit = np.int64(nranks * levels(bits))
    info = np.iinfo(dtype)
    codes = rng.integers(max(-limit, info.min), min(limit, info.max), n, endpoint=True)
    codes = codes.astype(dtype)
    norm = np.float32(rng.random() * 10 + 1e-3)
    out = np.zeros(n, np.float32)
    args = (codes, *one(norm, n), levels(bits), nranks, limit, out)
    (e1, o1), (e2, o2) = both("dequantize", cuda, args, 7)
    assert e1 == e2 == 0
    same(o1, o2)


@pytest.mark.parametrize("dtype", CODES)
def test_dequantize_range_errors(cuda, dtype):
    info = np.iinfo(dtype)
    codes = np.array([0, 1, -1, 5, -6, info.max, info.min] * 9, dtype)
    out = np.zeros(codes.size, np.float32)
    args = (codes, *one(3.5, codes.size), 3, 2, np.int64(5), out)
    (e1, o1), (e2, o2) = both("dequantize", cuda, args, 7)
    assert e1 == e2 == kq.ERR_RANGE
    same(o1, o2)


def packed(rng, n, width, shift, offset, extra=3):
    """Return (a stream of n code sums + shift packed at ``width`` bits, starting at byte
    ``offset`` of its buffer, garbage bytes after it; the int64 sums)."""
    top = (1 << width) - 1
    raw = rng.integers(0, top, n, endpoint=True, dtype=np.int64) if n else np.zeros(0, np.int64)
    raw[:2] = [0, top][:n]
    buf = rng.integers(0, 256, offset + packed_size(n, width) + extra, dtype=np.uint8)
    stream = buf[offset:]
    # The layout in NumPy (bit b of the stream: byte b // 8, bit b % 8), not the twin's packer:
    # an independent check, and no numba parallel loop (TSan cannot see OpenMP's barriers).
    bits = (raw[:, None] >> np.arange(width)) & 1
    stream[: packed_size(n, width)] = np.packbits(bits.astype(np.uint8).ravel(), bitorder="little")
    return stream, raw - shift


WIDTHS = [1, 2, 3, 5, 7, 8, 9, 12, 13, 15, 16, 17, 23, 24, 25, 31, 32]


@pytest.mark.parametrize("width", WIDTHS)
def test_dequantize_packed_matches(cuda, width):
    for k, n in enumerate(SIZES):
        rng = np.random.default_rng([width, n])
        shift = (1 << (width - 1)) - 1 if width > 1 else 0
        stream, sums = packed(rng, n, width, shift, offset=k % 4)
        limit = np.int64(np.abs(sums).max() if n else 0)
        if k % 3 == 0 and limit:
            limit -= 1  # some sums beyond the limit: ERR_RANGE
        nranks = 1 + k
        out = np.zeros(n, np.float32)
        args = (stream, width, shift, *one(0.37, n), 127, nranks, limit, out)
        (e1, o1), (e2, o2) = both("dequantize_packed", cuda, args, 9)
        assert e1 == e2
        same(o1, o2)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("code_dtype", CODES)
def test_multiscale_dequantize_matches(cuda, n, code_dtype):
    rng = np.random.default_rng([n, np.dtype(code_dtype).itemsize])
    scales = scale_set((2, 5, 9))
    nranks = 3
    limit = np.int64(nranks * levels(2))
    info = np.iinfo(code_dtype)
    codes = rng.integers(max(-300, info.min), min(300, info.max), n).astype(code_dtype)
    sidx_dtype = [np.uint8, np.int64, np.uint32, np.int16][n % 4]
    sidx = rng.integers(0, 4, n).astype(sidx_dtype)  # 3: outside the set
    out = np.zeros(n, np.float32)
    args = (codes, sidx, *one(1.75, n), scales, nranks, limit, out)
    (e1, o1), (e2, o2) = both("multiscale_dequantize", cuda, args, 8)
    assert e1 == e2
    same(o1, o2)


@pytest.mark.parametrize("width", [1, 3, 8, 11, 16, 20, 32])
@pytest.mark.parametrize("sidx_dtype", [np.uint8, np.int64, np.uint16])
def test_multiscale_dequantize_packed_matches(cuda, width, sidx_dtype):
    scales = scale_set((4, 8, 12))
    for k, n in enumerate(SIZES):
        rng = np.random.default_rng([width, n, 3])
        shift = (1 << (width - 1)) if width > 1 else 1
        stream, sums = packed(rng, n, width, shift, offset=(k + 1) % 4)
        limit = np.int64(np.abs(sums).max() if n else 0) - (k % 2)
        sidx = rng.integers(0, 3 + k % 2, n).astype(sidx_dtype)
        out = np.zeros(n, np.float32)
        args = (stream, width, shift, sidx, *one(2.5, n), scales, 1 + k, limit, out)
        (e1, o1), (e2, o2) = both("multiscale_dequantize_packed", cuda, args, 10)
        assert e1 == e2
        same(o1, o2)


# ---- block norms --------------------------------------------------------------------------

# (elements, block, members): regular cuts, a cut per member, blocks longer than a CHUNK
# (several pieces), one block per member (block 0), empty members.
CUTS = [
    (0, 16, None), (1, 16, None), (1027, 16, None), (4099, 1024, None), (4099, 1, None),
    (4099, 5000, None), (2 * kq.CHUNK + 9, kq.CHUNK + 3, None), (2 * kq.CHUNK + 9, 0, None),
    (4099, 64, [1000, 0, 3, 3000, 96]), (4099, 0, [2000, 2099]),
    (3 * kq.CHUNK, 0, [kq.CHUNK + 1, 2 * kq.CHUNK - 1]), (1027, 7, [1, 1, 1025]),
]  # fmt: skip


@pytest.mark.parametrize("m, block, members", CUTS, ids=str)
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "index"])
def test_block_norms_match(cuda, m, block, members, dense):
    n = m if dense else 3 * m
    x = gradient(n, m + block, spread=0.5)
    idx = NO_INDEX if dense else np.sort(np.random.default_rng(m).choice(n, m, replace=False))
    starts, pieces, first, _ = cut(m, block, members)
    o1, o2 = np.zeros(starts.size - 1, np.float32), np.zeros(starts.size - 1, np.float32)
    assert cuda.block_norms(x, idx, dense, pieces, first, o1) == 0
    assert REF.block_norms(x, idx, dense, pieces, first, o2) == 0
    same(o1, o2)
    v = (x if dense else x[idx]).astype(np.float64)
    want = [np.sqrt(np.sum(v[a:b] ** 2)) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    np.testing.assert_allclose(o2, want, rtol=1e-6)
    if m and block == 0 and members is None:  # one block: the whole tensor's norm
        assert o2[0] == norm_of(x, None if dense else idx)


@pytest.mark.parametrize("case", ["nan", "inf", "overflow"])
def test_block_norms_errors(cuda, case):
    x = gradient(3000, 7)
    bad = {"nan": np.nan, "inf": -np.inf, "overflow": np.float32(3e38)}[case]
    x[1500:1502] = bad
    starts, pieces, first, _ = cut(x.size, 100)
    o1, o2 = np.ones(starts.size - 1, np.float32), np.ones(starts.size - 1, np.float32)
    e1 = cuda.block_norms(x, NO_INDEX, True, pieces, first, o1)
    e2 = REF.block_norms(x, NO_INDEX, True, pieces, first, o2)
    assert e1 == e2 == (kq.ERR_OVERFLOW if case == "overflow" else kq.ERR_VALUE)
    same(o1, o2)
    assert o2[15] == 0 and np.count_nonzero(o2) == o2.size - 1


def blocked(m, block, members, norms):
    """(norms, starts, regular) for the cut, with and without the ``regular`` shortcut."""
    starts, _, _, regular = cut(m, block, members)
    return [(norms, starts, regular), (norms, starts, 0)]


@pytest.mark.parametrize("m, block, members", CUTS[:-3] + CUTS[-2:], ids=str)
def test_codes_against_block_norms_match(cuda, m, block, members):
    # Every kernel that reads a norm, against a cut of many blocks: the twin's bytes, and
    # the same bytes whether the block is found by i // regular or by a search.
    x = gradient(m, 3 * m + block)
    starts = cut(m, block, members)[0]
    norms = block_norms_of(x, NO_INDEX, True, starts)
    scales = scale_set((4, 8, 12))
    results = []
    for blocks in blocked(m, block, members, norms):
        out = []
        codes = np.zeros(m, np.int16)
        (e1, o1), (e2, o2) = both(
            "quantize", cuda, (x, NO_INDEX, True, *blocks, 127, KEY, codes), 8
        )
        assert e1 == e2 == 0
        same(o1, o2)
        sidx = shared_index(x, NO_INDEX, True, blocks, scales)
        args = (x, NO_INDEX, True, *blocks, scales, sidx, KEY, np.zeros(m, np.int8))
        (e1, o3), (e2, o4) = both("multiscale_quantize", cuda, args, 9)
        assert e1 == e2 == 0
        same(o3, o4)
        sums = o1.astype(np.int64) * 2
        for name, args, at in [
            ("dequantize", (sums, *blocks, 127, 2, np.int64(254), np.zeros(m, np.float32)), 7),
            (
                "multiscale_dequantize",
                (sums, sidx, *blocks, scales, 2, np.int64(254), np.zeros(m, np.float32)),
                8,
            ),
        ]:
            (e1, v1), (e2, v2) = both(name, cuda, args, at)
            assert e1 == e2 == 0
            same(v1, v2)
            out.append(v2)
        stream, packed_sums = packed(np.random.default_rng(m), m, 9, 255, offset=1)
        limit = np.int64(256)
        for name, args, at in [
            (
                "dequantize_packed",
                (stream, 9, 255, *blocks, 7, 1, limit, np.zeros(m, np.float32)),
                9,
            ),
            (
                "multiscale_dequantize_packed",
                (stream, 9, 255, sidx, *blocks, scales, 1, limit, np.zeros(m, np.float32)),
                10,
            ),
        ]:
            (e1, v1), (e2, v2) = both(name, cuda, args, at)
            assert e1 == e2
            same(v1, v2)
            out.append(v2)
        results.append([o2, sidx, o4, *out])
    for a, b in zip(*results, strict=True):
        same(a, b)


def pack_sums(sums, width, shift, offset):
    """Return sums + shift packed LSB-first at ``width`` bits (NumPy's packbits, not the twin's
    packer), starting at byte ``offset`` of its buffer."""
    raw = np.asarray(sums, np.int64) + shift
    bits = (raw[:, None] >> np.arange(width)) & 1
    body = np.packbits(bits.astype(np.uint8).ravel(), bitorder="little")
    buf = np.zeros(offset + body.size, np.uint8)
    buf[offset:] = body
    return buf[offset:]


@pytest.mark.parametrize("m, block, members", CUTS, ids=str)
def test_a_span_from_an_element_offset_is_the_slice_of_the_whole(cuda, m, block, members):
    # A reduce-scatter's row: codes and out start at element ``base`` of the coded vector, whose
    # block norms they take. Both twins give the bytes of the whole vector's decode, sliced.
    rng = np.random.default_rng([m, block])
    starts = cut(m, block, members)[0]
    norms = (rng.random(starts.size - 1) * 10 + 0.5).astype(np.float32)
    scales = scale_set((4, 8, 12))
    limit = np.int64(2 * 127)
    sums = rng.integers(-limit, limit + 1, m)
    sidx = rng.integers(0, 3, m).astype(np.uint8)
    spans = sorted({(0, m), (m // 3, m), (m // 3, min(m, 2 * m // 3 + 1)), (max(0, m - 5), m)})
    for blocks in blocked(m, block, members, norms):
        whole, whole_ms = np.zeros(m, np.float32), np.zeros(m, np.float32)
        assert REF.dequantize(sums, *blocks, 127, 2, limit, whole) == 0
        assert REF.multiscale_dequantize(sums, sidx, *blocks, scales, 2, limit, whole_ms) == 0
        for a, b in spans:
            stream = pack_sums(sums[a:b], 9, 255, offset=a % 4)
            out = np.zeros(b - a, np.float32)
            for name, args, at, want in [
                ("dequantize", (sums[a:b], *blocks, 127, 2, limit, out, a), 7, whole),
                ("dequantize_packed", (stream, 9, 255, *blocks, 127, 2, limit, out, a), 9, whole),
                (
                    "multiscale_dequantize",
                    (sums[a:b], sidx[a:b], *blocks, scales, 2, limit, out, a),
                    8,
                    whole_ms,
                ),
                (
                    "multiscale_dequantize_packed",
                    (stream, 9, 255, sidx[a:b], *blocks, scales, 2, limit, out, a),
                    10,
                    whole_ms,
                ),
            ]:
                (e1, v1), (e2, v2) = both(name, cuda, args, at)
                assert e1 == e2 == 0, (name, a, b)
                same(v1, v2)
                same(v2, want[a:b])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_a_bad_block_norm_is_err_norm(cuda, bad):
    m = 1000
    x = gradient(m, 2)
    starts = cut(m, 100)[0]
    norms = block_norms_of(x, NO_INDEX, True, starts) * np.float32(2)
    norms[4] = bad
    blocks = (norms, starts, 100)
    codes = np.zeros(m, np.int8)
    (e1, o1), (e2, o2) = both("quantize", cuda, (x, NO_INDEX, True, *blocks, 127, KEY, codes), 8)
    assert e1 & kq.ERR_NORM and e1 == e2
    same(o1, o2)
    sums = np.zeros(m, np.int8)
    args = (sums, *blocks, 127, 1, np.int64(127), np.zeros(m, np.float32))
    (e1, _), (e2, _) = both("dequantize", cuda, args, 7)
    assert e1 == e2 == kq.ERR_NORM


# ---- GlobalRandK coordinates --------------------------------------------------------------

SELECT = [(1, 1), (2, 1), (10, 10), (1000, 1), (1000, 300), (1000, 999), (5000, 30), (4099, 4099),
          (3000, 2000), (700, 64)]  # fmt: skip


@pytest.mark.parametrize("n, k", SELECT)
@pytest.mark.parametrize("seed", [0, 1])
def test_grandk_select_matches_floyd(cuda, n, k, seed):
    # Both table layouts: direct when 4n bytes are few (k near n), hashed when k << n.
    key = np.uint64(seed * 1_000_003 + n * 7 + k)
    m1, m2 = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    p1, p2 = np.empty(k, np.int64), np.empty(k, np.int64)
    cuda.grandk_select(np.int64(n), np.int64(k), key, m1, p1)
    REF.grandk_select(np.int64(n), np.int64(k), key, m2, p2)
    same(p1, p2)
    same(m1, m2)


def test_grandk_select_with_a_preset_mask(cuda):
    # Coordinates already marked count as taken, as in the twin's `if mask[t]`.
    n, k = 2000, 500
    preset = (np.random.default_rng(2).random(n) < 0.1).astype(np.uint8)
    m1, m2 = preset.copy(), preset.copy()
    p1, p2 = np.empty(k, np.int64), np.empty(k, np.int64)
    cuda.grandk_select(np.int64(n), np.int64(k), KEY, m1, p1)
    REF.grandk_select(np.int64(n), np.int64(k), KEY, m2, p2)
    same(p1, p2)
    same(m1, m2)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 33, 1000, 4099])
def test_grandk_sort_matches(cuda, n):
    rng = np.random.default_rng(n)
    picks = rng.integers(-50, 10**12, n, dtype=np.int64)
    if n > 4:
        picks[rng.integers(0, n, n // 4)] = picks[0]  # duplicates
    p1, p2 = picks.copy(), picks.copy()
    cuda.grandk_sort(p1)
    REF.grandk_sort(p2)
    same(p1, p2)


@pytest.mark.parametrize("n", [0, 1, 7, 4095, 4096, 4097, 9001, 20000])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_grandk_compact_matches(cuda, n, density):
    rng = np.random.default_rng([n, int(density * 100)])
    mask = (rng.random(n) < density).astype(np.uint8)
    mask[mask.astype(bool)] = rng.integers(1, 256, int(mask.sum()), dtype=np.uint8)  # any nonzero
    k = int(np.count_nonzero(mask))
    o1, o2 = np.full(k, -1, np.int64), np.full(k, -1, np.int64)
    cuda.grandk_compact(mask, o1)
    REF.grandk_compact(mask, o2)
    same(o1, o2)


@pytest.mark.parametrize("n, k", [(1, 1), (100, 7), (5000, 1234)])
def test_grandk_scatter_matches(cuda, n, k):
    rng = np.random.default_rng(k)
    idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    vals = gradient(k, k)
    ratio = np.float32(n / k)
    o1, o2 = np.zeros(n, np.float32), np.zeros(n, np.float32)
    cuda.grandk_scatter(vals, idx, ratio, o1)
    REF.grandk_scatter(vals, idx, ratio, o2)
    same(o1, o2)


def test_selected_coordinates_end_to_end(cuda):
    # select -> sort / compact -> quantize at the coordinates -> dequantize -> scatter.
    n, k = 6000, 40
    m, picks = np.zeros(n, np.uint8), np.empty(k, np.int64)
    cuda.grandk_select(np.int64(n), np.int64(k), KEY, m, picks)
    sorted_, compact = picks.copy(), np.empty(k, np.int64)
    cuda.grandk_sort(sorted_)
    cuda.grandk_compact(m, compact)
    same(sorted_, compact)
    x = gradient(n, 9)
    norm = np.float32(np.sqrt(cuda.sumsq(x, compact, False)))
    codes = np.zeros(k, np.int8)
    assert cuda.quantize(x, compact, False, *one(norm, k), 127, KEY, codes) == 0
    vals = np.zeros(k, np.float32)
    assert cuda.dequantize(codes, *one(norm, k), 127, 1, np.int64(127), vals) == 0
    out = np.zeros(n, np.float32)
    cuda.grandk_scatter(vals, compact, np.float32(n / k), out)
    ref_codes = np.zeros(k, np.int8)
    REF.quantize(x, compact, False, *one(norm, k), 127, KEY, ref_codes)
    same(codes, ref_codes)


# ---- contract -----------------------------------------------------------------------------


def test_host_syncs_are_one_per_result(dev, cuda):
    x = gradient(500, 1)
    norm = np.float32(np.abs(x).max())
    before = dev.syncs
    cuda.sumsq(x, NO_INDEX, True)
    cuda.quantize(x, NO_INDEX, True, *one(norm, 500), 7, KEY, np.zeros(500, np.int8))
    blocks = one(norm, 500)
    cuda.dequantize(np.zeros(500, np.int8), *blocks, 7, 1, np.int64(7), np.zeros(500, np.float32))
    starts, pieces, first, regular = cut(500, 64)
    cuda.block_norms(x, NO_INDEX, True, pieces, first, np.zeros(starts.size - 1, np.float32))
    assert dev.syncs - before == 4
    before = dev.syncs
    m, p = np.zeros(500, np.uint8), np.empty(50, np.int64)
    cuda.grandk_select(np.int64(500), np.int64(50), KEY, m, p)
    cuda.grandk_sort(p)
    cuda.grandk_compact(m, p)
    cuda.grandk_scatter(x[:50], p, np.float32(10), np.zeros(500, np.float32))
    assert cuda.sumsq(x[:0], NO_INDEX, True) == 0.0
    assert dev.syncs == before


def test_launchers_have_the_numba_names(cuda):
    assert set(vars(cuda)) == set(vars(REF))


# ---- tiles, groups of 4 and misaligned views ------------------------------------------------
# sumsq_lanes walks its pieces in tiles of 8 elements per thread (256 and 512 at the emulated
# geometries, 1,024 at a GPU's: blocks of 128), a group of pieces per block; the element
# kernels take 4 elements a thread, one vector access each for x (16 bytes), codes, scale
# indices and floats where aligned, one access per element elsewhere.


@pytest.fixture(scope="module")
def gpu_like():
    """The launchers at a GPU's geometry (256 threads a block; sumsq_lanes in blocks of 128),
    on the emulation."""
    return cuda_qsgd.launchers(Device.emulated(256, 8))


# (elements, block): pieces of 128 in groups of up to 16 per block, pieces around a tile,
# CHUNK-long pieces (one per block), blocks crossing tiles and CHUNKs, tiny inputs.
LANE_EDGES = [
    (1, 128), (5, 128), (255, 128), (257, 128), (1023, 128), (1025, 128), (4097, 128),
    (1000, 1), (2049, 7), (3001, 1000), (kq.CHUNK - 1, 0), (kq.CHUNK + 1, 0),
    (kq.CHUNK + 1, 128), (2 * kq.CHUNK + 5, kq.CHUNK - 3),
]  # fmt: skip


@pytest.mark.parametrize("m, block", LANE_EDGES, ids=str)
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "index"])
def test_norms_around_tiles_and_misaligned(cuda, gpu_like, m, block, dense):
    n = m if dense else m + m // 2 + 1
    x = gradient(n, m + block, spread=0.5)
    idx = NO_INDEX if dense else np.sort(np.random.default_rng(m).choice(n, m, replace=False))
    starts, pieces, first, _ = cut(m, block)
    want = np.zeros(starts.size - 1, np.float32)
    assert REF.block_norms(x, idx, dense, pieces, first, want) == 0
    big = m > kq.CHUNK
    for k, shift in [(cuda, 1), (cuda, 0), (gpu_like, 3)][: 2 if big else 3]:
        got = np.zeros(starts.size - 1, np.float32)
        assert k.block_norms(placed(x, shift), idx, dense, pieces, first, got) == 0
        same(got, want)
    if block == 0 or m <= 1025:
        ss = cuda.sumsq(placed(x, 2), idx, dense)
        assert np.float64(ss).tobytes() == np.float64(ref_sumsq(x, idx, dense)).tobytes()


def guarded(n, dtype, shift, fill=0x5A):
    """An output of n elements ``shift`` elements past a 16-byte boundary, with 5 guard
    elements after it; returns (the whole, the output view)."""
    whole = placed(np.full((n + 5) * np.dtype(dtype).itemsize, fill, np.uint8).view(dtype), shift)
    return whole, whole[:n]


# Regular blocks of 3 (a group of 4 crosses a block's end), and irregular ones.
def element_blocks(m):
    starts = np.unique(np.r_[0, np.arange(1, m, 5), np.arange(2, m, 11), m]).astype(np.int64)
    return [(3, cut(m, 3)[0]), (0, starts)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 258, 1027])
@pytest.mark.parametrize("shift", [1, 2, 3])
def test_element_kernels_on_misaligned_views(cuda, gpu_like, n, shift):
    k = gpu_like if n == 1027 else cuda
    x = gradient(n, 7 * n + shift)
    xs = placed(x, shift)
    scales = scale_set((4, 8, 12))
    for regular, starts in element_blocks(n):
        norms = block_norms_of(x, NO_INDEX, True, starts) * np.float32(1.5)
        norms_s = placed(norms, (shift + 1) % 4)
        blocks, blocks_s = (norms, starts, regular), (norms_s, placed(starts, shift % 2), regular)
        for dtype in CODES:
            want, got = np.zeros(n + 5, dtype), guarded(n, dtype, (shift + 2) % 4)
            e = REF.quantize(x, NO_INDEX, True, *blocks, 127, KEY, want[:n])
            assert k.quantize(xs, NO_INDEX, True, *blocks_s, 127, KEY, got[1]) == e == 0
            same(got[1], want[:n])
            assert not np.any(got[0][n:].view(np.uint8) != 0x5A)
        sidx_want, sidx_got = np.zeros(n, np.uint8), guarded(n, np.uint8, shift)
        e = REF.multiscale_index(x, NO_INDEX, True, *blocks, scales, sidx_want)
        assert k.multiscale_index(xs, NO_INDEX, True, *blocks_s, scales, sidx_got[1]) == e == 0
        same(sidx_got[1], sidx_want)
        assert not np.any(sidx_got[0][n:] != 0x5A)
        for sdt in (np.uint8, np.int64):
            sidx = placed(sidx_want.astype(sdt), (shift + 3) % 4)
            want, got = np.zeros(n, np.int8), guarded(n, np.int8, shift)
            e = REF.multiscale_quantize(x, NO_INDEX, True, *blocks, scales, sidx, KEY, want)
            e2 = k.multiscale_quantize(xs, NO_INDEX, True, *blocks_s, scales, sidx, KEY, got[1])
            assert e == e2 == 0
            same(got[1], want)
        for dtype in CODES:
            codes = placed(np.resize(np.array([3, -5, 0, 127, -127, 1], dtype), n), shift)
            want, got = np.zeros(n, np.float32), guarded(n, np.float32, (shift + 1) % 4)
            e = REF.dequantize(codes, *blocks, 127, 2, np.int64(254), want)
            assert k.dequantize(codes, *blocks_s, 127, 2, np.int64(254), got[1]) == e == 0
            same(got[1], want)
            assert not np.any(got[0][n:].view(np.uint8) != 0x5A)
            sidx = placed(np.resize(np.array([0, 1, 2, 3], np.uint8), n), shift)  # 3: outside
            want, got = np.zeros(n, np.float32), guarded(n, np.float32, shift)
            e = REF.multiscale_dequantize(codes, sidx, *blocks, scales, 2, np.int64(254), want)
            e2 = k.multiscale_dequantize(codes, sidx, *blocks_s, scales, 2, np.int64(254), got[1])
            assert e == e2
            same(got[1], want)
        for width in (3, 8, 32):
            stream, _ = packed(
                np.random.default_rng([n, width]), n, width, 0, offset=shift, extra=0
            )
            want, got = np.zeros(n, np.float32), guarded(n, np.float32, shift)
            limit = np.int64(2**31)
            e = REF.dequantize_packed(stream, width, 1, *blocks, 7, 3, limit, want)
            assert k.dequantize_packed(stream, width, 1, *blocks_s, 7, 3, limit, got[1]) == e
            same(got[1], want)
            sidx = placed(np.resize(np.array([2, 0, 1], np.int64), n), shift)
            want, got = np.zeros(n, np.float32), guarded(n, np.float32, (shift + 2) % 4)
            args = (scales, 3, limit)
            e = REF.multiscale_dequantize_packed(stream, width, 1, sidx, *blocks, *args, want)
            e2 = k.multiscale_dequantize_packed(stream, width, 1, sidx, *blocks_s, *args, got[1])
            assert e == e2
            same(got[1], want)


@pytest.mark.parametrize("n", [1, 5, 1030])
def test_index_kernels_on_misaligned_views(cuda, n):
    # GlobalRandK: x[idx] gathered, idx itself misaligned (its 4 indices in two 16-byte loads
    # where aligned).
    x = gradient(3 * n, n)
    idx = np.sort(np.random.default_rng(n).choice(3 * n, n, replace=False)).astype(np.int64)
    norm = norm_of(x, idx)
    for shift in (1, 2, 3):
        want, got = np.zeros(n, np.int8), guarded(n, np.int8, shift)
        e = REF.quantize(x, idx, False, *one(norm, n), 7, KEY, want)
        assert cuda.quantize(placed(x, shift), placed(idx, shift), False, *one(norm, n), 7, KEY,
                             got[1]) == e == 0  # fmt: skip
        same(got[1], want)
        ss = cuda.sumsq(placed(x, shift), placed(idx, shift), False)
        assert np.float64(ss).tobytes() == np.float64(REF.sumsq(x, idx, False)).tobytes()


def test_packed_stream_is_read_within_its_bytes(cuda):
    # A stream that ends exactly at the end of its buffer, not on a 4-byte word: the last
    # word is read byte by byte (ASan and a GPU's memcheck see any read past it).
    for n, width in [(3, 3), (5, 7), (9, 31), (13, 32), (100, 9)]:
        for offset in range(4):
            stream, _ = packed(np.random.default_rng(n), n, width, 0, offset=offset, extra=0)
            assert stream.size == packed_size(n, width) and stream.base.size == offset + stream.size
            want, got = np.zeros(n, np.float32), np.zeros(n, np.float32)
            limit = np.int64(2**32)
            e = REF.dequantize_packed(stream, width, 0, *one(1.0, n), 7, 1, limit, want)
            assert cuda.dequantize_packed(stream, width, 0, *one(1.0, n), 7, 1, limit, got) == e
            same(got, want)
