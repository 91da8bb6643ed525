"""HDF5 traces across real ranks: the rows rank 0 writes, their exact bytes against the
documented formulas (docs/collectives.md), the level-2 steps, and what periodic flushes
leave in the file before close. Run with
``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi``."""

import math

import numpy as np
import pytest

import mpicomp
from conftest import direct_traffic, gather_all, gradient_like, ring_traffic, world
from mpicomp import trace
from mpicomp.collectives.traffic import Traffic
from mpicomp.trace import report

BIG, SMALL = 5003, 10  # SMALL is below min_numel: averaged as plain float32
HEAD = 192  # one MaxAllReduce head (the agreement), sent and received


# Ranks share the cores: one kernel thread each (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_numba_thread_per_rank")


def _expected_bytes(name, comm, x, schedule=None):
    """(sent, recv) of this rank for one CompressedComm call on ``x``, from the docs."""
    size, rank = comm.size, comm.rank
    if name == "signsgd":
        # Agreement, the allgather of every rank's mean |x| (8 bytes), the majority votes.
        if schedule == "direct":
            votes = direct_traffic(x.size, size, rank, 8, 1, 1)
        else:
            votes = ring_traffic(x.size, size, rank, 8, lambda i: math.ceil(math.log2(i + 1)), 1)
        return HEAD + 8 + votes[0], HEAD + 8 * (size - 1) + votes[1]
    if name == "qsgd_maxnorm":
        # Agreement, the MaxAllReduce of the ceil(5003 / 128) = 40 block norms (16 in its
        # head, 24 float32 in its tail), then the signed sum with bound s = 2^(4-1) - 1 = 7.
        if schedule == "direct":
            sums = direct_traffic(x.size, size, rank, 8, 4, (14 * size).bit_length())
        else:
            sums = ring_traffic(
                x.size, size, rank, 8, lambda i: (14 * i).bit_length(), (14 * size).bit_length()
            )
        norms = 2 * HEAD + 24 * 4
        return norms + sums[0], norms + sums[1]
    # threelc: the agreement, sizes (one int64 each), then the payloads by Allgatherv.
    own = mpicomp.codec(name).encode(x).size
    every = gather_all(comm, np.array([own], dtype=np.int64)).reshape(-1)
    return HEAD + 8 + own, HEAD + 8 * (size - 1) + int(every.sum()) - own


def _plain_bytes(numel):
    return HEAD + 4 * numel  # agreement, then one float32 MPI_Allreduce (logical bytes)


def _inputs(rank, calls):
    return [
        (gradient_like(BIG, seed=100 * c + rank), gradient_like(SMALL, seed=7 + c))
        for c in range(calls)
    ]


