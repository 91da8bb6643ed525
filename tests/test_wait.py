"""collectives/_wait.py, on one rank: the wait loop with fake requests and a fake clock,
the timeout's resolution, the report and abort of a rank that timed out, and the MPI
calls made blocking without a timeout or nonblocking and waited on under one."""

import numpy as np
import pytest

from mpicomp.collectives import _wait


class FakeClock:
    """A clock that only moves when the wait loop sleeps; records every sleep."""

    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


class FakeRequests:
    """Requests that complete on the ``done_after``-th test (never when None)."""

    def __init__(self, done_after):
        self.done_after = done_after
        self.tests = 0

    def testall(self, requests):
        assert requests is self
        self.tests += 1
        return self.done_after is not None and self.tests >= self.done_after


def test_poll_completes_without_sleeping_when_ready():
    clock, reqs = FakeClock(), FakeRequests(1)
    assert _wait.poll(reqs, 2.0, reqs.testall, clock, clock.sleep) == (True, 0.0)
    assert clock.sleeps == []


def test_poll_backs_off_from_10us_to_1ms():
    clock, reqs = FakeClock(), FakeRequests(12)
    done, fake_clock_total = _wait.poll(reqs, 2.0, reqs.testall, clock, clock.sleep)
    assert done and reqs.tests == 12
    want = [1e-5 * 2**k for k in range(7)] + [1e-3] * 4  # 10 us doubling, capped at 1 ms
    assert clock.sleeps == pytest.approx(want)
    assert fake_clock_total == pytest.approx(sum(want))  # the fake clock's total, not real time


def test_poll_gives_up_at_the_timeout_exactly():
    clock, reqs = FakeClock(), FakeRequests(None)
    done, fake_clock_total = _wait.poll(reqs, 0.01, reqs.testall, clock, clock.sleep)
    assert not done
    assert fake_clock_total == pytest.approx(0.01)
    assert max(clock.sleeps) <= 1e-3
    # The last sleep is cut to the time left: the loop never oversleeps its deadline.
    assert sum(clock.sleeps) == pytest.approx(0.01)
    assert reqs.tests == len(clock.sleeps) + 1


def test_poll_tests_once_more_after_the_last_sleep():
    # Completion that arrives during the last sleep is seen, not reported as a timeout.
    clock = FakeClock()
    reqs = FakeRequests(None)
    _wait.poll(reqs, 0.01, reqs.testall, clock, clock.sleep)
    late = FakeRequests(reqs.tests)
    clock2 = FakeClock()
    assert _wait.poll(late, 0.01, late.testall, clock2, clock2.sleep)[0]


@pytest.mark.parametrize(
    "env, arg, want",
    [(None, None, 0.0), ("", None, 0.0), ("0", None, 0.0), ("2.5", None, 2.5), ("7", 1, 1.0)],
)
def test_resolve_timeout(monkeypatch, env, arg, want):
    if env is None:
        monkeypatch.delenv(_wait.ENV, raising=False)
    else:
        monkeypatch.setenv(_wait.ENV, env)
    assert _wait.resolve_timeout(arg) == want


def test_resolve_timeout_explicit_zero_turns_the_environment_off(monkeypatch):
    monkeypatch.setenv(_wait.ENV, "5")
    assert _wait.resolve_timeout(0) == 0.0
    assert _wait.resolve_timeout(_wait.resolve_timeout(0)) == 0.0  # resolves to itself
    assert _wait.resolve_timeout(np.float32(0.5)) == 0.5


@pytest.mark.parametrize("env", ["soon", "-1", "nan"])
def test_resolve_timeout_rejects_a_bad_environment(monkeypatch, env):
    monkeypatch.setenv(_wait.ENV, env)
    with pytest.raises(ValueError, match=_wait.ENV):
        _wait.resolve_timeout()


@pytest.mark.parametrize(
    "arg, exc", [(-1, ValueError), (float("nan"), ValueError), ("2", TypeError), (True, TypeError)]
)
def test_resolve_timeout_rejects_a_bad_argument(arg, exc):
    with pytest.raises(exc, match="timeout"):
        _wait.resolve_timeout(arg)


