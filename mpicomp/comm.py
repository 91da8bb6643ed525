"""CompressedComm: the one call a training loop makes instead of its all-reduce."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
import weakref
import zlib
from dataclasses import replace
from functools import partial

import numpy as np
from mpi4py import MPI

from mpicomp import _reduce, kernels
from mpicomp._arrays import to_float32
from mpicomp._progress import Handle, Worker
from mpicomp._reduce import NonFiniteWarning, RankError, Skipped
from mpicomp.codecs import Codec, ErrorFeedback
from mpicomp.codecs._base import check_number
from mpicomp.codecs._base import make as make_codec
from mpicomp.collectives import plain
from mpicomp.collectives._wait import resolve_timeout
from mpicomp.trace import NO_CLOCK

__all__ = ["CompressedComm", "Handle", "NonFiniteWarning", "RankError"]

# Biased gather codecs lose what they do not send unless it is fed back next step.
_FEEDBACK_DEFAULT = {"threelc", "topk", "fft", "fastsgd"}


class CompressedComm:
    """Average gradients over the ranks of ``comm`` through a compressing codec.

    Args:
        comm: an ``mpi4py.MPI.Comm``; a duplicate is kept, so mpicomp's messages never
            match the caller's.
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
        **codec_params: parameters of the codec when ``codec`` is a name.

    Every rank must make the same calls in the same order with tensors of the same
    sizes (as with any MPI collective); sizes that differ, or a NaN/Inf on one rank,
    raise an error on every rank instead of hanging. ``iallreduce`` calls count in
    the order they are started; one thread drives a CompressedComm.

    Raises:
        ValueError: ``background=True`` while MPI provides less than
            ``MPI_THREAD_MULTIPLE``.
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
        trace=None,
        trace_level: int = 1,
        trace_flush_every: int | None = 100,
        nonfinite: str = "raise",
        debug: bool | None = None,
        timeout: float | None = None,
        background: bool | None = None,
        **codec_params,
    ):
        if isinstance(codec, str):
            codec = make_codec(codec, **codec_params)
        elif codec_params:
            raise TypeError("codec parameters go with a codec name, not a made codec")
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a name or an mpicomp codec, got {codec!r}")
        self.codec = codec
        self.kernels = codec.kernels  # the backend of NumPy arrays, read when made
        self.min_numel = check_number("min_numel", min_numel, 0, None, integer=True)
        self.bucket_numel = check_number("bucket_numel", bucket_numel, 1, None, integer=True)
        if error_feedback is None:
            error_feedback = codec.name in _FEEDBACK_DEFAULT
        if error_feedback and codec.aggregation != "gather":
            raise ValueError(
                f"error_feedback applies to gather codecs; {codec.name!r} is {codec.aggregation!r}"
            )
        if sharded and codec.aggregation != "gather":
            raise ValueError(
                f"sharded applies to gather codecs; {codec.name!r} is {codec.aggregation!r}"
            )
        self.sharded = bool(sharded)
        # The reduction path (mpicomp._reduce.REDUCERS) of every compressed call.
        self._path = "sharded" if self.sharded else codec.aggregation
        if not isinstance(nonfinite, str):
            raise TypeError(f"nonfinite must be a str, got {type(nonfinite).__name__}")
        if nonfinite not in _reduce.POLICIES:
            raise ValueError(f"nonfinite must be one of {_reduce.POLICIES}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        if debug is None:
            debug = os.environ.get("MPICOMP_DEBUG", "") not in ("", "0")
        if not isinstance(debug, (bool, np.bool_)):
            raise TypeError(f"debug must be a bool or None, got {type(debug).__name__}")
        self.debug = bool(debug)
        # Checked now, so a bad value fails at construction, not in the first call.
        # 0 stays 0 (off, whatever the environment says); None defers to MPICOMP_TIMEOUT.
        self.timeout = None if timeout is None else (resolve_timeout(timeout) or 0)
        # A second thread making MPI calls needs MPI_THREAD_MULTIPLE (mpi4py asks for it),
        # and numba kernels on two threads at once a thread-safe threading layer.
        if background is not None and not isinstance(background, (bool, np.bool_)):
            raise TypeError(f"background must be a bool or None, got {type(background).__name__}")
        why = None
        if background is None or background:
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                why = f"MPI provides thread level {MPI.Query_thread()}, not MPI_THREAD_MULTIPLE"
            elif not kernels.threadsafe(self.kernels):
                why = "numba's threading layer is workqueue (install OpenMP or TBB)"
        if background and why:
            raise ValueError(
                f"background=True: {why} (see docs/usage.md, Overlapping communication)"
            )
        self.background = why is None if background is None else bool(background)
        self._eager_why = why if background is None else None  # warned once, at first use
        self._worker = None  # made by the first background iallreduce
        self._spare = {}  # pre-call copies of residuals, reused call after call
        self._feedback = ErrorFeedback(codec) if error_feedback else None
        self._server_feedback = ErrorFeedback(codec) if error_feedback and sharded else None
        self._plain = make_codec("none")
        self._comm = comm.Dup()
        self.rank = self._comm.rank
        self.size = self._comm.size
        self._calls = 0  # the step of the counter-based RNG: the same on every rank
        # A recorder of the collectives' exchange steps (``record(op, step, sent, recv,
        # bits)``, e.g. collectives.traffic.Traffic); with a trace it gets them too.
        self.tracer = None
        self.trace = None
        if trace is not None:
            from mpicomp.trace import Tracer

            try:
                self.trace = Tracer(
                    self._comm,
                    trace,
                    level=trace_level,
                    flush_every=trace_flush_every,
                    attrs=self._trace_attrs(),
                )
            except BaseException:
                self._comm.Free()
                raise

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
        return _deliver(self._job(x, name)())

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
        return self._start(self._job(x, name))

    def allreduce_many(self, arrays, names=None) -> list:
        """Return the averages of ``arrays``, fusing small tensors into buckets.

        Consecutive tensors smaller than ``bucket_numel`` share one buffer and one
        collective call; larger ones go alone. Pass the same list structure every step
        (bucket residuals are keyed by position and names).
        """
        self._check_open()
        self._drain()
        return _deliver(self._job_many(arrays, names)())

    def iallreduce_many(self, arrays, names=None) -> Handle:
        """Start ``allreduce_many(arrays, names)``; return a ``Handle`` whose ``wait()``
        gives its list of averages. The rules of ``iallreduce`` apply.

        Raises:
            RuntimeError: the CompressedComm is closed.
        """
        self._check_open()
        return self._start(self._job_many(arrays, names))

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
        # Leaving by an exception, other ranks may be elsewhere: a final gather could
        # hang, so the trace keeps what its earlier flushes wrote.
        self._close(flush_trace=exc_type is None)

    def __repr__(self) -> str:
        return f"CompressedComm(size={self.size}, codec={self.codec!r})"

    # -- internals -------------------------------------------------------------

    def _start(self, job) -> Handle:
        """Run ``job`` on the worker thread behind the calls started before (or now)."""
        if not self.background:
            if self._eager_why:
                why, self._eager_why = self._eager_why, None
                warnings.warn(
                    f"{why}: iallreduce runs each call at once in the caller's thread (no overlap)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            handle = Handle(_deliver)
            handle._run(job)
            return handle
        if self._worker is None:
            self._worker = Worker(f"mpicomp-worker-{self.rank}")
            # An unclosed communicator still finishes its started calls at exit.
            self._stop_worker = weakref.finalize(self, self._worker.stop)
        return self._worker.submit(job, _deliver)

    def _drain(self) -> None:
        """Wait until every started ``iallreduce`` has finished (errors stay in handles)."""
        if self._worker is not None:
            self._worker.drain()

    def _job(self, x, name: str):
        """Return the function that runs ``allreduce(x, name)``'s collectives.

        Reads and converts ``x`` now; the function returns (average, skip messages)
        and raises what the call raises.
        """
        try:
            flat, over = to_float32(x, what=f"gradient {name!r}" if name else "gradient")
            self._check_name(name)
        except (ValueError, TypeError) as e:
            return partial(self._fail, e)

        def run():
            try:
                avg = self._average(flat.reshape(-1), name, dtype=_dtype(x), over=over)
            except Skipped as e:
                return _like(x, np.zeros(np.shape(x), dtype=np.float32)), [e.message]
            return _like(x, avg.reshape(np.shape(x))), []

        return run

    def _job_many(self, arrays, names):
        """Return the function that runs ``allreduce_many(arrays, names)``'s collectives."""
        arrays = list(arrays)
        names = [f"#{i}" for i in range(len(arrays))] if names is None else list(names)
        try:
            if len(names) != len(arrays):
                raise ValueError(f"{len(names)} names for {len(arrays)} arrays")
            converted = [
                to_float32(a, what=f"gradient {n!r}") for a, n in zip(arrays, names, strict=True)
            ]
            for n in names:
                self._check_name(n)
        except (ValueError, TypeError) as e:
            return partial(self._fail, e)
        return partial(self._many, arrays, names, converted)

    def _many(self, arrays: list, names: list, converted: list):
        """Run the bucketed calls of ``allreduce_many``; return (averages, skip messages)."""
        flats = [f.reshape(-1) for f, _ in converted]
        out: list = [None] * len(arrays)
        skipped, ledger = [], []
        for members in _buckets([f.size for f in flats], self.bucket_numel):
            over = any(converted[i][1] for i in members)
            dtype = "/".join(sorted({_dtype(arrays[i]) for i in members}))
            if len(members) == 1:
                (i,) = members
                call = (flats[i], names[i], "allreduce_many")
                layout = None
            else:
                fused = np.concatenate([flats[i] for i in members])
                bucket = "bucket:" + "|".join(names[i] for i in members)
                sizes = ",".join(str(flats[i].size) for i in members)
                layout = zlib.crc32(f"{bucket}/{sizes}".encode())
                call = (fused, bucket, "allreduce_many bucket")
            try:
                avg = self._average(*call, layout, dtype=dtype, over=over, ledger=ledger)
            except Skipped as e:
                # The later buckets still run (every rank makes their calls), but
                # skip_step means no update at all: zeros and residuals rolled back below.
                skipped.append(e.message)
                avg = np.zeros(call[0].size, dtype=np.float32)
            start = 0
            for i in members:
                part = avg[start : start + flats[i].size]
                out[i] = _like(arrays[i], part.reshape(np.shape(arrays[i])))
                start += flats[i].size
        if skipped:
            for keys, saved in ledger:
                self._restore(keys, saved)
            out = [_like(a, np.zeros(np.shape(a), dtype=np.float32)) for a in arrays]
        return out, skipped

    def _check_open(self):
        if self._comm is None:
            raise RuntimeError("CompressedComm is closed")

    def _check_name(self, name: str) -> None:
        if self._feedback is not None and not name:
            raise ValueError(
                "error feedback keeps one residual per tensor: pass name= (the same each step)"
            )

    def _fail(self, error: Exception):
        """Raise ``error`` here and a RankError on every other rank, in step with them."""
        self._calls += 1  # the other ranks count this call: keep the RNG step aligned
        if self.debug:
            self._check_same_call(None)
        _reduce.fail(_reduce.Call(self._comm, tracer=self.tracer, timeout=self.timeout), error)

    def _check_same_call(self, call: str | None) -> None:
        """Raise RankError on every rank unless all ranks describe the same ``call``.

        One 8-byte hash per rank (Allgather); the descriptions themselves travel
        only when hashes differ. A rank whose input was refused brings None (hash
        0) and is left out: the agreement that follows reports it.
        """
        desc = None if call is None else f"{call}\n{self.codec!r}, nonfinite={self.nonfinite!r}"
        h = 0
        if desc is not None:
            h = int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=8).digest(), "little")
            h |= 1  # 0 means "refused"
        hashes = np.empty(self.size, dtype=np.uint64)
        plain.allgather(self._comm, np.array([h], dtype=np.uint64), hashes, timeout=self.timeout)
        live = np.flatnonzero(hashes)
        if live.size == 0 or (hashes[live] == hashes[live[0]]).all():
            return
        from mpicomp.collectives.allgather import allgather_bytes

        mine = np.frombuffer((desc or "").encode(), dtype=np.uint8).copy()
        descs = [bytes(p).decode() for p in allgather_bytes(self._comm, mine, timeout=self.timeout)]
        ref = int(live[0])
        ref_call, ref_conf = descs[ref].split("\n", 1)
        parts = []
        for r in live.tolist():
            if hashes[r] == hashes[ref]:
                continue
            r_call, r_conf = descs[r].split("\n", 1)
            parts.append(
                f"rank {r} called {r_call}" + (f" with {r_conf}" if r_conf != ref_conf else "")
            )
        conf = (
            "" if all(d.split("\n", 1)[1] == ref_conf for d in descs if d) else f" with {ref_conf}"
        )
        raise RankError(f"{'; '.join(parts)} while rank {ref} called {ref_call}{conf}")

    def _residual_keys(self, name: str) -> list:
        """Return the (ErrorFeedback, key) pairs a compressed call of ``name`` may update."""
        if self._feedback is None:
            return []
        if not self.sharded:
            return [(self._feedback, name)]
        keys = [(self._feedback, f"{name}#shard{s}") for s in range(self.size)]
        return keys + [(self._server_feedback, name)]

    def _save(self, keys: list) -> set:
        """Copy the residuals of ``keys`` into spare buffers; return the keys that had one."""
        saved = set()
        for fb, key in keys:
            r = fb.residual(key)
            if r is None:
                continue
            spare = self._spare.get((id(fb), key))
            if spare is None or spare.shape != r.shape or type(spare) is not type(r):
                spare = self._spare[(id(fb), key)] = kernels.backend_of(r).xp.empty_like(r)
            spare[...] = r
            saved.add((id(fb), key))
        return saved

    def _restore(self, keys: list, saved: set) -> None:
        """Put the residuals of ``keys`` back as ``_save`` found them (none: zeros)."""
        for fb, key in keys:
            r = fb.residual(key)
            if r is not None:
                r[...] = self._spare[(id(fb), key)] if (id(fb), key) in saved else 0

    def _close(self, flush_trace: bool) -> None:
        if self._comm is None:
            return
        if self._worker is not None:
            # Started calls use the communicator: they finish before it is freed.
            self._stop_worker()
            self._worker = None
        try:
            if self.trace is not None and flush_trace:
                self.trace.close()
        finally:
            self._comm.Free()
            self._comm = None

    def _trace_attrs(self) -> dict:
        """Return the run attributes a trace records about this CompressedComm."""
        return {
            "backend": self.kernels.name,
            "cuda_aware": False,
            "codec": self.codec.name,
            "codec_params": json.dumps(self.codec.params, sort_keys=True, default=str),
            "min_numel": self.min_numel,
            "bucket_numel": self.bucket_numel,
            "error_feedback": self._feedback is not None,
            "sharded": self.sharded,
        }

    def _average(
        self,
        flat: np.ndarray,
        name: str,
        op: str = "allreduce",
        layout: int | None = None,
        *,
        dtype: str = "float32",
        over: bool = False,
        ledger: list | None = None,
    ) -> np.ndarray:
        """Return the average of ``flat`` over ranks: one collective call.

        Error-feedback residuals are copied before the call and put back when it
        fails or is skipped, so such a call changes no residual on any rank; the
        copies are appended to ``ledger`` for a caller that may roll back later.

        Raises:
            Skipped: under ``nonfinite="skip_step"``, when some rank held NaN/Inf.
        """
        step = self._calls
        self._calls += 1
        if self.debug:
            self._check_same_call(f"{op}({name!r}, {flat.size} {dtype})")
        # Below min_numel every codec, fp16 included, steps aside for a float32 sum.
        uncompressed = flat.size < self.min_numel and self.codec.name != "none"
        # Names (and bucket layouts) take part in the agreement: ranks calling with
        # tensors in different orders raise instead of mixing them.
        if layout is None:
            layout = zlib.crc32(name.encode())
        keys = [] if uncompressed else self._residual_keys(name)
        saved = self._save(keys)
        if ledger is not None:
            ledger.append((keys, saved))
        what = f"gradient {name!r}" if name else "gradient"
        restore = (lambda: self._restore(keys, saved)) if keys else None  # noqa: E731
        guard = _reduce.Guard(self.nonfinite, what, over, restore)
        trace = self.trace
        call = _reduce.Call(
            self._comm, step, self.tracer, NO_CLOCK, layout, guard, self.timeout, self.kernels
        )
        # Below min_numel every codec steps aside for the float32 sum of `none`.
        codec = self._plain if uncompressed else self.codec
        reduce = _reduce.REDUCERS["sum" if uncompressed else self._path]
        encoders = None if uncompressed else self._encoders(name)
        try:
            if trace is None:
                return reduce(call, codec, flat, encoders)
            trace.begin(
                step,
                f"{op} below min_numel" if uncompressed else op,
                codec.name,
                name,
                flat.size,
                self.tracer,
            )
            try:
                out = reduce(replace(call, tracer=trace, clock=trace), codec, flat, encoders)
            except Skipped:
                trace.end()  # a skipped call still exchanged its agreement: keep its event
                raise
            trace.end()
            return out
        except BaseException:
            self._restore(keys, saved)
            raise

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


def _dtype(x) -> str:
    """Return the name of ``x``'s dtype as the caller passed it (for debug descriptions)."""
    dt = getattr(x, "dtype", None)
    return str(dt).removeprefix("torch.") if dt is not None else type(x).__name__


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
    if isinstance(x, np.ndarray):
        return avg.astype(x.dtype, copy=False)
    if isinstance(x, np.generic):
        return avg.astype(dtype).reshape(())[()]
    # A DLPack producer (PyTorch, JAX): hand the result back through its own from_dlpack.
    lib = sys.modules.get(type(x).__module__.split(".")[0])
    from_dlpack = getattr(lib, "from_dlpack", None)
    result = from_dlpack(avg) if from_dlpack is not None else avg
    if dtype is not None and hasattr(result, "to"):
        result = result.to(dtype)
    return result
