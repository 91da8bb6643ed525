"""The CUDA 3LC kernels (emulated on the CPU) give the numba twin's bytes and return values."""

import numpy as np
import pytest
from _devices import device, params

from mpicomp.kernels import threelc as k3
from mpicomp.kernels.cpu import threelc as cpu
from mpicomp.kernels.cuda import threelc as cuda_threelc

# Sizes around the tiles (threads * 8 bytes) and spans of both geometries, with ragged tails.
SIZES = [0, 1, 4, 5, 6, 31, 33, 257, 1029, 4099]


@pytest.fixture(scope="module", params=params())
def k(request):
    return cuda_threelc.launchers(device(request.param))


def gradient(n, seed, zeros=0.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32) * np.float32(1e-2)
    x[rng.random(n) < zeros] = 0
    return x


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


# ---- max -----------------------------------------------------------------------------------------


def check_max(k, x, r, use_r, s):
    want = cpu.mpicomp_threelc_max(x, r, use_r, s)
    got = k.max(x, r, use_r, s)
    assert type(got[0]) is type(want[0]) and type(got[1]) is type(want[1])
    assert got[1] == want[1]
    assert np.float32(got[0]).tobytes() == np.float32(want[0]).tobytes()
    # M's 4 bytes where a payload holds them (here at an odd offset): the same on both.
    want_b, got_b = np.full(9, 7, np.uint8), np.full(9, 7, np.uint8)
    assert cpu.mpicomp_threelc_max(x, r, use_r, s, want_b[3:7]) == want
    assert k.max(x, r, use_r, s, got_b[3:7]) == got
    same(got_b, want_b)
    m = want_b[3:7].view("<f4")[0]
    if want[1]:
        assert m.tobytes() == np.float32(want[0]).tobytes()
    else:
        assert np.isnan(m)  # the mark quartic_encode writes nothing on
    return want_b[3:7]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("use_r", [False, True])
@pytest.mark.parametrize("s", [1.0, 1.5, 1.9999999])
def test_max_random(k, n, use_r, s):
    x = gradient(n, n)
    r = gradient(n, n + 1) if use_r else x[:0]
    check_max(k, x, r, use_r, np.float32(s))


@pytest.mark.parametrize("use_r", [False, True])
@pytest.mark.parametrize(
    "special", ["nan", "-nan", "inf", "-inf", "big", "zeros", "-zeros", "overflow_sum"]
)
def test_max_edges(k, use_r, special):
    n = 1037
    x = gradient(n, 7)
    r = np.zeros(n, np.float32) if use_r else x[:0]
    where = 613
    if special == "nan":
        x[where] = np.nan
    elif special == "-nan":
        x[where] = -np.float32(np.nan)
    elif special == "inf":
        x[where] = np.inf
    elif special == "-inf":
        x[-1] = -np.inf
    elif special == "big":
        x[where] = np.float32(-3.0e38)  # times 1.5 overflows: clamped to FLT_MAX
    elif special in ("zeros", "-zeros"):
        x[:] = np.float32(-0.0 if special == "-zeros" else 0.0)
        if use_r:
            r[:] = np.float32(-0.0)
    elif special == "overflow_sum":
        x[where] = np.float32(3.0e38)
        if use_r:
            r[where] = np.float32(3.0e38)  # x + r is Inf: not encodable
    check_max(k, x, r, use_r, np.float32(1.5))
    check_max(k, x, r, use_r, 1.0)  # a Python float, as numba takes it


@pytest.mark.parametrize("s", [1.0, 1.5, 1.0000001, 1.9999999, 1.3333334])
def test_max_rounds_m_as_float32_denormals_and_overflow_included(k, s):
    # M = max * s is computed on the device in integers: each pattern's product must round
    # (to nearest even) as the twin's float32 product, from denormals to the FLT_MAX clamp.
    rng = np.random.default_rng(int(s * 1e7))
    tops = [1, 2, 3, 0x7FFFFF, 0x800000, 0x800001, 0x7F7FFFFF, 0x7F000000, 0x7F400000]
    tops += [0x00400000, 0x00555555, 0x3F800000, 0x3FFFFFFF]
    tops += rng.integers(1, 0x7F800000, 40).tolist() + rng.integers(1, 0x800000, 20).tolist()
    for top in tops:
        x = np.array([top], np.uint32).view(np.float32)
        x = np.concatenate([x, x * np.float32(0.5), -x])  # the max is top, whatever its sign
        check_max(k, x, x[:0], False, np.float32(s))


