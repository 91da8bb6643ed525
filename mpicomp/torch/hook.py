"""The DDP communication hook: ``comm_hook`` with its ``HookState`` averages each
gradient bucket of ``torch.nn.parallel.DistributedDataParallel`` through a
``CompressedComm`` instead of DDP's own all-reduce.

DDP decides the buckets; each is started on mpicomp's background thread and the
future DDP waits for completes with the average. The calls of one backward pass are a
``_Pass``: a failed bucket makes ``backward()`` raise mpicomp's error on every rank
once DDP has finished the pass, and no residual of that iteration moves.
"""

from __future__ import annotations

import warnings
import zlib

import torch

from mpicomp.call.config import Config, check_same
from mpicomp.call.worker import user_stacklevel
from mpicomp.errors import NonFiniteWarning
from mpicomp.torch.shared import (
    Failed,
    Staging,
    at_end_of_backward,
    check_comm,
    check_given,
    compressed,
    count,
    cuda_staging,
    kind,
    peer_closed_in,
    quiet,
)

__all__ = ["HookState", "comm_hook"]


class HookState:
    """The state of ``comm_hook`` for ``DistributedDataParallel.register_comm_hook``.

    Args:
        comm: an mpi4py communicator (a ``CompressedComm`` is made over it) or a
            ``CompressedComm``. Its ranks must be the process group's, in order.
        codec: a codec name or a made codec.
        start_step: iterations averaged uncompressed (float32) first. DDP rebuilds its
            buckets after the first iteration; residuals are keyed by bucket index and
            dropped when a bucket's size changes, so ``start_step >= 1`` (as PowerSGD's
            ``start_powerSGD_iter``) loses no error feedback.
        **options: ``CompressedComm`` options and codec parameters.
    """

    def __init__(self, comm, codec=None, *, start_step: int = 0, **options):
        # A bad or differing start_step on one rank is every rank's error (one small
        # allgather), before the CompressedComm (collective) is made.
        check_comm(comm)
        error, config = None, None
        try:
            check_given(comm, codec, options)
            start_step = count("start_step", start_step, 0)
            config = Config({"start_step": start_step})
        except Exception as e:  # the other ranks must hear of it
            error = e
        check_same(quiet(comm), config, error, "this HookState", options.get("timeout"))
        self.start_step = start_step
        self.comm = compressed(comm, codec, options)
        #: Iterations seen (counted at each iteration's last bucket).
        self.iteration = 0
        self._sizes: dict[int, int] = {}
        self._staging = Staging("mpicomp.torch.comm_hook")
        self._pass: _Pass | None = None  # the calls of the backward pass under way


class _Pass:
    """The calls of one backward pass (one DDP iteration): their handles and the
    residual snapshots they took, so a failed bucket fails the whole iteration."""

    def __init__(self, comm):
        self.comm = comm  # the HookState's CompressedComm
        self.handles: list = []
        self.snapshots: list = []
        self.errors: dict = {}  # handle -> what failed after its call (writing the bucket)
        self.queued = False  # a final callback of this backward pass raises its error
        self.last = -1  # the index of its last bucket started so far

    def raise_first_error(self) -> None:
        """Run by autograd after DDP has finished the backward pass: if a call of this
        pass failed, put every call's residuals back and raise the first error (this
        rank's own ValueError/TypeError, or RankError) out of ``backward()``."""
        error = None
        for h in self.handles:
            try:
                h.wait()
            except BaseException as e:
                error = error or e
            error = error or self.errors.get(h)
        if error is not None:
            self.comm.rollback(self.snapshots)  # the iteration is not taken: no residual moves
            raise error

    def after_ddp(self) -> None:
        """Run by autograd at the end of backward, before DDP's own finalization (queued
        earlier): queue ``raise_first_error`` behind it."""
        at_end_of_backward(self.raise_first_error)


