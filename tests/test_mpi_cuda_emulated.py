"""Multi-rank all-reduce of every codec through the CUDA sources (``cuda-emulated``): the
numba backend's results, bit for bit, with no numba launcher reachable (rings, fp16 sum
and payload checksums included)."""

import numpy as np
import pytest
from _seam import poison

import mpicomp
import mpicomp.kernels as K


@pytest.mark.mpi
@pytest.mark.parametrize(
    "name", [n for n in mpicomp.codecs.available() if mpicomp.codec(n).on_kernels]
)
def test_allreduce_through_the_cuda_sources_equals_numba(monkeypatch, name):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rng = np.random.default_rng(world.rank)
    xs = [rng.standard_normal(n).astype(np.float32) * 1e-3 for n in (3001, 700, 64)]

    def run():
        with mpicomp.CompressedComm(world, name, min_numel=1, bucket_numel=1000) as cc:
            out = [cc.allreduce(xs[0], name="w") for _ in range(2)]
            return out + cc.allreduce_many(xs[1:], ["a", "b"])

    ref = run()
    monkeypatch.setenv(K.ENV, "cuda-emulated")
    poison(monkeypatch, K.backend("numba"))
    got = run()
    for a, b in zip(ref, got, strict=True):
        assert a.tobytes() == b.tobytes()
