"""FastSGD: bytes against a plain NumPy/Python reference of the FastSGD paper §3 and
docs/codecs.md ("fastsgd"), the paper's properties, and decoding of hostile payloads."""

import math
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpicomp
from conftest import gradient_like
from mpicomp.codecs import _wire
from mpicomp.codecs.fastsgd import DEFAULT_BUCKET

FLT_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------- reference


def ref_powers(base, tau):
    """b^L for L = 0..tau, each the previous one times b (the documented definition)."""
    p = [1.0]
    for _ in range(tau):
        p.append(p[-1] * base)
    return p


def ref_abs_sum(v):
    """sum |v| rounded once to float32 (half to even), saturated at FLT_MAX, by Python ints."""
    bits = np.abs(v.astype(np.float32)).view(np.uint32).astype(np.int64)
    exp = bits >> 23
    mant = (bits & 0x7FFFFF) | np.where(exp > 0, 0x800000, 0)
    # bincount in float64 is exact here: every bin sum stays below 2^53.
    per_exp = np.bincount(np.maximum(exp, 1), weights=mant, minlength=256)
    total = 0  # in units of 2^-149
    for e in np.flatnonzero(per_exp):
        total += int(per_exp[e]) << (int(e) - 1)
    if total == 0:
        return 0.0
    shift = max(total.bit_length() - 24, 0)
    q, r = divmod(total, 1 << shift)
    if shift and (2 * r > (1 << shift) or (2 * r == (1 << shift) and q & 1)):
        q += 1
    return min(math.ldexp(q, shift - 149), FLT_MAX)


