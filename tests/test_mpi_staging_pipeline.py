"""The staged float32 sum in chunks across ranks: the same bytes as the NumPy path and
as one MPI_Allreduce, whichever path each rank takes (staged, direct or host arrays: the
messages are the same), under the NaN/Inf policies and a timeout, with the copies of
the host-backed stand-ins deferred until waited for (tests/_device_arrays.py)."""

import _device_arrays as D
import numpy as np
import pytest
from _devices import REQUIRE_GPU, gpu_present

import mpicomp
from mpicomp import RankError
from mpicomp.reduction import transport
from mpicomp.reduction.transport import CHUNK_BYTES, CHUNK_ENV

CHUNK = 4096  # bytes: 1024 float32 values
N = 5000  # 5 chunks


@pytest.fixture
def deferred(monkeypatch):
    """Chunks of ``CHUNK`` bytes; the host-backed device's copies deferred."""
    monkeypatch.setenv(CHUNK_ENV, str(CHUNK))
    D.install()
    monkeypatch.setattr(mpicomp.kernels.backend(D.BACKEND).device, "streams", D.DeferredStreams())


def _transport_is(monkeypatch, path: str) -> None:
    monkeypatch.setenv(transport.ENV, "1" if path == "direct" else "0")
    transport.cuda_aware.cache_clear()


def _gradient(rank: int, n: int = N) -> np.ndarray:
    rng = np.random.default_rng(rank)
    return (rng.standard_normal(n) * rng.uniform(1e-20, 1e20, n)).astype(np.float32)


def _average(world, x, chunk: int = CHUNK, name: str = "w", **options):
    """The second of two averages of ``x`` staged in chunks of ``chunk`` bytes (0: none)."""
    D.install()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CHUNK_ENV, str(chunk))  # read when the CompressedComm is made
        made = D.count_pinned(mp, mpicomp.kernels.backend(D.BACKEND).device)
        with mpicomp.CompressedComm(world, "none", min_numel=1, **options) as cc:
            out = [cc.allreduce(x, name=name) for _ in range(2)]
    assert len(made) <= 3  # the chunks' two buffers, the wire's
    return out[-1]


@pytest.mark.mpi
@pytest.mark.parametrize("timeout", [None, 30.0])
def test_staged_chunks_give_the_bytes_of_one_mpi_allreduce(deferred, monkeypatch, timeout):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    x = _gradient(world.rank)
    host = _average(world, x, timeout=timeout)  # NumPy: the same MPI_Allreduce per chunk
    whole = _average(world, x, chunk=0, timeout=timeout)  # NumPy, one MPI_Allreduce
    _transport_is(monkeypatch, "staged")
    got = _average(world, D.to_device(x), timeout=timeout)
    assert isinstance(got, D.DeviceArray)
    assert D.to_host(got).tobytes() == host.tobytes()
    ref = np.sum(world.allgather(x), axis=0, dtype=np.float32) / np.float32(world.size)
    if world.size <= 2:  # one addition per element: MPI's order cannot change it
        assert whole.tobytes() == host.tobytes() == ref.tobytes()
    # From 3 ranks an MPI whose algorithm depends on the message size (Open MPI) may add
    # a chunk in another order than the whole: a few float32 roundings of the magnitudes.
    scale = np.sum(np.abs(world.allgather(x)), axis=0, dtype=np.float64) / world.size
    assert np.all(np.abs(host.astype(np.float64) - whole) <= 4 * 2.0**-23 * scale)
    transport.cuda_aware.cache_clear()


