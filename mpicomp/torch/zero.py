"""``ZeroOptimizer``: a ``torch.optim`` optimizer whose state is split over the ranks (ZeRO
stage 1, as torch's ``ZeroRedundancyOptimizer``), gradients arriving by a compressed
reduce-scatter and parameters returning by an allgather.

The trainable parameters go, in reverse order, into buckets; each bucket's parameters
become views of one flat buffer of ``size`` equal rows (``CompressedComm.reduce_scatter``'s
layout), and rank r's optimizer steps row r of every bucket only. Where the parameters
are float32 and come back in float32, that row of the model's own buffer is the
optimizer's parameter; otherwise a float32 master copy of the row is.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import partial

import numpy as np
import torch

from mpicomp.call.arguments import unknown_keywords
from mpicomp.call.options import OPTIONS
from mpicomp.codecs._base import codec_parameters
from mpicomp.codecs.arrays import FLOAT32_RANGE, result_range
from mpicomp.collectives._wait import issue, resolve_timeout
from mpicomp.comm import CompressedComm
from mpicomp.errors import PeerClosed
from mpicomp.reduction import kind_of
from mpicomp.reduction.rows import PRECISIONS
from mpicomp.torch.adam import FrozenAdam, check_adam, warn_untrained
from mpicomp.torch.buckets import Bucket, BucketedOptimizer, agree_on_arguments, check_schedule
from mpicomp.torch.parameters import (
    _pairs,
    check_unique,
    describe_layout,
)
from mpicomp.torch.shared import agree, check_comm, check_given, cuda_staging, kind

__all__ = ["GradientsIgnoredWarning", "ZeroOptimizer"]

#: The dtypes of parameters a ZeroOptimizer trains (its master rows are float32).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GradientsIgnoredWarning(UserWarning):
    """``ZeroOptimizer.step()`` averaged gradients as they were when their bucket was
    sent (during backward); they changed after that (clipped, scaled, or another
    backward pass without ``backward_passes_per_step``), and the change is not used."""


@dataclass(kw_only=True)
class _Rows(Bucket):
    """A bucket whose parameters are views of one flat buffer of ``size`` equal rows."""

    values: torch.Tensor  # size * width elements, the parameters' dtype: they are views
    shard: torch.Tensor  # float32 row of this rank: a view of values, or a master copy
    master: bool  # whether shard is a copy (then values hold what the allgather gave)
    staged: bool  # CUDA tensors through host memory (no CuPy)
    versions: list[int] = field(default_factory=list)  # the parameters' after the last write

    @property
    def width(self) -> int:
        return self.shard.numel()


class ZeroOptimizer(BucketedOptimizer):
    """Train with ``optimizer_class``, each rank of ``comm`` keeping 1/N of its state.

    Gradients are averaged by ``CompressedComm.reduce_scatter`` (compressed by
    ``codec``), each rank steps the rows it owns, and ``allgather`` gives every rank the
    updated parameters (the same bits on every rank).

    Args:
        named_parameters: ``model.named_parameters()`` ((name, tensor) pairs, or a dict
            of name -> tensor), or a list of parameter groups, dicts whose ``"params"``
            are such pairs and whose other keys are that group's hyperparameters
            (``[{"params": decay, "weight_decay": 0.1}, {"params": no_decay}]``). The
            order fixes the buckets (reverse order, as DDP). Parameters that do not
            require gradients are left alone.
        optimizer_class: a ``torch.optim.Optimizer`` class whose update is elementwise
            (SGD, Adam, AdamW, RMSprop, Adagrad...): it steps one flat row per bucket,
            so an optimizer that looks at whole tensors (LAMB's trust ratio, Adafactor's
            factored moments) would see other tensors than the parameters.
        comm: an ``mpi4py`` communicator (a ``CompressedComm`` is made over it from
            ``codec`` and the keywords it takes) or a ``CompressedComm``.
        codec: a codec name (``"none"``, ``"qsgd_maxnorm"``, ...) or a made codec, of a
            kind that has a reduce-scatter (every one but ``powersgd``).
        gather_precision: ``"float32"``, or ``"bfloat16"`` (half the allgather's bytes:
            the parameters come back rounded to bfloat16, float32 master rows stay).
        overlap: start each bucket's reduce-scatter from the gradient hooks, during
            backward; False starts them all in ``step()``.
        backward_passes_per_step: gradients accumulate over this many backward passes
            before they are averaged.
        adam_warmup: the compressed-Adam mode, for ``torch.optim.Adam``/``AdamW``
            (docs/training.md): the first ``adam_warmup`` steps reduce-scatter float32
            gradients and step the optimizer as it is; from then on the second moment
            is frozen and the gradients go through the codec (with its error feedback)
            into each rank's rows' momentum. None: the codec from the start.
        **keywords: ``CompressedComm`` options (``bucket_numel``, ``error_feedback``,
            ``nonfinite``, ...) and codec parameters (``bits=4``) go to the
            CompressedComm; the rest (``lr=1e-3``) to ``optimizer_class``.

    Each bucket's parameters become views of one buffer (as ``ZeroRedundancyOptimizer``'s
    ``parameters_as_bucket_view``): make the ZeroOptimizer after moving the model to its
    device and dtype. ``step()`` waits for the reduce-scatters, steps the inner
    optimizer (``optimizer``) on this rank's rows, allgathers every bucket and writes
    the parameters; ``p.grad`` keeps this rank's own gradient (the average exists only
    as rows), so clipping or scaling ``p.grad`` between backward and ``step()`` changes
    nothing (``GradientsIgnoredWarning`` says so). A parameter without a gradient
    counts as zeros (its momentum and weight decay still act, unlike an unsharded
    optimizer, which skips it). Parameters written between steps
    (``model.load_state_dict``, ``broadcast_parameters``, new ``.data`` of the same
    device and dtype) are what the next step starts from.

    ``param_groups`` and ``state`` are the inner optimizer's: one group per group given,
    whose ``"params"`` are this rank's rows (learning-rate schedulers work on either).
    ``state_bytes()`` counts this rank's optimizer memory.

    Under ``nonfinite="skip_step"`` a NaN/Inf in any rank's gradient skips the step on
    every rank (state, parameters and residuals untouched) with a ``NonFiniteWarning``;
    ``skipped`` tells it. A step that fails on any rank (a reduce-scatter, the inner optimizer's step, or
    the allgather: NaN/Inf in the stepped parameters) raises on every rank and moves
    nothing: each rank copies its rows and the inner optimizer's state before stepping
    (1/N of them, for as long as the step) and puts them back, with the residuals.

    Raises:
        TypeError, ValueError: an argument is wrong on this rank (RankError on the
            others, before anything else collective runs).
        RankError: ranks wrap other parameters (naming each one that differs, with its
            shape on every rank) or configure it differently.
    """

    what = "ZeroOptimizer"
    changed_warning = (
        GradientsIgnoredWarning,
        "during backward (clipped or scaled before step(), or another backward pass) and "
        "the change is not used: accumulate with backward_passes_per_step, or pass "
        "overlap=False",
    )

    def __init__(
        self,
        named_parameters,
        optimizer_class: type[torch.optim.Optimizer],
        comm,
        codec=None,
        *,
        gather_precision: str = PRECISIONS[0],
        overlap: bool = True,
        backward_passes_per_step: int = 1,
        adam_warmup: int | None = None,
        **keywords,
    ):
        check_comm(comm)
        error, named, comm_keywords, defaults = None, None, {}, {}
        try:
            if not (
                isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)
            ):
                raise TypeError(_not_a_class(optimizer_class))
            _check_steps_alone(optimizer_class)
            if gather_precision not in PRECISIONS:
                raise ValueError(
                    f"gather_precision must be one of {PRECISIONS}, got {gather_precision!r}"
                )
            backward_passes_per_step = check_schedule(overlap, backward_passes_per_step)
            check_adam(optimizer_class, adam_warmup)
            check_given(comm, codec, {k: v for k, v in keywords.items() if k in OPTIONS})
            groups = _groups(named_parameters)
            named = [(n, p) for _, pairs in groups for n, p in pairs]
            comm_keywords, defaults = _split(keywords, optimizer_class, comm, codec)
            trained = [(n, p) for n, p in named if p.requires_grad]
            if not trained:
                raise ValueError("named_parameters holds no parameter that requires a gradient")
            for n, p in trained:
                if p.dtype not in _DTYPES:
                    raise TypeError(
                        f"parameter {n!r} is {p.dtype}: a ZeroOptimizer trains float32, "
                        "bfloat16 and float16 parameters (its master rows are float32)"
                    )
            layout = "||".join(describe_layout(pairs) for _, pairs in groups)
            settings = {
                "optimizer_class": optimizer_class.__qualname__,
                "optimizer_arguments": repr(sorted(defaults.items())),
                "groups": [repr(sorted(o.items())) for o, _ in groups],
                "gather_precision": gather_precision,
                "overlap": bool(overlap),
                "backward_passes_per_step": backward_passes_per_step,
                "adam_warmup": adam_warmup,
            }
        except Exception as e:  # whatever it is, the other ranks must hear of it
            error, settings, layout = e, None, ""
        agree_on_arguments(
            comm, self.what, settings, layout, named or [], error,
            comm_keywords.get("timeout"),  # the CompressedComm's timeout= covers it too
        )  # fmt: skip
        #: The optimizer stepping this rank's rows (one parameter per bucket).
        self.optimizer = None
        self.gather_precision = gather_precision
        self._open(comm, codec, comm_keywords, overlap, backward_passes_per_step)
        error, inner = None, None
        try:  # allocates, and the optimizer checks its arguments: may fail on one rank
            _check_scatters(self.comm.codec)
            self._buckets = self._make_buckets([pairs for _, pairs in groups])
            inner = optimizer_class(
                [
                    {**options, "params": [b.shard for b in self._buckets if b.group == g]}
                    for g, (options, _) in enumerate(groups)
                ],
                **defaults,
            )
            if adam_warmup is not None:
                self._adam = FrozenAdam(inner, adam_warmup)
        except Exception as e:
            error = e
        self._agree_built(error)
        self.optimizer = inner
        self._adopt(inner)
        warn_untrained(self.comm.codec, inner, self._adam)

    def state_bytes(self) -> int:
        """Return the bytes of this rank's optimizer memory: the inner optimizer's state
        tensors (Adam's ``exp_avg``, ``exp_avg_sq`` and ``step`` of its rows) and the
        float32 master rows where the parameters are not float32 or come back in
        bfloat16 (none otherwise: the rows are views of the parameters); in the
        compressed-Adam mode past its warm-up, the scales of every bucket too (a
        float32 value per parameter value: ``adam_warmup``)."""
        state = sum(
            t.nbytes
            for s in self.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t)
        )
        scales = sum(s.nbytes for s in self._scales or [])
        return state + scales + sum(b.shard.nbytes for b in self._buckets if b.master)

    # -- the buckets ---------------------------------------------------------------

    def _bucket(self, index: int, group: int, run: list[tuple[str, torch.Tensor]]) -> _Rows:
        """Make one bucket: its parameters become views of its rows' buffer."""
        plain = self._plain_bucket(index, group, run)
        size, rank = self.comm.size, self.comm.rank
        width = -(-plain.numel // size)
        first = plain.params[0]
        values = torch.zeros(size * width, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, lo, hi in zip(plain.params, plain.offsets, plain.offsets[1:], strict=False):
                values[lo:hi].copy_(p.reshape(-1))
                p.data = values[lo:hi].view_as(p)
        row = values[rank * width : (rank + 1) * width]
        master = first.dtype != torch.float32 or self.gather_precision != PRECISIONS[0]
        return _Rows(
            **{f.name: getattr(plain, f.name) for f in fields(Bucket)},
            values=values,
            shard=row.float().clone() if master else row,
            master=master,
            staged=cuda_staging(first.device),
            versions=[p._version for p in plain.params],
        )

    # -- during backward -----------------------------------------------------------

    def _scales_of(self, b: _Rows) -> torch.Tensor:
        """The bucket's scales (``BucketedOptimizer._freeze_scales``): each rank holds its
        rows' second moment only, so they are allgathered once, as the second moment
        freezes (a float32 copy of the bucket per rank from then on)."""
        from mpi4py import MPI

        (mine,) = self._adam.denominators([b.shard])
        if mine is None:
            mine = torch.ones(b.width)
        mine = mine.detach().cpu().numpy().astype(np.float32)
        every = np.empty(self.comm.size * b.width, np.float32)
        issue(
            self._control, MPI.Comm.Allgather, MPI.Comm.Iallgather, mine, every,
            timeout=resolve_timeout(self.comm.options.timeout), name="ZeroOptimizer.step",
            detail=lambda: f"the second moment frozen in step {self.steps}, an Iallgather "
            f"of {mine.nbytes} bytes per rank",
        )  # fmt: skip
        return torch.from_numpy(every).to(b.grads.device)

    def _call_of(self, b: _Rows) -> tuple:
        compress = self._adam is None or self._adam.frozen(self.steps)
        return self.comm.start_scatter, dict(snapshots=self._snapshots, compress=compress)

    # -- the step --------------------------------------------------------------------

    def step(self, closure=None):
        """Average the gradients by reduce-scatter, step this rank's rows, allgather the
        parameters; unless a NaN/Inf skipped this step. Returns ``closure()``'s loss.

        Raises:
            RankError, ValueError, TypeError, ...: a reduce-scatter, the inner
                optimizer's step or an allgather failed on this rank or another. Every
                rank raises (its own error where it failed, RankError elsewhere) and
                no state moved on any rank: rows, the inner optimizer's state and the
                residuals are as before the step.
            PeerClosed: another rank closed instead of taking this step; closed here too.
            RuntimeError: this ZeroOptimizer is closed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        compressing_adam = self._adam is not None and self._adam.frozen(self.steps)
        try:
            self._start_buckets()
            rows, snapshots = self._wait_for_rows()
        finally:
            self.steps += 1
        if rows is not None:
            error, before = None, None
            try:
                self._adopt_changed_parameters()
                for b, row in zip(self._buckets, rows, strict=True):
                    row = self._unscaled(b, row, self.comm.rank * b.width)
                    b.shard.grad = row.to(b.shard.device) if b.staged else row
                before = self._rows_and_state()
                if compressing_adam:
                    self._adam.step()  # the rows' averages in .grad, the second moment frozen
                else:
                    self.optimizer.step()
                self._check_rows_fit()
            except Exception as e:  # every rank must hear of it before the allgather
                error = e
            finally:
                for b in self._buckets:
                    b.shard.grad = None
            try:
                self._agree_on_step(error)
                self._gather()
            except BaseException as e:
                # A step that fails anywhere moves nothing: rows, state, residuals.
                if before is not None:
                    self._restore(before)
                if not isinstance(e, PeerClosed) and not self.comm.closed:
                    self.comm.rollback(snapshots)
                raise
        self._freeze_scales()  # collective once, as the warm-up ends: every rank is here
        self._warn_changed()
        return loss

    def _check_rows_fit(self) -> None:
        """Refuse rows stepped past the range of their parameters' dtype (float16,
        bfloat16): the allgather would write Inf into the model."""
        for b in self._buckets:
            dtype = str(b.values.dtype).removeprefix("torch.")
            held = result_range(dtype)
            if held is FLOAT32_RANGE or not b.width:
                continue
            largest = float(b.shard.abs().max())
            if largest > held.limit:
                shown = ", ".join(map(repr, b.names[:3])) + (", ..." if len(b.names) > 3 else "")
                raise ValueError(
                    f"ZeroOptimizer: the step took parameters of bucket {b.index} ({shown}) "
                    f"past {dtype}'s range (|x| up to {largest:.6g}): lower the learning rate "
                    "or train in float32"
                )

    def _rows_and_state(self) -> tuple[list, dict]:
        """Return copies of this rank's rows and of the inner optimizer's state, for
        ``_restore`` (a step that fails on some rank is undone on every rank)."""
        rows = [b.shard.detach().clone() for b in self._buckets]
        state = {
            p: {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in s.items()}
            for p, s in self.optimizer.state.items()
        }
        return rows, state

    def _restore(self, before: tuple[list, dict]) -> None:
        """Put back what ``_rows_and_state`` copied."""
        rows, state = before
        with torch.no_grad():
            for b, row in zip(self._buckets, rows, strict=True):
                b.shard.copy_(row)
        self.optimizer.state.clear()
        self.optimizer.state.update(state)

    def _agree_on_step(self, error: Exception | None) -> None:
        """Raise on every rank if the step failed on some rank; PeerClosed (and close
        here too) if some rank closed after sending this step's gradients instead of
        stepping. One Allreduce of two int32, then the failed ranks' errors only when
        some rank failed."""
        step = self.steps - 1  # step() counted it already
        (failed,), closer = self._max_over_ranks(
            [error is not None],
            closing=False,
            where="step",
            what=lambda: (
                f"whether every rank stepped its rows in step {step} (optimizer.steps, from 0)"
            ),
        )
        if closer is not None:
            self.close()
            raise self._peer_closed(closer, step)
        if failed:
            agree(self._control, error, "ZeroOptimizer.step", self.comm.options.timeout)

    def _wait_for_rows(self) -> tuple[list | None, list]:
        """Wait for this step's reduce-scatters; return their rows (None when the step
        is skipped: NaN/Inf under ``skip_step``, warned) and what rolls their residuals
        back."""
        outcomes, error = self._wait_for_buckets()
        snapshots, self._snapshots = self._snapshots, []
        self._changed = (self.steps, self._changed_since_sent())
        self._reset_passes()
        skipped = [m for o in outcomes for m in o.skipped]
        if error is not None or skipped:
            self.comm.rollback(snapshots)  # no residual moves in a step that does not happen
        if isinstance(error, PeerClosed):
            self.close()  # as the CompressedComm is: a later step() raises RuntimeError
        if error is not None:
            raise error
        self.skipped = bool(skipped)
        if skipped:
            self._warn_skipped(skipped, self.steps)
            return None, snapshots
        return [o.average for o in outcomes], snapshots

    def _adopt_changed_parameters(self) -> None:
        """Take in what changed the parameters since the last step: a parameter written
        in place (its master row is read again), or given new storage of the same
        device and dtype (copied into its bucket, a view again)."""
        with torch.no_grad():
            for b in self._buckets:
                changed = False
                for i, (n, p) in enumerate(zip(b.names, b.params, strict=True)):
                    lo, hi = b.offsets[i], b.offsets[i + 1]
                    if p.untyped_storage().data_ptr() != b.values.untyped_storage().data_ptr():
                        if p.device != b.values.device or p.dtype != b.values.dtype:
                            raise RuntimeError(
                                f"ZeroOptimizer: parameter {n!r} moved to {p.device}, "
                                f"{p.dtype} after it was made (on {b.values.device}, "
                                f"{b.values.dtype}): make the ZeroOptimizer after the model "
                                "has its device and dtype"
                            )
                        b.values[lo:hi].copy_(p.reshape(-1))
                        p.data = b.values[lo:hi].view_as(p)
                        changed = True
                    elif p._version != b.versions[i]:
                        changed = True
                if changed and b.master:
                    rank, width = self.comm.rank, b.width
                    b.shard.copy_(b.values[rank * width : (rank + 1) * width])
                if changed:
                    b.versions = [p._version for p in b.params]

    def _gather(self) -> None:
        """Allgather every bucket's rows and write them into the parameters, once every
        allgather succeeded (every rank, the owner too, takes the gathered bits)."""
        cc = self.comm  # "cc": its allgather is mpicomp's, not an MPI call
        handles = [
            cc.iallgather(
                b.shard.cpu() if b.staged else b.shard,
                f"{self.names}bucket{b.index}",
                numel=b.numel,
                precision=self.gather_precision,
            )
            for b in self._buckets
        ]
        gathered, error = [], None
        for h in handles:
            try:
                gathered.append(h.wait())
            except Exception as e:
                error = error or e
        if error is not None:
            if isinstance(error, PeerClosed):
                self.close()
            raise error
        with torch.no_grad():
            for b, flat in zip(self._buckets, gathered, strict=True):
                b.values[: b.numel].copy_(flat)
                b.versions = [p._version for p in b.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model parameters' gradients (``None``, or zeros in place)."""
        for b in self._buckets:
            for p in b.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's part: the inner optimizer's state of its rows, the master rows,
        the error-feedback residuals and the step counter (tensors: ``torch.load``
        reads them with ``weights_only=True``). Save one file per rank."""
        state = self.optimizer.state_dict()
        state["mpicomp"] = {
            **self._mpicomp_state(),
            "rank": self.comm.rank,
            "size": self.comm.size,
            "masters": {b.index: b.shard.detach().clone() for b in self._buckets if b.master},
        }
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore this rank's ``state_dict()`` (saved by the same rank of as many ranks).
        Collective: every rank loads its own; one that cannot raises, the others
        RankError, and no rank's state changes. Load the model's parameters first:
        parameters written after this replace the master rows."""
        error, before = None, None
        try:
            if not isinstance(state_dict, Mapping):
                raise TypeError(f"state_dict must be a dict, got {kind(state_dict)}")
            state = dict(state_dict)
            ours = state.pop("mpicomp", None)
            if not isinstance(ours, Mapping):
                raise ValueError(
                    "not a ZeroOptimizer's state_dict (no 'mpicomp' entry): each rank "
                    "loads what its own ZeroOptimizer.state_dict() gave"
                )
            entry = partial(self._entry, ours)
            where = (int(entry("rank")), int(entry("size")))
            if where != (self.comm.rank, self.comm.size):
                raise ValueError(
                    f"this state_dict is rank {where[0]}'s of {where[1]} ranks; this is rank "
                    f"{self.comm.rank} of {self.comm.size}: each rank loads its own rows"
                )
            masters = {int(k): v for k, v in entry("masters").items()}
            wanted = {b.index for b in self._buckets if b.master}
            if set(masters) != wanted:
                raise ValueError(
                    f"this state_dict has master rows for buckets {sorted(masters)}, this "
                    f"ZeroOptimizer for {sorted(wanted)} (another gather_precision or dtype)"
                )
            for b in self._buckets:
                if b.master and tuple(masters[b.index].shape) != tuple(b.shard.shape):
                    raise ValueError(
                        f"master row of bucket {b.index}: shape "
                        f"{tuple(masters[b.index].shape)}, this ZeroOptimizer's "
                        f"{tuple(b.shard.shape)}"
                    )
            comm = self._comm_state(ours)
            steps = int(entry("steps"))
            before = (copy.deepcopy(self.optimizer.state_dict()), self.comm.state_dict())
            self.comm.load_state_dict(comm)  # checks all of it first: a refusal changes nothing
            self.optimizer.load_state_dict(state)
        except Exception as e:
            error = e
        try:
            agree(
                self._control, error, "ZeroOptimizer.load_state_dict",
                self.comm.options.timeout,
            )  # fmt: skip
        except BaseException:
            if before is not None:  # loaded here, refused elsewhere: back as it was
                self.optimizer.load_state_dict(before[0])
                self.comm.load_state_dict(before[1])
                self.param_groups = self.optimizer.param_groups
                self.state = self.optimizer.state
            raise
        # torch's load_state_dict makes new groups and state: schedulers edit these
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        with torch.no_grad():
            for b in self._buckets:
                if b.master:
                    b.shard.copy_(masters[b.index])
                # The parameters as they are now go with these rows (a model loaded
                # before is not read into them again).
                b.versions = [p._version for p in b.params]
        self.steps = steps
        self._scales = None  # of the loaded second moment, if frozen (every rank loaded)
        self._freeze_scales()

    def _step_flags(self) -> list[int]:
        return [0]  # _agree_on_step's "this rank failed"

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, rank {self.comm.rank} of {self.comm.size})"


