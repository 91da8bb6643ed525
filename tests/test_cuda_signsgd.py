"""The CUDA signSGD kernels (kernels/cuda/signsgd.cu), run on the CPU by the emulation, give
the numba twin's bytes: votes, sign bits, sum |x| in the twin's order (several chunks, ragged
tails, denormals), the majority with every tie rule, and the expansion."""

import math

import numpy as np
import pytest
from _devices import device, params, placed

from mpicomp.kernels.cpu import record
from mpicomp.kernels.cuda import signsgd as cuda_signsgd
from mpicomp.kernels.cuda.device import Device
from mpicomp.kernels.signsgd import CHUNK, TIE_NEGATIVE, TIE_POSITIVE, TIE_RANDOM

REF = record().signsgd
# Ragged sizes: not multiples of 4, 8 or 32, one element, none, several blocks of threads.
SIZES = [0, 1, 3, 7, 8, 9, 33, 255, 1027, 4099]
# Several CHUNKs with ragged tails: the order of the float64 sum matters.
BIG = [CHUNK, 2 * CHUNK + 3]
KINDS = ["normal", "special", "tiny", "huge"]


@pytest.fixture(scope="module", params=params())
def cuda(request):
    return cuda_signsgd.launchers(device(request.param))


def gradient(n, kind, seed=0):
    """Return float32 x of size n: ``kind`` chooses normals, zeros/denormals/extremes mixed
    in, only denormals and zeros, or magnitudes near float32's max."""
    rng = np.random.default_rng([n, KINDS.index(kind), seed])
    x = rng.standard_normal(n).astype(np.float32) * np.float32(rng.uniform(1e-3, 1e3))
    if kind == "special":
        picks = np.array([0.0, -0.0, 1e-45, -1e-45, 3e-39, -3e-39, 1.1754944e-38, 3.4e38, -3.4e38])
        mask = rng.random(n) < 0.3
        x[mask] = rng.choice(picks.astype(np.float32), mask.sum())
    elif kind == "tiny":
        sign = rng.integers(0, 2, n, dtype=np.uint32) << np.uint32(31)
        x = (rng.integers(0, 2**23, n, dtype=np.uint32) | sign).view(np.float32)
    elif kind == "huge":
        x = (rng.choice([-1, 1], n) * rng.uniform(1e37, 3.4e38, n)).astype(np.float32)
    return x


def with_nonfinite(x, seed, what):
    x = x.copy()
    if x.size:
        x[np.random.default_rng(seed).integers(0, x.size)] = what
    return x


def same_float(a, b):
    assert isinstance(b, float)
    assert (math.isnan(a) and math.isnan(b)) or np.float64(a).tobytes() == np.float64(b).tobytes()


def sentinel(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n + 5, dtype=np.uint8)


