"""The CUDA fft family (kernels/cuda/fft.cu) on the emulated device against its numba twin.

Every launcher but the transforms must give the twin's bytes for the same input arrays, on
two launch geometries. The transforms (rfft, irfft) go through the device's FFT library and
are compared with a tolerance (see ``test_rfft_and_irfft_match_within_float32_rounding``).
"""

import numpy as np
import pytest
from _devices import device, params

from mpicomp.kernels import fft as K
from mpicomp.kernels.cpu import record
from mpicomp.kernels.cpu import rfft as cpu_rfft
from mpicomp.kernels.cuda import fft as cuda_fft
from mpicomp.kernels.readback import Later, batch


@pytest.fixture(scope="module", params=params())
def cu(request):
    return cuda_fft.launchers(device(request.param))


@pytest.fixture(scope="module")
def nb():
    return record().fft


def bits_of(a):
    return np.ascontiguousarray(a).view(np.uint32)


def spectrum(nbins, seed, ties=False):
    """Interleaved float32 spectrum (as uint32 bits) and its |X|^2; ``ties`` repeats magnitudes."""
    rng = np.random.default_rng(seed)
    if ties:
        parts = rng.integers(-3, 4, 2 * nbins).astype(np.float32)
    else:
        parts = (rng.standard_normal(2 * nbins) * 10.0 ** rng.integers(-6, 6, 2 * nbins)).astype(
            np.float32
        )
    parts[rng.random(2 * nbins) < 0.05] = 0.0
    re, im = parts[0::2], parts[1::2]
    return parts, (re * re + im * im).astype(np.float32)


def test_the_chunk_of_the_fp16_error_rule_is_the_twins():
    from mpicomp.kernels.cpu import fft as cpu_fft

    assert cuda_fft.FP16_CHUNK == cpu_fft._CHUNK
    assert cuda_fft._SUM_SPECTRA_MIN == cpu_rfft.BLOCKED_MIN
    assert cuda_fft._MIN_SIDE == cpu_rfft._MIN_SIDE


# ---------------------------------------------------------------- float16 rounding

SPECIALS = [
    0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x33000000, 0x33000001, 0x387FF000,
    0x387FFFFF, 0x38800000, 0x3F800FFF, 0x3F801000, 0x3F803000, 0x477FE000, 0x477FEFFF,
    0x477FF000, 0xC77FF000, 0x47800000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
    0x7FFFF000, 0x7FFFFFFF, 0xFFFFFFFF,
]  # fmt: skip


def fp16_inputs():
    rng = np.random.default_rng(1)
    finite = (rng.standard_normal(3000) * 10.0 ** rng.integers(-9, 4, 3000)).astype(np.float32)
    big = np.resize(finite, (1 << 16) + 37)
    nan_then_overflow = big.copy()
    nan_then_overflow[5] = np.uint32(0x7FFFFFFF).view(np.float32)  # r wraps below 65504
    nan_then_overflow[(1 << 16) + 3] = 70000.0  # overflow in the second chunk
    both_first_chunk = nan_then_overflow.copy()
    both_first_chunk[100] = 70000.0
    quiet_wrapped_nan = finite.copy()
    quiet_wrapped_nan[7] = np.uint32(0xFFFFFFFF).view(np.float32)
    return {
        "empty": np.zeros(0, np.float32),
        "one": np.float32([0.3]),
        "ragged": finite[:1001],
        "specials_ok": np.array(SPECIALS[:14], np.uint32).view(np.float32),
        "specials": np.array(SPECIALS, np.uint32).view(np.float32),
        "overflow": np.concatenate([finite[:50], np.float32([65520.0]), finite[:50]]),
        "inf_after_overflow": np.concatenate([np.float32([1e5]), np.float32([np.inf])]),
        "two_chunks": big,
        "nan_then_overflow": nan_then_overflow,
        "both_first_chunk": both_first_chunk,
        "quiet_wrapped_nan": quiet_wrapped_nan,
    }


@pytest.mark.parametrize("case", list(fp16_inputs()))
def test_round_fp16_matches_the_twin(cu, nb, case):
    x = bits_of(fp16_inputs()[case])
    want_out = np.zeros_like(x)
    got_out = np.full_like(x, 0xDEADBEEF)
    want = nb.round_fp16(x, want_out)
    got = cu.round_fp16(x, got_out)
    assert got == want
    assert got_out.tobytes() == want_out.tobytes()