# -- arguments -----------------------------------------------------------------------


def _not_a_class(value) -> str:
    hint = ""
    if isinstance(value, torch.optim.Optimizer):
        hint = (
            f" (an optimizer: pass its class, {type(value).__name__}, and its arguments as "
            "keywords, lr=...)"
        )
    return (
        "optimizer_class must be a torch.optim.Optimizer class such as torch.optim.Adam, "
        f"got {kind(value)}{hint}"
    )


def _check_steps_alone(optimizer_class) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (LBFGS): it re-evaluates the
    whole model's loss, which a rank stepping its rows alone cannot."""
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"{optimizer_class.__name__}.step needs a closure (it evaluates the loss again "
            "during its step): a ZeroOptimizer steps each rank's rows alone; use an "
            "elementwise optimizer (SGD, Adam, AdamW, ...)"
        )


def _groups(named_parameters) -> list[tuple[dict, list[tuple[str, torch.Tensor]]]]:
    """Return [(group options, (name, tensor) pairs)] of ``named_parameters``: pairs, a
    dict, or a list of parameter-group dicts; each name and tensor once."""
    items = named_parameters
    if isinstance(items, list | tuple) and items and all(isinstance(g, Mapping) for g in items):
        groups = []
        for i, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"parameter group {i} has no 'params'")
            options = {k: v for k, v in g.items() if k != "params"}
            groups.append((options, _pairs(g["params"])))
    else:
        groups = [({}, _pairs(items))]
    check_unique([pair for _, pairs in groups for pair in pairs])
    return groups


