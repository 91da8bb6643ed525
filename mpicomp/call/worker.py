"""A background worker that runs started reductions one after another, their handles, and
the turns of the threads that call one CompressedComm (``Turns``).

``CompressedComm.iallreduce`` hands a job (a function making the collective calls) to
its communicator's ``Worker``; one thread runs the jobs strictly in submission order,
so every rank issues its collectives in the order its caller started them, and the
caller gets a ``Handle`` at once. A job's result or exception lands in its handle;
``Handle.wait`` returns or raises it, as often as it is called.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable

from mpicomp._log import log
from mpicomp.call import threads

__all__ = ["Handle", "Runner", "Turns", "Worker", "overlap_blocker", "user_stacklevel"]


_STOP = object()  # the queue item that ends a worker's thread
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # mpicomp/


# Frameworks whose frames can lie between the user's line and mpicomp's (mpicomp.jax
# runs calls inside jax's callbacks; DDP calls the torch hook from its reducer).
_FRAMEWORKS = ("torch", "jax", "jaxlib")


def _not_the_users() -> tuple[str, ...]:
    """Return the folders whose frames are not the user's: mpicomp's, and those of the
    frameworks already imported."""
    folders = [_PACKAGE]
    for name in _FRAMEWORKS:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            folders.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(folders)


def user_stacklevel() -> int:
    """Return the ``stacklevel`` at which a ``warnings.warn`` made by this function's
    caller names the first frame outside mpicomp (and the frameworks calling it: torch,
    jax): the user's line, however many frames (methods, thread guards, handles,
    callbacks) lie between."""
    theirs = _not_the_users()
    level, frame = 2, sys._getframe(2)  # stacklevel 2: the warning function's caller
    while frame is not None and frame.f_code.co_filename.startswith(theirs):
        level, frame = level + 1, frame.f_back
    return level


def overlap_blocker(record) -> str | None:
    """Return why started calls cannot run on a background thread here (None: they can).

    A second thread making MPI calls needs ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it),
    and kernels of ``record`` on two threads at once a thread-safe backend.
    """
    from mpi4py import MPI

    from mpicomp import kernels

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return f"MPI provides thread level {MPI.Query_thread()}, not MPI_THREAD_MULTIPLE"
    if not kernels.threadsafe(record):
        if record.name == "numba":
            return "numba's threading layer is workqueue (install OpenMP or TBB)"
        return f"the {record.name!r} kernel backend is not thread-safe"
    return None


class Handle:
    """The pending result of one nonblocking call (``CompressedComm.iallreduce``).

    ``wait()`` blocks until the call has run and returns its result, or raises the
    error it raised (on every call of ``wait``); ``test()`` and ``done`` tell whether
    it has finished without blocking; ``add_done_callback(fn)`` runs ``fn(handle)``
    when it finishes (as ``concurrent.futures.Future`` does).
    """

    __slots__ = (
        "_callbacks",
        "_deliver",
        "_error",
        "_event",
        "_lock",
        "_result",
        "_seen",
        "_what",
    )

    def __init__(self, deliver: Callable | None = None, what: str = "a started call"):
        """``deliver``: applied once to the result, in the thread that first waits;
        ``what``: the call that made the handle, as its warning names it (e.g.
        ``"ireduce_scatter of 'w'"``)."""
        self._what = what
        self._event = threading.Event()
        self._lock = threading.Lock()  # orders add_done_callback against completion
        self._callbacks: list[Callable] = []
        self._result = None
        self._error: BaseException | None = None
        self._deliver = deliver  # run once, in the thread that first waits
        self._seen = False  # the error was raised to the caller at least once

    @property
    def done(self) -> bool:
        """True once the call has finished (with a result or an error)."""
        return self._event.is_set()

    def test(self) -> bool:
        """Return True if the call has finished; never blocks, never raises its error."""
        return self._event.is_set()

    def wait(self):
        """Block until the call has finished; return its result or raise its error.

        Waiting again returns the same result (or raises the same error).
        """
        self._event.wait()
        if self._error is not None:
            self._seen = True
            raise self._error
        if self._deliver is not None:
            deliver, self._deliver = self._deliver, None
            self._result = deliver(self._result)
        return self._result

    def add_done_callback(self, fn: Callable) -> None:
        """Call ``fn(handle)`` once the call has finished: at once (in this thread) if it
        has, else in the thread that finishes it (the background worker's).

        ``fn`` may call ``wait()``, which then returns or raises without blocking. An
        exception ``fn`` raises is logged to the ``mpicomp`` logger and ignored.
        """
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        _call_back(fn, self)

    def _run(self, job: Callable) -> None:
        """Run ``job()`` and keep its result or exception; mark the handle done."""
        try:
            self._result = job()
        except BaseException as e:  # kept for wait(), which raises it in the caller's thread
            self._error = e
            if (
                not isinstance(e, Exception)
                and threading.current_thread() is threading.main_thread()
            ):
                self._seen = True
                raise  # Ctrl-C during an eager call interrupts the caller now
        finally:
            with self._lock:
                self._event.set()
                callbacks, self._callbacks = self._callbacks, []
            for fn in callbacks:
                _call_back(fn, self)

    def __del__(self):
        # Like asyncio's "exception was never retrieved": an error nobody waited for
        # is reported rather than lost.
        if self._error is not None and not self._seen:
            warnings.warn(
                f"the handle of {self._what} was dropped without wait() and held an error: "
                f"{self._error!r}",
                RuntimeWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        state = "pending" if not self.done else ("failed" if self._error else "done")
        return f"<mpicomp Handle {state}>"


def _call_back(fn: Callable, handle: Handle) -> None:
    """Run a done-callback; log what it raises (it must not kill the worker thread)."""
    try:
        fn(handle)
    except Exception:
        log.exception("a done-callback of %r raised", handle)


class Worker:
    """One daemon thread running submitted jobs in submission order.

    Started by the first ``submit``. A daemon thread lets the interpreter exit while
    it idles; the owner calls ``stop`` at close and at exit (``weakref.finalize``), so
    queued jobs finish (or time out and abort the job) before mpi4py's
    ``MPI_Finalize``, which runs after every ``atexit`` hook.

    Args:
        name: the thread's name (shown in tracebacks and debuggers).
    """

    def __init__(self, name: str = "mpicomp-worker"):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last: Handle | None = None  # jobs run in order: this one done => all done

    def submit(
        self, job: Callable, deliver: Callable | None = None, what: str = "a started call"
    ) -> Handle:
        """Queue ``job()`` behind the jobs submitted before; return its handle.

        Args:
            job: a function of no arguments, run on the worker's thread.
            deliver: applied once to the job's result in the thread that first waits
                (for what must happen there, e.g. warnings).
            what: the call, as the handle's warnings name it.
        """
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._queue,), name=self.name)
            self._thread.daemon = True
            self._thread.start()
        handle = Handle(deliver, what)
        self._last = handle
        self._queue.put((handle, job))
        return handle

    def drain(self) -> None:
        """Block until every submitted job has finished; errors stay in their handles."""
        last = self._last
        if last is not None:
            last._event.wait()
            self._last = None

    def stop(self) -> None:
        """Finish the queued jobs, then end the thread. Safe twice; a later submit restarts it."""
        self.drain()
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            if thread is not threading.current_thread():
                thread.join()


class Runner:
    """Where a CompressedComm's started calls run: on a ``Worker`` (made by the first
    one) when ``background``, else at once in the caller's thread, saying once why
    (``eager_why``) when the default chose that.

    ``owner``: the object whose collection (or the interpreter's exit) stops the worker,
    so that an unclosed communicator still finishes its started calls.
    """

    def __init__(self, owner, background: bool, eager_why: str | None, name: str):
        self.background = background
        self._eager_why = eager_why
        self._name = name
        self._owner = weakref.ref(owner)
        self._worker: Worker | None = None
        self._stop = None

    def start(self, job: Callable, deliver: Callable, what: str = "a started call") -> Handle:
        """Run ``job`` behind the calls started before (or now); the handle's ``wait()``
        returns ``deliver(outcome)``; ``what`` names the call in its warnings."""
        if not self.background:
            if self._eager_why:
                why, self._eager_why = self._eager_why, None
                warnings.warn(
                    f"{why}: iallreduce runs each call at once in the caller's thread (no overlap)",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
            handle = Handle(deliver, what)
            handle._run(job)
            return handle
        if self._worker is None:
            self._worker = Worker(self._name)
            self._stop = weakref.finalize(self._owner(), self._worker.stop)
        return self._worker.submit(job, deliver, what)

    def runs_here(self) -> bool:
        """Return whether this thread is the worker that runs the started calls."""
        worker = self._worker
        return worker is not None and worker._thread is threading.current_thread()

    def drain(self) -> None:
        """Wait until every started call has finished (errors stay in handles)."""
        if self._worker is not None:
            self._worker.drain()

    def stop(self) -> None:
        """Finish the started calls and end the worker's thread."""
        if self._worker is not None:
            self._stop()
            self._worker = None


class Turns:
    """One call at a time, in the order threads ask for it: ``enter`` waits until the
    threads that asked before have left (``leave``). ``holder`` is the thread whose
    call runs (None between calls)."""

    def __init__(self):
        self._changed = threading.Condition()
        self._line: deque = deque()  # a token per waiting thread, first come first
        self.holder: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        """How many threads wait for their turn."""
        return len(self._line)

    def enter(self) -> None:
        """Wait for this thread's turn, then take it."""
        token = object()
        with self._changed:
            self._line.append(token)
            try:
                while self.holder is not None or self._line[0] is not token:
                    self._changed.wait()
            except BaseException:  # interrupted (Ctrl-C): the threads behind keep their turns
                self._line.remove(token)
                self._changed.notify_all()
                raise
            self._line.popleft()
            self.holder = threading.current_thread()

    def leave(self) -> None:
        """End this thread's turn: the next one waiting takes it."""
        with self._changed:
            self.holder = None
            self._changed.notify_all()


def _serve(jobs: queue.SimpleQueue) -> None:
    """The worker thread: run (handle, job) items until the stop marker."""
    while True:
        item = jobs.get()
        if item is _STOP:
            return
        handle, job = item
        threads.apply()  # numba's thread count is per thread: this one's starts at the pool's
        handle._run(job)
        del item, handle, job  # keep nothing alive while idle