@pytest.mark.mpi
@pytest.mark.parametrize("other", ["host", "direct"])
def test_ranks_on_different_paths_send_the_same_messages(deferred, monkeypatch, other):
    """Rank 0 stages its device array in chunks while the others hand MPI host arrays
    or device arrays directly: every path splits the sum alike, so they all meet."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    x = _gradient(world.rank)
    want = _average(world, x)
    _transport_is(monkeypatch, "staged" if world.rank == 0 or other == "host" else "direct")
    mine = D.to_device(x) if world.rank == 0 or other == "direct" else x
    got = _average(world, mine)
    got = D.to_host(got) if isinstance(got, D.DeviceArray) else got
    assert got.tobytes() == want.tobytes()
    transport.cuda_aware.cache_clear()


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["raise", "skip_step", "zero"])
def test_nonfinite_values_in_a_later_chunk_meet_the_policy_on_every_rank(
    deferred, monkeypatch, policy
):
    from mpi4py import MPI

    from mpicomp.comm import NonFiniteWarning

    world = MPI.COMM_WORLD
    culprit = world.size - 1
    x = _gradient(world.rank)
    if world.rank == culprit:
        x[4321] = np.inf  # chunk 4 of 5
    want = None
    if policy == "zero":
        want = _average(world, x, nonfinite="zero")
    _transport_is(monkeypatch, "staged")
    with mpicomp.CompressedComm(world, "none", min_numel=1, nonfinite=policy) as cc:
        if policy == "raise":
            err = ValueError if world.rank == culprit else RankError
            with pytest.raises(err, match="NaN or Inf"):
                cc.allreduce(D.to_device(x), name="w")
        elif policy == "skip_step":
            with pytest.warns(NonFiniteWarning, match=f"rank\\(s\\) {culprit}"):
                cc.allreduce(D.to_device(x), name="w")
        else:
            got = D.to_host(cc.allreduce(D.to_device(x), name="w"))
            assert got.tobytes() == want.tobytes()
        # Every rank is still in step: the next call works.
        ok = D.to_device(_gradient(world.rank))
        assert cc.allreduce(ok, name="w").shape == (N,)
    transport.cuda_aware.cache_clear()


@pytest.mark.mpi
def test_a_sum_beyond_float32_in_a_later_chunk_is_refused_on_every_rank(deferred, monkeypatch):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size < 2:
        pytest.skip("a sum over one rank is its input")
    x = np.full(N, 1.0, np.float32)
    x[4999] = np.float32(3e38)  # the last chunk: finite on each rank, not in the sum
    _transport_is(monkeypatch, "staged")
    with mpicomp.CompressedComm(world, "none", min_numel=1) as cc:
        with pytest.raises(RankError, match="the sum over ranks overflows float32"):
            cc.allreduce(D.to_device(x), name="w")
    transport.cuda_aware.cache_clear()


@pytest.mark.mpi
@pytest.mark.skipif(not (gpu_present() or REQUIRE_GPU), reason="needs a GPU (CuPy)")
def test_gpu_gradients_staged_in_default_chunks_give_the_numpy_bytes(monkeypatch):
    import cupy
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    monkeypatch.delenv(CHUNK_ENV, raising=False)
    x = _gradient(world.rank, 3 * (CHUNK_BYTES // 4) + 5)  # 4 chunks of 4 MiB
    want = _average(world, x, chunk=CHUNK_BYTES)
    _transport_is(monkeypatch, "staged")
    got = _average(world, cupy.asarray(x), chunk=CHUNK_BYTES)
    assert isinstance(got, cupy.ndarray)
    assert got.get().tobytes() == want.tobytes()
    transport.cuda_aware.cache_clear()


@pytest.mark.mpi(min_size=2)
def test_ranks_with_other_staging_chunks_are_refused_at_the_agreement(monkeypatch):
    """Another chunk cuts a sum into another number of MPI_Allreduce: the ranks would
    hang, so the chunk is part of the configuration every rank agrees on."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    monkeypatch.setenv(CHUNK_ENV, "1M" if world.rank == 1 else "4M")
    with pytest.raises(RankError, match="differently: staging_chunk: .*1048576 on rank 1"):
        mpicomp.CompressedComm(world, "none")


