"""Reads a call makes together (``mpicomp.kernels.readback``): one transfer for a batch's
values, its checks run in order after it, nothing read when the block fails, and a
CompressedComm call on a device whose deferred checks still raise where they should."""

import numpy as np
import pytest

import mpicomp
from mpicomp.kernels.cuda.device import Device
from mpicomp.kernels.readback import Later, batch, ignored, read, value_of, when


@pytest.fixture
def dev():
    return Device.emulated()  # to_host counts; nothing is compiled


def _first(host):
    return int(host[0])


def test_without_a_batch_each_read_is_its_own_sync(dev):
    assert read(dev, np.array([7], np.uint32), "a", _first) == 7
    assert read(dev, np.array([2.5], np.float32), "b")[0] == 2.5
    assert dev.syncs == 2 and dev.sync_reasons == {"a": 1, "b": 1}
    assert read(None, np.array([3], np.int64), "host", _first) == 3  # a host array
    assert dev.syncs == 2


def test_a_batch_reads_its_values_in_one_transfer_of_every_dtype(dev):
    mask = np.array([5], np.uint32)
    norms = np.array([[1.5, -2.0], [3.25, 4.0]], np.float32)
    flag = np.bool_(True)
    lengths = np.array([1, 2**40], np.int64)
    with batch("end") as b:
        got = [read(dev, mask, "mask", _first), read(dev, norms, "norms")]
        got += [read(dev, flag, "flag", bool), read(dev, lengths, "lengths")]
        assert all(isinstance(g, Later) for g in got)
        assert dev.syncs == 0
        mask[0] = 6  # the batch reads when it closes, not before
    assert dev.syncs == 1
    assert dev.sync_reasons == {"end: mask, norms, flag, lengths": 1}
    assert got[0].value == 6 and got[2].value is True
    np.testing.assert_array_equal(got[1].value, norms)
    assert got[1].value.dtype == np.float32 and got[1].value.shape == (2, 2)
    np.testing.assert_array_equal(value_of(got[3]), lengths)
    b.read()  # nothing is left pending: no second transfer
    assert dev.syncs == 1


def test_checks_run_in_order_after_the_read_and_the_first_failure_raises(dev):
    ran = []

    def check(name):
        def fn(value):
            ran.append((name, value))
            if value:
                raise ValueError(f"{name} failed")

        return fn

    with pytest.raises(ValueError, match="second failed"):
        with batch("end"):
            first = read(dev, np.array([0], np.uint32), "first", _first)
            second = read(dev, np.array([3], np.uint32), "second", _first)
            third = read(dev, np.array([4], np.uint32), "third", _first)
            when(first, check("first"))
            when(second, check("second"))
            when(third, check("third"))
            assert ran == []  # nothing decided before the read
    assert ran == [("first", 0), ("second", 3)]
    when(0, check("now"))  # a plain value is checked at once
    assert ran[-1] == ("now", 0)
    with pytest.raises(ValueError, match="late failed"):
        when(third, check("late"))  # a value read already: at once too


def test_a_failing_block_reads_nothing(dev):
    with pytest.raises(KeyError):
        with batch("end"):
            later = read(dev, np.array([1], np.uint32), "x", _first)
            when(later, lambda v: pytest.fail("a check ran after the block failed"))
            raise KeyError("boom")
    assert dev.syncs == 0
    with pytest.raises(RuntimeError, match="x: read before its batch closed"):
        _ = later.value


def test_a_deferred_value_refuses_to_be_branched_on(dev):
    with batch("end"):
        later = read(dev, np.array([1], np.uint32), "flag", _first)
        with pytest.raises(TypeError, match="flag: a deferred device value"):
            bool(later)


def test_batches_nest_and_a_read_goes_to_the_innermost(dev):
    with batch("outer"):
        outer = read(dev, np.array([1], np.uint32), "o", _first)
        with batch("inner"):
            inner = read(dev, np.array([2], np.uint32), "i", _first)
            seen = []
            when(outer, seen.append)  # registered on its own batch, the outer one
        assert inner.value == 2 and seen == [] and dev.syncs == 1
    assert seen == [1] and dev.sync_reasons == {"inner: i": 1, "outer: o": 1}


def test_a_shared_batch_lends_its_values_to_an_inner_transfer_and_keeps_its_checks(dev):
    seen = []
    with batch("outer", shared=True):
        outer = read(dev, np.array([1], np.uint32), "o", _first)
        when(outer, lambda v: seen.append(("outer", v)))
        with batch("empty"):
            pass  # nothing of its own to read: no transfer, nothing taken
        assert dev.syncs == 0
        with ignored(), batch("inner"):  # lent through an ignored batch too
            inner = read(dev, np.array([2], np.uint32), "i", _first)
        assert inner.value == 2 and outer.value == 1 and dev.syncs == 1  # one transfer
        when(outer, lambda v: seen.append(("late", v)))  # lent, its batch open: waits
        assert seen == []
        left = read(dev, np.array([3], np.uint32), "left", _first)
    assert seen == [("outer", 1), ("late", 1)] and left.value == 3
    assert dev.sync_reasons == {"inner: i, o": 1, "outer: left": 1}
    when(outer, lambda v: seen.append(("after", v)))  # its batch closed: at once
    assert seen[-1] == ("after", 1)


def test_reads_inside_ignored_are_never_transferred(dev):
    with batch("end"):
        kept = read(dev, np.array([1], np.uint32), "kept", _first)
        with ignored():
            dropped = read(dev, np.array([2], np.uint32), "dropped", _first)
            with pytest.raises(TypeError, match="dropped: a value read inside"):
                when(dropped, print)
    assert kept.value == 1 and dev.sync_reasons == {"end: kept": 1}
    with pytest.raises(RuntimeError, match="dropped: read before"):
        _ = dropped.value


