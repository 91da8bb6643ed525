"""QSGD-MaxNorm family (the unbiased quantizers paper §3.1-3.4) against plain NumPy references.

The references (tests/_qsgd_ref.py) re-derive everything from the paper, docs/codecs.md
and the RNG's published schedule (splitmix64 of seed, step, stream, index); none calls our
kernels.
Statistical tests use fixed seeds and tolerances of 5-6 standard errors computed from
the exact variance, so they are deterministic and still fail on a bias or a wrong scale.
"""

import math

import numpy as np
import pytest
from _qsgd_ref import (
    levels_of,
    per_element,
    ref_block_norms,
    ref_coordinates,
    ref_cut,
    ref_ms_quantize,
    ref_norm,
    ref_quantize,
    ref_scale_index,
    ref_segments,
    ref_unit,
)
from hypothesis import given
from hypothesis import strategies as st

import mpicomp
from conftest import gradient_like, to_numpy

# ---------------------------------------------------------------- QSGD-MaxNorm


@given(n=st.integers(0, 10**5), seed=st.integers(0, 2**32 - 1), bits=st.integers(2, 16))
def test_quantize_matches_reference_any_length(n, seed, bits):
    x = gradient_like(n, seed=seed)
    c = mpicomp.codec("qsgd_maxnorm", bits=bits, seed=seed)
    norm = c.local_norm(x)
    assert norm == pytest.approx(ref_norm(x), rel=1e-6, abs=0)
    codes = c.quantize(x, norm, step=seed % 97, stream=3)
    assert codes.dtype == (np.int8 if bits <= 8 else np.int16) and codes.shape == (n,)
    np.testing.assert_array_equal(codes, ref_quantize(x, norm, bits, seed, seed % 97, 3))
    assert np.abs(codes.astype(np.int64)).max(initial=0) <= c.bound == levels_of(bits)
    back = c.dequantize(codes, norm)
    # one quantization interval: |Q(v) - v| <= norm / s, plus float32 rounding
    assert np.all(np.abs(back - x) <= norm / c.levels * (1 + 1e-5) + 1e-30)


def test_attributes_follow_the_bits():
    for bits, dtype in [(2, np.int8), (8, np.int8), (9, np.int16), (16, np.int16)]:
        c = mpicomp.codec("qsgd_maxnorm", bits=bits)
        assert c.levels == c.bound == 2 ** (bits - 1) - 1
        assert c.code_dtype == dtype
        assert c.aggregation == "integer_sum"
        assert np.iinfo(c.code_dtype).max >= c.bound


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (7,), (4, 5, 3)])
def test_round_trip_keeps_shape(xp, shape):
    n = math.prod(shape)
    host = (gradient_like(max(n, 1), seed=5)[:n] * np.float32(100)).reshape(shape)
    x = xp.asarray(host)
    c = mpicomp.codec("qsgd_maxnorm", bits=12)
    norm = c.local_norm(x)
    codes = c.quantize(x, norm)
    assert codes.shape == (n,) and type(codes) is type(x)
    back = c.dequantize(codes, norm, shape=shape)
    assert back.shape == shape and back.dtype == np.float32 and type(back) is type(x)
    np.testing.assert_allclose(to_numpy(back), host, rtol=0, atol=norm / c.levels * 1.0001)


def test_dtype_conversion_and_zero_norm():
    c = mpicomp.codec("qsgd_maxnorm", bits=6)
    x = gradient_like(1000, seed=1)
    norm = c.local_norm(x)
    for other in (np.float16, np.float64):
        y = x.astype(other)
        np.testing.assert_array_equal(c.quantize(y, norm), c.quantize(y.astype(np.float32), norm))
    zeros = np.zeros(50, np.float32)
    assert c.local_norm(zeros) == 0.0
    assert not c.quantize(zeros, 0.0).any()
    assert not c.dequantize(np.zeros(50, np.int32), 0.0).any()


def test_reproducible_for_same_counters_and_independent_across_streams():
    x = gradient_like(20_000, seed=2)
    c = mpicomp.codec("qsgd_maxnorm", bits=4, seed=11)
    norm = c.local_norm(x)
    a = c.quantize(x, norm, step=5, stream=1)
    np.testing.assert_array_equal(
        a, mpicomp.codec("qsgd_maxnorm", bits=4, seed=11).quantize(x, norm, step=5, stream=1)
    )
    for other in (
        c.quantize(x, norm, step=5, stream=2),
        c.quantize(x, norm, step=6, stream=1),
        mpicomp.codec("qsgd_maxnorm", bits=4, seed=12).quantize(x, norm, step=5, stream=1),
    ):
        assert np.count_nonzero(other != a) > 100  # the rounding noise changes


def test_unbiased_mean_of_many_quantizations():
    # s = 3 levels: a biased rounding would be off by up to norm / (2 s), many sigmas here.
    bits, steps, n = 3, 1000, 500
    x = gradient_like(n, seed=3)
    x[:50] = np.linspace(-0.05, 0.05, 50, dtype=np.float32)
    c = mpicomp.codec("qsgd_maxnorm", bits=bits)
    norm = c.local_norm(x) * 1.5  # another rank's larger norm
    acc = np.zeros(n)
    for t in range(steps):
        acc += c.dequantize(c.quantize(x, norm, step=t, stream=0), norm)
    mean = acc / steps
    y = ref_unit(x, norm) * np.float32(c.levels)
    p = (y - np.floor(y)).astype(np.float64)
    sigma = norm / c.levels * np.sqrt(p * (1 - p) / steps)  # exact per-element std of the mean
    assert np.all(np.abs(mean - x) <= 6 * sigma + 1e-6 * norm / c.levels)
    assert abs(np.sum(mean - x)) <= 5 * np.sqrt(np.sum(sigma**2)) + 1e-6 * norm


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_lemma_1_variance_bound(bits):
    n, steps = 2000, 200
    v = gradient_like(n, seed=bits)
    c = mpicomp.codec("qsgd_maxnorm", bits=bits, seed=1)
    w = 1.25 * c.local_norm(v)  # ‖w‖: the largest norm over ranks
    s = c.levels
    errs = np.array(
        [
            np.sum((c.dequantize(c.quantize(v, w, step=t), w) - v).astype(np.float64) ** 2)
            for t in range(steps)
        ]
    )
    measured = errs.mean()
    lemma = (1 + min(n / s**2, math.sqrt(n) / s)) * w**2
    assert measured <= lemma
    # and it is the exact variance sum_i (w/s)^2 p_i (1 - p_i), within 5 standard errors
    y = ref_unit(v, w) * np.float32(s)
    p = (y - np.floor(y)).astype(np.float64)
    exact = np.sum((w / s) ** 2 * p * (1 - p))
    se = math.sqrt(np.sum((w / s) ** 4 * p * (1 - p) * (1 - 2 * p) ** 2) / steps)
    assert abs(measured - exact) <= 5 * se + 1e-4 * exact


def test_codes_stay_bounded_with_a_norm_a_little_short():
    c = mpicomp.codec("qsgd_maxnorm", bits=2)
    x = np.array([1.0, -1.0, 0.5, 0.0], np.float32)
    short = float(np.float32(1.0) * np.float32(1 - 5e-7))  # within the 1e-6 slack
    for t in range(50):
        codes = c.quantize(x, short, step=t)
        assert np.abs(codes).max() <= c.bound
        assert codes[0] == 1 and codes[1] == -1
    with pytest.raises(ValueError, match="norm"):
        c.quantize(x, 0.99)