@pytest.mark.mpi
@pytest.mark.parametrize(
    "name,schedule",
    [
        ("qsgd_maxnorm", None),
        ("qsgd_maxnorm", "direct"),
        ("signsgd", None),
        ("signsgd", "direct"),
        ("threelc", None),
    ],
)
def test_events_hold_one_row_per_call_per_rank_with_the_exact_bytes(name, schedule, shared_dir):
    comm = world()
    path = shared_dir / f"{name}-{schedule}.h5"
    params = {"bits": 4} if name == "qsgd_maxnorm" else {}
    inputs = _inputs(comm.rank, 3)
    with mpicomp.CompressedComm(
        comm, name, min_numel=1024, error_feedback=False, trace=path, schedule=schedule, **params
    ) as cc:
        for big, small in inputs:
            cc.allreduce(big, name="w")
            cc.allreduce(small, name="b")
    expected = []
    for big, _ in inputs:
        expected += [_expected_bytes(name, comm, big, schedule), (_plain_bytes(SMALL),) * 2]
    if comm.size == 1:
        expected = [(0, 0)] * len(expected)  # one rank: nothing crosses the wire
    mine = np.array(expected, dtype=np.int64)
    every = gather_all(comm, mine)  # before any assert: a failing rank must not desync
    events, steps, attrs = report.read(path)
    size, calls = comm.size, 2 * len(inputs)
    assert steps is None  # level 1
    assert events.size == calls * size
    # Sorted by call, then rank; every rank has every call.
    assert events["call"].tolist() == [c for c in range(calls) for _ in range(size)]
    assert events["rank"].tolist() == list(range(size)) * calls
    assert events["step"].tolist() == events["call"].tolist()
    assert events["name"].tolist() == ([b"w"] * size + [b"b"] * size) * len(inputs)
    big_rows = events["name"] == b"w"
    assert set(events["numel"][big_rows].tolist()) == {BIG}
    assert set(events["numel"][~big_rows].tolist()) == {SMALL}
    assert (events["bytes_in"] == 4 * events["numel"]).all()
    assert set(events["codec"][big_rows].tolist()) == {name.encode()}
    assert set(events["codec"][~big_rows].tolist()) == {b"none"}
    assert set(events["op"][big_rows].tolist()) == {b"allreduce"}
    assert set(events["op"][~big_rows].tolist()) == {b"allreduce below min_numel"}
    for r in range(size):
        rows = events[events["rank"] == r]
        assert rows["bytes_sent"].tolist() == every[r, :, 0].tolist()
        assert rows["bytes_recv"].tolist() == every[r, :, 1].tolist()
    for col in ("t_encode", "t_comm", "t_decode"):
        assert (events[col] >= 0).all() and (events[col] <= events["t_total"]).all()
    phases = events["t_encode"] + events["t_comm"] + events["t_decode"]
    assert (phases <= events["t_total"] * (1 + 1e-9)).all()
    assert attrs["world_size"] == size and attrs["codec"] == name
    assert attrs["mpicomp_trace_version"] == 3 and "end_time" in attrs
    # A timeline: one rank's calls follow one another on the shared clock.
    for r in range(size):
        rows = events[events["rank"] == r]
        ends = rows["t_start"] + rows["t_total"]
        assert rows["t_start"][0] >= 0 and (rows["t_start"][1:] >= ends[:-1]).all()
    assert attrs["error_feedback"] is False and attrs["min_numel"] == 1024
    assert attrs["schedule"] == schedule or (schedule is None and attrs["schedule"] != "direct")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["signsgd", "qsgd_maxnorm_multiscale", "threelc"])
def test_level_2_steps_sum_to_the_event_bytes(name, shared_dir):
    comm = world()
    path = shared_dir / f"steps-{name}.h5"
    inputs = _inputs(comm.rank, 2)
    seen = Traffic()
    opts = {"min_numel": 1024, "bucket_numel": 1000}  # w goes alone, b1 and b2 together
    with mpicomp.CompressedComm(comm, name, trace=path, trace_level=2, **opts) as cc:
        cc.recorder = seen  # gets every exchange step too
        for big, small in inputs:
            cc.allreduce(big, name="w")
            cc.allreduce(small, name="b")
        cc.allreduce_many([inputs[0][0], inputs[0][1], inputs[1][1]], names=["w", "b1", "b2"])
    events, steps, attrs = report.read(path)
    assert attrs["trace_level"] == 2 and steps is not None
    mine = events[events["rank"] == comm.rank]
    assert mine["op"].tolist()[-2:] == [b"allreduce_many", b"allreduce_many bucket below min_numel"]
    assert mine["name"].tolist()[-1] == b"bucket:b1|b2" and mine["numel"][-1] == 2 * SMALL
    for ev in events:
        rows = steps[(steps["call"] == ev["call"]) & (steps["rank"] == ev["rank"])]
        assert rows.size > 0
        assert (int(rows["sent"].sum()), int(rows["recv"].sum())) == (
            ev["bytes_sent"],
            ev["bytes_recv"],
        )
        # each step ends inside its call, in order
        assert (rows["t_end"] >= ev["t_start"]).all()
        assert (rows["t_end"] <= ev["t_start"] + ev["t_total"]).all()
        assert (np.diff(rows["t_end"]) >= 0).all()
    # What the extra recorder saw is what this rank's rows hold.
    assert (seen.sent, seen.recv) == (int(mine["bytes_sent"].sum()), int(mine["bytes_recv"].sum()))
    my_steps = steps[steps["rank"] == comm.rank]
    assert [(s["op"].decode(), int(s["substep"]), int(s["bits"])) for s in my_steps] == [
        (op, step, bits) for op, step, _, _, bits in seen.steps
    ]
    if name == "signsgd" and comm.size > 1:
        ring = my_steps[np.char.startswith(my_steps["op"], b"ring.")]
        assert ring.size == 2 * (comm.size - 1) * 3  # 3 signSGD calls (w, w, many's w)


