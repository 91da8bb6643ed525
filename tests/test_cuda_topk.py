"""The CUDA top-k kernels (kernels/cuda/topk.cu), run on the CPU by the emulation, give the
numba twin's bytes: the selected (index, value) pairs with the twin's tie rule (many ties,
zeros of both signs, denormals, extremes), the scatter's error codes, and the finiteness check."""

import numpy as np
import pytest
from _devices import device, params

from mpicomp.kernels.cpu import record
from mpicomp.kernels.cuda import topk as cuda_topk
from mpicomp.kernels.cuda.device import Device

REF = record().topk
# Ragged sizes: not multiples of 8, 32 or a tile, one element, several tiles and blocks.
SIZES = [1, 2, 7, 33, 255, 1027, 4099]
KINDS = ["normal", "ties", "zeros", "equal", "tiny", "huge"]
INDEX_DTYPES = [np.uint32, np.uint64, np.int64]


@pytest.fixture(scope="module", params=params())
def cuda(request):
    return cuda_topk.launchers(device(request.param))


def gradient(n, kind, seed=0):
    """Return float32 x of size n of a ``kind``: normals, few distinct magnitudes (ties at
    the threshold), zeros of both signs, one magnitude with random signs, denormals, or
    magnitudes near float32's max."""
    rng = np.random.default_rng([n, KINDS.index(kind), seed])
    if kind == "normal":
        x = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)
    elif kind == "ties":
        x = rng.choice([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5], n)
    elif kind == "zeros":
        x = rng.choice([0.0, -0.0], n)
    elif kind == "equal":
        x = rng.choice([-3.0, 3.0], n)
    elif kind == "tiny":
        sign = rng.integers(0, 2, n, dtype=np.uint32) << np.uint32(31)
        return (rng.integers(0, 64, n, dtype=np.uint32) | sign).view(np.float32)
    else:
        x = rng.choice([-1, 1], n) * rng.choice([3.4e38, 3.3e38, 1e38], n)
    return x.astype(np.float32)


