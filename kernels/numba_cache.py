"""One numba cache for every process, compiled into by one process at a time.

numba's on-disk cache (``cache=True``) is not safe when several processes compile into
it at once: saving an entry reads the function's index, picks the next free data file
and writes both back, so two processes saving together overwrite each other's data file
or index, and a later load runs another signature's machine code (a SIGSEGV; numba
issues #4807, #10128). Ranks that found the cache cold (a fresh clone, a new node)
crashed that way, so earlier releases gave each rank a directory of its own and compiled
once per rank.

Now every kernel of ``mpicomp.kernels.cpu`` compiles under an exclusive lock of its own
(``flock`` on ``<module>.<kernel>.lock`` in the cache directory: the processes of one
host, or of every host where the filesystem supports it, and a re-entrant lock for this
process's threads). The first process to need a kernel compiles and saves it; the others
wait on its lock and then load what it wrote, while different kernels compile in
parallel. So ranks on one host compile each kernel once, and no two processes ever
write one kernel's cache entries together.

The directory is ``$MPICOMP_NUMBA_CACHE``, else ``$XDG_CACHE_HOME/mpicomp/numba``
(``~/.cache/...``), for a single process and every rank alike, unless ``NUMBA_CACHE_DIR``
is set (then numba's own rules apply, and the lock is taken in whatever directory numba
chose). ``python -m mpicomp compile`` fills it ahead of a job. A compile that lasts more
than two seconds is announced on the ``mpicomp.compile`` logger at INFO, with a progress
line every 15 s.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from contextlib import contextmanager

# By name: mpicomp/_log.py gives this logger its rank filter.
log = logging.getLogger("mpicomp.compile")

#: Seconds a compile runs before it is announced, then between progress lines.
ANNOUNCE_AFTER_S = 2.0
PROGRESS_EVERY_S = 15.0


def cache_root(environ=os.environ) -> str | None:
    """Return the numba cache directory mpicomp chooses, or None where the user chose
    one with ``NUMBA_CACHE_DIR``."""
    if environ.get("NUMBA_CACHE_DIR"):
        return None
    root = environ.get("MPICOMP_NUMBA_CACHE")
    if not root:
        home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(home, "mpicomp", "numba")
    return root


def configure() -> None:
    """Point numba's cache at ``cache_root()``; call before any kernel is defined."""
    path = cache_root()
    if path is None:
        return
    import numba

    numba.config.CACHE_DIR = path  # read when each cache=True function is decorated


class KernelLock:
    """Exclusive hold of one kernel's cache entries: ``flock`` on ``<name>.lock`` in its
    cache directory across processes, a re-entrant lock across this process's threads.

    One lock per kernel, since numba keeps one index file per kernel: processes compile
    different kernels at once, and one kernel once. A kernel compiling its callees takes
    theirs too (the call graph has no cycles, so two processes never wait on each other).
    """

    def __init__(self, directory: str, name: str):
        self.directory, self.name = directory, name
        self._threads = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    def __enter__(self):
        self._threads.acquire()
        if self._depth == 0:
            self._fd = self._lock_file()
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None
        self._threads.release()

    def _lock_file(self) -> int | None:
        import fcntl

        try:
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"{self.name}.lock")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:  # a read-only cache: numba cannot save into it either
            log.debug("no compile lock in %s: %s", self.directory, e)
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: loading (brief), or compiling (said if long)
                with _after(ANNOUNCE_AFTER_S, lambda *_: _say_waiting(self.directory)):
                    fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            _say_unlockable(self.directory, e)
            return None
        return fd


_said: set[str] = set()  # what this process said once


def _say_waiting(directory: str) -> None:
    if "waiting" not in _said:
        _said.add("waiting")
        log.info(
            "another process is compiling mpicomp's kernels into %s; waiting for it, "
            "then loading what it wrote",
            directory,
        )


def _say_unlockable(directory: str, error: OSError) -> None:
    if "unlockable" not in _said:
        _said.add("unlockable")
        log.warning(
            "cannot lock the numba cache %s (%s): processes sharing it may compile into it "
            "at once; set MPICOMP_NUMBA_CACHE to a node-local directory",
            directory,
            error,
        )


@contextmanager
def _after(seconds: float, say, every: float | None = None, done_say=None, when=None):
    """Call ``say()`` if the block lasts over ``seconds`` (and, with ``when``, once
    ``when()`` is true), then ``say(seconds_so_far)`` every ``every`` seconds, and
    ``done_say(total_seconds)`` at its end if ``say`` ran."""
    done = threading.Event()
    start = time.monotonic()

    def watch():
        if done.wait(seconds):
            return
        while when is not None and not when():
            if done.wait(0.05):
                return
        say()
        while every is not None and not done.wait(every):
            say(time.monotonic() - start)
        if done_say is not None:
            done_say(time.monotonic() - start)

    watcher = threading.Thread(target=watch, name="mpicomp-compile-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def announced(what: str, compiling):
    """Log that ``what`` compiles, at INFO, if it lasts over ANNOUNCE_AFTER_S and
    ``compiling()`` says it is not loading from the cache, then every PROGRESS_EVERY_S,
    then how long it took."""

    def say(elapsed=None):
        if elapsed is None:
            log.info("compiling %s (first use of this numba cache; later runs load it)", what)
        else:
            log.info("still compiling %s: %.0f s so far", what, elapsed)

    return _after(
        ANNOUNCE_AFTER_S,
        say,
        every=PROGRESS_EVERY_S,
        done_say=lambda total: log.info("compiled %s in %.0f s", what, total),
        when=compiling,
    )


def guard(namespace: dict) -> None:
    """Make every cached numba kernel in ``namespace`` (a module's ``globals()``) compile
    under its own lock, announced when slow.

    Wraps each dispatcher's ``compile`` (what numba calls on a new signature) and its
    cache's ``load_overload`` (to tell a load from a compile): numba has no public hook
    around its cache, and these two have kept their signatures since numba 0.40.
    """
    from numba.core.dispatcher import Dispatcher

    module = namespace.get("__name__", "?").rsplit(".", 1)[-1]
    for name, kernel in list(namespace.items()):
        path = getattr(getattr(kernel, "_cache", None), "cache_path", None)
        if isinstance(kernel, Dispatcher) and path and not hasattr(kernel, "_mpicomp_lock"):
            kernel._mpicomp_lock = KernelLock(path, f"{module}.{name}")
            kernel.compile = _locked(kernel, kernel._mpicomp_lock)


_compiling = threading.local()  # how deep this thread is in compiles (callees nest)


def _locked(kernel, lock: KernelLock):
    compile_, load = kernel.compile, kernel._cache.load_overload
    missed = threading.Event()  # set when the cache had no entry: a real compile follows

    def load_overload(sig, target_context):
        data = load(sig, target_context)
        if data is None:
            missed.set()
        return data

    def compile(sig):
        if tuple(sig) in kernel.overloads:  # compiled already (typing a caller asks again)
            return compile_(sig)
        depth = getattr(_compiling, "depth", 0)
        with lock:
            _compiling.depth = depth + 1
            try:
                if depth:  # a callee of a kernel being compiled: said already
                    return compile_(sig)
                missed.clear()
                with announced(lock.name, missed.is_set):
                    return compile_(sig)
            finally:
                _compiling.depth = depth

    kernel._cache.load_overload = load_overload
    return compile
