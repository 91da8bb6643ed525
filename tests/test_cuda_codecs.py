"""Every codec through the CUDA sources (the ``cuda-emulated`` backend) gives the numba
backend's payload bytes and decoded arrays, with no numba launcher reachable."""

import inspect

import _device_arrays as D
import numpy as np
import pytest
from _devices import REQUIRE_GPU, gpu_present, place
from _seam import assert_same, poison, round_trip

import mpicomp
import mpicomp.kernels as K
from conftest import gradient_like

# Sizes that keep the emulation short and reach ragged tails; parameters that reach every
# kernel path (multi-scale, GlobalRandK, error feedback, buckets, plain quartic).
# Codecs on mpicomp's kernels (not PowerSGD's BLAS products, which no twin computes).
KERNEL_CODECS = [n for n in mpicomp.codecs.available() if mpicomp.codec(n).on_kernels]
CASES = [(name, {}) for name in KERNEL_CODECS] + [
    ("threelc", {"zero_run": False}),
    ("threelc", {"sparsity": 1.5}),
    ("fft", {"theta": 0.5, "bits": 6}),
    ("fastsgd", {"bucket": 1000}),
    ("grandk_maxnorm_multiscale", {"k": 0.3}),
    ("qsgd_maxnorm", {"bits": 4}),
    ("topk", {"ratio": 0.05}),
]


def test_the_emulated_record_has_every_launcher_of_numba_with_its_parameters():
    numba, cuda = K.backend("numba"), K.backend("cuda-emulated")
    assert cuda.name == "cuda-emulated" and cuda.xp is np and K.threadsafe(cuda)
    for fam in K.FAMILIES:
        mine, theirs = K.launchers(cuda, fam), K.launchers(numba, fam)
        assert sorted(mine) == sorted(theirs), fam
        for name, fn in theirs.items():
            want = list(inspect.signature(fn).parameters)
            assert list(inspect.signature(mine[name]).parameters) == want, (fam, name, want)


# Where the CUDA sources compute: the emulation on NumPy arrays (MPICOMP_KERNELS), the same
# behind device arrays that refuse host access as CuPy's do, and a GPU where one is present.
PLACES = ["emulated", "host-backed"] + (["gpu"] if gpu_present() or REQUIRE_GPU else [])


@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}{p or ''}" for n, p in CASES])
@pytest.mark.parametrize("n", [1, 4099])
def test_every_codec_gives_the_numba_bytes_through_the_cuda_sources(
    monkeypatch, where, name, params, n
):
    x = gradient_like(n, seed=n)
    ref = round_trip(mpicomp.codec(name, **params), x)
    to_place, to_host, array_type = place(where)
    if where == "emulated":
        monkeypatch.setenv(K.ENV, "cuda-emulated")
    codec = mpicomp.codec(name, **params)
    if where == "emulated":
        assert codec.kernels.name == "cuda-emulated"
    poison(monkeypatch, K.backend("numba"))
    D.reset_syncs()
    got = round_trip(codec, to_place(x))
    # Only explicit reads (the record's to_host) bring device bytes to the host.
    assert D.SYNCS["implicit"] == 0, D.SYNCS
    for a, b in zip(ref, got, strict=True):
        assert isinstance(b, array_type), (type(b), array_type)
        assert_same(np.asarray(a), to_host(b), transform_differs=name == "fft" and where == "gpu")
