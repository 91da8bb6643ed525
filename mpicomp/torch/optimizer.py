"""``DistributedOptimizer``: any ``torch.optim`` optimizer whose gradients are averaged
over the ranks through a ``CompressedComm`` while backward still runs.

Its trainable parameters go, in reverse order, into buckets (one float32 buffer and one
collective call each); a gradient hook starts each bucket's call as soon as all its
gradients are accumulated, and ``step()`` waits, writes the averages into ``p.grad``
and steps the wrapped optimizer. Which parameters it wraps, and how ranks that wrap
others are told apart, is ``mpicomp/torch/parameters.py``.
"""

from __future__ import annotations

import threading
import warnings
import zlib
from dataclasses import dataclass, field
from functools import partial

import torch

from mpicomp._log import log
from mpicomp.call.config import Config, check_same
from mpicomp.call.worker import user_stacklevel
from mpicomp.collectives._wait import dup, resolve_timeout
from mpicomp.comm import CompressedComm
from mpicomp.errors import NonFiniteWarning, PeerClosed
from mpicomp.torch.parameters import LAYOUT, describe_layout, layout_differences, named
from mpicomp.torch.shared import (
    Failed,
    Staging,
    agree,
    check_comm,
    check_given,
    claim_names,
    compressed,
    count,
    cuda_staging,
    kind,
    max_over_ranks,
    mpi_of,
    peer_closed_in,
    quiet,
    release_names,
)

