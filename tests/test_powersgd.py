"""PowerSGD's steps on one rank (``mpicomp.codecs.powersgd``): what each step of the
paper's Algorithms 1 and 2 gives and keeps, as ``mpicomp.reduction.low_rank.run`` calls
them (the sums over ranks: tests/test_mpi_powersgd.py)."""

import inspect

import numpy as np
import pytest

import mpicomp
from conftest import to_numpy
from mpicomp.reduction.low_rank import LowRankCodec, alone


def _call(codec, kept, g, name="w", shapes=None, feedback=True, nranks=1):
    """Run one call's steps as ``low_rank.run`` does, each sum over ``nranks`` ranks that
    all bring ``g`` (the sum: ``nranks`` times the wire, exact for a power of two)."""
    work = codec.begin(kept, shapes or [g.shape], name, feedback)
    x = codec.add_error(work, g.reshape(-1))
    p_sum = codec.compress(work, x) * np.float32(nranks)
    q_sum = codec.project(work, p_sum) * np.float32(nranks) if work.factored else None
    out = codec.decompress(work, p_sum, q_sum, nranks)
    codec.memorize(work, out)
    return work, out


def test_the_protocol_declares_the_steps_with_the_codecs_parameters():
    codec = mpicomp.codec("powersgd")
    assert isinstance(codec, LowRankCodec)
    steps = ["begin", "add_error", "compress", "project", "decompress", "memorize"]
    for step in steps:
        want = list(inspect.signature(getattr(LowRankCodec, step)).parameters)[1:]
        assert list(inspect.signature(getattr(codec, step)).parameters) == want, step


def test_a_rank_one_matrix_is_rebuilt_and_the_error_is_what_the_factors_missed(xp):
    codec = mpicomp.codec("powersgd", rank=1, start_iter=0)
    u = np.linspace(1, 2, 48, dtype=np.float32)
    v = np.linspace(-1, 1, 64, dtype=np.float32)
    kept = {}
    work, out = _call(codec, kept, xp.asarray(np.outer(u, v)))
    assert work.factored
    np.testing.assert_allclose(to_numpy(out).reshape(48, 64), np.outer(u, v), atol=1e-5)
    np.testing.assert_allclose(to_numpy(kept["error"]), 0, atol=1e-5)
    # A full-rank matrix: the error is Δ - out, bit for bit, and Δ of the next call adds it.
    g = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)
    _, out = _call(codec, kept, xp.asarray(g))
    want = g.reshape(-1) + to_numpy(kept["error"])
    assert np.abs(to_numpy(out) - g.reshape(-1)).max() > 0.1  # rank 1 misses much
    work = codec.begin(kept, [g.shape], "w", True)
    assert to_numpy(codec.add_error(work, xp.asarray(g.reshape(-1)))).tobytes() == want.tobytes()
    assert to_numpy(kept["calls"]).tolist() == [2.0]
    assert kept["q"].shape == (64,)


def test_the_average_over_ranks_divides_the_sums():
    codec = mpicomp.codec("powersgd", rank=2, start_iter=0)
    g = np.random.default_rng(1).standard_normal((30, 40)).astype(np.float32)
    _, one = _call(codec, {}, g, nranks=1)
    _, four = _call(codec, {}, g, nranks=4)  # every rank brings g: the average is g's
    np.testing.assert_allclose(four, one, rtol=1e-5, atol=1e-6)


def test_memorize_puts_new_arrays_in_and_never_writes_into_the_kept_ones():
    codec = mpicomp.codec("powersgd", rank=2, start_iter=0)
    rng = np.random.default_rng(2)
    kept = {}
    _call(codec, kept, rng.standard_normal((30, 40)).astype(np.float32))
    before = dict(kept)
    copies = {k: a.copy() for k, a in kept.items()}
    _call(codec, kept, rng.standard_normal((30, 40)).astype(np.float32))
    assert sorted(kept) == ["calls", "error", "q"]
    for k in before:
        assert kept[k] is not before[k]
        assert before[k].tobytes() == copies[k].tobytes(), k


def test_the_first_start_iter_calls_are_plain_averages_keeping_only_their_count():
    codec = mpicomp.codec("powersgd", start_iter=2)
    g = np.random.default_rng(3).standard_normal((30, 40)).astype(np.float32)
    kept = {}
    for calls in (1, 2):
        work, out = _call(codec, kept, g, nranks=2)
        assert not work.factored
        assert out.tobytes() == g.reshape(-1).tobytes()  # (g + g) / 2
        assert sorted(kept) == ["calls"] and kept["calls"].tolist() == [calls]
    work, _ = _call(codec, kept, g)
    assert work.factored and sorted(kept) == ["calls", "error", "q"]


def test_without_error_feedback_no_error_is_added_or_kept():
    codec = mpicomp.codec("powersgd", start_iter=0)
    g = np.random.default_rng(4).standard_normal((30, 40)).astype(np.float32).reshape(-1)
    kept = {"error": np.ones(g.size, np.float32)}  # say, from a checkpoint
    work = codec.begin(kept, [(30, 40)], "w", feedback=False)
    assert codec.add_error(work, g) is g
    _call(codec, kept, g, shapes=[(30, 40)], feedback=False)
    assert kept["error"].tobytes() == np.ones(g.size, np.float32).tobytes()


@pytest.mark.parametrize("key", ["error", "q"])
def test_kept_arrays_of_another_layout_are_refused_naming_the_tensor(key):
    codec = mpicomp.codec("powersgd", start_iter=0)
    kept = {key: np.zeros(7, np.float32)}
    work = codec.begin(kept, [(30, 40)], "fc.weight", True)
    with pytest.raises(ValueError, match=r"powersgd: tensor 'fc.weight' had another layout"):
        codec.add_error(work, np.zeros(1200, np.float32))


def test_thin_and_one_dimensional_tensors_travel_as_they_are():
    codec = mpicomp.codec("powersgd", rank=2, start_iter=0)
    rng = np.random.default_rng(5)
    tensors = [rng.standard_normal(s).astype(np.float32) for s in [(50,), (40, 2), (30, 40)]]
    flat = np.concatenate([t.reshape(-1) for t in tensors])
    work, out = _call(codec, {}, flat, shapes=[t.shape for t in tensors], nranks=2)
    assert [bool(k.r) for k in work.layout.members] == [False, False, True]
    assert out[:130].tobytes() == flat[:130].tobytes()  # (t + t) / 2, exact


def test_alone_times_one_ranks_factors_and_counts_their_bytes():
    codec = mpicomp.codec("powersgd", rank=2)  # start_iter=1000: alone factors anyway
    u = np.random.default_rng(6).standard_normal((64, 2)).astype(np.float32)
    v = np.random.default_rng(7).standard_normal((2, 96)).astype(np.float32)
    x = u @ v  # rank 2: rebuilt by rank-2 factors
    encode, decode, wire_bytes = alone(codec, x)
    encode()
    np.testing.assert_allclose(decode(), x, rtol=1e-4, atol=1e-4)
    assert wire_bytes() == 4 * (64 + 96) * 2
    encode, decode, wire_bytes = alone(codec, np.arange(5, dtype=np.float32))
    encode()
    assert decode().tobytes() == np.arange(5, dtype=np.float32).tobytes()
    assert wire_bytes() == 4 * 5
