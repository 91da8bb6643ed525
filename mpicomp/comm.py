"""CompressedComm: the one call a training loop makes instead of its all-reduce."""

from __future__ import annotations

import difflib
import inspect
import json
import math
import sys
import warnings
import weakref
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial, wraps

import numpy as np
from mpi4py import MPI

from mpicomp import _reduce
from mpicomp import model as model_mod
from mpicomp._arrays import array_module, check_numel, is_device_array, to_float32
from mpicomp._config import Config, check_same
from mpicomp._log import log
from mpicomp._same_call import CLOSING, check_same_call
from mpicomp._transport import Transport, cuda_aware
from mpicomp._worker import Handle, Worker, overlap_blocker
from mpicomp.codecs import Codec, ErrorFeedback
from mpicomp.codecs._base import available as available_codecs
from mpicomp.codecs._base import codec_parameters
from mpicomp.codecs._base import make as make_codec
from mpicomp.codecs._wire import MAX_NUMEL
from mpicomp.collectives._wait import resolve_timeout
from mpicomp.errors import NonFiniteWarning, PeerClosed, RankError
from mpicomp.kernels import backend_of
from mpicomp.options import AUTO, Options
from mpicomp.schedules import FLOAT32, HIER, Topology, choose, predict
from mpicomp.trace import NO_CLOCK

__all__ = ["CompressedComm", "Handle", "NonFiniteWarning", "Options", "RankError"]


def _on_its_gpu(method):
    """Run a CompressedComm ``method`` with the communicator's GPU current, in whichever
    thread runs it (CuPy's current device is per thread: the worker's starts at GPU 0)."""

    @wraps(method)
    def run(self, *args, **kwargs):
        with self._gpu_on():
            return method(self, *args, **kwargs)

    return run


