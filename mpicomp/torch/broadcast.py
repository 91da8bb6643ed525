"""Broadcasts that start every rank from rank ``root``'s state:
``broadcast_parameters`` (a model's parameters and buffers, in one message) and
``broadcast_optimizer_state`` (an optimizer's state and hyperparameters).

Each first checks that every rank names the same ``root`` and its own arguments (a
rank that cannot raises, the others RankError), then that every rank can take
``root``'s values, over the communicator's own timeout.
"""

from __future__ import annotations

import io
import numbers

import torch

from mpicomp.call.config import Config, check_same
from mpicomp.collectives import plain
from mpicomp.torch.optimizer import DistributedOptimizer
from mpicomp.torch.shared import agree, check_comm, kind, quiet, timeout_of
from mpicomp.torch.zero import ZeroOptimizer

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(params, comm, root: int = 0) -> None:
    """Overwrite, in place, every rank's parameters and buffers with rank ``root``'s.

    Args:
        params: a ``torch.nn.Module`` (its ``state_dict()``: parameters and buffers),
            a dict of tensors, or (name, tensor) pairs.
        comm: an mpi4py communicator or a ``CompressedComm``.
        root: the rank whose values everyone gets.

    Raises:
        ValueError: ranks hold different names, shapes or dtypes (on the ranks that
            differ from ``root``; RankError on the others).
    """
    check_comm(comm)
    mpi, timeout = quiet(comm), timeout_of(comm)
    error, named, mine = None, [], []
    try:
        _check_root(root, mpi.size)
        if isinstance(params, torch.nn.Module):
            params = params.state_dict()
        named = list(params.items() if isinstance(params, dict) else params)
        if not all(isinstance(t, torch.Tensor) for _, t in named):
            raise TypeError("params must be a module, a dict of tensors or (name, tensor) pairs")
        mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    except Exception as e:  # the other ranks hear of it before the broadcasts
        error = e
    _agree_on_root(mpi, root, error, "broadcast_parameters", timeout)
    theirs = plain.bcast_object(mpi, mine, root, timeout=timeout)
    differs = None if mine == theirs else _difference(mine, theirs, root)
    agree(mpi, differs, "broadcast_parameters", timeout)
    if not named:
        return
    # One message: every tensor's bytes end to end.
    data = [t.detach().reshape(-1).contiguous().view(torch.uint8).cpu() for _, t in named]
    sizes = [d.numel() for d in data]
    payload = torch.cat(data) if mpi.rank == root else torch.empty(sum(sizes), dtype=torch.uint8)
    plain.bcast(mpi, payload.numpy(), root, timeout=timeout)
    if mpi.rank == root:
        return
    with torch.no_grad():
        for (_, t), part in zip(named, torch.split(payload, sizes), strict=True):
            # clone: a slice of the byte buffer may not be aligned for t's dtype
            t.copy_(part.clone().view(t.dtype).view(t.shape))


def broadcast_optimizer_state(optimizer, comm, root: int = 0) -> None:
    """Give every rank's optimizer rank ``root``'s state (momentum, step counts, groups'
    hyperparameters). For a ``DistributedOptimizer``, its wrapped optimizer's state:
    error-feedback residuals are each rank's own and stay.

    Raises:
        ValueError: this rank's optimizer cannot take ``root``'s state (other parameter
            groups or shapes); RankError on the other ranks.
    """
    check_comm(comm)
    mpi, timeout = quiet(comm), timeout_of(comm)
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    error, blob = None, None
    try:
        _check_root(root, mpi.size)
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {kind(optimizer)}")
        if isinstance(inner, ZeroOptimizer):
            raise TypeError(
                "a ZeroOptimizer's state is each rank's own rows: there is nothing to "
                "broadcast (broadcast_parameters starts every rank from the same parameters)"
            )
        if mpi.rank == root:
            out = io.BytesIO()
            torch.save(inner.state_dict(), out)
            blob = out.getvalue()
    except Exception as e:  # the other ranks hear of it before the broadcast
        error = e
    _agree_on_root(mpi, root, error, "broadcast_optimizer_state", timeout)
    blob = plain.bcast_object(mpi, blob, root, timeout=timeout)
    error = None
    if mpi.rank != root:
        try:
            state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            inner.load_state_dict(state)  # moves each state tensor to its parameter's device
        except (ValueError, KeyError, RuntimeError) as e:
            error = ValueError(f"rank {mpi.rank}: cannot load rank {root}'s optimizer state: {e}")
    agree(mpi, error, "broadcast_optimizer_state", timeout)


def _check_root(root, size: int) -> None:
    """Refuse a ``root`` that is not a rank of a communicator of ``size`` ranks."""
    if isinstance(root, bool) or not isinstance(root, numbers.Integral):
        raise TypeError(f"root must be a rank (an int), got {kind(root)}")
    if not 0 <= root < size:
        raise ValueError(f"root must be a rank in [0, {size}), got {root}")


def _agree_on_root(mpi, root, error, what: str, timeout) -> None:
    """Raise on every rank if one failed (``error``) or the ranks name other roots: one
    Allgather, before the broadcast that would otherwise hang or mix them."""
    config = None if error is not None else Config({"root": int(root)})
    check_same(mpi, config, error, what, timeout)


def _difference(mine: list, theirs: list, root: int) -> str:
    """Describe how this rank's (name, shape, dtype) list differs from ``root``'s."""
    if len(mine) != len(theirs):
        return f"{len(mine)} tensors here, {len(theirs)} on rank {root}"
    for a, b in zip(mine, theirs, strict=True):
        if a != b:
            return f"tensor {a[0]!r} {a[1]} {a[2]} here, {b[0]!r} {b[1]} {b[2]} on rank {root}"
    return "tensors differ"  # pragma: no cover
