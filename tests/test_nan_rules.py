"""NaN rules written in code, not left to the compiler: the kernels whose output bytes can
carry a NaN give x86's bytes (a NaN operand: the first one, quieted; an invalid operation:
the default NaN 0xFFC00000; a negation: the sign bit flipped) on their serial path, their
chunked/parallel path at any thread count, and in their CUDA twin (emulated). Where a NaN
only makes a kernel refuse its input, it must do so wherever the NaN sits, on both paths.

NaN scale arguments are quiet ones: a signaling NaN passed as a scalar argument is quieted
on the way in (numba unboxes a float32 through a double), before any kernel sees it.
"""

from contextlib import contextmanager

import numba
import numpy as np
import pytest

from mpicomp.kernels import fastsgd as kfastsgd
from mpicomp.kernels import fft as kfft
from mpicomp.kernels import qsgd as kqsgd
from mpicomp.kernels import signsgd as ksignsgd
from mpicomp.kernels.cpu import fastsgd, fft, fp16, qsgd, signsgd, threelc, topk
from mpicomp.kernels.cuda import fp16 as cuda_fp16
from mpicomp.kernels.cuda import signsgd as cuda_signsgd
from mpicomp.kernels.cuda import threelc as cuda_threelc
from mpicomp.kernels.threelc import OK as THREELC_OK

# Quiet +, quiet -, signaling +, signaling - (float16 and float32 bit patterns).
F16_NANS = [0x7E01, 0xFE05, 0x7D01, 0xFD03]
F32_NANS = [0x7FC00001, 0xFFC00005, 0x7F800001, 0xFF800003]
QUIET_F32_NANS = [0x7FC00001, 0xFFC00005]
DEFAULT_NAN = 0xFFC00000
SIGN = np.uint32(0x80000000)

# The case: a NaN first, second, negative first, signaling first, -Inf + Inf.
A5 = [0x7E01, 0x3C00, 0xFE05, 0x7D01, 0xFC00]
B5 = [0x7E02, 0x7E03, 0x7E04, 0xFE06, 0x7C00]
SUM5 = [0x7E01, 0x7E03, 0xFE05, 0x7F01, 0xFE00]


def thread_counts():
    return sorted({1, numba.config.NUMBA_NUM_THREADS})