class CompressedComm:
    """Average gradients over the ranks of ``comm`` through a compressing codec.

    Args:
        comm: an ``mpi4py.MPI.Intracomm``; a duplicate is kept, so mpicomp's messages
            never match the caller's.
        codec: a codec name (with ``**codec_params``) or a made codec.
        min_numel: tensors with fewer elements are averaged uncompressed (float32 MPI
            sum): headers and extra messages would cost more than they save.
        bucket_numel: ``allreduce_many`` fuses consecutive tensors smaller than this
            into buckets of up to this many elements, one collective call each.
        error_feedback: keep per-tensor residuals (default: on for the biased gather
            codecs 3LC, top-k, FFT and FastSGD, off otherwise).
        sharded: gather codecs only: reduce through shard owners (3LC's push/pull,
            an alltoallv then an allgather) instead of allgathering whole payloads;
            each rank receives O(1) compressed tensors instead of N - 1. With error
            feedback, workers keep a residual per shard and owners one per tensor.
            The same as ``schedule="sharded"``.
        schedule: how a compressed call moves its bytes (docs/collectives.md, "Which
            collective for which codec"): QSGD and signSGD ``"ring"`` (default, the
            width-growing ring) or ``"direct"`` (a direct reduce-scatter: each code
            sent once to its chunk's owner, fewer bytes from 3 ranks on, the same
            results bit for bit); gather codecs ``"allgather"`` (default) or
            ``"sharded"``; ``none`` and ``fp16`` ``"allreduce"``. Also ``"float32"``
            (MPI_Allreduce of float32, uncompressed), ``"hier:NAME"`` for QSGD,
            signSGD and the gather codecs (reduce within each host, NAME between
            hosts; several hosts of as many ranks each; docs/collectives.md,
            "Hierarchy") and
            ``"auto"``: per call, the schedule ``model`` predicts to be cheapest for
            the tensor's size (the same on every rank; docs/collectives.md,
            "Choosing a schedule"). None: the codec's default.
        model: what ``schedule="auto"`` predicts with (``mpicomp.model.Model``, or
            a file from ``mpicomp bench --save-model``); None: the file
            ``MPICOMP_MODEL`` names, else the network and the codec measured when
            this CompressedComm is made (collective, a fraction of a second). With
            another schedule, a given model only fills the trace's ``t_predicted``.
        local_comm: the ranks of ``comm`` that share this rank's host, for the
            hierarchical schedules and the model (default:
            ``comm.Split_type(MPI.COMM_TYPE_SHARED)``; e.g. one per socket).
        trace: a path (str or os.PathLike): record every collective call of every
            rank (bytes, phase times) into this HDF5 file, written by rank 0 (see
            docs/trace-format.md). The ``mpicomp.trace.Tracer`` is ``self.trace``.
        trace_level: 1 records one event per call per rank; 2 also every exchange
            step of the collectives.
        trace_flush_every: rank 0 appends to the file every this many calls (None:
            only at ``close``), so a job that dies keeps what was flushed.
        nonfinite: what a NaN/Inf in some rank's gradient does (the same on every
            rank): ``"raise"`` (ValueError there, RankError on the others),
            ``"skip_step"`` (every rank returns zeros, residuals stay as they were,
            and a ``NonFiniteWarning`` names the ranks) or ``"zero"`` (that rank
            sends its NaN/Inf as 0). float64 values beyond float32's range count
            as Inf.
        debug: check on every call that all ranks make the same call (op, name,
            numel, dtype, codec, policy), naming the ranks that differ; costs one
            8-byte Allgather per call. Default: the ``MPICOMP_DEBUG`` environment
            variable (set and not ``0``).
        timeout: seconds any one message of this communicator may wait before the
            rank reports what it waited for and aborts the job (docs/reliability.md).
            Default: the ``MPICOMP_TIMEOUT`` environment variable (unset: no timeout);
            0 turns it off. Every rank must have one, or none.
        background: run ``iallreduce`` calls on a background thread, so they overlap
            the caller's work. Default: when MPI provides ``MPI_THREAD_MULTIPLE``
            (``MPI.Query_thread()``); False (or a lower thread level) runs them at
            once in the caller's thread, their handles already complete.
        on_call: called with every finished call's event on this rank, a dict of
            the trace's columns (``op``, ``name``, ``numel``, ``bytes_sent``,
            ``bytes_recv``, ``t_start``, ``t_encode``, ``t_comm``, ``t_decode``,
            ``t_total``, ...; docs/trace-format.md), with or without ``trace``: for
            TensorBoard, W&B or a log. It runs in the thread that ran the call (the
            background thread for ``iallreduce``): keep it short; what it raises is
            logged and ignored.
        **codec_params: parameters of the codec when ``codec`` is a name.

    Every rank must make the same calls in the same order with tensors of the same
    sizes (as with any MPI collective); sizes that differ, or a NaN/Inf on one rank,
    raise an error on every rank instead of hanging. ``iallreduce`` calls count in
    the order they are started; one thread drives a CompressedComm.

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

    def __init__(
        self,
        comm,
        codec: str | Codec = "none",
        *,
        min_numel: int = 1024,
        bucket_numel: int = 1 << 22,
        error_feedback: bool | None = None,
        sharded: bool = False,
        schedule: str | None = None,
        model=None,
        local_comm=None,
        trace=None,
        trace_level: int = 1,
        trace_flush_every: int | None = 100,
        nonfinite: str = "raise",
        debug: bool | None = None,
        timeout: float | None = None,
        background: bool | None = None,
        on_call=None,
        **codec_params,
    ):
        _check_comm(comm)
        # Whatever one rank finds wrong here, every rank hears of in the check below (one
        # small Allgather on ``comm``), before anything collective could wait for it.
        error, config, opts = None, None, None
        try:
            codec = _codec(codec, codec_params)
            #: The checked options (``mpicomp.options.Options``), frozen.
            opts = Options.resolve(
                codec,
                min_numel=min_numel,
                bucket_numel=bucket_numel,
                error_feedback=error_feedback,
                sharded=sharded,
                schedule=schedule,
                trace=trace,
                trace_level=trace_level,
                trace_flush_every=trace_flush_every,
                nonfinite=nonfinite,
                debug=debug,
                timeout=timeout,
                background=background,
            )
            why = None if opts.background is False else overlap_blocker(codec.kernels)
            if opts.background and why:
                raise ValueError(
                    f"background=True: {why} (see docs/usage.md, Overlapping communication)"
                )
            if on_call is not None and not callable(on_call):
                raise TypeError(f"on_call must be callable or None, got {on_call!r}")
            if local_comm is not None and not isinstance(local_comm, MPI.Intracomm):
                raise TypeError(
                    f"local_comm must be an mpi4py.MPI.Intracomm or None, got {local_comm!r}"
                )
            # How device gradients' bytes reach MPI: directly when the library is CUDA-aware.
            transport = Transport(direct=cuda_aware()[0])
            config = _config(codec, opts, on_call is not None, local_comm is not None)
        except Exception as e:
            error = e
        timeout = opts.timeout if opts is not None else None
        check_same(comm, config, error, "this CompressedComm", timeout)
        self.codec = codec
        self.options = opts
        self.kernels = codec.kernels  # the backend of NumPy arrays, read when made
        self._transport = transport
        self._config = config
        self._configs = {}  # schedule run -> the Config a call by it agrees on
        self._gpu = None  # the GPU of this rank's device gradients, fixed at the first one
        self._gpu_on = nullcontext  # a context making that GPU current
        #: Whether ``iallreduce`` runs its calls on a background thread.
        self.background = why is None if opts.background is None else opts.background
        self._eager_why = why if opts.background is None else None  # warned once, at first use
        self._worker = None  # made by the first background iallreduce
        self._feedback = ErrorFeedback(codec) if opts.error_feedback else None
        may_shard = opts.schedule in ("sharded", HIER + "sharded") or (
            opts.schedule == AUTO and codec.aggregation == "gather"
        )
        self._server_feedback = ErrorFeedback(codec) if opts.error_feedback and may_shard else None
        self._plain = make_codec("none")
        self._comm = comm.Dup()
        self._closed = False
        self._peer_closed = None  # why, once another rank closed this CompressedComm
        self.rank = self._comm.rank
        self.size = self._comm.size
        #: Where the ranks are (``mpicomp.schedules.Topology``; one host unless a
        #: hierarchical or ``"auto"`` schedule asked, or a model was given).
        self.topology = Topology(1, self.size)
        #: What the schedules' times are predicted with (``mpicomp.model.Model``), or None.
        self.model = None
        self._hosts = None  # the communicators of the hierarchical schedules
        self._plans = {}  # (numel, schedule asked) -> (schedule run, predicted seconds)
        try:
            self._place(local_comm, model)
        except BaseException:
            self._comm.Free()
            raise
        self._calls = 0  # the step of the counter-based RNG: the same on every rank
        #: Gets every exchange step of the collectives, ``record(op, step, sent, recv,
        #: bits)`` (e.g. a ``collectives.traffic.Traffic``); None by default.
        self.recorder = None
        #: The ``mpicomp.trace.Tracer`` of ``trace=`` and ``on_call=`` (without a file
        #: when only ``on_call`` is given), or None.
        self.trace = None
        if trace is not None or on_call is not None:
            from mpicomp.trace import Tracer

            try:
                self.trace = Tracer(
                    self._comm,
                    trace,
                    level=trace_level,
                    flush_every=trace_flush_every if trace is not None else None,
                    attrs=self._trace_attrs(),
                    on_call=on_call,
                )
            except BaseException:
                self._free_comms()
                raise
        log.info(
            "CompressedComm on %d ranks: codec %r, %s kernels, device transport %s, iallreduce %s",
            self.size,
            codec,
            self.kernels.name,
            self._transport.path,
            "on a background thread" if self.background else f"in the caller's thread ({why})",
        )

    # -- the API ---------------------------------------------------------------

    def allreduce(self, x, name: str = ""):
        """Return the average over ranks of ``x``, with ``x``'s backend, shape and dtype.

        Args:
            x: the local gradient: a NumPy array, or any ``__dlpack__`` object (a
                PyTorch CPU tensor is taken without a copy).
            name: the tensor's name; keys its error-feedback residual, so use the same
                name for the same tensor every step.
        """
        self._check_open()
        self._drain()
        return _deliver(self._average(self._take(x, name)))

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
        return self._start(partial(self._average, self._take(x, name)))

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
        self._drain()
        return _deliver(self._many(*self._take_many(arrays, names)))

    def iallreduce_many(self, arrays, names=None) -> Handle:
        """Start ``allreduce_many(arrays, names)``; return a ``Handle`` whose ``wait()``
        gives its list of averages. The rules of ``iallreduce`` apply.

        Raises:
            RuntimeError: the CompressedComm is closed.
        """
        self._check_open()
        return self._start(partial(self._many, *self._take_many(arrays, names)))

    def state_dict(self) -> dict:
        """Return the error-feedback residuals and the step, for a checkpoint.

        Waits first for every started ``iallreduce``.
        """
        self._drain()
        residuals = self._feedback.state_dict() if self._feedback else {}
        server = self._server_feedback.state_dict() if self._server_feedback else {}
        return {"step": self._calls, "residuals": residuals, "server_residuals": server}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (same codec, same tensor names).

        Waits first for every started ``iallreduce``.
        """
        self._drain()
        self._calls = int(state["step"])
        if self._feedback is not None:
            self._feedback.load_state_dict(state["residuals"])
        if self._server_feedback is not None:
            self._server_feedback.load_state_dict(state["server_residuals"])

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

    # -- the gradient path: allreduce -> _average -> a reducer -> a collective -> MPI

    def _average(self, t: _Tensor, *args, **kwargs) -> tuple:
        """``_average_once``, unless another rank closed this CompressedComm: a call it
        met raised PeerClosed, and calls started after it raise that too (no message)."""
        if self._peer_closed is not None:
            raise PeerClosed(self._peer_closed)
        try:
            return self._average_once(t, *args, **kwargs)
        except PeerClosed as e:
            self._peer_closed = str(e)
            raise

    @_on_its_gpu
    def _average_once(
        self,
        t: _Tensor,
        op: str = "allreduce",
        layout: int | None = None,
        ledger=None,
        compress: bool = True,
    ) -> tuple:
        """Run one collective call averaging ``t`` over ranks (``compress=False``: the
        float32 sum of ``none``, as below ``min_numel``; a warm-up step).

        Returns:
            (average in ``t``'s framework, shape and dtype; skip messages). A call
            skipped under ``nonfinite="skip_step"`` returns zeros and its message.

        Error-feedback residuals are snapshot before the call and restored when it
        fails or is skipped, so such a call changes no residual on any rank; the
        snapshots are appended to ``ledger`` for a caller that may roll back later.

        Raises:
            ValueError, TypeError: this rank's input was refused (RankError on the others).
            RankError: another rank failed, or ranks disagree, in this call.
        """
        opts = self.options
        step = self._calls
        self._calls += 1  # counted on every rank, failed or not: the RNG steps stay aligned
        # Below min_numel every codec, fp16 included, steps aside for the float32 sum of `none`.
        small = t.flat.size < opts.min_numel
        schedule, predicted = self._plan(t.flat.size, compress and not small)
        if opts.debug:
            what = f"{op}({t.name!r}, {t.flat.size} {t.dtype})"
            config = f"{self.codec!r}, nonfinite={opts.nonfinite!r}, schedule={schedule!r}"
            check_same_call(self._comm, None if t.error else what, config, opts.timeout)
        if t.error is not None:
            _reduce.fail(self._call(step), t.error)
        uncompressed = schedule == FLOAT32
        codec = self._plain if uncompressed else self.codec
        reduce = _reduce.REDUCERS["sum"] if uncompressed else self._reducer(schedule)
        # A local rank's residual by host covers its shard alone: a name of its own
        # (forget(name) still drops it), so no other schedule ever reads it.
        key = t.name
        if schedule.startswith(HIER):
            key = f"{t.name}#shard@{self._hosts.node.rank}/{self._hosts.node.size}"
        encoders = None if uncompressed else self._encoders(key)
        snapshots = [] if uncompressed else self._snapshot(key, schedule)
        if ledger is not None:
            ledger.extend(snapshots)
        rollback = partial(_restore, snapshots) if snapshots else None
        guard = _reduce.Guard(opts.nonfinite, t.what, t.overflowed, rollback)
        # Names (and bucket layouts) take part in the agreement: ranks calling with
        # tensors in different orders raise instead of mixing them.
        call = self._call(step, zlib.crc32(t.name.encode()) if layout is None else layout, guard)
        call = replace(
            call,
            schedule=schedule.removeprefix(HIER),
            config=self._call_config(schedule),
            label=t.name,
        )
        trace = self.trace
        if trace is not None:
            aside = (small or not compress) and self.codec.name != "none"
            label = op if not aside else f"{op} below min_numel" if small else f"{op} warm-up"
            trace.begin(
                step, label, codec.name, t.name, t.flat.size, self.recorder, schedule, predicted
            )
            call = replace(call, recorder=trace, clock=trace)
        try:
            avg = reduce(call, codec, t.flat, encoders)
        except _reduce.Skipped as e:
            _restore(snapshots)
            if trace is not None:
                trace.end()  # a skipped call still exchanged its agreement: keep its event
            return t.result(np.zeros(t.flat.size, dtype=np.float32)), [e.message]
        except BaseException:
            _restore(snapshots)
            raise
        if trace is not None:
            trace.end()
        return t.result(avg), []

    def _place(self, local_comm, model) -> None:
        """Find the hosts, make the hierarchical schedules' communicators and the model,
        as the options ask (collective; a problem raises on every rank)."""
        schedule = self.options.schedule
        # fp16's and none's sums never run by host (schedules.schedules_of).
        hier = schedule.startswith(HIER) or (schedule == AUTO and self.codec.aggregation != "sum")
        # Whether to split at all must not hang on one rank's argument: model= given on
        # some ranks only still makes every rank take part (rank 0's model is used).
        given = self._comm.allreduce(model is not None, op=MPI.LOR)
        if not (given or hier or schedule == AUTO and self.codec.name != "none"):
            return  # nothing to choose, no model to predict with
        node = model_mod.host_comm(self._comm, local_comm)
        try:
            self.topology = topo = model_mod.topology(self._comm, node)
            if schedule.startswith(HIER) and not topo.hierarchical:
                raise ValueError(
                    f"schedule={schedule!r} needs several hosts holding as many ranks "
                    f"each; here {topo.hosts} host(s), up to {topo.per_host} rank(s) each"
                    + ("" if topo.even else " (not the same on every host)")
                )
            if schedule == AUTO or given:
                self.model = model_mod.resolve(self._comm, node, self.codec, model)
        except BaseException:
            node.Free()
            raise
        if hier and topo.hierarchical:
            self._hosts = _reduce.Hosts(node, self._comm.Split(node.rank, self.rank))
        else:
            node.Free()

    def schedule_for(self, numel: int) -> tuple[str, float]:
        """Return the schedule a call of ``numel`` elements runs by, and the seconds the
        model predicts for it (NaN without a model): under ``schedule="auto"`` the
        cheapest, the same on every rank."""
        return self._plan(numel, numel >= self.options.min_numel)

    def _plan(self, numel: int, compress: bool) -> tuple[str, float]:
        """Return the schedule of a call of ``numel`` elements and its predicted seconds
        (NaN without a model): the float32 sum when not compressing, the cheapest under
        ``"auto"`` (the same on every rank: same model, same size), else the option."""
        schedule = self.options.schedule
        if self.codec.name == "none":
            schedule = "allreduce"
        elif not compress:
            schedule = FLOAT32
        key = (numel, schedule)
        if key not in self._plans:
            predicted = math.nan
            if schedule == AUTO:
                schedule, times = choose(self.codec, numel, self.topology, self.model)
                predicted = times.get(schedule, math.nan)
            elif self.model is not None:
                predicted = predict(schedule, self.codec, numel, self.topology, self.model)
            self._plans[key] = (schedule, predicted)
        return self._plans[key]

    def _reducer(self, schedule: str):
        """Return the reduction of a compressed call by ``schedule``."""
        inner = schedule.removeprefix(HIER)
        path = "sharded" if inner == "sharded" else self.codec.aggregation
        if inner == schedule:
            return _reduce.REDUCERS[path]
        return partial(_reduce.reduce_hierarchical, inner=path, hosts=self._hosts)

    def _call(self, step: int, layout: int = 0, guard: _reduce.Guard | None = None):
        """Return the ``_reduce.Call`` of call ``step``: what its messages share (untraced)."""
        guard = guard or _reduce.Guard()
        timeout = self.options.timeout
        return _reduce.Call(
            self._comm,
            step,
            self.recorder,
            NO_CLOCK,
            layout,
            guard,
            timeout,
            self.kernels,
            self._transport,
        )

    def _call_config(self, schedule: str) -> Config:
        """Return the configuration a call run by ``schedule`` agrees on: this
        CompressedComm's, and the schedule the call runs."""
        config = self._configs.get(schedule)
        if config is None:
            config = self._configs[schedule] = self._config.with_fields(run=schedule)
        return config

    def _encoders(self, name: str) -> _reduce.Encoders | None:
        """Return how a gather call of ``name`` compresses (through error feedback when on)."""
        codec, fb = self.codec, self._feedback
        if codec.aggregation != "gather":
            return None
        if fb is None:
            return _reduce.Encoders(codec.encode, lambda f, s: codec.encode(f), codec.encode)
        return _reduce.Encoders(
            lambda f: fb.encode(f, name),
            lambda f, s: fb.encode(f, f"{name}#shard{s}"),
            lambda f: self._server_feedback.encode(f, name),
        )

    def _snapshot(self, name: str, schedule: str) -> list:
        """Return snapshots of the residuals a compressed call of ``name`` by ``schedule``
        may update."""
        if self._feedback is None:
            return []
        if schedule.removeprefix(HIER) != "sharded":
            return [self._feedback.snapshot([name])]
        owners = self._hosts.cross.size if schedule.startswith(HIER) else self.size
        shards = [f"{name}#shard{s}" for s in range(owners)]
        return [self._feedback.snapshot(shards), self._server_feedback.snapshot([name])]

    # -- for the framework adapters (mpicomp.torch, mpicomp.jax) -----------------

    def _istart(self, x, name: str, layout: int, ledger: list, compress: bool = True) -> Handle:
        """Start one call as ``iallreduce`` does; its handle's ``wait()`` returns the raw
        outcome (average, skip messages) without warning, and the residual snapshots the
        call takes are appended to ``ledger``, so an adapter can skip and roll back a
        whole optimizer step of several calls. ``layout`` joins the agreement (ranks
        calling with different buckets raise); ``compress=False`` is a warm-up call."""
        self._check_open()
        job = partial(self._average, self._take(x, name), "allreduce", layout, ledger, compress)
        return self._start(job, deliver=_raw)

    def _forget(self, name: str) -> None:
        """Drop the residuals of tensor ``name`` (its layout changed, e.g. DDP rebuilt
        its buckets): the next call starts it from zero."""
        self._drain()
        for feedback in (self._feedback, self._server_feedback):
            if feedback is not None:
                feedback.forget(name)

    # -- inputs -----------------------------------------------------------------

    def _take(self, x, name: str) -> _Tensor:
        """Read and convert ``x`` now; a refused input is kept with its error, for
        ``_average`` to raise inside the call (every rank then raises)."""
        if not isinstance(name, str):
            error = TypeError(f"name must be a str (the tensor's name), got {name!r}")
            return _Tensor.refused(x, "", error)
        what = f"gradient {name!r}" if name else "gradient"
        try:
            check_numel(x, _max_numel(), what)
            flat, overflowed = to_float32(x, what=what)
            if is_device_array(flat):
                self._check_gpu(flat, what)
            self._check_name(name)
        except Exception as e:  # whatever converting raised, every rank must hear of it
            return _Tensor.refused(x, name, e)
        return _Tensor(x, name, flat.reshape(-1), overflowed, _dtype(x))

    def _take_many(self, arrays, names) -> tuple[list, _Tensor | None]:
        """Return (``arrays`` taken one by one, None), or ([], a refused input) when one
        of them, or the names, is refused."""
        try:
            arrays = _sequence("arrays", arrays, "gradients")
            if names is None:
                names = [f"#{i}" for i in range(len(arrays))]
            names = _sequence("names", names, "str")
        except TypeError as e:
            return [], _Tensor.refused(arrays, "", e)
        if len(names) != len(arrays):
            error = ValueError(f"{len(names)} names for {len(arrays)} arrays")
            return [], _Tensor.refused(arrays, "", error)
        tensors = [self._take(a, n) for a, n in zip(arrays, names, strict=True)]
        refused = next((t for t in tensors if t.error is not None), None)
        if refused is None and len({array_module(t.flat) for t in tensors}) > 1:
            # A fused bucket lives in one place: host and device arrays do not mix.
            error = TypeError("allreduce_many takes host arrays or device arrays, not both")
            refused = _Tensor.refused(arrays, "", error)
        return ([], refused) if refused else (tensors, None)

    @_on_its_gpu
    def _many(self, tensors: list, refused: _Tensor | None) -> tuple:
        """Average ``tensors`` in buckets, one call per bucket; return (averages, skip
        messages). A refused input makes one failing call."""
        if refused is not None:
            self._average(refused, "allreduce_many")  # raises on every rank
        out: list = [None] * len(tensors)
        skipped, ledger = [], []
        for members in _buckets([t.flat.size for t in tensors], self.options.bucket_numel):
            if len(members) == 1:
                (i,) = members
                avg, messages = self._average(tensors[i], "allreduce_many", ledger=ledger)
                out[i] = avg
            else:
                bucket = _Tensor.fused([tensors[i] for i in members])
                label = f"{bucket.name}/{','.join(str(tensors[i].flat.size) for i in members)}"
                avg, messages = self._average(
                    bucket, "allreduce_many bucket", zlib.crc32(label.encode()), ledger
                )
                start = 0
                for i in members:
                    out[i] = tensors[i].result(avg[start : start + tensors[i].flat.size])
                    start += tensors[i].flat.size
            # The later buckets still run (every rank makes their calls), but skip_step
            # means no update at all: zeros, and residuals rolled back, below.
            skipped += messages
        if skipped:
            _restore(ledger)
            out = [t.result(np.zeros(t.flat.size, dtype=np.float32)) for t in tensors]
        return out, skipped

    def _check_gpu(self, flat, what: str) -> None:
        """Check that device array ``flat`` is on this communicator's GPU: the one its
        first device gradient lives on (every call then runs with that GPU current)."""
        gpu = flat.device.id
        if self._gpu is None:
            device = getattr(backend_of(flat), "device", None)
            self._gpu_on = partial(device.on, gpu) if device is not None else nullcontext
            self._gpu = gpu
        elif gpu != self._gpu:
            raise TypeError(
                f"{what} is on GPU {gpu}; this CompressedComm works on GPU {self._gpu} "
                "(one GPU per communicator and rank)"
            )

    def _check_name(self, name: str) -> None:
        if self._feedback is not None and not name:
            raise ValueError(
                "error feedback keeps one residual per tensor: pass name= (the same each step)"
            )

    # -- threads and lifetime ---------------------------------------------------

    def _start(self, job, deliver=None) -> Handle:
        """Run ``job`` on the worker thread behind the calls started before (or now);
        the handle's ``wait()`` returns ``deliver(outcome)`` (default ``_deliver``)."""
        deliver = deliver or _deliver
        if not self.background:
            if self._eager_why:
                why, self._eager_why = self._eager_why, None
                warnings.warn(
                    f"{why}: iallreduce runs each call at once in the caller's thread (no overlap)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            handle = Handle(deliver)
            handle._run(job)
            return handle
        if self._worker is None:
            self._worker = Worker(f"mpicomp-worker-{self.rank}")
            # An unclosed communicator still finishes its started calls at exit.
            self._stop_worker = weakref.finalize(self, self._worker.stop)
        return self._worker.submit(job, deliver)

    def _drain(self) -> None:
        """Wait until every started ``iallreduce`` has finished (errors stay in handles)."""
        if self._worker is not None:
            self._worker.drain()

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
        if self._worker is not None:
            # Started calls use the communicator: they finish before it is freed.
            self._stop_worker()
            self._worker = None
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
                check_same_call(self._comm, CLOSING, "", self.options.timeout)
            return _reduce.agree_close(replace(self._call(self._calls), recorder=None))
        except Exception as e:
            log.warning("closing CompressedComm without the other ranks: %s", e)
            return False

    def _free_comms(self) -> None:
        """Free the duplicated communicator and the hierarchy's, whatever fails first."""
        try:
            if self._hosts is not None:
                self._hosts.free()
                self._hosts = None
        finally:
            self._comm.Free()
            self._comm = None
            self._closed = True

    def _trace_attrs(self) -> dict:
        """Return the run attributes a trace records about this CompressedComm."""
        opts = self.options
        return {
            "backend": self.kernels.name,
            "cuda_aware": self._transport.direct,
            "device_transport": self._transport.path,
            "mpi_cuda_aware": _mpi_cuda_aware(),
            "codec": self.codec.name,
            "codec_params": json.dumps(self.codec.params, sort_keys=True, default=str),
            "min_numel": opts.min_numel,
            "bucket_numel": opts.bucket_numel,
            "error_feedback": opts.error_feedback,
            "sharded": opts.sharded,
            "schedule": opts.schedule,
        }


def _sequence(what: str, items, of: str) -> list:
    """Return ``items`` as a list, refusing one array, a str or a mapping in its place."""
    if isinstance(items, (str, bytes)) or hasattr(items, "shape") or hasattr(items, "keys"):
        hint = " (for one array use allreduce)" if hasattr(items, "shape") else ""
        if hasattr(items, "keys"):
            hint = " (for a dict d: list(d.values()), names=list(d))"
        raise TypeError(f"{what} must be a list or tuple of {of}, got {type(items).__name__}{hint}")
    try:
        return list(items)
    except TypeError:
        raise TypeError(
            f"{what} must be a list or tuple of {of}, got {type(items).__name__}"
        ) from None


def _max_numel() -> int:
    """Return the most elements one call carries: what a payload header describes, and
    what an MPI count (a C int) holds before MPI 4."""
    return MAX_NUMEL if MPI.Get_version() >= (4, 0) else 2**31 - 1


def _check_comm(comm) -> None:
    """Refuse what is not an mpi4py communicator (on this rank alone: without one, no
    other rank can be told)."""
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            f"comm must be an mpi4py.MPI.Intracomm such as MPI.COMM_WORLD, got {comm!r}"
        )


