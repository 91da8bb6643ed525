"""3LC codec (the 3LC paper §3): bytes against a plain NumPy reference, paper properties,
error feedback and payload validation."""

import itertools
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpicomp
from conftest import gradient_like
from mpicomp import PayloadError
from mpicomp.codecs import _wire
from mpicomp.codecs.feedback import ErrorFeedback
from mpicomp.codecs.threelc import ThreeLC
from mpicomp.kernels.cpu import threelc as kernels

FLT_MAX = np.finfo(np.float32).max


# --- a naive reference, written from the paper and docs/codecs.md -------------------------


def ref_zero_run(q):
    """Replace runs of k bytes 121 (2..14) by 243 + k - 2, 14 at a time."""
    out = []
    for value, group in itertools.groupby(q.tolist()):
        k = len(list(group))
        if value != 121:
            out += [value] * k
            continue
        while k >= 14:
            out.append(255)
            k -= 14
        if k == 1:
            out.append(121)
        elif k >= 2:
            out.append(243 + k - 2)
    return np.array(out, dtype=np.uint8)


def ref_quantize(x, sparsity=1.0, residual=None):
    """Return (M, trits, y) with y = x (+ residual) flattened."""
    y = np.asarray(x, dtype=np.float32).reshape(-1)
    if residual is not None:
        y = y + residual.reshape(-1)
    m = np.abs(y).max() if y.size else np.float32(0)
    with np.errstate(over="ignore"):
        M = np.float32(m) * np.float32(sparsity)
    M = min(M, FLT_MAX)
    if M == 0:
        trits = np.zeros(y.size, dtype=np.float32)
    else:
        trits = np.rint(y / M)  # float32 division, round half to even
    return np.float32(M), trits, y


def ref_encode(x, sparsity=1.0, zero_run=True, residual=None):
    """Return the whole payload: the reference body in the common wire header."""
    M, trits, _ = ref_quantize(x, sparsity, residual)
    n = trits.size
    L = (n + 4) // 5
    padded = np.zeros(5 * L, dtype=np.uint8)
    padded[:n] = (trits + 1).astype(np.uint8)
    p = padded.reshape(5, L).astype(np.uint16)
    q = (p[0] * 81 + p[1] * 27 + p[2] * 9 + p[3] * 3 + p[4]).astype(np.uint8)
    if zero_run:
        q = ref_zero_run(q)
    body = np.frombuffer(struct.pack("<f", M) + q.tobytes(), dtype=np.uint8)
    return _wire.pack("threelc", np.shape(x), body, flags=1 if zero_run else 0)


def ref_decoded(x, sparsity=1.0, residual=None):
    """Return trit * M in the shape of x."""
    M, trits, _ = ref_quantize(x, sparsity, residual)
    return (trits.astype(np.float32) * M).reshape(np.shape(x))


def body_of(payload):
    """Return the body bytes of a payload (after header and shape)."""
    ndim = int(payload[4])
    return payload[16 + 8 * ndim :]


# --- bytes and round trips -----------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (0,), (1,), (4,), (5,), (7,), (3, 4, 5), (2, 0, 3), (1001,)])
@pytest.mark.parametrize("sparsity", [1.0, 1.5, 1.99])
@pytest.mark.parametrize("zero_run", [True, False])
def test_bytes_match_reference(shape, sparsity, zero_run):
    x = gradient_like(int(np.prod(shape)), seed=len(shape)).reshape(shape)
    codec = ThreeLC(sparsity=sparsity, zero_run=zero_run)
    payload = codec.encode(x)
    assert payload.dtype == np.uint8 and payload.ndim == 1
    np.testing.assert_array_equal(payload, ref_encode(x, sparsity, zero_run))
    out = codec.decode(payload)
    assert out.dtype == np.float32 and out.shape == shape
    np.testing.assert_array_equal(out, ref_decoded(x, sparsity))


