"""CompressedComm: the one call a training loop makes instead of its all-reduce.

This module is the façade: lifetime and the call itself. What the arguments resolve to
is ``mpicomp.call.arguments``; where started calls run, ``mpicomp.call.worker``; what a call
takes in, ``mpicomp.call.intake``; where the ranks are and what a call runs,
``mpicomp.call.placement``; what is kept per tensor across calls, ``mpicomp.reduction.residuals``;
how the bytes move, ``mpicomp.reduction`` (docs/architecture.md).
"""

from __future__ import annotations

import math
import operator
import threading
import warnings
from dataclasses import replace
from functools import partial, wraps
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from mpicomp._log import log
from mpicomp.call import options, threads
from mpicomp.call.arguments import resolve as resolve_arguments
from mpicomp.call.arguments import split as split_keywords
from mpicomp.call.arguments import trace_attrs
from mpicomp.call.config import check_same
from mpicomp.call.intake import Gpu, Tensor, buckets, take, take_many
from mpicomp.call.options import Options
from mpicomp.call.placement import Planner, place
from mpicomp.call.same_call import CLOSING, check_same_call
from mpicomp.call.worker import Handle, Runner, Turns, user_stacklevel
from mpicomp.codecs import Codec
from mpicomp.codecs._base import make as make_codec
from mpicomp.codecs.arrays import array_module
from mpicomp.collectives._wait import Timeout, dup, resolve_timeout
from mpicomp.errors import NonFiniteWarning, PeerClosed, RankError
from mpicomp.kernels.readback import batch
from mpicomp.model.cost import Topology
from mpicomp.reduction import kind_of
from mpicomp.reduction.agreement import (
    Call,
    Guard,
    Skipped,
    agree,
    agree_close,
    check_average,
    describe,
    fail,
)
from mpicomp.reduction.residuals import NO_RESIDUALS, Encoding, check_state, rollback
from mpicomp.reduction.rows import PRECISIONS
from mpicomp.reduction.rows import allgather as allgather_rows

__all__ = ["CompressedComm", "Handle", "NonFiniteWarning", "Options", "Outcome", "RankError"]

#: What ``reduce_scatter`` gives each rank of the rows' sum: their average, or the sum.
_REDUCE_OPS = ("mean", "sum")


class Outcome(NamedTuple):
    """What a call started by ``CompressedComm.start`` gives its handle's ``wait()``:
    the ``average`` (zeros when skipped) and the ``skipped`` messages (empty unless
    ``nonfinite="skip_step"`` skipped the call on every rank; nothing is warned)."""

    average: object
    skipped: list


def _one_thread(method):
    """Make ``method`` wait for the call of this CompressedComm that another thread is in:
    two threads' calls would interleave their messages (wrong sums, then MPI's fatal
    errors), and a refusal on some ranks only would split the ranks' call sequences.
    Calls run one at a time, in the order their threads entered. Where waiting could
    never end it raises at once: a thread already inside a call (a callback calling back)
    or the background worker (which blocking calls and ``close`` wait for)."""

    @wraps(method)
    def entered(self, *args, **kwargs):
        if self._turns.holder is threading.current_thread():
            raise RuntimeError(
                f"CompressedComm.{method.__name__} called from inside a call of this "
                "CompressedComm in the same thread (a callback: on_call, or a handle's done "
                "callback run at once), which would wait for itself: call it after that "
                "call returns"
            )
        if self._runner.runs_here():
            raise RuntimeError(
                f"CompressedComm.{method.__name__} called from the background thread that "
                "runs this CompressedComm's started calls (a handle's done callback, or "
                "on_call of a started call), which would wait for itself: call it from "
                "another thread, after handle.wait()"
            )
        self._turns.enter()
        try:
            threads.apply()  # numba's thread count is per thread: cap this one's
            return method(self, *args, **kwargs)
        finally:
            self._turns.leave()

    return entered


class _Step:
    """What puts a CompressedComm's step back where it was before a call (in a list of
    snapshots, for ``rollback``): a step not taken draws no random numbers."""

    def __init__(self, owner, step: int):
        self._owner, self._step = owner, step

    def restore(self) -> None:
        self._owner._calls = self._step