def _codec(codec, params: dict) -> Codec:
    """Return the codec ``codec`` names (made with ``params``), or ``codec`` itself.

    A keyword neither CompressedComm nor the codec takes is blamed on both, with the
    closest names, instead of on the codec's ``__init__``.
    """
    if isinstance(codec, str):
        unknown = [k for k in params if k not in codec_parameters(codec)]
        if unknown and codec in available_codecs():
            raise TypeError(_unknown_keywords(unknown, codec))
        return make_codec(codec, **params)
    if params:
        raise TypeError(
            f"codec parameters ({', '.join(params)}) go with a codec name, not a made codec"
        )
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a codec name or an mpicomp codec, got {codec!r}")
    return codec


def _unknown_keywords(unknown: list[str], codec: str) -> str:
    options = [p for p in inspect.signature(CompressedComm).parameters if p != "codec_params"]
    own = codec_parameters(codec)
    parts = []
    for k in unknown:
        close = difflib.get_close_matches(k, options + list(own), n=1)
        parts.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"CompressedComm got unknown keyword(s) {', '.join(parts)}: not an option of "
        f"CompressedComm nor a parameter of codec {codec!r} "
        f"({', '.join(own) if own else 'which takes none'})"
    )


def _config(codec: Codec, opts: Options, on_call: bool, local_comm: bool) -> Config:
    """Return what every rank's CompressedComm must share: what changes the messages
    (a tracer of a file or of ``on_call`` alike syncs its clock with the other ranks'
    at start; one of a file also gathers its events at every flush)."""
    traced = opts.trace is not None
    return Config(
        {
            "codec": {"name": codec.name, **codec.params},
            "schedule": opts.schedule,
            "sharded": opts.sharded,
            "min_numel": opts.min_numel,
            "bucket_numel": opts.bucket_numel,
            "error_feedback": opts.error_feedback,
            "nonfinite": opts.nonfinite,
            "timeout": "off" if opts.timeout == 0 or not resolve_timeout(opts.timeout) else "set",
            "debug": opts.debug,
            "traced": traced or on_call,
            "trace_file": traced,
            "trace_level": opts.trace_level if traced else None,
            "trace_flush_every": opts.trace_flush_every if traced else None,
            "local_comm": local_comm,
        }
    )


