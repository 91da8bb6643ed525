"""What ``DistributedOptimizer`` and ``ZeroOptimizer`` share: trainable parameters in
buckets (one float32 buffer of gradients and one collective call each), started in
order from the gradient hooks as backward fills them, the step's agreement over a
control communicator of their own (with a slot by which a rank that closes instead of
stepping tells the others), and the checkpoint's mpicomp entry.

A subclass says what a bucket's call is (``_start_call``: an allreduce, a
reduce-scatter), how a bucket is made (``_bucket``) and what its step does with the
outcomes; everything about when calls start, what they were sent and how a step
that is left is dropped lives here once.
"""

from __future__ import annotations

import threading
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from mpicomp._log import log
from mpicomp.call.config import Config, check_same
from mpicomp.call.worker import user_stacklevel
from mpicomp.collectives._wait import dup, resolve_timeout
from mpicomp.comm import CompressedComm
from mpicomp.errors import NonFiniteWarning, PeerClosed
from mpicomp.torch.parameters import LAYOUT, layout_differences
from mpicomp.torch.shared import (
    Failed,
    Staging,
    agree,
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

#: The least scale, as a fraction of its bucket's mean (``_freeze_scales``).
SCALE_FLOOR = 1e-2

__all__ = ["Bucket", "BucketedOptimizer", "agree_on_arguments", "check_schedule"]


@dataclass
class Bucket:
    """Parameters reduced by one collective call: their gradients end to end in
    ``grads`` (float32, on their device, or pinned host memory when staged)."""

    index: int
    group: int  # the parameter group it belongs to (buckets never span two)
    names: list[str]
    params: list[torch.Tensor]
    offsets: list[int]
    grads: torch.Tensor
    layout: int  # crc32 of names and sizes: ranks with other buckets raise
    ready: int = 0  # parameters whose gradients are complete this step
    handle: object = None
    has_grad: list[bool] = field(default_factory=list)
    # Each gradient as copied into grads, with its version counter (None: no gradient):
    # a change after the copy is one the step does not see.
    sent: list = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def parts(self):
        """(parameter, its slice of ``grads``) for each parameter, in order."""
        for p, lo, hi in zip(self.params, self.offsets, self.offsets[1:], strict=False):
            yield p, self.grads[lo:hi]


def agree_on_arguments(comm, what: str, settings, layout: str, parameters, error, timeout):
    """Raise on every rank if one refused its arguments (``error``), or ranks differ in
    ``settings`` (a dict; None where refused) or in their parameters (``layout``, from
    ``describe_layout``: each one that differs is named). One small allgather, under
    the CompressedComm's ``timeout`` (the one it will have), before anything else."""
    config = None
    if error is None:
        digest = f"{zlib.crc32(layout.encode()):08x}"
        config = Config({**settings, "parameters": len(parameters), LAYOUT: digest})
    check_same(
        quiet(comm),
        config,
        error,
        f"this {what}",
        timeout,
        differences=partial(layout_differences, mpi_of(comm), config, parameters),
    )


def check_schedule(overlap, backward_passes_per_step) -> int:
    """Check the two arguments every bucketed optimizer takes; return the count."""
    if not isinstance(overlap, bool | int) or overlap not in (0, 1):
        raise TypeError(f"overlap must be True or False, got {kind(overlap)}")
    return count("backward_passes_per_step", backward_passes_per_step, 1)


class BucketedOptimizer(torch.optim.Optimizer):
    """The scaffolding of an optimizer that reduces its gradients in buckets through a
    ``CompressedComm`` (see the module's docstring). Not made directly."""

    #: The class's name in messages ("DistributedOptimizer").
    what = "BucketedOptimizer"
    #: What a gradient changed after its bucket was sent comes to: (the warning's
    #: class, its text after "changed after they were sent for averaging").
    changed_warning: tuple[type[Warning], str]

    # -- construction: _open, then _make_buckets (agreed), then _adopt ----------------

    def _open(self, comm, codec, options: dict, overlap, backward_passes_per_step) -> None:
        """Make (or take) the CompressedComm and this optimizer's control communicator;
        collective: after the arguments were agreed on every rank."""
        self._hooks = []  # first: close() reads them, also after a failure below
        self._control = None
        self._closed_why = "close() was called"  # told by a step() after close()
        self._owns_comm = not isinstance(comm, CompressedComm)
        self.comm = compressed(comm, codec, options)  # collective: raises on every rank
        #: What this optimizer's call names begin with: "" for the first optimizer open
        #: on its CompressedComm, "optimizer1." for a second (residuals are per name).
        self.names = claim_names(self.comm, self)
        # The optimizer's own agreements go through a communicator of their own: the
        # CompressedComm's may be busy with this step's calls on its worker thread.
        self._control = dup(
            mpi_of(self.comm), timeout=resolve_timeout(self.comm.options.timeout), name=self.what
        )
        self.overlap = bool(overlap)
        self.backward_passes_per_step = backward_passes_per_step
        #: Steps taken (skipped ones included): the same on every rank.
        self.steps = 0
        #: Whether the last ``step()`` skipped the optimizer's step (NaN/Inf).
        self.skipped = False
        self._staging = Staging(f"mpicomp.torch.{self.what}")
        self._buckets: list[Bucket] = []
        self._next = 0  # the next bucket to start: buckets start in order on every rank
        self._snapshots: list = []  # residual snapshots of this step's calls
        self._synchronized = False  # this step's outcomes are taken (DistributedOptimizer)
        # The step and the gradients changed after they were sent, warned after the step.
        self._changed: tuple[int, list[str]] = (0, [])
        # Autograd may run hooks on one thread per device: buckets start one at a time.
        self._lock = threading.Lock()
        #: The compressed-Adam mode's update (``adam_warmup``), or None; and, once its
        #: second moment is frozen, what divides each bucket's gradients before the
        #: codec and multiplies their averages after it (``_freeze_scales``).
        self._adam = None
        self._scales: list[torch.Tensor] | None = None

    def _agree_built(self, error: Exception | None) -> None:
        """Raise on every rank if making the buckets (or more) failed on one; closed then."""
        try:
            agree(self._control, error, self.what, self.comm.options.timeout)
        except BaseException:
            self.close()
            raise

    def _adopt(self, inner: torch.optim.Optimizer) -> None:
        """Take ``inner``'s parameter groups and state as this optimizer's own objects
        (learning-rate schedulers work on either), and hook the gradients."""
        self._building = True
        # The parent's bookkeeping (hooks, profiling) over the inner groups.
        super().__init__(inner.param_groups, inner.defaults)
        self.param_groups = inner.param_groups
        self.state = inner.state
        self._building = False
        self._owner = {p: b for b in self._buckets for p in b.params}
        self._passes = dict.fromkeys(self._owner, 0)
        log.info(
            "%s: %d buckets of %s values, overlap %s",
            self.what,
            len(self._buckets),
            [b.numel for b in self._buckets],
            self.overlap,
        )
        if self.overlap:
            for b in self._buckets:
                for p in b.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._start_buckets))

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_building", False):
            return super().add_param_group(param_group)
        raise RuntimeError(
            f"{self.what}: give every parameter group before wrapping (every rank's "
            "buckets are fixed when it is made)"
        )

    # -- the buckets -------------------------------------------------------------------

    @property
    def buckets(self) -> tuple[tuple[str, ...], ...]:
        """The names of each bucket's parameters, in the order the buckets start: the
        trainable parameters in reverse order, a new bucket where ``bucket_numel`` would
        be passed or the parameter group, device or dtype changes. One collective call
        per bucket and step; the same on every rank."""
        return tuple(tuple(b.names) for b in self._buckets)

    def _make_buckets(self, groups: list[list[tuple[str, torch.Tensor]]]) -> list[Bucket]:
        """Group the trainable parameters of ``groups`` ((name, tensor) pairs per
        parameter group), in reverse order, into buckets of at most ``bucket_numel``
        elements, one group, device and dtype each."""
        limit = self.comm.options.bucket_numel
        buckets: list[Bucket] = []
        run: list[tuple[str, torch.Tensor]] = []
        total, where = 0, None

        def close():
            nonlocal run, total
            if run:
                buckets.append(self._bucket(len(buckets), where[0], run))
            run, total = [], 0

        everything = [(g, n, p) for g, pairs in enumerate(groups) for n, p in pairs]
        for g, name, p in reversed(everything):
            if not p.requires_grad:
                continue
            here = (g, p.device, p.dtype)
            if run and (total + p.numel() > limit or here != where):
                close()
            where = here
            run.append((name, p))
            total += p.numel()
        close()
        return buckets

    def _bucket(self, index: int, group: int, run: list[tuple[str, torch.Tensor]]) -> Bucket:
        """Make bucket ``index`` of ``run`` ((name, tensor) pairs): the subclass's own."""
        return self._plain_bucket(index, group, run)

    def _plain_bucket(self, index: int, group: int, run: list) -> Bucket:
        names = [n for n, _ in run]
        params = [p for _, p in run]
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        device = params[0].device
        if cuda_staging(device):
            grads = self._staging.buffer(offsets[-1])
        else:
            grads = torch.empty(offsets[-1], dtype=torch.float32, device=device)
        label = ";".join(f"{n}:{p.numel()}" for n, p in run)
        return Bucket(index, group, names, params, offsets, grads, zlib.crc32(label.encode()))

    # -- during backward ---------------------------------------------------------------

    def _start_buckets(self, p: torch.Tensor | None = None) -> None:
        """Start the buckets that are due, in order, each call straight from here (the
        gradient's path to MPI: tests/test_mpi_architecture.py).

        The gradient hook (``p``: the parameter whose gradient was accumulated) counts
        the pass and starts the buckets that are full (a full bucket waits for those
        before it); ``step()`` and ``synchronize()`` (no ``p``) start every bucket not
        started yet, unless this step's outcomes are taken or the optimizer closed."""
        with self._lock:
            if p is not None:
                self._passes[p] += 1
                if self._passes[p] != self.backward_passes_per_step:
                    return
                self._owner[p].ready += 1
            elif self._synchronized or self._control is None:
                return  # nothing to start; the step says why where it must
            while self._next < len(self._buckets):
                b = self._buckets[self._next]
                if p is not None and b.ready < len(b.params):
                    break
                self._copy_in(b)
                try:
                    # the CompressedComm's method called here: no frame between (see above)
                    start, keywords = self._call_of(b)
                    b.handle = start(b.grads, f"{self.names}bucket{b.index}", **keywords)
                except RuntimeError:  # closed: by a peer whose close an earlier bucket met?
                    closed = peer_closed_in([x.handle for x in self._buckets[: b.index]])
                    if closed is None:
                        raise
                    b.handle = Failed(closed)  # the step raises it
                self._next = b.index + 1

    def _call_of(self, b: Bucket) -> tuple:
        """Return bucket ``b``'s call: the CompressedComm's method that starts it
        (``start``, ``start_scatter``) and its keywords."""
        raise NotImplementedError

    def _copy_in(self, b: Bucket) -> None:
        """Copy the bucket's gradients (zeros where none) into ``grads``, noting which
        exist and what each was (to see a change made after the copy)."""
        b.has_grad, b.sent = [], []
        with torch.no_grad():
            for p, part in b.parts():
                grad = p.grad
                if grad is None:
                    part.zero_()
                else:
                    part.copy_(grad.reshape(-1))
                b.has_grad.append(grad is not None)
                b.sent.append(None if grad is None else (grad, grad._version))
            if self._scales is not None:
                b.grads.div_(self._scales[b.index][: b.numel])

    # -- the compressed-Adam mode's scales ----------------------------------------------

    def _freeze_scales(self) -> None:
        """Once the second moment is frozen, make each bucket's scales: Adam's
        denominator ``sqrt(v / (1 - beta2**frozen_step)) + eps`` of its values, the same
        on every rank. Each rank then sends its gradient divided by them, so that the
        codec sees what the update will be (a sign, a top-k, a 3LC level is of the
        step each value takes, not of the gradient's own scale), and the average is
        multiplied back (mpicomp/torch/adam.py)."""
        if self._adam is None or self._scales is not None or not self._adam.frozen(self.steps):
            return
        self._scales = [self._scales_of(b) for b in self._buckets]
        # A value no warm-up gradient reached has v = 0 and a scale of eps: its first
        # gradient would come to the codec a hundred million times larger (past fp16's
        # range). Any positive scale keeps the mode exact; this one keeps it in range.
        for s in self._scales:
            if s.numel():
                s.clamp_(min=SCALE_FLOOR * float(s.mean()))

    def _scales_of(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s scales, on its gradients' device (1 where a parameter has no
        second moment)."""
        scales = torch.ones(b.numel, dtype=torch.float32, device=b.grads.device)
        found = self._adam.denominators(b.params)
        for lo, hi, d in zip(b.offsets, b.offsets[1:], found, strict=False):
            if d is not None:
                scales[lo:hi].copy_(d)
        return scales

    def _unscaled(self, b: Bucket, average: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """``average`` (of bucket ``b``'s values from ``lo`` on) multiplied back by the
        scales the gradients were divided by, if any."""
        if self._scales is None:
            return average
        scales = self._scales[b.index][lo : lo + average.numel()]
        return average * scales.to(average.device)

    # -- the step ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._control is None:
            raise RuntimeError(f"{self.what} is closed: {self._closed_why}")

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

    def _changed_since_sent(self) -> list[str]:
        """The parameters whose gradients changed after their bucket copied them
        (clipping before ``step()``, a GradScaler's unscale_, another backward pass)."""
        return [
            n
            for b in self._buckets
            for n, p, sent in zip(b.names, b.params, b.sent, strict=True)
            if _changed_since(p.grad, sent)
        ]

    def _warn_changed(self) -> None:
        """Warn of the gradients ``_changed`` names (``_changed_since_sent``), once.
        Warned after the step: under -W error it raises on the ranks whose gradients
        changed only, which must still step."""
        (step, changed), self._changed = self._changed, (0, [])
        if not changed:
            return
        shown = ", ".join(map(repr, changed[:3]))
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        category, consequence = self.changed_warning
        warnings.warn(
            f"{self.what} step {step}: the gradients of {shown}{more} changed after they "
            f"were sent for averaging {consequence}",
            category,
            stacklevel=user_stacklevel(),
        )

    def _reset_passes(self) -> None:
        for p in self._passes:
            self._passes[p] = 0
        for b in self._buckets:
            b.ready, b.handle = 0, None
            b.sent = []  # holds gradients: let zero_grad() free them
        self._next = 0

    def _warn_skipped(self, skipped: list[str], step: int) -> None:
        warnings.warn(
            f"{'; '.join(skipped)}: optimizer step {step} skipped on every rank",
            NonFiniteWarning,
            stacklevel=user_stacklevel(),
        )

    def _max_over_ranks(self, flags: list[int], closing: bool, where: str, what):
        """Return (the max over the ranks of ``flags``, the rank that closed instead of
        stepping or None): one small Allreduce on the control communicator with a last
        slot for a closing rank; ``closing``: this rank's part in it is its close()."""
        every = max_over_ranks(
            self._control,
            [*map(int, flags), self._control.rank + 1 if closing else 0],
            self.comm.options.timeout,
            f"{self.what}.{'close' if closing else where}",
            what,
        )
        closer = every[-1] - 1
        return every[:-1], None if closer < 0 else closer

    def _peer_closed(self, closer: int, step: int) -> PeerClosed:
        """The error of a step whose gradients rank ``closer`` sent and then closed."""
        return PeerClosed(
            f"rank {closer} closed its {self.what} after sending the gradients of step "
            f"{step}, which this rank took; it is closed on this rank too"
        )

    def _step_flags(self) -> list[int]:
        """This rank's flags in the step's agreement (``_max_over_ranks``), which it also
        sends, beside its closing slot, when it closes instead of stepping."""
        raise NotImplementedError

    # -- checkpoints -------------------------------------------------------------------

    def _mpicomp_state(self) -> dict:
        """The checkpoint's ``"mpicomp"`` entry: the step counter, this rank's
        error-feedback residuals (as tensors: ``torch.load`` reads them with
        ``weights_only=True``) and the CompressedComm's step."""
        comm = self.comm.state_dict()
        return {
            "steps": self.steps,
            "comm_step": comm["step"],
            "residuals": _tensors(comm["residuals"]),
            "server_residuals": _tensors(comm["server_residuals"]),
        }

    def _comm_state(self, ours: Mapping) -> dict:
        """The CompressedComm's state in a checkpoint's ``"mpicomp"`` entry ``ours``."""
        return {
            "step": int(self._entry(ours, "comm_step")),
            "residuals": dict(self._entry(ours, "residuals")),
            "server_residuals": dict(self._entry(ours, "server_residuals")),
        }

    def _entry(self, ours: Mapping, key: str):
        """Return ``ours[key]``; a ValueError naming a missing key."""
        if key not in ours:
            raise ValueError(
                f"this state_dict's 'mpicomp' entry has no {key!r}: load what "
                f"{self.what}.state_dict() gave, whole"
            )
        return ours[key]

    # -- the end -----------------------------------------------------------------------

    def close(self) -> None:
        """Remove the gradient hooks, drop a step started and not taken (its residuals
        back), and release the communicators (the CompressedComm too when this optimizer
        made it). Safe twice.

        Like ``CompressedComm.close``, it takes part in what the other ranks' next step
        begins with: a rank still stepping raises ``PeerClosed`` instead of waiting for
        this one, also when this rank closes after backward, before its ``step()``."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._control is None:
            return
        try:
            if self._next and not self._synchronized:
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
        """Drop a step whose buckets were started and not taken (close() after
        backward). If every bucket went through on every rank, the other ranks' next
        message is that step's agreement: take part as the closing rank, so that they
        raise PeerClosed. Otherwise their next bucket call meets the CompressedComm's
        close, or they failed alike already."""
        sent_all = self._next == len(self._buckets)
        outcomes, error = self._wait_for_buckets()  # the step is dropped: its errors too
        snapshots, self._snapshots = self._snapshots, []
        self._reset_passes()
        if self.comm.closed:
            return
        self.comm.rollback(snapshots)  # the step is not taken
        if sent_all and error is None and not any(o.skipped for o in outcomes):
            self._max_over_ranks(
                self._step_flags(),
                closing=True,
                where="close",
                what=lambda: f"telling the other ranks that this rank closes in step {self.steps}",
            )

    def __repr__(self) -> str:
        inner = getattr(self, "optimizer", None)
        name = type(inner).__name__ if inner is not None else "?"
        return f"{self.what}({name}, codec={self.comm.codec!r}, buckets={len(self._buckets)})"


def _changed_since(grad, sent) -> bool:
    """Whether ``grad`` (a parameter's gradient now) is not what a bucket copied:
    ``sent`` is (that gradient, its version counter), or None where there was none."""
    if sent is None:
        return grad is not None
    return grad is not sent[0] or grad._version != sent[1]


def _tensors(arrays: dict) -> dict:
    """Return residual arrays (NumPy or CuPy) as torch tensors (no copy)."""
    return {k: torch.from_dlpack(v) for k, v in arrays.items()}