def _check_scatters(codec) -> None:
    """Refuse a codec whose kind has no reduce-scatter (``powersgd``)."""
    if next(iter(kind_of(codec).schedules.values())).scatter is None:
        raise ValueError(
            f"codec {codec.name!r} has no reduce-scatter (its aggregation needs every "
            "rank's whole tensor): use it with DistributedOptimizer, or give ZeroOptimizer "
            "a codec of another kind (docs/sharded.md)"
        )


def _split(keywords: dict, optimizer_class, comm, codec) -> tuple[dict, dict]:
    """Return ``keywords`` as (the CompressedComm's: options and codec parameters, the
    optimizer's); a TypeError for a keyword both take, or neither."""
    try:
        signature = inspect.signature(optimizer_class).parameters
    except (TypeError, ValueError):  # no signature to read: it gets the rest
        signature = {"": inspect.Parameter("_", inspect.Parameter.VAR_KEYWORD)}
    anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    # Its first argument is the parameters, given by the ZeroOptimizer.
    takes = [
        n
        for i, (n, p) in enumerate(signature.items())
        if i > 0 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    mine: set[str] = set()
    if not isinstance(comm, CompressedComm):
        mine = set(OPTIONS) | set(codec_parameters(codec if isinstance(codec, str) else ""))
    both = [k for k in keywords if k in mine and k in takes]
    if both:
        raise TypeError(
            f"keyword(s) {', '.join(map(repr, both))} are taken by the CompressedComm and "
            f"by {optimizer_class.__name__}: they go to the CompressedComm; give the "
            "optimizer's in a parameter group ([{'params': model.named_parameters(), ...}])"
        )
    unknown = [k for k in keywords if k not in mine and k not in takes and not anything]
    if unknown:
        name = optimizer_class.__name__
        raise TypeError(unknown_keywords(unknown, codec, "ZeroOptimizer", (name, takes)))
    return (
        {k: v for k, v in keywords.items() if k in mine},
        {k: v for k, v in keywords.items() if k not in mine},
    )
