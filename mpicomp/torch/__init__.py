"""PyTorch in two lines: a distributed optimizer, a DDP communication hook, broadcasts.

``DistributedOptimizer`` wraps any ``torch.optim`` optimizer: gradients are averaged
through a ``CompressedComm`` while backward still runs (buckets of parameters, each
started as soon as all its gradients are accumulated), and ``step()`` waits, writes
the averages into ``p.grad`` and steps. ``comm_hook`` with a ``HookState`` does the
same inside ``torch.nn.parallel.DistributedDataParallel``. ``broadcast_parameters``
and ``broadcast_optimizer_state`` start every rank from rank ``root``'s state.

Needs PyTorch (``pip install 'mpicomp[torch]'``). See docs/pytorch.md.
"""

from __future__ import annotations

import io
import json
import numbers
import os
import sys
import threading
import warnings
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial

try:
    import torch
except ImportError as e:  # pragma: no cover - the test extras install torch
    raise ImportError("mpicomp.torch needs PyTorch: pip install 'mpicomp[torch]'") from e

from mpicomp._log import log
from mpicomp.call.config import Config, allgather_json, check_same, disagreement, ranks_text
from mpicomp.collectives import plain
from mpicomp.collectives._wait import issue, resolve_timeout
from mpicomp.comm import CompressedComm
from mpicomp.errors import NonFiniteWarning, PeerClosed, RankError

__all__ = [
    "DistributedOptimizer",
    "GradientsOverwrittenWarning",
    "HookState",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "comm_hook",
]


def _compressed(comm, codec, options) -> CompressedComm:
    """Return ``comm`` if it is a CompressedComm (then no codec or options), else a
    CompressedComm over the mpi4py communicator ``comm``."""
    if isinstance(comm, CompressedComm):
        if codec is not None or options:
            raise TypeError("a CompressedComm comes with its codec and options: pass neither")
        return comm
    return CompressedComm(comm, "none" if codec is None else codec, **options)


def _check_comm(comm) -> None:
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
        f"mpicomp.CompressedComm, got {_kind(comm)}{hint}"
    )


def _count(what: str, value, least: int) -> int:
    """Return ``value`` as an int >= ``least``; a TypeError or ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int >= {least}, got {_kind(value)}")
    if value < least:
        raise ValueError(f"{what} must be >= {least}, got {value}")
    return int(value)


def _kind(value) -> str:
    """Describe ``value`` for a message: its type, and its repr when short."""
    if isinstance(value, torch.nn.Parameter):
        return f"a Parameter of shape {tuple(value.shape)}"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, torch.nn.Module):
        return f"a module ({type(value).__name__})"
    kind = type(value).__name__
    a = "an" if kind[:1].lower() in "aeiou" else "a"
    if isinstance(value, tuple | list) and 0 < len(value) <= 3:
        return f"{a} {kind} of ({', '.join(type(v).__name__ for v in value)})"
    text = repr(value)
    return f"{kind} {text}" if len(text) <= 60 and not text.startswith("<") else f"{a} {kind}"


def _mpi(comm):
    """Return the mpi4py communicator of ``comm`` (a CompressedComm's own duplicate)."""
    return comm.comm if isinstance(comm, CompressedComm) else comm


def _quiet(comm):
    """Return ``comm``'s mpi4py communicator once no started call of a CompressedComm
    uses it (collectives of one communicator must not run on two threads at once)."""
    if isinstance(comm, CompressedComm):
        comm.wait_all()
    return _mpi(comm)


def _cuda_staging(device: torch.device) -> bool:
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


class _Staging:
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
                stacklevel=4,
            )
        return torch.empty(numel, dtype=torch.float32, pin_memory=True)


class _Failed:
    """The handle of a call that could not start: ``wait()`` raises ``error``."""

    done = True

    def __init__(self, error: Exception):
        self.error = error

    def wait(self):
        raise self.error

    def add_done_callback(self, fn) -> None:
        fn(self)


def _peer_closed_in(handles: list) -> PeerClosed | None:
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


# -- the distributed optimizer ------------------------------------------------------