@pytest.mark.parametrize("nranks", [1, 2, 3, 5])
def test_sum_over_ranks_dequantizes_to_the_mean(nranks):
    n = 3001
    grads = [gradient_like(n, seed=10 + r) * np.float32(1 + r) for r in range(nranks)]
    c = mpicomp.codec("qsgd_maxnorm", bits=5)
    norm = max(c.local_norm(g) for g in grads)  # MaxAllReduce
    codes = [c.quantize(g, norm, step=4, stream=r) for r, g in enumerate(grads)]
    total = np.sum([q.astype(np.int32) for q in codes], axis=0, dtype=np.int32)
    assert np.abs(total).max() <= nranks * c.bound
    mean = np.mean([c.dequantize(q, norm) for q in codes], axis=0, dtype=np.float64)
    avg = c.dequantize(total, norm, nranks=nranks)
    np.testing.assert_allclose(avg, mean, rtol=0, atol=4e-7 * norm)
    expected = ((total.astype(np.float32) * np.float32(norm)) / np.float32(c.levels)) / np.float32(
        nranks
    )
    np.testing.assert_array_equal(avg, expected)  # the documented float32 op order


@pytest.mark.parametrize("name", ["qsgd_maxnorm", "qsgd_maxnorm_multiscale"])
def test_parallel_chunks_give_the_bytes_of_the_reference(name):
    n = 3 * (1 << 16) + 11  # four chunks of the parallel drivers, the last one short
    x = gradient_like(n, seed=12)
    c = mpicomp.codec(name, bits=4, seed=5)
    norm = c.local_norm(x)
    assert norm == pytest.approx(ref_norm(x), rel=1e-6, abs=0)
    assert norm == c.local_norm(x.copy())  # fixed summation order
    if name == "qsgd_maxnorm":
        codes = c.quantize(x, norm, step=3, stream=1)
        np.testing.assert_array_equal(codes, ref_quantize(x, norm, 4, 5, 3, 1))
        expected = (codes.astype(np.float32) * np.float32(norm)) / np.float32(7)
        np.testing.assert_array_equal(c.dequantize(codes, norm), expected / np.float32(1))
        return
    levels = c.scale_levels
    sidx = c.scale_index(x, norm)
    np.testing.assert_array_equal(sidx, ref_scale_index(x, norm, levels))
    codes = c.quantize(x, norm, sidx, step=3, stream=1)
    ref = ref_ms_quantize(x, norm, levels, sidx, 5, 3, 1, np.arange(n))
    np.testing.assert_array_equal(codes, ref)
    s = np.array(levels, np.float32)[sidx]
    expected = ((codes.astype(np.float32) * np.float32(norm)) / s) / np.float32(1)
    np.testing.assert_array_equal(c.dequantize(codes, norm, sidx), expected)


# ---------------------------------------------------------------- multi-scale


def simulated_shared_index(codec, grads, norm, **kw):
    return np.minimum.reduce([codec.scale_index(g, norm, **kw) for g in grads])  # MinAllReduce


@given(
    n=st.integers(0, 10**5),
    seed=st.integers(0, 2**32 - 1),
    bits=st.integers(2, 12),
    extra=st.lists(st.integers(0, 12), max_size=4),
)
def test_multiscale_matches_reference_any_length(n, seed, bits, extra):
    scales = [bits + e for e in extra]
    c = mpicomp.codec("qsgd_maxnorm_multiscale", bits=bits, scales=scales, seed=seed)
    levels = [levels_of(b) for b in sorted(set(scales) | {bits})]
    assert c.scale_levels == tuple(levels) and c.n_scales == len(levels)
    assert c.index_bits == math.ceil(math.log2(len(levels)))
    x = gradient_like(n, seed=seed)
    norm = c.local_norm(x)
    sidx = c.scale_index(x, norm)
    assert sidx.dtype == np.uint8
    np.testing.assert_array_equal(sidx, ref_scale_index(x, norm, levels))
    codes = c.quantize(x, norm, sidx, step=2, stream=1)
    ref = ref_ms_quantize(x, norm, levels, sidx, seed, 2, 1, np.arange(n))
    np.testing.assert_array_equal(codes, ref)
    assert np.abs(codes.astype(np.int64)).max(initial=0) <= c.bound == levels[0]
    back = c.dequantize(codes, norm, sidx)
    step_size = norm / np.array(levels, np.float64)[sidx]
    assert np.all(np.abs(back - x) <= step_size * (1 + 1e-5) + 1e-30)


def test_multiscale_defaults_and_index_order():
    c = mpicomp.codec("qsgd_maxnorm_multiscale")
    assert c.params["scales"] == (8, 12) and c.scale_levels == (127, 2047)
    assert c.bound == 127 and c.code_dtype == np.int8 and c.index_bits == 1
    c = mpicomp.codec("qsgd_maxnorm_multiscale", bits=2, scales=(10, 6, 6))
    assert c.params["scales"] == (2, 6, 10) and c.index_bits == 2
    x = np.array([1.0, 0.5, 0.02, 0.001, 0.0], np.float32)
    # a = 1 -> only s_min = 1 fits; 0.5 * 31 > 1 -> s_min; 0.02 * 31 <= 1 < 0.02 * 511; tiny -> finest
    np.testing.assert_array_equal(c.scale_index(x, 1.0), [0, 0, 1, 2, 2])


def test_multiscale_min_over_ranks_is_safe_and_unbiased():
    n, steps, nranks = 400, 600, 3
    grads = [gradient_like(n, seed=20 + r) * np.float32(r + 1) for r in range(nranks)]
    c = mpicomp.codec("qsgd_maxnorm_multiscale", bits=3, scales=(3, 6, 9))
    norm = max(c.local_norm(g) for g in grads)
    shared = simulated_shared_index(c, grads, norm)
    own = [c.scale_index(g, norm) for g in grads]
    assert len({tuple(o) for o in own}) > 1  # the ranks disagree somewhere
    acc = np.zeros(n)
    for t in range(steps):
        total = np.zeros(n, np.int32)
        for r, g in enumerate(grads):
            q = c.quantize(g, norm, shared, step=t, stream=r)
            assert np.abs(q).max() <= c.bound
            total += q
        acc += c.dequantize(total, norm, shared, nranks=nranks)
    mean = acc / steps
    target = np.mean(grads, axis=0, dtype=np.float64)
    # per rank and element |Q - v| <= norm / s; the variance of the average is at most
    # sum_r (norm / s_i)^2 / 4 / nranks^2 per step
    sigma = norm / np.array(c.scale_levels, np.float64)[shared] / 2 / math.sqrt(nranks * steps)
    assert np.all(np.abs(mean - target) <= 6 * sigma + 1e-6 * norm)
    with pytest.raises(ValueError, match="scale_index"):
        finer = np.full(n, c.n_scales - 1, np.uint8)
        c.quantize(grads[2] * 0 + norm, norm, finer)  # |v| = norm needs the coarsest scale


