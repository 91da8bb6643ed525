"""mpicomp/call/worker.py: where started calls run (one background thread in submission
order, or at once in the caller's thread), their handles and done-callbacks, and the
warnings that point at the caller's line."""

import logging
import os
import sys
import threading
import time
import warnings

import pytest

from mpicomp.call.worker import Runner, Turns, Worker, overlap_blocker, user_stacklevel


class _Owner:
    """What a Runner stops its worker with when collected (a CompressedComm)."""


def test_jobs_run_in_submission_order_on_one_named_thread():
    worker = Worker("mpicomp-worker-test")
    ran = []
    gate = threading.Event()
    handles = [worker.submit(lambda: gate.wait())]
    for i in range(5):
        handles.append(worker.submit(lambda i=i: ran.append((i, threading.current_thread().name))))
    assert not any(h.done for h in handles)  # all behind the first, which waits
    gate.set()
    worker.drain()
    assert all(h.test() for h in handles)
    assert ran == [(i, "mpicomp-worker-test") for i in range(5)]
    worker.stop()
    assert not any(t.name == "mpicomp-worker-test" for t in threading.enumerate())
    assert worker.submit(lambda: 3).wait() == 3  # a later submit starts it again
    worker.stop()


def test_an_error_stays_in_its_handle_and_is_raised_by_every_wait():
    worker = Worker("mpicomp-worker-test")
    failed = worker.submit(lambda: 1 / 0)
    after = worker.submit(lambda: "next")  # the thread survives the error
    assert after.wait() == "next"
    for _ in range(2):
        with pytest.raises(ZeroDivisionError):
            failed.wait()
    assert repr(failed) == "<mpicomp Handle failed>" and repr(after) == "<mpicomp Handle done>"
    worker.stop()


def test_deliver_runs_once_in_the_thread_that_waits():
    worker = Worker("mpicomp-worker-test")
    seen = []

    def deliver(result):
        seen.append(threading.current_thread().name)
        return result * 2

    h = worker.submit(lambda: 21, deliver)
    assert h.wait() == 42 and h.wait() == 42
    assert seen == [threading.current_thread().name]
    worker.stop()


def test_done_callback_runs_once_when_the_call_finishes_or_at_once_after():
    worker = Worker("test-callbacks")
    gate = threading.Event()
    seen = []
    h = worker.submit(lambda: gate.wait() and 7)  # wait() gives True
    h.add_done_callback(lambda handle: seen.append(("before", handle.wait())))
    assert seen == []  # still running: the callback waits for completion
    gate.set()
    worker.drain()
    h.add_done_callback(lambda handle: seen.append(("after", handle.wait())))
    assert seen == [("before", 7), ("after", 7)]
    worker.stop()


def test_a_raising_callback_is_logged_and_the_others_still_run(caplog):
    worker = Worker("test-callbacks")
    gate = threading.Event()
    seen = []
    h = worker.submit(gate.wait)
    h.add_done_callback(lambda _: 1 / 0)
    h.add_done_callback(lambda handle: seen.append(handle.done))
    with caplog.at_level(logging.ERROR, logger="mpicomp"):
        gate.set()
        worker.drain()
    worker.stop()
    assert seen == [True]
    assert "done-callback" in caplog.text and "ZeroDivisionError" in caplog.text


def test_an_eager_runner_runs_at_once_and_warns_once_at_the_callers_line():
    owner = _Owner()
    runner = Runner(owner, background=False, eager_why="no threads here", name="unused")
    with pytest.warns(RuntimeWarning, match="no threads here: iallreduce runs each call") as w:
        h = runner.start(lambda: threading.current_thread(), lambda thread: thread)
    assert h.done and h.wait() is threading.current_thread()
    assert [r.filename for r in w] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per runner
        assert runner.start(lambda: 5, lambda x: x).wait() == 5


def test_ctrl_c_in_an_eager_call_interrupts_the_caller():
    def interrupted():
        raise KeyboardInterrupt

    owner = _Owner()
    runner = Runner(owner, background=False, eager_why=None, name="unused")
    with pytest.raises(KeyboardInterrupt):
        runner.start(interrupted, lambda x: x)
    runner.drain()  # nothing left waiting
    assert runner.start(lambda: 5, lambda x: x + 1).wait() == 6