@given(
    n=st.integers(0, 100_000),
    seed=st.integers(0, 2**32 - 1),
    sparsity=st.sampled_from([1.0, 1.25, 1.5, 1.75, 1.9]),
    zero_run=st.booleans(),
)
def test_bytes_match_reference_any_length(n, seed, sparsity, zero_run):
    rng = np.random.default_rng(seed)
    x = gradient_like(n, seed)
    # Exact zeros and ties at +-M/2 as well as ordinary values.
    if n:
        x[rng.integers(0, n, n // 7 + 1)] = 0
        x[rng.integers(0, n, n // 11 + 1)] = np.abs(x).max() * np.float32(sparsity) / 2
    codec = ThreeLC(sparsity=sparsity, zero_run=zero_run)
    payload = codec.encode(x)
    np.testing.assert_array_equal(payload, ref_encode(x, sparsity, zero_run))
    np.testing.assert_array_equal(codec.decode(payload), ref_decoded(x, sparsity))


def test_round_half_to_even_at_half_scale():
    # M = 2: 1/2 and -1/2 are ties and round to 0, 2 and -2 to +-1.
    x = np.array([2.0, 1.0, -1.0, -2.0, 1.0000001, -0.9999999], dtype=np.float32)
    out = ThreeLC().decode(ThreeLC().encode(x))
    np.testing.assert_array_equal(out, [2.0, 0.0, 0.0, -2.0, 2.0, 0.0])


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_float_dtypes_convert_once(dtype):
    x = gradient_like(333, seed=3).astype(dtype)
    np.testing.assert_array_equal(ThreeLC().encode(x), ThreeLC().encode(x.astype(np.float32)))


def test_non_contiguous_input():
    x = gradient_like(200, seed=4).reshape(20, 10)[:, ::2]
    np.testing.assert_array_equal(ThreeLC().encode(x), ref_encode(np.ascontiguousarray(x)))


def test_scale_overflow_is_clamped_to_float32_max():
    x = np.array([FLT_MAX, -FLT_MAX / 2, 1.0], dtype=np.float32)
    payload = ThreeLC(sparsity=1.5).encode(x)
    assert struct.unpack("<f", body_of(payload)[:4].tobytes())[0] == FLT_MAX
    np.testing.assert_array_equal(ThreeLC().decode(payload), [FLT_MAX, 0.0, 0.0])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_is_rejected(bad):
    x = gradient_like(1000, seed=5)
    x[777] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        ThreeLC().encode(x)


def test_overflowing_sum_with_residual_is_rejected_and_residual_kept():
    x = np.full(10, FLT_MAX, dtype=np.float32)
    r = np.ones(10, dtype=np.float32)
    r[3] = FLT_MAX
    before = r.copy()
    with pytest.raises(ValueError, match="NaN or Inf"):
        ThreeLC().encode(x, residual=r)
    np.testing.assert_array_equal(r, before)


# --- paper properties ----------------------------------------------------------------


def test_all_zeros_are_280_times_smaller():
    n = 70 * 1000
    payload = ThreeLC().encode(np.zeros(n, dtype=np.float32))
    fixed = _wire.header_size(1) + 4
    assert 4 * n / (payload.size - fixed) >= 280
    np.testing.assert_array_equal(body_of(payload)[4:], np.full(1000, 255, dtype=np.uint8))
    np.testing.assert_array_equal(ThreeLC().decode(payload), np.zeros(n, dtype=np.float32))


@pytest.mark.parametrize("n", [1, 4, 5, 6, 999, 1000, 12_347])
def test_quartic_only_size_is_ceil_n_over_5(n):
    payload = ThreeLC(zero_run=False).encode(gradient_like(n, seed=n))
    assert body_of(payload).size == 4 + (n + 4) // 5
    if n % 5 == 0:
        assert 8 * (body_of(payload).size - 4) / n == 1.6


@pytest.mark.parametrize(
    "run, code",
    [
        (1, [121]),
        (2, [243]),
        (14, [255]),
        (15, [255, 121]),
        (16, [255, 243]),
        (28, [255, 255]),
        (29, [255, 255, 121]),
    ],
)
@pytest.mark.parametrize("where", ["alone", "start", "middle", "end"])
def test_zero_run_known_strings(run, code, where):
    before = {"alone": [], "start": [], "middle": [7, 120], "end": [0, 242]}[where]
    after = {"alone": [], "start": [122, 3], "middle": [242, 1], "end": []}[where]
    src = np.array(before + [121] * run + after, dtype=np.uint8)
    expected = np.array(before + code + after, dtype=np.uint8)
    np.testing.assert_array_equal(ref_zero_run(src), expected)
    dst = np.empty(src.size, dtype=np.uint8)
    used = kernels.mpicomp_threelc_zero_run_encode(src, dst)
    np.testing.assert_array_equal(dst[:used], expected)
    assert kernels.mpicomp_threelc_zero_run_length(expected, src.size) == src.size
    back = np.empty(src.size, dtype=np.uint8)
    assert kernels.mpicomp_threelc_zero_run_decode(expected, back)
    np.testing.assert_array_equal(back, src)


def test_zero_run_through_the_codec():
    # 5 * 40 values, zero except for partition 0 at bytes 3 and 20: quartic bytes are
    # 121 except 202 (= 2*81 + 40) there; runs of 3, 16 and 19 bytes of 121.
    x = np.zeros(200, dtype=np.float32)
    x[[3, 20]] = 1.0
    body = body_of(ThreeLC().encode(x))
    np.testing.assert_array_equal(body[4:], [244, 202, 255, 243, 202, 255, 246])


def test_decoded_values_are_trits_times_scale():
    x = gradient_like(10_000, seed=6)
    for s in (1.0, 1.3, 1.8):
        payload = ThreeLC(sparsity=s).encode(x)
        M = struct.unpack("<f", body_of(payload)[:4].tobytes())[0]
        assert M == np.float32(np.abs(x).max()) * np.float32(s)
        out = ThreeLC().decode(payload)
        assert set(np.unique(out / np.float32(M))) <= {-1.0, 0.0, 1.0}
        assert np.abs(x - out).max() <= M / 2
    # s = 1 keeps the largest magnitude exactly.
    out = ThreeLC().decode(ThreeLC().encode(x))
    assert np.abs(out).max() == np.abs(x).max()


def test_larger_sparsity_gives_more_zeros_and_fewer_bytes():
    x = gradient_like(50_000, seed=7)
    zeros, sizes = [], []
    for s in (1.0, 1.5, 1.9):
        payload = ThreeLC(sparsity=s).encode(x)
        zeros.append(int(np.count_nonzero(ThreeLC().decode(payload) == 0)))
        sizes.append(payload.size)
    assert zeros[0] < zeros[1] < zeros[2]
    assert sizes[0] > sizes[1] > sizes[2]


def test_zero_run_shrinks_gradient_like_input():
    x = gradient_like(50_000, seed=8)
    with_zre = ThreeLC().encode(x).size
    without = ThreeLC(zero_run=False).encode(x).size
    assert with_zre < without


# --- error feedback ------------------------------------------------------------------


def test_fused_residual_matches_reference_bytes():
    rng = np.random.default_rng(9)
    x = gradient_like(4321, seed=9)
    r = (rng.standard_normal(4321) * 1e-3).astype(np.float32)
    expected_payload = ref_encode(x, 1.5, True, residual=r)
    M, trits, y = ref_quantize(x, 1.5, residual=r)
    expected_r = y - trits.astype(np.float32) * M
    payload = ThreeLC(sparsity=1.5).encode(x, residual=r)
    np.testing.assert_array_equal(payload, expected_payload)
    np.testing.assert_array_equal(r, expected_r)


def test_error_feedback_tracks_the_sum_of_inputs():
    codec = ThreeLC(sparsity=1.5)
    assert codec.fused_feedback
    feedback = ErrorFeedback(codec)
    n = 3000
    sum_in = np.zeros(n)
    sum_out = np.zeros(n)
    for step in range(50):
        x = gradient_like(n, seed=100 + step)
        payload = feedback.encode(x, name="w")
        out = feedback.decode(payload)
        M = struct.unpack("<f", body_of(payload)[:4].tobytes())[0]
        residual = feedback.residual("w")
        # Each step leaves at most M/2 per element behind (paper §3.1).
        assert np.abs(residual).max() <= M / 2 * (1 + 1e-6)
        sum_in += x
        sum_out += out
        np.testing.assert_allclose(sum_in - sum_out, residual, rtol=0, atol=1e-5)


def test_error_feedback_beats_no_feedback_on_a_constant_input():
    # Without feedback a value that rounds to 0 is lost at every step; with it, it is sent.
    x = gradient_like(3000, seed=12)
    codec = ThreeLC()
    r = np.zeros_like(x)
    sent_fb = sum(codec.decode(codec.encode(x, residual=r)).astype(np.float64) for _ in range(50))
    sent_plain = 50 * codec.decode(codec.encode(x)).astype(np.float64)
    wanted = 50 * x.astype(np.float64)
    assert np.abs(wanted - sent_fb).max() * 10 < np.abs(wanted - sent_plain).max()


def test_residual_of_a_0d_array_is_updated_in_place():
    x = np.array(0.25, dtype=np.float32)
    r = np.array(0.5, dtype=np.float32)
    payload = ThreeLC(sparsity=1.5).encode(x, residual=r)
    # v = 0.75, M = 1.125, v / M = 0.667 -> trit 1, residual 0.75 - 1.125.
    assert ThreeLC().decode(payload) == np.float32(1.125)
    assert r == np.float32(0.75) - np.float32(1.125)


def test_residual_must_match_x():
    x = gradient_like(10, seed=10)
    codec = ThreeLC()
    with pytest.raises(ValueError, match="shape"):
        codec.encode(x, residual=np.zeros(11, dtype=np.float32))
    with pytest.raises(ValueError, match="float32"):
        codec.encode(x, residual=np.zeros(10, dtype=np.float64))
    with pytest.raises(ValueError, match="contiguous"):
        codec.encode(x, residual=np.zeros(20, dtype=np.float32)[::2])


# --- parameters ----------------------------------------------------------------------


def test_registry_and_params():
    codec = mpicomp.codec("threelc", sparsity=1.5, zero_run=False)
    assert isinstance(codec, ThreeLC)
    assert codec.params == {"sparsity": 1.5, "zero_run": False}
    assert codec.aggregation == "gather"
    assert ThreeLC().params == {"sparsity": 1.0, "zero_run": True}


@pytest.mark.parametrize("value", [0.999, 2.0, 2.5, -1, float("nan"), float("inf"), "1.5", None])
def test_bad_sparsity(value):
    expected = TypeError if isinstance(value, (str, type(None))) else ValueError
    with pytest.raises(expected, match="sparsity"):
        ThreeLC(sparsity=value)


def test_sparsity_that_rounds_to_two_in_float32():
    with pytest.raises(ValueError, match="sparsity"):
        ThreeLC(sparsity=2 - 1e-9)
    assert ThreeLC(sparsity=float(np.nextafter(np.float32(2), np.float32(0))))


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_zero_run(value):
    with pytest.raises(ValueError, match="zero_run"):
        ThreeLC(zero_run=value)


def test_unknown_parameter():
    with pytest.raises(TypeError):
        mpicomp.codec("threelc", bits=3)


# --- payload validation --------------------------------------------------------------


def forge(body, shape=(10,), flags=1):
    """Return a payload with a valid header and checksum around ``body``."""
    return _wire.pack("threelc", shape, np.asarray(body, dtype=np.uint8), flags=flags)


def scale_bytes(M):
    return list(np.array([M], dtype="<f4").view(np.uint8))


@pytest.fixture
def payload():
    return ThreeLC().encode(gradient_like(1000, seed=11))


def test_truncated_payload(payload):
    for size in (0, 5, 16, 24, payload.size - 1):
        with pytest.raises(PayloadError):
            ThreeLC().decode(payload[:size])


def test_flipped_body_byte(payload):
    bad = payload.copy()
    bad[30] ^= 0x10
    with pytest.raises(PayloadError, match="checksum"):
        ThreeLC().decode(bad)


def test_wrong_codec_id(payload):
    other = _wire.pack("topk", (1000,), body_of(payload))
    with pytest.raises(PayloadError, match="topk"):
        ThreeLC().decode(other)


def test_not_a_uint8_array(payload):
    with pytest.raises(PayloadError):
        ThreeLC().decode(payload.tobytes())


@pytest.mark.parametrize(
    "body, flags, match",
    [
        ([], 1, "truncated"),
        ([0, 0, 128], 0, "truncated"),
        (scale_bytes(1.0) + [121], 0, "quartic bytes"),  # 10 values need 2 bytes
        (scale_bytes(1.0) + [121, 121, 121], 0, "quartic bytes"),
        (scale_bytes(1.0) + [121], 1, "expands to 1"),
        (scale_bytes(1.0) + [244], 1, "expands to more"),
        (scale_bytes(1.0) + [121, 121, 121], 1, "expands to more"),
        (scale_bytes(1.0) + [255] * 3, 1, "expands to more"),
        (scale_bytes(1.0) + [243, 121], 3, "flags"),
        (scale_bytes(1.0) + [243, 121], 0x80, "flags"),
        (scale_bytes(1.0) + [121, 243], 0, "above 242"),
        (scale_bytes(np.nan) + [121, 121], 0, "scale"),
        (scale_bytes(np.inf) + [121, 121], 0, "scale"),
        (scale_bytes(-1.0) + [121, 121], 0, "scale"),
        (scale_bytes(-0.0) + [121, 121], 0, "scale"),
        (scale_bytes(0.0) + [121, 122], 0, "M = 0"),
    ],
)
def test_inconsistent_body(body, flags, match):
    with pytest.raises(PayloadError, match=match):
        ThreeLC().decode(forge(body, flags=flags))


def test_pad_positions_must_hold_the_pad_value():
    # 7 values: L = 2 bytes, positions 7, 8, 9 (digits 3 and 4 of byte 1, digit 4 of
    # byte 0) are pad. All-zero trits with zero pad digits decode; anything else fails.
    shape = (7,)
    good = [1 * 81 + 1 * 27 + 1 * 9 + 1 * 3 + 0, 1 * 81 + 1 * 27 + 1 * 9 + 0 + 0]
    assert ThreeLC().decode(forge(scale_bytes(1.0) + good, shape, 0)).tolist() == [0.0] * 7
    for j, add in [(0, 1), (1, 3), (1, 1), (1, 2)]:
        body = list(good)
        body[j] += add
        with pytest.raises(PayloadError, match="pad"):
            ThreeLC().decode(forge(scale_bytes(1.0) + body, shape, 0))


def test_huge_shape_with_tiny_body_does_not_allocate():
    with pytest.raises(PayloadError, match="expands"):
        ThreeLC().decode(forge(scale_bytes(1.0) + [255], shape=(1 << 39,)))
    with pytest.raises(PayloadError, match="quartic bytes"):
        ThreeLC().decode(forge(scale_bytes(1.0) + [121], shape=(1 << 39,), flags=0))


@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 200),
    size=st.integers(0, 60),
    flags=st.sampled_from([0, 1]),
)
def test_random_bodies_decode_or_raise_payload_error(seed, n, size, flags):
    rng = np.random.default_rng(seed)
    body = rng.integers(0, 256, size, dtype=np.uint8)
    # Keep M plausible half the time so the body checks are reached.
    if size >= 4 and seed % 2:
        body[:4] = scale_bytes(0.5)
        if not flags:
            body[4:] = np.where(body[4:] > 242, 121, body[4:])
    try:
        out = ThreeLC().decode(forge(body, shape=(n,), flags=flags))
    except PayloadError:
        return
    assert out.shape == (n,)
    M = struct.unpack("<f", body[:4].tobytes())[0]
    assert set(np.unique(out).tolist()) <= {-M, 0.0, M}


def test_feedback_state_dict_is_a_snapshot_and_names_cannot_change_shape():
    from mpicomp.codecs import ErrorFeedback

    fb = ErrorFeedback(mpicomp.codec("threelc"))
    x = np.linspace(-1, 1, 101, dtype=np.float32)
    fb.encode(x, "w")
    saved = fb.state_dict()
    before = saved["w"].copy()
    fb.encode(x, "w")
    np.testing.assert_array_equal(saved["w"], before)  # not aliased to the live buffer
    with pytest.raises(ValueError, match="'w' had shape"):
        fb.encode(x[:50], "w")


# --- on a device (the CUDA sources, emulated): what comes back to the host, and when ---------


def emulated(monkeypatch, **params):
    """Return (a ThreeLC of ``params`` on ``cuda-emulated``, its device, which counts reads)."""
    monkeypatch.setenv(mpicomp.kernels.ENV, "cuda-emulated")
    codec = ThreeLC(**params)
    assert codec.kernels.name == "cuda-emulated"
    return codec, mpicomp.kernels.backend("cuda-emulated").device


@pytest.mark.parametrize("zero_run", [True, False])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4, 5), (4099,)])
def test_a_device_encode_reads_once_and_gives_the_numba_bytes(monkeypatch, zero_run, shape):
    n = int(np.prod(shape))
    x = gradient_like(n, seed=n).reshape(shape)
    r = gradient_like(n, seed=n + 1).reshape(shape)
    want = ThreeLC(sparsity=1.5, zero_run=zero_run)
    want_r = r.copy()
    want_payloads = [want.encode(x), want.encode(x, residual=want_r)]
    codec, dev = emulated(monkeypatch, sparsity=1.5, zero_run=zero_run)
    got_r = r.copy()
    before = dev.sync_reasons.copy()  # the device is the session's: count this test's
    got = [codec.encode(x), codec.encode(x, residual=got_r)]
    # M stays on the device; the NaN/Inf check and the zero-run length come back together.
    reads = dev.sync_reasons - before
    assert sum(reads.values()) == 2
    allowed = {"threelc encode: threelc.max: M"}  # and the length, of a zero-run body
    allowed.add("threelc encode: threelc.max: M, threelc.zero_run_encode: length")
    assert set(reads) <= allowed
    for a, b in zip(want_payloads, got, strict=True):
        assert a.tobytes() == b.tobytes()
    assert want_r.tobytes() == got_r.tobytes()


