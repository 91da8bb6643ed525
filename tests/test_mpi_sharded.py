"""3LC's push/pull through shard owners: bytes moved, and results against NumPy references."""

import numpy as np
import pytest

import mpicomp
from conftest import gather_all, gradient_like, world
from mpicomp.collectives.sharded import alltoall_bytes, push_pull, shard_bounds
from mpicomp.collectives.traffic import Traffic
from mpicomp.errors import RankError


@pytest.mark.parametrize("n, k", [(0, 1), (0, 3), (5, 3), (2, 5), (10, 5), (1001, 4)])
def test_shard_bounds_tile_the_range(n, k):
    b = shard_bounds(n, k)
    assert len(b) == k and b[0][0] == 0 and b[-1][1] == n
    assert all(b[i][1] == b[i + 1][0] for i in range(k - 1))
    sizes = [hi - lo for lo, hi in b]
    assert max(sizes) - min(sizes) <= 1


def _payload(src, dst):
    # Deterministic, different length for every (src, dst) pair, some empty.
    return ((np.arange((3 * src + 5 * dst) % 7 * 11) + src * 31 + dst) % 256).astype(np.uint8)


@pytest.mark.mpi
def test_alltoall_bytes_delivers_every_pair():
    comm = world()
    t = Traffic()
    got = alltoall_bytes(comm, [_payload(comm.rank, d) for d in range(comm.size)], recorder=t)
    for src in range(comm.size):
        np.testing.assert_array_equal(got[src], _payload(src, comm.rank))
    others = [d for d in range(comm.size) if d != comm.rank]
    assert t.by_op()["sharded.push"] == (
        sum(_payload(comm.rank, d).size for d in others),
        sum(_payload(s, comm.rank).size for s in others),
    )


@pytest.mark.mpi(min_size=2)
def test_alltoall_bytes_bad_input_on_one_rank_raises_everywhere():
    comm = world()
    payloads = [_payload(comm.rank, d) for d in range(comm.size)]
    if comm.rank == 1:
        payloads = payloads[:-1]
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] did not pass"):
        alltoall_bytes(comm, payloads)


def _averaging_owner(comm):
    """An owner that averages the float32 shards pushed to it (raw bytes in and out)."""

    def owner(received):
        shards = [p.view(np.float32) for p in received]
        mean = np.sum(shards, axis=0, dtype=np.float32) / np.float32(comm.size)
        return mean.view(np.uint8), None

    return owner


@pytest.mark.mpi
@pytest.mark.parametrize("n", [0, 2, 1001])
def test_push_pull_gives_every_rank_every_owners_result(n):
    comm = world()
    x = np.random.default_rng(80 + comm.rank).standard_normal(n).astype(np.float32)
    bounds = shard_bounds(n, comm.size)
    t = Traffic()
    pulled = push_pull(
        comm, [x[a:b].view(np.uint8) for a, b in bounds], _averaging_owner(comm), recorder=t
    )
    # The NumPy reference: owner s averages shard s of every rank's x, in rank order.
    every = gather_all(comm, x)
    for (a, b), got in zip(bounds, pulled, strict=True):
        want = np.sum(every[:, a:b], axis=0, dtype=np.float32) / np.float32(comm.size)
        np.testing.assert_array_equal(got.view(np.float32), want)
    # Bytes: this rank pushes every shard but its own and pulls every owner's but its own.
    mine = 4 * (bounds[comm.rank][1] - bounds[comm.rank][0])
    assert t.by_op()["sharded.push"] == (4 * n - mine, (comm.size - 1) * mine)
    assert t.by_op()["allgather.data"] == (mine if comm.size > 1 else 0, 4 * n - mine)


@pytest.mark.mpi(min_size=2)
def test_push_pull_owner_failing_on_one_rank_raises_everywhere():
    comm = world()
    x = np.ones(64, dtype=np.float32)
    pushed = [x[a:b].view(np.uint8) for a, b in shard_bounds(x.size, comm.size)]
    average = _averaging_owner(comm)

    def owner(received):
        if comm.rank == 1:
            return None, ValueError("owner 1 refused its shard")
        return average(received)

    if comm.rank == 1:
        with pytest.raises(ValueError, match="owner 1 refused its shard"):
            push_pull(comm, pushed, owner)
    else:
        with pytest.raises(RankError, match="rank 1 passed an invalid payload"):
            push_pull(comm, pushed, owner)
    # Nothing was left in flight: the next call works.
    assert len(push_pull(comm, pushed, average)) == comm.size


@pytest.mark.mpi(min_size=2)
def test_push_pull_failed_push_on_one_rank_raises_everywhere():
    comm = world()
    x = np.ones(64, dtype=np.float32)
    pushed = [x[a:b].view(np.uint8) for a, b in shard_bounds(x.size, comm.size)]
    called = []
    with pytest.raises(RankError, match=r"rank\(s\) \[1\] did not pass"):
        push_pull(comm, None if comm.rank == 1 else pushed, called.append)
    assert not called  # no owner runs after a failed push


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["threelc", "topk", "fastsgd"])
def test_sharded_average_matches_push_pull_reference(name):
    comm = world()
    n = 4099
    x = gradient_like(n, seed=60 + comm.rank)
    with mpicomp.CompressedComm(comm, name, sharded=True, error_feedback=False, min_numel=0) as cc:
        y = cc.allreduce(x)
    inputs, codec = gather_all(comm, x), mpicomp.codec(name)
    expected = []
    for a, b in shard_bounds(n, comm.size):
        avg = np.sum([codec.decode(codec.encode(v[a:b])) for v in inputs], axis=0, dtype=np.float32)
        expected.append(codec.decode(codec.encode(avg / np.float32(comm.size))))
    np.testing.assert_array_equal(y, np.concatenate(expected))
    np.testing.assert_array_equal(gather_all(comm, y)[0], y)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["threelc", "topk", "fft", "fastsgd"])
