"""CompressedComm across ranks: every codec against a NumPy reference of what the
average should be, the same result on every rank, and clear errors instead of hangs."""

import math

import numpy as np
import pytest

import mpicomp
from conftest import gather_all, gradient_like, world

N = 5003  # not divisible by 2, 3, 4, 5 or 8
ALL = [
    "none", "fp16", "topk", "signsgd", "threelc", "fft", "fastsgd", "qsgd_maxnorm",
    "qsgd_maxnorm_multiscale", "grandk_maxnorm", "grandk_maxnorm_multiscale",
]  # fmt: skip


def _same_on_every_rank(comm, y):
    np.testing.assert_array_equal(gather_all(comm, np.asarray(y))[0], y)


def reference_average(name, inputs, step=0, **params):
    """What CompressedComm must return, from every rank's input, in plain NumPy + codec calls."""
    codec = mpicomp.codec(name, **params)
    nranks = len(inputs)
    if name in ("none",):
        return inputs.astype(np.float64).sum(axis=0).astype(np.float32) / np.float32(nranks)
    if name == "fp16":
        return inputs.astype(np.float16).astype(np.float32).sum(axis=0) / np.float32(nranks)
    if name == "signsgd":
        positive = (inputs > 0).sum(axis=0)
        bits = codec.majority(positive, nranks, step=step)
        scale = sum(float(np.abs(x.astype(np.float64)).sum() / x.size) for x in inputs)
        return codec.expand(bits, inputs.shape[1], scale / nranks)
    if codec.aggregation == "integer_sum":
        sparse = hasattr(codec, "coordinates")
        at = {"step": step} if sparse else {}
        norm = np.max([codec.local_norms(x, **at) for x in inputs], axis=0)  # MaxAllReduce
        extra = ()
        if hasattr(codec, "scale_index"):
            extra = (np.min([codec.scale_index(x, norm, **at) for x in inputs], axis=0),)
        codes = [codec.quantize(x, norm, *extra, step=step, stream=r) for r, x in enumerate(inputs)]
        total = np.sum(codes, axis=0, dtype=np.int64)
        shape = {"shape": inputs.shape[1:], "step": step} if sparse else {}
        return codec.dequantize(total, norm, *extra, nranks=nranks, **shape)
    decoded = [codec.decode(codec.encode(x)) for x in inputs]
    return np.sum(decoded, axis=0, dtype=np.float32) / np.float32(nranks)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ALL)
def test_every_codec_averages_like_the_reference(name):
    comm = world()
    x = gradient_like(N, seed=10 + comm.rank)
    with mpicomp.CompressedComm(comm, name, min_numel=0) as cc:
        y = cc.allreduce(x, name="w")
    expected = reference_average(name, gather_all(comm, x))
    if name == "none":
        np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-9)
    elif name == "fp16":
        # Partial sums are rounded to float16 at each hop: half an ulp of the largest
        # partial sum per hop, relative to the largest magnitude.
        scale = np.abs(gather_all(comm, x)).sum(axis=0).max()
        np.testing.assert_allclose(y, expected, rtol=0, atol=comm.size * 2.0**-11 * scale)
    else:
        np.testing.assert_array_equal(y, expected)
    assert y.shape == x.shape and y.dtype == np.float32
    _same_on_every_rank(comm, y)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "name", ["signsgd", "qsgd_maxnorm", "qsgd_maxnorm_multiscale", "grandk_maxnorm"]
)
def test_the_direct_schedule_averages_like_the_reference_bit_for_bit(name):
    """schedule="direct" sums the same codes another way: the reference's (and so the
    ring's) result exactly, on every rank, three calls in a row (the RNG steps)."""
    comm = world()
    xs = [gradient_like(N, seed=30 + 7 * c + comm.rank) for c in range(3)]
    with mpicomp.CompressedComm(comm, name, min_numel=0, schedule="direct") as cc:
        assert cc.options.schedule == "direct"
        ys = [cc.allreduce(x, name="w") for x in xs]
    for step, (x, y) in enumerate(zip(xs, ys, strict=True)):
        np.testing.assert_array_equal(y, reference_average(name, gather_all(comm, x), step))
        _same_on_every_rank(comm, y)


