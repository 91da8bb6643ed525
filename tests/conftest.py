"""Shared fixtures: every codec test runs on each backend present (NumPy always, CuPy
where a GPU is found) and compares bytes with the NumPy run."""

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "mpicomp",
    deadline=None,
    max_examples=int(os.environ.get("MPICOMP_HYPOTHESIS_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("mpicomp")


def _backends():
    names = ["numpy"]
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            names.append("cupy")
    except Exception:  # no CuPy, or CuPy without a usable GPU
        pass
    return names


BACKENDS = _backends()


@pytest.fixture(params=BACKENDS)
def xp(request):
    """The array module of one backend present: numpy, then cupy where a GPU is found."""
    if request.param == "cupy":
        import cupy

        return cupy
    return np


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


def gather_all(comm, x):
    """Return every rank's ``x`` stacked in rank order (a plain buffer Allgather)."""
    out = np.empty((comm.size,) + x.shape, dtype=x.dtype)
    comm.Allgather(np.ascontiguousarray(x), out)
    return out


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