def test_a_device_encode_refuses_nan_and_keeps_the_residual(monkeypatch):
    codec, _ = emulated(monkeypatch)
    x = np.full(10, FLT_MAX, dtype=np.float32)
    r = np.ones(10, dtype=np.float32)
    r[3] = FLT_MAX
    before = r.copy()
    # The encode runs on before the check is read: the quartic kernel writes nothing on
    # the NaN mark max leaves for M.
    with pytest.raises(ValueError, match="x \\+ residual: it contains NaN or Inf"):
        codec.encode(x, residual=r)
    np.testing.assert_array_equal(r, before)
    x = gradient_like(1000, seed=5)
    x[777] = np.nan
    with pytest.raises(ValueError, match="cannot encode x: it contains NaN or Inf"):
        codec.encode(x)


@pytest.mark.parametrize("zero_run", [True, False])
def test_gathered_payloads_decode_with_the_callers_one_read(monkeypatch, zero_run):
    from mpicomp.kernels.readback import batch

    numba = ThreeLC(sparsity=1.3, zero_run=zero_run)
    xs = [gradient_like(1003, seed=s) for s in range(3)]
    payloads = [numba.encode(x) for x in xs]
    want = numba.decode_sum(payloads, 1003)
    codec, dev = emulated(monkeypatch, sparsity=1.3, zero_run=zero_run)
    before = dev.syncs
    with batch("end"):
        total = codec.decode_gathered(payloads, 1003)
    assert dev.syncs - before == 1
    np.testing.assert_array_equal(total, want)
    # decode reads the header and the checksum at once, the body's checks with the batch.
    before = dev.syncs
    with batch("end"):
        one = codec.decode(payloads[0], numel=1003)
    assert dev.syncs - before == 3
    np.testing.assert_array_equal(one, numba.decode(payloads[0]))
    # Not a flat array's payload (its length fits one): decode says what is wrong.
    if zero_run:
        square = numba.encode(xs[0][:1000].reshape(10, 100))
        with pytest.raises(PayloadError, match=r"of shape \(10, 100\) is not what the colle"):
            codec.decode_gathered([square], 1000)


