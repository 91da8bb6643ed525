"""signSGD: votes, packed signs and majority decisions against plain NumPy references."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpicomp
from conftest import gradient_like
from mpicomp.kernels.cpu.rng import uniform_array


def reference_majority(counts, nranks, tie_bits):
    bit = np.where(2 * counts > nranks, 1, np.where(2 * counts < nranks, 0, tie_bits))
    return np.packbits(bit.astype(np.uint8), bitorder="little")


@given(n=st.integers(0, 10**5), seed=st.integers(0, 2**32 - 1))
def test_signs_are_packed_votes(n, seed):
    x = gradient_like(n, seed=seed)
    x[::7] = 0.0
    c = mpicomp.codec("signsgd")
    votes = c.votes(x)
    np.testing.assert_array_equal(votes, (x > 0).astype(np.uint8))
    bits = c.signs(x)
    assert bits.size == (n + 7) // 8
    np.testing.assert_array_equal(bits, np.packbits(x > 0, bitorder="little"))


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("tie", ["negative", "positive"])
def test_majority_against_reference(nranks, tie):
    rng = np.random.default_rng(nranks)
    votes = rng.integers(0, 2, (nranks, 1001)).astype(np.uint8)
    counts = votes.sum(axis=0, dtype=np.int32)
    c = mpicomp.codec("signsgd", tie=tie)
    expected = reference_majority(counts, nranks, 1 if tie == "positive" else 0)
    np.testing.assert_array_equal(c.majority(counts, nranks), expected)


def test_random_ties_are_shared_and_unbiased():
    c = mpicomp.codec("signsgd", seed=7)
    counts = np.full(100_000, 2, np.int16)  # 4 ranks, every element a tie
    bits = c.majority(counts, 4, step=3)
    # The same draw on another rank, chunk boundaries anywhere: same bits.
    again = np.concatenate(
        [
            np.unpackbits(c.majority(counts[:333], 4, step=3), bitorder="little")[:333],
            np.unpackbits(c.majority(counts[333:], 4, step=3, offset=333), bitorder="little")[
                : 100_000 - 333
            ],
        ]
    )
    np.testing.assert_array_equal(np.unpackbits(bits, bitorder="little"), again)
    ones = int(np.unpackbits(bits, bitorder="little").sum())
    assert abs(ones - 50_000) < 5 * np.sqrt(100_000 * 0.25)  # 5 sigma of a fair coin
    other = c.majority(counts, 4, step=4)
    assert not np.array_equal(bits, other)
    u = uniform_array(7, 3, 0, 16)
    assert u.dtype == np.float32  # the tie draw and the uniforms share one key schedule


def test_majority_rejects_counts_out_of_range():
    c = mpicomp.codec("signsgd")
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        c.majority(np.array([0, 4]), 3)
    with pytest.raises(ValueError, match="nranks"):
        c.majority(np.array([0, 1]), 0)


def test_encode_decode_carries_mean_magnitude_and_signs():
    x = gradient_like(1003, seed=5).reshape(17, 59)
    c = mpicomp.codec("signsgd")
    p = c.encode(x)
    assert p.size == 16 + 16 + 4 + (1003 + 7) // 8
    y = c.decode(p)
    scale = np.float32(np.abs(x.astype(np.float64)).mean())
    np.testing.assert_array_equal(y, np.where(x > 0, scale, -scale).astype(np.float32))


def test_nonfinite_input_is_refused():
    c = mpicomp.codec("signsgd")
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="NaN or Inf"):
            c.signs(np.array([1.0, bad, 2.0], np.float32))
        with pytest.raises(ValueError, match="NaN or Inf"):
            c.votes(np.array([bad], np.float32))


def test_decode_refuses_stray_bits_and_bad_scale():
    from mpicomp.codecs import _wire

    c = mpicomp.codec("signsgd")
    ok = np.concatenate([np.array([0.5], "<f4").view(np.uint8), np.array([0b111], np.uint8)])
    assert c.decode(_wire.pack("signsgd", (3,), ok)).tolist() == [0.5, 0.5, 0.5]
    stray = ok.copy()
    stray[-1] = 0b1111
    with pytest.raises(mpicomp.PayloadError, match="past its last"):
        c.decode(_wire.pack("signsgd", (3,), stray))
    neg = np.concatenate([np.array([-1.0], "<f4").view(np.uint8), np.array([1], np.uint8)])
    with pytest.raises(mpicomp.PayloadError, match="scale"):
        c.decode(_wire.pack("signsgd", (3,), neg))


@pytest.mark.parametrize("step", range(12))
def test_majority_works_for_every_step_key(step):
    # Keys >= 2**63 once overflowed on their way back into numba.
    bits = mpicomp.codec("signsgd", seed=step).majority(np.full(64, 1, np.int8), 2, step=step)
    assert bits.size == 8


@pytest.mark.parametrize("n", [0, 1, 9, 3 * (1 << 16) + 5])
def test_votes_and_scale_are_votes_and_scale_in_one_pass(n):
    x = gradient_like(n, seed=n)
    c = mpicomp.codec("signsgd")
    votes, scale = c.votes_and_scale(x)
    np.testing.assert_array_equal(votes, c.votes(x))
    assert scale == c.scale(x)
    assert scale == pytest.approx(float(np.abs(x.astype(np.float64)).mean()) if n else 0.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.votes_and_scale(np.array([1.0, np.nan], np.float32))
