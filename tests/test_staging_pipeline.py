"""The staged float32 sum in chunks (``Transport.exchange_in_chunks``), on one rank: the
order of its copies and MPI calls, its bytes, its host waits and its buffers, with the
host-backed stand-ins whose copies run only when waited for (tests/_device_arrays.py,
``DeferredStreams``): a wait the pipeline forgot leaves bytes not yet copied."""

import _device_arrays as D
import numpy as np
import pytest
from _devices import REQUIRE_GPU, gpu_present
from mpi4py import MPI

import mpicomp
from conftest import to_numpy
from mpicomp.collectives import plain
from mpicomp.kernels.cuda.device import Device, HostStreams
from mpicomp.reduction import transport
from mpicomp.reduction.transport import (
    CHUNK_BYTES,
    CHUNK_ENV,
    chunk_bounds,
)

CHUNK = 4096  # bytes: 1024 float32 values
N = 5000  # 5 chunks, the last one short


@pytest.fixture
def staged(monkeypatch):
    """The host-backed device, staged through host memory in chunks of ``CHUNK`` bytes,
    its copies deferred; returns its ``DeferredStreams``."""
    monkeypatch.setenv(transport.ENV, "0")
    monkeypatch.setenv(CHUNK_ENV, str(CHUNK))
    transport.cuda_aware.cache_clear()
    D.install()
    streams = D.DeferredStreams()
    monkeypatch.setattr(_device(), "streams", streams)
    yield streams
    transport.cuda_aware.cache_clear()


def _device() -> Device:
    return mpicomp.kernels.backend(D.BACKEND).device


def _gradient(n: int = N, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _comm(chunk: int, **options) -> mpicomp.CompressedComm:
    """A CompressedComm of this rank staging in chunks of ``chunk`` bytes (0: none), as
    ``MPICOMP_STAGING_CHUNK`` says when it is made."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CHUNK_ENV, str(chunk))
        return mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=1, **options)


def _numpy_result(x: np.ndarray, chunk: int = CHUNK, **options) -> np.ndarray:
    with _comm(chunk, **options) as cc:
        return cc.allreduce(x, name="w")


def _log_mpi(monkeypatch, log: list) -> None:
    """Add ``("mpi", step)`` and ``("mpi done", step)`` around each chunk's MPI call."""
    real = plain.allreduce

    def allreduce(*args, step=1, **kwargs):
        log.append(("mpi", step))
        real(*args, step=step, **kwargs)
        log.append(("mpi done", step))

    monkeypatch.setattr(plain, "allreduce", allreduce)


def _chunk_of(log: list, kind: str) -> dict:
    """Return {pointer: chunk index} of the copies of ``kind`` in ``log``."""
    pointers = sorted({e[1] for e in log if e[0] == kind})
    return {p: (p - pointers[0]) // CHUNK for p in pointers}


def test_each_chunk_comes_down_before_the_mpi_of_the_one_before_ends(staged, monkeypatch):
    x = _gradient()
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=1) as cc:
        _log_mpi(monkeypatch, staged.log)  # the call's messages, not the constructor's
        out = cc.allreduce(D.to_device(x), name="w")
    np.testing.assert_array_equal(D.to_host(out), x)
    log = staged.log
    down, up = _chunk_of(log, "download"), _chunk_of(log, "upload")
    n = len(chunk_bounds(N, 4, CHUNK))
    assert sorted(down.values()) == sorted(up.values()) == list(range(n))

    def at(entry) -> int:
        return log.index(entry)

    issued_down = {down[e[1]]: at(e) for e in log if e[0] == "download"}
    ran_down = {down[e[2]]: at(e) for e in log if e[:2] == ("ran", "download")}
    issued_up = {up[e[1]]: at(e) for e in log if e[0] == "upload"}
    for i in range(n):
        step = i + 1
        assert ran_down[i] < at(("mpi", step))  # MPI reads chunk i once it is down
        assert issued_up[i] > at(("mpi done", step))  # and it goes up after
        if i + 1 < n:
            assert issued_down[i + 1] < at(("mpi", step))  # the next one comes down meanwhile
        if i + 2 < n:
            assert issued_down[i + 2] > at(("mpi done", step))  # three buffers: no more
    # The call ends by letting the last uploads run: the decode reads them.
    assert log[-1][:2] == ("ran", "upload")


def test_the_bytes_are_the_unchunked_and_numpy_ones(staged):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(N) * rng.uniform(1e-30, 1e30, N)).astype(np.float32)
    x[[7, 1023, 1024, 4999]] = [0.0, -0.0, np.float32(3.4e38), np.float32(1e-45)]
    want = _numpy_result(x, chunk=0)  # one MPI_Allreduce of the host array
    np.testing.assert_array_equal(_numpy_result(x), want)  # host, in chunks
    for chunk in (CHUNK, 0, 4, N * 4 - 4, 3 * CHUNK):
        with _comm(chunk) as cc:
            got = cc.allreduce(D.to_device(x), name="w")
        assert isinstance(got, D.DeviceArray)
        assert D.to_host(got).tobytes() == want.tobytes(), chunk


