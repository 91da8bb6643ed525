"""fft codec (the FFT sparsification paper) against a plain NumPy reference written from
the paper and the docs."""

import math
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpicomp
from conftest import gradient_like
from mpicomp.codecs import _wire
from mpicomp.codecs.feedback import ErrorFeedback
from mpicomp.kernels.readback import batch

# ---------------------------------------------------------------- reference


def ref_kept(n, theta):
    """Number of kept frequencies: ceil((1 - theta) * (n//2 + 1)), as written, in double."""
    nbins = n // 2 + 1 if n else 0
    return nbins, min(nbins, math.ceil((1.0 - theta) * nbins))


def ref_choose_range(vals_bits, bits):
    """(m, pbase): the largest code covers max|v|; m minimizes the per-binade error bound."""
    a = vals_bits.astype(np.int64) & 0x7FFFFFFF
    vmax = int(a.max()) if a.size else 0
    hist = np.bincount(a[a != 0] >> 23, minlength=256)
    q = 2 ** (bits - 1) - 1
    best = None
    for m in range(23, -1, -1):
        s = 23 - m
        pbase = max(1, (vmax >> s) - q + 1)
        eps = np.array([pbase << s], np.uint32).view(np.float32)[0]
        ee = (pbase << s) >> 23
        err = 0.0
        for e in range(256):
            c = int(hist[e])
            if c == 0:
                continue
            if e > ee:
                b2 = 2.0 ** (2 * (e - 127 - m))
            elif e == ee:
                b2 = float(eps) ** 2
            else:
                b2 = 2.0 ** (2 * (e - 126))
            err += float(c) * b2
        if best is None or err < best[0]:
            best = (err, m, pbase)
    return best[1], best[2], vmax


def ref_pack_bits(codes, width):
    """Pack codes LSB-first: code i takes stream bits [i*width, (i+1)*width)."""
    codes = np.asarray(codes, dtype=np.int64)
    bit_matrix = (codes[:, None] >> np.arange(width)) & 1
    return np.packbits(bit_matrix.astype(np.uint8).ravel(), bitorder="little")


def ref_unpack_bits(stream, count, width):
    bits_ = np.unpackbits(stream, bitorder="little")[: count * width].astype(np.int64)
    return (bits_.reshape(count, width) << np.arange(width)).sum(axis=1)


def ref_encode_body(x, theta=0.85, bits=10, fp16=True):
    """The body the docs specify, built step by step with NumPy."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    n = flat.size
    nbins, k = ref_kept(n, theta)
    if n == 0:
        return struct.pack("<IBBHQ", 1, 23, bits, 0, 0)
    if fp16:
        flat = flat.astype(np.float16).astype(np.float32)
    X = np.fft.rfft(flat).astype(np.complex64)
    re, im = X.real.copy(), X.imag.copy()
    mag2 = re * re + im * im
    kept = np.sort(np.argsort(-mag2, kind="stable")[:k])  # ties: lower index first
    mask = np.zeros(nbins, dtype=np.uint8)
    mask[kept] = 1
    bitmap = np.packbits(mask, bitorder="little")
    vals = np.concatenate([re[kept], im[kept]]).astype(np.float32).view(np.uint32)
    m, pbase, vmax = ref_choose_range(vals, bits)
    s = 23 - m
    a = np.minimum(vals.astype(np.int64) & 0x7FFFFFFF, vmax)
    top = a >> s
    mag = np.where(top >= pbase, top - pbase + 1, 0)
    sign = vals.astype(np.int64) >> 31
    codes = np.where(mag > 0, (sign << (bits - 1)) | mag, 0)
    head = struct.pack("<IBBHQ", pbase << s, m, bits, 0, k)
    return head + bitmap.tobytes() + ref_pack_bits(codes, bits).tobytes()


def ref_decode_body(body, n):
    """Decode a body by the docs: codes -> floats -> scattered spectrum -> irfft."""
    eps_bits, m, bits, _, k = struct.unpack_from("<IBBHQ", body, 0)
    nbins = n // 2 + 1 if n else 0
    if n == 0:
        return np.zeros(0, np.float32)
    s = 23 - m
    pbase = eps_bits >> s
    b = np.frombuffer(body, np.uint8)
    bitmap = b[16 : 16 + (nbins + 7) // 8]
    codes = ref_unpack_bits(b[16 + bitmap.size :], 2 * k, bits)
    mag = codes & (2 ** (bits - 1) - 1)
    sign = codes >> (bits - 1)
    pattern = np.where(mag > 0, (mag + pbase - 1) << s, 0) | (sign << 31)
    vals = pattern.astype(np.uint32).view(np.float32)
    kept = np.flatnonzero(np.unpackbits(bitmap, bitorder="little")[:nbins])
    spec = np.zeros(nbins, np.complex64)
    spec.real[kept] = vals[:k]
    spec.imag[kept] = vals[k:]
    return np.fft.irfft(spec, n=n).astype(np.float32)


def ref_topk(x, theta):
    """Plain top-k: keep the ceil((1-theta)*n) largest |x|, zero the rest."""
    k = math.ceil((1.0 - theta) * x.size)
    out = np.zeros_like(x)
    idx = np.argsort(-np.abs(x), kind="stable")[:k]
    out[idx] = x[idx]
    return out


def body_of(payload, ndim=1):
    return payload[_wire.header_size(ndim) :]


def roundtrip(x, **params):
    c = mpicomp.codec("fft", **params)
    return c.decode(c.encode(x))


def rel_err(y, x):
    return float(np.linalg.norm(y - x) / np.linalg.norm(x))


def smooth_signal(n, seed):
    """A smooth gradient-like signal: a random walk plus a few slow oscillations."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, n)
    walk = np.cumsum(rng.standard_normal(n)) / np.sqrt(n)
    waves = sum(rng.standard_normal() * np.sin(2 * np.pi * f * t) for f in (1, 3, 7))
    return (1e-3 * (walk + waves)).astype(np.float32)


