"""A multi-rank all-reduce through a second kernel backend: every kernel call goes
through the registered record, and the results are the numba backend's."""

from collections import Counter

import numpy as np
import pytest
from _seam import counting_record, poison

import mpicomp
import mpicomp.kernels as K


@pytest.mark.mpi
@pytest.mark.parametrize(
    "name", [n for n in mpicomp.codecs.available() if mpicomp.codec(n).on_kernels]
)
def test_allreduce_through_a_counting_backend_equals_the_default(monkeypatch, name):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    x = np.random.default_rng(world.rank).standard_normal(20_000).astype(np.float32) * 1e-3
    with mpicomp.CompressedComm(world, name, min_numel=1) as cc:
        ref = [cc.allreduce(x, name="w") for _ in range(2)]
    calls = Counter()
    K.register_backend("counting", counting_record(calls))
    try:
        monkeypatch.setenv(K.ENV, "counting")
        with mpicomp.CompressedComm(world, name, min_numel=1) as cc:
            assert cc.kernels.name == "counting"
            poison(monkeypatch, K.backend("numba"))
            got = [cc.allreduce(x, name="w") for _ in range(2)]
    finally:
        K._REGISTRY.pop("counting")
    assert sum(calls.values()) > 0 or name == "none"
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(a, b)
