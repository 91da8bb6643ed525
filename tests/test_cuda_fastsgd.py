"""The CUDA ``fastsgd`` launchers (kernels/cuda/fastsgd.cu), run on the CPU through the
emulation, give the numba twin's bytes on two launch geometries."""

import numpy as np
import pytest
from _devices import device, params

from mpicomp.kernels import fastsgd as K
from mpicomp.kernels.cpu import fastsgd as nf
from mpicomp.kernels.cuda import fastsgd as cf

NUMBA = nf.encode, nf.mpicomp_fastsgd_assemble, nf.mpicomp_fastsgd_scan, nf.mpicomp_fastsgd_decode
TINY = np.float32(1e-39)  # subnormal: flushed by a careless float32 operation under -ftz


@pytest.fixture(scope="module", params=params())
def dev(request):
    d = device(request.param)
    d.fs = cf.launchers(d)
    return d


def gradient(n, seed, scale=1e-3):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    if n:
        x[rng.integers(0, n, max(1, n // 50))] *= np.float32(20)
    return x


def sparse(n, seed, nnz):
    """Zeros with nnz values far apart: gaps longer than a chunk, chunks that keep nothing."""
    rng = np.random.default_rng(seed)
    x = np.zeros(n, np.float32)
    x[rng.choice(n, nnz, replace=False)] = rng.standard_normal(nnz).astype(np.float32)
    return x


def encode_both(dev, x, bucket, base, tau, fb):
    """Encode with both twins; assert equal results; return the numba ones."""
    n = x.size
    nb = -(-n // bucket) if n else 0
    cap = K.bucket_capacity(min(bucket, n), fb)
    powers = nf.mpicomp_fastsgd_powers(base, tau)
    got = []
    for enc in (nf.encode, dev.fs.encode):
        scratch = np.full(nb * cap, 0xA5, np.uint8)
        sizes = np.full(nb, -7, np.int64)
        ok = enc(x, bucket, powers, fb, scratch, cap, sizes)
        got.append((bool(ok), sizes, scratch))
    (ok, sizes, scratch), (ok2, sizes2, scratch2) = got
    assert ok == ok2
    np.testing.assert_array_equal(sizes2, sizes)
    for k in range(nb):
        lo = k * cap
        assert scratch2[lo : lo + sizes[k]].tobytes() == scratch[lo : lo + sizes[k]].tobytes(), k
    return ok, sizes, scratch, cap


def body_of(x, bucket, base, tau, fb):
    """The numba twin's body: prefix, then the assembled buckets."""
    n = x.size
    nb = -(-n // bucket) if n else 0
    cap = K.bucket_capacity(min(bucket, n), fb)
    scratch = np.zeros(nb * cap, np.uint8)
    sizes = np.zeros(nb, np.int64)
    assert nf.encode(x, bucket, nf.mpicomp_fastsgd_powers(base, tau), fb, scratch, cap, sizes)
    offsets = K.PREFIX_BYTES + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    body = np.zeros(K.PREFIX_BYTES + int(sizes.sum()), np.uint8)
    body[:8] = np.frombuffer(np.float64(base).tobytes(), np.uint8)
    body[8:12] = np.frombuffer(np.uint32(bucket).tobytes(), np.uint8)
    body[12], body[13] = tau, fb
    nf.mpicomp_fastsgd_assemble(scratch, cap, sizes, offsets[:nb], body)
    return body


# ---- powers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("base", [1.0001, 1.1, 3.7, 16.0])
@pytest.mark.parametrize("tau", [1, 127])
def test_powers(dev, base, tau):
    want = nf.mpicomp_fastsgd_powers(base, tau)
    assert dev.fs.powers(base, tau).tobytes() == want.tobytes()


# ---- encode ----------------------------------------------------------------------------------

# What both twins encode, scan and decode: (n, bucket, base, tau, flag_bits): ragged tails,
# buckets of several chunks (2048), one bucket per element, every flag size, bases on both
# sides of the L table's one-step rule.
CASES = [
    (0, 16, 1.1, 127, 2),
    (1, 1, 1.1, 127, 2),
    (7, 3, 1.1, 127, 1),
    (2049, 4500, 1.1, 127, 2),
    (5001, 4500, 1.1, 127, 3),
    (4500, 1000, 1.001, 127, 4),
    (3001, 777, 2.0, 6, 5),
    (1500, 1500, 16.0, 127, 1),
    (1500, 500, 16.0, 127, 4),
    (2500, 33, 1.3, 20, 1),
    (2500, 33, 1.3, 20, 2),
]


@pytest.mark.parametrize("n, bucket, base, tau, fb", CASES)
def test_encode_gradient(dev, n, bucket, base, tau, fb):
    ok, *_ = encode_both(dev, gradient(n, n + fb), bucket, base, tau, fb)
    assert ok


@pytest.mark.parametrize("fb", [1, 2, 5])
def test_encode_sparse_gaps_across_chunks(dev, fb):
    # Keys 3000+ apart: whole chunks keep nothing; W reaches 13 bits.
    ok, sizes, *_ = encode_both(dev, sparse(9000, fb, 4), 9000, 1.1, 127, fb)
    assert ok and sizes[0] > K.BUCKET_HEAD_BYTES


def test_encode_extreme_values(dev):
    x = gradient(4200, 3)
    x[:300] = 0.0  # a bucket of zeros: sum 0, nothing kept
    x[600] = 5.0  # the only value of its bucket: L = 0
    x[601:900] = 0.0
    x[900:1200] = np.float32(3e38)  # the sum saturates at FLT_MAX
    x[1200:1500] = -TINY * np.arange(300, dtype=np.float32)  # subnormals only
    x[1500:1800:7] = np.float32(-1e-45)  # the smallest subnormal beside normal values
    x[2000] = -0.0
    ok, *_ = encode_both(dev, x, 300, 1.1, 127, 2)
    assert ok
    ok, *_ = encode_both(dev, x, 300, 16.0, 127, 3)
    assert ok
    ok, *_ = encode_both(dev, x, 300, 1.001, 127, 4)  # the exact walk down the L table
    assert ok


def tiny(n, seed, normal=0.0):
    """Signed subnormals, log-uniform over every binade (bit patterns 1 .. 2^23 - 1), a
    fraction ``normal`` of them replaced by values of the lowest normal binades."""
    rng = np.random.default_rng(seed)
    top = rng.integers(0, 23, n)
    bits = rng.integers(1 << top, 2 << top).astype(np.uint32)
    low = ((rng.integers(1, 8, n) << 23) | rng.integers(0, 1 << 23, n)).astype(np.uint32)
    bits = np.where(rng.random(n) < normal, low, bits)
    bits |= (rng.random(n) < 0.5).astype(np.uint32) << np.uint32(31)
    return bits.view(np.float32)


def check_levels(x, bucket, base, tau, sizes, scratch, cap):
    """Assert each bucket's L codes are the smallest L with q[L] = sum / b^L <= |v| (the
    definition, in float64); return how many subnormal values were kept."""
    powers = nf.mpicomp_fastsgd_powers(base, tau)
    nsub = 0
    for k in range(sizes.size):
        slot = scratch[k * cap : k * cap + sizes[k]]
        s = np.float64(slot[:4].view(np.float32)[0])
        d = int(slot[4:8].view(np.uint32)[0])
        v = x[k * bucket : (k + 1) * bucket]
        a = np.abs(v).astype(np.float64)
        q = s / powers
        keys = np.flatnonzero(a >= q[tau]) if s > 0 else np.zeros(0, np.int64)
        assert d == keys.size, k
        want = [int(np.argmax(q <= a[i])) for i in keys]
        codes = slot[K.BUCKET_HEAD_BYTES : K.BUCKET_HEAD_BYTES + d]
        np.testing.assert_array_equal(codes & 0x7F, want, err_msg=f"bucket {k}")
        np.testing.assert_array_equal(codes >> 7, v[keys] < 0)
        nsub += np.count_nonzero(a[keys] < np.finfo(np.float32).tiny)
    return nsub


@pytest.mark.parametrize("base", [1.001, 1 + 2.0**-7, 1.01, 1.1, 2.0, 16.0])
@pytest.mark.parametrize("bucket, tau, normal", [(2, 127, 0.3), (5, 40, 0.3), (64, 127, 0.0)])
def test_encode_levels_of_kept_subnormals(dev, base, bucket, tau, normal):
    # Buckets with sums small enough to keep subnormal values, bases on both sides of the L
    # table's one-step rule: both twins give the same bytes, and the L codes are exact.
    x = tiny(100 * bucket, bucket + tau, normal)  # 100 buckets (the emulation is per chunk)
    ok, sizes, scratch, cap = encode_both(dev, x, bucket, base, tau, 2)
    assert ok
    nsub = check_levels(x, bucket, base, tau, sizes, scratch, cap)
    assert nsub > 0 or (base, bucket) == (1.001, 64)  # 1.001^127 = 1.14: sums of 64 keep none


@pytest.mark.parametrize("base", [1.1, 2.0, 16.0])
def test_encode_levels_of_subnormals_across_chunks(dev, base):
    # One bucket of subnormals spanning three chunks (2048 values each).
    x = tiny(6000, 11)
    ok, sizes, scratch, cap = encode_both(dev, x, 6000, base, 127, 3)
    assert ok
    assert check_levels(x, 6000, base, 127, sizes, scratch, cap) > 0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encode_nan_inf(dev, bad):
    x = gradient(3000, 9)
    x[1234] = bad
    ok, sizes, *_ = encode_both(dev, x, 1000, 1.1, 127, 2)
    assert not ok and sizes[1] == 0
    x = gradient(3000, 9)
    x[-1] = bad
    ok, *_ = encode_both(dev, x, 3000, 1.1, 127, 2)
    assert not ok


# ---- assemble --------------------------------------------------------------------------------


@pytest.mark.parametrize("n, bucket", [(0, 8), (3000, 1000), (5000, 70)])
def test_assemble(dev, n, bucket):
    fb = 2
    _, sizes, scratch, cap = encode_both(dev, gradient(n, 1), bucket, 1.1, 127, fb)
    offsets = K.PREFIX_BYTES + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    offsets = offsets[: sizes.size]
    total = K.PREFIX_BYTES + int(sizes.sum())
    want = np.full(total, 0x5A, np.uint8)
    got = want.copy()
    nf.mpicomp_fastsgd_assemble(scratch, cap, sizes, offsets, want)
    dev.fs.assemble(scratch, cap, sizes, offsets, got)
    assert got.tobytes() == want.tobytes()


# ---- scan and decode -------------------------------------------------------------------------


def scan_both(dev, body, n, bucket, fb):
    nb = -(-n // bucket) if n else 0
    res = []
    for scan in (nf.mpicomp_fastsgd_scan, dev.fs.scan):
        offsets = np.full(nb + 1, -3, np.int64)
        sums = np.full(nb, 7, np.uint32)
        res.append((int(scan(body, n, bucket, fb, offsets, sums)), offsets, sums))
    (e, o, s), (e2, o2, s2) = res
    assert e2 == e
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(s2, s)
    return e, o, s


def decode_both(dev, body, n, bucket, base, tau, fb, offsets, sums, init=None):
    """Decode with both twins (into ``init``'s copies when accumulating); compare errs and out."""
    powers = nf.mpicomp_fastsgd_powers(base, tau)
    res = []
    for decode in (nf.mpicomp_fastsgd_decode, dev.fs.decode):
        out = np.full(n, np.float32(9.0)) if init is None else init.copy()
        errs = np.full(sums.size, -1, np.int64)
        decode(body, n, bucket, powers, fb, offsets, sums, out, errs, init is not None)
        res.append((errs, out))
    (errs, out), (errs2, out2) = res
    np.testing.assert_array_equal(errs2, errs)
    assert out2.tobytes() == out.tobytes()
    return errs, out


@pytest.mark.parametrize("n, bucket, base, tau, fb", CASES)
def test_scan_and_decode_valid(dev, n, bucket, base, tau, fb):
    x = gradient(n, n)
    body = body_of(x, bucket, base, tau, fb)
    err, offsets, sums = scan_both(dev, body, n, bucket, fb)
    assert err == K.OK
    errs, out = decode_both(dev, body, n, bucket, base, tau, fb, offsets, sums)
    assert not errs.any()
    # accumulate onto values that include subnormals and signed zeros
    init = gradient(n, 5) * np.float32(1e-3)
    init[::5] = TINY
    init[1::7] = -0.0
    errs, _ = decode_both(dev, body, n, bucket, base, tau, fb, offsets, sums, init)
    assert not errs.any()


def test_decode_subnormal_values(dev):
    # Subnormal inputs and base 16: the decoded float32 values are subnormal too.
    x = (TINY * gradient(3000, 2, scale=1.0)).astype(np.float32)
    for base in (1.1, 16.0):
        body = body_of(x, 1000, base, 127, 2)
        _, offsets, sums = scan_both(dev, body, 3000, 1000, 2)
        errs, out = decode_both(dev, body, 3000, 1000, base, 127, 2, offsets, sums)
        assert not errs.any() and (out != 0).any()
        init = np.full(3000, -TINY)
        decode_both(dev, body, 3000, 1000, base, 127, 2, offsets, sums, init)


def test_scan_empty_and_zeros(dev):
    body = body_of(np.zeros(0, np.float32), 4, 1.1, 127, 2)
    assert scan_both(dev, body, 0, 4, 2)[0] == K.OK
    body = body_of(np.zeros(100, np.float32), 30, 1.1, 127, 2)
    err, offsets, sums = scan_both(dev, body, 100, 30, 2)
    assert err == K.OK
    decode_both(dev, body, 100, 30, 1.1, 127, 2, offsets, sums)


@pytest.mark.parametrize("seed", range(3))
def test_scan_corrupted_headers(dev, seed):
    n, bucket, fb = 2000, 300, 2
    body = body_of(gradient(n, seed), bucket, 1.1, 127, fb)
    rng = np.random.default_rng(seed)
    seen = set()
    for cut in (body.size - 1, body.size - 40, 20, 16, 10):  # truncated
        seen.add(scan_both(dev, body[:cut], n, bucket, fb)[0])
    seen.add(scan_both(dev, np.append(body, np.uint8(0)), n, bucket, fb)[0])  # trailing
    _, offsets, _ = scan_both(dev, body, n, bucket, fb)
    for _ in range(12):  # one header byte changed
        bad = body.copy()
        k = int(rng.integers(0, offsets.size - 1))
        bad[offsets[k] + int(rng.integers(0, K.BUCKET_HEAD_BYTES))] ^= np.uint8(
            rng.integers(1, 256)
        )
        seen.add(scan_both(dev, bad, n, bucket, fb)[0])
    assert len(seen) >= 3


@pytest.mark.parametrize(
    "field, value, want",
    [
        (4, 301, K.ERR_COUNT),  # d beyond the bucket
        (4, 2**32 - 1, K.ERR_COUNT),
        (8, 2**32 - 1, K.ERR_WIDTH),  # key_bytes past the end
        (8, 0, K.ERR_WIDTH),  # key_bytes too small for d keys
        (0, 0x7FC00000, K.ERR_SUM),  # a NaN sum
        (None, None, K.ERR_TRUNCATED),  # the body cut inside the bucket's codes
        (None, 0, K.ERR_TRUNCATED),  # cut inside its header
    ],
)
@pytest.mark.parametrize("bad", [0, 3, 6])
def test_decode_after_a_failed_scan_reads_only_the_checked_buckets(dev, field, value, want, bad):
    """A scan that fails at bucket ``bad`` leaves it and every bucket after it empty (their
    offsets equal, sums 0), the same in both twins; the decode run on that (before anyone
    reads the scan's error) writes the checked buckets' values and reads nothing of the
    rest, whose slices are zeroed or left as they were."""
    n, bucket, fb = 2000, 300, 2
    clean = body_of(gradient(n, 11), bucket, 1.1, 127, fb)
    _, good, good_sums = scan_both(dev, clean, n, bucket, fb)
    head = int(good[bad])
    if field is None:  # truncated: in the bucket's codes, or 5 bytes into its header
        body = clean[: head + (K.BUCKET_HEAD_BYTES + 3 if value is None else 5)].copy()
    else:
        body = clean.copy()
        body[head + field : head + field + 4] = np.frombuffer(np.uint32(value).tobytes(), np.uint8)
    err, offsets, sums = scan_both(dev, body, n, bucket, fb)
    assert err == want
    np.testing.assert_array_equal(offsets[: bad + 1], good[: bad + 1])
    assert (offsets[bad:] == head).all() and not sums[bad:].any()
    np.testing.assert_array_equal(sums[:bad], good_sums[:bad])
    clean_errs, clean_out = decode_both(dev, clean, n, bucket, 1.1, 127, fb, good, good_sums)
    assert not clean_errs.any()
    errs, out = decode_both(dev, body, n, bucket, 1.1, 127, fb, offsets, sums)
    assert not errs[:bad].any() and (errs[bad:] == K.ERR_TRUNCATED).all()
    cut = bad * bucket
    assert out[:cut].tobytes() == clean_out[:cut].tobytes() and not out[cut:].any()
    init = gradient(n, 12)
    errs, out = decode_both(dev, body, n, bucket, 1.1, 127, fb, offsets, sums, init)
    assert out[cut:].tobytes() == init[cut:].tobytes()


@pytest.mark.parametrize("fb", [1, 2, 4])
def test_decode_corrupted_streams(dev, fb):
    """Changed codes, key bits or key widths (the headers still pass the scan): the same
    errors, and the same values written before them."""
    n, bucket, tau = 3000, 700, 40
    clean = body_of(gradient(n, fb), bucket, 1.1, tau, fb)
    _, offsets, _ = scan_both(dev, clean, n, bucket, fb)
    rng = np.random.default_rng(fb)
    seen = set()
    for trial in range(6):
        body = clean.copy()
        for k in range(offsets.size - 1):
            head = offsets[k]
            if trial % 2:  # a bit flipped in the codes or the key stream
                p = rng.integers(head + K.BUCKET_HEAD_BYTES, offsets[k + 1])
                body[p] ^= np.uint8(1 << int(rng.integers(0, 8)))
            else:  # W one wider or narrower, or one key fewer
                what = int(rng.integers(0, 3))
                if what < 2:
                    body[head + 12] = max(int(body[head + 12]) + (1 if what else -1), 1)
                else:
                    body[head + 4] -= np.uint8(1)
        err, offs, sums = scan_both(dev, body, n, bucket, fb)
        if err != K.OK:
            continue
        errs, _ = decode_both(dev, body, n, bucket, 1.1, tau, fb, offs, sums)
        decode_both(dev, body, n, bucket, 1.1, tau, fb, offs, sums, np.ones(n, np.float32))
        seen.update(int(e) for e in errs)
    assert len(seen - {K.OK}) >= 2, seen


@pytest.mark.parametrize("fb", [1, 3])
def test_decode_short_stream(dev, fb):
    """The last bucket's key stream one byte short (its header agreeing): ERR_KEY_BITS."""
    n, bucket = 1000, 400
    body = body_of(gradient(n, 7), bucket, 1.1, 127, fb)
    _, offsets, _ = scan_both(dev, body, n, bucket, fb)
    last = offsets[-2]
    kb = body[last + 8 : last + 12].view(np.uint32)
    kb -= np.uint32(1)
    body = body[:-1]
    err, offsets, sums = scan_both(dev, body, n, bucket, fb)
    assert err == K.OK
    errs, _ = decode_both(dev, body, n, bucket, 1.1, 127, fb, offsets, sums)
    assert errs[-1] == K.ERR_KEY_BITS and not errs[:-1].any()


def test_host_syncs(dev):
    """encode and scan each bring one value to the host; the others none."""
    x = gradient(1000, 4)
    before = dev.syncs
    encode_both(dev, x, 400, 1.1, 127, 2)
    assert dev.syncs == before + 1
    body = body_of(x, 400, 1.1, 127, 2)
    _, offsets, sums = scan_both(dev, body, 1000, 400, 2)
    assert dev.syncs == before + 2
    decode_both(dev, body, 1000, 400, 1.1, 127, 2, offsets, sums)
    dev.fs.powers(1.1, 127)
    assert dev.syncs == before + 2


# ---- the parallel decode: segments, rounds, phases -------------------------------------------
# The CUDA decode splits each key stream into 64-bit segments (FS_SEG), blockDim.x of them a
# round, and finds where each segment's first field starts by composing per-segment phase
# tables. These tests forge streams whose fields cross segment and round boundaries, streams
# that end exactly at one, fixed-length fields (no resynchronization), the widest gaps, and
# corruptions at those places; the numba twin is the reference throughout.

SEG = 64  # FS_SEG in fastsgd.cu
GPU_GEOMETRY = (cf.DECODE_THREADS, 2)  # the GPU's decode block: its rounds, on the emulation


def bits_of(fields):
    """The MSB-first stream of (value, width) fields, zero-padded to bytes."""
    s = "".join(format(v, f"0{w}b") if w else "" for v, w in fields)
    s += "0" * (-len(s) % 8)
    return np.array([int(s[i : i + 8], 2) for i in range(0, len(s), 8)], np.uint8)


def key_fields(keys, W, fb, flag_of=None):
    """The (flag, delta) fields of sorted keys (the smallest flag for each delta, or
    ``flag_of(j, delta)``)."""
    nflags = 1 << fb
    width = [((c + 1) * W + nflags - 1) >> fb for c in range(nflags)]
    fields, prev = [], 0
    for j, key in enumerate(keys):
        delta = int(key) - prev
        prev = int(key)
        c = min(c for c in range(nflags) if width[c] >= delta.bit_length())
        if flag_of is not None:
            c = flag_of(j, delta, c)
        fields += [(c, fb), (delta, width[c])]
    return fields


def forge(buckets, bucket, base=1.1, tau=127, fb=2):
    """A body of buckets given as (sum, codes, W, stream bytes): any d, W and key bits."""
    parts = [
        np.frombuffer(np.float64(base).tobytes(), np.uint8),
        np.frombuffer(np.uint32(bucket).tobytes(), np.uint8),
        np.array([tau, fb, 0, 0], np.uint8),
    ]
    for s, codes, W, stream in buckets:
        head = np.array([np.float32(s).view(np.uint32), len(codes), len(stream)], np.uint32)
        parts += [head.view(np.uint8), np.array([W], np.uint8), np.asarray(codes, np.uint8)]
        parts.append(np.asarray(stream, np.uint8))
    return np.concatenate(parts)


def valid_bucket(keys, blen, fb, rng, tau=127):
    """(sum, codes, W, stream) of a bucket keeping ``keys`` (as the encoder writes it)."""
    keys = np.asarray(keys, np.int64)
    gaps = np.diff(keys, prepend=0)
    W = int(gaps.max()).bit_length() if keys.size else 0
    codes = rng.integers(0, tau + 1, keys.size) | (rng.integers(0, 2, keys.size) << 7)
    return 1.0, codes, W, bits_of(key_fields(keys, W, fb)) if keys.size else []


def check_decode(dev, body, n, bucket, fb, base=1.1, tau=127):
    """Scan and decode ``body`` with both twins (both modes); return the errors."""
    err, offsets, sums = scan_both(dev, body, n, bucket, fb)
    assert err == K.OK
    errs, _ = decode_both(dev, body, n, bucket, base, tau, fb, offsets, sums)
    init = gradient(n, 3)
    init[::3] = -0.0
    errs2, _ = decode_both(dev, body, n, bucket, base, tau, fb, offsets, sums, init)
    np.testing.assert_array_equal(errs2, errs)
    return errs


@pytest.fixture(scope="module")
def gpu_geometry():
    d = device(GPU_GEOMETRY)
    d.fs = cf.launchers(d)
    return d


@pytest.mark.parametrize("fb", [1, 2, 3])
def test_decode_fixed_length_fields_ending_on_round_boundaries(dev, gpu_geometry, fb):
    """Every value kept (W = 1): fields of one length, which never resynchronize from a wrong
    phase; buckets of exactly 1, 2 and 3 rounds of 32, 64 and 128 segments, and tails of a
    few segments, a segment and a part of one."""
    flen = fb + 1
    blens = [32 * SEG // flen * r for r in (1, 2, 3)] + [4096 * 3 // flen, 3 * SEG, SEG, 7]
    for d in (dev, gpu_geometry):
        for blen in blens:
            x = np.ones(2 * blen + 5, np.float32)
            x[blen + 3] = -2.0  # a sign, and a value of another L
            body = body_of(x, blen, 16.0, 127, fb)
            assert not check_decode(d, body, x.size, blen, fb).any()


@pytest.mark.parametrize("fb", [1, 2, 5])
def test_decode_widest_gaps(dev, fb):
    """Keys at the two ends of each bucket (delta = blen - 1: W at its largest for blen), one
    key per bucket anywhere, and buckets of one key at 0 (W = 0)."""
    rng = np.random.default_rng(fb)
    for blen in (2, 3, 64, 65, 1 << 12, (1 << 13) + 1):
        buckets = [valid_bucket([0, blen - 1], blen, fb, rng)]
        buckets += [valid_bucket([blen - 1], blen, fb, rng), valid_bucket([0], blen, fb, rng)]
        buckets += [valid_bucket([int(rng.integers(0, blen))], blen, fb, rng)]
        buckets += [valid_bucket([], blen, fb, rng)]
        body = forge(buckets, blen, fb=fb)
        assert not check_decode(dev, body, blen * len(buckets), blen, fb).any()


def test_decode_sparse_buckets_many_rounds(dev):
    """Keys about 23 apart (W = 7 and 8; 13 phases beside fb = 5), streams of several rounds."""
    x = sparse(70000, 5, 3000)
    for fb in (2, 5):
        body = body_of(x, 35000, 1.1, 127, fb)
        assert not check_decode(dev, body, 70000, 35000, fb).any()


def test_decode_segments_with_no_field_start(dev):
    """Fields of up to 19 bits and single keys between long runs of empty buckets: rounds
    whose segments hold no key, and buckets with no stream at all."""
    rng = np.random.default_rng(4)
    blen = 1 << 17
    buckets = []
    for k in range(6):
        keys = np.sort(rng.choice(blen, 40 * k, replace=False)) if k % 2 else []
        buckets.append(valid_bucket(keys, blen, 2, rng))
    body = forge(buckets, blen, fb=2)
    assert not check_decode(dev, body, blen * len(buckets), blen, 2).any()


def stream_span(body, offsets, k):
    """(first byte, end) of bucket k's key stream in body."""
    d = int(body[offsets[k] + 4 : offsets[k] + 8].view(np.uint32)[0])
    return offsets[k] + K.BUCKET_HEAD_BYTES + d, offsets[k + 1]


@pytest.mark.parametrize("fb", [1, 2, 4])
def test_decode_bit_flips_at_segment_and_round_boundaries(dev, gpu_geometry, fb):
    """One key bit flipped beside a segment boundary (64 bits) or a round boundary (32, 64
    and 128 segments), in fixed-length and in varied fields: the same error code, and the
    same values written before it."""
    x = gradient(9000, fb)
    x[4500:6000] = 1.0  # a bucket of fixed-length fields
    n, bucket = x.size, 1500
    clean = body_of(x, bucket, 1.1, 127, fb)
    _, offsets, _ = scan_both(dev, clean, n, bucket, fb)
    spots = [SEG - 1, SEG, SEG + 1, 2048 - 1, 2048, 4096 + 1, 8192 - 1]
    seen = set()
    for k in range(offsets.size - 1):
        s0, s1 = stream_span(clean, offsets, k)
        for spot in spots:
            if s0 * 8 + spot >= s1 * 8:
                continue
            body = clean.copy()
            body[s0 + spot // 8] ^= np.uint8(0x80 >> (spot % 8))
            for d in (dev, gpu_geometry) if spot in (2048, 4096 + 1) else (dev,):
                errs = check_decode(d, body, n, bucket, fb)
                seen.add(int(errs[k]))
                assert not np.delete(errs, k).any()
    assert len(seen - {K.OK}) >= 2, seen


@pytest.mark.parametrize("fb", [1, 3])
def test_decode_random_corruptions(dev, fb):
    """Random bit flips in the codes and keys, streams cut or lengthened by whole bytes
    (their headers agreeing), codes above tau, non-minimal flags: any error code, and the
    values before it, as the twin's."""
    rng = np.random.default_rng(10 + fb)
    n, bucket, tau = 6000, 2000, 60
    clean = body_of(gradient(n, fb, scale=1e-2), bucket, 1.1, tau, fb)
    _, offsets, _ = scan_both(dev, clean, n, bucket, fb)
    seen = set()
    for trial in range(24):
        k = int(rng.integers(0, offsets.size - 1))
        s0, s1 = stream_span(clean, offsets, k)
        head = offsets[k]
        what = trial % 4
        body = clean.copy()
        if what == 0:  # a few bits anywhere in the bucket's codes and keys
            for p in rng.integers(head + K.BUCKET_HEAD_BYTES, s1, int(rng.integers(1, 4))):
                body[p] ^= np.uint8(1 << int(rng.integers(0, 8)))
        elif what == 1:  # a code above tau, late in the bucket
            d = s0 - head - K.BUCKET_HEAD_BYTES
            body[head + K.BUCKET_HEAD_BYTES + int(rng.integers(d // 2, d))] = tau + 1
        else:  # the key stream cut or lengthened by m bytes, key_bytes agreeing
            m = int(rng.integers(1, 3))
            cut = what == 2
            extra = rng.integers(0, 256 if trial % 8 < 4 else 1, m).astype(np.uint8)
            tail = body[s1:]
            body = np.concatenate([body[: s1 - m] if cut else np.append(body[:s1], extra), tail])
            kb = body[head + 8 : head + 12].view(np.uint32)
            kb[0] = int(kb[0]) + (-m if cut else m)
        err, offs, _ = scan_both(dev, body, n, bucket, fb)
        if err != K.OK:
            continue
        errs = check_decode(dev, body, n, bucket, fb, tau=tau)
        seen.update(int(e) for e in errs)
    assert len(seen - {K.OK}) >= 3, seen


def test_decode_forged_flags_and_orders(dev):
    """Keys forged with a wider flag than their delta needs (ERR_KEY_FLAG), a repeated key
    (ERR_KEY_ORDER), a key past the bucket, and a W no delta reaches (ERR_KEY_TAIL), each
    in the middle of a stream of several rounds."""
    rng = np.random.default_rng(8)
    fb, blen = 2, 20000
    keys = np.sort(rng.choice(blen, 6000, replace=False))
    W = int(np.diff(keys, prepend=0).max()).bit_length()
    codes = rng.integers(0, 128, keys.size)

    def bucket_with(fields, w=W, c=codes):
        return (1.0, c, w, bits_of(fields))

    mid = keys.size // 2
    wide = key_fields(keys, W, fb, lambda j, delta, c: 3 if j == mid else c)
    repeat = key_fields(np.insert(keys, mid, keys[mid]), W, fb)
    past = key_fields(np.append(keys[:-1], blen), W + 1, fb)
    cases = {
        K.ERR_KEY_FLAG: bucket_with(wide),
        K.ERR_KEY_ORDER: bucket_with(repeat, c=np.append(codes, 0)),
        K.ERR_KEY_TAIL: bucket_with(key_fields(keys, W + 1, fb), w=W + 1),
    }
    for want, b in cases.items():
        body = forge([valid_bucket(keys[:10], blen, fb, rng), b], blen, fb=fb)
        errs = check_decode(dev, body, 2 * blen, blen, fb)
        assert list(errs) == [K.OK, want]
    body = forge([(1.0, codes, W + 1, bits_of(past))], blen + 1, fb=fb)
    errs = check_decode(dev, body, blen, blen + 1, fb)  # the last bucket is blen long
    assert list(errs) == [K.ERR_KEY_ORDER]


def test_decode_w0_many_fields(dev):
    """W = 0 (every field is its flag alone) with many keys claimed: 64 / fb fields a segment,
    all but the first invalid."""
    for fb in (1, 2):
        for d in (2, 5, 200):
            kb = (d * fb + 7) // 8
            body = forge([(1.0, np.zeros(d, np.uint8), 0, np.zeros(kb, np.uint8))], 300, fb=fb)
            errs = check_decode(dev, body, 300, 300, fb)
            assert list(errs) == [K.ERR_KEY_ORDER]


@pytest.mark.parametrize("fb", [1, 2, 3])
def test_decode_padding_bits(dev, fb):
    """A one bit in any padding position of the last byte (ERR_KEY_TAIL), in streams that end
    inside a segment, on a segment boundary and past it."""
    rng = np.random.default_rng(fb)
    blen = 5000
    for d in (7, 64, 300):
        keys = np.sort(rng.choice(blen, d, replace=False))
        _, codes, W, stream = valid_bucket(keys, blen, fb, rng)
        used = len("".join(format(v, f"0{w}b") if w else "" for v, w in key_fields(keys, W, fb)))
        for pad in range(-used % 8):
            bad = stream.copy()
            bad[-1] |= np.uint8(1 << pad)
            body = forge([(1.0, codes, W, stream), (1.0, codes, W, bad)], blen, fb=fb)
            errs = check_decode(dev, body, 2 * blen, blen, fb)
            assert list(errs) == [K.OK, K.ERR_KEY_TAIL]