def ks(n):
    """Return the k to select from n: the first, a share, all but one, and all (small n)."""
    return sorted({1, n // 3, n - 1, n if n < 40 else 1} - {0})


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_select_matches_numba(cuda, n, kind):
    x = gradient(n, kind)
    for j, k in enumerate(ks(n)):
        dtype = INDEX_DTYPES[(n + j) % len(INDEX_DTYPES)]
        ref_idx, ref_val = np.full(k + 3, 7, dtype), np.full(k + 3, 7, np.float32)
        got_idx, got_val = ref_idx.copy(), ref_val.copy()
        assert REF.select(x, k, ref_idx[:k], ref_val[:k]) is True
        assert cuda.select(x, k, got_idx[:k], got_val[:k]) is True
        assert ref_idx.tobytes() == got_idx.tobytes(), (k, dtype)
        assert ref_val.tobytes() == got_val.tobytes(), (k, dtype)


@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_select_with_more_tiles_than_threads(cuda, kind):
    # 9000 elements: at 32 threads, more compaction tiles (8 * 32 elements) than a block has
    # threads, so the one-block scan carries from segment to segment.
    x = gradient(9000, kind)
    for k in (3001, 8999):
        ref_idx, ref_val = np.empty(k, np.int64), np.empty(k, np.float32)
        got_idx, got_val = np.empty(k, np.int64), np.empty(k, np.float32)
        REF.select(x, k, ref_idx, ref_val)
        assert cuda.select(x, k, got_idx, got_val) is True
        assert ref_idx.tobytes() == got_idx.tobytes() and ref_val.tobytes() == got_val.tobytes()


@pytest.mark.parametrize("n", [1, 40, 1027])
@pytest.mark.parametrize("what", [np.nan, -np.nan, np.inf, -np.inf])
def test_select_reports_nonfinite_and_writes_nothing(cuda, n, what):
    x = gradient(n, "normal")
    x[np.random.default_rng(n).integers(0, n)] = what
    k = max(1, n // 4)
    idx, val = np.full(k, 9, np.int64), np.full(k, 9, np.float32)
    assert REF.select(x, k, idx, val) is False
    assert cuda.select(x, k, idx, val) is False
    assert (idx == 9).all() and (val == 9).all()


def test_select_into_misaligned_views(cuda):
    x = gradient(1027, "ties")
    k = 300
    ref_idx, ref_val = np.empty(k, np.uint32), np.empty(k, np.float32)
    REF.select(x, k, ref_idx, ref_val)
    # A payload body is a byte buffer: its index and value views may start anywhere.
    buf = np.zeros(1 + 8 * k + 1, np.uint8)
    idx, val = buf[1 : 1 + 4 * k].view("<u4"), buf[1 + 4 * k : 1 + 8 * k].view("<f4")
    assert cuda.select(x, k, idx, val) is True
    assert idx.tobytes() == ref_idx.tobytes() and val.tobytes() == ref_val.tobytes()


def test_select_rejects_k_out_of_range(cuda):
    x = gradient(10, "normal")
    for k in (0, 11):
        with pytest.raises(ValueError, match="k must lie"):
            cuda.select(x, k, np.empty(12, np.int64), np.empty(12, np.float32))


def test_one_sync_per_launch():
    dev = Device.emulated(32, 2)
    k = cuda_topk.launchers(dev)
    x = gradient(300, "normal")
    k.select(x, 10, np.empty(10, np.int64), np.empty(10, np.float32))
    k.scatter(np.arange(3, dtype=np.uint32), x[:3], 300, np.zeros(300, np.float32))
    k.all_finite(x)
    assert dev.syncs == 3
    assert k.all_finite(np.empty(0, np.float32)) is True
    assert (
        k.scatter(np.empty(0, np.uint32), np.empty(0, np.float32), 5, np.zeros(5, np.float32)) == 0
    )
    assert dev.syncs == 3


def scatter_case(rng, n, k, dtype, error):
    """Return (indices, values) of k strictly increasing indices < n, spoilt by ``error``."""
    idx = np.sort(rng.choice(n, k, replace=False)).astype(dtype)
    vals = gradient(k, "normal", seed=n)
    vals[::7] = gradient(k, "tiny")[::7]
    at = int(rng.integers(0, k))
    if error == "range":
        idx[at:] = np.arange(n, n + k - at, dtype=dtype)
    elif error == "repeat" and k > 1:
        at = max(at, 1)
        idx[at] = idx[at - 1]
    elif error == "decrease" and k > 1:
        at = max(at, 1)
        idx[at] = idx[at - 1] - 1 if idx[at - 1] else 0
    elif error == "negative":
        idx = idx.astype(np.int64) if dtype != np.uint64 else idx
        idx[at] = -1 if idx.dtype == np.int64 else np.uint64(2**64 - 1)
    elif error in ("nan", "inf"):
        vals[at] = np.nan if error == "nan" else -np.inf
    elif error == "both":  # a bad value first, a bad index later (or the other way)
        vals[at] = np.inf
        idx[int(rng.integers(0, k))] = n
    return idx, vals


@pytest.mark.parametrize("n, k", [(1, 1), (9, 4), (100, 100), (1027, 33), (4099, 2000)])
@pytest.mark.parametrize(
    "error", [None, "range", "repeat", "decrease", "negative", "nan", "inf", "both"]
)
def test_scatter_matches_numba(cuda, n, k, error):
    rng = np.random.default_rng([n, k, len(error or "")])
    for dtype in INDEX_DTYPES:
        idx, vals = scatter_case(rng, n, k, dtype, error)
        ref, got = np.zeros(n, np.float32), np.zeros(n, np.float32)
        code = REF.scatter(idx, vals, n, ref)
        assert cuda.scatter(idx, vals, n, got) == code, dtype
        if error is None:
            assert code == 0 and ref.tobytes() == got.tobytes()


@pytest.mark.parametrize("n", [0, 1, 33, 4099])
def test_all_finite_matches_numba(cuda, n):
    x = gradient(n, "normal") if n else np.empty(0, np.float32)
    cases = [x, gradient(n, "tiny"), gradient(n, "huge")]
    for at in sorted({0, n // 2, n - 1}) if n else []:
        for what in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[at] = what
            cases.append(y)
    for y in cases:
        assert cuda.all_finite(y) is bool(REF.all_finite(y))


# The select keeps the threshold's top-digit bin as candidates when it fits a buffer of
# cuda_topk._room(n), else takes the last digit and the counts from x: both paths, forced.
ROOMS = {"fits": (1 << 40, 1), "spills": (1, 1 << 40)}


@pytest.fixture(params=sorted(ROOMS))
def room(request, monkeypatch):
    least, share = ROOMS[request.param]
    monkeypatch.setattr(cuda_topk, "CAND_MIN", least)
    monkeypatch.setattr(cuda_topk, "CAND_SHARE", share)
    return request.param


def check_select(k_launchers, x, k, dtype=np.int64):
    ref_idx, ref_val = np.full(k + 2, 7, dtype), np.full(k + 2, 7, np.float32)
    got_idx, got_val = ref_idx.copy(), ref_val.copy()
    assert REF.select(x, k, ref_idx[:k], ref_val[:k]) is True
    assert k_launchers.select(x, k, got_idx[:k], got_val[:k]) is True
    assert ref_idx.tobytes() == got_idx.tobytes(), k
    assert ref_val.tobytes() == got_val.tobytes(), k


# Around tiles (8 * threads: 256 and 512 elements) and pass-1 rounds (2 * 4 * threads).
EDGE_SIZES = [255, 256, 257, 511, 512, 513, 1535, 1536, 1537]


@pytest.mark.parametrize("n", EDGE_SIZES)
@pytest.mark.parametrize("kind", ["normal", "ties", "equal"])
def test_select_both_paths_at_tile_edges(cuda, room, n, kind):
    x = gradient(n, kind, seed=1)
    for k in (1, 2, n // 2, n - 1, n):
        check_select(cuda, x, k)


@pytest.mark.parametrize("k", [1, 100, 1000, 2999, 3000, 3001, 5000, 8999, 9000])
def test_select_ties_across_tiles(cuda, room, k):
    """3000 elements of one magnitude, spread over many tiles, at the threshold: the lowest
    indices of them are kept, wherever the tile boundary falls; signs mixed."""
    rng = np.random.default_rng(k)
    x = (rng.standard_normal(9000) * 0.1).astype(np.float32)
    x[rng.choice(9000, 3000, replace=False)] = np.float32(2.5) * rng.choice([-1, 1], 3000)
    x[rng.choice(9000, 1000, replace=False)] = 7.0  # above the ties
    check_select(cuda, x, k)


@pytest.mark.parametrize("value", [0.0, -0.0, 1.5, 3e38, 1e-45])
def test_select_all_equal(cuda, room, value):
    x = np.full(1027, value, np.float32)
    x[::3] *= -1
    for k in (1, 513, 1026, 1027):
        check_select(cuda, x, k)


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_select_from_misaligned_input(cuda, room, offset):
    """x 1-3 elements past a 16-byte boundary: the vector loads step aside."""
    buf = np.zeros(1027 + 4, np.float32)
    x = buf[offset : offset + 1027]
    x[...] = gradient(1027, "ties", seed=2)
    for k in (1, 300, 1027):
        check_select(cuda, x, k)


@pytest.mark.parametrize("low_bits", [10, 20])
def test_select_digits_that_differ_only_low(cuda, room, low_bits):
    """Magnitudes sharing their top 21 (or 11) bits: every element is a candidate, and the
    threshold is found in the last digit (or the last two)."""
    base = np.uint32(0x3F800000)
    u = base + np.random.default_rng(5).integers(0, 1 << low_bits, 4099, dtype=np.uint32)
    x = u.view(np.float32) * np.where(np.arange(4099) % 2, -1, 1).astype(np.float32)
    for k in (1, 7, 2048, 4098):
        check_select(cuda, x, k)


@pytest.fixture(scope="module")
def gpu_geometry():
    """Launches at a GPU's geometry (256 threads, 2 SMs' worth of blocks)."""
    return cuda_topk.launchers(Device.emulated(256, 8))


@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_select_gpu_geometry(gpu_geometry, room, kind):
    x = gradient(20011, kind, seed=3)
    for k in (1, 200, 10005, 20011):
        check_select(gpu_geometry, x, k)
