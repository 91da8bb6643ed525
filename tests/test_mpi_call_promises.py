"""What every public call of a CompressedComm promises at any world size (issue 45): it
agrees before its first message, so one rank's mistake raises on every rank instead of
leaving the others waiting, and its messages name the cause. The rank at fault is the
last one (no message passes by naming rank 0 alone); at one rank only what every rank
does alike is checked."""

import re
import threading
import time

import numpy as np
import pytest
from test_mpi_mistakes import _assert_same_state

import mpicomp
from conftest import gather_all, report_timeouts, world

# The codecs that keep error-feedback residuals by name (and 3LC's shard residuals).
FEEDBACK = {
    "topk": ("topk", {}),
    "threelc": ("threelc", {}),
    "fft": ("fft", {}),
    "fastsgd": ("fastsgd", {}),
    "threelc_sharded": ("threelc", {"sharded": True}),
}


def _grad(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _raised_on_every_rank(comm, fn, *args, **kwargs) -> list:
    """Call ``fn``; return what each rank raised, as (class name, message) or None, in
    rank order. Every rank checks all of them: a rank that raised otherwise fails the
    test on every rank at once, instead of leaving the others waiting in a later call."""
    try:
        fn(*args, **kwargs)
        mine = None
    except Exception as e:
        mine = (type(e).__name__, str(e))
    return comm.allgather(mine)


def _ranks(first: int, last: int) -> str:
    """How messages name ranks ``first`` to ``last`` ("rank 0", "ranks 0-2")."""
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


# --- threads: a second thread waits for the call in progress ----------------------------


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_two_threads_calls_run_in_turn_whether_or_not_they_overlap_on_a_rank():
    """Thread A calls, then thread B: on every rank but the last, B starts after A's call
    returned; on the last, B enters while A is still inside its call (held there by
    on_call). B must wait for A there, never be refused, so that every rank makes both
    calls in the same order. A timeout turns the old refusal's hang into an abort."""
    comm = world()
    overlap = comm.rank == comm.size - 1
    xs = {"a": _grad(3000, comm.rank), "b": _grad(2000, 10 + comm.rank)}
    got, errors, entering = {}, [], threading.Event()

    def call(name):
        try:
            got[name] = cc.allreduce(xs[name], name=name)
        except Exception as e:
            errors.append((name, e))

    b = threading.Thread(target=lambda: (entering.set(), call("b")), name="B")

    def on_call(event):
        if overlap and event["name"] == "a":  # inside A's call: B enters now
            b.start()
            entering.wait(30)
            time.sleep(0.3)  # B reaches the guard and waits there
            got["b inside a"] = b.is_alive() and "b" not in got and not errors

    with mpicomp.CompressedComm(comm, "none", on_call=on_call, timeout=20) as cc:
        a = threading.Thread(target=call, args=("a",), name="A")
        a.start()
        a.join()
        if not overlap:
            b.start()
        b.join()
    assert not errors, errors
    assert got.pop("b inside a", True)  # on the last rank B overlapped A
    for name, x in xs.items():
        want = gather_all(comm, x).astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


# --- names reserved for the residuals of shards and rows ----------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("reserved", ["w#shards#shard0", "w#shard1", "w#shard@0/2"])
def test_a_name_reserved_for_shard_residuals_is_refused_on_its_rank(reserved):
    comm = world()
    last = comm.size - 1
    x = _grad(600, comm.rank)
    with mpicomp.CompressedComm(comm, "topk", min_numel=0) as cc:
        cc.reduce_scatter(x, name="w")  # keeps w#shards#shard<r>
        before = cc.state_dict()
        seen = _raised_on_every_rank(
            comm, cc.allreduce, x, name=reserved if comm.rank == last else "w"
        )
        *others, (kind, message) = seen
        assert kind == "ValueError" and f"name '{reserved}' holds '#shard', which" in message
        failed = ("RankError", f"rank {last} failed in the same call (see its error)")
        assert others == [failed] * last
        _assert_same_state(before, cc.state_dict())


@pytest.mark.mpi
def test_default_and_bucket_names_stay_allowed():
    # allreduce_many names its tensors "#0", "#1", ... and fused buckets "bucket:#0|#1".
    comm = world()
    xs = [_grad(n, comm.rank + n) for n in (300, 500, 2000)]
    with mpicomp.CompressedComm(comm, "topk", ratio=1.0, min_numel=0, bucket_numel=1000) as cc:
        for _ in range(2):  # the second call reads the residuals the first kept
            got = cc.allreduce_many(xs)
        assert sorted(cc.state_dict()["residuals"]) == ["#2", "bucket:#0|#1"]
    for x, y in zip(xs, got, strict=True):
        want = gather_all(comm, x).astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


# --- error feedback: a later call of another size -----------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("codec", FEEDBACK)
def test_a_later_call_of_another_size_names_the_sizes_on_every_rank(codec, op):
    """The rank whose tensor changed size would refuse its residual of the old size: the
    agreement compares sizes first, so every rank raises the same RankError naming them.
    Where every rank changed it alike, every rank raises the residual's own error."""
    comm = world()
    last = comm.size - 1
    name, params = FEEDBACK[codec]
    with mpicomp.CompressedComm(comm, name, min_numel=0, **params) as cc:
        call = getattr(cc, op)
        call(_grad(600, comm.rank), name="w")
        before = cc.state_dict()
        if comm.size > 1:
            n = 400 if comm.rank == last else 600
            seen = _raised_on_every_rank(comm, call, _grad(n, comm.rank), name="w")
            sizes = f"numel: 600 on {_ranks(0, last - 1)}, 400 on rank {last}"
            said = f"ranks disagree on the tensor size in the same call: {sizes}"
            assert all(kind == "RankError" and said in message for kind, message in seen), seen
            _assert_same_state(before, cc.state_dict())
        seen = _raised_on_every_rank(comm, call, _grad(400, comm.rank), name="w")
        said = re.compile(r"tensor 'w[#@\w/]*' had shape \(\d+,\), now \(\d+,\); give each")
        assert all(kind == "ValueError" and said.search(message) for kind, message in seen), seen
        _assert_same_state(before, cc.state_dict())
        after = call(_grad(600, 7 + comm.rank), name="w")
    with mpicomp.CompressedComm(comm, name, min_numel=0, **params) as fresh:
        fresh.load_state_dict(before)
        again = getattr(fresh, op)(_grad(600, 7 + comm.rank), name="w")
    np.testing.assert_array_equal(after, again)


# --- a timeout's report names the call and its tensor -------------------------------------

CALLS = {
    "allreduce": lambda cc, x: cc.allreduce(x, name="fsdp:layer1"),
    "iallreduce": lambda cc, x: cc.iallreduce(x, name="fsdp:layer1").wait(),
    "reduce_scatter": lambda cc, x: cc.reduce_scatter(x, name="fsdp:layer1"),
    "ireduce_scatter": lambda cc, x: cc.ireduce_scatter(x, name="fsdp:layer1").wait(),
    "allgather": lambda cc, x: cc.allgather(x, name="fsdp:layer1"),
    "iallgather": lambda cc, x: cc.iallgather(x, name="fsdp:layer1").wait(),
    "allreduce_many": lambda cc, x: cc.allreduce_many([x], names=["fsdp:layer1"]),
}


@pytest.mark.mpi
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("call", CALLS)
def test_a_timeout_report_names_the_call_and_its_tensor(monkeypatch, call, debug):
    """Every wait is made to report a timeout once its messages are in (so the job goes
    on, as tests/test_timeout.py's jobs cannot): each report of the call, the agreement's
    and the debug check's included, names the op and the tensor."""
    comm = world()
    with mpicomp.CompressedComm(comm, "topk", min_numel=0, timeout=30, debug=debug) as cc:
        reports = report_timeouts(monkeypatch)
        CALLS[call](cc, _grad(600, comm.rank))
        monkeypatch.undo()
    assert reports, "no wait was made under the timeout"
    op = call.removeprefix("i")  # an i-call runs its blocking twin's call
    said = f" ({op} of 'fsdp:layer1') after 30 s (timeout 30 s): "
    assert all(said in r for r in reports), reports
    assert any(" timed out in max_allreduce (" in r for r in reports), reports  # the agreement