__all__ = ["DistributedOptimizer", "GradientsOverwrittenWarning"]


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
    ``NonFiniteWarning``; ``skipped`` tells it. ``buckets`` names the parameters of
    each bucket (one collective call per bucket and step).

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
        check_comm(comm)
        error, parameters = None, None
        try:
            check_given(comm, codec, options)
            if isinstance(optimizer, DistributedOptimizer):
                raise TypeError(
                    "optimizer is already a DistributedOptimizer: wrap the plain optimizer "
                    "once (every gradient would be averaged twice)"
                )
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    "optimizer must be a torch.optim.Optimizer such as "
                    f"torch.optim.SGD(model.parameters(), lr=0.1), got {kind(optimizer)}"
                )
            backward_passes_per_step = count(
                "backward_passes_per_step", backward_passes_per_step, 1
            )
            start_step = count("start_step", start_step, 0)
            if not isinstance(overlap, bool | int) or overlap not in (0, 1):
                raise TypeError(f"overlap must be True or False, got {kind(overlap)}")
            parameters = named(optimizer, named_parameters)
            layout = describe_layout(parameters).encode()
            config = Config(
                {
                    "backward_passes_per_step": backward_passes_per_step,
                    "start_step": start_step,
                    "overlap": bool(overlap),
                    "parameters": len(parameters),
                    LAYOUT: f"{zlib.crc32(layout):08x}",
                }
            )
        except Exception as e:  # whatever it is, the other ranks must hear of it
            error, config = e, None
        # The CompressedComm made below checks its own options the same way.
        check_same(
            quiet(comm),
            config,
            error,
            "this DistributedOptimizer",
            options.get("timeout"),  # the CompressedComm's timeout= covers this check too
            differences=partial(layout_differences, mpi_of(comm), config, parameters),
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
        self.comm = compressed(comm, codec, options)  # collective: raises on every rank
        #: What this optimizer's call names begin with: "" for the first optimizer open
        #: on its CompressedComm, "optimizer1." for a second (residuals are per name).
        self.names = claim_names(self.comm, self)
        self.backward_passes_per_step = backward_passes_per_step
        self.start_step = start_step
        self.overlap = bool(overlap)
        #: Steps taken (skipped ones included): the same on every rank.
        self.steps = 0
        #: Whether the last ``step()`` skipped the wrapped optimizer's step (NaN/Inf).
        self.skipped = False
        self._staging = Staging("mpicomp.torch.DistributedOptimizer")
        # Which parameters have gradients goes through a communicator of its own: the
        # CompressedComm's may be busy with this step's calls on its worker thread.
        self._control = dup(
            mpi_of(self.comm),
            timeout=resolve_timeout(self.comm.options.timeout),
            name="DistributedOptimizer",
        )
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
            self._buckets = self._make_buckets(parameters)  # allocates: may fail on one rank
        except Exception as e:
            error = e
        try:
            agree(self._control, error, "DistributedOptimizer", self.comm.options.timeout)
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
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._start_buckets))

    @property
    def buckets(self) -> tuple[tuple[str, ...], ...]:
        """The names of each bucket's parameters, in the order the buckets start: the
        trainable parameters in reverse order of ``named_parameters``, a new bucket
        where ``bucket_numel`` would be passed or the device or dtype changes. One
        collective call per bucket and step; the same on every rank."""
        return tuple(tuple(b.names) for b in self._buckets)

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
        if cuda_staging(device):
            buffer = self._staging.buffer(offsets[-1])
        else:
            buffer = torch.empty(offsets[-1], dtype=torch.float32, device=device)
        label = ";".join(f"{n}:{p.numel()}" for n, p in group)
        return _Bucket(index, names, params, offsets, buffer, zlib.crc32(label.encode()))

    # -- during backward ---------------------------------------------------------

    def _start_buckets(self, p: torch.Tensor | None = None) -> None:
        """Start the buckets that are due, in order, each call straight from here (the
        gradient's path to MPI: tests/test_mpi_architecture.py).

        The gradient hook (``p``: the parameter whose gradient was accumulated) counts
        the pass and starts the buckets that are full (a full bucket waits for those
        before it); ``step()`` and ``synchronize()`` (no ``p``) start every bucket not
        started yet, unless this step is synchronized already or the optimizer closed."""
        with self._lock:
            if p is not None:
                self._passes[p] += 1
                if self._passes[p] != self.backward_passes_per_step:
                    return
                self._owner[p].ready += 1
            elif self._synchronized or self._control is None:
                return  # nothing to start; _synchronize says why where it must
            while self._next < len(self._buckets):
                b = self._buckets[self._next]
                if p is not None and b.ready < len(b.params):
                    break
                self._copy_in(b)
                try:
                    b.handle = self.comm.start(
                        b.buffer,
                        f"{self.names}bucket{b.index}",
                        layout=b.layout,
                        snapshots=self._snapshots,
                        compress=self.steps >= self.start_step,
                        shapes=[tuple(q.shape) for q in b.params],
                        result_dtype=b.params[0].dtype,  # float16 gradients: their range
                    )
                except RuntimeError:  # closed: by a peer whose close an earlier bucket met?
                    closed = peer_closed_in([x.handle for x in self._buckets[: b.index]])
                    if closed is None:
                        raise
                    b.handle = Failed(closed)  # step() raises it
                self._next = b.index + 1

    def _copy_in(self, b: _Bucket) -> None:
        """Copy the bucket's gradients (zeros where none) into its buffer, noting which
        exist and what each was (to see a change made after the copy)."""
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
        self._start_buckets()
        self._synchronize()
        self._warn_overwritten()

    def _synchronize(self) -> None:
        """Wait for this step's bucket calls (every one started: ``_start_buckets``),
        agree on which gradients exist, and write the averages."""
        if self._synchronized:
            return
        if self._control is None:
            raise RuntimeError(f"DistributedOptimizer is closed: {self._closed_why}")
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
                stacklevel=user_stacklevel(),
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
        flags = [h for b in self._buckets for h in b.has_grad]
        if closing:
            where, what = "close", "telling the other ranks that this rank closes"
        else:
            where, what = "synchronize", "which parameters have gradients"
        every = max_over_ranks(
            self._control,
            [*map(int, flags), self._control.rank + 1 if closing else 0],
            self.comm.options.timeout,
            f"DistributedOptimizer.{where}",
            lambda: f"{what} in step {self.steps} (optimizer.steps, from 0)",
        )
        closer = every[-1] - 1
        return [bool(f) for f in every[:-1]], None if closer < 0 else closer

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
            stacklevel=user_stacklevel(),
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
            self._start_buckets()  # here, not in _synchronize: one frame less to MPI
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
        """Restore ``state_dict()`` (this rank's): all of it, or, where any part is
        refused (a damaged residual, another optimizer's state), none of it."""
        state = dict(state_dict)
        ours = state.pop("mpicomp", None)
        if ours is None:
            self.optimizer.load_state_dict(state)
            return
        try:
            steps = int(ours["steps"])
            comm = {
                "step": int(ours["comm_step"]),
                "residuals": dict(ours["residuals"]),
                "server_residuals": dict(ours["server_residuals"]),
            }
        except KeyError as e:
            raise ValueError(
                f"this state_dict's 'mpicomp' entry has no {e.args[0]!r}: load what "
                "DistributedOptimizer.state_dict() gave, whole"
            ) from None
        before = self.comm.state_dict()
        self.comm.load_state_dict(comm)  # checks all of it first: a refusal changes nothing
        try:
            self.optimizer.load_state_dict(state)
        except BaseException:
            self.comm.load_state_dict(before)
            raise
        self.steps = steps

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
            release_names(self.comm, self)
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


def _changed_since(grad, sent) -> bool:
    """Whether ``grad`` (a parameter's gradient now) is not what a bucket copied:
    ``sent`` is (that gradient, its version counter), or None where there was none."""
    if sent is None:
        return grad is not None
    return grad is not sent[0] or grad._version != sent[1]


def _tensors(arrays: dict) -> dict:
    """Return residual arrays (NumPy or CuPy) as torch tensors (no copy)."""
    return {k: torch.from_dlpack(v) for k, v in arrays.items()}