# ---------------------------------------------------------------- transforms


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4097, 1 << 18])
def test_rfft_and_irfft_match_within_float32_rounding(cu, nb, n):
    """The transforms agree to ||dX|| <= 1e-6 * log2(n) * ||X|| (norm-wise relative error).

    A float32 FFT's error is a few units of float32 rounding (2**-24 ~ 6e-8) per butterfly
    stage, growing like log2(n) in the worst case (about sqrt(log2(n)) on average), so two
    correct float32 FFTs (cuFFT or pocketfft vs numba's blocked scipy transform from 2**18
    on) differ by at most ~1e-6 * log2(n) relative to the spectrum's norm; below 2**18
    both are numpy.fft here and agree exactly. |X|^2 and the finiteness flag follow.
    """
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    tol = 1e-6 * max(1.0, np.log2(n))
    ws, wm, wok = nb.rfft(x.copy(), True)
    gs, gm, gok = cu.rfft(x.copy(), True)
    assert gs.dtype == np.float32 and gm.dtype == np.float32 and gs.shape == ws.shape
    assert gok is True and wok is True
    assert np.linalg.norm(gs - ws) <= tol * np.linalg.norm(ws)
    assert np.linalg.norm(gm - wm) <= 2 * tol * np.linalg.norm(wm)
    if n < cpu_rfft.BLOCKED_MIN:
        assert gs.tobytes() == ws.tobytes() and gm.tobytes() == wm.tobytes()
    wx, gx = nb.irfft(ws, n), cu.irfft(ws, n)
    assert gx.dtype == np.float32 and gx.shape == (n,)
    assert np.linalg.norm(gx - wx) <= tol * np.linalg.norm(wx)
    assert np.linalg.norm(gx - x) <= tol * np.linalg.norm(x)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e38])
def test_rfft_reports_nonfinite_spectra(cu, nb, bad):
    x = np.ones(64, np.float32)
    x[3] = bad  # 3e38 twice: the sum overflows float32
    x[4] = 3e38 if bad == 3e38 else 1.0
    assert cu.rfft(x.copy(), True)[2] is nb.rfft(x.copy(), True)[2] is False


@pytest.mark.parametrize("n", [0, 1, 1000, 1 << 18, (1 << 18) + 1, (1 << 18) + 2, 1 << 20, 1 << 19])
def test_sum_spectra_answers_as_the_twin(cu, nb, n):
    assert cu.sum_spectra(n) is nb.sum_spectra(n)


def test_sum_spectra_of_a_prime_half(cu, nb):
    n = 2 * 262147  # 262147 is prime: no blocked plan
    assert cu.sum_spectra(n) is nb.sum_spectra(n) is False


@pytest.mark.parametrize(
    "x",
    [
        np.zeros(0, np.float32),
        np.ones(777, np.float32),
        np.float32([1.0, np.nan, 2.0]),
        np.float32([np.inf] + [0.0] * 500),
        np.float32([0.0] * 500 + [-np.inf]),
        np.array([0x7F800001], np.uint32).view(np.float32),
        np.float32([3.4e38, -3.4e38]),
    ],
)
def test_all_finite_matches_the_twin(cu, nb, x):
    assert cu.all_finite(x) is bool(nb.all_finite(x))


# ---------------------------------------------------------------- residual addition


@pytest.mark.parametrize("n", [1, 2, 3, 8, 999, 1000, 4099])
@pytest.mark.parametrize("overflow", [False, True])
def test_add_residual_matches_the_twin(cu, nb, n, overflow):
    rng = np.random.default_rng(n)
    nbins = n // 2 + 1
    spec = rng.standard_normal(2 * nbins).astype(np.float32)
    spec[1] = -0.0  # + 0.0f makes it +0.0, as the twin's
    r = rng.standard_normal(n).astype(np.float32)
    if overflow:
        spec[-2] = 3e38
        r[-1] = 3e38
    want_spec, got_spec = spec.copy(), spec.copy()
    want_mag, got_mag = np.zeros(nbins, np.float32), np.zeros(nbins, np.float32)
    want = nb.add_residual(want_spec, r, want_mag)
    got = cu.add_residual(got_spec, r, got_mag)
    assert got is bool(want)
    assert got_spec.tobytes() == want_spec.tobytes()
    assert got_mag.tobytes() == want_mag.tobytes()


# ---------------------------------------------------------------- selection