# ---------------------------------------------------------------- bytes and values


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 9, 16, 17, 100, 1001, 4099])
@pytest.mark.parametrize("theta,bits,fp16", [(0.85, 10, True), (0.0, 16, False), (0.5, 4, True)])
def test_bytes_and_values_match_reference(n, theta, bits, fp16):
    x = gradient_like(n, seed=n + 7)
    c = mpicomp.codec("fft", theta=theta, bits=bits, fp16=fp16)
    p = c.encode(x)
    expected = ref_encode_body(x, theta, bits, fp16)
    assert body_of(p).tobytes() == expected
    y = c.decode(p)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_array_equal(y, ref_decode_body(expected, n))


@given(
    n=st.integers(0, 10**5),
    seed=st.integers(0, 2**32 - 1),
    theta=st.floats(0.0, 0.999),
    bits=st.integers(4, 16),
    fp16=st.booleans(),
)
def test_property_bytes_size_and_roundtrip(n, seed, theta, bits, fp16):
    x = gradient_like(n, seed=seed)
    c = mpicomp.codec("fft", theta=theta, bits=bits, fp16=fp16)
    p = c.encode(x)
    nbins, k = ref_kept(n, theta)
    assert c.kept(n) == k
    assert p.size == 16 + 8 + 16 + (nbins + 7) // 8 + (2 * k * bits + 7) // 8
    expected = ref_encode_body(x, theta, bits, fp16)
    assert body_of(p).tobytes() == expected
    y = c.decode(p)
    assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_array_equal(y, ref_decode_body(expected, n))


@pytest.mark.parametrize("theta", [0.0, 0.3, 0.85, 0.9, 0.99])
@pytest.mark.parametrize("n", [1, 2, 14, 15, 16, 17, 1000, 12345])
def test_body_size_formula(n, theta):
    for bits in (4, 10, 13, 16):
        p = mpicomp.codec("fft", theta=theta, bits=bits).encode(gradient_like(n, seed=1))
        nbins = n // 2 + 1
        k = min(nbins, math.ceil((1.0 - theta) * nbins))
        assert p.size == 24 + 16 + math.ceil(nbins / 8) + math.ceil(2 * k * bits / 8)
        assert int(body_of(p)[8:16].view("<u8")[0]) == k


# ---------------------------------------------------------------- paper properties


@pytest.mark.parametrize("theta", [0.5, 0.85, 0.95])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fft_beats_topk_on_smooth_signals(theta, seed):
    x = smooth_signal(8192, seed)
    y = roundtrip(x, theta=theta)
    e_fft, e_topk = rel_err(y, x), rel_err(ref_topk(x, theta), x)
    assert e_fft < e_topk, (e_fft, e_topk)


