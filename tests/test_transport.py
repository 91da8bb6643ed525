"""mpicomp/reduction/transport.py: whether the MPI library takes GPU buffers (forced by
MPICOMP_CUDA_AWARE, asked of the library, told by a build's own settings), the staging
chunk, and the staging buffers one CompressedComm makes once and reuses (the pipelined
exchange itself: tests/test_staging_pipeline.py)."""

import numpy as np
import pytest

from mpicomp.reduction import transport
from mpicomp.reduction.transport import (
    CHUNK_ENV,
    Transport,
    chunk_bounds,
    describe,
    staging_chunk,
)


@pytest.fixture(autouse=True)
def fresh_decision():
    """Each test decides anew; what it decided is not kept for the next."""
    transport.cuda_aware.cache_clear()
    yield
    transport.cuda_aware.cache_clear()


def test_chunk_bounds_cover_the_array_in_whole_values():
    assert chunk_bounds(10, 4, 16) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 4, 16) == [(0, 4), (4, 8)]
    assert chunk_bounds(4, 4, 16) == [(0, 4)]  # fits: one message, as unchunked
    assert chunk_bounds(10, 4, 0) == [(0, 10)]  # 0: no chunks
    assert chunk_bounds(0, 4, 16) == [(0, 0)]
    assert chunk_bounds(3, 4, 2) == [(0, 1), (1, 2), (2, 3)]  # a value at least


# The settings that say an MPI library's build takes GPU buffers (docs/environment.md).
CUDA_HINTS = (
    "OMPI_MCA_opal_cuda_support",
    "MPIR_CVAR_ENABLE_GPU",
    "MPICH_GPU_SUPPORT_ENABLED",
    "MV2_USE_CUDA",
    "I_MPI_OFFLOAD",
)


def test_intel_mpi_offload_is_a_hint_when_the_library_cannot_be_asked(monkeypatch):
    for var in (transport.ENV, *CUDA_HINTS):
        monkeypatch.delenv(var, raising=False)
    unasked = (None, "the library has no MPIX_Query_cuda_support")
    monkeypatch.setattr(transport, "library_cuda_support", lambda path, vendor: unasked)
    try:
        for value, expect in (
            ("1", (True, "I_MPI_OFFLOAD=1 (Intel MPI)")),
            ("0", (False, f"{unasked[1]}; no environment hint")),
        ):
            monkeypatch.setenv("I_MPI_OFFLOAD", value)
            transport.cuda_aware.cache_clear()
            assert transport.cuda_aware() == expect
    finally:
        transport.cuda_aware.cache_clear()


@pytest.mark.parametrize(
    "vendor, var", [("MPICH", "MPIR_CVAR_ENABLE_GPU"), ("Open MPI", "OMPI_MCA_opal_cuda_support")]
)
def test_gpu_support_switched_off_for_the_run_wins_over_the_build(vendor, var, monkeypatch):
    """Open MPI 4.1 answers MPIX_Query_cuda_support with how it was built: a run that
    switched CUDA off must not get device pointers."""
    monkeypatch.setenv(var, "0")
    assert transport.library_cuda_support("/no/such/libmpi.so", vendor) == (False, f"{var}=0")
    other = "Open MPI" if vendor == "MPICH" else "MPICH"
    assert transport.library_cuda_support(None, other)[0] is None  # another vendor's knob


@pytest.mark.parametrize(
    "value, forced", [("1", True), ("yes", True), ("on", True), ("0", False), ("off", False)]
)
def test_mpicomp_cuda_aware_decides_when_set(monkeypatch, value, forced):
    monkeypatch.setenv(transport.ENV, value)
    assert transport.cuda_aware() == (forced, f"MPICOMP_CUDA_AWARE={value}")


def test_a_bad_mpicomp_cuda_aware_is_named(monkeypatch):
    monkeypatch.setenv(transport.ENV, "maybe")
    with pytest.raises(ValueError, match="MPICOMP_CUDA_AWARE='maybe' is not a boolean"):
        transport.cuda_aware()