def test_multiscale_error_below_single_scale_at_the_same_bits():
    x = gradient_like(50_000, seed=4)  # mostly 1e-3, a few 2e-2: a wide dynamic range
    single = mpicomp.codec("qsgd_maxnorm", bits=4)
    multi = mpicomp.codec("qsgd_maxnorm_multiscale", bits=4)  # scales (4, 8)
    norm = single.local_norm(x)
    sidx = multi.scale_index(x, norm)
    err_single = err_multi = 0.0
    for t in range(4):
        err_single += np.sum((single.dequantize(single.quantize(x, norm, t), norm) - x) ** 2)
        codes = multi.quantize(x, norm, sidx, t)
        assert np.abs(codes).max() <= single.bound  # the same code width
        err_multi += np.sum((multi.dequantize(codes, norm, sidx) - x) ** 2)
    assert err_multi < 0.25 * err_single
    n, s_hat = x.size, multi.scale_levels[0]
    assert err_multi / 4 <= (1 + min(n / s_hat**2, math.sqrt(n) / s_hat)) * norm**2  # Lemma 2


# ---------------------------------------------------------------- GlobalRandK


@given(
    n=st.integers(0, 10**5),
    k=st.integers(1, 3000),
    seed=st.integers(0, 2**64 - 1),
    step=st.integers(0, 2**64 - 1),
)
def test_coordinates_match_floyd_reference(n, k, seed, step):
    c = mpicomp.codec("grandk_maxnorm", k=k, seed=seed)
    idx = c.coordinates(n, step)
    assert idx.dtype == np.int64 and idx.size == min(k, n) == c.num_coordinates(n)
    np.testing.assert_array_equal(idx, ref_coordinates(n, min(k, n), seed, step))


@pytest.mark.parametrize("n, k", [(1000, 3), (1000, 500), (1000, 1000), (257, 1), (256, 1)])
def test_coordinates_both_sort_paths(n, k):
    idx = mpicomp.codec("grandk_maxnorm", k=k, seed=9).coordinates(n, 2)
    np.testing.assert_array_equal(idx, ref_coordinates(n, k, 9, 2))
    assert np.all(np.diff(idx) > 0) and (idx.size == 0 or (idx[0] >= 0 and idx[-1] < n))


def test_coordinates_shared_by_ranks_and_fresh_each_step():
    a = mpicomp.codec("grandk_maxnorm", k=100, seed=3)
    b = mpicomp.codec("grandk_maxnorm", k=100, seed=3)
    np.testing.assert_array_equal(a.coordinates(10_000, 7), b.coordinates(10_000, 7))
    assert not np.array_equal(a.coordinates(10_000, 7), a.coordinates(10_000, 8))
    assert not np.array_equal(
        a.coordinates(10_000, 7),
        mpicomp.codec("grandk_maxnorm", k=100, seed=4).coordinates(10_000, 7),
    )
    # uniform: 10 of 50 coordinates per step, so over 2000 steps each is chosen
    # 400 times on average, with variance 2000 * 0.2 * 0.8 = 320
    u = mpicomp.codec("grandk_maxnorm", k=10, seed=3)
    counts = np.zeros(50)
    for t in range(2000):
        counts[u.coordinates(50, t)] += 1
    assert np.all(np.abs(counts - 400) <= 6 * math.sqrt(320))


def test_k_as_count_or_fraction():
    assert mpicomp.codec("grandk_maxnorm").num_coordinates(10**6) == 10_000  # the paper's K
    assert mpicomp.codec("grandk_maxnorm", k=50).num_coordinates(20) == 20
    assert (
        mpicomp.codec("grandk_maxnorm", k=0.3).num_coordinates(10) == 3
    )  # not ceil(3.0000000000000004)
    assert mpicomp.codec("grandk_maxnorm", k=0.25).num_coordinates(9) == 3
    assert mpicomp.codec("grandk_maxnorm", k=0.1).num_coordinates(5000) == 500
    assert mpicomp.codec("grandk_maxnorm", k=1.0).num_coordinates(7) == 7
    assert mpicomp.codec("grandk_maxnorm", k=0.01).num_coordinates(0) == 0


@given(n=st.integers(0, 10**5), seed=st.integers(0, 2**32 - 1), k=st.integers(1, 3000))
def test_grandk_quantize_matches_reference_any_length(n, seed, k):
    x = gradient_like(n, seed=seed)
    c = mpicomp.codec("grandk_maxnorm", bits=6, k=k, seed=seed)
    idx = c.coordinates(n, 5)
    norm = c.local_norm(x, step=5)
    assert norm == pytest.approx(ref_norm(x[idx]), rel=1e-6, abs=0)  # the selected sub-vector
    codes = c.quantize(x, norm, step=5, stream=2)
    np.testing.assert_array_equal(codes, ref_quantize(x, norm, 6, seed, 5, 2, index=idx))
    out = c.dequantize(codes, norm, shape=x.shape, step=5)
    expected = np.zeros(n, np.float32)
    if idx.size:
        vals = ((codes.astype(np.float32) * np.float32(norm)) / np.float32(c.levels)) / np.float32(
            1
        )
        expected[idx] = vals * np.float32(n / idx.size)
    np.testing.assert_array_equal(out, expected)


def test_grandk_unbiased_with_n_over_k_rescaling():
    n, k, steps = 200, 50, 2000
    x = gradient_like(n, seed=6) * np.float32(10)
    c = mpicomp.codec("grandk_maxnorm", bits=3, k=k)
    acc = np.zeros(n)
    for t in range(steps):
        norm = c.local_norm(x, step=t)
        acc += c.dequantize(c.quantize(x, norm, step=t), norm, shape=(n,), step=t)
    mean = acc / steps
    # out_i is (n/K) Q(v_i) with probability K/n, else 0, and |Q(v_i)| <= |v_i| + ‖x‖/s:
    # its variance is below (n/K) (|v_i| + ‖x‖/s)^2
    bound = np.abs(x.astype(np.float64)) + np.linalg.norm(x.astype(np.float64)) / c.levels
    sigma = np.sqrt(n / k * bound**2 / steps)
    assert np.all(np.abs(mean - x) <= 6 * sigma)
    assert abs(np.sum(mean - x)) <= 5 * math.sqrt(np.sum(sigma**2))
    assert abs(np.sum(mean * x) / np.sum(x.astype(np.float64) ** 2) - 1) < 0.1  # not K/n = 0.25


@pytest.mark.parametrize("name", ["grandk_maxnorm", "grandk_maxnorm_multiscale"])
def test_grandk_sum_over_ranks_dequantizes_to_the_mean(name):
    n, nranks = 5000, 3
    grads = [gradient_like(n, seed=30 + r) for r in range(nranks)]
    c = mpicomp.codec(name, bits=5, k=0.1, seed=2)
    norm = max(c.local_norm(g, step=9) for g in grads)
    extra = ()
    if name.endswith("multiscale"):
        extra = (simulated_shared_index(c, grads, norm, step=9),)
        assert extra[0].size == c.num_coordinates(n) == 500
    codes = [c.quantize(g, norm, *extra, step=9, stream=r) for r, g in enumerate(grads)]
    total = np.sum([q.astype(np.int32) for q in codes], axis=0, dtype=np.int32)
    each = [c.dequantize(q, norm, *extra, shape=(n,), step=9) for q in codes]
    avg = c.dequantize(total, norm, *extra, nranks=nranks, shape=(n,), step=9)
    np.testing.assert_allclose(avg, np.mean(each, axis=0), rtol=0, atol=1e-6 * norm * n / 500)
    assert np.count_nonzero(avg[np.setdiff1d(np.arange(n), c.coordinates(n, 9))]) == 0