def test_a_corrupt_push_on_a_device_raises_on_every_rank(name, monkeypatch):
    """On cuda-emulated, where the decodes' checks wait for a batch, a push that fails its
    checksum still reaches its owner's refusal before the pull: every rank raises."""
    from mpicomp.errors import PayloadError

    comm = world()
    monkeypatch.setenv(mpicomp.kernels.ENV, "cuda-emulated")
    x = gradient_like(4099, seed=70 + comm.rank)
    with mpicomp.CompressedComm(comm, name, sharded=True, error_feedback=False, min_numel=0) as cc:
        encode = cc.codec.encode
        pushes = []

        def corrupt_first_push(v):
            payload = encode(v)
            pushes.append(payload.size)
            if comm.rank == 1 and len(pushes) == 1:  # rank 1's push to rank 0
                payload = payload.copy()
                payload[-1] ^= 0x10
            return payload

        monkeypatch.setattr(cc.codec, "encode", corrupt_first_push)
        with pytest.raises((RankError, PayloadError)) as caught:
            cc.allreduce(x)
    if comm.rank == 0:  # the owner says what it found
        assert "checksum" in str(caught.value) or "shard" in str(caught.value)


@pytest.mark.mpi(min_size=4)
def test_sharded_receives_fewer_bytes_than_allgather():
    comm = world()
    # Normal values: 3LC keeps ~0.25 bits/element, so payloads (~12 KB) dwarf the fixed
    # per-shard headers and the test sees the O(P) against O(N P) scaling it is about.
    x = np.random.default_rng(70 + comm.rank).standard_normal(400_000).astype(np.float32)
    received = {}
    for sharded in (False, True):
        with mpicomp.CompressedComm(comm, "threelc", sharded=sharded, min_numel=0) as cc:
            cc.recorder = Traffic()
            cc.allreduce(x, name="g")
            received[sharded] = cc.recorder.recv
    # Allgather: N-1 whole payloads P. Push/pull: (N-1)/N of one P, plus (N-1)/N of the
    # owners' re-compressed averages, which 3LC sends less sparsely (~1.75 P measured).
    # Below 4 ranks the two are close; from 4 on push/pull must receive less.
    assert received[True] < received[False]


@pytest.mark.mpi
@pytest.mark.parametrize("staged", [False, True])
def test_a_sharded_call_reads_once_per_push_beside_two(staged, monkeypatch):
    """Host reads of a sharded 3LC call on device arrays, on every rank at any N: each
    push's encode (its length), the owner's one read before the pull (its re-encode's, its
    pushes' checks with it), and the end of the call (the pulled payloads' headers and
    checksums among its checks: ``decode_flat``). Staged (MPI not CUDA-aware), two copies
    down besides: the pushes end to end, and the owner's pull."""
    import _device_arrays as D

    from mpicomp.reduction import transport

    comm = world()
    monkeypatch.setenv(transport.ENV, "0" if staged else "1")
    transport.cuda_aware.cache_clear()
    D.install()
    dev = mpicomp.kernels.backend(D.BACKEND).device
    x = D.to_device(gradient_like(4099, seed=90 + comm.rank))
    try:
        with mpicomp.CompressedComm(comm, "threelc", sharded=True, min_numel=0) as cc:
            cc.allreduce(x, name="w")
            before = dev.sync_reasons.copy()
            y = cc.allreduce(x, name="w")  # residuals in play
            reasons = dev.sync_reasons - before
    finally:
        transport.cuda_aware.cache_clear()
    n = comm.size
    copies = reasons.pop("staging: device to host", 0)
    assert copies == (2 if staged else 0), dict(reasons)
    assert sum(reasons.values()) == n + 2, dict(reasons)
    assert "payload header" not in reasons  # compared on the device, read at the end
    owner = [why for why in reasons if "encode: " in why and "payload: checksum field" in why]
    assert len(owner) == 1 and reasons[owner[0]] == 1, dict(reasons)
    np.testing.assert_array_equal(gather_all(comm, D.to_host(y))[0], D.to_host(y))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["threelc", "topk", "fastsgd"])
def test_a_shard_whose_average_overflows_on_a_device_raises_on_every_rank(name, monkeypatch):
    """On cuda-emulated the owner learns of an average beyond float32 from its re-encode's
    refusal, read with its pushes' checks: every rank raises the overflow's RankError, and
    the next call is right."""
    comm = world()
    monkeypatch.setenv(mpicomp.kernels.ENV, "cuda-emulated")
    x = gradient_like(4099, seed=100 + comm.rank)
    big = x.copy()
    big[7] = np.float32(3e38)  # the sum of two is beyond float32
    with mpicomp.CompressedComm(comm, name, sharded=True, error_feedback=False, min_numel=0) as cc:
        with pytest.raises(RankError, match="the average of a shard over ranks overflows"):
            cc.allreduce(big)
        y = cc.allreduce(x)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(gather_all(comm, y)[0], y)