def test_what_mpicomp_info_says_of_an_answer():
    assert describe((True, "MPIX_Query_cuda_support")) == "yes (MPIX_Query_cuda_support)"
    assert describe((False, "MPIR_CVAR_ENABLE_GPU=0")) == "no (MPIR_CVAR_ENABLE_GPU=0)"
    assert describe((None, "MPI library file not found")) == "unknown (MPI library file not found)"


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (None, 4 << 20),
        ("", 4 << 20),
        ("0", 0),
        ("65536", 65536),
        ("8M", 8 << 20),
        ("512k", 512 << 10),
        ("1GiB", 1 << 30),
    ],
)
def test_the_chunk_comes_from_the_environment(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv(CHUNK_ENV, raising=False)
    else:
        monkeypatch.setenv(CHUNK_ENV, raw)
    assert staging_chunk() == want
    assert Transport().chunk_bytes == want


@pytest.mark.parametrize("raw", ["-1", "4 MB please", "1.5M", "lots"])
def test_a_bad_chunk_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(CHUNK_ENV, raw)
    with pytest.raises(ValueError, match=CHUNK_ENV):
        staging_chunk()
    with pytest.raises(ValueError, match="chunk_bytes must be >= 0"):
        Transport(chunk_bytes=-1)


def test_a_slots_buffer_is_made_once_and_grows_by_half_again():
    class Record:  # a backend that cannot pin: NumPy buffers
        pass

    t = Transport(direct=False, chunk_bytes=0)
    assert t.path == "staged" and Transport(direct=True).path == "direct"
    small = t.host(Record(), "wire", np.float32, 10)
    assert small.shape == (10,) and small.dtype == np.float32 and t.allocations == 1
    assert t.host(Record(), "wire", np.uint8, 1000).base is small.base  # 64 KiB at least
    assert t.allocations == 1
    big = t.host(Record(), "wire", np.uint8, 70_000)
    assert t.allocations == 2 and big.base.nbytes == 98_304  # 64 KiB * 3/2
    t.host(Record(), "codes", np.int64, 1)  # another slot, another buffer
    assert t.allocations == 3


def test_down_in_order_copies_span_by_span_and_ready_waits_for_what_it_names():
    """``down_in_order`` issues one copy per span in the order given; ``ready(lo, hi)``
    lets exactly the spans that meet [lo, hi) run (the stand-ins' copies run only when
    waited for), each counted once as a staging wait; bytes not yet waited for are not
    there."""
    import _device_arrays as D

    import mpicomp

    D.install()
    dev = mpicomp.kernels.backend(D.BACKEND).device
    streams = D.DeferredStreams()
    old = dev.streams
    dev.streams = streams
    try:
        x = np.arange(1, 41, dtype=np.int8)
        t = Transport(direct=False, chunk_bytes=0)
        record = mpicomp.kernels.backend(D.BACKEND)
        before = dev.sync_reasons["staging: device to host"]
        spans = [(16, 24), (8, 16), (0, 8), (24, 24), (24, 40)]  # an empty one: no copy
        staged = t.down_in_order(record, D.to_device(x), "codes", spans)
        staged.host[:] = 0  # what a buffer held before (copies have not run)
        issued = [e for e in streams.log if e[0] == "download"]
        assert len(issued) == 4 and not any(e[0] == "ran" for e in streams.log)
        assert [p - issued[2][1] for _, p in issued] == [16, 8, 0, 24]  # in spans' order
        staged.ready(10, 12)  # inside (8, 16): the copy queued before it ran too
        assert np.array_equal(staged.host[8:24], x[8:24])
        assert not staged.host[:8].any() and not staged.host[24:].any()
        staged.ready(5, 5)  # empty: nothing waited
        staged.ready(20, 22)  # down already: no wait
        assert dev.sync_reasons["staging: device to host"] - before == 1
        staged.ready(30, 31)  # the last span: one wait covers (0, 8) too
        assert np.array_equal(staged.host, x)
        assert dev.sync_reasons["staging: device to host"] - before == 2
        staged.ready(0, 40)  # each span is waited for once at most
        assert dev.sync_reasons["staging: device to host"] - before == 2
    finally:
        dev.streams = old