class GradientsOverwrittenWarning(UserWarning):
    """``DistributedOptimizer.step()`` (or ``synchronize()``) is overwriting gradients
    that changed after their bucket was sent for averaging (clipped or scaled without
    ``synchronize()`` first, or another backward pass): the change is lost."""


@dataclass
class _Bucket:
    """Parameters reduced by one collective call, end to end in a float32 buffer."""

    index: int
    names: list[str]
    params: list[torch.Tensor]
    offsets: list[int]
    buffer: torch.Tensor  # float32, on the parameters' device (or pinned host: staging)
    layout: int  # crc32 of names and sizes: ranks with other buckets raise
    ready: int = 0  # parameters whose gradients are complete this step
    handle: object = None
    has_grad: list[bool] = field(default_factory=list)
    # Each gradient as copied into the buffer, with its version counter (None: no
    # gradient): a change after the copy is one step() would overwrite.
    sent: list = field(default_factory=list)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that its gradients are averaged over the ranks of ``comm``.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its parameter groups and state are
            shared, not copied (learning-rate schedulers work on either object).
        comm: an ``mpi4py`` communicator (a ``CompressedComm`` is made over it from
            ``codec`` and ``options``) or a ``CompressedComm``.
        named_parameters: ``model.named_parameters()`` ((name, tensor) pairs, or a
            dict of name -> tensor): names key error-feedback residuals and
            messages, and the order fixes the buckets (reverse order, as DDP: the
            last layers' gradients are ready first). Default: the optimizer's
            parameters, named ``group<g>.param<i>``. Every parameter of the
            optimizer must be in it; plain ``model.parameters()`` is refused.
        codec: a codec name (``"none"``, ``"qsgd_maxnorm"``, ...) or a made codec.
        backward_passes_per_step: gradients accumulate over this many backward passes
            before they are averaged (the average over ranks of the accumulated sum).
        start_step: the first ``start_step`` steps average uncompressed (float32 sum),
            then the codec takes over (PowerSGD's ``start_powerSGD_iter``).
        overlap: start each bucket's reduction from the gradient hooks, during
            backward; False starts them all in ``step()``.
        **options: ``CompressedComm`` options (``bucket_numel``, ``error_feedback``,
            ``nonfinite``, ``trace``, ...) and codec parameters (``bits=4``).

    ``step()`` waits for the reductions, writes the averages into ``p.grad`` (in each
    gradient's own device and dtype) and steps the wrapped optimizer. Call
    ``synchronize()`` first when something must read or change the averaged
    gradients before the step (gradient clipping, ``GradScaler.unscale_``); ``step()``
    then does not wait again. A gradient changed after its bucket was sent and before
    ``synchronize()`` is overwritten by the average: ``GradientsOverwrittenWarning``.
    A parameter without a gradient on some rank counts as zeros there;
    one without a gradient on every rank keeps ``grad = None``. Under
    ``nonfinite="skip_step"`` a NaN/Inf on any rank skips the wrapped optimizer's
    step on every rank (momentum, weight decay and residuals untouched) with a
    ``NonFiniteWarning``; ``skipped`` tells it.

    Every rank must wrap the same parameters in the same order, and take as many
    steps: a rank stepping after another closed raises ``mpicomp.PeerClosed``.

    Raises:
        TypeError, ValueError: an argument is wrong on this rank (RankError on the
            others: every rank hears of it before anything else collective runs).
        RankError: ranks wrap other parameters (naming each one that differs, with
            its shapes on every rank) or configure it differently.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        comm,
        named_parameters=None,
        codec=None,
        *,
        backward_passes_per_step: int = 1,
        start_step: int = 0,
        overlap: bool = True,
        **options,
    ):
        # What one rank finds wrong in its arguments, every rank hears of (one small
        # allgather) before anything else collective starts.
        _check_comm(comm)
        error, named = None, None
        try:
            if isinstance(optimizer, DistributedOptimizer):
                raise TypeError(
                    "optimizer is already a DistributedOptimizer: wrap the plain optimizer "
                    "once (every gradient would be averaged twice)"
                )
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    "optimizer must be a torch.optim.Optimizer such as "
                    f"torch.optim.SGD(model.parameters(), lr=0.1), got {_kind(optimizer)}"
                )
            backward_passes_per_step = _count(
                "backward_passes_per_step", backward_passes_per_step, 1
            )
            start_step = _count("start_step", start_step, 0)
            if not isinstance(overlap, bool | int) or overlap not in (0, 1):
                raise TypeError(f"overlap must be True or False, got {_kind(overlap)}")
            named = _names(optimizer, named_parameters)
            layout = "|".join(f"{n}:{tuple(p.shape)}" for n, p in named).encode()
            config = Config(
                {
                    "backward_passes_per_step": backward_passes_per_step,
                    "start_step": start_step,
                    "overlap": bool(overlap),
                    "parameters": len(named),
                    _LAYOUT: f"{zlib.crc32(layout):08x}",
                }
            )
        except Exception as e:  # whatever it is, the other ranks must hear of it
            error, config = e, None
        # The CompressedComm made below checks its own options the same way.
        check_same(
            _quiet(comm),
            config,
            error,
            "this DistributedOptimizer",
            None,
            differences=partial(_layout_differences, _mpi(comm), config, named),
        )
        self._building = True
        # The parent's bookkeeping (hooks, profiling) over the wrapped groups; the
        # groups and state are then the wrapped optimizer's own objects.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._building = False
        self.optimizer = optimizer
        self._owns_comm = not isinstance(comm, CompressedComm)
        self.comm = _compressed(comm, codec, options)  # collective: raises on every rank
        self.backward_passes_per_step = backward_passes_per_step
        self.start_step = start_step
        self.overlap = bool(overlap)
        #: Steps taken (skipped ones included): the same on every rank.
        self.steps = 0
        #: Whether the last ``step()`` skipped the wrapped optimizer's step (NaN/Inf).
        self.skipped = False
        self._staging = _Staging("mpicomp.torch.DistributedOptimizer")
        # Which parameters have gradients goes through a communicator of its own: the
        # CompressedComm's may be busy with this step's calls on its worker thread.
        self._control = _mpi(self.comm).Dup()
        self._closed_why = "close() was called"  # told by a step() after close()
        self._hooks = []
        self._buckets: list[_Bucket] = []
        self._next = 0  # the next bucket to start: buckets start in order on every rank
        self._snapshots: list = []  # residual snapshots of this step's calls
        self._synchronized = False
        # The step and the gradients its averages overwrote, for a warning after the step.
        self._overwritten: tuple[int, list[str]] = (0, [])
        error = None
        try:
            self._buckets = self._make_buckets(named)  # allocates: may fail on one rank
        except Exception as e:
            error = e
        try:
            _agree(self._control, error, "DistributedOptimizer", self.comm.options.timeout)
        except BaseException:
            self.close()
            raise
        self._owner = {p: b for b in self._buckets for p in b.params}
        self._passes = dict.fromkeys(self._owner, 0)
        # Autograd may run hooks on one thread per device: buckets start one at a time.
        self._lock = threading.Lock()
        log.info(
            "DistributedOptimizer: %d buckets of %s values, overlap %s, start_step %d",
            len(self._buckets),
            [b.buffer.numel() for b in self._buckets],
            self.overlap,
            self.start_step,
        )
        if self.overlap:
            for b in self._buckets:
                for p in b.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _make_buckets(self, named: list[tuple[str, torch.Tensor]]) -> list[_Bucket]:
        """Group trainable parameters, in reverse order, into buckets of at most
        ``bucket_numel`` elements, one device and dtype each."""
        limit = self.comm.options.bucket_numel
        buckets: list[_Bucket] = []
        group: list[tuple[str, torch.Tensor]] = []
        total = 0

        def close():
            nonlocal group, total
            if group:
                buckets.append(self._bucket(len(buckets), group))
            group, total = [], 0

        for name, p in reversed(named):
            if not p.requires_grad:
                continue
            if group and (
                total + p.numel() > limit
                or p.device != group[0][1].device
                or p.dtype != group[0][1].dtype
            ):
                close()
            group.append((name, p))
            total += p.numel()
        close()
        return buckets

    def _bucket(self, index: int, group: list[tuple[str, torch.Tensor]]) -> _Bucket:
        names = [n for n, _ in group]
        params = [p for _, p in group]
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        device = params[0].device
        if _cuda_staging(device):
            buffer = self._staging.buffer(offsets[-1])
        else:
            buffer = torch.empty(offsets[-1], dtype=torch.float32, device=device)
        label = ";".join(f"{n}:{p.numel()}" for n, p in group)
        return _Bucket(index, names, params, offsets, buffer, zlib.crc32(label.encode()))

    # -- during backward ---------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        """A parameter's gradient was accumulated: count the pass; start the buckets
        that are full, in order (a full bucket waits for those before it)."""
        with self._lock:
            self._passes[p] += 1
            if self._passes[p] != self.backward_passes_per_step:
                return
            bucket = self._owner[p]
            bucket.ready += 1
            while self._next < len(self._buckets):
                b = self._buckets[self._next]
                if b.ready < len(b.params):
                    break
                self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        """Copy the bucket's gradients (zeros where none) into its buffer; start its call."""
        b.has_grad, b.sent = [], []
        with torch.no_grad():
            for p, lo, hi in zip(b.params, b.offsets, b.offsets[1:], strict=False):
                part = b.buffer[lo:hi]
                grad = p.grad
                if grad is None:
                    part.zero_()
                else:
                    part.copy_(grad.reshape(-1))
                b.has_grad.append(grad is not None)
                b.sent.append(None if grad is None else (grad, grad._version))
        compress = self.steps >= self.start_step
        try:
            b.handle = self.comm.start(
                b.buffer,
                f"bucket{b.index}",
                layout=b.layout,
                snapshots=self._snapshots,
                compress=compress,
                shapes=[tuple(p.shape) for p in b.params],
            )
        except RuntimeError:  # closed: by a peer whose close an earlier bucket met?
            closed = _peer_closed_in([x.handle for x in self._buckets[: b.index]])
            if closed is None:
                raise
            b.handle = _Failed(closed)  # step() raises it
        self._next = b.index + 1

    # -- the step ----------------------------------------------------------------

    def synchronize(self) -> None:
        """Start the reductions not started yet, wait for all, and write the averages
        into ``p.grad``. Idempotent until the next ``step()``.

        Raises:
            RankError, ValueError, TypeError: the reduction failed on this rank or
                another (every rank raises; nothing was written, residuals unchanged).
            PeerClosed: another rank closed this DistributedOptimizer (or its
                CompressedComm) instead of taking this step; it is closed here too.
            RuntimeError: this DistributedOptimizer is closed.
        """
        self._synchronize()
        self._warn_overwritten()

    def _synchronize(self) -> None:
        if self._synchronized:
            return
        if self._control is None:
            raise RuntimeError(f"DistributedOptimizer is closed: {self._closed_why}")
        for b in self._buckets[self._next :]:
            self._launch(b)
        # The bucket calls first: their agreement raises PeerClosed where a rank closed
        # (and any failure on every rank), so the exchange below runs only when every
        # rank made this step's calls, and every rank then makes it (or close() does).
        outcomes, error = self._wait_for_buckets()
        sent = [s for b in self._buckets for s in b.sent]
        snapshots, self._snapshots = self._snapshots, []
        self._reset_passes()
        skipped = [m for _, messages in outcomes for m in messages]
        if error is None and not skipped and self._buckets:
            flags, closer = self._exchange(closing=False)
            if closer is not None:
                error = PeerClosed(
                    f"rank {closer} closed its DistributedOptimizer after sending the "
                    f"gradients of step {self.steps}, which this rank took; it is closed on "
                    "this rank too"
                )
        if error is not None or skipped:
            self.comm.rollback(snapshots)  # no residual moves in a step that does not happen
        if isinstance(error, PeerClosed):
            self._closed_why = str(error)
            self.close()  # as the CompressedComm is: a later step() raises RuntimeError
        if error is not None:
            raise error
        self.skipped = bool(skipped)
        self._synchronized = True
        if skipped:
            text = "; ".join(skipped)
            warnings.warn(
                f"{text}: optimizer step {self.steps} skipped on every rank",
                NonFiniteWarning,
                stacklevel=_callers_level(),
            )
            return
        # Warned after the step (step()) or the writing (synchronize()): under -W error it
        # raises on the ranks whose gradients changed only, which must still step.
        self._overwritten = (self.steps, self._changed_since_sent(sent))
        with torch.no_grad():
            i = 0
            for b, (avg, _) in zip(self._buckets, outcomes, strict=True):
                for p, lo, hi in zip(b.params, b.offsets, b.offsets[1:], strict=False):
                    if flags[i]:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        p.grad.copy_(avg[lo:hi].view_as(p))
                    i += 1

    def _wait_for_buckets(self) -> tuple[list, Exception | None]:
        """Wait for every started bucket call; return their outcomes and the first error."""
        outcomes, error = [], None
        for b in self._buckets:
            if b.handle is None:  # not started (close() in the middle of a step)
                continue
            try:
                outcomes.append(b.handle.wait())
            except Exception as e:  # wait for every call before raising the first error
                error = error or e
        return outcomes, error

    def _exchange(self, closing: bool) -> tuple[list[bool], int | None]:
        """Return, per parameter in bucket order, whether any rank has its gradient (a
        parameter unused everywhere keeps ``grad = None``), and the rank that closed
        instead of stepping (None: none). One small MPI_Allreduce (max) on the control
        communicator, behind the CompressedComm's timeout; ``closing``: this rank's
        part in it is its close()."""
        import numpy as np
        from mpi4py import MPI

        flags = [h for b in self._buckets for h in b.has_grad]
        mine = np.array([*flags, self._control.rank + 1 if closing else 0], np.int32)
        every = np.empty_like(mine)
        if closing:
            where, what = "close", "telling the other ranks that this rank closes"
        else:
            where, what = "synchronize", "which parameters have gradients"
        issue(
            self._control,
            "Allreduce",
            mine,
            every,
            op=MPI.MAX,
            timeout=resolve_timeout(self.comm.options.timeout),
            name=f"DistributedOptimizer.{where}",
            detail=lambda: (
                f"{what} in step {self.steps} (optimizer.steps, from 0), an Iallreduce of "
                f"{mine.nbytes} bytes over all {self._control.size} ranks"
            ),
        )
        closer = int(every[-1]) - 1
        return every[:-1].astype(bool).tolist(), None if closer < 0 else closer

    def _changed_since_sent(self, sent: list) -> list[str]:
        """Return the parameters whose gradients changed after their bucket copied them:
        writing the averages undoes that change (clipping before ``step()`` without
        ``synchronize()``, a GradScaler's unscale_, another backward pass)."""
        names = [n for b in self._buckets for n in b.names]
        params = [p for b in self._buckets for p in b.params]
        return [n for n, p, s in zip(names, params, sent, strict=True) if _changed_since(p.grad, s)]

    def _warn_overwritten(self) -> None:
        """Warn of the gradients the last averages overwrote (``_changed_since_sent``)."""
        (step, changed), self._overwritten = self._overwritten, (0, [])
        if not changed:
            return
        shown = ", ".join(map(repr, changed[:3]))
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        warnings.warn(
            f"DistributedOptimizer step {step}: the gradients of {shown}{more} changed "
            "after they were sent for averaging (clipped or scaled before step() without "
            "synchronize(), or another backward pass) and are overwritten now with the "
            "averages of the gradients as sent, undoing the change: call "
            "optimizer.synchronize() first, then clip or scale, then step()",
            GradientsOverwrittenWarning,
            stacklevel=_callers_level(),
        )

    def _reset_passes(self) -> None:
        for p in self._passes:
            self._passes[p] = 0
        for b in self._buckets:
            b.ready, b.handle = 0, None
            b.sent = []  # holds gradients: let zero_grad() free them
        self._next = 0

    def step(self, closure=None):
        """Average the gradients (``synchronize``), then step the wrapped optimizer,
        unless a NaN/Inf skipped this step. Returns ``closure()``'s loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._synchronize()
        finally:
            self._synchronized = False
            self.steps += 1
        if not self.skipped:
            self.optimizer.step()
        self._warn_overwritten()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if self._building:
            return super().add_param_group(param_group)
        raise RuntimeError(
            "DistributedOptimizer: add parameter groups to the wrapped optimizer before "
            "wrapping it (every rank's buckets are fixed when it is made)"
        )

    def state_dict(self) -> dict:
        """The wrapped optimizer's state, plus mpicomp's: this rank's error-feedback
        residuals and the step counter (as tensors: ``torch.load`` reads them with
        ``weights_only=True``)."""
        state = self.optimizer.state_dict()
        comm = self.comm.state_dict()
        state["mpicomp"] = {
            "steps": self.steps,
            "comm_step": comm["step"],
            "residuals": _tensors(comm["residuals"]),
            "server_residuals": _tensors(comm["server_residuals"]),
        }
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        ours = state.pop("mpicomp", None)
        self.optimizer.load_state_dict(state)
        if ours is not None:
            self.steps = int(ours["steps"])
            self.comm.load_state_dict(
                {
                    "step": int(ours["comm_step"]),
                    "residuals": dict(ours["residuals"]),
                    "server_residuals": dict(ours["server_residuals"]),
                }
            )

    def close(self) -> None:
        """Remove the gradient hooks and release the communicators (the CompressedComm
        too when this optimizer made it). Safe twice.

        Like ``CompressedComm.close``, it takes part in what the other ranks' next step
        begins with: a rank still stepping raises ``PeerClosed`` instead of waiting for
        this one, also when this rank closes after backward, before its ``step()``."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._control is None:
            return
        try:
            self._leave_step()
        finally:
            try:
                if self._owns_comm:
                    self.comm.close()
            finally:
                self._control.Free()
                self._control = None

    def _leave_step(self) -> None:
        """Drop a step whose buckets were started but not synchronized (close() after
        backward). If every bucket went through, the other ranks' next MPI call is that
        step's exchange (in ``synchronize``, or this same one in their ``close``): take
        part as the closing rank, so they raise PeerClosed. Otherwise their next bucket
        call meets the CompressedComm's close, or they failed alike already."""
        if self._synchronized or self._next == 0:
            return
        sent_all = self._next == len(self._buckets)
        outcomes, error = self._wait_for_buckets()
        snapshots, self._snapshots = self._snapshots, []
        self._reset_passes()
        self.comm.rollback(snapshots)  # the step is not taken
        if sent_all and error is None and not any(messages for _, messages in outcomes):
            self._exchange(closing=True)

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({self.optimizer.__class__.__name__}, "
            f"codec={self.comm.codec!r}, buckets={len(self._buckets)})"
        )


def _names(optimizer, named_parameters) -> list[tuple[str, torch.Tensor]]:
    """Return (name, parameter) for every parameter of ``optimizer``, checked."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return [
            (f"group{g}.param{i}", p)
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        ]
    named = _pairs(named_parameters)
    names: dict[str, int] = {}
    tensors: dict[int, str] = {}
    for n, p in named:
        if n in names:
            raise ValueError(f"named_parameters names {n!r} more than once")
        names[n] = id(p)
        if id(p) in tensors:
            raise ValueError(
                f"named_parameters holds one tensor under two names, {tensors[id(p)]!r} "
                f"and {n!r} (tied weights: name each tensor once, as "
                "model.named_parameters() does)"
            )
        tensors[id(p)] = n
    missing = [
        f"group{g}.param{i} {tuple(p.shape)}"
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in tensors
    ]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ValueError(
            f"{len(missing)} parameters of the optimizer are not in named_parameters "
            f"({shown}): pass model.named_parameters() of the model the optimizer trains"
        )
    mine = {id(p) for p in params}
    return [(n, p) for n, p in named if id(p) in mine]


_PAIRS = "named_parameters must be (name, tensor) pairs such as model.named_parameters()"


def _pairs(named_parameters) -> list[tuple[str, torch.Tensor]]:
    """Return ``named_parameters`` (pairs, or a dict of name -> tensor) as a list of
    pairs; a TypeError saying what was given instead."""
    if isinstance(named_parameters, torch.nn.Module):
        raise TypeError(f"{_PAIRS}; got {_kind(named_parameters)}: pass its named_parameters()")
    if isinstance(named_parameters, str | bytes | torch.Tensor):
        hint = (
            f" (a codec? pass codec={named_parameters!r})"
            if isinstance(named_parameters, str)
            else ""
        )
        raise TypeError(f"{_PAIRS}; got {_kind(named_parameters)}{hint}")
    if isinstance(named_parameters, Mapping):
        named_parameters = named_parameters.items()
    try:
        items = list(named_parameters)
    except TypeError:
        raise TypeError(f"{_PAIRS}; got {_kind(named_parameters)}") from None
    pairs = []
    for item in items:
        if isinstance(item, torch.Tensor):
            raise TypeError(
                f"{_PAIRS}; got {_kind(item)} (model.parameters() has no names: pass "
                "model.named_parameters(), or leave named_parameters out to name the "
                "optimizer's parameters by position)"
            )
        if not (
            isinstance(item, tuple | list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise TypeError(f"{_PAIRS}; got an item {_kind(item)}")
        pairs.append((item[0], item[1]))
    return pairs


def _callers_level() -> int:
    """Return the ``stacklevel`` of the first frame outside this module and torch (which
    wraps ``Optimizer.step``) for a warning raised by the function calling this one."""
    level, frame = 1, sys._getframe(1)  # stacklevel 1: the function calling warn()
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_TORCH)
    ):
        level, frame = level + 1, frame.f_back
    return level


_TORCH = os.path.dirname(torch.__file__) + os.sep


def _changed_since(grad, sent) -> bool:
    """Whether ``grad`` (a parameter's gradient now) is not what a bucket copied:
    ``sent`` is (that gradient, its version counter), or None where there was none."""
    if sent is None:
        return grad is not None
    return grad is not sent[0] or grad._version != sent[1]


#: The configuration field of the parameters' names, shapes and order (a digest).
_LAYOUT = "parameter_names_and_shapes"
_SHOWN = 4  # differing parameters named in one message


def _layout_differences(mpi, config: Config, named: list, timeout) -> str:
    """Return, on every rank, what differs among the ranks' parameters (each one named,
    with its shape on every rank) and other fields of ``config``. Collective: every
    rank's names and shapes go to every rank, once the digests have differed."""
    fields = {k: v for k, v in config.fields.items() if k not in (_LAYOUT, "parameters")}
    mine = {"fields": fields, "parameters": [[n, list(p.shape)] for n, p in named]}
    every = allgather_json(mpi, mine, timeout)
    parts = []
    for key in fields:
        groups = _ranks_by(json.dumps(e["fields"].get(key)) for e in every)
        if len(groups) > 1:
            parts.append(f"{key}: " + ", ".join(f"{v} on {r}" for v, r in groups))
    shapes = [{n: tuple(s) for n, s in e["parameters"]} for e in every]
    names = dict.fromkeys(n for e in every for n, _ in e["parameters"])
    differ = []
    for name in names:
        groups = _ranks_by(s.get(name) for s in shapes)
        if len(groups) > 1:
            sides, said = [], False  # "shape (4, 3) on rank 0, (5, 3) on rank 1"
            for shape, ranks in groups:
                if shape is None:
                    sides.append(f"absent on {ranks}")
                else:
                    sides.append(f"{'' if said else 'shape '}{shape} on {ranks}")
                    said = True
            differ.append(f"parameter {name!r}: " + ", ".join(sides))
    orders = [[n for n, _ in e["parameters"]] for e in every]
    rows = enumerate(zip(*orders, strict=False))  # up to the shortest list
    at = next((i for i, row in rows if len(set(row)) > 1), None)
    if not differ and at is not None:  # the same names and shapes, in another order
        sides = ", ".join(f"{n!r} on {r}" for n, r in _ranks_by(o[at] for o in orders))
        differ.append(f"the same parameters in another order: at position {at}, {sides}")
    more = [f"and {len(differ) - _SHOWN} more parameters"] if len(differ) > _SHOWN else []
    # Digests that differ where nothing shown does: the fields, as check_same names them.
    return "; ".join(parts + differ[:_SHOWN] + more) or disagreement(mpi, config.fields, timeout)


def _ranks_by(values) -> list[tuple]:
    """Return [(value, "rank 0" or "ranks 1-3")] for each distinct value, in rank order."""
    groups: dict = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    return [(v, ranks_text(r)) for v, r in groups.items()]


def _tensors(arrays: dict) -> dict:
    """Return residual arrays (NumPy or CuPy) as torch tensors (no copy)."""
    return {k: torch.from_dlpack(v) for k, v in arrays.items()}


# -- broadcasts -----------------------------------------------------------------------


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
    mpi = _quiet(comm)
    if isinstance(params, torch.nn.Module):
        params = params.state_dict()
    named = list(params.items() if isinstance(params, dict) else params)
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    timeout = _timeout(comm)
    theirs = plain.bcast_object(mpi, mine, root, timeout=timeout)
    differs = None if mine == theirs else _difference(mine, theirs, root)
    _agree(mpi, differs, "broadcast_parameters", timeout)
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
    mpi = _quiet(comm)
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    blob = None
    if mpi.rank == root:
        out = io.BytesIO()
        torch.save(inner.state_dict(), out)
        blob = out.getvalue()
    timeout = _timeout(comm)
    blob = plain.bcast_object(mpi, blob, root, timeout=timeout)
    error = None
    if mpi.rank != root:
        try:
            state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            inner.load_state_dict(state)  # moves each state tensor to its parameter's device
        except (ValueError, KeyError, RuntimeError) as e:
            error = ValueError(f"rank {mpi.rank}: cannot load rank {root}'s optimizer state: {e}")
    _agree(mpi, error, "broadcast_optimizer_state", timeout)


def _timeout(comm) -> float | None:
    """Return the timeout of ``comm``'s messages: a CompressedComm's own, else None
    (``MPICOMP_TIMEOUT`` decides)."""
    return comm.options.timeout if isinstance(comm, CompressedComm) else None


def _agree(mpi, error, what: str, timeout: float | None = None) -> None:
    """Raise on every rank if any rank has an ``error`` (a message or an exception)."""
    errors = plain.allgather_object(mpi, None if error is None else str(error), timeout=timeout)
    if error is not None:
        raise error if isinstance(error, Exception) else ValueError(error)
    bad = [r for r, e in enumerate(errors) if e is not None]
    if bad:
        raise RankError(f"{what} failed on rank(s) {bad}: {errors[bad[0]]}")


def _difference(mine: list, theirs: list, root: int) -> str:
    """Describe how this rank's (name, shape, dtype) list differs from ``root``'s."""
    if len(mine) != len(theirs):
        return f"{len(mine)} tensors here, {len(theirs)} on rank {root}"
    for a, b in zip(mine, theirs, strict=True):
        if a != b:
            return f"tensor {a[0]!r} {a[1]} {a[2]} here, {b[0]!r} {b[1]} {b[2]} on rank {root}"
    return "tensors differ"  # pragma: no cover


# -- DDP communication hook --------------------------------------------------------------


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
        _check_comm(comm)
        error, config = None, None
        try:
            start_step = _count("start_step", start_step, 0)
            config = Config({"start_step": start_step})
        except Exception as e:  # the other ranks must hear of it
            error = e
        check_same(_quiet(comm), config, error, "this HookState", None)
        self.start_step = start_step
        self.comm = _compressed(comm, codec, options)
        #: Iterations seen (counted at each iteration's last bucket).
        self.iteration = 0
        self._sizes: dict[int, int] = {}
        self._staging = _Staging("mpicomp.torch.comm_hook")
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
        torch.autograd.Variable._execution_engine.queue_callback(self.raise_first_error)


def _queue_at_end_of_backward(p: _Pass) -> bool:
    """Make ``p``'s first error come out of the running ``backward()`` after DDP has
    finished it; False where no backward pass runs (the hook called directly)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(p.after_ddp)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    except AttributeError:  # pragma: no cover - a torch without it: fail the future
        return False
    return True


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
            f"mpicomp.torch.comm_hook); got {_kind(state)}"
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
        state._pass.queued = _queue_at_end_of_backward(state._pass)
    this = state._pass
    this.last = index
    source = buffer
    if _cuda_staging(buffer.device):
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
        closed = _peer_closed_in(this.handles)
        if closed is None:
            raise
        handle = _Failed(closed)  # backward() raises it, as the earlier bucket's
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
                    stacklevel=2,
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
