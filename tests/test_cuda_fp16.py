"""The CUDA float16 kernels (kernels/cuda/fp16.cu), run on the CPU by the emulation, give the
numba twin's bytes: every float16 pattern, rounding ties, range edges, NaN payloads, Adler-32
sums of the payload, and one host synchronization per launcher that returns a value."""

import numpy as np
import pytest

from mpicomp.kernels.cpu import record
from mpicomp.kernels.cuda import fp16 as cuda_fp16
from mpicomp.kernels.cuda.device import Device

REF = record().fp16
SIZES = [0, 1, 7, 33, 1001, 4099]
ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@pytest.fixture(scope="module")
def cuda(dev):
    return cuda_fp16.launchers(dev)


def floats(n, seed):
    """Return n float32 values over float16's whole range and past it: normals, float16
    subnormals, float32 denormals, exact rounding ties, +-65504 / 65520, signed zeros."""
    rng = np.random.default_rng(seed)
    h = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    h[(h & 0x7C00) == 0x7C00] &= 0xBFFF  # finite halves: the bulk must encode
    x = h.view(np.float16).astype(np.float32)
    u = x.view(np.uint32)
    kind = rng.integers(0, 8, n)
    u[kind == 1] += np.uint32(0x1000)  # exactly halfway between two halves: ties to even
    u[kind == 2] += rng.integers(1, 0x2000, int((kind == 2).sum()), dtype=np.uint32)
    u[kind == 3] = rng.integers(0, 0x38800000, int((kind == 3).sum()), dtype=np.uint32)
    u[kind == 4] = rng.integers(0, 0x00800000, int((kind == 4).sum()), dtype=np.uint32)
    u[kind == 3] |= rng.integers(0, 2, int((kind == 3).sum()), dtype=np.uint32) << 31
    over = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x477FE000)  # keep |x| <= 65504
    u[over] = (u[over] & np.uint32(0x80000000)) | np.uint32(0x477FE000)
    edges = np.array([0.0, -0.0, 65504.0, -65504.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26], np.float32)
    x[: min(n, edges.size)] = edges[: min(n, edges.size)]
    return x


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def run_encode(k, x, with_sum):
    h16 = np.full(x.size, 0xA5A5, np.uint16)
    result = k.encode(x, h16, h16.view(np.uint8) if with_sum else None)
    return result, h16


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("with_sum", [False, True])
def test_encode(dev, cuda, n, with_sum):
    x = floats(n, n)
    (ok_w, sum_w), h_w = run_encode(REF, x, with_sum)
    syncs = dev.syncs
    (ok_g, sum_g), h_g = run_encode(cuda, x, with_sum)
    assert dev.syncs - syncs == (1 if n else 0)
    assert (ok_g, sum_g) == (ok_w, sum_w) and ok_g is True and type(sum_g) is int
    same(h_g, h_w)
    same(h_g, x.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("bad", [65520.0, -65505.0, np.inf, -np.inf, np.nan, 1e30])
@pytest.mark.parametrize("where", [0, 500, 1000])
def test_encode_out_of_range(cuda, bad, where):
    """ok is False wherever the bad value sits; the other halves (and the garbage) agree."""
    x = floats(1001, 5)
    x[where] = bad
    for with_sum in (False, True):
        (ok_w, sum_w), h_w = run_encode(REF, x, with_sum)
        (ok_g, sum_g), h_g = run_encode(cuda, x, with_sum)
        assert (ok_g, sum_g) == (ok_w, sum_w) and ok_g is False
        same(h_g, h_w)


def test_encode_every_bit_pattern_slice(cuda):
    """Every 2^-14 .. 2^16 exponent and NaN payload as raw bits: the garbage half of an
    out-of-range value is the twin's too."""
    u = np.random.default_rng(3).integers(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)
    x = u.view(np.float32)
    (ok_w, sum_w), h_w = run_encode(REF, x, True)
    (ok_g, sum_g), h_g = run_encode(cuda, x, True)
    assert (ok_g, sum_g) == (ok_w, sum_w)
    same(h_g, h_w)


@pytest.mark.parametrize(
    "scale", [1.0, 3.0, 8.0, 0.5, -7.0, 1e-30, -1e38, 3e38, np.inf, -np.inf, np.nan]
)
def test_decode_every_half(dev, cuda, scale):
    """All 65536 float16 patterns, NaN payloads, Inf / Inf, quotients that underflow."""
    h = ALL_HALVES.copy()
    want, got = np.full(h.size, 7, np.float32), np.full(h.size, 9, np.float32)
    ok_w = REF.decode(h, want, scale)
    syncs = dev.syncs
    ok_g = cuda.decode(h, got, scale)
    assert dev.syncs - syncs == 1
    assert ok_g is ok_w is False
    same(got, want)


@pytest.mark.parametrize("n", SIZES)
def test_decode_finite(dev, cuda, n):
    h = floats(n, n + 1).astype(np.float16).view(np.uint16)
    for scale in (1.0, 5.0):
        want, got = np.zeros(n, np.float32), np.ones(n, np.float32)
        ok_w = REF.decode(h, want, scale)
        syncs = dev.syncs
        ok_g = cuda.decode(h, got, scale)
        assert dev.syncs - syncs == (1 if n else 0)
        assert ok_g is bool(ok_w) is True
        same(got, want)


def test_decode_zero_scale(cuda):
    with pytest.raises(ZeroDivisionError):
        cuda.decode(ALL_HALVES[:5], np.zeros(5, np.float32), 0.0)
    assert cuda.decode(ALL_HALVES[:0], np.zeros(0, np.float32), 0.0) is True


@pytest.mark.parametrize("seed", range(3))
def test_add_every_half(dev, cuda, seed):
    """All 65536 patterns against a shuffle of them: overflow to Inf, Inf - Inf, NaN payloads
    (the first operand's wins), signed zeros, subnormal sums."""
    a = ALL_HALVES.copy()
    b = np.random.default_rng(seed).permutation(ALL_HALVES)
    if seed == 1:
        b = a ^ np.uint16(0x8000)  # x + (-x), Inf + -Inf
    want, got = b.copy(), b.copy()
    REF.add(a, want)
    syncs = dev.syncs
    cuda.add(a, got)
    assert dev.syncs == syncs
    same(got, want)


@pytest.mark.parametrize("n", SIZES)
def test_add_ragged(cuda, n):
    rng = np.random.default_rng(n)
    a, b = (np.clip(rng.standard_normal(n) * 3e4, -65504, 65504) for _ in "ab")
    a, b = (v.astype(np.float16).view(np.uint16) for v in (a, b))
    want, got = b.copy(), b.copy()
    REF.add(a, want)
    cuda.add(a, got)
    same(got, want)


@pytest.mark.parametrize("n", [0, 1, 33, 4099])
@pytest.mark.parametrize("special", [None, 0x7C00, 0xFC00, 0x7E01, 0xFFFF])
def test_all_finite(dev, cuda, n, special):
    h = floats(n, 9).astype(np.float16).view(np.uint16)
    for where in sorted({0, n // 2, n - 1}) if n and special else [None]:
        g = h.copy()
        if where is not None:
            g[where] = special
        syncs = dev.syncs
        got = cuda.all_finite(g)
        assert dev.syncs - syncs == (1 if n else 0)
        assert got is bool(REF.all_finite(g))
        assert got is (where is None)


def test_rejects(cuda):
    with pytest.raises(ValueError, match="sizes"):
        cuda.encode(np.zeros(3, np.float32), np.zeros(4, np.uint16))
    with pytest.raises(ValueError, match="h8"):
        cuda.encode(np.zeros(3, np.float32), np.zeros(3, np.uint16), np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="sizes"):
        cuda.decode(np.zeros(3, np.uint16), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="sizes"):
        cuda.add(np.zeros(3, np.uint16), np.zeros(2, np.uint16))


# The element kernels move groups of 4 in rows of 4 * threads elements, ROWS rows a round, and
# fall back to one element at a time for the last n % 4 and for misaligned pointers: sizes
# around those edges at both emulated geometries (rows of 256 and 128 elements) and at a GPU's.
EDGE_SIZES = [3, 4, 5, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2047, 2053]


def _views(x, h, off_x, off_h):
    """Return x and h placed off_x / off_h elements past a 16-byte boundary."""
    bx = np.empty(x.size + 8, np.float32)[off_x : off_x + x.size]
    bx[...] = x
    bh = np.empty(h.size + 8, h.dtype)[off_h : off_h + h.size]
    bh[...] = h
    return bx, bh


def same_round_trip(launchers, x):
    """Encode ``x`` (with and without the checksum) and decode it (by 1 and by 3) with
    ``launchers`` and with the twin: the same bytes and flags; return the float16 bits."""
    for with_sum in (False, True):
        (ok_w, sum_w), h_w = run_encode(REF, x, with_sum)
        (ok_g, sum_g), h_g = run_encode(launchers, x, with_sum)
        assert (ok_g, sum_g) == (ok_w, sum_w)
        same(h_g, h_w)
    for scale in (1.0, 3.0):
        want, got = np.zeros(x.size, np.float32), np.ones(x.size, np.float32)
        assert launchers.decode(h_w, got, scale) is bool(REF.decode(h_w, want, scale))
        same(got, want)
    return h_w


@pytest.mark.parametrize("n", EDGE_SIZES)
def test_encode_decode_at_group_and_row_edges(dev, cuda, n):
    x = floats(n, 100 + n)
    h_w = same_round_trip(cuda, x)
    a = floats(n, 7 + n).astype(np.float16).view(np.uint16)
    want, got = h_w.copy(), h_w.copy()
    REF.add(a, want)
    cuda.add(a, got)
    same(got, want)


@pytest.mark.parametrize("off_x", [0, 1, 2, 3])
@pytest.mark.parametrize("off_h", [0, 1, 2, 3, 4])
def test_misaligned_views(cuda, off_x, off_h):
    """Inputs and outputs 1-3 elements past a 16-byte boundary (4 halves: 8-byte aligned, as a
    1-D payload's body): the vector loops step aside for the scalar one, same bytes."""
    n = 1029
    x, h = _views(floats(n, 11), np.full(n, 0xA5A5, np.uint16), off_x, off_h)
    (ok_w, sum_w), h_w = run_encode(REF, x, True)
    assert cuda.encode(x, h, h.view(np.uint8)) == (ok_w, sum_w)
    same(h, h_w)
    out, hh = _views(np.zeros(n, np.float32), h_w, off_x, off_h)
    for scale in (1.0, 5.0):
        want = np.zeros(n, np.float32)
        assert cuda.decode(hh, out, scale) is bool(REF.decode(h_w, want, scale))
        same(out, want)
    b = h_w.copy()
    a = np.empty(n + 8, np.uint16)[off_x : off_x + n]
    a[...] = floats(n, 12).astype(np.float16).view(np.uint16)
    want = b.copy()
    REF.add(a, want)
    cuda.add(a, hh)
    same(hh, want)
    assert cuda.all_finite(hh) is bool(REF.all_finite(want))


@pytest.mark.parametrize("special", [0x7C00, 0xFE01])
def test_flags_in_every_lane_of_a_group(cuda, special):
    """A NaN/Inf in each position of a group of 4, in the vector part and in the tail."""
    n = 1027
    h = floats(n, 13).astype(np.float16).view(np.uint16)
    for at in (0, 1, 2, 3, 517, 1022, 1023, 1024, 1026):
        g = h.copy()
        g[at] = special
        assert cuda.all_finite(g) is False
        want, got = np.zeros(n, np.float32), np.zeros(n, np.float32)
        assert cuda.decode(g, got) is bool(REF.decode(g, want)) is False
        same(got, want)
        x = g.view(np.float16).astype(np.float32)
        assert run_encode(cuda, x, True)[0] == run_encode(REF, x, True)[0]


@pytest.fixture(scope="module")
def gpu_geometry():
    """Launches at a GPU's geometry (256 threads, 2 SMs' worth of blocks)."""
    return cuda_fp16.launchers(Device.emulated(256, 8))


@pytest.mark.parametrize("n", [1, 4099, 2 * 2 * 1024 * 5 + 3, 70001])
def test_gpu_geometry(gpu_geometry, n):
    same_round_trip(gpu_geometry, floats(n, 21))