# ---- quartic encode ------------------------------------------------------------------------------


def check_encode(k, x, r, use_r, scale, L=None):
    L = k3.quartic_length(x.size) if L is None else L
    want_out, got_out = np.full(L, 7, np.uint8), np.full(L, 7, np.uint8)
    want_r, got_r = r.copy(), r.copy()
    assert cpu.mpicomp_threelc_quartic_encode(x, want_r, use_r, scale, want_out) is None
    assert k.quartic_encode(x, got_r, use_r, scale, got_out) is None
    same(got_out, want_out)
    same(got_r, want_r)
    return want_out


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("use_r", [False, True])
@pytest.mark.parametrize("s", [1.0, 1.5, 1.999])
def test_quartic_encode_random(k, n, use_r, s):
    x = gradient(n, 3 * n, zeros=0.3)
    r = gradient(n, 3 * n + 1) if use_r else x[:0]
    scale, ok = cpu.mpicomp_threelc_max(x, r, use_r, np.float32(s))
    assert ok
    check_encode(k, x, r, use_r, np.float32(scale))


@pytest.mark.parametrize("use_r", [False, True])
def test_quartic_encode_ties_and_zero_scale(k, use_r):
    # Exactly +-M/2 rounds to 0 (half to even); +-M and values just past M/2 do not.
    half = np.float32(0.5)
    past = np.nextafter(half, np.float32(1))
    base = np.array([1, -1, half, -half, past, -past, 0, -0.0, 0.25, -0.75], np.float32)
    x = np.tile(base, 103)[:1021]
    r = np.zeros_like(x) if use_r else x[:0]
    check_encode(k, x, r, use_r, np.float32(1))
    check_encode(k, x, r, use_r, np.float32(0))  # M = 0: every trit 0, r = x + r
    check_encode(k, x, r, use_r, np.float32(3.4028235e38))
    z = np.zeros(1023, np.float32)
    check_encode(k, z, np.zeros_like(z) if use_r else z[:0], use_r, np.float32(0))


@pytest.mark.parametrize("use_r", [False, True])
def test_quartic_encode_reads_m_from_the_bytes_max_wrote(k, use_r):
    n = 1029
    x = gradient(n, 21, zeros=0.2)
    r = gradient(n, 22) if use_r else x[:0]
    m = check_max(k, x, r, use_r, np.float32(1.5))
    want = check_encode(k, x, r, use_r, np.float32(m.view("<f4")[0]))
    assert check_encode(k, x, r, use_r, m).tobytes() == want.tobytes()


@pytest.mark.parametrize("use_r", [False, True])
def test_quartic_encode_writes_nothing_on_the_not_encodable_mark(k, use_r):
    # What max writes for NaN/Inf: on a device the encode runs before the host knows, and
    # must leave the residual (and out) as they were.
    x = gradient(1037, 23)
    x[500] = np.inf
    r = np.zeros_like(x) if use_r else x[:0]
    mark = check_max(k, x, r, use_r, np.float32(1.5))
    out = check_encode(k, x, r, use_r, mark)
    assert (out == 7).all()
    r2 = r.copy()
    assert k.quartic_encode(x, r2, use_r, mark, np.full(208, 7, np.uint8)) is None
    same(r2, r)


def test_quartic_encode_odd_lengths(k):
    # out sizes other than ceil(n / 5): the twins agree on the layout L = out.size.
    x = gradient(203, 11)
    for L in (0, 1, 30, 40, 41, 60):
        check_encode(k, x, x[:0], False, np.float32(0.01), L=L)


# ---- zero-run encode / length / decode -----------------------------------------------------------


