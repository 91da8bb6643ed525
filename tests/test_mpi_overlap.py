"""Nonblocking CompressedComm.iallreduce across ranks: results against a NumPy reference
and bit-identical to allreduce, handles in flight waited in any order, errors raised
by wait() on every rank, the eager fallback, and close() with calls still running."""

import threading

import numpy as np
import pytest
from test_mpi_comm import reference_average

import mpicomp
from conftest import gather_all, gradient_like, world
from mpicomp.codecs import ErrorFeedback
from mpicomp.errors import RankError

N = 5003  # not divisible by 2, 3, 4, 5 or 8
STEPS, TENSORS = 3, 3
CODECS = ["none", "qsgd_maxnorm", "qsgd_maxnorm_multiscale", "signsgd", "threelc", "topk"]


def _inputs(comm, step):
    """This rank's tensors of one step (sizes differ per tensor, the same on every rank)."""
    return [gradient_like(N + 7 * j, seed=1000 * step + 10 * j + comm.rank) for j in range(TENSORS)]


def _expected(name, comm, steps, feedback):
    """The averages every call must return, call by call, from NumPy and codec calls only.

    Calls count in start order (the counter-based draws use it); with error feedback
    every rank's residual of each tensor name is carried from step to step.
    """
    codec = mpicomp.codec(name)
    memory = [ErrorFeedback(codec) for _ in range(comm.size)] if feedback else None
    out = []
    for step in range(steps):
        for j, x in enumerate(_inputs(comm, step)):
            everyone = gather_all(comm, x)
            if not feedback:
                out.append(reference_average(name, everyone, step=step * TENSORS + j))
                continue
            total = np.zeros(x.size, dtype=np.float32)
            for r, xr in enumerate(everyone):  # decoded and summed in rank order
                total += codec.decode(memory[r].encode(xr, f"t{j}"), numel=x.size)
            out.append(total / np.float32(comm.size))
    return out


def _check(name, got, want):
    if name == "none":  # MPI's float32 sum vs a float64 one
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.mpi
@pytest.mark.parametrize("name", CODECS)
def test_iallreduce_matches_the_reference_and_allreduce_bit_for_bit(name):
    comm = world()
    feedback = name in ("threelc", "topk")  # on by default for the biased gather codecs
    want = _expected(name, comm, STEPS, feedback)
    rng = np.random.default_rng(comm.rank)  # each rank waits in its own order
    got, blocking = [], []
    with (
        mpicomp.CompressedComm(comm, name, min_numel=0) as cc,
        mpicomp.CompressedComm(comm, name, min_numel=0, background=False) as ref,
    ):
        assert cc.background  # MPICH and Open MPI wheels provide MPI_THREAD_MULTIPLE
        for step in range(STEPS):
            xs = _inputs(comm, step)
            handles = [cc.iallreduce(x, name=f"t{j}") for j, x in enumerate(xs)]
            results = [None] * TENSORS
            for j in rng.permutation(TENSORS):
                results[j] = handles[j].wait()
            got += results
            blocking += [ref.allreduce(x, name=f"t{j}") for j, x in enumerate(xs)]
        assert cc.state_dict()["step"] == STEPS * TENSORS
    for g, b, w in zip(got, blocking, want, strict=True):
        assert g.dtype == np.float32 and g.shape == w.shape
        np.testing.assert_array_equal(g, b)
        _check(name, g, w)


@pytest.mark.mpi
def test_handles_of_every_step_in_flight_then_waited_backwards():
    comm = world()
    want = _expected("qsgd_maxnorm", comm, STEPS, feedback=False)
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=0) as cc:
        handles = [
            cc.iallreduce(x, name=f"t{j}")
            for step in range(STEPS)
            for j, x in enumerate(_inputs(comm, step))
        ]
        got = [h.wait() for h in reversed(handles)][::-1]
        assert all(h.done and h.test() for h in handles)
        again = [h.wait() for h in handles]  # the same objects, no new call
    for g, a, w in zip(got, again, want, strict=True):
        assert a is g
        np.testing.assert_array_equal(g, w)


@pytest.mark.mpi
def test_iallreduce_many_fuses_like_allreduce_many():
    comm = world()
    sizes = [3000, 10, 2000, 500, 9000]
    xs = [gradient_like(n, seed=50 * comm.rank + i) for i, n in enumerate(sizes)]
    names = [f"p{i}" for i in range(len(sizes))]
    kw = {"min_numel": 0, "bucket_numel": 6000}
    with (
        mpicomp.CompressedComm(comm, "none", **kw) as cc,
        mpicomp.CompressedComm(comm, "none", background=False, **kw) as ref,
    ):
        handle = cc.iallreduce_many(xs, names)
        blocking = ref.allreduce_many(xs, names)
        got = handle.wait()
    for x, g, b in zip(xs, got, blocking, strict=True):
        np.testing.assert_array_equal(g, b)
        _check("none", g, reference_average("none", gather_all(comm, x)))


@pytest.mark.mpi
def test_errors_are_raised_by_wait_on_every_rank_and_later_calls_go_through():
    comm = world()
    last = comm.size - 1
    x = gradient_like(N, seed=comm.rank)
    bad = x.astype(np.int32) if comm.rank == last else x  # refused on the last rank
    longer = gradient_like(N + (comm.rank == 0), seed=comm.rank)  # sizes differ (N > 1)
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=0) as cc:
        refused = cc.iallreduce(bad, name="w")
        mismatched = cc.iallreduce(longer, name="w") if comm.size > 1 else None
        fine = cc.iallreduce(x, name="w")
        np.testing.assert_array_equal(
            fine.wait(), reference_average("qsgd_maxnorm", gather_all(comm, x), step=0)
        )
        expected = TypeError if comm.rank == last else RankError
        for _ in range(2):  # waiting again raises the same error again
            with pytest.raises(expected):
                refused.wait()
        if mismatched is not None:
            with pytest.raises(RankError, match="disagree on the tensor size"):
                mismatched.wait()
        assert cc.state_dict()["step"] == 1  # failed calls take no step, on any rank