def test_a_forgotten_wait_leaves_other_bytes(staged, monkeypatch):
    """The stand-ins catch a pipeline that does not wait: without the host's wait for
    each download, or without the streams' waits for each other, the bytes differ."""
    x = _gradient()
    monkeypatch.setattr(D.DeferredStream, "wait_event", lambda self, event: None)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=1) as cc:
        got = D.to_host(cc.allreduce(D.to_device(x), name="w"))
    assert not np.array_equal(got, x)
    monkeypatch.undo()
    monkeypatch.setenv(transport.ENV, "0")
    monkeypatch.setenv(CHUNK_ENV, str(CHUNK))
    monkeypatch.setattr(_device(), "streams", D.DeferredStreams())
    monkeypatch.setattr(Device, "wait", lambda self, event, why="": None)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=1) as cc:
        got = D.to_host(cc.allreduce(D.to_device(x), name="w"))
    assert not np.array_equal(got, x)


def test_the_host_waits_once_per_chunk_and_reuses_its_buffers(staged, monkeypatch):
    dev, x = _device(), _gradient()
    n = len(chunk_bounds(N, 4, CHUNK))
    made = D.count_pinned(monkeypatch, dev)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=1) as cc:
        cc.allreduce(D.to_device(x), name="w")
        assert len(made) == 2  # the pinned buffers of the chunks going down and up
        for _ in range(3):
            D.reset_syncs()
            before = dev.sync_reasons.copy()
            cc.allreduce(D.to_device(x), name="w")
            reasons = dev.sync_reasons - before
            assert reasons == {"staging: device to host": n}, reasons
            assert D.SYNCS == {"get": n, "implicit": 0, "h2d": n}
        assert len(made) == 2


def test_one_chunk_is_staged_whole_as_before(staged):
    """At or below one chunk nothing overlaps: one download, one MPI_Allreduce."""
    dev, x = _device(), _gradient(CHUNK // 4)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=1) as cc:
        cc.allreduce(D.to_device(x), name="w")
        before = dev.sync_reasons.copy()
        out = cc.allreduce(D.to_device(x), name="w")
    assert dev.sync_reasons - before == {"staging: device to host": 1}
    assert staged.log == []  # no stream copies
    np.testing.assert_array_equal(D.to_host(out), x)


@pytest.mark.parametrize("policy", ["raise", "skip_step", "zero"])
def test_nonfinite_values_in_a_later_chunk_meet_the_policy(staged, policy):
    from mpicomp.comm import NonFiniteWarning

    x = _gradient()
    x[4000] = np.nan  # chunk 3: the check must see every chunk
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=1, nonfinite=policy) as cc:
        if policy == "raise":
            with pytest.raises(ValueError, match="gradient 'w' holds NaN or Inf"):
                cc.allreduce(D.to_device(x), name="w")
        elif policy == "skip_step":
            with pytest.warns(NonFiniteWarning):
                out = cc.allreduce(D.to_device(x), name="w")
            # (A skipped call gives NumPy zeros for device input, on every path.)
            np.testing.assert_array_equal(to_numpy(out), np.zeros_like(x))
        else:
            got = D.to_host(cc.allreduce(D.to_device(x), name="w"))
            np.testing.assert_array_equal(got, _numpy_result(x, nonfinite="zero"))
            assert got[4000] == 0