class CompressedComm:
    """Average gradients over the ranks of ``comm`` through a compressing codec.

    {options}

    Every rank must make the same calls in the same order with tensors of the same
    sizes (as with any MPI collective); sizes that differ, or a NaN/Inf on one rank,
    raise an error on every rank instead of hanging. ``iallreduce`` calls count in
    the order they are started. Several threads may call it: a call waits for the one
    in progress, so calls run one at a time in the order their threads entered, and
    that order must be the same on every rank (where it is not, the call's agreement
    raises ``RankError`` on every rank if the calls' names or sizes differ). A callback
    calling the CompressedComm from inside a call, or from the background thread of
    started calls, gets a ``RuntimeError`` at once (it would wait for itself).

    Every rank must configure it alike: the codec, its parameters and the options that
    change the messages are compared once here, collectively, and by digest in every
    call's agreement (docs/usage.md, "API").

    Raises:
        TypeError: ``comm`` is not an intracommunicator (on this rank alone); an
            argument of the wrong type, or a keyword neither an option nor a codec
            parameter.
        ValueError: an argument out of range; ``background=True`` while MPI provides
            less than ``MPI_THREAD_MULTIPLE``.
        RankError: another rank's arguments were refused, or ranks configured this
            CompressedComm differently (on every rank, naming what differs).
    """

    def __init__(self, comm, codec: str | Codec = "none", **keywords):
        # The keywords are the options' declarations (mpicomp.call.options.OPTIONS; the
        # signature below says them) and the codec's parameters.
        _check_comm(comm)
        self._turns = Turns()  # one call at a time, threads in the order they came (_one_thread)
        # Whatever one rank finds wrong here, every rank hears of in the check below (one
        # small Allgather on ``comm``), before anything collective could wait for it.
        error, args = None, None
        try:
            given, codec_params = split_keywords(keywords)
            args = resolve_arguments(codec, codec_params, given)
        except Exception as e:
            error = e
        config, timeout = (args.config, args.options.timeout) if args else (None, None)
        check_same(comm, config, error, "this CompressedComm", timeout)
        self.codec = codec = args.codec
        #: The checked options (``mpicomp.call.options.Options``), frozen.
        self.options = opts = args.options
        self.kernels = codec.kernels  # the backend of NumPy arrays, read when made
        self._transport = args.transport
        self._gpu = Gpu()  # the GPU of this rank's device gradients, fixed at the first one
        self._comm = dup(comm, timeout=resolve_timeout(opts.timeout), name="CompressedComm")
        self.rank = self._comm.rank
        self.size = self._comm.size
        #: Whether ``iallreduce`` runs its calls on a background thread.
        self.background = args.background
        self._runner = Runner(self, args.background, args.eager_why, f"mpicomp-worker-{self.rank}")
        # What this CompressedComm keeps per tensor across calls (residuals, factors).
        self._residuals = kind_of(codec).state(codec, opts)
        self._plain = make_codec("none")
        self._closed = False
        self._peer_closed = None  # why, once another rank closed this CompressedComm
        try:
            #: The kernel threads (``mpicomp.call.threads.Decision``): CPUs / ranks on the host
            #: unless NUMBA_NUM_THREADS is set; before ``place``, which may time the kernels.
            self.threads = threads.limit(self._comm, opts.timeout)
            self._placement = place(
                self._comm, opts.local_comm, opts.model, codec, args.schedule, timeout=opts.timeout
            )
        except BaseException:
            self._comm.Free()
            raise
        self._planner = Planner(codec, args.schedule, self._placement, args.config)
        self._agrees_on_shapes = kind_of(codec).shaped  # not only on sizes
        # Whether the codec's kind has a reduce-scatter (every schedule of a kind has
        # one, or none has): None where it has not.
        self._scatters = next(iter(kind_of(codec).schedules.values())).scatter
        self._last_whole = None, None  # the last allreduce_many's tensors and description
        self._calls = 0  # the step of the counter-based RNG: the same on every rank
        #: Gets every exchange step of the collectives, ``record(op, step, sent, recv,
        #: bits)`` (e.g. a ``collectives.traffic.Traffic``); None by default.
        self.recorder = None
        #: The ``mpicomp.trace.Tracer`` of ``trace=`` and ``on_call=`` (without a file
        #: when only ``on_call`` is given), or None.
        self.trace = None
        if opts.trace is not None or opts.on_call is not None:
            from mpicomp.trace import Tracer

            flush_every = opts.trace_flush_every if opts.trace is not None else None
            attrs = trace_attrs(args)
            try:
                self.trace = Tracer(
                    self._comm, opts.trace, level=opts.trace_level, flush_every=flush_every,
                    attrs=attrs, on_call=opts.on_call, timeout=opts.timeout,
                )  # fmt: skip
            except BaseException:
                self._free_comms()
                raise
        log.info(
            "CompressedComm on %d ranks: codec %r, %s kernels, device transport %s, iallreduce %s",
            self.size,
            codec,
            self.kernels.name,
            self._transport.path,
            "on a background thread" if self.background else "in the caller's thread",
        )

    @property
    def topology(self) -> Topology:
        """Where the ranks are (``mpicomp.model.cost.Topology``; one host unless a
        hierarchical or ``"auto"`` schedule asked, or a model was given)."""
        return self._placement.topology

    @property
    def model(self):
        """What the schedules' times are predicted with (``mpicomp.model.Model``), or None."""
        return self._placement.model

    # -- the API ---------------------------------------------------------------

    @_one_thread
    def allreduce(self, x, name: str = ""):
        """Return the average over ranks of ``x``, with ``x``'s backend, shape and dtype.

        Args:
            x: the local gradient: a NumPy array, or any ``__dlpack__`` object (a
                PyTorch CPU tensor is taken without a copy).
            name: the tensor's name; keys its error-feedback residual, so use the same
                name for the same tensor every step.
        """
        self._check_open()
        self._runner.drain()
        t = take(x, name, self._gpu, named=self._residuals.named)
        # _reduce itself, not _average: a gradient reaches MPI in six frames from here.
        return _deliver(self._as_result(t, *self._reduce(t, "allreduce")))

    @_one_thread
    def iallreduce(self, x, name: str = "") -> Handle:
        """Start ``allreduce(x, name)`` and return at once; ``wait()`` on the handle gives
        what ``allreduce`` would have returned (or raises what it would have raised).

        Started calls run one after another, in the order they were started, on a
        background thread (see ``background``) while the caller computes. ``x`` is
        read while the call runs: leave it unmodified until ``wait()`` returns, as
        with ``MPI_Iallreduce`` (input that needs converting, e.g. float64, is copied
        at once and may change). Blocking calls, ``state_dict`` and ``close`` first
        wait for every started call.

        Args:
            x: the local gradient, as for ``allreduce``.
            name: the tensor's name, as for ``allreduce``.

        Returns:
            A ``Handle``: ``wait()`` (result or error, the same on every wait),
            ``test()`` and ``done``.

        Raises:
            RuntimeError: the CompressedComm is closed (errors of the call itself
                are raised by ``wait()``).
        """
        self._check_open()
        t = take(x, name, self._gpu, named=self._residuals.named)
        job = partial(self._average, t)
        return self._runner.start(job, _deliver, _call_name("iallreduce", t.name))

    @_one_thread
    def allreduce_many(self, arrays, names=None) -> list:
        """Return the averages of ``arrays``, fusing small tensors into buckets.

        Consecutive tensors smaller than ``bucket_numel`` share one buffer and one
        collective call; larger ones go alone. Pass the same list structure every step
        (bucket residuals are keyed by position and names).

        Args:
            arrays: a list or tuple of gradients, each as for ``allreduce``.
            names: their names (default ``"#0"``, ``"#1"``, ...), one per array.
        """
        self._check_open()
        self._runner.drain()
        return _deliver(self._many(*take_many(arrays, names, self._gpu, self._residuals.named)))

    @_one_thread
    def iallreduce_many(self, arrays, names=None) -> Handle:
        """Start ``allreduce_many(arrays, names)``; return a ``Handle`` whose ``wait()``
        gives its list of averages. The rules of ``iallreduce`` apply.

        Raises:
            RuntimeError: the CompressedComm is closed.
        """
        self._check_open()
        taken = take_many(arrays, names, self._gpu, self._residuals.named)
        tensors, refused = taken  # a refused member's name, where one is refused
        names = "|".join(t.name for t in tensors) or (refused.name if refused else "")
        return self._runner.start(
            partial(self._many, *taken), _deliver, _call_name("iallreduce_many", names)
        )

    @_one_thread
    def reduce_scatter(self, x, name: str = "", *, op: str = "mean"):
        """Return this rank's row of the average (or sum) over ranks of ``x``: the flat
        input as ``size`` equal rows of ceil(numel / size) elements, zero-padded at the
        end; rank r gets row r, 1-D, with ``x``'s backend and dtype (the layout FSDP2
        reduce-scatters in; docs/sharded.md).

        It is the first phase of ``allreduce``'s schedule alone, compressed by the same
        codec, with the same agreement, NaN/Inf policy, timeout and trace; error
        feedback keeps one residual per ``name`` and row.

        Args:
            x: the local gradient, as for ``allreduce``; any number of elements.
            name: the tensor's name, as for ``allreduce``.
            op: ``"mean"`` (the average) or ``"sum"`` (the average times ``size``).

        Raises:
            ValueError: the codec has no reduce-scatter (``powersgd``), or ``op`` is
                neither ``"mean"`` nor ``"sum"`` (every rank raises alike).
        """
        self._check_open()
        self._runner.drain()
        t = self._take_scattered(x, name, op)
        return _deliver(self._scatter(t, op))

    @_one_thread
    def ireduce_scatter(self, x, name: str = "", *, op: str = "mean") -> Handle:
        """Start ``reduce_scatter(x, name, op=op)``; return a ``Handle`` whose ``wait()``
        gives its row. The rules of ``iallreduce`` apply."""
        self._check_open()
        t = self._take_scattered(x, name, op)
        job = partial(self._scatter, t, op)
        return self._runner.start(job, _deliver, _call_name("ireduce_scatter", t.name))

    @_one_thread
    def allgather(
        self, shard, name: str = "", *, numel: int | None = None, precision: str = "float32"
    ):
        """Return every rank's ``shard`` end to end, in rank order: the inverse of
        ``reduce_scatter`` (parameters back after a sharded optimizer step).

        Every rank brings a shard of the same size; the result is 1-D, with
        ``shard``'s backend and dtype, and the same bits on every rank.

        Args:
            shard: this rank's row, as for ``allreduce``'s ``x``.
            name: names the call in traces and errors.
            numel: keep the first ``numel`` elements (the tensor without its padding);
                default all ``size * shard.size``.
            precision: ``"float32"``, or ``"bfloat16"`` (half the bytes: every rank's
                row, this rank's too, rounded to nearest even).

        Raises:
            ValueError: a shard holding NaN or Inf (on its rank; RankError on the
                others), a ``numel`` beyond ``size * shard.size``, an unknown precision.
        """
        self._check_open()
        self._runner.drain()
        t = take(shard, name, self._gpu, named=False)
        return _deliver(self._gather(t, numel, precision))

    @_one_thread
    def iallgather(
        self, shard, name: str = "", *, numel: int | None = None, precision: str = "float32"
    ) -> Handle:
        """Start ``allgather(shard, name, numel=numel, precision=precision)``; return a
        ``Handle`` whose ``wait()`` gives its result. The rules of ``iallreduce`` apply."""
        self._check_open()
        t = take(shard, name, self._gpu, named=False)
        job = partial(self._gather, t, numel, precision)
        return self._runner.start(job, _deliver, _call_name("iallgather", t.name))

    def schedule_for(self, numel: int) -> tuple[str, float]:
        """Return the schedule a call of ``numel`` elements runs by, and the seconds the
        model predicts for it (NaN without a model): under ``schedule="auto"`` the
        cheapest, the same on every rank."""
        planned = self._planner.plan(numel, numel >= self.options.min_numel)
        return planned.plan.name, planned.predicted

    @_one_thread
    def state_dict(self) -> dict:
        """Return the error-feedback residuals and the step, for a checkpoint.

        Waits first for every started ``iallreduce``.
        """
        self._runner.drain()
        residuals, server = self._residuals.state_dict()
        return {"step": self._calls, "residuals": residuals, "server_residuals": server}

    @_one_thread
    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (same codec, same tensor names).

        Waits first for every started ``iallreduce``. All of ``state`` is checked
        before anything changes: a state refused changes nothing.

        Raises:
            TypeError: ``state`` is not such a dict, its step not an integer, or a
                residual not an array.
            ValueError: the step is negative, or a residual holds NaN or Inf (naming it).
        """
        self._runner.drain()
        step, workers, owners = check_state(state)
        self._residuals.load_state_dict(workers, owners)
        self._calls = step

    @_one_thread
    def close(self) -> None:
        """Wait for every started ``iallreduce`` (their handles keep their results and
        errors), write the rest of the trace, release the duplicated communicator.
        Safe twice."""
        self._close(flush_trace=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # Leaving by an exception, other ranks may be elsewhere: an agreement or a final
        # gather could hang, so the trace keeps what its earlier flushes wrote.
        self._close(flush_trace=exc_type is None, agree=exc_type is None)

    def __repr__(self) -> str:
        return f"CompressedComm(size={self.size}, codec={self.codec!r})"

    # -- for framework adapters (mpicomp.torch, mpicomp.jax; docs/architecture.md) -------

    @property
    def comm(self):
        """The duplicate of the communicator this CompressedComm was made with (its own
        messages never match the caller's). Make other collectives on it only while no
        started call runs (``wait_all``), from one thread."""
        return self._comm

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran, or another rank closed this CompressedComm."""
        return self._closed or self._peer_closed is not None

    @_one_thread
    def start(
        self,
        x,
        name: str = "",
        *,
        layout: int | str | None = None,
        snapshots: list | None = None,
        compress: bool = True,
        shapes=None,
        refuse: BaseException | None = None,
        result_dtype=None,
    ) -> Handle:
        """Start one call as ``iallreduce`` does, for an adapter that averages a whole
        optimizer step in several calls and may skip or undo it.

        Args:
            x: the local gradient, as for ``allreduce``.
            name: the tensor's name, as for ``allreduce``.
            layout: an int or a str every rank must bring to this call besides the
                name, sizes and step it agrees on anyway (e.g. a hash of a bucket's
                parameters); ranks calling with different ones raise, naming them.
            snapshots: a list the call appends what restores the residuals and the
                step it may move to, for ``rollback``.
            compress: False averages uncompressed (the float32 sum; a warm-up step).
            shapes: the shapes of the tensors ``x`` holds end to end (a bucket of
                parameters; default: ``x``'s shape), for codecs that work on matrices
                (``powersgd``).
            refuse: an error this rank found in the adapter's own arguments: the call
                takes part in the agreement without its bytes, and every rank raises
                (this one ``refuse``, the others ``RankError``).
            result_dtype: the dtype the adapter writes the average into, where it is
                not ``x``'s (a float32 bucket of float16 gradients): the call checks
                the average against its range on every rank, as for ``x``'s own.

        Returns:
            A ``Handle`` whose ``wait()`` returns an ``Outcome`` (average, skip messages)
            without warning, or raises the call's error.

        Raises:
            RuntimeError: the CompressedComm is closed.
        """
        self._check_open()
        t = take(x, name, self._gpu, self._residuals.named, shapes)
        layout, t = _adapter_input(layout, t, refuse, result_dtype)
        job = partial(self._average, t, "allreduce", layout, snapshots, compress)
        return self._runner.start(job, Outcome._make, _call_name("start", t.name))

    @_one_thread
    def start_scatter(
        self,
        x,
        name: str = "",
        *,
        op: str = "mean",
        snapshots: list | None = None,
        layout: int | str | None = None,
        refuse: BaseException | None = None,
        result_dtype=None,
        compress: bool = True,
    ) -> Handle:
        """Start one ``reduce_scatter`` as ``start`` starts an allreduce, for an adapter
        that reduce-scatters a whole optimizer step in several calls and may skip or
        undo it (``mpicomp.torch.ZeroOptimizer``, FSDP2's ``ReduceScatter``): ``wait()``
        returns an ``Outcome`` (this rank's row, skip messages) without warning;
        ``snapshots``, ``layout``, ``refuse``, ``result_dtype`` and ``compress`` as for
        ``start``.

        Raises:
            ValueError: the codec has no reduce-scatter (as ``reduce_scatter``).
            RuntimeError: the CompressedComm is closed.
        """
        self._check_open()
        t = self._take_scattered(x, name, op)
        layout, t = _adapter_input(layout, t, refuse, result_dtype)
        job = partial(self._scatter, t, op, snapshots, layout, compress)
        return self._runner.start(job, Outcome._make, _call_name("start_scatter", t.name))

    def rollback(self, snapshots: list) -> None:
        """Restore the residuals and the step of ``snapshots`` (filled by ``start``): a
        step that is not taken moves no state. Waits first for every started call (a
        later one's step then depends on no thread's timing)."""
        self._runner.drain()
        rollback(snapshots)

    @_one_thread
    def forget(self, name: str) -> None:
        """Drop the residuals of tensor ``name`` (its layout changed, e.g. DDP rebuilt
        its buckets): the next call starts it from zero. Waits for started calls."""
        self._runner.drain()
        self._residuals.forget(name)

    @_one_thread
    def wait_all(self) -> None:
        """Wait until every started call has finished (their handles keep their results
        and errors).

        Raises:
            RuntimeError: the CompressedComm is closed.
        """
        self._check_open()
        self._runner.drain()

    # -- the gradient path: allreduce -> _average -> a kind's schedule -> a collective

    def _average(
        self,
        t: Tensor,
        op: str = "allreduce",
        layout: int | str | None = None,
        snapshots: list | None = None,
        compress: bool = True,
        whole: dict | None = None,
    ) -> tuple:
        """Run one collective call averaging ``t`` over ranks (``compress=False``: the
        float32 sum of ``none``, as below ``min_numel``; a warm-up step).

        Returns:
            (average in ``t``'s framework, shape and dtype; skip messages). A call
            skipped under ``nonfinite="skip_step"`` returns zeros and its message.

        A call that fails or is skipped changes no state on any rank: its residuals
        are snapshot before and restored, and its step is not counted (the next call
        draws as a fresh CompressedComm at this step would). What restores them is
        appended to ``snapshots`` for a caller that may roll back later; ``whole``
        describes the ``allreduce_many`` call this is the first bucket of.

        Raises:
            ValueError, TypeError: this rank's input was refused (RankError on the others).
            RankError: another rank failed, or ranks disagree, in this call.
            PeerClosed: another rank closed this CompressedComm (then so do calls
                started after it, without a message).
        """
        return self._as_result(t, *self._reduce(t, op, layout, snapshots, compress, whole))

    def _take_scattered(self, x, name: str, op: str) -> Tensor:
        """Take ``x`` for a reduce-scatter: refused (every rank hears of it in the call)
        for an ``op`` other than mean or sum; a codec without one raises here alike."""
        if self._scatters is None:
            kind = kind_of(self.codec)
            raise ValueError(
                f"codec {self.codec.name!r} ({kind.name}) has no reduce-scatter: its "
                "aggregation needs every rank's whole tensor; use allreduce, or a codec "
                "of another kind (docs/sharded.md)"
            )
        t = take(x, name, self._gpu, named=self._residuals.named)
        if op not in _REDUCE_OPS:
            error = ValueError(f"op must be 'mean' or 'sum', got {op!r}")
            t = Tensor.refused(x, name, error)
        return t

    def _scatter(
        self, t: Tensor, op: str, snapshots: list | None = None, layout=None, compress=True
    ) -> tuple:
        """Run one reduce-scatter of ``t``; return (this rank's row in ``t``'s framework
        and dtype, or zeros when skipped; skip messages)."""
        row, skipped = self._reduce(t, "reduce_scatter", layout, snapshots, compress, rows=op)
        width = -(-t.flat.size // self.size)
        with self._gpu.current():
            xp = array_module(t.flat)
            return t.like(xp.zeros(width, np.float32) if skipped else row), skipped

    def _gather(self, t: Tensor, numel, precision: str) -> tuple:
        """Run one allgather of ``t``; return (the rows end to end in ``t``'s framework
        and dtype; no skip messages)."""
        total = self.size * t.flat.size
        if t.error is None:
            error = None
            if precision not in PRECISIONS:
                error = ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
            elif numel is not None and (
                isinstance(numel, bool)
                or not isinstance(numel, (int, np.integer))
                or not 0 <= numel <= total
            ):
                error = ValueError(
                    f"numel must be an integer in [0, {total}] (size * shard size), got {numel!r}"
                )
            if error is not None:
                t = Tensor.refused(t.x, t.name, error)
        gather = (total if numel is None else int(numel), precision)
        out, _ = self._reduce(t, "allgather", gather=gather)
        with self._gpu.current():
            return t.like(out), []

    def _as_result(self, t: Tensor, avg, skipped: list) -> tuple:
        """Return (``_reduce``'s flat average as ``t``'s result, or zeros when skipped;
        the skip messages), made on the gradients' GPU."""
        with self._gpu.current():
            return (t.zeros() if skipped else t.result(avg)), skipped

    def _reduce(
        self,
        t: Tensor,
        op: str,
        layout=None,
        snapshots=None,
        compress=True,
        whole=None,
        rows: str | None = None,
        gather: tuple | None = None,
    ) -> tuple:
        """Make the collective call of ``_average``; return (the flat float32 average or
        None, skip messages); ``rows``: a reduce-scatter's op (this rank's row instead);
        ``gather``: an allgather's (numel, precision). What fails here fails on every rank alike (the agreement,
        the schedules' own checks), and only that takes the state back: the step and the
        residuals. What comes after it (converting the result, the trace's bookkeeping)
        runs on each rank alone, and is kept out of the rollback."""
        if self._peer_closed is not None:
            raise PeerClosed(self._peer_closed)
        step = self._calls
        mark = _Step(self, step)
        if snapshots is not None:
            snapshots.append(mark)
        with self._gpu.current():
            try:
                call, codec, run = self._prepare(
                    t, op, layout, snapshots, compress, whole, step, rows, gather
                )
                try:
                    # Overflow is found by the finiteness checks, alike on every rank;
                    # NumPy's warning would come on some ranks only (an error under -W error).
                    # The checks that can wait for the end (the kernels' error masks, the
                    # average's finiteness) come back together, in one read.
                    with np.errstate(over="ignore", invalid="ignore"), batch("end of call"):
                        avg = run(call, codec, t.flat)
                        if rows is None and gather is None:  # a row is checked by its kind
                            check_average(call, codec, avg)
                except BaseException:
                    call.residuals.restore()
                    raise
            except Skipped as e:
                mark.restore()
                if self.trace is not None:
                    self.trace.end()  # a skipped call still exchanged its agreement
                return None, [e.message]
            except BaseException as e:
                mark.restore()
                if isinstance(e, PeerClosed):  # met here, or in the debug check
                    self._peer_closed = str(e)
                raise
        if self.trace is not None:
            self.trace.end()
        return avg, []

    def _prepare(
        self, t: Tensor, op, layout, snapshots, compress, whole, step: int, rows=None, gather=None
    ) -> tuple:
        """Return (``Call``, codec, run) of call ``step`` averaging ``t`` (``rows``: its
        reduce-scatter; ``gather``: an allgather): its plan, residual snapshot and trace
        event begun; a refused input raises here on this rank, RankError on the others."""
        opts = self.options
        self._calls = step + 1  # taken back by _reduce if the call fails or is skipped
        # Below min_numel every codec, fp16 included, steps aside for the float32 sum of
        # `none`; an allgather moves the rows as they are.
        small = t.flat.size < opts.min_numel
        compress = compress and gather is None
        planned = self._planner.plan(t.flat.size, compress and not small)
        plan = planned.plan
        during = _call_name(op, t.name)  # what a timeout's report names
        if opts.debug:
            what = f"{op}({t.name!r}, {t.flat.size} {t.dtype})"
            self._check_same_call(None if t.error else what, repr(plan.name), during)
        if t.error is not None:
            fail(self._context(step, during=during), t.error)
        codec = self.codec if plan.compressed else self._plain
        residuals = self._encoding(t.name, plan, snapshots, rows is not None)
        if snapshots is not None and residuals is not NO_RESIDUALS:
            snapshots.append(residuals)
        # Everything the bytes depend on takes part in the agreement: ranks calling with
        # tensors in other orders, sizes, shapes or buckets raise instead of mixing them.
        description = {
            "op": op,
            "tensor": t.name,
            "numels": [math.prod(shape) for shape in t.shapes],
            "step": step,
        }
        if self._agrees_on_shapes and plan.compressed:
            description["shapes"] = [list(shape) for shape in t.shapes]
        if layout is not None:
            description["layout"] = layout
        run, guard = planned.run, Guard(opts.nonfinite, t.what, t.overflowed)
        if rows is not None:  # the schedule's first phase alone
            description["reduce"] = rows
            run = partial(plan.schedule.scatter, mean=rows == "mean")
        if gather is not None:  # NaN/Inf in parameters: no step to skip, nothing to zero
            description["allgather"] = list(gather)
            run = partial(allgather_rows, numel=gather[0], precision=gather[1])
            guard = Guard("raise", f"shard {t.name!r}" if t.name else "shard")
        digested = description
        if whole is not None:
            whole, whole_digest = whole
            description["call"] = whole  # named where ranks differ; its digest joins the call's
            digested = {**description, "call": whole_digest}
        call = self._context(
            step,
            description,
            guard,
            digest=describe(digested),
            residuals=residuals,
            shapes=t.shapes,
            config=planned.config,
            label=t.name,
            dtype=t.dtype,
            during=during,
        )
        trace = self.trace
        if trace is not None:
            aside = (small or not compress) and self.codec.compresses and gather is None
            label = op if not aside else f"{op} below min_numel" if small else f"{op} warm-up"
            trace.begin(
                step,
                label,
                codec.name,
                t.name,
                t.flat.size,
                self.recorder,
                plan.name,
                planned.predicted,
            )
            call = replace(call, recorder=trace, clock=trace)
        return call, codec, run

    def _encoding(
        self, name: str, plan, snapshots: list | None = None, rows: bool = False
    ) -> Encoding:
        """Return how a call of ``name`` by ``plan`` encodes (``rows``: a reduce-scatter),
        what it may move of this CompressedComm's per-tensor state snapshot
        (``snapshots``: the list it will join)."""
        if not plan.compressed:
            return NO_RESIDUALS
        hosts = self._placement.hosts
        owners = 0
        if rows:  # a residual per row, named apart from the all-reduce's and its shards'
            name, owners = f"{name}#shards", self.size
        elif plan.hierarchical:
            # A local rank's residual by host covers its shard alone: a name of its own
            # (forget(name) still drops it), so no other schedule ever reads it.
            name = f"{name}#shard@{hosts.node.rank}/{hosts.node.size}"
        if plan.sharded and not rows:
            owners = hosts.cross.size if plan.hierarchical else self.size
        # A name met twice in one list of snapshots keeps a copy of its own: the shared
        # snapshot buffer would hold the second state, and a rollback would stop there.
        again = snapshots is not None and any(getattr(s, "name", None) == name for s in snapshots)
        return self._residuals.encoding(name, owners, private=again)

    def _context(
        self,
        step: int,
        description: dict | None = None,
        guard: Guard | None = None,
        digest: int | None = None,
        during: str = "",
        **more,
    ) -> Call:
        """Return the ``Call`` of call ``step``: what its messages share (untraced);
        ``digest``: the description's (default: computed here); ``during``: the call
        as a timeout's report names it."""
        description = description or {}
        return Call(
            self._comm,
            step,
            self.recorder,
            description=description,
            digest=describe(description) if digest is None else digest,
            guard=guard or Guard(),
            timeout=self._timeout(during),
            kernels=self.kernels,
            transport=self._transport,
            **more,
        )

    def _many(self, tensors: list, refused: Tensor | None) -> tuple:
        """Average ``tensors`` in buckets, one call per bucket; return (averages, skip
        messages). A refused input makes one failing call.

        The first bucket's agreement carries the whole call (how many tensors, their
        names and sizes): a rank that brings other tensors raises there, on every rank,
        before any bucket's bytes move; an empty call still agrees. All or nothing: a
        bucket that fails or is skipped rolls back the residuals and steps of the
        buckets before it."""
        with self._gpu.current():  # fusing and slicing run on the gradients' GPU
            if refused is not None:
                self._average(refused, "allreduce_many")  # raises on every rank
            whole = self._whole(tensors)
            groups = buckets([t.flat.size for t in tensors], self.options.bucket_numel)
            if not groups:
                self._agree_empty(whole[0])
                return [], []
            averages, skipped, snapshots = [], [], []
            try:
                for k, members in enumerate(groups):
                    first = whole if k == 0 else None
                    if len(members) == 1:
                        (i,) = members
                        t, op = tensors[i], "allreduce_many"
                    else:
                        t, op = Tensor.fused([tensors[i] for i in members]), "allreduce_many bucket"
                    avg, messages = self._reduce(t, op, None, snapshots, True, first)
                    averages.append(avg)
                    # The later buckets still run (every rank makes their calls), but
                    # skip_step means no update at all: zeros, and state rolled back, below.
                    skipped += messages
            except BaseException:
                rollback(snapshots)
                raise
            if skipped:
                rollback(snapshots)
                return [t.zeros() for t in tensors], skipped
            out: list = [None] * len(tensors)
            for members, avg in zip(groups, averages, strict=True):
                start = 0
                for i in members:
                    out[i] = tensors[i].result(avg[start : start + tensors[i].flat.size])
                    start += tensors[i].flat.size
            return out, skipped

    def _whole(self, tensors: list) -> tuple[dict, str]:
        """Return the description of an ``allreduce_many`` call of ``tensors`` (how many,
        each one's name and size) and its digest, kept from the last call: a training
        loop passes the same tensors every step."""
        key = tuple((t.name, t.flat.size) for t in tensors)
        if self._last_whole[0] != key:
            whole = {"tensors": len(tensors)}
            whole.update({f"#{i}": f"{name} ({n})" for i, (name, n) in enumerate(key)})
            self._last_whole = key, (whole, f"{describe(whole):016x}")
        return self._last_whole[1]

    def _timeout(self, during: str = "") -> float:
        """Return the timeout of every wait of a call, naming the call ``during`` in
        its reports (``collectives._wait.Timeout``)."""
        seconds = self.options.timeout
        return Timeout(seconds, during) if seconds and during else seconds

    def _check_same_call(self, what: str | None, schedule: str, during: str) -> None:
        """The debug check that every rank makes call ``what`` (None: refused here)."""
        opts = self.options
        config = f"{self.codec!r}, nonfinite={opts.nonfinite!r}, schedule={schedule}"
        check_same_call(self._comm, what, config, self._timeout(during))

    def _agree_empty(self, whole: dict) -> None:
        """Take part, with an empty ``allreduce_many``, in the agreement that the other
        ranks' first bucket begins with (they raise if they brought tensors)."""
        opts = self.options
        description = {"op": "allreduce_many", "tensor": "", "numels": [], "call": whole}
        during = "allreduce_many of no tensors"
        config = self._planner.plan(0, False).config
        call = self._context(self._calls, description, config=config, during=during)
        try:
            if opts.debug:
                self._check_same_call("allreduce_many([])", "None", during)
            agree(call, 0, None)
        except PeerClosed as e:  # as _reduce: this rank follows the one that closed
            self._peer_closed = str(e)
            raise

    # -- threads and lifetime ---------------------------------------------------

    def _check_open(self):
        if self._peer_closed is not None:
            self._close(flush_trace=False)  # another rank closed it: this rank follows
        if self._closed:
            why = f": {self._peer_closed}" if self._peer_closed else ""
            raise RuntimeError(f"CompressedComm is closed{why}")

    def _close(self, flush_trace: bool, agree: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._runner.stop()  # started calls use the communicator: they finish first
        # Closing takes part in the agreement every call begins with: a rank still
        # calling raises PeerClosed (and closes) instead of waiting for this one forever.
        together = agree and self._peer_closed is None and self._agree_close()
        try:
            if self.trace is not None and flush_trace and together:
                self.trace.close()  # a gather: only when every rank is here
        finally:
            # Freed here, never later by the garbage collector: MPICH's MPI_Comm_free
            # can wait for the other ranks.
            self._free_comms()

    def _agree_close(self) -> bool:
        """Return True if every rank is closing too; False if some rank called (it
        raises PeerClosed) or the agreement failed (logged)."""
        try:
            if self.options.debug:  # the calls begin with the debug check there
                check_same_call(self._comm, CLOSING, "", self._timeout("close"))
            call = self._context(self._calls, during="close")
            return agree_close(replace(call, recorder=None))
        except Exception as e:
            log.warning("closing CompressedComm without the other ranks: %s", e)
            return False

    def _free_comms(self) -> None:
        """Free the duplicated communicator and the hierarchy's, whatever fails first."""
        try:
            self._placement.free()
            self._placement = self._placement._replace(hosts=None)
        finally:
            self._comm.Free()
            self._comm = None
            self._closed = True


if CompressedComm.__doc__:  # None under python -OO
    CompressedComm.__doc__ = CompressedComm.__doc__.replace("{options}", options.docstring_args())
CompressedComm.__init__.__signature__ = options.signature()


def _check_comm(comm) -> None:
    """Refuse what is not an mpi4py communicator (on this rank alone: without one, no
    other rank can be told)."""
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            f"comm must be an mpi4py.MPI.Intracomm such as MPI.COMM_WORLD, got {comm!r}"
        )


def _adapter_input(layout, t: Tensor, refuse: BaseException | None, result_dtype=None) -> tuple:
    """Return what an adapter's ``start``/``start_scatter`` brings to its call:
    (``layout`` as an int, a str or None; ``t``, refused where ``refuse`` is an error or
    ``layout`` is neither, so that every rank hears of it in the call's agreement, and
    described as ``result_dtype`` where given)."""
    if result_dtype is not None:
        t = replace(t, dtype=str(result_dtype).removeprefix("torch."))
    if layout is not None and not isinstance(layout, str):
        try:  # an int of any kind (a NumPy one too), as the agreement's digest takes it
            layout = operator.index(layout)
        except TypeError:
            error = TypeError(f"layout must be an integer, a str or None, got {layout!r}")
            refuse, layout = refuse or error, None
    if refuse is not None and t.error is None:
        t = Tensor.refused(t.x, t.name, refuse)
    return layout, t


def _call_name(op: str, name: str) -> str:
    """Return how messages name a call of ``op`` on tensor ``name``, e.g.
    ``"reduce_scatter of 'fsdp:layer1'"`` (a long name, a bucket's, cut short)."""
    if not name:
        return op
    shown = name if len(name) <= 80 else name[:77] + "..."
    return f"{op} of {shown!r}"


def _deliver(outcome: tuple):
    """Return a call's result from (result, skip messages), warning in the caller's thread.

    The warning is raised where the caller gets the result (``allreduce`` or
    ``Handle.wait``), never on the worker thread, whose warnings nobody would see.
    """
    result, skipped = outcome
    if skipped:
        _warn(skipped)
    return result


def _warn(messages: list[str]) -> None:
    """Warn that a call was skipped on every rank, naming the ranks that held NaN/Inf."""
    text = "; ".join(messages) + " (every rank returned zeros; residuals unchanged)"
    # At the caller's line (past allreduce, its thread guard, Handle.wait).
    warnings.warn(text, NonFiniteWarning, stacklevel=user_stacklevel())