@pytest.mark.mpi
def test_backend_shape_and_dtype_come_back_as_given():
    comm = world()
    x = gradient_like(4 * 6 * 50, seed=comm.rank).astype(np.float64).reshape(4, 6, 50)
    with mpicomp.CompressedComm(comm, "threelc", min_numel=0) as cc:
        y = cc.allreduce(x, name="conv")
    assert y.shape == (4, 6, 50) and y.dtype == np.float64
    _same_on_every_rank(comm, y)


@pytest.mark.mpi
def test_small_tensors_are_averaged_uncompressed():
    comm = world()
    x = gradient_like(100, seed=20 + comm.rank)
    with mpicomp.CompressedComm(comm, "threelc", min_numel=1024) as cc:
        y = cc.allreduce(x, name="bias")
    mean = gather_all(comm, x).astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(y, mean, rtol=1e-5, atol=1e-9)


@pytest.mark.mpi
def test_error_feedback_memory_is_kept_per_name():
    comm = world()
    x = gradient_like(N, seed=30 + comm.rank)
    with mpicomp.CompressedComm(comm, "topk", ratio=0.05, min_numel=0) as cc:
        first = cc.allreduce(x, name="a")
        second = cc.allreduce(x, name="a")
        fresh = cc.allreduce(x, name="b")
        state = cc.state_dict()
    np.testing.assert_array_equal(first, fresh)  # "b" starts with no residual
    assert not np.array_equal(first, second)  # "a" sends what step 1 left behind
    inputs = gather_all(comm, x)
    codec = mpicomp.codec("topk", ratio=0.05)
    # Reference of step 2: each rank compresses x + (x - decode(encode(x))).
    second_ref = np.zeros(N, np.float32)
    for xr in inputs:
        r = xr - codec.decode(codec.encode(xr))
        second_ref += codec.decode(codec.encode(xr + r))
    np.testing.assert_array_equal(second, second_ref / np.float32(comm.size))
    assert set(state["residuals"]) == {"a", "b"} and state["step"] == 3


@pytest.mark.mpi
def test_allreduce_many_fuses_small_tensors_and_splits_back():
    comm = world()
    shapes = [(10,), (3, 7), (2000,), (1,), (50, 3)]
    xs = [
        gradient_like(math.prod(s), seed=40 + comm.rank + i).reshape(s)
        for i, s in enumerate(shapes)
    ]
    with mpicomp.CompressedComm(comm, "none", bucket_numel=1024, min_numel=0) as cc:
        ys = cc.allreduce_many(xs)
    for x, y in zip(xs, ys, strict=True):
        assert y.shape == x.shape
        np.testing.assert_allclose(
            y, gather_all(comm, x).astype(np.float64).mean(axis=0), rtol=1e-6, atol=1e-9
        )
    # A lossy codec on a fused bucket: the reference compresses the concatenation.
    with mpicomp.CompressedComm(comm, "threelc", bucket_numel=4096, min_numel=0) as cc:
        ys = cc.allreduce_many(xs[:2] + xs[3:])
    fused = gather_all(comm, np.concatenate([x.reshape(-1) for x in xs[:2] + xs[3:]]))
    expected = reference_average("threelc", fused)
    np.testing.assert_array_equal(np.concatenate([y.reshape(-1) for y in ys]), expected)


@pytest.mark.mpi
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_average_is_within_the_variance_bound(bits):
    comm = world()
    x = gradient_like(N, seed=50 + comm.rank)
    mean = gather_all(comm, x).astype(np.float64).mean(axis=0)
    norm = max(np.linalg.norm(v) for v in gather_all(comm, x).astype(np.float64))
    s = 2 ** (bits - 1) - 1
    # Lemma 1 of the unbiased quantizers paper per rank, independent noise across ranks:
    # the mean's variance is 1/N of it.
    bound = min(N / s**2, math.sqrt(N) / s) * norm**2 / comm.size
    errors = []
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", bits=bits, min_numel=0) as cc:
        for _ in range(8):
            errors.append(np.sum((cc.allreduce(x) - mean) ** 2))
    assert np.mean(errors) <= bound


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["none", "qsgd_maxnorm", "signsgd", "threelc"])
def test_mismatched_sizes_raise_on_every_rank(name):
    comm = world()
    x = gradient_like(N + comm.rank % 2, seed=1)
    with mpicomp.CompressedComm(comm, name, min_numel=0) as cc:
        with pytest.raises(RuntimeError, match="disagree"):
            cc.allreduce(x, name="g")
        # The communicator is still usable: the next agreeing call goes through.
        y = cc.allreduce(np.ones(N, np.float32), name="h")
    assert y.shape == (N,)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["fp16", "qsgd_maxnorm", "signsgd", "threelc", "topk"])