@pytest.mark.parametrize("bits", [4, 6, 10, 16])
def test_nbit_float_relative_error_and_coverage(bits):
    # Decode the codes with the reference decoder and compare with the kept spectrum
    # values: truncation to m mantissa bits (relative error < 2**-m) from eps up to max,
    # zero below eps, the sign kept, and the largest magnitude code used for max|v|.
    x = gradient_like(20000, seed=bits)
    c = mpicomp.codec("fft", theta=0.7, bits=bits, fp16=False)
    body = body_of(c.encode(x))
    eps_bits, m, _, _, k = struct.unpack_from("<IBBHQ", body.tobytes(), 0)
    s = 23 - m
    eps = np.array([eps_bits], np.uint32).view(np.float32)[0]
    X = np.fft.rfft(x).astype(np.complex64)
    nbins = X.size
    kept = np.flatnonzero(np.unpackbits(body[16 : 16 + (nbins + 7) // 8], bitorder="little"))
    v = np.concatenate([X.real[kept], X.imag[kept]])
    codes = ref_unpack_bits(body[16 + (nbins + 7) // 8 :], 2 * k, bits)
    mag = codes & (2 ** (bits - 1) - 1)
    pattern = np.where(mag > 0, (mag + (eps_bits >> s) - 1) << s, 0) | ((codes >> (bits - 1)) << 31)
    d = pattern.astype(np.uint32).view(np.float32)
    above = np.abs(v) >= eps
    assert above.mean() > 0.5  # most values lie in the covered range
    rel = np.abs(d[above] - v[above]) / np.abs(v[above])
    assert rel.max() < 2.0**-m
    assert np.all(np.abs(d) <= np.abs(v))  # truncation never grows a magnitude
    assert np.all(np.sign(d[above]) == np.sign(v[above]))
    assert np.all(d[~above] == 0)
    big = np.argmax(np.abs(v))
    assert mag[big] == 2 ** (bits - 1) - 1
    assert abs(d[big]) > abs(v[big]) * (1 - 2.0**-m)


@pytest.mark.parametrize("fp16", [True, False])
def test_theta_zero_sixteen_bits_reconstructs_closely(fp16):
    x = gradient_like(50000, seed=3)
    c = mpicomp.codec("fft", theta=0.0, bits=16, fp16=fp16)
    y = c.decode(c.encode(x))
    assert rel_err(y, x) < 1e-3
    assert np.abs(y - x).max() < 1e-3 * np.abs(x).max()


def test_error_shrinks_with_bits_and_with_theta():
    x = smooth_signal(4096, 5)
    errs = [rel_err(roundtrip(x, theta=0.85, bits=b), x) for b in (4, 8, 16)]
    assert errs[0] > errs[1] > errs[2]
    errs = [rel_err(roundtrip(x, theta=t, bits=16, fp16=False), x) for t in (0.99, 0.9, 0.5)]
    assert errs[0] > errs[1] > errs[2]


@pytest.mark.parametrize("shape", [(), (0,), (1,), (2,), (3,), (0, 4), (3, 5), (2, 3, 4)])
def test_small_and_shaped_inputs_round_trip(shape):
    x = (gradient_like(math.prod(shape), seed=4) * np.float32(1000)).reshape(shape)
    c = mpicomp.codec("fft", theta=0.0, bits=16)
    y = c.decode(c.encode(x))
    assert y.shape == shape and y.dtype == np.float32
    scale = float(np.abs(x).max()) if x.size else 0.0
    np.testing.assert_allclose(y, x.astype(np.float16).astype(np.float32), atol=2e-3 * scale)


def test_ties_keep_the_lowest_frequencies():
    # A unit impulse has a flat spectrum: every bin ties, the lowest k are kept.
    x = np.zeros(64, np.float32)
    x[0] = 1.0
    c = mpicomp.codec("fft", theta=0.75, bits=8)
    body = body_of(c.encode(x))
    k = c.kept(64)
    mask = np.unpackbits(body[16 : 16 + 5], bitorder="little")[:33]
    np.testing.assert_array_equal(mask, np.arange(33) < k)


def test_other_dtypes_are_converted_once():
    c = mpicomp.codec("fft", fp16=False)
    x = gradient_like(999, seed=6)
    for dt in (np.float16, np.float64):
        p = c.encode(x.astype(dt))
        assert body_of(p).tobytes() == ref_encode_body(x.astype(dt), fp16=False)
    with pytest.raises(TypeError, match="floating-point"):
        c.encode(np.arange(8))


def test_fp16_rounding_matches_numpy_and_refuses_overflow():
    from mpicomp.kernels.cpu import fft as k

    rng = np.random.default_rng(8)
    x = np.concatenate(
        [
            rng.standard_normal(50000).astype(np.float32)
            * np.float32(10) ** rng.integers(-9, 5, 50000),
            np.arange(0, 0x38900000, 4099, dtype=np.uint32).view(np.float32),  # fp16 subnormals
            np.array([65504, 65519.99, -65519, 2.0**-25, 3 * 2.0**-26, -0.0], np.float32),
        ]
    ).astype(np.float32)
    out = np.empty_like(x)
    assert k.mpicomp_fft_round_fp16(x.view(np.uint32), out.view(np.uint32)) == k.FP16_OK
    np.testing.assert_array_equal(
        out.view(np.uint32), x.astype(np.float16).astype(np.float32).view(np.uint32)
    )
    with pytest.raises(ValueError, match="overflows float16"):
        mpicomp.codec("fft").encode(np.array([1.0, 65520.0], np.float32))
    y = roundtrip(np.array([1.0, 1e6], np.float32), theta=0.0, bits=16, fp16=False)
    np.testing.assert_allclose(y, [1.0, 1e6], atol=1e3)  # fp16=False takes it


@pytest.mark.parametrize("fp16", [True, False])
# NaN, +-Inf, and NaNs whose float16 rounding wraps past bit 31 (once taken for +-0).
@pytest.mark.parametrize("bad", [0x7FC00000, 0x7F800000, 0xFF800000, 0x7FFFF000, 0xFFFFFFFF])
def test_nan_and_inf_are_refused(fp16, bad):
    x = gradient_like(1000, seed=9)
    x.view(np.uint32)[123] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        mpicomp.codec("fft", fp16=fp16).encode(x)


def unfused(codec):
    """Return ``codec`` with fused feedback off: ErrorFeedback then subtracts decode()."""
    codec.fused_feedback = False  # an instance attribute hides the class's True
    return codec


def unpack_residual(r, n):
    """Return the interleaved half spectrum of a packed fft residual (see FFTCodec.encode)."""
    spec = np.zeros(2 * (n // 2 + 1), np.float32)
    spec[0] = r[0]
    spec[2 : n + 1] = r[1:]
    return spec


def test_works_with_error_feedback():
    c = mpicomp.codec("fft", theta=0.9)
    assert c.fused_feedback
    ef = ErrorFeedback(c)
    x = gradient_like(5000, seed=10)
    p = ef.encode(x, "w")
    np.testing.assert_array_equal(p, c.encode(x))  # the first step sends what encode() does
    # The residual is the spectrum's part the payload missed: back in time, x - decode.
    back = np.fft.irfft(unpack_residual(ef.residual("w"), x.size).view(np.complex64), n=x.size)
    x16 = x.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(back, x16 - c.decode(p), rtol=0, atol=1e-6 * np.abs(x).max())
    p2 = ef.encode(x, "w")
    # Two steps of feedback carry more of 2x than two independent compressions.
    assert rel_err(c.decode(p) + c.decode(p2), 2 * x) < rel_err(2 * c.decode(c.encode(x)), 2 * x)


@pytest.mark.parametrize("fp16", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 1001, 5000, 1 << 18, (1 << 18) + 2])
def test_fused_feedback_transmits_the_cumulative_signal(n, fp16):
    # Sum of decoded payloads + final residual transformed back == sum of the inputs
    # (with fp16, of the rounded inputs: the rounding of x is not fed back).
    c = mpicomp.codec("fft", theta=0.9, fp16=fp16)
    ef = ErrorFeedback(c)
    sent = np.zeros(n, np.float64)
    total = np.zeros(n, np.float64)
    for step in range(4):
        x = gradient_like(n, seed=step)
        total += x.astype(np.float16).astype(np.float32) if fp16 else x
        sent += c.decode(ef.encode(x, "w"))
    back = np.fft.irfft(unpack_residual(ef.residual("w"), n).astype(np.float64).view(complex), n=n)
    assert np.abs(sent + back - total).max() < 1e-6 * np.abs(total).max()


@pytest.mark.parametrize("n", [1000, 5001, 1 << 18])
def test_fused_feedback_payloads_match_the_unfused_ones(n):
    # Without float16 rounding both feed back the same error (by linearity); only float
    # rounding differs, so the first payload is identical and later ones decode alike.
    fused, plain = (mpicomp.codec("fft", theta=0.9, fp16=False) for _ in range(2))
    ef_fused, ef_plain = ErrorFeedback(fused), ErrorFeedback(unfused(plain))
    for step in range(5):
        x = gradient_like(n, seed=step)
        p, q = ef_fused.encode(x, "w"), ef_plain.encode(x, "w")
        if step == 0:
            np.testing.assert_array_equal(p, q)
        y, z = fused.decode(p), plain.decode(q)
        assert rel_err(y, z) < 1e-3


def test_fused_feedback_keeps_the_selection_on_a_well_separated_input():
    # Six strong frequencies (k = 6), far above the rest: every step keeps the same bins
    # on both paths, and the fused payloads carry them as the unfused ones do.
    n = 4096
    t = np.arange(n)
    x = sum(np.cos(2 * np.pi * f * t / n + f) * (1 + f / 100) for f in (3, 17, 40, 99, 257, 600))
    x = (x + 1e-4 * np.random.default_rng(1).standard_normal(n)).astype(np.float32)
    fused, plain = (mpicomp.codec("fft", theta=0.9975, fp16=False) for _ in range(2))
    ef_fused, ef_plain = ErrorFeedback(fused), ErrorFeedback(unfused(plain))
    nbins = n // 2 + 1
    for _ in range(4):
        p, q = ef_fused.encode(x, "w"), ef_plain.encode(x, "w")
        bitmap = slice(16 + 8 + 16, 16 + 8 + 16 + (nbins + 7) // 8)
        np.testing.assert_array_equal(p[bitmap], q[bitmap])
        assert rel_err(fused.decode(p), plain.decode(q)) < 1e-4


def test_fused_feedback_state_round_trips():
    c = mpicomp.codec("fft", theta=0.9)
    ef = ErrorFeedback(c)
    for step in range(2):
        ef.encode(gradient_like(3000, seed=step).reshape(3, 1000), "w")
    again = ErrorFeedback(mpicomp.codec("fft", theta=0.9))
    again.load_state_dict(ef.state_dict())
    x = gradient_like(3000, seed=7).reshape(3, 1000)
    np.testing.assert_array_equal(ef.encode(x, "w"), again.encode(x, "w"))
    np.testing.assert_array_equal(ef.residual("w"), again.residual("w"))


def test_fused_feedback_refuses_bad_residuals():
    c = mpicomp.codec("fft")
    x = gradient_like(100, seed=1)
    with pytest.raises(ValueError, match="float32 array"):
        c.encode(x, residual=np.zeros(100, np.float64))
    with pytest.raises(ValueError, match="shape"):
        c.encode(x, residual=np.zeros(101, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        c.encode(x, residual=np.zeros(200, np.float32)[::2])
    r = np.zeros(100, np.float32)
    r[5] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.encode(x, residual=r)
    assert r[5] == np.inf and np.count_nonzero(r) == 1  # a refused call leaves it alone


# ---------------------------------------------------------------- parameters


def test_registry_and_defaults():
    c = mpicomp.codec("fft")
    assert type(c).__name__ == "FFTCodec" and c.aggregation == "gather"
    assert c.params == {"theta": 0.85, "bits": 10, "fp16": True}
    assert "fft" in mpicomp.codecs.available()


@pytest.mark.parametrize(
    "param,value",
    [
        ("theta", -0.1),
        ("theta", 1.0),
        ("theta", float("nan")),
        ("theta", "0.5"),
        ("bits", 3),
        ("bits", 17),
        ("bits", 10.5),
        ("bits", True),
        ("fp16", "yes"),
        ("fp16", 1),
    ],
)
def test_bad_parameters_name_themselves(param, value):
    # No number at all is a TypeError; a number out of range (or 1 for a bool) a ValueError.
    wrong_type = isinstance(value, (str, bool)) and param != "fp16"
    with pytest.raises(TypeError if wrong_type else ValueError, match=param):
        mpicomp.codec("fft", **{param: value})


def test_unknown_parameter_is_a_type_error():
    with pytest.raises(TypeError):
        mpicomp.codec("fft", sparsity=0.5)


# ---------------------------------------------------------------- hostile payloads


def forge(
    n, eps_bits=0x3F800000, m=10, bits=8, k=None, reserved=0, bitmap=None, codes=b"", flags=0
):
    nbins = n // 2 + 1
    if bitmap is None:
        mask = np.zeros(nbins, np.uint8)
        mask[: (k or 0)] = 1
        bitmap = np.packbits(mask, bitorder="little").tobytes()
    body = struct.pack("<IBBHQ", eps_bits, m, bits, reserved, k or 0) + bitmap + codes
    return _wire.pack("fft", (n,), np.frombuffer(body, np.uint8), flags=flags)


def test_a_forged_valid_payload_decodes():
    # The forging helper itself is right: with consistent fields it decodes.
    p = forge(16, k=2, bits=8, codes=bytes([1, 0x81, 0, 0]))
    y = mpicomp.codec("fft").decode(p)
    assert y.shape == (16,) and np.all(np.isfinite(y)) and np.any(y != 0)


INCONSISTENT = [
    ("k beyond the bins", dict(k=10, bitmap=b"\xff\x01", codes=bytes(20))),
    ("codes short", dict(k=2, codes=bytes(3))),
    ("codes long", dict(k=2, codes=bytes(5))),
    ("bitmap short", dict(k=2, bitmap=b"\x03", codes=bytes(4))),
    ("popcount below k", dict(k=2, bitmap=b"\x01\x00", codes=bytes(4))),
    ("popcount above k", dict(k=2, bitmap=b"\x07\x00", codes=bytes(4))),
    ("bitmap padding", dict(k=2, bitmap=b"\x03\x02", codes=bytes(4))),
    ("code padding", dict(k=1, bits=5, codes=b"\x00\x04")),
    ("negative zero code", dict(k=1, bits=8, codes=b"\x80\x00")),
    (
        "code beyond float32",
        dict(k=1, bits=16, m=0, eps_bits=0x7F000000, codes=b"\xff\x00\0\0"),
    ),
    (
        "spectrum sums past float32",
        dict(
            k=9,
            bits=16,
            m=0,
            eps_bits=0x7F000000,
            bitmap=b"\xff\x01",
            codes=b"\x01\x00" * 9 + bytes(18),
        ),
    ),
    ("eps is inf", dict(eps_bits=0x7F800000, k=1, codes=bytes(2))),
    ("eps is NaN", dict(eps_bits=0x7FC00000, k=1, codes=bytes(2))),
    ("eps is zero", dict(eps_bits=0, k=1, codes=bytes(2))),
    ("eps is negative", dict(eps_bits=0xBF800000, k=1, codes=bytes(2))),
    ("eps off the m grid", dict(eps_bits=0x3F800001, k=1, codes=bytes(2))),
    ("m too large", dict(m=24, k=1, codes=bytes(2))),
    ("bits too small", dict(bits=3, k=2, codes=bytes(2))),
    ("bits too large", dict(bits=17, k=1, codes=bytes(5))),
    ("reserved", dict(reserved=1, k=1, codes=bytes(2))),
    ("flags", dict(flags=1, k=1, codes=bytes(2))),
]


@pytest.mark.parametrize("what,kwargs", INCONSISTENT)
def test_inconsistent_bodies_raise_payload_error(what, kwargs):
    with pytest.raises(mpicomp.PayloadError):
        mpicomp.codec("fft").decode(forge(16, **kwargs))


@pytest.fixture
def emulated(monkeypatch):
    """(an fft codec on the numba backend, one on cuda-emulated, the emulated device)."""
    host = mpicomp.codec("fft", theta=0.5, bits=7)
    monkeypatch.setenv(mpicomp.kernels.ENV, "cuda-emulated")
    device = mpicomp.kernels.backend("cuda-emulated").device
    return host, mpicomp.codec("fft", theta=0.5, bits=7), device


def _gathered(codec, payloads, numel):
    with batch("end of call"):
        return codec.decode_gathered(payloads, numel)


def _message(fn) -> str:
    with pytest.raises(mpicomp.PayloadError) as caught:
        fn()
    return str(caught.value)


@pytest.mark.parametrize("what,kwargs", INCONSISTENT)
def test_gathered_bodies_are_checked_in_the_batch_with_decodes_messages(what, kwargs, emulated):
    # On a device a gathered payload's fields stay there: every check is read at the end
    # of the caller's batch, in one read, and raises decode's PayloadError, same message.
    host, codec, dev = emulated
    p = forge(16, **kwargs)
    want = _message(lambda: host.decode(p, numel=16))
    good = forge(16, k=2, bits=8, codes=bytes([1, 0x81, 0, 0]))
    for payloads in ([p], [good, p]):
        before = dev.syncs
        assert _message(lambda payloads=payloads: _gathered(codec, payloads, 16)) == want
        # (A header unlike a flat array's is read once more, to say what is wrong.)
        assert dev.syncs - before == (2 if what == "flags" else 1)


def test_gathered_payloads_of_no_body_of_their_size_are_refused_by_decodes_path(emulated):
    host, codec, _ = emulated
    for p in (_wire.pack("fft", (16,), np.zeros(15, np.uint8)), forge(16, k=2, codes=bytes(80))):
        want = _message(lambda p=p: host.decode(p))
        assert _message(lambda p=p: _gathered(codec, [p], 16)) == want


@pytest.mark.parametrize("n", [1, 2, 3001, 1 << 18])
def test_gathered_payloads_decode_with_one_read_as_decode_sum(n, emulated):
    host, codec, dev = emulated
    xs = [gradient_like(n, seed=s) for s in range(3)]
    payloads = [codec.encode(x) for x in xs]
    if n < 1 << 18:  # below the blocked transform, the same spectrum: the same bytes
        for p, x in zip(payloads, xs, strict=True):
            np.testing.assert_array_equal(p, host.encode(x))
    before = dev.syncs
    total = _gathered(codec, payloads, n)
    assert dev.syncs - before == 1
    np.testing.assert_array_equal(total, codec.decode_sum(payloads, n))
    np.testing.assert_allclose(total, host.decode_sum(payloads, n), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("at", [3, 12, 16, 9, 30, 60])
def test_gathered_corruption_raises_when_the_batch_is_read(at, emulated):
    host, codec, dev = emulated
    good = codec.encode(gradient_like(3001, seed=4))
    bad = good.copy()
    bad[at] ^= 1
    with pytest.raises(mpicomp.PayloadError):
        with batch("end of call"):
            total = codec.decode_gathered([good, bad], 3001)
            assert total.shape == (3001,)  # nothing raised yet: the checks wait for the read
    with pytest.raises(mpicomp.PayloadError):
        host.decode_sum([good, bad], 3001)


def test_device_encode_reads_once_and_a_refused_one_keeps_the_residual(emulated):
    host, codec, dev = emulated
    x = gradient_like(3001, seed=5)
    r = (gradient_like(3001, seed=6) * 1e-3).astype(np.float32)
    want_r = r.copy()
    want = host.encode(x, residual=want_r)
    before = dev.syncs
    got = codec.encode(x, residual=r)
    assert dev.syncs - before == 1
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(r, want_r)
    for bad_x, bad_r, match in (
        (x, np.where(np.arange(3001) == 5, np.inf, r).astype(np.float32), "residual"),
        (np.where(np.arange(3001) == 7, np.nan, x).astype(np.float32), r, "NaN or Inf"),
        (np.where(np.arange(3001) == 9, 1e6, x).astype(np.float32), r, "overflows float16"),
    ):
        kept = bad_r.copy()
        with pytest.raises(ValueError, match=match):
            codec.encode(bad_x, residual=bad_r)
        np.testing.assert_array_equal(bad_r, kept)  # a refused call leaves it alone


def test_body_shorter_than_its_fixed_part():
    p = _wire.pack("fft", (16,), np.zeros(15, np.uint8))
    with pytest.raises(mpicomp.PayloadError, match="truncated"):
        mpicomp.codec("fft").decode(p)


def test_truncated_flipped_and_foreign_payloads():
    c = mpicomp.codec("fft")
    p = c.encode(gradient_like(3000, seed=11))
    with pytest.raises(mpicomp.PayloadError):
        c.decode(p[:-1])
    with pytest.raises(mpicomp.PayloadError):
        c.decode(p[:10])
    flipped = p.copy()
    flipped[40 + 100] ^= 0x10
    with pytest.raises(mpicomp.PayloadError, match="checksum"):
        c.decode(flipped)
    other = mpicomp.codec("topk").encode(gradient_like(3000, seed=11))
    with pytest.raises(mpicomp.PayloadError, match="topk"):
        c.decode(other)
    with pytest.raises(mpicomp.PayloadError):
        c.decode(p.astype(np.int16))


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300), flips=st.integers(1, 4))
def test_corrupted_bodies_with_valid_checksums_never_crash(seed, n, flips):
    # Re-packed so the checksum passes: only the body validation stands in the way.
    c = mpicomp.codec("fft", theta=0.5, bits=7)
    body = body_of(c.encode(gradient_like(n, seed=seed))).copy()
    rng = np.random.default_rng(seed)
    for pos in rng.integers(0, body.size, flips):
        body[pos] ^= np.uint8(1 << rng.integers(0, 8))
    try:
        y = c.decode(_wire.pack("fft", (n,), body))
    except mpicomp.PayloadError:
        return
    assert y.shape == (n,) and y.dtype == np.float32 and np.all(np.isfinite(y))


# ---------------------------------------------------------------- blocked transform, sums


def test_blocked_plan_only_for_large_even_balanced_sizes():
    from mpicomp.kernels.cpu import rfft as F

    assert F.plan(F.BLOCKED_MIN - 2) is None
    assert F.plan(F.BLOCKED_MIN + 1) is None  # odd
    assert F.plan(2 * 262147) is None  # n/2 prime: no balanced split
    plan = F.plan(600_000)
    assert plan is not None and plan.n1 * plan.n2 == 300_000 and plan.n1 >= 64


@pytest.mark.parametrize("n", [1 << 18, 600_000, 1_048_576 + 2 * 3 * 5 * 7 * 11])
def test_blocked_transform_matches_numpy_within_float32_rounding(n):
    from mpicomp.kernels.cpu import rfft as F

    assert F.plan(n) is not None
    x = gradient_like(n, seed=n % 97)
    ref = np.fft.rfft(x.astype(np.float64))
    spec, mag2, ok = F.rfft(x, own=False)
    X = spec.view(np.complex64)
    assert ok and X.size == n // 2 + 1
    scale = np.abs(ref).max()
    assert np.abs(X - ref).max() < 1e-6 * scale
    assert X[0].imag == 0 and X[-1].imag == 0
    np.testing.assert_array_equal(mag2, X.real * X.real + X.imag * X.imag)
    back = F.irfft(spec.copy(), n)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-6 * np.abs(x).max())
    # Imaginary parts of DC and Nyquist are ignored, as numpy.fft.irfft does.
    odd = spec.copy()
    odd[1], odd[-1] = 5.0, -3.0
    np.testing.assert_array_equal(F.irfft(odd, n), back)


@pytest.mark.parametrize("n", [1 << 18, 600_000])
def test_blocked_payloads_follow_the_format(n):
    # Same layout and rules as the reference; the spectrum itself differs from NumPy's in
    # the last bits, so the kept set and codes are compared with the reference's tolerance.
    x = gradient_like(n, seed=3)
    c = mpicomp.codec("fft")
    p = c.encode(x)
    expected = ref_encode_body(x)
    body = body_of(p)
    assert body.size == len(expected)
    nbins, k = ref_kept(n, 0.85)
    got = np.unpackbits(body[16 : 16 + (nbins + 7) // 8], bitorder="little")[:nbins]
    want = np.unpackbits(np.frombuffer(expected, np.uint8)[16:], bitorder="little")[:nbins]
    assert got.sum() == k and np.count_nonzero(got != want) < 1e-3 * k
    y = c.decode(p)
    ref = ref_decode_body(body.tobytes(), n)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    assert rel_err(y, ref_decode_body(expected, n)) < 1e-2


def test_kth_largest_is_numpy_partition():
    from mpicomp.kernels.cpu import fft as k

    rng = np.random.default_rng(4)
    for m2 in (
        rng.random(300_000).astype(np.float32) ** 4,
        np.repeat(rng.random(50).astype(np.float32), 5000),  # ties everywhere
        np.zeros(70_000, np.float32),
        np.array([3.0], np.float32),
    ):
        for kk in {1, 2, m2.size // 3, m2.size - 1, m2.size} & set(range(1, m2.size + 1)):
            want = np.partition(m2, m2.size - kk)[m2.size - kk]
            assert k.mpicomp_fft_kth_largest(m2, kk) == want


def test_ties_across_parallel_chunks_keep_the_lowest_bins():
    from mpicomp.kernels.cpu import fft as k

    nbins = 200_003
    mag2 = np.ones(nbins, np.float32)
    mag2[::7] = 2.0
    spec = np.arange(2 * nbins, dtype=np.float32).view(np.uint32)
    kk = (nbins + 6) // 7 + 100_000
    bitmap = np.zeros((nbins + 7) // 8, np.uint8)
    dense = np.empty(2 * kk, np.uint32)
    hist = np.zeros(256, np.int64)
    k.mpicomp_fft_select_pack(spec, mag2, np.float32(1.0), kk, bitmap, dense, hist)
    keep = mag2 == 2.0
    keep[np.flatnonzero(~keep)[: kk - keep.sum()]] = True
    np.testing.assert_array_equal(np.unpackbits(bitmap, bitorder="little")[:nbins], keep)
    idx = np.flatnonzero(keep)
    np.testing.assert_array_equal(dense[:kk], spec[2 * idx])
    np.testing.assert_array_equal(dense[kk:], spec[2 * idx + 1])


@pytest.mark.parametrize("n", [0, 1, 1001, 600_000])
def test_decode_sum_is_the_sum_of_decodes(n):
    from mpicomp.kernels.cpu.rfft import BLOCKED_MIN

    c = mpicomp.codec("fft", theta=0.7)
    payloads = [
        c.encode(gradient_like(n, seed=s).reshape(-1, 1) if n else np.zeros(0)) for s in range(3)
    ]
    total = c.decode_sum(payloads, numel=n)
    ref = sum((c.decode(p).reshape(-1).astype(np.float64) for p in payloads), np.zeros(n))
    assert total.shape == (n,) and total.dtype == np.float32
    np.testing.assert_allclose(total, ref, rtol=0, atol=2e-6 * (np.abs(ref).max() if n else 1))
    if n < BLOCKED_MIN:  # decoded one by one and added in float32: bit-identical
        expected = np.zeros(n, np.float32)
        for p in payloads:
            expected += c.decode(p).reshape(-1)
        np.testing.assert_array_equal(total, expected)
    np.testing.assert_array_equal(
        c.decode_sum(payloads[:1], numel=n), c.decode(payloads[0]).reshape(-1)
    )
    assert c.decode_sum([], numel=n).shape == (n,)


def test_decode_sum_refuses_bad_payloads():
    c = mpicomp.codec("fft")
    good = c.encode(gradient_like(1000, seed=1))
    with pytest.raises(mpicomp.PayloadError):
        c.decode_sum([good, c.encode(gradient_like(1002, seed=1))], numel=1000)
    with pytest.raises(mpicomp.PayloadError):
        c.decode_sum(
            [good, forge(1000, k=2, bitmap=b"\x07" + bytes(62), codes=bytes(3))], numel=1000
        )