BOUNDED = [
    ("qsgd_maxnorm", {}),
    ("qsgd_maxnorm", {"schedule": "direct"}),
    ("qsgd_maxnorm_multiscale", {}),
    ("signsgd", {}),
    ("signsgd", {"schedule": "direct"}),
]


def _bounded_result(world, codec, options, x, log=None):
    """The second of two averages of ``x`` with ``codec``; ``log`` (when given) is
    cleared before it and gets ``("mpi", phase, step)`` for each exchange of its bounded
    collectives, among the copies the stand-ins log there."""
    from mpicomp.collectives import _wait

    with mpicomp.CompressedComm(world, codec, min_numel=1, seed=3, **options) as cc:
        cc.allreduce(x, name="w")
        if log is None:
            return cc.allreduce(x, name="w")
        log.clear()
        real = _wait.Exchange.__call__

        def logged(self, sendbuf, dest, recvbuf, source, phase, step):
            log.append(("mpi", phase, step))
            real(self, sendbuf, dest, recvbuf, source, phase, step)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_wait.Exchange, "__call__", logged)
            return cc.allreduce(x, name="w")


@pytest.mark.mpi
@pytest.mark.parametrize("codec, options", BOUNDED)
def test_staged_codes_come_down_chunk_by_chunk_as_the_schedule_reads_them(
    deferred, monkeypatch, codec, options
):
    """The bounded schedules' codes (and votes, and scale indices) come down chunk by
    chunk in the order the reduce-scatter reads them: all copies are issued before its
    first message, and only the first chunk it sends is down by then. The result goes
    up chunk by chunk as the allgather completes it: this rank's own before the
    allgather's first message. The bytes are the NumPy path's."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    x = _gradient(world.rank)
    want = _bounded_result(world, codec, options, x)
    _transport_is(monkeypatch, "staged")
    log = mpicomp.kernels.backend(D.BACKEND).device.streams.log
    got = _bounded_result(world, codec, options, D.to_device(x), log=log)
    assert D.to_host(got).tobytes() == want.tobytes()
    # Every chunk comes down once (the multiscale codecs' scale indices, then codes).
    downs = [e for e in log if e[:2] == ("ran", "download")]
    assert len(downs) == world.size * (2 if codec.endswith("multiscale") else 1)
    if world.size > 1:
        first = next(i for i, e in enumerate(log) if e[0] == "mpi")
        issued = [e for e in log[:first] if e[0] == "download"]
        ran = [e for e in log[:first] if e[:2] == ("ran", "download")]
        assert len(issued) == world.size and len(ran) == 1, log[: first + 1]
    # The sums (decisions) go up a chunk at a time, issued as the allgather brings them
    # (the stand-ins run an upload only when waited for: the bytes above say it was).
    ups = [i for i, e in enumerate(log) if e[0] == "upload"]
    assert len(ups) == world.size
    if world.size > 1:
        last = max(i for i, e in enumerate(log) if e[0] == "mpi" and e[1] != "allgather")
        gathers = [i for i, e in enumerate(log) if e[:2] == ("mpi", "allgather") and i > last]
        assert ups[0] < gathers[0] and all(g < u for g, u in zip(gathers, ups[1:], strict=True))
    transport.cuda_aware.cache_clear()


@pytest.mark.mpi(min_size=2)
def test_a_forgotten_ready_leaves_other_bytes(deferred, monkeypatch):
    """The stand-ins catch a collective that reads staged codes before they are down."""
    from mpi4py import MPI

    from mpicomp.reduction.transport import Staged

    world = MPI.COMM_WORLD
    x = _gradient(world.rank)
    want = _bounded_result(world, "qsgd_maxnorm", {}, x)
    _transport_is(monkeypatch, "staged")
    monkeypatch.setattr(Staged, "ready", lambda self, lo, hi: None)
    got = _bounded_result(world, "qsgd_maxnorm", {}, D.to_device(x))
    assert D.to_host(got).tobytes() != want.tobytes()
    transport.cuda_aware.cache_clear()