@pytest.mark.mpi
def test_flushed_rows_are_in_the_file_before_close(shared_dir):
    comm = world()
    path = shared_dir / "flush.h5"
    cc = mpicomp.CompressedComm(comm, "signsgd", trace=path, trace_flush_every=2)
    for c in range(5):
        cc.allreduce(gradient_like(BIG, seed=c + comm.rank), name="w")
    comm.Barrier()  # rank 0 wrote the 2nd flush before it reached the barrier
    if comm.rank == 0:
        events, _, attrs = report.read(path)
        flushed = events["call"].tolist()
        closed_before = "end_time" in attrs
    comm.Barrier()  # rank 0 has closed the file again before the next flush opens it
    cc.close()
    if comm.rank == 0:
        assert flushed == [c for c in range(4) for _ in range(comm.size)]
        assert not closed_before
        events, _, attrs = report.read(path)
        assert events["call"].tolist() == [c for c in range(5) for _ in range(comm.size)]
        assert "end_time" in attrs


@pytest.mark.mpi
def test_a_tracer_never_closed_leaves_its_flushed_rows(shared_dir):
    comm = world()
    sub = comm.Dup()
    path = shared_dir / "crash.h5"
    tracer = trace.Tracer(sub, path, flush_every=3, attrs={"codec": "test"})
    for c in range(7):
        tracer.begin(c, "allreduce", "test", f"t{c}", 10 + c)
        tracer.record("fake.step", 1, 100 + comm.rank, 200, 8)
        tracer.encoded()
        tracer.end()
    del tracer  # the job dies here: one call never flushed, no close
    comm.Barrier()
    if comm.rank == 0:
        events, _, attrs = report.read(path)
    comm.Barrier()
    sub.Free()
    if comm.rank == 0:
        assert events.size == 6 * comm.size and "end_time" not in attrs
        assert events["numel"].tolist() == [10 + c for c in range(6) for _ in range(comm.size)]
        assert events["bytes_sent"].tolist() == list(range(100, 100 + comm.size)) * 6
        assert (events["bytes_recv"] == 200).all() and attrs["codec"] == "test"


@pytest.mark.mpi(min_size=2)
def test_a_call_that_fails_on_every_rank_is_not_recorded(shared_dir):
    comm = world()
    path = shared_dir / "fail.h5"
    with mpicomp.CompressedComm(
        comm, "qsgd_maxnorm", trace=path, trace_level=2, trace_flush_every=2, min_numel=0
    ) as cc:
        cc.allreduce(gradient_like(100, seed=comm.rank), name="ok")
        with pytest.raises(RuntimeError, match="disagree"):
            cc.allreduce(gradient_like(100 + comm.rank, seed=1), name="bad")
        cc.allreduce(gradient_like(100, seed=2), name="ok")
        cc.allreduce(gradient_like(100, seed=3), name="ok")
    events, steps, _ = report.read(path)
    assert events.size == 3 * comm.size
    assert set(events["name"].tolist()) == {b"ok"}
    assert events["call"].tolist() == [c for c in range(3) for _ in range(comm.size)]
    assert events["step"].tolist() == [s for s in (0, 1, 2) for _ in range(comm.size)]
    for ev in events:
        rows = steps[(steps["call"] == ev["call"]) & (steps["rank"] == ev["rank"])]
        assert int(rows["sent"].sum()) == ev["bytes_sent"]


@pytest.mark.mpi
def test_an_uncreatable_trace_file_raises_on_every_rank(shared_dir):
    comm = world()
    with pytest.raises(OSError):
        mpicomp.CompressedComm(comm, "none", trace=shared_dir / "missing" / "t.h5")
    with pytest.raises(ValueError, match="level"):
        mpicomp.CompressedComm(comm, "none", trace=shared_dir / "t.h5", trace_level=3)
