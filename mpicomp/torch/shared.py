"""What the distributed optimizer, the DDP hook and the broadcasts share.

The checks of the arguments they take (a communicator, counts) and how a wrong value
is described; the CompressedComm they reduce through and its mpi4py communicator;
``agree``, by which every rank hears of what failed on one (their only message of
their own besides the broadcasts and the optimizer's per-step exchange); pinned host
staging for CUDA tensors without CuPy; the handle of a call refused because a peer
closed; and where a warning should point (the user's line).
"""

from __future__ import annotations

import numbers
import warnings
import weakref
from collections.abc import Iterator, Mapping

import torch

from mpicomp.call.config import check_same
from mpicomp.call.worker import user_stacklevel
from mpicomp.comm import CompressedComm
from mpicomp.errors import PeerClosed

__all__ = [
    "Failed",
    "Staging",
    "agree",
    "at_end_of_backward",
    "check_comm",
    "check_given",
    "claim_names",
    "compressed",
    "count",
    "cuda_staging",
    "kind",
    "max_over_ranks",
    "mpi_of",
    "peer_closed_in",
    "quiet",
    "release_names",
    "timeout_of",
]


# -- arguments ------------------------------------------------------------------------


def check_comm(comm) -> None:
    """Refuse a ``comm`` that is neither an mpi4py communicator nor a CompressedComm
    (on this rank alone: without a communicator no other rank can be told)."""
    from mpi4py import MPI

    if isinstance(comm, CompressedComm | MPI.Intracomm):
        return
    hint = ""
    if isinstance(comm, Iterator | Mapping | list | tuple):
        hint = (
            " (named_parameters comes after comm: "
            "DistributedOptimizer(optimizer, MPI.COMM_WORLD, model.named_parameters()))"
        )
    raise TypeError(
        "comm must be an mpi4py communicator such as MPI.COMM_WORLD or a "
        f"mpicomp.CompressedComm, got {kind(comm)}{hint}"
    )