@contextmanager
def threads(n):
    before = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def places(n, chunk):
    """Start, middle (odd), end, and both sides of the first chunk boundary inside n."""
    return sorted({i for i in (0, 1, n // 2 + 1, chunk - 1, chunk, n - 2, n - 1) if 0 <= i < n})


def same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))
    assert not bad.size, f"first differing byte {bad[0]} of {got.nbytes}"


# ---- float16 add: the ring's float16 sum ----------------------------------------------------


@pytest.mark.parametrize("n", [5, 200_000])
def test_fp16_add_first_nan_wins(n):
    """x86's rule, bytes written out: vectorized body, scalar tail, whatever the size."""
    a = np.full(n, 0x3C00, np.uint16)  # 1 + 1 = 2 (0x4000) around the NaNs
    b = a.copy()
    want = np.full(n, 0x4000, np.uint16)
    for at in (0, n // 2 + 1, n - 5) if n > 5 else (0,):
        a[at : at + 5], b[at : at + 5], want[at : at + 5] = A5, B5, SUM5
    fp16.add(a, b)
    same(b, want)
    if n == 5:
        assert b.tolist() == [0x7E01, 0x7E03, 0xFE05, 0x7F01, 0xFE00]


def f16_nan_pairs(n, seed):
    """Return float16 bits (a, b) of size n: finite values, NaN in a, in b or both, Inf pairs."""
    rng = np.random.default_rng(seed)
    a, b = (
        np.clip(rng.standard_normal(n) * 1e3, -6e4, 6e4).astype(np.float16).view(np.uint16)
        for _ in "ab"
    )
    for k, at in enumerate(places(n, fp16.CHUNK)):
        x, y = F16_NANS[k % 4], F16_NANS[(k + 1) % 4]
        a[at], b[at] = [(x, y), (x, 0x3C00), (0xBC00, y), (0x7C00, 0xFC00)][k % 4]
    return a, b


def f16_to_f32_bits(h):
    """float32 bits of float16 bits h, NaN payloads kept (integer arithmetic, no CPU rule)."""
    h = h.astype(np.uint32)
    special = (h & 0x7C00) == 0x7C00
    finite = np.where(special, 0, h).astype(np.uint16).view(np.float16).astype(np.float32)
    bits = finite.view(np.uint32)
    inf_nan = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
    return np.where(special, inf_nan, bits).astype(np.uint32)


def is_nan32(u):
    return (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)


def add_reference(a, b):
    """float16(float32(a) + float32(b)) by x86's rule, the NaN choice made by bit tests."""
    fa, fb = f16_to_f32_bits(a), f16_to_f32_bits(b)
    with np.errstate(invalid="ignore", over="ignore"):
        s = fa.view(np.float32) + fb.view(np.float32)
        out = s.astype(np.float16).view(np.uint16)
    nan_a = (a & 0x7FFF) > 0x7C00
    nan_b = (b & 0x7FFF) > 0x7C00
    out = np.where(np.isnan(s), np.uint16(0xFE00), out)  # Inf - Inf: 0xFFC00000
    out = np.where(nan_b, b | 0x0200, out)
    return np.where(nan_a, a | 0x0200, out).astype(np.uint16)


def test_fp16_add_paths_agree():
    """Serial kernel, chunked kernel at 1 and all threads: NaNs at the chunk boundary too."""
    n = fp16.CHUNK + 1003
    a, b = f16_nan_pairs(n, 1)
    want = add_reference(a, b)
    assert (want[places(n, fp16.CHUNK)] & 0x7C00 == 0x7C00).all()  # the NaNs are there
    serial = b.copy()
    fp16.mpicomp_fp16_add(a, serial)
    same(serial, want)
    for t in thread_counts():
        got = b.copy()
        with threads(t):
            fp16.add(a, got)  # > CHUNK: the parallel driver
        same(got, want)


@pytest.mark.parametrize("n", [37, fp16.CHUNK + 1003])
def test_fp16_add_twin(dev, n):
    a, b = f16_nan_pairs(n, n)
    want, got = b.copy(), b.copy()
    fp16.add(a, want)
    cuda_fp16.launchers(dev).add(a, got)
    same(want, add_reference(a, b))
    same(got, want)


# ---- float16 decode divided by a scale: the average of the ring's sum -----------------------


def decode_reference(h, scale):
    """float32(h) / scale by x86's rule, the NaN choice made by bit tests."""
    f = f16_to_f32_bits(h)
    s = np.float32(scale).view(np.uint32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = (f.view(np.float32) / np.float32(scale)).view(np.uint32)
    out = np.where(is_nan32(q), np.uint32(DEFAULT_NAN), q)
    out = np.where(is_nan32(s), s | np.uint32(0x400000), out)
    return np.where(is_nan32(f), f | np.uint32(0x400000), out).astype(np.uint32)


def f16_with_nans(n, seed):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal(n) * 100).astype(np.float16).view(np.uint16)
    for k, at in enumerate(places(n, fp16.CHUNK)):
        h[at] = (F16_NANS + [0x7C00, 0xFC00])[k % 6]
    return h


SCALES = [3.0, np.inf] + [np.uint32(u).view(np.float32) for u in QUIET_F32_NANS]


@pytest.mark.parametrize("scale", SCALES, ids=["3", "inf", "nan+", "nan-"])
def test_fp16_decode_scale_paths_agree(scale):
    for n in (7, fp16.CHUNK + 1003):
        h = f16_with_nans(n, n)
        want = decode_reference(h, scale)
        for t in thread_counts():
            out = np.zeros(n, np.float32)
            with threads(t):
                assert fp16.decode(h, out, scale) is False
            same(out.view(np.uint32), want)
        assert want[0] == 0x7FC02000  # 0x7E01 / anything: the half's payload


@pytest.mark.parametrize("scale", SCALES, ids=["3", "inf", "nan+", "nan-"])
def test_fp16_decode_scale_twin(dev, scale):
    h = f16_with_nans(1001, 3)
    want, got = np.zeros(h.size, np.float32), np.ones(h.size, np.float32)
    fp16.decode(h, want, scale)
    cuda_fp16.launchers(dev).decode(h, got, scale)
    same(got, want)


def test_fp16_encode_refuses_nan_on_both_paths():
    """A NaN only fails the range check; the garbage bytes and sums agree across paths."""
    n = fp16.CHUNK + 1003
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    for k, at in enumerate(places(n, fp16.CHUNK)):
        u = x.view(np.uint32)
        u[at] = F32_NANS[k % 4]
        runs = []
        for run in (fp16.mpicomp_fp16_encode, fp16.mpicomp_fp16_encode_chunks):
            h16 = np.zeros(n, np.uint16)
            ok, s = run(u, h16, h16.view(np.uint8), True)
            runs.append((bool(ok), int(s), h16.tobytes()))
        assert runs[0] == runs[1] and runs[0][0] is False
        u[at] = 0x3F800000
    assert fp16.encode(x[:5].copy(), np.zeros(5, np.uint16))[0] is True
    x[:5].view(np.uint32)[2] = F32_NANS[2]
    assert fp16.encode(x[:5].copy(), np.zeros(5, np.uint16))[0] is False


# ---- negations: -scale as a sign-bit flip -----------------------------------------------------


@pytest.mark.parametrize("nan", QUIET_F32_NANS, ids=hex)
def test_signsgd_expand_nan_scale(dev, nan):
    scale = np.uint32(nan).view(np.float32)
    for n in (13, 2 * ksignsgd.CHUNK + 3):
        bits = np.random.default_rng(n).integers(0, 256, (n + 7) // 8, dtype=np.uint8)
        on = np.unpackbits(bits, bitorder="little")[:n].astype(bool)
        want = np.where(on, np.uint32(nan), np.uint32(nan) ^ SIGN).astype(np.uint32)
        for t in thread_counts():
            got = np.zeros(n, np.float32)
            with threads(t):
                signsgd.mpicomp_signsgd_expand(bits, scale, got)
            same(got.view(np.uint32), want)
        twin = np.zeros(n, np.float32)
        cuda_signsgd.launchers(dev).expand(bits, scale, twin)
        same(twin.view(np.uint32), want)


@pytest.mark.parametrize("nan", QUIET_F32_NANS, ids=hex)
def test_threelc_decode_nan_scale(dev, nan):
    """Trits 1, 0, -1 decode to M, +0 and M with the sign flipped: serial span and the
    parallel chunks (more than DECODE_CHUNK bytes)."""
    scale = np.uint32(nan).view(np.float32)
    for L in (7, threelc.DECODE_CHUNK + 5):
        src = np.random.default_rng(L).integers(0, 243, L, dtype=np.uint8)
        digits = np.stack([src // 3 ** (4 - k) % 3 for k in range(5)]).reshape(-1)
        pick = [np.uint32(nan) ^ SIGN, np.uint32(0), np.uint32(nan)]
        want = np.choose(digits, pick).astype(np.uint32)
        for t in thread_counts():
            out = np.ones(5 * L, np.float32)
            with threads(t):
                assert threelc.mpicomp_threelc_quartic_decode(src, scale, out) == THREELC_OK
            same(out.view(np.uint32), want)
        twin = np.ones(5 * L, np.float32)
        assert cuda_threelc.launchers(dev).quartic_decode(src, scale, twin) == THREELC_OK
        same(twin.view(np.uint32), want)


# ---- kernels where a NaN only makes the codec refuse x --------------------------------------


def nan_positions(n, chunk):
    """Yield (x, position) with one float32 NaN of each kind at start, middle, end and the
    first chunk boundary of a finite x."""
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    u = x.view(np.uint32)
    for k, at in enumerate(places(n, chunk)):
        keep = u[at]
        u[at] = F32_NANS[k % 4]
        yield x, at
        u[at] = keep


def refused_threelc_max(x):
    none = x[:0]
    _, ok = threelc.mpicomp_threelc_max(x, none, False, 1.5)
    # A NaN in the residual only (x finite) is refused as well.
    r = np.zeros_like(x)
    r[np.isnan(x)] = x[np.isnan(x)]
    _, ok_r = threelc.mpicomp_threelc_max(np.nan_to_num(x), r, True, 1.5)
    return not ok and not ok_r


def refused_signsgd(x):
    votes = np.empty(x.size, np.uint8)
    ok, total = signsgd.mpicomp_signsgd_votes_scale(x, votes)
    packed = np.empty((x.size + 7) // 8, np.uint8)
    return not ok and not signsgd.mpicomp_signsgd_pack(x, packed) and np.isnan(total)


def refused_qsgd_sumsq(x):
    return np.isnan(qsgd.sumsq(x, np.empty(0, np.int64), True))


def refused_fft_round(x):
    out = np.empty(x.size, np.uint32)
    return fft.mpicomp_fft_round_fp16(x.view(np.uint32), out) == kfft.FP16_NONFINITE


def refused_fastsgd(x):
    bucket, flag_bits = 4096, 2
    nb = -(-x.size // bucket)
    cap = kfastsgd.bucket_capacity(min(bucket, x.size), flag_bits)
    scratch, sizes = np.empty(nb * cap, np.uint8), np.empty(nb, np.int64)
    powers = fastsgd.mpicomp_fastsgd_powers(2.0, 16)
    return not fastsgd.encode(x, bucket, powers, flag_bits, scratch, cap, sizes)


def refused_topk(x):
    k = max(1, x.size // 100)
    return not topk.select(x, k, np.empty(k, np.int64), np.empty(k, np.float32))


REFUSALS = [
    (refused_threelc_max, 1 << 16),  # one serial pass: no chunks
    (refused_signsgd, ksignsgd.CHUNK),
    (refused_qsgd_sumsq, kqsgd.CHUNK),
    (refused_fft_round, 1 << 16),  # fft._CHUNK
    (refused_fastsgd, 4096),  # the bucket
    (refused_topk, topk.CHUNK),
]


@pytest.mark.parametrize("refused, chunk", REFUSALS, ids=lambda v: getattr(v, "__name__", ""))
def test_nan_is_refused_wherever_it_sits(refused, chunk):
    for n in (5, 2 * chunk + 3):
        x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        assert not refused(x)  # finite: accepted (the check can fail)
        for x, _ in nan_positions(n, chunk):
            for t in thread_counts():
                with threads(t):
                    assert refused(x)
