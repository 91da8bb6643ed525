"""One numba cache for every process, compiled into by one process at a time.

numba's on-disk cache (``cache=True``) is not safe when several processes compile into
it at once: saving an entry reads the function's index, picks the next free data file
and writes both back, so two processes saving together overwrite each other's data file
or index, and a later load runs another signature's machine code (a SIGSEGV; numba
issues #4807, #10128). Ranks that found the cache cold (a fresh clone, a new node)
crashed that way, so earlier releases gave each rank a directory of its own and compiled
once per rank.

Now every kernel of ``mpicomp.kernels.cpu`` compiles under an exclusive lock of its cache
directory (``flock`` on a file in it: the processes of one host, or of every host where
the filesystem supports it, and a re-entrant lock for this process's threads). The first
process to need a kernel compiles and saves it; the others wait on the lock and then
load what it wrote. So ranks on one host compile once, and no two processes ever write
one cache together.

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

from mpicomp._log import rank_filter

log = logging.getLogger("mpicomp.compile")
log.addFilter(rank_filter)

#: Seconds a compile runs before it is announced, then between progress lines.
ANNOUNCE_AFTER_S = 2.0
PROGRESS_EVERY_S = 15.0
LOCK_FILE = ".mpicomp-compile.lock"


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


class DirectoryLock:
    """Exclusive hold of one cache directory: ``flock`` across processes, a re-entrant
    lock across this process's threads (a kernel compiling its callees takes it again)."""

    def __init__(self, path: str):
        self.path = path
        self._threads = threading.RLock()
        self._depth = 0
        self._fd: int | None = None
        self._told_waiting = False

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
            os.makedirs(self.path, exist_ok=True)
            fd = os.open(os.path.join(self.path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:  # a read-only cache: numba cannot save into it either
            log.debug("no compile lock in %s: %s", self.path, e)
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: loading (brief), or compiling (said if long)
                with _after(ANNOUNCE_AFTER_S, self._say_waiting):
                    fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            log.warning(
                "cannot lock the numba cache %s (%s): processes sharing it may compile "
                "into it at once; set MPICOMP_NUMBA_CACHE to a node-local directory",
                self.path,
                e,
            )
            return None
        return fd

    def _say_waiting(self) -> None:
        if not self._told_waiting:  # once per process
            self._told_waiting = True
            log.info(
                "another process is compiling mpicomp's kernels into %s; waiting for it, "
                "then loading what it wrote",
                self.path,
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


_locks: dict[str, DirectoryLock] = {}
_locks_guard = threading.Lock()


def lock(path: str) -> DirectoryLock:
    """Return the lock of cache directory ``path`` (one object per directory)."""
    path = os.path.abspath(path)
    with _locks_guard:
        return _locks.setdefault(path, DirectoryLock(path))


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
    under its cache directory's lock, announced when slow."""
    from numba.core.dispatcher import Dispatcher

    module = namespace.get("__name__", "?").rsplit(".", 1)[-1]
    for name, kernel in list(namespace.items()):
        path = getattr(getattr(kernel, "_cache", None), "cache_path", None)
        if isinstance(kernel, Dispatcher) and path and not hasattr(kernel, "_mpicomp_lock"):
            kernel._mpicomp_lock = lock(path)
            kernel.compile = _locked(kernel, kernel._mpicomp_lock, f"{module}.{name}")


def _locked(kernel, directory: DirectoryLock, what: str):
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
        with directory:
            if directory._depth > 1:  # a callee of a kernel being compiled: said already
                return compile_(sig)
            missed.clear()
            with announced(what, missed.is_set):
                return compile_(sig)

    kernel._cache.load_overload = load_overload
    return compile