def ref_bucket(v, base, tau, flag_bits):
    """Return (sum, kept indices, L codes, W, key stream bits) of one bucket."""
    s = ref_abs_sum(v)
    a = np.abs(v).astype(np.float64)
    if s == 0.0:
        keys = np.zeros(0, np.int64)
    else:
        keys = np.flatnonzero(a >= s / ref_powers(base, tau)[tau])
    q = np.array([s / p for p in ref_powers(base, tau)])
    # L = ceil(log_b(sum/|v|)): the number of thresholds sum/b^L still above |v|.
    L = (q[None, :] > a[keys, None]).sum(axis=1)
    codes = (L | np.where(v[keys] < 0, 0x80, 0)).astype(np.uint8)
    deltas = np.diff(keys, prepend=0)
    W = int(deltas.max()).bit_length() if keys.size else 0
    widths = np.array([-(-(c + 1) * W // 2**flag_bits) for c in range(2**flag_bits)])
    need = np.frexp(deltas.astype(np.float64))[1]  # bits of each delta (0 for 0)
    c = np.searchsorted(widths, need)  # the smallest flag whose width holds the delta
    flen = flag_bits + widths[c]
    field = (c << widths[c]) | deltas  # flag, then delta: one l + w bit field
    owner = np.repeat(np.arange(keys.size), flen)
    first = np.repeat(np.cumsum(flen) - flen, flen)
    shift = flen[owner] - 1 - (np.arange(flen.sum()) - first)  # most significant bit first
    bits = ((field[owner] >> shift) & 1).astype(np.uint8)
    return s, keys, codes, W, bits


def ref_body(x, base=1.1, tau=127, flag_bits=2, bucket=DEFAULT_BUCKET):
    """The FastSGD body of x as documented, built bucket by bucket."""
    flat = x.reshape(-1).astype(np.float32)
    n = flat.size
    size = bucket if bucket else max(n, 1)
    out = [struct.pack("<dIBBH", base, bucket, tau, flag_bits, 0)]
    for start in range(0, n, size):
        s, keys, codes, W, bits = ref_bucket(flat[start : start + size], base, tau, flag_bits)
        packed = np.packbits(bits).tobytes()  # first bit = most significant bit of byte 0
        out.append(struct.pack("<fIIB", s, keys.size, len(packed), W))
        out.append(codes.tobytes() + packed)
    return np.frombuffer(b"".join(out), np.uint8)


def ref_body_size(x, flag_bits=2, bucket=DEFAULT_BUCKET, base=1.1, tau=127):
    """16 + sum over buckets of 13 + d + ceil(sum_j (l + width(c_j)) / 8), from the kept keys."""
    flat = x.reshape(-1)
    size = bucket if bucket else max(flat.size, 1)
    total = 16
    for start in range(0, flat.size, size):
        v = flat[start : start + size].astype(np.float64)
        s = ref_abs_sum(v)
        keys = (
            np.flatnonzero(np.abs(v) >= s / ref_powers(base, tau)[tau])
            if s
            else np.zeros(0, np.int64)
        )
        deltas = np.diff(keys, prepend=0)
        W = int(deltas.max()).bit_length() if keys.size else 0
        nflags = 2**flag_bits
        widths = np.array([math.ceil((c + 1) * W / nflags) for c in range(nflags)])
        need = np.array([int(dk).bit_length() for dk in deltas], dtype=np.int64)
        chosen = widths[np.searchsorted(widths, need)]  # smallest width holding each delta
        total += 13 + keys.size + (int(np.sum(flag_bits + chosen)) + 7) // 8
    return total


def body_of(payload, ndim):
    return payload[_wire.header_size(ndim) :]


def forge(body, shape):
    """A payload with a correct header and checksum around any body."""
    return _wire.pack("fastsgd", shape, np.asarray(body, np.uint8))


# ---------------------------------------------------------------- bytes and sizes


@pytest.mark.parametrize("bucket", [0, 1, 7, 1000, DEFAULT_BUCKET])
@pytest.mark.parametrize("flag_bits", [1, 2, 5])
def test_bytes_match_reference(bucket, flag_bits):
    x = gradient_like(5003, seed=bucket + flag_bits)
    x[::3] = 0.0
    c = mpicomp.codec("fastsgd", flag_bits=flag_bits, bucket=bucket)
    np.testing.assert_array_equal(
        body_of(c.encode(x), 1), ref_body(x, flag_bits=flag_bits, bucket=bucket)
    )


@given(
    n=st.integers(0, 10**5),
    seed=st.integers(0, 2**32 - 1),
    bucket=st.sampled_from([0, 1, 7, 64, 1000, 4096, DEFAULT_BUCKET]),
    flag_bits=st.integers(1, 5),
    base=st.sampled_from([1.03625, 1.1, 2.0, 16.0]),
    tau=st.sampled_from([1, 8, 64, 127]),
)
def test_bytes_and_properties_over_lengths(n, seed, bucket, flag_bits, base, tau):
    if bucket:
        n = min(n, 200 * bucket)  # keep the Python reference to a few hundred buckets
    rng = np.random.default_rng(seed)
    x = gradient_like(n, seed=seed)
    x[rng.random(n) < rng.random()] = 0.0  # sparse to dense
    c = mpicomp.codec("fastsgd", base=base, tau=tau, flag_bits=flag_bits, bucket=bucket)
    body = body_of(c.encode(x), 1)
    np.testing.assert_array_equal(body, ref_body(x, base, tau, flag_bits, bucket))
    assert body.size == ref_body_size(x, flag_bits, bucket, base, tau)
    y = c.decode(c.encode(x))
    assert y.shape == x.shape and y.dtype == np.float32
    kept = y != 0
    assert np.all(np.abs(y) <= np.abs(x))
    assert np.all(np.sign(y[kept]) == np.sign(x[kept]))
    assert np.all(np.abs(y[kept]) > np.abs(x[kept]).astype(np.float64) / base * (1 - 1e-6))


def test_body_size_formula_bucket_zero_and_positive():
    x = gradient_like(20_011, seed=4)
    for bucket in (0, 3000, DEFAULT_BUCKET):
        for flag_bits in (1, 3):
            c = mpicomp.codec("fastsgd", bucket=bucket, flag_bits=flag_bits)
            assert body_of(c.encode(x), 1).size == ref_body_size(x, flag_bits, bucket)


def test_paper_key_example_fig3():
    # Keys 3, 235, 250: deltas 3, 232, 15; W = 8 and l = 2 give widths 2, 4, 6, 8, so
    # 3 -> '00' '11' (the paper's '0011'), 232 -> '11' '11101000', 15 -> '01' '1111'.
    x = np.zeros(300, np.float32)
    x[[3, 235, 250]] = [1.0, -1.0, 1.0]
    body = body_of(mpicomp.codec("fastsgd", bucket=0).encode(x), 1)
    s, d, kbytes, W = struct.unpack_from("<fIIB", body, 16)
    assert (s, d, kbytes, W) == (3.0, 3, 3, 8)
    L = math.ceil(math.log(3.0) / math.log(1.1))
    assert body[29:32].tolist() == [L, 0x80 | L, L]
    assert body[32:].tolist() == [0b00111111, 0b10100001, 0b11110000]


def test_threshold_filter_and_quantization_exact_powers_of_two():
    # base 2, tau 3: sum 8, threshold 8 / 2^3 = 1 keeps 4, 2, 1 (L = 1, 2, 3), drops 0.5.
    x = np.array([4.0, -0.5, 2.0, 0.5, -1.0], np.float32)
    c = mpicomp.codec("fastsgd", base=2.0, tau=3, bucket=0)
    body = body_of(c.encode(x), 1)
    assert struct.unpack_from("<fI", body, 16) == (8.0, 3)
    assert body[29:32].tolist() == [1, 2, 0x80 | 3]
    np.testing.assert_array_equal(c.decode(c.encode(x)), [4.0, 0.0, 2.0, 0.0, -1.0])


def test_paper_fig2_ceiling():
    # R = 6.1 with b = 2 gives L = ceil(log2 6.1) = 3: the decoded value is sum / 8.
    x = np.array([1.0, 5.1], np.float32)
    c = mpicomp.codec("fastsgd", base=2.0, bucket=0)
    s = ref_abs_sum(x)
    y = c.decode(c.encode(x))
    assert y[0] == np.float32(s / 8) and y[0] <= 1.0 and y[0] > 0.5


def ref_levels(v, base, tau):
    """(kept indices, L of each) of one bucket, straight from the definition: float64
    q[L] = sum / b^L (b^L each the previous times b), L the smallest in [0, tau] with
    q[L] <= |v|; values with |v| < q[tau] (or a sum of 0) are dropped."""
    s = ref_abs_sum(v)
    q = np.array([s / p for p in ref_powers(base, tau)])
    a = np.abs(v.astype(np.float32)).astype(np.float64)
    keys = np.flatnonzero(a >= q[tau]) if s else np.zeros(0, np.int64)
    levels = np.array([next(L for L in range(tau + 1) if q[L] <= a[i]) for i in keys], np.int64)
    return s, q, keys, levels


def tiny_values(kind, n, seed):
    """Signed float32 values at the bottom of the range: ``subnormal`` (log-uniform over
    every subnormal binade, with the L table's cell edges and the smallest ones), ``normal``
    (the lowest normal binades, for contrast) or ``mixed`` (both in the same buckets)."""
    rng = np.random.default_rng(seed)
    top = rng.integers(0, 23, n)  # bit patterns in [2^top, 2^(top+1)): exponent field 0
    sub = rng.integers(1 << top, 2 << top).astype(np.uint32)
    edges = np.array([1, 2, 3, 5, 1 << 14, (1 << 15) - 1, 1 << 15, (1 << 15) + 1], np.uint32)
    edges = np.concatenate([edges, (np.arange(1, 256, 7, dtype=np.uint32) << 15) + 1])
    sub[rng.choice(n, edges.size, replace=False)] = edges
    norm = ((rng.integers(1, 24, n) << 23) | rng.integers(0, 1 << 23, n)).astype(np.uint32)
    bits = {"subnormal": sub, "normal": norm, "mixed": np.where(rng.random(n) < 0.5, sub, norm)}
    x = bits[kind].view(np.float32)
    return np.where(rng.random(n) < 0.5, -x, x).astype(np.float32)


@pytest.mark.parametrize("kind", ["subnormal", "normal", "mixed"])
@pytest.mark.parametrize("base", [1.001, 1 + 2.0**-7, 1.01, 1.1, 1.5, 2.0, 16.0])
@pytest.mark.parametrize("tau", [6, 40, 127])
def test_levels_of_tiny_values_are_the_smallest_level(kind, base, tau):
    # Buckets of 2 to 64 values: sums small enough (subnormal ones too) for subnormals to
    # be kept at every base. Every kept value's L code is the smallest L with q[L] <= |v|.
    n = 3000
    x = tiny_values(kind, n, seed=int(base * 1000) + tau)
    nsub = 0
    for bucket in (2, 5, 64):
        c = mpicomp.codec("fastsgd", base=base, tau=tau, bucket=bucket)
        payload = c.encode(x)
        body = body_of(payload, 1)
        y = c.decode(payload)
        pos, wrong = 16, []
        want = np.zeros(n, np.float32)
        for start in range(0, n, bucket):
            v = x[start : start + bucket]
            s, q, keys, levels = ref_levels(v, base, tau)
            got_s, d, kbytes, _ = struct.unpack_from("<fIIB", body, pos)
            assert (got_s, d) == (np.float32(s), keys.size)
            codes = body[pos + 13 : pos + 13 + d]
            assert np.array_equal(codes >> 7, (v[keys] < 0).astype(np.uint8))
            bad = np.flatnonzero((codes & 0x7F) != levels)
            wrong += [(float(v[keys[j]]), s, int(codes[j] & 0x7F), int(levels[j])) for j in bad]
            # The decoded value is +-float32(q[L]) of the defined L.
            want[start + keys] = np.copysign(q[levels].astype(np.float32), v[keys])
            nsub += np.count_nonzero(np.abs(v[keys]) < np.finfo(np.float32).tiny)
            pos += 13 + d + kbytes
        assert pos == body.size
        assert not wrong, f"bucket {bucket}: {len(wrong)} wrong (v, sum, L, want): {wrong[:3]}"
        assert y.tobytes() == want.tobytes()
    assert (nsub > 20) == (kind != "normal")  # subnormals are kept (and checked)


def test_level_of_a_subnormal_value_example():
    # Three subnormals, base 2: sum = 2^-130 (1 + 2^-10 + 2^-19) is a little above a power
    # of two, so sum / 2^L <= |v| first holds at L = 1, 11 and 20 (the last one 2^-149).
    x = np.array([2.0**-130, -(2.0**-140), 2.0**-149], np.float32)
    c = mpicomp.codec("fastsgd", base=2.0, tau=127, bucket=0)
    body = body_of(c.encode(x), 1)
    assert struct.unpack_from("<I", body, 20)[0] == 3
    assert body[29:32].tolist() == [1, 0x80 | 11, 20]


@given(n=st.integers(0, 10**5), seed=st.integers(0, 2**32 - 1))
def test_threshold_filter_keeps_exactly_the_large_values(n, seed):
    x = gradient_like(n, seed=seed)
    base, tau, bucket = 1.1, 127, 4096
    c = mpicomp.codec("fastsgd", base=base, tau=tau, bucket=bucket)
    kept = c.decode(c.encode(x)) != 0
    expect = np.zeros(n, bool)
    for start in range(0, n, bucket):
        v = x[start : start + bucket]
        s = ref_abs_sum(v)
        expect[start : start + bucket] = np.abs(v) >= s / ref_powers(base, tau)[tau]
    np.testing.assert_array_equal(kept, expect)


@given(
    n=st.integers(1, 10**5),
    seed=st.integers(0, 2**32 - 1),
    flag_bits=st.integers(1, 5),
    gap=st.sampled_from([1, 3, 100, 10_000]),
)
def test_keys_round_trip_exactly(n, seed, flag_bits, gap):
    rng = np.random.default_rng(seed)
    idx = np.unique(np.minimum(np.cumsum(rng.geometric(1 / gap, size=n // gap + 1)) - 1, n - 1))
    x = np.zeros(n, np.float32)
    # Magnitudes in [1, 1.5): even 10^5 of them sum to less than 1.1^127, so all are kept.
    x[idx] = rng.choice([-1.0, 1.0], idx.size) * (1 + rng.random(idx.size) / 2).astype(np.float32)
    c = mpicomp.codec("fastsgd", flag_bits=flag_bits, bucket=0)
    np.testing.assert_array_equal(np.flatnonzero(c.decode(c.encode(x))), idx)


def test_sum_is_rounded_once_to_float32():
    def sum_field(x):
        return struct.unpack_from("<f", body_of(mpicomp.codec("fastsgd").encode(x), 1), 16)[0]

    half_ulp = 2.0**-24
    # 1 + 2^-24 is a tie: to even (1.0); a tiny extra term breaks the tie upwards, which a
    # float64 running sum (where 2^-100 vanishes) would miss.
    assert sum_field(np.array([1.0, half_ulp], np.float32)) == 1.0
    assert sum_field(np.array([1.0, half_ulp, 2.0**-100], np.float32)) == 1.0 + 2**-23
    assert sum_field(np.array([1.0 + 2**-23, half_ulp], np.float32)) == 1.0 + 2**-22
    assert (
        sum_field(np.array([-(2.0**-149), 2.0**-149, 2.0**-130], np.float32)) == 2**-130 + 2**-148
    )
    big = np.full(4, FLT_MAX, np.float32)
    assert sum_field(big) == FLT_MAX  # saturates instead of overflowing
    y = mpicomp.codec("fastsgd").decode(mpicomp.codec("fastsgd").encode(big))
    assert np.all(y <= FLT_MAX) and np.all(y > 0)
    rng = np.random.default_rng(0)
    mixed = (rng.standard_normal(3001) * 2.0 ** rng.integers(-140, 100, 3001)).astype(np.float32)
    assert sum_field(mixed) == ref_abs_sum(mixed)


# ---------------------------------------------------------------- shapes, dtypes, inputs


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (5,), (8,), (13, 17), (2, 3, 4)])
def test_round_trip_shapes(shape):
    x = gradient_like(math.prod(shape), seed=2).reshape(shape)
    c = mpicomp.codec("fastsgd", bucket=16)
    y = c.decode(c.encode(x))
    assert y.shape == shape and y.dtype == np.float32
    assert np.all(np.abs(y) <= np.abs(x))
    if shape == ():
        assert y == x  # one value is its own sum: L = 0 decodes exactly


def test_other_float_dtypes_are_converted_once():
    x = gradient_like(3000, seed=3)
    c = mpicomp.codec("fastsgd", bucket=500)
    for dt in (np.float16, np.float64):
        xd = x.astype(dt)
        np.testing.assert_array_equal(c.encode(xd), c.encode(xd.astype(np.float32)))


def test_nonfinite_input_is_refused():
    c = mpicomp.codec("fastsgd", bucket=4)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(10, np.float32)
        x[9] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            c.encode(x)


def test_all_zero_buckets_keep_nothing():
    x = np.zeros(1000, np.float32)
    x[900] = -2.0
    c = mpicomp.codec("fastsgd", bucket=100)
    body = body_of(c.encode(x), 1)
    assert body.size == 16 + 10 * 13 + 1 + 1  # nine empty buckets; one key, one code
    y = c.decode(c.encode(x))
    assert y[900] == -2.0 and np.count_nonzero(y) == 1


def test_bucket_zero_refuses_tensors_beyond_the_largest_bucket(monkeypatch):
    from mpicomp.kernels import fastsgd as kernels

    p = mpicomp.codec("fastsgd", bucket=101).encode(np.ones(101, np.float32))
    monkeypatch.setattr(kernels, "MAX_BUCKET", 100)  # stands for 2**29, without 2 GiB of input
    c = mpicomp.codec("fastsgd", bucket=0)
    c.encode(np.ones(100, np.float32))
    with pytest.raises(ValueError, match="bucket"):
        c.encode(np.ones(101, np.float32))
    with pytest.raises(mpicomp.PayloadError, match="bucket"):
        c.decode(p)


# ---------------------------------------------------------------- paper properties


def test_sparse_linear_model_gradient_compresses_by_a_large_factor():
    rng = np.random.default_rng(5)
    n = 1 << 20
    x = np.zeros(n, np.float32)
    idx = rng.choice(n, n // 1000, replace=False)
    x[idx] = rng.standard_normal(idx.size).astype(np.float32)
    for bucket in (0, DEFAULT_BUCKET):
        c = mpicomp.codec("fastsgd", bucket=bucket)
        p = c.encode(x)
        assert 4 * n / p.size > 500
        y = c.decode(p)
        kept = np.flatnonzero(y)
        assert kept.size > idx.size // 2  # the larger values survive the filter
        assert set(kept) <= set(idx)


def test_bucket_zero_keeps_almost_nothing_of_a_dense_gradient():
    x = gradient_like(1 << 20, seed=6)
    whole = mpicomp.codec("fastsgd", bucket=0)
    kept_all = np.count_nonzero(whole.decode(whole.encode(x)))
    c = mpicomp.codec("fastsgd")
    kept_default = np.count_nonzero(c.decode(c.encode(x)))
    assert kept_all < 0.02 * x.size
    assert 0.3 * x.size < kept_default < 0.7 * x.size


def test_error_feedback_recovers_what_the_filter_drops():
    x = gradient_like(50_000, seed=7)
    fb = mpicomp.codecs.ErrorFeedback(mpicomp.codec("fastsgd", base=2.0, bucket=10_000))
    plain = mpicomp.codec("fastsgd", base=2.0, bucket=10_000)
    steps = 30
    total_fb = np.zeros_like(x, dtype=np.float64)
    for _ in range(steps):
        total_fb += fb.decode(fb.encode(x, name="w"))
    total_plain = steps * plain.decode(plain.encode(x)).astype(np.float64)
    target = steps * x.astype(np.float64)
    err_fb = np.linalg.norm(total_fb - target) / np.linalg.norm(target)
    err_plain = np.linalg.norm(total_plain - target) / np.linalg.norm(target)
    assert err_fb < 0.05 and err_plain > 0.2
    np.testing.assert_allclose(total_fb + fb.residual("w"), target, rtol=0, atol=1e-4)


# ---------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "param, value",
    [
        ("base", 1.0), ("base", 0.5), ("base", 16.5), ("base", float("nan")), ("base", "1.1"),
        ("tau", 0), ("tau", 128), ("tau", 2.5),
        ("flag_bits", 0), ("flag_bits", 6), ("flag_bits", 1.5),
        ("bucket", -1), ("bucket", 2**29 + 1), ("bucket", 10.5), ("bucket", True),
    ],
)  # fmt: skip
def test_bad_parameters_name_themselves(param, value):
    wrong_type = isinstance(value, (str, bool))  # no number at all: TypeError
    with pytest.raises(TypeError if wrong_type else ValueError, match=param):
        mpicomp.codec("fastsgd", **{param: value})


def test_defaults_follow_the_paper():
    c = mpicomp.codec("fastsgd")
    assert c.params == {"base": 1.1, "tau": 127, "flag_bits": 2, "bucket": DEFAULT_BUCKET}
    with pytest.raises(TypeError):
        mpicomp.codec("fastsgd", threshold=3)


# ---------------------------------------------------------------- hostile payloads


def valid():
    x = gradient_like(600, seed=8)
    x[100:400] = 0.0
    return x, mpicomp.codec("fastsgd", bucket=200).encode(x)


def test_transport_errors_are_payload_errors():
    x, p = valid()
    c = mpicomp.codec("fastsgd")
    with pytest.raises(mpicomp.PayloadError, match="length"):
        c.decode(p[:-1])
    flipped = p.copy()
    flipped[-5] ^= 0x10
    with pytest.raises(mpicomp.PayloadError, match="checksum"):
        c.decode(flipped)
    other = mpicomp.codec("topk").encode(x)
    with pytest.raises(mpicomp.PayloadError, match="topk"):
        c.decode(other)
    with pytest.raises(mpicomp.PayloadError):
        c.decode(p.astype(np.int8))


def edit(body, offset, fmt, value):
    b = body.copy()
    struct.pack_into(fmt, b, offset, value)
    return b


def test_payload_decodes_with_any_codec_parameters():
    x, p = valid()
    y = mpicomp.codec("fastsgd", base=2.0, tau=5, flag_bits=4, bucket=3).decode(p)
    np.testing.assert_array_equal(y, mpicomp.codec("fastsgd", bucket=200).decode(p))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b[:15], "truncated"),
        (lambda b: edit(b, 0, "<d", 1.0), "base"),
        (lambda b: edit(b, 0, "<d", float("nan")), "base"),
        (lambda b: edit(b, 12, "B", 0), "tau"),
        (lambda b: edit(b, 12, "B", 128), "tau"),
        (lambda b: edit(b, 13, "B", 6), "flag_bits"),
        (lambda b: edit(b, 14, "<H", 1), "reserved"),
        (lambda b: edit(b, 8, "<I", 2**29 + 1), "bucket"),
        (lambda b: edit(b, 8, "<I", 1), "cannot hold"),
        (lambda b: edit(b, 8, "<I", 100), "more values"),  # bucket 2 holds 199 of 100
        (lambda b: np.concatenate([b, [0]]), "follow the last"),
        (lambda b: b[:-1], "runs past"),
        (lambda b: edit(b, 16, "<f", float("nan")), "sum"),
        (lambda b: edit(b, 16, "<f", -1.0), "sum"),
        (lambda b: edit(b, 16, "<f", 0.0), "sum"),
        (lambda b: edit(b, 20, "<I", 201), "more values"),
        (lambda b: edit(b, 20, "<I", 2**32 - 1), "more values"),
        (lambda b: edit(b, 24, "<I", 2**32 - 1), "key byte count"),
        (lambda b: edit(b, 28, "B", 9), "key width"),
        (lambda b: edit(b, 12, "B", 1), "exceeds tau"),  # tau 1 < the L codes sent
    ],
)
def test_forged_bodies_are_payload_errors(mutate, match):
    _, p = valid()
    with pytest.raises(mpicomp.PayloadError, match=match):
        mpicomp.codec("fastsgd").decode(forge(mutate(body_of(p, 1)), (600,)))


def one_bucket(keys_stream, d, W, n=64, codes=None):
    """A single-bucket body (bucket = 0) with the given key bit string."""
    bits = np.array([int(ch) for ch in keys_stream], np.uint8)
    packed = np.packbits(bits).tobytes()
    codes = bytes([10] * d) if codes is None else codes
    raw = struct.pack("<dIBBH", 1.1, 0, 127, 2, 0) + struct.pack("<fIIB", 5.0, d, len(packed), W)
    return forge(np.frombuffer(raw + codes + packed, np.uint8), (n,))


def test_forged_key_streams_are_payload_errors():
    c = mpicomp.codec("fastsgd")
    # W = 3 (widths 1, 2, 3, 3 for l = 2): keys 0, 5 -> '00'+'0', '10'+'101'.
    ok = c.decode(one_bucket("000" + "10101", 2, 3))
    assert np.flatnonzero(ok).tolist() == [0, 5]
    cases = [
        ("000" + "00" + "0", 2, 3, "not strictly increasing"),  # second delta 0
        ("000" + "10111" + "10111", 3, 3, "outside its bucket"),  # keys 0, 7, 14 of 8
        ("000" + "10001", 2, 3, "smallest one"),  # delta 1 sent with flag 2
        ("000" + "10101" + "00000000", 2, 3, "key byte count|extra bytes"),
        ("000" + "10101" + "1", 2, 3, "padding"),
        ("000" + "0110", 2, 3, "wrong W"),  # widest delta 2 has 2 bits, W says 3
        ("000" + "10101", 3, 3, "ends before"),  # a third key's flag past the last byte
    ]
    for stream, d, W, match in cases:
        with pytest.raises(mpicomp.PayloadError, match=match):
            c.decode(one_bucket(stream, d, W, n=8 if "outside" in match else 64))
    # 300 keys of W = 0 need 75 bytes of flags at least.
    with pytest.raises(mpicomp.PayloadError, match="key byte count"):
        c.decode(one_bucket("00", 300, 0, n=300))
    # A huge shape with bucket = 0 is refused before anything is allocated.
    raw = struct.pack("<dIBBH", 1.1, 0, 127, 2, 0) + struct.pack("<fIIB", 0.0, 0, 0, 0)
    with pytest.raises(mpicomp.PayloadError, match="impossible"):
        c.decode(forge(np.frombuffer(raw, np.uint8), (2**35,)))
    with pytest.raises(mpicomp.PayloadError, match="flags"):
        c.decode(_wire.pack("fastsgd", (64,), body_of(one_bucket("000" + "10101", 2, 3), 1), 1))


@given(data=st.binary(max_size=200), n=st.integers(0, 300))
def test_random_bodies_never_crash(data, n):
    c = mpicomp.codec("fastsgd")
    try:
        y = c.decode(forge(np.frombuffer(data, np.uint8), (n,)))
    except mpicomp.PayloadError:
        return
    assert y.shape == (n,) and np.all(np.isfinite(y))


@given(pos=st.integers(0, 10**6), value=st.integers(0, 255), seed=st.integers(0, 100))
def test_mutated_bodies_decode_or_raise_payload_error(pos, value, seed):
    x = gradient_like(700, seed=seed)
    body = body_of(mpicomp.codec("fastsgd", bucket=100).encode(x), 1).copy()
    body[pos % body.size] = value
    try:
        y = mpicomp.codec("fastsgd").decode(forge(body, (700,)))
    except mpicomp.PayloadError:
        return
    assert y.shape == (700,) and np.all(np.isfinite(y))


# ---------------------------------------------------------------- exact sums, gather sums


@pytest.mark.parametrize("n", [2, 1000, 70_000])
@pytest.mark.parametrize("spread", [0, 20, 40, 60, 90, 250])
def test_exact_sum_over_every_exponent_spread(n, spread):
    # The fast fixed-point windows cover 2 * (40 - bit_length(n)) binades below the
    # largest value; wider spreads take the per-exponent bins. Both round once.
    rng = np.random.default_rng(n + spread)
    e = rng.integers(-spread, 1, n) + 100
    x = (rng.random(n) + 0.5) * 2.0 ** (e.astype(np.float64) - 127)
    x = x.astype(np.float32)
    x[rng.integers(0, n, n // 4)] = 0.0
    body = body_of(mpicomp.codec("fastsgd", bucket=0).encode(x), 1)
    assert struct.unpack_from("<f", body, 16)[0] == ref_abs_sum(x)


@pytest.mark.parametrize("bucket", [0, 100, DEFAULT_BUCKET])
@pytest.mark.parametrize("n", [0, 1, 999, 300_001])
def test_decode_sum_is_the_float32_sum_of_decodes(bucket, n):
    c = mpicomp.codec("fastsgd", bucket=bucket)
    payloads = [c.encode(gradient_like(n, seed=s)) for s in range(4)]
    expected = np.zeros(n, np.float32)
    for p in payloads:
        expected += c.decode(p)
    total = c.decode_sum(payloads, numel=n)
    assert total.dtype == np.float32 and total.shape == (n,)
    np.testing.assert_array_equal(total, expected)


def test_decode_sum_refuses_bad_payloads_before_adding():
    c = mpicomp.codec("fastsgd", bucket=100)
    good = c.encode(gradient_like(700, seed=1))
    with pytest.raises(mpicomp.PayloadError):
        c.decode_sum([good, c.encode(gradient_like(701, seed=1))], numel=700)
    body = body_of(good, 1).copy()
    body[-1] ^= 0xFF
    with pytest.raises(mpicomp.PayloadError):
        c.decode_sum([good, forge(body, (700,))], numel=700)


def _bucket_starts(body, n, bucket):
    """The byte offsets of each bucket's header in a valid body (the walk the scan makes)."""
    starts, pos = [], 16
    for _ in range(-(-n // bucket)):
        starts.append(pos)
        d, kb = struct.unpack_from("<II", body, pos + 4)
        pos += 13 + d + kb
    return starts


# Bucket 2 of five (bucket 1024, n 5000) made corrupt, the payload then sealed again: what
# the scan refuses (its message), whatever the decode would make of the bytes.
GATHERED_CORRUPTIONS = {
    "d beyond the bucket": (lambda b, at: struct.pack_into("<I", b, at + 4, 1025), "more values"),
    "d of 2**32 - 1": (lambda b, at: struct.pack_into("<I", b, at + 4, 2**32 - 1), "more values"),
    "key_bytes past the end": (
        lambda b, at: struct.pack_into("<I", b, at + 8, 2**32 - 1),
        "key byte count",
    ),
    "key_bytes 0": (lambda b, at: struct.pack_into("<I", b, at + 8, 0), "key byte count"),
    "W too wide": (lambda b, at: struct.pack_into("B", b, at + 12, 30), "key width W"),
    "a NaN sum": (lambda b, at: struct.pack_into("<f", b, at, float("nan")), "sum is negative"),
    "key_bytes one too large": (
        lambda b, at: struct.pack_into("<I", b, at + 8, struct.unpack_from("<I", b, at + 8)[0] + 1),
        "is inconsistent",
    ),
    "d one too small": (
        lambda b, at: struct.pack_into("<I", b, at + 4, struct.unpack_from("<I", b, at + 4)[0] - 1),
        "is inconsistent",
    ),
}


@pytest.mark.parametrize("where", ["numpy", "host-backed"])
@pytest.mark.parametrize("name", [*GATHERED_CORRUPTIONS, "truncated", "header cut"])
def test_a_corrupt_gathered_payload_raises_the_scans_error_after_one_read(where, name):
    """A gathered payload whose bucket headers are corrupt (sealed again: the checksum
    agrees), beside a good one: the scan's PayloadError, the same on NumPy and on device
    arrays, where it comes with the checksums' and the decodes' errors in the caller's one
    read: the decode runs first, on the buckets the scan checked only."""
    import _device_arrays as D
    from _devices import place

    from mpicomp.kernels import backend
    from mpicomp.kernels.readback import batch

    n, bucket = 5000, 1024
    codec = mpicomp.codec("fastsgd", bucket=bucket)
    good = codec.encode(gradient_like(n, seed=21))
    body = body_of(codec.encode(gradient_like(n, seed=22)), 1).copy()
    at = _bucket_starts(body, n, bucket)[2]
    if name == "truncated":  # the body ends inside bucket 2's codes
        body, match = body[: at + 20], "runs past the end"
    elif name == "header cut":  # ... or inside its header
        body, match = body[: at + 7], "runs past the end"
    else:
        edit, match = GATHERED_CORRUPTIONS[name]
        edit(body, at)
    bad = forge(body, (n,))
    with pytest.raises(mpicomp.PayloadError, match=match) as numpy_error:
        codec.decode_gathered([good, bad], n)
    if where == "numpy":
        return
    to_device, _, _ = place(where)
    dev = backend(D.BACKEND).device
    payloads = [to_device(good), to_device(bad)]
    D.reset_syncs()
    before, reached = dev.syncs, False
    with pytest.raises(mpicomp.PayloadError) as error:
        with batch("end"):
            codec.decode_gathered(payloads, n)
            reached = True  # nothing was read yet: the checks raise when the batch is
    assert reached and dev.syncs - before == 1
    assert D.SYNCS["implicit"] == 0
    assert str(error.value) == str(numpy_error.value)
    assert str(error.value).startswith("fastsgd payload is inconsistent: ")  # the scan's


@pytest.mark.parametrize("where", ["numpy", "host-backed"])
def test_gathered_payloads_decode_with_one_read_as_decode_sum(where):
    import _device_arrays as D
    from _devices import place

    from mpicomp.kernels import backend
    from mpicomp.kernels.readback import batch

    n = 5000
    codec = mpicomp.codec("fastsgd", bucket=1024)
    payloads = [codec.encode(gradient_like(n, seed=s)) for s in range(3)]
    want = np.zeros(n, np.float32)
    for p in payloads:
        want += codec.decode(p)
    to_device, to_host, _ = place(where)
    dev = backend(D.BACKEND).device if where == "host-backed" else None
    before = dev.syncs if dev else 0
    with batch("end"):
        total = codec.decode_gathered([to_device(p) for p in payloads], n)
    if dev:
        assert dev.syncs - before == 1
    np.testing.assert_array_equal(to_host(total), want)