@given(n=st.integers(0, 10**5), seed=st.integers(0, 2**32 - 1), k=st.integers(1, 3000))
def test_grandk_multiscale_matches_reference_any_length(n, seed, k):
    x = gradient_like(n, seed=seed)
    c = mpicomp.codec("grandk_maxnorm_multiscale", bits=4, scales=(8, 12), k=k, seed=seed)
    levels = [levels_of(b) for b in (4, 8, 12)]
    idx = c.coordinates(n, 1)
    norm = c.local_norm(x, step=1)
    sidx = c.scale_index(x, norm, step=1)
    np.testing.assert_array_equal(sidx, ref_scale_index(x[idx], norm, levels))
    codes = c.quantize(x, norm, sidx, step=1, stream=4)
    np.testing.assert_array_equal(
        codes, ref_ms_quantize(x[idx], norm, levels, sidx, seed, 1, 4, idx)
    )
    assert np.abs(codes.astype(np.int64)).max(initial=0) <= c.bound
    out = c.dequantize(codes, norm, sidx, shape=(n,), step=1)
    assert out.shape == (n,) and np.count_nonzero(out) <= idx.size


# ---------------------------------------------------------------- block norms

DENSE = ["qsgd_maxnorm", "qsgd_maxnorm_multiscale"]
SPARSE = ["grandk_maxnorm", "grandk_maxnorm_multiscale"]
CHUNK = 1 << 16


def split(n, parts, seed):
    """``parts`` tensor sizes adding to n (some may be empty), as 1-D shapes."""
    cuts = np.sort(np.random.default_rng(seed).integers(0, n + 1, parts - 1))
    return [(int(b - a),) for a, b in zip([0, *cuts], [*cuts, n], strict=True)]


def test_default_block_and_parameters():
    for name in DENSE + SPARSE:
        c = mpicomp.codec(name)
        assert c.params["block"] == 128 and c.params["per_tensor"] is True
        assert mpicomp.codec(name, block=None).params["block"] == 0
    c = mpicomp.codec("qsgd_maxnorm", block=4096.0, per_tensor=np.bool_(False))
    assert c.params["block"] == 4096 and c.params["per_tensor"] is False


@pytest.mark.parametrize(
    "numel, block, shapes, per_tensor",
    [
        (0, 16, None, True),
        (1, 16, None, True),
        (100, 16, None, True),
        (96, 16, None, True),
        (100, 0, None, True),
        (100, 1000, None, True),
        (100, 7, [(3, 4), (0,), (88,)], True),
        (100, 7, [(3, 4), (0,), (88,)], False),
        (100, 0, [(3, 4), (0,), (88,)], True),
        (100, 0, [(3, 4), (0,), (88,)], False),
        (5, 2, [(), (4,)], True),
        (3 * CHUNK, 0, [(CHUNK + 1,), (2 * CHUNK - 1,)], True),
    ],
)
@pytest.mark.parametrize("name", DENSE + SPARSE)
def test_blocks_are_cut_as_documented(name, numel, block, shapes, per_tensor):
    params = {"k": 0.37} if name in SPARSE else {}
    c = mpicomp.codec(name, block=block, per_tensor=per_tensor, **params)
    sizes = [math.prod(s) for s in shapes] if shapes else [numel]
    at = {"step": 4} if name in SPARSE else {}
    coords = c.coordinates(numel, 4) if name in SPARSE else None
    starts = c.blocks(numel, shapes=shapes, **at)
    np.testing.assert_array_equal(starts, ref_cut(ref_segments(sizes, per_tensor, coords), block))
    assert starts.dtype == np.int64 and not starts.flags.writeable
    x = gradient_like(numel, seed=numel)
    assert c.local_norms(x, shapes=shapes, **at).shape == (starts.size - 1,)


@given(
    n=st.integers(0, 20_000),
    block=st.sampled_from([0, 1, 2, 7, 64, 1000, 4096]),
    parts=st.integers(1, 4),
    per_tensor=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    bits=st.integers(2, 16),
)
def test_block_norms_codes_and_averages_match_the_reference(
    n, block, parts, per_tensor, seed, bits
):
    x = gradient_like(n, seed=seed) * np.float32(1 + seed % 7)
    shapes = split(n, parts, seed) if parts > 1 else None
    c = mpicomp.codec("qsgd_maxnorm", bits=bits, block=block, per_tensor=per_tensor, seed=seed)
    starts = ref_cut(ref_segments([s[0] for s in shapes] if shapes else [n], per_tensor), block)
    norms = c.local_norms(x, shapes=shapes)
    assert norms.dtype == np.float32
    np.testing.assert_array_equal(norms, ref_block_norms(x, starts))  # the documented order
    w = norms * np.float32(1.25)  # another rank's larger norms
    codes = c.quantize(x, w, step=3, stream=2, shapes=shapes)
    each = per_element(w, starts)
    np.testing.assert_array_equal(codes, ref_quantize(x, each, bits, seed, 3, 2))
    assert np.abs(codes.astype(np.int64)).max(initial=0) <= c.bound
    total = codes.astype(np.int64) * 3
    avg = c.dequantize(total, w, nranks=3, shapes=shapes)
    s = np.float32(c.levels)
    np.testing.assert_array_equal(avg, ((total.astype(np.float32) * each) / s) / np.float32(3))
    # one quantization interval of each element's block: |Q(v) - v| <= w_b / s
    assert np.all(np.abs(c.dequantize(codes, w, shapes=shapes) - x) <= each / s * 1.00001 + 1e-30)


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize(
    "block, shapes",
    [
        (1000, None),
        (CHUNK + 5, None),
        (0, [(CHUNK + 3,), (7,), (2 * CHUNK + 1,)]),
        (333, [(70_000,), (126_619,)]),
    ],
    ids=["1000", "chunk+5", "0-members", "333-members"],
)
def test_parallel_chunks_give_the_reference_bytes_by_block(name, block, shapes):
    n = 3 * (1 << 16) + 11  # four chunks of the parallel drivers, the last one short
    x = gradient_like(n, seed=21)
    c = mpicomp.codec(name, bits=4, block=block, seed=5)
    starts = ref_cut([s[0] for s in shapes] if shapes else [n], block)
    norms = c.local_norms(x, shapes=shapes)
    np.testing.assert_array_equal(norms, ref_block_norms(x, starts))
    each = per_element(norms, starts)
    if name == "qsgd_maxnorm":
        codes = c.quantize(x, norms, step=3, stream=1, shapes=shapes)
        np.testing.assert_array_equal(codes, ref_quantize(x, each, 4, 5, 3, 1))
        expected = ((codes.astype(np.float32) * each) / np.float32(7)) / np.float32(1)
        np.testing.assert_array_equal(c.dequantize(codes, norms, shapes=shapes), expected)
        return
    levels = c.scale_levels
    sidx = c.scale_index(x, norms, shapes=shapes)
    np.testing.assert_array_equal(sidx, ref_scale_index(x, each, levels))
    codes = c.quantize(x, norms, sidx, step=3, stream=1, shapes=shapes)
    np.testing.assert_array_equal(
        codes, ref_ms_quantize(x, each, levels, sidx, 5, 3, 1, np.arange(n))
    )
    s = np.array(levels, np.float32)[sidx]
    expected = ((codes.astype(np.float32) * each) / s) / np.float32(1)
    np.testing.assert_array_equal(c.dequantize(codes, norms, sidx, shapes=shapes), expected)


