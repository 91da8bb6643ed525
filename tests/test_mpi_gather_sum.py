"""The allgather path's sum of N payloads (``decode_sum``) across real MPI ranks, against
NumPy references built from every rank's payload. Run with
``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/test_mpi_gather_sum.py``."""

import numpy as np
import pytest
from test_fft import body_of, ref_decode_body

import mpicomp
from conftest import gather_all, gather_payloads, gradient_like, world
from mpicomp.codecs import _wire
from mpicomp.kernels.cpu.rfft import BLOCKED_MIN

# Small tensors take NumPy's FFT, large ones the blocked one; FastSGD: one bucket or several.
CASES = [
    ("fastsgd", {}, 10_007),
    ("fastsgd", {"bucket": 1000}, 10_007),
    ("fastsgd", {}, 300_001),
    ("fft", {}, 10_007),
    ("fft", {"theta": 0.5, "bits": 16}, 4_099),
    ("fft", {}, 600_000),
]


def _payloads(comm, codec, n):
    """Every rank's payload of its own gradient, in rank order (a plain Allgatherv)."""
    return gather_payloads(comm, codec.encode(gradient_like(n, seed=500 + comm.rank)))


def _mean(codec, payloads, n):
    """The allgather path's average: the codec's sum of the gathered payloads over N."""
    return codec.decode_gathered(payloads, n) / np.float32(len(payloads))


def _reference_sum(name, payloads, n):
    """Sum of the payloads' values by NumPy, in rank order, in float32 as the path adds."""
    total = np.zeros(n, np.float32)
    for p in payloads:
        if name == "fft":
            total += ref_decode_body(body_of(p).tobytes(), n)
        else:
            total += mpicomp.codec("fastsgd").decode(p, numel=n)
    return total


@pytest.mark.mpi
@pytest.mark.parametrize("name,params,n", CASES)
def test_mean_of_gathered_payloads_matches_numpy(name, params, n):
    comm = world()
    codec = mpicomp.codec(name, **params)
    payloads = _payloads(comm, codec, n)
    mean = _mean(codec, payloads, n)
    assert mean.dtype == np.float32 and mean.shape == (n,)
    reference = _reference_sum(name, payloads, n) / np.float32(comm.size)
    if name == "fastsgd":
        # A scatter-add in rank order: bit-identical to decoding each and adding.
        np.testing.assert_array_equal(mean, reference)
    elif n < BLOCKED_MIN:
        # Small tensors: each payload decoded and added, as before decode_sum existed.
        np.testing.assert_array_equal(mean, reference)
    else:
        # One inverse FFT of the summed spectra: equal up to float32 rounding.
        scale = float(np.abs(reference).max())
        np.testing.assert_allclose(mean, reference, rtol=0, atol=2e-6 * scale)
    # Every rank holds the same result, bit for bit.
    everyone = gather_all(comm, mean)
    for r in range(comm.size):
        np.testing.assert_array_equal(everyone[r], mean, err_msg=f"rank {r} differs")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["fastsgd", "fft"])
def test_a_corrupt_or_mis_sized_payload_raises_on_every_rank(name):
    comm = world()
    codec = mpicomp.codec(name)
    n = 10_007
    payloads = _payloads(comm, codec, n)
    last = comm.size - 1
    # A payload describing 2^40 elements: refused by the numel check, before allocating.
    huge = _wire.pack(name, (1 << 40,), body_of(payloads[last]))
    with pytest.raises(mpicomp.PayloadError):
        _mean(codec, payloads[:last] + [huge], n)
    # A body corrupted behind a valid checksum.
    body = body_of(payloads[last]).copy()
    body[body.size // 2 :] ^= 0x5A
    forged = _wire.pack(name, (n,), body)
    with pytest.raises(mpicomp.PayloadError):
        _mean(codec, payloads[:last] + [forged], n)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["fastsgd", "fft"])
def test_compressed_allreduce_is_the_same_on_every_rank(name):
    comm = world()
    n = 300_001 if name == "fastsgd" else 600_000
    x = gradient_like(n, seed=900 + comm.rank)
    with mpicomp.CompressedComm(comm, codec=name) as cc:
        out = cc.allreduce(x, name="w")
    assert out.shape == x.shape and out.dtype == np.float32
    everyone = gather_all(comm, out)
    for r in range(comm.size):
        np.testing.assert_array_equal(everyone[r], out, err_msg=f"rank {r} differs")