def mag2_cases():
    rng = np.random.default_rng(5)
    mixed = rng.standard_normal(3001).astype(np.float32) ** 2
    ties = rng.integers(0, 5, 2500).astype(np.float32)
    # Many values share their top 16 bits: the second level decides.
    close = (np.float32(1.5) + rng.integers(0, 40, 1500) * np.float32(2**-22)).astype(np.float32)
    wide = np.abs(rng.standard_normal(1200) * 10.0 ** rng.integers(-30, 30, 1200)).astype(
        np.float32
    )
    wide[:3] = [0.0, np.inf, 1e-40]  # zero, overflowed |X|^2, a denormal
    return {
        "one": np.float32([2.0]),
        "five": np.float32([3.0, 1.0, 3.0, 0.0, 2.0]),
        "mixed": mixed,
        "ties": ties,
        "close": close,
        "wide": wide,
        "zeros": np.zeros(700, np.float32),
    }


@pytest.mark.parametrize("case", list(mag2_cases()))
def test_kth_largest_matches_the_twin(cu, nb, case):
    mag2 = mag2_cases()[case]
    n = mag2.size
    for k in sorted(k for k in {1, 2, n // 3, n // 2, n - 1, n} if 1 <= k <= n):
        want = np.float32(nb.kth_largest(mag2, k))
        got = np.float32(cu.kth_largest(mag2, k))
        assert got.tobytes() == want.tobytes(), k


def test_kth_largest_refuses_k_out_of_range(cu):
    with pytest.raises(ValueError, match="k must lie"):
        cu.kth_largest(np.ones(4, np.float32), 5)


def select_both(cu, nb, parts, mag2, k, thresh, hist0=None):
    """Run select_pack on both; return both (bitmap, dense, hist, vmax)."""
    nbins = mag2.size
    out = []
    for fk in (nb, cu):
        bitmap = np.full((nbins + 7) // 8, 0xAB, np.uint8)
        dense = np.full(2 * k, 0xDEADBEEF, np.uint32)
        hist = np.zeros(256, np.int64) if hist0 is None else hist0.copy()
        vmax = fk.select_pack(bits_of(parts), mag2, np.float32(thresh), k, bitmap, dense, hist)
        out.append((bitmap, dense, hist, int(vmax)))
    return out


@pytest.mark.parametrize("nbins", [1, 2, 9, 100, 4096, 2 * 4096 + 13])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("frac", [0.0, 0.15, 1.0])
def test_select_pack_matches_the_twin(cu, nb, nbins, ties, frac):
    parts, mag2 = spectrum(nbins, nbins, ties)
    k = max(1, int(np.ceil(frac * nbins)))
    thresh = np.float32(-np.inf) if k == nbins else nb.kth_largest(mag2, k)
    hist0 = np.arange(256, dtype=np.int64)  # the launcher adds into the caller's counts
    (wb, wd, wh, wv), (gb, gd, gh, gv) = select_both(cu, nb, parts, mag2, k, thresh, hist0)
    assert gv == wv
    assert gb.tobytes() == wb.tobytes()
    assert gd.tobytes() == wd.tobytes()
    assert gh.tobytes() == wh.tobytes()


def test_select_pack_of_no_bins(cu, nb):
    empty = np.zeros(0, np.float32)
    args = (np.zeros(0, np.uint32), empty, np.float32(0), 0, np.zeros(0, np.uint8))
    hist = np.zeros(256, np.int64)
    assert cu.select_pack(*args, np.zeros(0, np.uint32), hist) == 0
    assert nb.select_pack(*args, np.zeros(0, np.uint32), hist) == 0


# ---------------------------------------------------------------- range-based N-bit floats

WIDTHS = [2, 3, 4, 5, 7, 8, 10, 11, 13, 16, 20, 24]


def kept_parts(seed, n, scale_exp=(-8, 8)):
    """Random float32 bits with zeros, signs, several binades and a denormal."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(n) * 10.0 ** rng.integers(*scale_exp, n)).astype(np.float32)
    v[rng.random(n) < 0.1] = 0.0
    if n > 3:
        v[1] = -0.0
        v[2] = np.float32(1e-41)
    return bits_of(v)


@pytest.mark.parametrize("bits", WIDTHS)
def test_choose_range_matches_the_twin(cu, nb, bits):
    for seed, n in [(1, 1), (2, 17), (3, 3000)]:
        v = kept_parts(seed, n).astype(np.int64) & 0x7FFFFFFF
        hist = np.bincount(v[v != 0] >> 23, minlength=256).astype(np.int64)
        vmax = int(v.max())
        assert cu.choose_range(hist, vmax, bits) == tuple(
            map(int, nb.choose_range(hist, vmax, bits))
        )
    zero = np.zeros(256, np.int64)
    assert cu.choose_range(zero, 0, bits) == tuple(map(int, nb.choose_range(zero, 0, bits)))


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("n", [1, 9, 1001])
def test_quantize_and_unpack_match_the_twin(cu, nb, bits, n):
    values = kept_parts(bits * 1000 + n, n)
    a = values.astype(np.int64) & 0x7FFFFFFF
    vmax = int(a.max())
    m, pbase = nb.choose_range(np.bincount(a[a != 0] >> 23, minlength=256), vmax, bits)
    shift = K.MAX_MANTISSA - m
    for vm, pb in [(vmax, pbase), (vmax // 3, max(1, pbase - 5))]:  # also clamping
        size = (n * bits + 7) // 8
        want, got = np.zeros(size, np.uint8), np.full(size, 0xAB, np.uint8)
        nb.quantize_pack(values, vm, pb, shift, bits, want)
        cu.quantize_pack(values, vm, pb, shift, bits, got)
        assert got.tobytes() == want.tobytes()
        wout, gout = np.zeros(n, np.uint32), np.full(n, 0xDEADBEEF, np.uint32)
        assert cu.unpack_dequantize(want, pb, shift, bits, gout) == nb.unpack_dequantize(
            want, pb, shift, bits, wout
        )
        assert gout.tobytes() == wout.tobytes()


def test_the_encoders_steps_keep_their_values_on_the_device_in_a_batch(cu, nb):
    # In a readback.batch kth_largest, select_pack and choose_range return Laters; the
    # next launcher reads their values on the device: one read at the end, the twin's bytes.
    nbins, k, bits = 2 * 4096 + 13, 1234, 10
    parts, mag2 = spectrum(nbins, 3)
    size = (2 * k * bits + 7) // 8
    out = []
    for fk in (nb, cu):
        bitmap, dense = np.zeros((nbins + 7) // 8, np.uint8), np.zeros(2 * k, np.uint32)
        hist, codes = np.zeros(256, np.int64), np.zeros(size, np.uint8)
        with batch("steps"):
            thresh = fk.kth_largest(mag2, k)
            thresh = thresh if isinstance(thresh, Later) else np.float32(thresh)
            vmax = fk.select_pack(bits_of(parts), mag2, thresh, k, bitmap, dense, hist)
            rng = fk.choose_range(hist, vmax, bits)
            m, pbase = (rng.array[0:1], rng.array[1:2]) if fk is cu else rng
            fk.quantize_pack(dense, vmax, pbase, K.MAX_MANTISSA - m, bits, codes)
        if fk is cu:
            assert all(isinstance(v, Later) for v in (thresh, vmax, rng))
            thresh, vmax, rng = thresh.value, vmax.value, rng.value
        out.append((float(thresh), int(vmax), tuple(map(int, rng)), bitmap, dense, codes))
    want, got = out
    assert got[:3] == want[:3]
    for g, w in zip(got[3:], want[3:], strict=True):
        assert g.tobytes() == w.tobytes()


def test_unpack_and_scatter_take_their_parameters_from_the_device(cu, nb):
    # A decoder that leaves a payload's fields on the device: pbase, shift, bits, k and
    # the code count as 1-element arrays, the output sized for every bin.
    nbins, k, bits, pbase, shift = 100, 7, 6, 3, 20
    rng = np.random.default_rng(5)
    stream = rng.integers(0, 256, (2 * k * bits + 7) // 8, dtype=np.uint8)
    stream[-1] &= (1 << ((2 * k * bits) % 8 or 8)) - 1
    want = np.zeros(2 * k, np.uint32)
    code = nb.unpack_dequantize(stream, pbase, shift, bits, want)
    got = np.full(2 * nbins, 0xDEADBEEF, np.uint32)
    one = [np.array([v], np.int64) for v in (pbase, shift, bits, 2 * k)]
    assert cu.unpack_dequantize(stream, *one[:3], got, count=one[3]) == code
    assert got[: 2 * k].tobytes() == want.tobytes()
    host = np.full(2 * nbins, 0xDEADBEEF, np.uint32)  # the twin takes the count too
    assert nb.unpack_dequantize(stream, pbase, shift, bits, host, count=one[3]) == code
    assert host.tobytes() == got.tobytes()  # the codes, and nothing past them
    bitmap = np.packbits(np.arange(nbins) % 13 < 1, bitorder="little")
    kk = int(np.unpackbits(bitmap, bitorder="little")[:nbins].sum())
    dense = rng.standard_normal(2 * nbins).astype(np.float32)
    wspec, gspec = np.zeros(2 * nbins, np.float32), np.zeros(2 * nbins, np.float32)
    packed = np.concatenate([dense[:kk], dense[nbins : nbins + kk]])
    assert nb.scatter(bitmap, packed, kk, wspec) == K.DECODE_OK
    dense[kk : 2 * kk] = dense[nbins : nbins + kk]
    assert cu.scatter(bitmap, dense, np.array([kk], np.int64), gspec) == K.DECODE_OK
    assert gspec.tobytes() == wspec.tobytes()
    # k beyond the bins is a count error, not a read past them.
    big = np.array([1 << 40], np.int64)
    assert cu.scatter(bitmap, dense, big, np.zeros(2 * nbins, np.float32)) == K.DECODE_COUNT


@pytest.mark.parametrize("bits", [4, 5, 10, 16])
@pytest.mark.parametrize("seed", range(4))
def test_unpack_of_any_bytes_matches_the_twin(cu, nb, bits, seed):
    """Random streams: negative zeros, overflowing codes and padding, the first error wins."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    stream = rng.integers(0, 256, (n * bits + 7) // 8, dtype=np.uint8)
    if seed == 0:  # only padding wrong: every code valid
        stream[:] = 0
        if (n * bits) % 8:
            stream[-1] = 0x80
    for pbase, shift in [(1, 0), (0xFF000 >> 3, 3), (0x7F7FF >> 0, 0), (255 << 10, 13)]:
        wout, gout = np.zeros(n, np.uint32), np.full(n, 7, np.uint32)
        want = nb.unpack_dequantize(stream, pbase, shift, bits, wout)
        got = cu.unpack_dequantize(stream, pbase, shift, bits, gout)
        assert got == want
        assert gout.tobytes() == wout.tobytes()


def test_unpack_of_no_codes(cu, nb):
    out = np.zeros(0, np.uint32)
    stream = np.zeros(0, np.uint8)
    assert cu.unpack_dequantize(stream, 1, 0, 10, out) == nb.unpack_dequantize(
        stream, 1, 0, 10, out
    )


def test_widths_out_of_range_are_refused(cu):
    with pytest.raises(ValueError, match="bits must lie"):
        cu.quantize_pack(np.zeros(8, np.uint32), 0, 1, 0, 0, np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match="shift"):
        cu.residual(
            np.zeros(4, np.float32), np.zeros(1, np.uint8), 0, 1, 24, 8, np.zeros(2, np.float32)
        )


# ---------------------------------------------------------------- scatter and residual


@pytest.mark.parametrize("nbins", [1, 8, 9, 100, 2 * 4096 + 13])
@pytest.mark.parametrize("frac", [0.0, 0.3, 1.0])
def test_scatter_matches_the_twin(cu, nb, nbins, frac):
    rng = np.random.default_rng(nbins)
    keep = rng.random(nbins) < frac
    k = int(keep.sum())
    bitmap = np.packbits(keep, bitorder="little")
    dense = rng.standard_normal(2 * k).astype(np.float32)
    base = rng.standard_normal(2 * nbins).astype(np.float32)
    for spec0 in (np.zeros(2 * nbins, np.float32), base):
        want, got = spec0.copy(), spec0.copy()
        assert cu.scatter(bitmap, dense, k, got) == nb.scatter(bitmap, dense, k, want)
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("nbins", [9, 100, 4096 + 5])
def test_scatter_refuses_bad_bitmaps_as_the_twin(cu, nb, nbins):
    rng = np.random.default_rng(3)
    keep = rng.random(nbins) < 0.5
    k = int(keep.sum())
    bitmap = np.packbits(keep, bitorder="little")
    padded = bitmap.copy()
    padded[-1] |= 0x80  # a bit past the last bin (nbins % 8 != 0)
    dense = rng.standard_normal(2 * k + 2).astype(np.float32)
    spec0 = rng.standard_normal(2 * nbins).astype(np.float32)
    for bm, kk in [(bitmap, k + 1), (bitmap, k - 1), (padded, k), (padded, k + 1)]:
        want, got = spec0.copy(), spec0.copy()
        code = nb.scatter(bm, dense, kk, want)
        assert code != K.DECODE_OK
        assert cu.scatter(bm, dense, kk, got) == code
        assert got.tobytes() == want.tobytes() == spec0.tobytes()


def test_scatter_of_no_bins(cu, nb):
    e8, e32 = np.zeros(0, np.uint8), np.zeros(0, np.float32)
    assert cu.scatter(e8, e32, 0, e32.copy()) == nb.scatter(e8, e32, 0, e32.copy())


@pytest.mark.parametrize("n", [1, 2, 3, 16, 1001, 2 * 4096 + 30])
@pytest.mark.parametrize("bits", [4, 10, 16])
def test_residual_matches_the_twin(cu, nb, n, bits):
    nbins = n // 2 + 1
    parts, mag2 = spectrum(nbins, n + bits)
    k = max(1, nbins // 5)
    thresh = nb.kth_largest(mag2, k)
    bitmap = np.zeros((nbins + 7) // 8, np.uint8)
    dense = np.zeros(2 * k, np.uint32)
    hist = np.zeros(256, np.int64)
    vmax = nb.select_pack(bits_of(parts), mag2, np.float32(thresh), k, bitmap, dense, hist)
    m, pbase = nb.choose_range(hist, vmax, bits)
    shift = K.MAX_MANTISSA - m
    want, got = np.zeros(n, np.float32), np.full(n, np.nan, np.float32)
    nb.residual(parts, bitmap, vmax, pbase, shift, bits, want)
    cu.residual(parts, bitmap, vmax, pbase, shift, bits, got)
    assert got.tobytes() == want.tobytes()


# ---------------------------------------------------------------- the encoder's sequence


@pytest.mark.parametrize("n", [5, 1000, 3 * 4096 + 7])
def test_the_encoders_launch_sequence_gives_the_twins_bytes(cu, nb, n):
    """round_fp16, rfft, add_residual, kth_largest, select_pack, choose_range, quantize_pack,
    residual, then unpack and scatter, as the codec calls them."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    r0 = (rng.standard_normal(n) * 0.1).astype(np.float32)
    outs = []
    for fk in (nb, cu):
        rounded = np.empty(n, np.float32)
        assert fk.round_fp16(bits_of(x), rounded.view(np.uint32)) == K.FP16_OK
        spec, mag2, ok = fk.rfft(rounded, True)
        r = r0.copy()
        assert ok and fk.add_residual(spec, r, mag2)
        nbins, kept = n // 2 + 1, max(1, (n // 2 + 1) // 7)
        thresh = fk.kth_largest(mag2, kept)
        bitmap = np.zeros((nbins + 7) // 8, np.uint8)
        dense = np.zeros(2 * kept, np.uint32)
        hist = np.zeros(256, np.int64)
        vmax = fk.select_pack(
            spec.view(np.uint32), mag2, np.float32(thresh), kept, bitmap, dense, hist
        )
        m, pbase = fk.choose_range(hist, vmax, 10)
        codes = np.zeros((2 * kept * 10 + 7) // 8, np.uint8)
        fk.quantize_pack(dense, vmax, pbase, 23 - m, 10, codes)
        fk.residual(spec, bitmap, vmax, pbase, 23 - m, 10, r)
        decoded = np.zeros(2 * kept, np.float32)
        assert fk.unpack_dequantize(codes, pbase, 23 - m, 10, decoded.view(np.uint32)) == 0
        out_spec = np.zeros(2 * nbins, np.float32)
        assert fk.scatter(bitmap, decoded, kept, out_spec) == 0
        outs.append([rounded, spec, mag2, bitmap, dense, hist, codes, r, out_spec, (m, pbase)])
    for want, got in zip(*outs, strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_select_pack_compares_denormal_magnitudes_as_the_twin(cu, nb):
    """|X|^2 may be denormal: compared on bits, not by a flush-to-zero float compare."""
    mag2 = np.float32([1e-40, 0.0, 2e-40, 1e-40, 0.0, 3.0, 1e-40, 2e-45, 0.0])
    parts = bits_of(np.arange(1, 2 * mag2.size + 1, dtype=np.float32)).view(np.float32)
    for k in range(1, mag2.size + 1):
        thresh = nb.kth_largest(mag2, k)
        assert np.float32(cu.kth_largest(mag2, k)).tobytes() == np.float32(thresh).tobytes()
        (wb, wd, wh, wv), (gb, gd, gh, gv) = select_both(cu, nb, parts, mag2, k, thresh)
        assert (gb.tobytes(), gd.tobytes(), gh.tobytes(), gv) == (
            wb.tobytes(), wd.tobytes(), wh.tobytes(), wv,
        )  # fmt: skip