@given(
    n=st.integers(0, 20_000),
    k=st.integers(1, 3000),
    block=st.sampled_from([0, 1, 5, 64, 1000]),
    parts=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_grandk_block_norms_and_codes_match_the_reference(n, k, block, parts, seed):
    x = gradient_like(n, seed=seed)
    shapes = split(n, parts, seed) if parts > 1 else None
    for name in SPARSE:
        c = mpicomp.codec(name, bits=4, k=k, block=block, seed=seed)
        idx = c.coordinates(n, 7)
        sizes = [s[0] for s in shapes] if shapes else [n]
        starts = ref_cut(ref_segments(sizes, True, idx), block)
        norms = c.local_norms(x, step=7, shapes=shapes)
        np.testing.assert_array_equal(norms, ref_block_norms(x[idx], starts))
        each = per_element(norms, starts)
        if name == "grandk_maxnorm":
            codes = c.quantize(x, norms, step=7, stream=1, shapes=shapes)
            np.testing.assert_array_equal(codes, ref_quantize(x, each, 4, seed, 7, 1, index=idx))
            out = c.dequantize(codes, norms, shape=(n,), step=7, shapes=shapes)
            vals = ((codes.astype(np.float32) * each) / np.float32(7)) / np.float32(1)
        else:
            levels = c.scale_levels
            sidx = c.scale_index(x, norms, step=7, shapes=shapes)
            np.testing.assert_array_equal(sidx, ref_scale_index(x[idx], each, levels))
            codes = c.quantize(x, norms, sidx, step=7, stream=1, shapes=shapes)
            ref = ref_ms_quantize(x[idx], each, levels, sidx, seed, 7, 1, idx)
            np.testing.assert_array_equal(codes, ref)
            out = c.dequantize(codes, norms, sidx, shape=(n,), step=7, shapes=shapes)
            s = np.array(levels, np.float32)[sidx]
            vals = ((codes.astype(np.float32) * each) / s) / np.float32(1)
        expected = np.zeros(n, np.float32)
        if idx.size:
            expected[idx] = vals * np.float32(n / idx.size)
        np.testing.assert_array_equal(out, expected)


def test_one_norm_per_tensor_and_the_papers_one_norm():
    x = gradient_like(5000, seed=9)
    shapes = [(2000,), (3000,)]
    per_tensor = mpicomp.codec("qsgd_maxnorm", block=0)
    norms = per_tensor.local_norms(x, shapes=shapes)
    assert norms.tolist() == [per_tensor.local_norm(x[:2000]), per_tensor.local_norm(x[2000:])]
    paper = mpicomp.codec("qsgd_maxnorm", block=0, per_tensor=False)
    assert paper.local_norms(x, shapes=shapes).tolist() == [paper.local_norm(x)]
    # one number for every block gives the bytes of the paper's codec
    one = paper.local_norm(x)
    blocked = mpicomp.codec("qsgd_maxnorm")
    np.testing.assert_array_equal(
        blocked.quantize(x, one, step=2, shapes=shapes), paper.quantize(x, one, step=2)
    )
    np.testing.assert_array_equal(
        paper.quantize(x, np.array([one], np.float32), step=2), paper.quantize(x, one, step=2)
    )


def test_block_quantization_is_unbiased():
    # Blocks of 16 over a vector whose magnitudes differ by 1e3 between blocks, each
    # quantized against 1.5 times its own norm (another rank's) at s = 3.
    n, steps, block = 400, 1000, 16
    x = gradient_like(n, seed=13) * np.repeat(np.float32(10.0) ** np.arange(-2, 3), n // 5)
    c = mpicomp.codec("qsgd_maxnorm", bits=3, block=block)
    w = c.local_norms(x) * np.float32(1.5)
    acc = np.zeros(n)
    for t in range(steps):
        acc += c.dequantize(c.quantize(x, w, step=t, stream=0), w)
    mean = acc / steps
    each = per_element(w, c.blocks(n)).astype(np.float64)
    y = ref_unit(x, per_element(w, c.blocks(n))) * np.float32(c.levels)
    p = (y - np.floor(y)).astype(np.float64)
    sigma = each / c.levels * np.sqrt(p * (1 - p) / steps)  # exact std of the mean
    assert np.all(np.abs(mean - x) <= 6 * sigma + 1e-6 * each / c.levels)
    z = (mean - x) / np.maximum(sigma, 1e-30)
    assert abs(np.sum(z[sigma > 0])) <= 5 * math.sqrt(np.count_nonzero(sigma))


@pytest.mark.parametrize("bits, block", [(2, 16), (3, 64), (4, 1000), (8, 64)])
def test_variance_bound_holds_per_block(bits, block):
    """Lemma 1 per block b of d_b elements: E‖Q(v_b) - v_b‖² <= min(d_b/s², √d_b/s)‖w_b‖²."""
    n, steps = 3000, 200
    v = gradient_like(n, seed=bits + block)
    c = mpicomp.codec("qsgd_maxnorm", bits=bits, block=block, seed=1)
    starts = c.blocks(n)
    w = c.local_norms(v) * np.float32(1.25)
    s = c.levels
    errs = np.zeros(starts.size - 1)
    for t in range(steps):
        sq = (c.dequantize(c.quantize(v, w, step=t), w) - v).astype(np.float64) ** 2
        errs += np.add.reduceat(sq, starts[:-1]) / steps
    d = np.diff(starts)
    w64 = w.astype(np.float64)
    assert np.all(errs <= np.minimum(d / s**2, np.sqrt(d) / s) * w64**2)
    # and it is the exact variance sum_i (w_b/s)^2 p_i (1 - p_i), within 5 standard errors
    each = per_element(w, starts).astype(np.float64)
    y = ref_unit(v, per_element(w, starts)) * np.float32(s)
    p = (y - np.floor(y)).astype(np.float64)
    exact = np.add.reduceat((each / s) ** 2 * p * (1 - p), starts[:-1])
    var4 = np.add.reduceat((each / s) ** 4 * p * (1 - p) * (1 - 2 * p) ** 2, starts[:-1])
    assert np.all(np.abs(errs - exact) <= 5 * np.sqrt(var4 / steps) + 1e-4 * exact + 1e-30)


def test_blocks_cut_the_error_of_one_norm():
    x = gradient_like(200_000, seed=3)
    errs = {}
    for block in (0, 1024, 64):
        c = mpicomp.codec("qsgd_maxnorm", bits=4, block=block)
        w = c.local_norms(x)
        errs[block] = np.linalg.norm(c.dequantize(c.quantize(x, w), w) - x) / np.linalg.norm(x)
    assert errs[64] < errs[1024] < errs[0] / 4


def test_the_bench_error_drops_at_4m_elements(monkeypatch):
    """`mpicomp bench`'s rel.err column (one rank, no error feedback) at 4M elements: the
    paper's one norm against the default blocks (an error, not a timing)."""
    from mpicomp.tools.bench import kernels, workload

    rows = [("qsgd_maxnorm", {"bits": b, "block": d}) for b in (8, 2) for d in (0, 128)]
    monkeypatch.setattr(workload, "BENCH_SET", rows)
    err = {
        (r["params"]["bits"], r["params"]["block"]): r["rel_error"]
        for r in kernels.run(["qsgd_maxnorm"], numel=4_000_000, reps=1)
    }
    assert err[8, 0] > 2.0 and err[2, 0] > 25  # one norm: the error grows as n^(1/4)
    assert err[8, 128] < 0.05 and err[2, 128] < 3  # the default blocks
    assert err[8, 128] < err[8, 0] / 50 and err[2, 128] < err[2, 0] / 10


# ---------------------------------------------------------------- bad parameters and inputs


@pytest.mark.parametrize(
    "name, params, param",
    [
        ("qsgd_maxnorm", {"bits": 1}, "bits"),
        ("qsgd_maxnorm", {"bits": 17}, "bits"),
        ("qsgd_maxnorm", {"bits": 4.5}, "bits"),
        ("qsgd_maxnorm", {"bits": "8"}, "bits"),
        ("qsgd_maxnorm", {"seed": -1}, "seed"),
        ("qsgd_maxnorm", {"seed": 2**64}, "seed"),
        ("qsgd_maxnorm_multiscale", {"bits": 0}, "bits"),
        ("qsgd_maxnorm_multiscale", {"bits": 8, "scales": (4, 12)}, "scales"),
        ("qsgd_maxnorm_multiscale", {"scales": (8, 25)}, "scales"),
        ("qsgd_maxnorm_multiscale", {"scales": 12}, "scales"),
        ("qsgd_maxnorm_multiscale", {"scales": "12"}, "scales"),
        ("qsgd_maxnorm_multiscale", {"scales": (8, 10.5)}, "scales"),
        ("grandk_maxnorm", {"k": 0}, "k"),
        ("grandk_maxnorm", {"k": -3}, "k"),
        ("grandk_maxnorm", {"k": 0.0}, "k"),
        ("grandk_maxnorm", {"k": 1.5}, "k"),
        ("grandk_maxnorm", {"k": float("nan")}, "k"),
        ("grandk_maxnorm", {"k": "10"}, "k"),
        ("grandk_maxnorm", {"k": True}, "k"),
        ("grandk_maxnorm", {"bits": 17}, "bits"),
        ("grandk_maxnorm_multiscale", {"k": 0}, "k"),
        ("grandk_maxnorm_multiscale", {"bits": 6, "scales": (5,)}, "scales"),
    ],
)
def test_bad_parameter_names_the_parameter(name, params, param):
    with pytest.raises(_error_for(params), match=param):
        mpicomp.codec(name, **params)


def _error_for(params: dict) -> type:
    """What a bad parameter raises: TypeError for what is no number (a str, a bool,
    None), ValueError for a number out of range (docs/usage.md)."""
    wrong_type = any(isinstance(v, (str, bool, type(None))) for v in params.values())
    wrong_type |= params.get("scales") == 12  # one int where a sequence belongs
    return TypeError if wrong_type else ValueError


@pytest.mark.parametrize(
    "name",
    ["qsgd_maxnorm", "qsgd_maxnorm_multiscale", "grandk_maxnorm", "grandk_maxnorm_multiscale"],
)
def test_unknown_keyword_is_a_type_error(name):
    with pytest.raises(TypeError):
        mpicomp.codec(name, level=3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_is_reported(bad):
    x = gradient_like(1000, seed=8)
    x[537] = bad
    c = mpicomp.codec("qsgd_maxnorm")
    m = mpicomp.codec("qsgd_maxnorm_multiscale")
    g = mpicomp.codec("grandk_maxnorm", k=1.0)
    for call in (
        lambda: c.local_norm(x),
        lambda: c.quantize(x, 1.0),
        lambda: m.scale_index(x, 1.0),
        lambda: m.quantize(x, 1.0, np.zeros(1000, np.uint8)),
        lambda: g.local_norm(x),
        lambda: g.quantize(x, 1.0),
    ):
        with pytest.raises(ValueError, match="NaN or Inf"):
            call()


def test_norm_must_bound_x_and_be_a_finite_number():
    c = mpicomp.codec("qsgd_maxnorm")
    x = np.array([3.0, -4.0], np.float32)
    assert c.local_norm(x) == 5.0
    for bad in (3.9, 0.0):
        with pytest.raises(ValueError, match="norm"):
            c.quantize(x, bad)
    for bad in (-1.0, np.nan, np.inf, 1e39):
        with pytest.raises(ValueError, match="norm"):
            c.quantize(x, bad)
        with pytest.raises(ValueError, match="norm"):
            c.dequantize(np.zeros(2, np.int8), bad)
    with pytest.raises(TypeError, match="norm"):
        c.quantize(x, "5")
    np.testing.assert_array_equal(c.quantize(x, np.array([5.0])), c.quantize(x, 5.0))
    with pytest.raises(ValueError, match="overflows"):
        c.local_norm(np.full(4, 3e38, np.float32))


def test_counters_are_checked():
    c = mpicomp.codec("qsgd_maxnorm")
    x = np.ones(4, np.float32)
    for kw, name in [
        ({"step": -1}, "step"),
        ({"stream": -1}, "stream"),
        ({"stream": 2**64 - 1}, "stream"),
    ]:
        with pytest.raises(ValueError, match=name):
            c.quantize(x, 2.0, **kw)
    with pytest.raises(ValueError, match="nranks"):
        c.dequantize(np.zeros(4, np.int8), 2.0, nranks=0)


def test_dequantize_rejects_wrong_arrays():
    c = mpicomp.codec("qsgd_maxnorm", bits=4)
    with pytest.raises(TypeError, match="code_sum"):
        c.dequantize(np.zeros(4, np.float32), 1.0)
    with pytest.raises(TypeError, match="code_sum"):
        c.dequantize([1, 2, 3], 1.0)
    with pytest.raises(TypeError, match="code_sum"):
        c.dequantize(np.zeros(4, np.uint8), 1.0)
    with pytest.raises(ValueError, match="1-D"):
        c.dequantize(np.zeros((2, 2), np.int8), 1.0)
    with pytest.raises(ValueError, match="elements"):
        c.dequantize(np.zeros(4, np.int8), 1.0, shape=(5,))
    with pytest.raises(ValueError, match="nranks"):
        c.dequantize(np.array([0, 8, 0], np.int16), 1.0)  # beyond 1 * s = 7
    assert c.dequantize(np.array([0, 14, -14], np.int16), 1.0, nranks=2)[1] == 1.0
    with pytest.raises(TypeError):
        c.quantize(np.arange(4), 10.0)  # integer gradients are not floats


def test_scale_index_arrays_are_checked():
    c = mpicomp.codec("qsgd_maxnorm_multiscale", bits=4)
    x = gradient_like(100, seed=1)
    norm = c.local_norm(x)
    sidx = c.scale_index(x, norm)
    with pytest.raises(ValueError, match="scale_index"):
        c.quantize(x, norm, sidx[:-1])
    with pytest.raises(ValueError, match="outside the scale set"):
        c.quantize(x, norm, np.full(100, 2, np.uint8))
    with pytest.raises(TypeError, match="scale_index"):
        c.quantize(x, norm, sidx.astype(np.float32))
    codes = c.quantize(x, norm, sidx)
    with pytest.raises(ValueError, match="outside the scale set"):
        c.dequantize(codes, norm, np.full(100, 5, np.uint8))
    with pytest.raises(ValueError, match="scale_index"):
        c.dequantize(codes, norm, sidx[:50])


def test_grandk_dequantize_needs_the_full_shape_and_k_codes():
    c = mpicomp.codec("grandk_maxnorm", k=10)
    x = gradient_like(100, seed=2)
    norm = c.local_norm(x, step=1)
    codes = c.quantize(x, norm, step=1)
    assert codes.size == 10
    with pytest.raises(ValueError, match="shape"):
        c.dequantize(codes, norm, step=1)
    with pytest.raises(ValueError, match="code_sum"):
        c.dequantize(codes[:9], norm, shape=(100,), step=1)
    out = c.dequantize(codes, norm, shape=(10, 10), step=1)
    assert out.shape == (10, 10)
    np.testing.assert_array_equal(np.flatnonzero(out), c.coordinates(100, 1)[codes != 0])


@pytest.mark.parametrize("name", DENSE + SPARSE)
@pytest.mark.parametrize(
    "params, param",
    [
        ({"block": -1}, "block"),
        ({"block": 2.5}, "block"),
        ({"block": "64"}, "block"),
        ({"block": True}, "block"),
        ({"block": float("inf")}, "block"),
        ({"per_tensor": "yes"}, "per_tensor"),
        ({"per_tensor": 1}, "per_tensor"),
        ({"per_tensor": None}, "per_tensor"),
    ],
)
def test_bad_block_parameters_name_the_parameter(name, params, param):
    expected = ValueError if param == "per_tensor" else _error_for(params)
    with pytest.raises(expected, match=param):
        mpicomp.codec(name, **params)


@pytest.mark.parametrize("name", DENSE + SPARSE)
def test_shapes_and_block_norms_are_checked(name):
    c = mpicomp.codec(name, block=100, **({"k": 0.5} if name in SPARSE else {}))
    x = gradient_like(1000, seed=1)
    at = {"step": 2} if name in SPARSE else {}
    for bad in ([(999,)], [(500,), (501,)], [(2, -1)], [("a",)]):
        with pytest.raises(ValueError, match="shapes"):
            c.local_norms(x, shapes=bad, **at)
    norms = c.local_norms(x, **at)
    extra = (c.scale_index(x, norms, **at),) if name.endswith("multiscale") else ()
    out = {"shape": x.shape, **at} if name in SPARSE else {}
    codes = c.quantize(x, norms, *extra, **at)
    good = norms.copy()
    for bad, what in [
        (good[:-1], ValueError),
        (np.append(good, 1), ValueError),
        (good.reshape(1, -1), ValueError),
        (np.where(np.arange(good.size) == 2, np.nan, good), ValueError),
        (np.where(np.arange(good.size) == 2, -1.0, good), ValueError),
        (np.where(np.arange(good.size) == 2, np.inf, good), ValueError),
        (np.full(good.size, 1e39), ValueError),
        (good.astype(np.complex64), TypeError),
    ]:
        with pytest.raises(what, match="norm"):
            c.quantize(x, bad, *extra, **at)
        with pytest.raises(what, match="norm"):
            c.dequantize(codes, bad, *extra, **out)
    short = good.copy()
    short[3] *= np.float32(0.5)  # no longer bounds |x| in block 3
    with pytest.raises(ValueError, match="block's norm is below"):
        c.quantize(x, short, *extra, **at)
    with pytest.raises(ValueError, match="overflows"):
        c.local_norms(np.full(1000, 3e38, np.float32), **at)
    bad_x = x.copy()
    bad_x[c.coordinates(1000, 2)[5] if name in SPARSE else 5] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.local_norms(bad_x, **at)


# ---------------------------------------------------------------- packed code sums


def ref_pack(values, width):
    """LSB-first packing of non-negative ints at ``width`` bits, bit by bit."""
    v = np.asarray(values, dtype=np.uint64)
    bits = (v[:, None] >> np.arange(width, dtype=np.uint64)) & np.uint64(1)
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")


@pytest.mark.parametrize(
    "name",
    ["qsgd_maxnorm", "qsgd_maxnorm_multiscale", "grandk_maxnorm", "grandk_maxnorm_multiscale"],
)
@pytest.mark.parametrize("nranks", [1, 3, 4])
@pytest.mark.parametrize("n", [0, 13, 3 * (1 << 16) + 11])
def test_dequantize_packed_is_dequantize_of_the_unpacked_sums(name, nranks, n):
    """The ring's packed result (sum + offset at the full sum's width) decodes bit for bit."""
    params = {"k": 0.5} if name.startswith("grandk") else {}
    c = mpicomp.codec(name, bits=3 if nranks == 1 else 8, seed=2, **params)
    x = gradient_like(n, seed=n)
    step = 3
    at = {"step": step, "shape": x.shape} if name.startswith("grandk") else {}
    m = c.num_coordinates(n) if name.startswith("grandk") else n
    limit = nranks * c.bound
    sums = np.random.default_rng(n + nranks).integers(-limit, limit + 1, m)
    if m:
        sums[:2] = [-limit, limit]
    width = int(2 * limit).bit_length()
    data = ref_pack(sums + limit, width)
    norm = 0.25
    extra = ()
    if "multiscale" in name:
        extra = (np.random.default_rng(m).integers(0, c.n_scales, m).astype(np.uint8),)
    want = c.dequantize(sums.astype(np.int64), norm, *extra, nranks=nranks, **at)
    got = c.dequantize_packed(data, m, width, limit, norm, *extra, nranks=nranks, **at)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_dequantize_packed_rejects_wrong_streams():
    c = mpicomp.codec("qsgd_maxnorm", bits=4)
    data = ref_pack(np.array([7, 14, 0]), 4)
    assert list(c.dequantize_packed(data, 3, 4, 7, 7.0)) == [0.0, 7.0, -7.0]
    with pytest.raises(TypeError, match="uint8"):
        c.dequantize_packed(data.astype(np.int8), 3, 4, 7, 7.0)
    with pytest.raises(ValueError, match="bytes"):
        c.dequantize_packed(data[:1], 3, 4, 7, 7.0)
    with pytest.raises(ValueError, match="width"):
        c.dequantize_packed(data, 3, 33, 7, 7.0)
    with pytest.raises(ValueError, match="nranks"):
        c.dequantize_packed(ref_pack(np.array([15]), 4), 1, 4, 7, 7.0)  # 15 - 7 = 8 > s
    with pytest.raises(ValueError, match="elements"):
        c.dequantize_packed(data, 3, 4, 7, 7.0, shape=(4,))
    ms = mpicomp.codec("qsgd_maxnorm_multiscale", bits=4)
    with pytest.raises(ValueError, match="scale set"):
        ms.dequantize_packed(data, 3, 4, 7, 7.0, np.array([0, 2, 0], np.uint8))


# ---------------------------------------------------------------- a row alone (reduce-scatter)

QSGD_FAMILY = DENSE + SPARSE

# (numel, block, per_tensor, shapes): blocks, one norm per tensor, a bucket's tensors with
# blocks per tensor or across them, and rows longer than a CHUNK (the parallel drivers).
SPANS = [
    (1003, 128, True, None),
    (1003, 0, True, None),
    (1003, 7, True, [(3, 5), (0,), (900,), (88,)]),
    (1003, 7, False, [(3, 5), (0,), (900,), (88,)]),
    (1003, 0, True, [(3, 5), (0,), (900,), (88,)]),
    (2 * CHUNK + 4099, 128, True, [(CHUNK + 5,), (CHUNK + 4094,)]),
]


def fsdp_spans(n, nranks):
    """The rows [a, b) of n elements on ``nranks`` ranks (docs/sharded.md): S = ceil(n / N)."""
    width = -(-n // nranks)
    return [(min(n, r * width), min(n, (r + 1) * width)) for r in range(nranks)]


def ref_span(c, sums, norms, sidx, nranks, numel, shapes, coords, span):
    """NumPy: elements [a, b) of the dequantized tensor, from the whole coded vector's sums."""
    sizes = [math.prod(s) for s in shapes] if shapes else [numel]
    starts = ref_cut(ref_segments(sizes, c.params["per_tensor"], coords), c.params["block"])
    levels = np.float32(c.levels) if sidx is None else np.float32(c.scale_levels)[sidx]
    vals = ((sums.astype(np.float32) * per_element(norms, starts)) / levels) / np.float32(nranks)
    if coords is None:
        return vals[span[0] : span[1]]
    out = np.zeros(numel, np.float32)
    out[coords] = vals * np.float32(numel / coords.size)
    return out[span[0] : span[1]]


def span_case(name, numel, block, per_tensor, shapes, nranks=3, step=2):
    """Return (codec, the whole coded vector's sums, block norms, scale indices or None,
    coordinates or None, the codec's keywords of a step)."""
    params = {"k": 0.4} if name in SPARSE else {}
    c = mpicomp.codec(name, bits=4, block=block, per_tensor=per_tensor, seed=1, **params)
    at = {"step": step} if name in SPARSE else {}
    coords = ref_coordinates(numel, c.num_coordinates(numel), 1, step) if name in SPARSE else None
    m = numel if coords is None else coords.size
    rng = np.random.default_rng(numel + block)
    norms = c.local_norms(gradient_like(numel, seed=numel), shapes=shapes, **at) * np.float32(3)
    limit = nranks * c.bound
    sums = rng.integers(-limit, limit + 1, m)
    sidx = rng.integers(0, c.n_scales, m).astype(np.uint8) if c.multiscale else None
    return c, sums, norms, sidx, coords, at


def row_data(sums, lo, hi, limit, pad, rng):
    """Return (the sums lo <= j < hi packed as a ring leaves them, + limit at the full sum's
    width, then ``pad`` codes more, as a chunk's zero padding; the width)."""
    width = int(2 * limit).bit_length()
    tail = rng.integers(0, 2 * limit + 1, pad)
    return ref_pack(np.concatenate([sums[lo:hi] + limit, tail]), width), width


@pytest.mark.parametrize("name", QSGD_FAMILY)
@pytest.mark.parametrize("numel, block, per_tensor, shapes", SPANS)
def test_a_row_dequantizes_alone_to_the_whole_tensors_bits(name, numel, block, per_tensor, shapes):
    # A reduce-scatter's owner decodes its row from its sums alone: every element against its
    # block (found by its index in the tensor), as the whole tensor's dequantize gives it.
    nranks = 3
    c, sums, norms, sidx, coords, at = span_case(name, numel, block, per_tensor, shapes, nranks)
    extra = () if sidx is None else (sidx,)
    full = {"shape": (numel,), **at} if name in SPARSE else {}
    whole = c.dequantize(sums, norms, *extra, nranks=nranks, shapes=shapes, **full)
    rng = np.random.default_rng(5)
    limit = nranks * c.bound
    for size in (1, 2, 3, 7):
        for a, b in fsdp_spans(numel, size):
            lo, hi = (a, b) if coords is None else np.searchsorted(coords, [a, b]).tolist()
            data, width = row_data(sums, lo, hi, limit, pad=(a % 9), rng=rng)
            kw = {"numel": numel, "span": (a, b), "nranks": nranks, "shapes": shapes, **at}
            got = c.dequantize_span(data, width, limit, norms, *extra, **kw)
            want = ref_span(c, sums, norms, sidx, nranks, numel, shapes, coords, (a, b))
            assert got.dtype == np.float32 and got.shape == (b - a,)
            assert got.tobytes() == want.tobytes() == whole[a:b].tobytes()
            if coords is not None:  # the caller's codes in the row: the same bytes
                kw["codes"] = (lo, hi)
                assert c.dequantize_span(data, width, limit, norms, *extra, **kw).tobytes() == (
                    got.tobytes()
                )


def test_dequantize_span_refuses_what_does_not_fit():
    c = mpicomp.codec("qsgd_maxnorm", bits=4, block=2)
    norms = np.ones(5, np.float32)
    data = ref_pack(np.array([7, 14, 0]), 4)
    got = c.dequantize_span(data, 4, 7, norms, numel=10, span=(4, 7))
    assert got.tolist() == [0.0, 1.0, -1.0]
    for span, what in [((4, 11), ValueError), ((5, 4), ValueError), ((-1, 2), ValueError),
                       (4, TypeError), ((1, 2, 3), TypeError), ("ab", TypeError)]:  # fmt: skip
        with pytest.raises(what, match="span"):
            c.dequantize_span(data, 4, 7, norms, numel=10, span=span)
    with pytest.raises(ValueError, match="bytes"):
        c.dequantize_span(data, 4, 7, norms, numel=10, span=(4, 9))  # 5 sums, 2 bytes
    with pytest.raises(ValueError, match="nranks"):
        c.dequantize_span(ref_pack(np.array([15]), 4), 4, 7, norms, numel=10, span=(0, 1))
    with pytest.raises(ValueError, match="blocks"):
        c.dequantize_span(data, 4, 7, norms[:4], numel=10, span=(4, 7))
    g = mpicomp.codec("grandk_maxnorm", bits=4, k=4, block=0)
    with pytest.raises(ValueError, match="codes"):
        g.dequantize_span(data, 4, 7, 1.0, numel=10, span=(0, 10), codes=(0, 5))  # K is 4


@pytest.mark.parametrize("where", ["emulated", "host-backed"])
@pytest.mark.parametrize("name", QSGD_FAMILY)
def test_a_row_on_a_device_gives_the_numpy_bytes_and_reads_only_its_error_mask(
    monkeypatch, where, name
):
    import _device_arrays as D
    from _devices import place

    import mpicomp.kernels as K

    numel, shapes, nranks = 1003, [(3, 5), (0,), (900,), (88,)], 2
    c, sums, norms, sidx, coords, at = span_case(name, numel, 7, True, shapes, nranks)
    extra = () if sidx is None else (sidx,)
    limit = nranks * c.bound
    rng = np.random.default_rng(3)
    spans = fsdp_spans(numel, 3)
    want = []
    for a, b in spans:
        lo, hi = (a, b) if coords is None else np.searchsorted(coords, [a, b]).tolist()
        data, width = row_data(sums, lo, hi, limit, pad=5, rng=rng)
        kw = {"numel": numel, "span": (a, b), "nranks": nranks, "shapes": shapes, **at}
        ref = c.dequantize_span(data, width, limit, norms, *extra, **kw)
        want.append((data, width, kw, (lo, hi), ref))
    to_place, to_host, array_type = place(where)
    if where == "emulated":
        monkeypatch.setenv(K.ENV, "cuda-emulated")
    backend = "cuda-emulated" if where == "emulated" else D.BACKEND
    dev = K.backend(backend).device
    codec = mpicomp.codec(c.name, **c.params)
    on = [to_place(a) for a in (norms, *extra)]
    for data, width, kw, codes, ref in want:
        if coords is not None:
            kw = {**kw, "codes": codes}  # what the reduce-scatter passes: no read to find them
        D.reset_syncs()
        before = dev.sync_reasons.copy()
        got = codec.dequantize_span(to_place(data), width, limit, *on, **kw)
        reads = dev.sync_reasons - before
        assert D.SYNCS["implicit"] == 0, D.SYNCS
        assert isinstance(got, array_type)
        assert to_host(got).tobytes() == ref.tobytes()
        # The error mask; GlobalRandK also reads which of its codes fall in each tensor of
        # the bucket, as every decode of a bucket does.
        expected = {f"qsgd.{'multiscale_' * c.multiscale}dequantize_packed: error mask": 1}
        if coords is not None:
            expected["qsgd: picks per tensor"] = 1
        assert reads == expected