def _set_scale(body, m):
    body[:4] = scale_bytes(m)


def _first_literal(body, value):
    """Set the first stream byte that is not a zero-run code to ``value``."""
    at = 4 + int(np.flatnonzero(body[4:] < 243)[0])
    body[at] = value


def _first_run_to(body, value):
    """Set the first zero-run code other than ``value`` to ``value``."""
    at = 4 + int(np.flatnonzero((body[4:] >= 243) & (body[4:] != value))[0])
    body[at] = value


# (what to do to the body, resealed?, zero_run, what the message says). n = 1003: the last
# quartic byte has pad positions.
CORRUPTIONS = {
    "flipped body byte": (lambda b: b.__setitem__(9, b[9] ^ 0x10), False, True, "checksum"),
    "nan scale": (lambda b: _set_scale(b, np.nan), True, True, "scale"),
    "inf scale": (lambda b: _set_scale(b, np.inf), True, False, "scale"),
    "negative scale": (lambda b: _set_scale(b, -0.5), True, True, "scale"),
    "-0 scale": (lambda b: _set_scale(b, -0.0), True, False, "scale"),
    "zero scale": (lambda b: _set_scale(b, 0.0), True, False, "M = 0"),
    "longer run": (lambda b: _first_run_to(b, 255), True, True, "expands to more than 201"),
    "shorter run": (lambda b: _first_run_to(b, 121), True, True, r"expands to 1\d\d bytes"),
    "code for a byte": (lambda b: _first_literal(b, 250), True, True, "expands to more"),
    "byte above 242": (lambda b: b.__setitem__(6, 250), True, False, "above 242"),
    "pad digit": (lambda b: b.__setitem__(-1, b[-1] + 1 - b[-1] % 3), True, False, "pad"),
    "scale and run": (
        lambda b: [_set_scale(b, np.nan), _first_run_to(b, 255)],
        True,
        True,
        "scale",
    ),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_corrupt_gathered_payload_raises_decodes_error_when_the_batch_is_read(monkeypatch, name):
    from mpicomp.kernels.readback import batch

    edit, reseal, zero_run, match = CORRUPTIONS[name]
    numba = ThreeLC(zero_run=zero_run)
    x = gradient_like(1003, seed=9)
    x[100:900] = 0  # runs of zero bytes
    good = numba.encode(x)
    bad = good.copy()
    edit(bad[_wire.header_size(1) :])
    if reseal:
        _wire.reseal(bad)
    with pytest.raises(PayloadError, match=match) as numba_error:
        numba.decode_gathered([good, bad], 1003)
    codec, dev = emulated(monkeypatch, zero_run=zero_run)
    before, reached = dev.syncs, False
    with pytest.raises(PayloadError) as error:
        with batch("end"):
            codec.decode_gathered([good, bad], 1003)
            reached = True  # nothing was read yet: the checks raise when the batch is
    assert reached and dev.syncs - before == 1
    assert str(error.value) == str(numba_error.value)  # decode's own message


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda p: p.__setitem__(5, 0), "is not what the collectives send"),  # flags, resealed
        (lambda p: p.__setitem__(5, 3), "flags=0x3"),
        (lambda p: p.__setitem__(3, 10), "made by codec 'topk'"),
        (lambda p: p.__setitem__(16, 0xEC), "describes 1004 elements, expected 1003"),
    ],
)
def test_a_gathered_payloads_header_is_checked_with_unpacks_messages(monkeypatch, edit, match):
    from mpicomp.kernels.readback import batch

    x = gradient_like(1003, seed=10)
    bad = ThreeLC().encode(x)
    edit(bad)
    _wire.reseal(bad)
    codec, _ = emulated(monkeypatch)
    with pytest.raises(PayloadError, match=match):
        with batch("end"):
            codec.decode_gathered([bad], 1003)