def test_nan_on_one_rank_raises_on_every_rank(name):
    comm = world()
    x = gradient_like(N, seed=2)
    if comm.rank == 1:
        x[17] = np.nan
    with mpicomp.CompressedComm(comm, name, min_numel=0) as cc:
        expected = ValueError if comm.rank == 1 else RuntimeError
        with pytest.raises(expected, match="NaN|rank 1"):
            cc.allreduce(x, name="g")


@pytest.mark.mpi
def test_dlpack_input_and_closed_comm():
    comm = world()

    class Tensor:  # a minimal DLPack producer standing in for a PyTorch CPU tensor
        def __init__(self, a):
            self.a = a
            self.dtype = a.dtype
            self.shape = a.shape

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    x = np.full((3, 4), comm.rank, np.float32)
    cc = mpicomp.CompressedComm(comm, "none")
    y = cc.allreduce(Tensor(x))
    np.testing.assert_allclose(np.asarray(y), np.full((3, 4), (comm.size - 1) / 2))
    cc.close()
    cc.close()
    with pytest.raises(RuntimeError, match="closed"):
        cc.allreduce(x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["none", "grandk_maxnorm", "signsgd", "threelc", "fastsgd"])
def test_bad_input_on_one_rank_raises_everywhere_and_keeps_steps_aligned(name):
    comm = world()
    x = gradient_like(N, seed=3)
    with mpicomp.CompressedComm(comm, name, min_numel=0) as cc:
        bad = np.arange(N) if comm.rank == 1 else x  # integers: refused on rank 1 only
        expected = TypeError if comm.rank == 1 else RuntimeError
        with pytest.raises(expected, match="floating-point|rank 1 failed"):
            cc.allreduce(bad, name="g")
        # The failed call counted on no rank: the next call draws as the first would.
        y = cc.allreduce(x, name="g2")
        assert cc.state_dict()["step"] == 1
    np.testing.assert_array_equal(gather_all(comm, y)[0], y)
    expected_y = reference_average(name, gather_all(comm, x), step=0)
    if name == "none":
        np.testing.assert_allclose(y, expected_y, rtol=1e-6, atol=1e-9)
    elif name != "fastsgd":  # fastsgd's payloads carry feedback state: same-step check suffices
        np.testing.assert_array_equal(y, expected_y)


@pytest.mark.mpi(min_size=2)
def test_tensors_fused_in_different_orders_raise_everywhere():
    comm = world()
    a, b = np.ones(30, np.float32), np.ones(50, np.float32)
    order = [a, b] if comm.rank % 2 == 0 else [b, a]
    names = ["a", "b"] if comm.rank % 2 == 0 else ["b", "a"]
    with mpicomp.CompressedComm(comm, "none", bucket_numel=1000) as cc:
        match = r'disagree on the tensor \(names.*"bucket:a\|b" on ranks? 0'
        with pytest.raises(RuntimeError, match=match):
            cc.allreduce_many(order, names=names)


@pytest.mark.mpi(min_size=2)
def test_sharded_size_mismatch_raises_everywhere():
    comm = world()
    x = gradient_like(100 + comm.rank % 2, seed=4)
    with mpicomp.CompressedComm(comm, "threelc", sharded=True, min_numel=0) as cc:
        with pytest.raises(RuntimeError, match="disagree"):
            cc.allreduce(x, name="g")


@pytest.mark.mpi
def test_error_feedback_needs_a_name_and_fp16_small_tensors_go_as_float32():
    comm = world()
    with mpicomp.CompressedComm(comm, "threelc", min_numel=0) as cc:
        with pytest.raises(ValueError, match="pass name="):
            cc.allreduce(np.ones(10, np.float32))
    x = np.full(10, 0.1 * (comm.rank + 1), np.float32)
    with mpicomp.CompressedComm(comm, "fp16") as cc:  # 10 < min_numel
        y = cc.allreduce(x)
    np.testing.assert_allclose(y, gather_all(comm, x).astype(np.float64).mean(axis=0), rtol=1e-6)