@dataclass(frozen=True)
class _Tensor:
    """One input of a call, read and converted when the call is made (or refused).

    ``flat`` is its float32 copy or view, 1-D; ``overflowed`` says float64 values
    beyond float32's range became Inf; ``dtype`` names the caller's dtype (debug
    descriptions); ``error`` is why the input was refused (then ``flat`` is empty).
    """

    x: object
    name: str
    flat: np.ndarray
    overflowed: bool = False
    dtype: str = "float32"
    error: Exception | None = None

    @classmethod
    def refused(cls, x, name: str, error: Exception) -> _Tensor:
        return cls(x, name, np.empty(0, dtype=np.float32), error=error)

    @classmethod
    def fused(cls, members: list[_Tensor]) -> _Tensor:
        """Return one bucket holding ``members`` end to end (all on the host, or all on
        one device)."""
        flat = array_module(members[0].flat).concatenate([t.flat for t in members])
        return cls(
            flat,
            "bucket:" + "|".join(t.name for t in members),
            flat,
            any(t.overflowed for t in members),
            "/".join(sorted({t.dtype for t in members})),
        )

    @property
    def what(self) -> str:
        """How messages name this tensor."""
        return f"gradient {self.name!r}" if self.name else "gradient"

    def result(self, avg: np.ndarray):
        """Return float32 ``avg`` in this input's framework, shape and dtype."""
        return _like(self.x, avg.reshape(_shape(self.x)))