def quartic_stream(n, seed, zero_frac):
    """Quartic bytes with runs of 121 of every length (and long runs across tiles and spans)."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, k3.MAX_QUARTIC + 1, n).astype(np.uint8)
    i = 0
    while i < n:
        run = int(rng.choice([1, 2, 13, 14, 15, 27, 28, 29, 40, 300, 700]))
        if rng.random() < zero_frac:
            out[i : i + run] = k3.ZERO_BYTE
        i += run + int(rng.integers(0, 4))
    return out


def streams():
    yield "empty", np.zeros(0, np.uint8)
    for n in (1, 2, 13, 14, 15, 16, 27, 28, 29, 42, 43, 513, 1000, 5003):
        yield f"zeros{n}", np.full(n, k3.ZERO_BYTE, np.uint8)
    for n in (1, 2, 37, 1029, 4099):
        yield f"dense{n}", quartic_stream(n, n, 0.0)
        yield f"mixed{n}", quartic_stream(n, n + 1, 0.5)
        yield f"sparse{n}", quartic_stream(n, n + 2, 0.95)
    alt = np.full(2051, k3.ZERO_BYTE, np.uint8)
    alt[::2] = 5
    yield "alternating", alt
    lone = np.full(3001, k3.ZERO_BYTE, np.uint8)
    lone[[0, 511, 512, 1000, 1001, 2999]] = 0  # non-zero bytes at tile and span edges
    yield "edges", lone


STREAMS = dict(streams())


@pytest.mark.parametrize("name", list(STREAMS))
def test_zero_run_round_trip(k, name):
    src = STREAMS[name]
    L = src.size
    want_dst, got_dst = np.full(L, 7, np.uint8), np.full(L, 7, np.uint8)
    want = cpu.mpicomp_threelc_zero_run_encode(src, want_dst)
    got = k.zero_run_encode(src, got_dst)
    assert type(got) is type(want) and got == want
    same(got_dst, want_dst)
    enc = want_dst[:want]
    for limit in (L, L - 1, L + 1, 0, -1, 10 * L + 5):
        want_n = cpu.mpicomp_threelc_zero_run_length(enc, limit)
        got_n = k.zero_run_length(enc, limit)
        assert type(got_n) is type(want_n) and got_n == want_n, limit
    for size in {L, max(L - 1, 0), max(L - 5, 0), 0, L + 3}:
        want_out, got_out = np.full(size, 9, np.uint8), np.full(size, 9, np.uint8)
        want_total = cpu.mpicomp_threelc_zero_run_decode(enc, want_out)
        got_total = k.zero_run_decode(enc, got_out)
        # The whole expansion's length, whatever dst holds of it.
        assert type(got_total) is type(want_total) and got_total == want_total == L, size
        same(got_out, want_out)
        if size == L:
            assert got_out.tobytes() == src.tobytes()


@pytest.mark.parametrize("n", [0, 1, 5, 33, 257, 1029, 3001])
@pytest.mark.parametrize("seed", [0, 1])
def test_zero_run_decode_arbitrary_bytes(k, n, seed):
    # Any byte stream (codes, bytes above 242, truncations): same lengths, flags and bytes.
    rng = np.random.default_rng(1000 * n + seed)
    src = rng.integers(0, 256, n).astype(np.uint8)
    if seed:
        src[rng.random(n) < 0.5] = 255
    total = int(np.where(src >= k3.RUN_BASE, src.astype(np.int64) - 241, 1).sum())
    for limit in (total, total - 1, n, 0):
        assert k.zero_run_length(src, limit) == cpu.mpicomp_threelc_zero_run_length(src, limit)
    for size in {total, max(total - 1, 0), total // 2, total + 2}:
        want_out, got_out = np.full(size, 9, np.uint8), np.full(size, 9, np.uint8)
        assert k.zero_run_decode(src, got_out) == total
        assert cpu.mpicomp_threelc_zero_run_decode(src, want_out) == total
        same(got_out, want_out)


# ---- quartic decode ------------------------------------------------------------------------------


def check_decode(k, src, scale, n):
    want_out, got_out = np.full(n, 5.0, np.float32), np.full(n, 5.0, np.float32)
    want = cpu.mpicomp_threelc_quartic_decode(src, scale, want_out)
    got = k.quartic_decode(src, scale, got_out)
    assert type(got) is type(want) and got == want
    same(got_out, want_out)
    # M as the 4 bytes of a payload's body (at an odd offset): the same code and floats.
    held = np.zeros(7, np.uint8)
    held[1:5] = np.array([scale], "<f4").view(np.uint8)
    for twin in (cpu.mpicomp_threelc_quartic_decode, k.quartic_decode):
        out = np.full(n, 5.0, np.float32)
        assert twin(src, held[1:5], out) == want
        same(out, want_out)
    return got


SCALES = [0.01, 1.0, 3.4028235e38, 1e-40, -0.0]  # 1e-40: a denormal M comes back as is


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", SCALES)
def test_quartic_decode_valid(k, n, scale):
    x = gradient(n, 5 * n, zeros=0.5)
    src = check_encode(k, x, x[:0], False, np.float32(0.01))
    # Non-zero trits with M = 0 (or -0) is ERR_ZERO_SCALE, unless there are none.
    check_decode(k, src, np.float32(scale), n)
    zeros = check_encode(k, np.zeros(n, np.float32), x[:0], False, np.float32(0.0))
    assert check_decode(k, zeros, np.float32(scale), n) == k3.OK


@pytest.mark.parametrize("n", [6, 9, 33, 1029, 4098])
def test_quartic_decode_errors(k, n):
    x = gradient(n, n, zeros=0.3)
    src = check_encode(k, x, x[:0], False, np.float32(0.01))
    L = src.size
    pad = src.copy()
    pad[L - 1] += 1  # the last digit of the last byte is a pad position (n % 5 != 0)
    assert check_decode(k, pad, np.float32(1), n) == k3.ERR_PAD
    for bad_byte in (k3.MAX_QUARTIC + 1, 255):
        big = src.copy()
        big[0] = bad_byte
        assert check_decode(k, big, np.float32(1), n) == k3.ERR_BYTE
        big[L - 1] += 1  # a pad error too: the byte error comes first
        assert check_decode(k, big, np.float32(1), n) == k3.ERR_BYTE
    assert check_decode(k, pad, np.float32(0), n) == k3.ERR_PAD  # before the zero-scale check
    zero = np.full(L, k3.ZERO_BYTE, np.uint8)
    zero[:] = check_encode(k, np.zeros(n, np.float32), x[:0], False, np.float32(0))
    zero[L // 3] += 81  # digit 0 (position j < n): a non-zero trit
    assert check_decode(k, zero, np.float32(0), n) == k3.ERR_ZERO_SCALE


@pytest.mark.parametrize("L, n", [(0, 0), (0, 3), (10, 20), (10, 53), (7, 35), (300, 1203)])
def test_quartic_decode_sizes(k, L, n):
    # out sizes other than the encoded ones: both twins apply the same pad rules.
    rng = np.random.default_rng(L + n)
    src = rng.integers(0, k3.MAX_QUARTIC + 1, L).astype(np.uint8)
    check_decode(k, src, np.float32(2), n)
    for j in range(L):  # zero the digits in pad positions: the valid decode
        for d in range(5):
            if d * L + j >= n:
                digit = src[j] // 3 ** (4 - d) % 3
                src[j] -= digit * 3 ** (4 - d)
    check_decode(k, src, np.float32(2), n)


# ---- reads -----------------------------------------------------------------------------------------


def test_reads_wait_for_the_callers_batch():
    """Inside ``readback.batch`` every value the launchers bring back is a ``Later``, read
    in one transfer when the batch closes; M itself stays on the device."""
    from _devices import GEOMETRIES

    from mpicomp.kernels.readback import Later, batch, value_of

    dev = device(GEOMETRIES[0])
    k = cuda_threelc.launchers(dev)
    n = 1029
    x = gradient(n, 31, zeros=0.9)
    L = k3.quartic_length(n)
    scale, quartic, stream = np.empty(4, np.uint8), np.empty(L, np.uint8), np.empty(L, np.uint8)
    before = dev.syncs
    with batch("encode"):
        m, ok = k.max(x, x[:0], False, np.float32(1.0), scale)
        k.quartic_encode(x, x[:0], False, scale, quartic)
        used = k.zero_run_encode(quartic, stream)
        assert all(isinstance(v, Later) for v in (m, ok, used))
    assert dev.syncs - before == 1
    assert value_of(ok) and value_of(m) == np.abs(x).max()
    with batch("decode"):
        back, out = np.empty(L, np.uint8), np.empty(n, np.float32)
        total = k.zero_run_decode(stream[: value_of(used)], back)
        code = k.quartic_decode(back, scale, out)
        length = k.zero_run_length(stream[: value_of(used)], L)
        assert all(isinstance(v, Later) for v in (total, code, length))
    assert dev.syncs - before == 2
    assert value_of(total) == value_of(length) == L and value_of(code) == k3.OK
    want_q, want = np.empty(L, np.uint8), np.empty(n, np.float32)
    cpu.mpicomp_threelc_quartic_encode(x, x[:0], False, value_of(m), want_q)
    assert cpu.mpicomp_threelc_quartic_decode(want_q, value_of(m), want) == k3.OK
    same(out, want)
