"""How many threads mpicomp's numba kernels run on.

numba starts one thread per CPU in every process; R ranks on a host of C CPUs would run
R x C threads that preempt one another. By default a ``CompressedComm`` caps its kernels
at the CPUs a rank may use divided among the ranks of its host that may use them too
(``decide``), unless ``NUMBA_NUM_THREADS`` in the environment says otherwise: then
mpicomp leaves every thread count as it is.

numba's count is per thread (``numba.set_num_threads`` applies to the calling thread),
so ``apply`` caps it in whichever thread launches kernels: the caller's at each call, the
background worker's at each job. It caps PyTorch's intra-op threads (if torch is loaded)
and that thread's OpenMP count at the same: numba's pool sets the OpenMP count to the
pool's size when it starts, and torch's threads at another count than numba's, in the
one OpenMP runtime they share, made a training step 3x slower (docs/running.md,
"Threads per rank").
"""

from __future__ import annotations

import os
import sys
import threading
from typing import NamedTuple

#: The variable that, when set, is the user's choice of kernel threads (numba's pool).
ENV = "NUMBA_NUM_THREADS"


class Decision(NamedTuple):
    """The kernel ``threads`` of this rank and ``why``: ``"2 CPUs / 2 ranks on this host"``
    or ``"NUMBA_NUM_THREADS=1"``."""

    threads: int
    why: str


def cpus() -> set[int]:
    """Return the CPUs this process may run on (its affinity; all of them where the
    system cannot say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def share(mine: set[int], host: list[set[int]]) -> Decision:
    """Return the threads for a rank with CPUs ``mine`` among the ranks of its host with
    CPUs ``host`` (``mine`` among them): its CPUs over the ranks that may run on them
    too. Ranks bound to cores of their own share nothing and keep all of theirs."""
    sharing = sum(1 for other in host if other & mine) or 1
    threads = max(1, len(mine) // sharing)
    held = _count(len(mine), "CPU")
    if sharing == len(host):
        return Decision(threads, f"{held} / {_count(sharing, 'rank')} on this host")
    return Decision(
        threads, f"{held} / {_count(sharing, 'rank')} of {len(host)} on this host using them"
    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def decide(comm, timeout=None) -> Decision:
    """Return this rank's kernel threads (collective over ``comm``: every rank takes part
    whatever its environment, so none waits for one that skipped; ``timeout``: seconds
    each message may wait, None: ``MPICOMP_TIMEOUT``).

    ``NUMBA_NUM_THREADS`` set: numba's pool, as the user chose. Otherwise ``share`` among
    the ranks of ``comm`` that share this host's memory (``MPI_COMM_TYPE_SHARED``), at
    most numba's pool.
    """
    import numba
    from mpi4py import MPI

    from mpicomp.collectives import plain
    from mpicomp.collectives._wait import resolve_timeout, split_type

    timeout = resolve_timeout(timeout)
    mine = cpus()
    node = split_type(comm, MPI.COMM_TYPE_SHARED, comm.Get_rank(), timeout=timeout, name="threads")
    try:
        host = [set(c) for c in plain.allgather_object(node, sorted(mine), timeout=timeout)]
    finally:
        node.Free()
    pool = int(numba.config.NUMBA_NUM_THREADS)
    if os.environ.get(ENV, "").strip():
        return Decision(pool, f"{ENV}={pool}")
    chosen = share(mine, host)
    return chosen if chosen.threads <= pool else Decision(pool, f"numba's pool; {chosen.why}")


_decided: Decision | None = None  # the latest CompressedComm's cap, for every thread
_applied = threading.local()  # .threads: the cap this thread got last


def limit(comm, timeout=None) -> Decision:
    """``decide`` (collective over ``comm``); unless the user chose (``NUMBA_NUM_THREADS``),
    keep the decision for every thread that launches kernels and ``apply`` it in this
    one. Return it."""
    global _decided
    chosen = decide(comm, timeout)
    _decided = None if chosen.why.startswith(ENV) else chosen
    apply()
    return chosen


def apply() -> None:
    """Cap this thread's numba threads, torch's intra-op threads and this thread's OpenMP
    threads at the kept decision (nothing before one; a count already lower stands)."""
    chosen = _decided
    if chosen is None or getattr(_applied, "threads", None) == chosen.threads:
        return
    import numba
    from threadpoolctl import ThreadpoolController

    torch = sys.modules.get("torch")
    # Read before numba's pool starts: its start sets the OpenMP count torch reports.
    wanted = None if torch is None else min(torch.get_num_threads(), chosen.threads)
    if numba.get_num_threads() > chosen.threads:  # starts numba's pool, if not yet
        numba.set_num_threads(chosen.threads)
    if wanted is not None:
        torch.set_num_threads(wanted)  # its own count, its BLAS's and OpenMP's as one
    for pool in ThreadpoolController().select(user_api="openmp").lib_controllers:
        if pool.num_threads > chosen.threads:
            pool.set_num_threads(chosen.threads)
    _applied.threads = chosen.threads


def kept() -> Decision | None:
    """Return the cap the kernels of this process follow: None before the first
    ``CompressedComm`` (numba's default, every CPU) or with ``NUMBA_NUM_THREADS`` set."""
    return _decided