def test_a_sum_beyond_float32_is_refused_in_a_later_chunk(monkeypatch):
    """A sum that overflows float32 in a later chunk (two equal ranks stood for by one
    rank whose MPI sum doubles) is refused on the rank, every chunk having been sent."""
    from mpicomp import RankError

    monkeypatch.setenv(transport.ENV, "0")
    monkeypatch.setenv(CHUNK_ENV, str(CHUNK))
    transport.cuda_aware.cache_clear()
    D.install()
    x = _gradient()
    seen = []
    real = plain.allreduce

    def doubling(comm, send, recv, op, **kwargs):  # the sum of two equal ranks
        real(comm, send, recv, op, **kwargs)
        recv *= np.float32(2)
        seen.append(kwargs["step"])

    x[4500] = np.float32(3e38)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=1, nonfinite="zero") as cc:
        monkeypatch.setattr(plain, "allreduce", doubling)  # the call's sums only
        with pytest.raises(RankError, match="the sum over ranks overflows float32"):
            cc.allreduce(D.to_device(x), name="w")
    assert seen == [1, 2, 3, 4, 5]  # every chunk summed, then checked: no rank's input was bad
    transport.cuda_aware.cache_clear()


def test_host_streams_copy_when_issued():
    """A device computing on the host (the emulation) copies at once: its events have
    always happened, and waiting for one is counted as a read."""
    dev = Device.emulated()
    assert isinstance(dev.streams, HostStreams)
    a, host, back = np.arange(6, dtype=np.float32), np.empty(6, np.float32), np.zeros(6, np.float32)
    s = dev.stream()
    dev.download(a, host, s)
    event = s.record(dev.event())
    np.testing.assert_array_equal(host, a)
    dev.upload(host * 2, back, s)
    np.testing.assert_array_equal(back, a * 2)
    dev.current_stream().wait_event(event)
    before = dev.syncs
    dev.wait(event, why="staging: device to host")
    assert dev.syncs == before + 1 and dev.sync_reasons["staging: device to host"] == 1


@pytest.mark.skipif(not (gpu_present() or REQUIRE_GPU), reason="needs a GPU (CuPy)")
def test_gpu_streams_pipeline_a_cupy_gradient_to_the_numpy_bytes(monkeypatch):
    """On a GPU: CUDA streams, events and cudaMemcpyAsync, at the default chunk, from the
    default stream and from another current stream."""
    import cupy

    monkeypatch.setenv(transport.ENV, "0")
    monkeypatch.delenv(CHUNK_ENV, raising=False)
    transport.cuda_aware.cache_clear()
    x = _gradient(3 * (CHUNK_BYTES // 4) + 5)  # 4 chunks, the last one short
    want = _numpy_result(x, chunk=CHUNK_BYTES)
    dev = mpicomp.kernels.backend("cuda").device
    made = D.count_pinned(monkeypatch, dev)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=1) as cc:
        before = dev.sync_reasons.copy()
        got = [cc.allreduce(cupy.asarray(x), name="w")]
        assert dev.sync_reasons - before == {"staging: device to host": 4}  # CHUNK_BYTES each
        with cupy.cuda.Stream(non_blocking=True) as stream:
            got.append(cc.allreduce(cupy.asarray(x) * 1, name="w") + 0)
            stream.synchronize()  # the default stream does not wait for this one
        buffers = len(made)
        got.append(cc.allreduce(cupy.asarray(x), name="w"))
        assert len(made) == buffers
    for g in got:
        assert isinstance(g, cupy.ndarray)
        assert g.get().tobytes() == want.tobytes()
    transport.cuda_aware.cache_clear()


@pytest.mark.skipif(not (gpu_present() or REQUIRE_GPU), reason="needs a GPU (CuPy)")
def test_gpu_copies_on_streams_round_trip_through_pinned_memory():
    import cupy

    dev = mpicomp.kernels.backend("cuda").device
    a = cupy.arange(1 << 20, dtype=cupy.float32)
    host = dev.pinned(a.nbytes).view(np.float32)
    back = cupy.zeros_like(a)
    down, up = dev.stream(), dev.stream()
    ready = dev.current_stream().record(dev.event())
    down.wait_event(ready)
    dev.download(a, host, down)
    dev.wait(down.record(dev.event()), why="test")
    np.testing.assert_array_equal(host, np.arange(1 << 20, dtype=np.float32))
    dev.upload(host, back, up)
    dev.current_stream().wait_event(up.record(dev.event()))
    assert bool((back == a).all())
    with pytest.raises(ValueError, match="bytes"):
        dev.download(a, host[:10], down)
