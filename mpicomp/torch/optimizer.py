"""``DistributedOptimizer``: any ``torch.optim`` optimizer whose gradients are averaged
over the ranks through a ``CompressedComm`` while backward still runs.

Its trainable parameters go, in reverse order, into buckets (one float32 buffer and one
collective call each); a gradient hook starts each bucket's call as soon as all its
gradients are accumulated, and ``step()`` waits, writes the averages into ``p.grad``
and steps the wrapped optimizer. Which parameters it wraps, and how ranks that wrap
others are told apart, is ``mpicomp/torch/parameters.py``.
"""

from __future__ import annotations

import torch

from mpicomp.errors import PeerClosed
from mpicomp.torch.adam import FrozenAdam, check_adam, warn_untrained
from mpicomp.torch.buckets import Bucket, BucketedOptimizer, agree_on_arguments, check_schedule
from mpicomp.torch.parameters import describe_layout, named
from mpicomp.torch.shared import check_comm, check_given, count, kind

__all__ = ["DistributedOptimizer", "GradientsOverwrittenWarning"]


class GradientsOverwrittenWarning(UserWarning):
    """``DistributedOptimizer.step()`` (or ``synchronize()``) is overwriting gradients
    that changed after their bucket was sent for averaging (clipped or scaled without
    ``synchronize()`` first, or another backward pass): the change is lost."""


class DistributedOptimizer(BucketedOptimizer):
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
        adam_warmup: the compressed-Adam mode, for ``torch.optim.Adam``/``AdamW``
            (docs/training.md): the first ``adam_warmup`` steps average float32
            gradients and step the optimizer as it is; from then on Adam's second
            moment is frozen and the gradients are averaged through the codec (with
            its error feedback) into Adam's momentum. None (the default): the codec
            averages the gradients from ``start_step`` on, for any optimizer.
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

    what = "DistributedOptimizer"
    changed_warning = (
        GradientsOverwrittenWarning,
        "(clipped or scaled before step() without synchronize(), or another backward "
        "pass) and are overwritten now with the averages of the gradients as sent, "
        "undoing the change: call optimizer.synchronize() first, then clip or scale, "
        "then step()",
    )

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
        adam_warmup: int | None = None,
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
            backward_passes_per_step = check_schedule(overlap, backward_passes_per_step)
            start_step = count("start_step", start_step, 0)
            adam = None
            if check_adam(type(optimizer), adam_warmup) is not None:
                if start_step:
                    raise ValueError(
                        "start_step and adam_warmup both set the uncompressed steps at the "
                        "start: give adam_warmup alone"
                    )
                start_step, adam = adam_warmup, FrozenAdam(optimizer, adam_warmup)
            parameters = named(optimizer, named_parameters)
            settings = {
                "optimizer": type(optimizer).__qualname__,
                "backward_passes_per_step": backward_passes_per_step,
                "start_step": start_step,
                "adam_warmup": adam_warmup,
                "overlap": bool(overlap),
            }
        except Exception as e:  # whatever it is, the other ranks must hear of it
            error, settings = e, None
        # The CompressedComm made below checks its own options the same way; its
        # timeout= covers this check too.
        agree_on_arguments(
            comm, self.what, settings, describe_layout(parameters or []), parameters or [],
            error, options.get("timeout"),
        )  # fmt: skip
        self.optimizer = optimizer
        self._open(comm, codec, options, overlap, backward_passes_per_step)
        self.start_step = start_step
        self._adam = adam
        error = None
        try:
            self._buckets = self._make_buckets([parameters])  # allocates: may fail on one rank
        except Exception as e:
            error = e
        self._agree_built(error)
        self._adopt(optimizer)
        warn_untrained(self.comm.codec, optimizer, adam)

    # -- during backward ---------------------------------------------------------

    def _call_of(self, b: Bucket) -> tuple:
        return self.comm.start, dict(
            layout=b.layout,
            snapshots=self._snapshots,
            compress=self.steps >= self.start_step,
            shapes=[tuple(q.shape) for q in b.params],
            result_dtype=b.params[0].dtype,  # float16 gradients: their range
        )

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
        self._warn_changed()

    def _synchronize(self) -> None:
        """Wait for this step's bucket calls (every one started: ``_start_buckets``),
        agree on which gradients exist, and write the averages."""
        if self._synchronized:
            return
        self._check_open()
        # The bucket calls first: their agreement raises PeerClosed where a rank closed
        # (and any failure on every rank), so the exchange below runs only when every
        # rank made this step's calls, and every rank then makes it (or close() does).
        outcomes, error = self._wait_for_buckets()
        changed = self._changed_since_sent()
        snapshots, self._snapshots = self._snapshots, []
        self._reset_passes()
        skipped = [m for o in outcomes for m in o.skipped]
        if error is None and not skipped and self._buckets:
            flags, closer = self._max_over_ranks(
                self._step_flags(),
                closing=False,
                where="synchronize",
                what=lambda: (
                    f"which parameters have gradients in step {self.steps} "
                    "(optimizer.steps, from 0)"
                ),
            )
            if closer is not None:
                error = self._peer_closed(closer, self.steps)
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
            self._warn_skipped(skipped, self.steps)
            return
        self._changed = (self.steps, changed)  # warned after the step or the writing
        with torch.no_grad():
            i = 0
            for b, (avg, _) in zip(self._buckets, outcomes, strict=True):
                avg = self._unscaled(b, avg)
                for p, lo, hi in zip(b.params, b.offsets, b.offsets[1:], strict=False):
                    if flags[i]:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        p.grad.copy_(avg[lo:hi].view_as(p))
                    i += 1

    def _step_flags(self) -> list[int]:
        """Per parameter in bucket order, whether it has a gradient here: the max over
        the ranks says which to write (one unused everywhere keeps ``grad = None``)."""
        return [h for b in self._buckets for h in b.has_grad]

    def step(self, closure=None):
        """Average the gradients (``synchronize``), then step the wrapped optimizer,
        unless a NaN/Inf skipped this step. Returns ``closure()``'s loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing_adam = self._adam is not None and self._adam.frozen(self.steps)
        try:
            self._start_buckets()  # here, not in _synchronize: one frame less to MPI
            self._synchronize()
        finally:
            self._synchronized = False
            self.steps += 1
        if self.skipped:
            pass
        elif compressing_adam:
            self._adam.step()  # the averages in p.grad, the second moment frozen
        else:
            self.optimizer.step()
        self._freeze_scales()
        self._warn_changed()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state, plus mpicomp's: this rank's error-feedback
        residuals and the step counter (as tensors: ``torch.load`` reads them with
        ``weights_only=True``)."""
        state = self.optimizer.state_dict()
        state["mpicomp"] = self._mpicomp_state()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore ``state_dict()`` (this rank's): all of it, or, where any part is
        refused (a damaged residual, another optimizer's state), none of it."""
        state = dict(state_dict)
        ours = state.pop("mpicomp", None)
        if ours is None:
            self.optimizer.load_state_dict(state)
            return
        steps = int(self._entry(ours, "steps"))
        comm = self._comm_state(ours)
        before = self.comm.state_dict()
        self.comm.load_state_dict(comm)  # checks all of it first: a refusal changes nothing
        try:
            self.optimizer.load_state_dict(state)
        except BaseException:
            self.comm.load_state_dict(before)
            raise
        self.steps = steps
        self._scales = None
        self._freeze_scales()