class FakeComm:
    """Rank 3 of 5; records the error code it is aborted with."""

    aborted = None

    def Get_rank(self):
        return 3

    def Get_size(self):
        return 5

    def Abort(self, code):
        self.aborted = code


def test_expire_reports_what_was_awaited_and_aborts(caplog, monkeypatch):
    comm = FakeComm()
    exits = []
    # An MPI_Abort that returns (FakeComm's, as MPICH's may): the process ends anyway.
    monkeypatch.setattr(_wait.os, "_exit", exits.append)
    _wait.expire(comm, "allgather", lambda: "sizes from rank 2", 2.0, 2.0004)
    err = caplog.text  # logged CRITICAL to "mpicomp" (stderr where logging is not set up)
    assert comm.aborted == _wait.ABORT_CODE
    assert exits == [_wait.ABORT_CODE]
    assert "rank 3 of 5 timed out in allgather after 2 s (timeout 2 s): sizes from rank 2" in err


def test_a_timeout_that_names_the_callers_call_keeps_it_through_resolution(monkeypatch):
    monkeypatch.setenv(_wait.ENV, "5")  # read by no one: the timeout is resolved
    timeout = _wait.Timeout(2.0, "reduce_scatter of 'fsdp:layer1'")
    assert _wait.resolve_timeout(timeout) is timeout and timeout == 2.0
    said = _wait.timeout_message(FakeComm(), "max_allreduce", "the head", timeout, timeout)
    assert said.startswith(
        "mpicomp: rank 3 of 5 timed out in max_allreduce (reduce_scatter of 'fsdp:layer1') "
        "after 2 s (timeout 2 s): the head. "
    )


# --- the calls, on one rank -------------------------------------------------------------


@pytest.mark.parametrize("timeout", [None, 1.0])
def test_issue_calls_the_blocking_function_or_under_a_timeout_its_twin(timeout):
    from mpi4py import MPI

    called = []

    def blocking(comm, *args, **kwargs):
        called.append("Allreduce")
        return MPI.Comm.Allreduce(comm, *args, **kwargs)

    def nonblocking(comm, *args, **kwargs):
        called.append("Iallreduce")
        return MPI.Comm.Iallreduce(comm, *args, **kwargs)

    got = np.zeros(3)
    _wait.issue(
        MPI.COMM_SELF, blocking, nonblocking, np.arange(3.0), got, op=MPI.SUM,
        timeout=timeout, name="test", detail="",
    )  # fmt: skip
    assert got.tolist() == [0.0, 1.0, 2.0]
    assert called == ["Allreduce" if timeout is None else "Iallreduce"]


@pytest.mark.parametrize("timeout", [None, 1.0])
def test_send_receive_moves_every_piece_in_order(timeout):
    from mpi4py import MPI

    sent, got = np.arange(10, dtype=np.uint8), np.zeros(10, np.uint8)
    pieces = [slice(0, 4), slice(4, 4), slice(4, 10)]  # an empty message among them
    _wait.send_receive(
        MPI.COMM_SELF, [sent[p] for p in pieces], 0, [got[p] for p in pieces], 0, 7,
        timeout, "test", "",
    )  # fmt: skip
    assert got.tolist() == sent.tolist()


@pytest.mark.parametrize("timeout", [None, 1.0])
def test_communicators_are_made_with_or_without_a_timeout(timeout):
    from mpi4py import MPI

    made = [
        _wait.dup(MPI.COMM_SELF, timeout=timeout, name="test"),
        _wait.split(MPI.COMM_SELF, 0, 0, timeout=timeout, name="test"),
        _wait.split_type(MPI.COMM_SELF, MPI.COMM_TYPE_SHARED, 0, timeout=timeout, name="test"),
    ]
    try:
        assert [c.Get_size() for c in made] == [1, 1, 1]
        assert all(c != MPI.COMM_SELF for c in made)  # new communicators, not the same
    finally:
        for c in made:
            c.Free()