def count(what: str, value, least: int) -> int:
    """Return ``value`` as an int >= ``least``; a TypeError or ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int >= {least}, got {kind(value)}")
    if value < least:
        raise ValueError(f"{what} must be >= {least}, got {value}")
    return int(value)


def kind(value) -> str:
    """Describe ``value`` for a message: its type, and its repr when short."""
    if isinstance(value, torch.nn.Parameter):
        return f"a Parameter of shape {tuple(value.shape)}"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, torch.nn.Module):
        return f"a module ({type(value).__name__})"
    name = type(value).__name__
    a = "an" if name[:1].lower() in "aeiou" else "a"
    if isinstance(value, tuple | list) and 0 < len(value) <= 3:
        return f"{a} {name} of ({', '.join(type(v).__name__ for v in value)})"
    text = repr(value)
    return f"{name} {text}" if len(text) <= 60 and not text.startswith("<") else f"{a} {name}"


# -- the communicators ----------------------------------------------------------------


def check_given(comm, codec, options) -> None:
    """Refuse a codec or options given with a CompressedComm (it comes with its own):
    call it where the other ranks hear of a refusal, before the first message."""
    if isinstance(comm, CompressedComm) and (codec is not None or options):
        given = ["codec"] * (codec is not None) + sorted(options)
        raise TypeError(
            "a CompressedComm comes with its codec and options: pass neither "
            f"(got {', '.join(given)})"
        )


def compressed(comm, codec, options) -> CompressedComm:
    """Return ``comm`` if it is a CompressedComm (then no codec or options:
    ``check_given``), else a CompressedComm over the mpi4py communicator ``comm``."""
    if isinstance(comm, CompressedComm):
        check_given(comm, codec, options)
        return comm
    return CompressedComm(comm, "none" if codec is None else codec, **options)


# Per CompressedComm, the optimizers open on it: each names its calls apart, so two
# optimizers on one CompressedComm (a GAN's two models) never share residuals.
_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def claim_names(comm: CompressedComm, owner) -> str:
    """Return the prefix of ``owner``'s call names on ``comm``: "" for the first open
    optimizer, ``"optimizer1."`` for a second, ... (the same on every rank where the
    optimizers are made and closed in the same order); ``release_names`` frees it."""
    users = _USERS.setdefault(comm, weakref.WeakKeyDictionary())  # never keeps one alive
    k = next(i for i in range(len(users) + 1) if i not in users.values())
    users[owner] = k
    return f"optimizer{k}." if k else ""


def release_names(comm: CompressedComm, owner) -> None:
    """Free the prefix ``claim_names`` gave ``owner`` (its optimizer closed)."""
    _USERS.get(comm, {}).pop(owner, None)


def mpi_of(comm):
    """Return the mpi4py communicator of ``comm`` (a CompressedComm's own duplicate)."""
    return comm.comm if isinstance(comm, CompressedComm) else comm


def quiet(comm):
    """Return ``comm``'s mpi4py communicator once no started call of a CompressedComm
    uses it (collectives of one communicator must not run on two threads at once)."""
    if isinstance(comm, CompressedComm):
        comm.wait_all()
    return mpi_of(comm)


def timeout_of(comm) -> float | None:
    """Return the timeout of ``comm``'s messages: a CompressedComm's own, else None
    (``MPICOMP_TIMEOUT`` decides)."""
    return comm.options.timeout if isinstance(comm, CompressedComm) else None


# -- every rank hears of it -----------------------------------------------------------


def agree(mpi, error, what: str, timeout: float | None = None) -> None:
    """Raise on every rank if any rank has an ``error`` (a message or an exception).

    ``check_same`` with nothing to compare, over ``mpi`` under ``timeout``: one
    Allgather of two int64 per rank, and the first failed rank's error only then. This
    rank's own error is raised as it is (a message as ValueError), RankError on the
    others, naming the ranks that failed and the first one's error ("{what} failed on
    rank(s) [1]: ValueError: ...")."""
    if error is not None and not isinstance(error, BaseException):
        error = ValueError(error)
    check_same(mpi, None, error, what, timeout, failure=lambda r: f"{what} failed on rank(s) {r}")


def max_over_ranks(mpi, flags: list[int], timeout, name: str, detail) -> list[int]:
    """Return the elementwise max over the ranks of ``mpi`` of this rank's ``flags``
    (small ints: who failed, who closed): one Allreduce under ``timeout``, named in a
    timeout's report by ``name`` and ``detail()``."""
    import numpy as np
    from mpi4py import MPI

    from mpicomp.collectives._wait import issue, resolve_timeout

    mine = np.array(flags, np.int32)
    every = np.empty_like(mine)
    issue(
        mpi, MPI.Comm.Allreduce, MPI.Comm.Iallreduce, mine, every, op=MPI.MAX,
        timeout=resolve_timeout(timeout), name=name,
        detail=lambda: f"{detail()}, an Iallreduce of {mine.nbytes} bytes over all {mpi.size} ranks",
    )  # fmt: skip
    return every.tolist()


# -- errors out of backward() ----------------------------------------------------------


def at_end_of_backward(fn) -> bool:
    """Run ``fn`` when the running ``backward()`` has finished its other work (queued
    behind what DDP and FSDP queued before): an error it raises comes out of
    ``backward()`` with the framework's own state complete. False where no backward
    pass runs (then nothing is queued)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(fn)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    except AttributeError:  # pragma: no cover - a torch without it
        return False
    return True


# -- CUDA tensors without CuPy --------------------------------------------------------


def cuda_staging(device: torch.device) -> bool:
    """Return True if tensors on ``device`` must be staged through host memory: a CUDA
    device without mpicomp's ``cuda`` kernel backend (CuPy and a GPU)."""
    if device.type != "cuda":
        return False
    from mpicomp.kernels import backend

    try:
        backend("cuda")
    except Exception:
        return True
    return False


class Staging:
    """Pinned host buffers for CUDA tensors when CuPy is missing; warns once per owner."""

    def __init__(self, owner: str):
        self.owner = owner
        self.warned = False

    def buffer(self, numel: int) -> torch.Tensor:
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"{self.owner}: CUDA tensors are staged through pinned host memory and "
                "compressed on the CPU (install CuPy, cupy-cuda12x or cupy-cuda13x, for the "
                "GPU kernels)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return torch.empty(numel, dtype=torch.float32, pin_memory=True)


# -- calls refused after a peer closed ------------------------------------------------


class Failed:
    """The handle of a call that could not start: ``wait()`` raises ``error``."""

    done = True

    def __init__(self, error: Exception):
        self.error = error

    def wait(self):
        raise self.error

    def add_done_callback(self, fn) -> None:
        fn(self)


def peer_closed_in(handles: list) -> PeerClosed | None:
    """Return the PeerClosed that one of ``handles`` (calls started earlier in this step)
    met, or None.

    Once a call has met another rank's close, the CompressedComm refuses to start more
    (RuntimeError): the calls of the same step started after that fail with its
    PeerClosed instead, as those started before it do."""
    for h in handles:
        try:
            h.wait()
        except PeerClosed as e:
            return e
        except Exception:  # another call's own error: raised where it is waited for
            pass
    return None