def test_a_background_runner_starts_its_thread_at_the_first_call_and_stop_ends_it():
    name = "mpicomp-worker-runner-test"
    owner = _Owner()  # held: the runner keeps only a weak reference
    runner = Runner(owner, background=True, eager_why=None, name=name)
    assert not any(t.name == name for t in threading.enumerate())
    h = runner.start(lambda: threading.current_thread().name, lambda x: x)
    assert h.wait() == name
    runner.stop()
    assert not any(t.name == name for t in threading.enumerate())


def _enter_in_turn(turns: Turns, threads: list, order: list, name: str) -> None:
    """Start a thread named ``name`` that takes a turn of ``turns`` (noting its name in
    ``order``); return once it waits behind the threads before it."""

    def take():
        turns.enter()
        order.append(name)
        turns.leave()

    waiting = turns.waiting
    thread = threading.Thread(target=take, name=name)
    threads.append(thread)
    thread.start()
    while turns.waiting == waiting:
        time.sleep(0.001)


def test_turns_go_to_threads_in_the_order_they_asked():
    turns, threads, order = Turns(), [], []
    turns.enter()
    assert turns.holder is threading.current_thread()
    for name in "abcd":
        _enter_in_turn(turns, threads, order, name)
    assert order == []  # all wait for this thread's turn
    turns.leave()
    for thread in threads:
        thread.join(timeout=30)
    assert order == list("abcd") and turns.holder is None


def test_a_thread_interrupted_while_waiting_gives_up_its_turn_alone(monkeypatch):
    turns, threads, order = Turns(), [], []
    wait = threading.Condition.wait

    def interrupted_in_b(self, timeout=None):
        if threading.current_thread().name == "b":
            raise KeyboardInterrupt  # as Ctrl-C would, in the main thread
        return wait(self, timeout)

    monkeypatch.setattr(threading.Condition, "wait", interrupted_in_b)
    turns.enter()
    _enter_in_turn(turns, threads, order, "a")
    interrupts = []

    def b_enters():
        try:
            turns.enter()
        except KeyboardInterrupt as e:  # at once: b is gone from the line
            interrupts.append(e)

    b = threading.Thread(target=b_enters, name="b")
    b.start()
    b.join(timeout=30)
    assert len(interrupts) == 1
    _enter_in_turn(turns, threads, order, "c")
    turns.leave()
    for thread in threads:
        thread.join(timeout=30)
    assert order == ["a", "c"] and turns.holder is None and turns.waiting == 0


def test_overlap_needs_thread_multiple(monkeypatch):
    from mpi4py import MPI

    import mpicomp.kernels as K

    numba = K.backend("numba")
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    assert overlap_blocker(numba) == (
        f"MPI provides thread level {MPI.THREAD_SERIALIZED}, not MPI_THREAD_MULTIPLE"
    )
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_MULTIPLE)
    if K.threadsafe(numba):
        assert overlap_blocker(numba) is None
    else:
        assert "workqueue" in overlap_blocker(numba)


def _compiled(source: str, filename: str, name: str):
    """Return function ``name`` of ``source``, its frames reporting ``filename``."""
    namespace = {"warnings": warnings, "user_stacklevel": user_stacklevel}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def test_a_warning_skips_mpicomps_and_a_frameworks_frames_to_the_users_line(tmp_path, monkeypatch):
    """As through mpicomp.jax: the user's line, then jax's frames, then mpicomp's."""
    import types

    import mpicomp

    jax = types.ModuleType("jax")
    jax.__file__ = str(tmp_path / "jax" / "__init__.py")
    monkeypatch.setitem(sys.modules, "jax", jax)
    inside = os.path.join(os.path.dirname(mpicomp.__file__), "not_a_module.py")
    warn = _compiled(
        "def warn():\n    warnings.warn('w', UserWarning, stacklevel=user_stacklevel())\n",
        inside,
        "warn",
    )
    through = _compiled("def through(f):\n    return f()\n", jax.__file__, "through")
    with pytest.warns(UserWarning) as caught:
        through(warn)  # the user's line
    assert caught[0].filename == __file__
    monkeypatch.delitem(sys.modules, "jax")  # without jax imported, its frame is the user's
    with pytest.warns(UserWarning) as caught:
        through(warn)
    assert caught[0].filename == jax.__file__