def test_a_tiny_body_of_a_huge_shape_is_refused_before_allocating_on_a_device(monkeypatch):
    from mpicomp.kernels.readback import batch

    codec, dev = emulated(monkeypatch)
    numel = 1 << 39
    for flags, match in [(1, "expands to 14 bytes"), (0, "quartic bytes")]:
        before = dev.syncs
        # Even inside a batch: the length is read at once, nothing of the shape's size
        # is allocated (the payload header's numel is not the collective's own).
        with pytest.raises(PayloadError, match=match), batch("end"):
            codec.decode(forge(scale_bytes(1.0) + [255], shape=(numel,), flags=flags))
        assert dev.syncs - before == 3  # header, checksum; then M (and the length)
    with pytest.raises(PayloadError, match="scale"), batch("end"):
        codec.decode(forge(scale_bytes(-1.0) + [255], shape=(numel,)))  # M's error first


@pytest.mark.parametrize("schedule", ["allgather", "sharded"])
def test_a_device_call_with_feedback_gives_the_numba_result(monkeypatch, schedule):
    from mpi4py import MPI

    xs = [gradient_like(4099, seed=s) for s in range(3)]

    def calls():
        with mpicomp.CompressedComm(MPI.COMM_SELF, "threelc", min_numel=1, schedule=schedule) as cc:
            return [cc.allreduce(x, name="w") for x in xs]

    want = calls()
    _, dev = emulated(monkeypatch)
    before = dev.syncs
    got = calls()
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
    assert dev.syncs > before  # the device path ran
