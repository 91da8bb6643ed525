"""torch.distributed's default process group on the ranks of an MPI communicator.

A job started by ``mpirun`` or ``srun`` has no ``MASTER_ADDR``/``MASTER_PORT``, as
``torchrun`` would set. DDP, FSDP2 and ``host_mesh`` need a process group whose ranks
are the communicator's; this starts one in a single call. Rank 0's store listens on a
port the operating system gives it and the address goes to the other ranks over MPI:
a port chosen first and bound later can be taken in between (the usual "find a free
port" recipe races with every other process on the host).
"""

from __future__ import annotations

import datetime
import math
import numbers
import socket

import torch.distributed as dist

from mpicomp.call.config import Config, check_same
from mpicomp.collectives import plain
from mpicomp.torch.shared import agree, kind

__all__ = ["init_process_group"]


def init_process_group(
    comm=None,
    backend: str | None = None,
    *,
    address: str | None = None,
    timeout: datetime.timedelta | float | None = None,
) -> None:
    """Start torch.distributed's default process group on the ranks of ``comm``, each
    process's torch rank its rank in ``comm``.

    Collective over ``comm``. Rank 0 runs the group's ``TCPStore`` on a port the
    operating system chooses, and sends its address to the others over MPI. End the
    group with ``torch.distributed.destroy_process_group()`` as usual.

    Args:
        comm: the mpi4py communicator (default ``MPI.COMM_WORLD``).
        backend: ``torch.distributed.init_process_group``'s backend (default: torch's,
            gloo for CPU tensors and NCCL for CUDA ones).
        address: the host name or IP address of rank 0 that the other ranks connect to
            (default: ``127.0.0.1`` when every rank runs on rank 0's host, else rank 0's
            ``socket.gethostname()``); rank 0's value is the one used. Give it where
            the host name does not resolve to the network the ranks share.
        timeout: how long the rendezvous and each of the group's collectives may wait,
            a ``timedelta`` or seconds (default: torch's, 10 minutes for NCCL and 30
            for the others).

    Raises:
        RuntimeError: torch.distributed is already initialized (on every rank).
        TypeError: ``comm`` is not an mpi4py communicator (on this rank), or
            ``timeout`` is neither a timedelta nor seconds (on that rank; RankError
            on the others).
        ValueError: ``timeout`` is not positive and finite (likewise).
        mpicomp.RankError: ranks gave other timeouts or backends (on every rank).
        mpicomp.RankError: starting the group failed on another rank; the rank where
            it failed raises its own error (e.g. the store's ``DistNetworkError``).
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py communicator, got {kind(comm)}")
    error, config = None, None
    try:
        if dist.is_initialized():
            raise RuntimeError(
                "init_process_group: torch.distributed is already initialized: call "
                "torch.distributed.destroy_process_group() first"
            )
        timeout = _timedelta(timeout)
        if backend is not None and not isinstance(backend, str):
            raise TypeError(
                f"init_process_group: backend must be a str such as 'gloo', got {kind(backend)}"
            )
        # Ranks that wait for each other as long, through the same backend: a rank whose
        # timeout ended first would leave the others inside torch's group setup.
        seconds = None if timeout is None else timeout.total_seconds()
        config = Config({"backend": backend, "timeout": seconds})
    except Exception as e:  # every rank hears of it below
        error = e
    check_same(comm, config, error, "init_process_group", None)
    store_timeout = timeout or datetime.timedelta(minutes=30)

    one_host = len(set(plain.allgather_object(comm, MPI.Get_processor_name()))) == 1
    store, where = None, None
    if comm.rank == 0:
        try:
            # The server listens on every interface; rank 0 itself connects locally.
            store = dist.TCPStore(
                "127.0.0.1",
                0,  # the operating system's choice
                comm.size,
                True,
                timeout=store_timeout,
                wait_for_workers=False,
            )
            where = (address or ("127.0.0.1" if one_host else socket.gethostname()), store.port)
        except Exception as exc:  # every rank hears of it below
            error = exc
    agree(comm, error, "init_process_group: rank 0's store")
    host, port = plain.bcast_object(comm, where)
    if comm.rank:
        try:
            store = dist.TCPStore(host, port, comm.size, False, timeout=store_timeout)
        except Exception as exc:  # every rank hears of it below
            error = exc
    # Every rank starts the group or none does: a start that fails on one rank still
    # advances torch's count of groups there, and the next start's keys would differ.
    agree(comm, error, "init_process_group: connecting to rank 0's store")
    try:
        dist.init_process_group(
            backend, store=store, rank=comm.rank, world_size=comm.size, timeout=timeout
        )
    except Exception as exc:  # every rank hears of it below
        error = exc
    try:
        agree(comm, error, "init_process_group")
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


def _timedelta(timeout) -> datetime.timedelta | None:
    """Return ``timeout`` (a timedelta, seconds or None) as a timedelta; refuse one
    that is not a positive, finite time."""
    if timeout is None:
        return None
    if not isinstance(timeout, datetime.timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(
                f"init_process_group: timeout must be a timedelta or seconds, got {kind(timeout)}"
            )
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(
                f"init_process_group: timeout must be a positive number of seconds, got {timeout!r}"
            )
        return datetime.timedelta(seconds=float(timeout))
    if timeout <= datetime.timedelta(0):
        raise ValueError(f"init_process_group: timeout must be positive, got {timeout!r}")
    return timeout