@pytest.mark.parametrize("n", SIZES + BIG)
@pytest.mark.parametrize("kind", KINDS)
def test_votes_pack_and_scale_match_numba(cuda, n, kind):
    x = gradient(n, kind)
    for launcher in ("votes", "votes_scale"):
        ref, got = sentinel(n), sentinel(n)
        r = getattr(REF, launcher)(x, ref[:n])
        g = getattr(cuda, launcher)(x, got[:n])
        if launcher == "votes":
            assert g is r is True
        else:
            assert g[0] is r[0] is True
            same_float(r[1], g[1])
        assert ref.tobytes() == got.tobytes()
    ref, got = sentinel((n + 7) // 8), sentinel((n + 7) // 8)
    assert REF.pack(x, ref) is cuda.pack(x, got) is True
    assert ref.tobytes() == got.tobytes()
    same_float(REF.abs_sum(x), cuda.abs_sum(x))


@pytest.mark.parametrize("n", [1, 9, 1027, CHUNK + 5])
@pytest.mark.parametrize("what", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_is_reported(cuda, n, what):
    x = with_nonfinite(gradient(n, "normal"), n, what)
    out = np.empty(n, np.uint8)
    assert cuda.votes(x, out) is REF.votes(x, out) is False
    assert cuda.pack(x, np.empty((n + 7) // 8, np.uint8)) is False
    ok, total = cuda.votes_scale(x, out)
    ref_ok, ref_total = REF.votes_scale(x, out)
    assert ok is ref_ok is False
    same_float(ref_total, total)
    same_float(REF.abs_sum(x), cuda.abs_sum(x))


def test_empty_and_syncs():
    dev = Device.emulated(32, 2)
    k = cuda_signsgd.launchers(dev)
    x = gradient(100, "normal")
    assert k.votes_scale(np.empty(0, np.float32), np.empty(0, np.uint8)) == (True, 0.0)
    assert k.abs_sum(np.empty(0, np.float32)) == 0.0
    assert dev.syncs == 0
    k.votes(x, np.empty(100, np.uint8))
    k.pack(x, np.empty(13, np.uint8))
    k.votes_scale(x, np.empty(100, np.uint8))
    k.abs_sum(x)
    k.majority(np.zeros(100, np.int8), 3, TIE_RANDOM, np.uint64(5), 0, np.empty(13, np.uint8))
    k.expand(np.zeros(13, np.uint8), np.float32(1), np.empty(100, np.float32))
    assert dev.syncs == 5  # one per launcher that returns something


DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("tie", [TIE_NEGATIVE, TIE_POSITIVE, TIE_RANDOM])
def test_majority_matches_numba(cuda, n, tie):
    for nranks in (1, 2, 3, 4, 5, 8):
        rng = np.random.default_rng([n, nranks, tie])
        dtype = DTYPES[(n + nranks + tie) % len(DTYPES)]
        counts = rng.integers(0, nranks, n, endpoint=True).astype(dtype)
        key = np.uint64(int(rng.integers(0, 2**63)) * 2 + 1)  # as rng.key(): above int64
        offset = int(rng.integers(0, 10**6))
        ref, got = sentinel((n + 7) // 8), sentinel((n + 7) // 8)
        r = REF.majority(counts, nranks, tie, key, offset, ref)
        assert cuda.majority(counts, nranks, tie, key, offset, got) is r is True
        assert ref.tobytes() == got.tobytes(), (nranks, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", ["above", "below"])
def test_majority_reports_counts_out_of_range(cuda, dtype, bad):
    counts = np.full(37, 1, dtype)
    nranks = 4
    if bad == "above":
        counts[30] = 5
    elif np.issubdtype(dtype, np.signedinteger):
        counts[30] = -1
    else:
        counts[30] = np.iinfo(dtype).max  # uint64's max is -1 as int64
    out = np.empty(5, np.uint8)
    expect = REF.majority(counts, nranks, TIE_RANDOM, np.uint64(1), 0, out)
    assert cuda.majority(counts, nranks, TIE_RANDOM, np.uint64(1), 0, out) is expect
    assert expect is False


@pytest.mark.parametrize("n", SIZES)
def test_expand_matches_numba(cuda, n):
    rng = np.random.default_rng(n)
    bits = rng.integers(0, 256, (n + 7) // 8 + 2, dtype=np.uint8)  # garbage past the end
    for scale in (1.0, 0.25, -3.0, 0.0, -0.0, 1e-40, np.inf, np.nan, 3.4e38, 0.1):
        ref = np.full(n, 7, np.float32)
        got = ref.copy()
        REF.expand(bits, np.float32(scale), ref)
        assert cuda.expand(bits, np.float32(scale), got) is None
        assert ref.tobytes() == got.tobytes(), scale


# ---- tiles, chunks, warp rows and misaligned views --------------------------------------------
# The lane sums walk a chunk in tiles of 8 elements per thread (256 and 512 at the emulated
# geometries, 1,024 at a GPU's: blocks of 128); pack's warps take rows of 256 elements; the
# vector accesses need 16-byte (x, expand's out) and 4-byte (votes, sign bits) alignment, and
# fall back to one access per element elsewhere.
EDGES = [2, 4, 5, 6, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 4097]
CHUNK_EDGES = [CHUNK - 1, CHUNK + 1, 2 * CHUNK - 4, 2 * CHUNK + 1]


@pytest.fixture(scope="module")
def gpu_like():
    """The launchers at a GPU's geometry (256 threads a block: lane sums in blocks of 128, tiles
    of 1,024 elements), on the emulation."""
    return cuda_signsgd.launchers(Device.emulated(256, 8))


def check_placed(k, n, shift, kind="special"):
    """Every launcher the codec runs, on x, outputs and bits ``shift`` elements (or bytes) past
    a 16-byte boundary, against the twin on plain arrays; the guard bytes after each output
    stay as they were."""
    x = gradient(n, kind, seed=shift)
    xs = placed(x, shift)
    ref, got = sentinel(n, shift), placed(sentinel(n, shift), (shift + 1) % 4)
    r = REF.votes_scale(x, ref[:n])
    g = k.votes_scale(xs, got[:n])
    assert g[0] is r[0] is True
    same_float(r[1], g[1])
    assert ref.tobytes() == got.tobytes()
    same_float(REF.abs_sum(x), k.abs_sum(xs))
    m = (n + 7) // 8
    ref, got = sentinel(m, n), placed(sentinel(m, n), shift)
    assert REF.pack(x, ref[:m]) is k.pack(xs, got[:m]) is True
    assert ref.tobytes() == got.tobytes()
    bits = placed(ref[:m], (shift + 2) % 4)
    want, out = np.full(n + 3, 7, np.float32), placed(np.full(n + 3, 7, np.float32), shift)
    REF.expand(ref[:m], np.float32(-0.5), want[:n])
    assert k.expand(bits, np.float32(-0.5), out[:n]) is None
    assert want.tobytes() == out.tobytes()


@pytest.mark.parametrize("n", EDGES)
@pytest.mark.parametrize("shift", [0, 1, 2, 3])
def test_tiles_rows_and_misaligned_views(cuda, gpu_like, n, shift):
    for k in (cuda, gpu_like):
        check_placed(k, n, shift)


@pytest.mark.parametrize("n", CHUNK_EDGES)
@pytest.mark.parametrize("shift", [0, 3])
def test_chunk_edges(cuda, gpu_like, n, shift):
    check_placed(cuda, n, shift, "normal")
    if shift == 0:
        check_placed(gpu_like, n, shift, "tiny")


@pytest.mark.parametrize("n", [5, 1025, CHUNK + 1])
@pytest.mark.parametrize("at", ["first", "last"])
def test_nonfinite_in_a_tiles_tail_is_reported(cuda, n, at):
    # The last group of 4 of a range is partial: its NaN must count, its padding must not.
    x = gradient(n, "normal")
    x[0 if at == "first" else n - 1] = np.nan
    xs = placed(x, 1)
    out = np.empty(n, np.uint8)
    assert cuda.votes_scale(xs, out)[0] is REF.votes_scale(x, out)[0] is False
    assert cuda.pack(xs, np.empty((n + 7) // 8, np.uint8)) is False
    clean = placed(gradient(n, "normal"), 3)
    assert cuda.votes_scale(clean, out)[0] is True
    assert cuda.pack(clean, out[: (n + 7) // 8]) is True