@pytest.mark.mpi
def test_skip_step_warns_from_wait_and_returns_zeros():
    comm = world()
    x = gradient_like(N, seed=comm.rank)
    if comm.rank == 0:
        x[5] = np.nan
    with mpicomp.CompressedComm(comm, "threelc", min_numel=0, nonfinite="skip_step") as cc:
        handle = cc.iallreduce(x, name="w")
        with pytest.warns(mpicomp.NonFiniteWarning, match="rank\\(s\\) 0"):
            y = handle.wait()
        assert not np.any(y)
        assert "w" not in cc.state_dict()["residuals"]  # rolled back: no residual made


@pytest.mark.mpi
def test_eager_fallback_gives_completed_handles_with_the_same_results():
    comm = world()
    want = _expected("signsgd", comm, 1, feedback=False)
    workers = {t for t in threading.enumerate() if t.name.startswith("mpicomp-worker")}
    with mpicomp.CompressedComm(comm, "signsgd", min_numel=0, background=False) as cc:
        handles = [cc.iallreduce(x, name=f"t{j}") for j, x in enumerate(_inputs(comm, 0))]
        assert all(h.done for h in handles)  # ran at once, in the caller's thread
        started = {t for t in threading.enumerate() if t.name.startswith("mpicomp-worker")}
        assert started <= workers  # and no background thread was started
        for h, w in zip(handles, want, strict=True):
            np.testing.assert_array_equal(h.wait(), w)


@pytest.mark.mpi
def test_close_waits_for_started_calls_and_handles_keep_their_results():
    comm = world()
    want = _expected("threelc", comm, 2, feedback=True)
    cc = mpicomp.CompressedComm(comm, "threelc", min_numel=0)
    handles = [
        cc.iallreduce(x, name=f"t{j}")
        for step in range(2)
        for j, x in enumerate(_inputs(comm, step))
    ]
    cc.close()
    assert all(h.done for h in handles)
    with pytest.raises(RuntimeError, match="closed"):
        cc.iallreduce(_inputs(comm, 0)[0], name="t0")
    for h, w in zip(handles, want, strict=True):
        np.testing.assert_array_equal(h.wait(), w)


@pytest.mark.mpi
def test_blocking_calls_wait_for_started_ones_first():
    comm = world()
    xs = _inputs(comm, 0)
    want = _expected("qsgd_maxnorm", comm, 1, feedback=False)
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=0) as cc:
        started = cc.iallreduce(xs[0], name="t0")
        y1 = cc.allreduce(xs[1], name="t1")  # call 1: after call 0 on every rank
        assert started.done
        started2 = cc.iallreduce(xs[2], name="t2")
        cc.load_state_dict(cc.state_dict())  # waits for call 2 before reading the step
        assert started2.done and cc.state_dict()["step"] == 3
    for y, w in zip([started.wait(), y1, started2.wait()], want, strict=True):
        np.testing.assert_array_equal(y, w)


@pytest.mark.mpi
def test_float64_input_is_copied_at_start_and_comes_back_float64():
    comm = world()
    x = gradient_like(N, seed=comm.rank).astype(np.float64)
    want = reference_average("qsgd_maxnorm", gather_all(comm, x.astype(np.float32)))
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=0) as cc:
        handle = cc.iallreduce(x, name="w")
        x[:] = 1e6  # converted (copied) at start: this change is not reduced
        y = handle.wait()
    assert y.dtype == np.float64
    np.testing.assert_array_equal(y, want.astype(np.float64))


@pytest.mark.mpi
def test_trace_records_background_calls_in_start_order(shared_dir):
    from mpicomp.trace.report import read

    comm = world()
    path = shared_dir / "overlap.h5"
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=0, trace=path) as cc:
        handles = [cc.iallreduce(x, name=f"t{j}") for j, x in enumerate(_inputs(comm, 0))]
        handles += [cc.iallreduce(x, name=f"t{j}") for j, x in enumerate(_inputs(comm, 1))]
        for h in reversed(handles):
            h.wait()
    if comm.rank == 0:
        events, _, _ = read(path)
        assert events.size == 2 * TENSORS * comm.size
        for r in range(comm.size):
            mine = events[events["rank"] == r]
            assert mine["step"].tolist() == list(range(2 * TENSORS))
            assert [n.decode() for n in mine["name"]] == [f"t{j}" for j in range(TENSORS)] * 2
            # One rank sends nothing (docs/trace-format.md).
            assert np.all(mine["bytes_sent"] > 0) == (comm.size > 1) and np.all(mine["t_total"] > 0)


@pytest.mark.mpi
def test_overlap_job_times_both_schedules(capsys):
    from jobs import overlap

    comm = world()
    row = overlap.measure(comm, 3000, "qsgd_maxnorm", buckets=3, reps=1, params={"bits": 4})
    assert row["ranks"] == comm.size and row["params"] == "bits=4" and row["background"]
    assert min(row[k] for k in ("t_compute", "t_reduce", "t_sequential", "t_overlapped")) > 0
    assert row["saving"] == pytest.approx(1 - row["t_overlapped"] / row["t_sequential"])
    assert overlap.main(["--numel", "2K", "--buckets", "2", "--reps", "1", "--codecs", "none"]) == 0
    out = capsys.readouterr().out
    assert ("overlap bench" in out and "none" in out) == (comm.rank == 0)
