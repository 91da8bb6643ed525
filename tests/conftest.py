"""Shared fixtures: tests taking ``xp`` run on each array module present (NumPy, the
host-backed stand-ins for CuPy arrays of tests/_device_arrays.py, CuPy where a GPU is
found)."""

import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from _devices import REQUIRE_GPU, device, gpu_present, params
from hypothesis import HealthCheck, settings

settings.register_profile(
    "mpicomp",
    deadline=None,
    max_examples=int(os.environ.get("MPICOMP_HYPOTHESIS_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("mpicomp")


BACKENDS = ["numpy", "host-backed"] + (["cupy"] if gpu_present() or REQUIRE_GPU else [])


@pytest.fixture(params=BACKENDS)
def xp(request):
    """The array module of one backend present: numpy, host-backed device arrays, then
    cupy where a GPU is found."""
    if request.param == "cupy":
        if not gpu_present():
            pytest.fail("MPICOMP_TEST_GPU=1 but CuPy finds no GPU")
        import cupy

        return cupy
    if request.param == "host-backed":
        import _device_arrays

        _device_arrays.install()
        return _device_arrays.xp
    return np


@pytest.fixture(scope="module", params=params())
def dev(request):
    """The device a kernel-family test (tests/test_cuda_<family>.py) runs the CUDA sources
    on: the emulation at each launch geometry, and the GPU where one is found
    (tests/_devices.py)."""
    return device(request.param)


def to_numpy(a):
    """Return ``a`` as a NumPy array, wherever it lives."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def gradient_like(n, seed=0, dtype=np.float32):
    """Return a gradient-shaped test vector: mostly small values, a few large ones."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n).astype(dtype) * dtype(1e-3)
    if n:
        g[rng.integers(0, n, max(1, n // 100))] *= dtype(20)
    return g


def world():
    """Return MPI.COMM_WORLD (mpi4py imported here, so collection works without MPI)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture(scope="module")
def one_numba_thread_per_rank():
    """Run a module's kernels on one numba thread: ranks share the cores, and OpenMP
    workers spinning in one rank starve the others."""
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


@pytest.fixture
def gloo():
    """A torch.distributed gloo process group over the MPI ranks (rank and size from
    COMM_WORLD), started and ended on every rank alike."""
    import torch.distributed as dist

    from mpicomp.torch import init_process_group

    init_process_group(world(), "gloo", timeout=60)
    yield dist
    end_process_group()


def end_process_group():
    """Destroy torch.distributed's default group once every rank is done with it (rank
    0's store serves the others until then)."""
    import torch.distributed as dist

    world().Barrier()
    dist.destroy_process_group()


def gather_all(comm, x):
    """Return every rank's ``x`` stacked in rank order (a plain buffer Allgather)."""
    out = np.empty((comm.size,) + x.shape, dtype=x.dtype)
    comm.Allgather(np.ascontiguousarray(x), out)
    return out


def gather_payloads(comm, payload):
    """Return every rank's uint8 ``payload`` (of any length) in rank order (a plain
    Allgatherv)."""
    from mpi4py import MPI

    sizes = gather_all(comm, np.array(payload.size, dtype=np.int64))
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    buf = np.empty(int(sizes.sum()), dtype=np.uint8)
    comm.Allgatherv(payload, [buf, sizes, displs, MPI.BYTE])
    return [buf[d : d + s] for d, s in zip(displs, sizes, strict=True)]


@pytest.fixture
def shared_dir():
    """Yield one new directory, the same on every rank; removed afterwards.

    Made by rank 0 and broadcast, not from pytest's tmp_path machinery (nor
    pytest-mpi's mpi_tmp_path): several pytest processes (ranks) pruning the same
    base directory at once race, and the leaked directory iterator becomes an error
    at exit under ``-W error``.
    """
    comm = world()
    path = comm.bcast(tempfile.mkdtemp(prefix="mpicomp-test-") if comm.rank == 0 else None)
    yield Path(path)
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def ring_chunks(n, size, align):
    """The documented layout: C = align*ceil(ceil(n/N)/align), chunk c = [c*C, (c+1)*C) ∩ [0, n)."""
    C = align * math.ceil(math.ceil(n / size) / align)
    return [(min(n, c * C), min(n, (c + 1) * C)) for c in range(size)]


def bounded_length(n, size):
    """A length of the bounded schedules' tests: a number, or one of the world size N:
    "N-1" is shorter than the ring, "8N+1" leaves trailing chunks empty."""
    return {"N-1": size - 1, "8N+1": 8 * size + 1}.get(n, n)


def bounded_codes(comm, n, bound, dtype, seed=0):
    """This rank's ``n`` codes in [-bound, bound] of ``dtype``, the first at one end of the
    range or the other by rank (random otherwise, by rank and ``seed``)."""
    codes = np.random.default_rng([comm.rank, n, bound, seed]).integers(-bound, bound + 1, n)
    if n:
        codes[0] = bound if comm.rank % 2 else -bound
    return codes.astype(dtype)


@pytest.fixture(params=[8, 24], ids=["align8", "align24"])
def chunk_align(request, monkeypatch):
    """Move the bounded schedules' chunk edges (``collectives.bounded.CHUNK_ALIGN``, which
    the ring and the direct schedule share): on multiples of 8, then of 24 elements."""
    from mpicomp.collectives import bounded

    monkeypatch.setattr(bounded, "CHUNK_ALIGN", request.param)
    return request.param


def ring_order_sum(every, add=np.add):
    """The sum of every rank's row as mpicomp's float rings make it: chunk c of ceil(n/N)
    elements summed in the rank order c+1, c+2, ..., N-1, 0, ..., c by ``add(partial,
    next)``, one addition at a time (float32: ``np.add``; fp16's ring: in float32,
    rounded to float16)."""
    nranks, n = every.shape
    width, out = -(-n // nranks), np.empty(n, every.dtype)
    for c in range(nranks):
        lo, hi = min(n, c * width), min(n, (c + 1) * width)
        acc = every[(c + 1) % nranks, lo:hi].copy()
        for r in range(2, nranks + 1):
            acc = add(acc, every[(c + r) % nranks, lo:hi])
        out[lo:hi] = acc
    return out


def ring_traffic(n, size, rank, align, rs_width, ag_width):
    """Bytes sent/received by ``rank`` in one width-growing ring call, and the world totals.

    The reference of docs/collectives.md: chunk c has ``lens[c]`` elements; at
    reduce-scatter step i a rank sends chunk (r - i) at ``rs_width(i)`` bits, at
    allgather step j chunk (r - j + 1) at ``ag_width`` bits.
    """
    lens = [hi - lo for lo, hi in ring_chunks(n, size, align)]

    def nbytes(count, width):
        return math.ceil(count * width / 8)

    steps = range(1, size)
    sent = sum(nbytes(lens[(rank - i) % size], rs_width(i)) for i in steps)
    sent += sum(nbytes(lens[(rank - j + 1) % size], ag_width) for j in steps)
    recv = sum(nbytes(lens[(rank - i - 1) % size], rs_width(i)) for i in steps)
    recv += sum(nbytes(lens[(rank - j) % size], ag_width) for j in steps)
    total = sum(nbytes(m, rs_width(i)) for i in steps for m in lens)
    total += (size - 1) * sum(nbytes(m, ag_width) for m in lens)
    return sent, recv, total


def direct_traffic(n, size, rank, align, code_width, sum_width):
    """Bytes sent/received by ``rank`` in one direct reduce-scatter + ring allgather call,
    and the world totals (docs/collectives.md): at alltoall step k a rank sends its chunk
    (r - k) at ``code_width`` bits and receives its own chunk r from rank r + k; the
    allgather is the ring's, at ``sum_width`` bits."""
    lens = [hi - lo for lo, hi in ring_chunks(n, size, align)]

    def nbytes(count, width):
        return math.ceil(count * width / 8)

    steps = range(1, size)
    sent = sum(nbytes(lens[(rank - k) % size], code_width) for k in steps)
    sent += sum(nbytes(lens[(rank - j + 1) % size], sum_width) for j in steps)
    recv = (size - 1) * nbytes(lens[rank], code_width)
    recv += sum(nbytes(lens[(rank - j) % size], sum_width) for j in steps)
    total = (size - 1) * sum(nbytes(m, code_width) + nbytes(m, sum_width) for m in lens)
    return sent, recv, total


# The CUDA sources run on the CPU through g++ (kernels/cuda/emulated.py): without it, the
# tests that run them are skipped with that reason (the compile checks skip on their own).
_EMULATED_TESTS = ("test_cuda_", "test_mpi_cuda_emulated")


def pytest_collection_modifyitems(config, items):
    if shutil.which("g++") is not None:
        return
    skip = pytest.mark.skip(reason="g++ is not on PATH: the CUDA sources cannot run on the CPU")
    for item in items:
        module = Path(str(item.fspath)).stem
        if module.startswith(_EMULATED_TESTS) and module != "test_cuda_build":
            item.add_marker(skip)


def report_timeouts(monkeypatch) -> list:
    """Make every timed wait report a timeout once its messages are in (the job goes
    on) and return the list its reports (``_wait.timeout_message``) are appended to."""
    from mpi4py import MPI

    from mpicomp.collectives import _wait

    reports = []

    def done_but_late(requests, timeout, testall):
        MPI.Request.Waitall(requests)
        return False, timeout

    def report(comm, op, detail, timeout, elapsed):
        text = detail() if callable(detail) else detail
        reports.append(_wait.timeout_message(comm, op, text, timeout, elapsed))

    monkeypatch.setattr(_wait, "poll", done_but_late)
    monkeypatch.setattr(_wait, "expire", report)
    return reports