def _restore(snapshots: list) -> None:
    """Put the residuals of ``snapshots`` back (a failed, skipped or rolled-back call)."""
    for snapshot in snapshots:
        snapshot.restore()


def _buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Group consecutive indices of tensors smaller than ``limit`` into buckets <= limit."""
    out, current, total = [], [], 0
    for i, n in enumerate(sizes):
        if n >= limit:
            if current:
                out.append(current)
                current, total = [], 0
            out.append([i])
            continue
        if total + n > limit and current:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        out.append(current)
    return out


def _shape(x) -> tuple:
    """Return the shape of input ``x``: an array's, a tensor's, or its CUDA array interface's."""
    if hasattr(x, "__cuda_array_interface__") and not hasattr(x, "shape"):
        return tuple(x.__cuda_array_interface__["shape"])
    return np.shape(x)


def _mpi_cuda_aware() -> str:
    """Return whether the MPI library takes GPU buffers, and how that was decided."""
    try:
        aware, how = cuda_aware()
    except ValueError as e:  # a bad MPICOMP_CUDA_AWARE
        return f"unknown ({e})"
    return f"{'yes' if aware else 'no'} ({how})"


def _dtype(x) -> str:
    """Return the name of ``x``'s dtype as the caller passed it (for debug descriptions)."""
    dt = getattr(x, "dtype", None)
    return str(dt).removeprefix("torch.") if dt is not None else type(x).__name__