def test_batches_are_per_thread(dev):
    from concurrent.futures import ThreadPoolExecutor

    with batch("mine"), ThreadPoolExecutor(1) as pool:
        theirs = pool.submit(read, dev, np.array([9], np.uint32), "theirs", _first).result()
    assert theirs == 9  # read at once: the other thread has no batch


@pytest.mark.parametrize("name", ["qsgd_maxnorm", "qsgd_maxnorm_multiscale"])
def test_a_deferred_check_still_fails_the_call_and_leaves_no_state(name, monkeypatch):
    """On cuda-emulated a codec's overflow is found by the end-of-call read; the call
    raises as on the host, the step stays where it was, and the next call is right."""
    from mpi4py import MPI

    monkeypatch.setenv(mpicomp.kernels.ENV, "cuda-emulated")
    dev = mpicomp.kernels.backend("cuda-emulated").device
    x = np.full(4096, 1e-3, np.float32)
    big = x.copy()
    big[7] = 3.3e38  # code 127 times the norm overflows float32 in the dequantization
    with mpicomp.CompressedComm(MPI.COMM_SELF, name, min_numel=1) as cc:
        want = cc.allreduce(x, name="w")
        step = cc.state_dict()["step"]
        before = dev.syncs
        with pytest.raises(mpicomp.RankError, match="overflows float32"):
            cc.allreduce(big, name="w")
        assert dev.syncs - before <= 2
        assert cc.state_dict()["step"] == step
    with mpicomp.CompressedComm(MPI.COMM_SELF, name, min_numel=1) as cc:
        np.testing.assert_array_equal(cc.allreduce(x, name="w"), want)


def _emulated_topk(monkeypatch):
    monkeypatch.setenv(mpicomp.kernels.ENV, "cuda-emulated")
    return mpicomp.codec("topk", ratio=0.05), mpicomp.kernels.backend("cuda-emulated").device


@pytest.mark.parametrize(
    "at, match",
    [
        (3, "made by codec"),  # the codec id
        (12, "does not match header"),  # the body length
        (16, "describes 4097 elements, expected 4096"),  # the shape
        (9, "fails its checksum"),  # the checksum itself
        (200, "fails its checksum"),  # an index in the body
        (24, "fails its checksum"),  # k
    ],
)
def test_gathered_top_k_payloads_are_checked_in_the_batch_with_unpacks_messages(
    at, match, monkeypatch
):
    from mpicomp.errors import PayloadError

    codec, dev = _emulated_topk(monkeypatch)
    rng = np.random.default_rng(1)
    good = codec.encode(rng.standard_normal(4096).astype(np.float32))
    bad = good.copy()
    bad[at] ^= 1
    with pytest.raises(PayloadError, match=match):
        with batch("end"):
            codec.decode_gathered([good, bad], 4096)


def test_gathered_top_k_payloads_decode_with_one_read(monkeypatch):
    from mpicomp.errors import PayloadError

    codec, dev = _emulated_topk(monkeypatch)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(4096).astype(np.float32) for _ in range(3)]
    payloads = [codec.encode(x) for x in xs]
    before = dev.syncs
    with batch("end"):
        total = codec.decode_gathered(payloads, 4096)
    assert dev.syncs - before == 1
    want = np.zeros(4096, np.float32)
    for p in payloads:
        want += codec.decode(p, numel=4096)
    np.testing.assert_array_equal(total, want)
    # Its checks assume what the collectives send: a flat array's payload; decode_sum
    # reads any payload's header.
    square = codec.encode(xs[0].reshape(64, 64))
    with pytest.raises(PayloadError, match=r"of shape \(64, 64\) is not what the collectives"):
        codec.decode_gathered([square], 4096)
    np.testing.assert_array_equal(codec.decode_sum([square], 4096), codec.decode(payloads[0]))


def test_gathered_fastsgd_payloads_are_checked_in_the_callers_one_read(monkeypatch):
    """FastSGD's gathered payloads: headers, prefixes, checksums, bucket scans and the
    decodes' errors all read in the caller's batch, one transfer, each payload's checks in
    that order (a corrupt payload's own error first)."""
    from mpicomp.codecs import _wire
    from mpicomp.errors import PayloadError
    from mpicomp.kernels.fastsgd import PREFIX_BYTES

    monkeypatch.setenv(mpicomp.kernels.ENV, "cuda-emulated")
    dev = mpicomp.kernels.backend("cuda-emulated").device
    codec = mpicomp.codec("fastsgd", bucket=1024)
    rng = np.random.default_rng(3)
    payloads = [codec.encode(rng.standard_normal(5000).astype(np.float32)) for _ in range(3)]
    before = dev.syncs
    with batch("end"):
        total = codec.decode_gathered(payloads, 5000)
    assert dev.syncs - before == 1
    np.testing.assert_array_equal(total, codec.decode_sum(payloads, 5000))
    start = _wire.header_size(1)
    first_bucket = start + PREFIX_BYTES
    for at, match, reseal in [
        (start + 1, "fails its checksum", False),  # the prefix's base
        (start + 40, "fails its checksum", False),  # a bucket's bytes
        (start + 9, "is not what the collectives send", True),  # another bucket, resealed
        (first_bucket + 5, "is inconsistent", True),  # a bucket's count, resealed
    ]:
        bad = payloads[1].copy()
        bad[at] ^= 0x40
        if reseal:
            _wire.reseal(bad)
        with pytest.raises(PayloadError, match=match):
            with batch("end"):
                codec.decode_gathered([payloads[0], bad], 5000)
    with pytest.raises(PayloadError, match="is not what the collectives send"):
        codec.decode_gathered([codec.encode(np.ones((50, 100), np.float32))], 5000)