def comm_hook(state: HookState, bucket) -> torch.futures.Future:
    """Average a DDP gradient bucket through ``state.comm``; return a future of it.

    Register with ``ddp.register_comm_hook(state, mpicomp.torch.comm_hook)``. The
    bucket's buffer is reduced on mpicomp's background thread and overwritten with
    the average when the future completes. Under ``nonfinite="skip_step"`` a skipped
    bucket averages to zeros (DDP cannot skip the optimizer step: use
    ``DistributedOptimizer`` for that).

    A call that fails (a NaN/Inf under ``nonfinite="raise"``, a refused tensor, ranks
    that disagree) makes ``backward()`` raise mpicomp's own exception on every rank,
    after DDP has finished the backward pass: ``ValueError``/``TypeError`` on the rank
    at fault, ``mpicomp.RankError`` on the others; ``mpicomp.PeerClosed`` where another
    rank has closed ``state.comm``. The failed buckets' gradients are
    zeros on every rank and no residual of that iteration moves; the next iteration
    runs as usual.
    """
    if not isinstance(state, HookState):
        raise TypeError(
            "comm_hook's state must be a mpicomp.torch.HookState: "
            "ddp.register_comm_hook(mpicomp.torch.HookState(comm, codec), "
            f"mpicomp.torch.comm_hook); got {kind(state)}"
        )
    buffer = bucket.buffer()
    index = bucket.index()
    name = f"ddp_bucket{index}"
    if state._sizes.get(index, buffer.numel()) != buffer.numel():
        state.comm.forget(name)  # DDP rebuilt its buckets: another layout under this index
    state._sizes[index] = buffer.numel()
    if state._pass is None or index <= state._pass.last:
        # DDP starts its buckets in index order: a bucket index not above the last one
        # begins another backward pass (also after one that ended half-way).
        state._pass = _Pass(state.comm)
        state._pass.queued = at_end_of_backward(state._pass.after_ddp)
    this = state._pass
    this.last = index
    source = buffer
    if cuda_staging(buffer.device):
        source = state._staging.buffer(buffer.numel())
        source.copy_(buffer)
    compress = state.iteration >= state.start_step
    layout = zlib.crc32(f"{name}:{buffer.numel()}".encode())
    grads = bucket.gradients() if hasattr(bucket, "gradients") else []
    shapes = [tuple(g.shape) for g in grads]
    if sum(g.numel() for g in grads) != buffer.numel():
        shapes = None  # padded (or unknown): not the gradients end to end
    try:
        handle = state.comm.start(
            source, name, layout=layout, snapshots=this.snapshots, compress=compress, shapes=shapes
        )
    except RuntimeError:  # closed: by a peer whose close an earlier bucket met?
        closed = peer_closed_in(this.handles)
        if closed is None:
            raise
        handle = Failed(closed)  # backward() raises it, as the earlier bucket's
    this.handles.append(handle)
    if bucket.is_last():
        state.iteration += 1
        state._pass = None  # the next bucket is the next iteration's
    future = torch.futures.Future()

    def complete(h) -> None:
        try:
            avg, skipped = h.wait()
            if skipped:
                warnings.warn(
                    "; ".join(skipped) + ": bucket averaged to zeros",
                    NonFiniteWarning,
                    stacklevel=user_stacklevel(),
                )
            with torch.no_grad():
                buffer.copy_(avg.reshape(buffer.shape))
        except BaseException as e:  # the future must complete, or DDP waits forever
            if not this.queued:  # called outside backward: the caller's wait() raises it
                future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
                return
            this.errors.setdefault(h, e)
            # DDP reads the future before the final callback raises the error: zeros,
            # the same on every rank, whatever the caller does next.
            with torch.no_grad():
                buffer.zero_()
        future.set_result(buffer)

    handle.add_done_callback(complete)
    return future


# DDP compares the annotation with the type itself (a string, under postponed evaluation,
# is refused).
comm_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