def _raw(outcome: tuple) -> tuple:
    return outcome


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
    # _warn <- _deliver <- allreduce / Handle.wait <- the caller's line.
    warnings.warn(text, NonFiniteWarning, stacklevel=4)


def _like(x, avg: np.ndarray):
    """Return float32 ``avg`` in ``x``'s dtype and framework (NumPy, or the DLPack producer's)."""
    dtype = getattr(x, "dtype", None)
    if isinstance(x, np.ndarray) or is_device_array(x):
        return avg.astype(x.dtype, copy=False)
    if hasattr(x, "__cuda_array_interface__") and not hasattr(x, "__dlpack__"):
        # No framework to return it in: a CuPy array (or NumPy under cuda-emulated).
        return avg.astype(np.dtype(x.__cuda_array_interface__["typestr"]), copy=False)
    if isinstance(x, np.generic):
        return avg.astype(dtype).reshape(())[()]
    jax = sys.modules.get("jax")  # never imported here: a jax.Array means JAX already is
    if jax is not None and isinstance(x, jax.Array):
        # Its type lives in jaxlib, which has no from_dlpack: put it back where x was.
        return jax.device_put(jax.numpy.from_dlpack(avg).astype(x.dtype), x.sharding)
    # A DLPack producer (PyTorch): hand the result back through its own from_dlpack.
    lib = sys.modules.get(type(x).__module__.split(".")[0])
    from_dlpack = getattr(lib, "from_dlpack", None)
    result = from_dlpack(avg) if from_dlpack is not None else avg
    if dtype is not None and hasattr(result, "to"):
        result = result.to(dtype)
    return result
