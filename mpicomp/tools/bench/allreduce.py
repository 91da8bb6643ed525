"""End-to-end all-reduce: every codec through CompressedComm against MPI_Allreduce of float32.

For each gradient size and codec, one ``CompressedComm(...).allreduce`` per repetition
after a warm-up call: the time is the slowest rank's, median over repetitions; the bytes
are what a ``mpicomp.collectives.traffic.Traffic`` attached as ``recorder`` counted per call,
the largest over ranks; the encode / exchange / decode split comes from the trace of
those calls. Both are compared with ``comm.Allreduce`` of the same float32 buffer in the
same run: its time, and the 2(N-1)/N * 4n bytes a ring (bandwidth-optimal) float32
all-reduce sends and receives per rank. On a device backend (``cuda``: CuPy arrays) the
gradient lives on the device and the reference is ``MPI_Allreduce`` of that device
buffer, staged through pinned host buffers and, where the MPI library is CUDA-aware,
handed to MPI directly. ``mpicomp bench`` and ``jobs/bench.py`` run :func:`measure`;
``mpicomp.tools.bench.report`` prints its rows.

The one module of ``mpicomp.tools.bench`` that imports ``mpi4py.MPI`` at import time, so the
package's ``__init__`` imports it only when an all-reduce is measured.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from time import perf_counter

import numpy as np
from mpi4py import MPI

import mpicomp.kernels as K
from mpicomp.codecs import codec as make_codec
from mpicomp.collectives import plain
from mpicomp.collectives.traffic import Traffic
from mpicomp.comm import CompressedComm
from mpicomp.model import probe
from mpicomp.model.cost import FLOAT32, Topology, predict
from mpicomp.model.cost import schedules_of as candidate_schedules
from mpicomp.model.measured import codec_key
from mpicomp.reduction import AUTO, kind_of
from mpicomp.reduction.low_rank import matrix_view
from mpicomp.reduction.transport import cuda_aware
from mpicomp.tools.bench._countdown import Countdown
from mpicomp.tools.bench.kernels import kernel_backend
from mpicomp.tools.bench.workload import label


def slowest_median(comm, fn, reps: int, warmup: bool = True) -> float:
    """Return the median over ``reps`` calls of the slowest rank's time of ``fn()``.

    One warm-up call first (unless ``warmup`` is False); a barrier before each timed
    call, so every rank starts together.
    """
    if warmup:
        fn()
    times = np.empty(reps)
    for i in range(reps):
        plain.barrier(comm)
        t0 = perf_counter()
        fn()
        times[i] = perf_counter() - t0
    slowest = np.empty_like(times)
    plain.allreduce(comm, times, slowest, MPI.MAX)
    return float(np.median(slowest))


def bytes_per_call(comm, traffic: Traffic, calls: int) -> tuple[int, int, float, float]:
    """Return what ``traffic`` counted over ``calls`` calls, per call: the bytes sent and
    received, each the largest over ranks, then both summed over ranks (collective)."""
    mine = np.array([traffic.sent, traffic.recv], dtype=np.float64) / calls
    most = np.empty_like(mine)
    plain.allreduce(comm, mine, most, MPI.MAX)
    totals = np.empty_like(mine)
    plain.allreduce(comm, mine, totals, MPI.SUM)
    sent, recv = (int(round(v)) for v in most)
    return sent, recv, float(totals[0]), float(totals[1])


def tc_sent_bytes(dev: str) -> int:
    """Return the bytes ``tc -s qdisc show dev DEV`` says the device's root qdisc sent.

    ``dev`` is a device of this network namespace, or ``NETNS/DEV`` for one in the
    named namespace (``tc -n NETNS``; root reads any).

    Raises:
        RuntimeError: ``tc`` is missing, fails, or prints no counter for ``dev``.
    """
    tc = shutil.which("tc") or next(
        (p for p in ("/usr/sbin/tc", "/sbin/tc") if os.access(p, os.X_OK)), None
    )
    if tc is None:
        raise RuntimeError("tc (iproute2) not found: needed for --tc-dev")
    netns, _, name = dev.rpartition("/")
    where = ["-n", netns] if netns else []
    out = subprocess.run(
        [tc, *where, "-s", "qdisc", "show", "dev", name],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Sent (\d+) bytes", out.stdout)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"tc -s qdisc show dev {dev}: {out.stderr.strip() or out.stdout!r}")
    return int(found.group(1))


class _Counter:
    """Device bytes around a measurement, summed over ``devs``, read on rank 0 (a
    counter belongs to a host, not to a rank)."""

    def __init__(self, comm, devs: list[str] | None):
        self.comm, self.devs = comm, devs or []

    def read(self) -> dict[str, int] | None:
        """Return ``{dev: bytes sent so far}`` on every rank (None without devices)."""
        if not self.devs:
            return None
        value = error = None
        if self.comm.rank == 0:
            try:
                value = {dev: tc_sent_bytes(dev) for dev in self.devs}
            except RuntimeError as e:
                error = str(e)
        value, error = plain.bcast_object(self.comm, (value, error))
        if error is not None:  # on every rank, so none waits for the others
            raise RuntimeError(error)
        return value


def _per_call(before: dict[str, int], after: dict[str, int], calls: int) -> dict[str, float]:
    return {dev: (after[dev] - before[dev]) / calls for dev in before}


def _trace_path(trace_dir: str, numel: int, name: str, params: dict, schedule: str) -> str:
    tag = "-".join([str(numel), name] + [f"{k}{v}" for k, v in params.items()] + [schedule])
    return os.path.join(trace_dir, f"{tag}.h5")


def schedules_of(name: str, params: dict, asked, topology: Topology | None = None) -> list[str]:
    """Return the schedules to measure of codec ``name``: ``asked`` None, its default;
    ``"all"``, every one ``schedule="auto"`` chooses among on ``topology`` (its own, the
    hierarchical ones where the hosts allow; not float32, every row's reference) and
    ``"auto"`` itself; a list, those of them it has, float32 included (its default if
    none)."""
    codec = make_codec(name, **params)
    default = kind_of(codec).default
    if asked is None:
        return [default]
    candidates = candidate_schedules(codec, topology or Topology())
    if len(candidates) > 1:  # something to choose among
        candidates += (AUTO,)
    if asked == "all":  # float32 is every row's reference already
        return [s for s in candidates if s != FLOAT32]
    return [s for s in candidates if s in asked] or [default]


def run_model(comm, codecs, given=None, numel: int = 0):
    """Return the model every CompressedComm of a run predicts with (collective): ``given``
    (a Model or a file) with the speeds it lacks for ``codecs`` measured now, else one
    measured now (``mpicomp.model.probe.measure``), so that none measures again. Speeds are
    measured on ``numel`` elements (0: ``mpicomp.model.probe.SPEED_NUMEL``): the run's largest
    size, since compute per element grows with size past the caches (FFT, top-k)."""
    made = [make_codec(name, **params) for name, params in codecs]
    made = [c for c in made if c.compresses]
    numel = numel or probe.SPEED_NUMEL
    node = probe.host_comm(comm)
    try:
        if given is None:
            return probe.measure(comm, node, made, numel)
        model = probe.resolve(comm, node, make_codec("none"), given)
        missing = [c for c in made if codec_key(c) not in model.speeds]
        return model.with_speeds(probe.measured_speeds(comm, missing, numel))
    finally:
        node.Free()


def _topology(comm) -> Topology:
    node = probe.host_comm(comm)
    try:
        return probe.topology(comm, node)
    finally:
        node.Free()


def _finite(v: float) -> float | None:
    return None if v != v else float(v)  # NaN (no model) as JSON's null


def _on_rank_0(comm, fn):
    """Return ``fn()``, run on rank 0 alone, on every rank; if it raises there, every rank
    raises a RuntimeError saying what (none is left waiting)."""
    value = error = None
    if comm.rank == 0:
        try:
            value = fn()
        except Exception as e:  # raised on every rank below
            error = e
    why = None if error is None else f"rank 0: {type(error).__name__}: {error}"
    value, why = plain.bcast_object(comm, (value, why))
    if why is not None:
        raise RuntimeError(why) from error
    return value


def _backend_on_every_rank(comm, name: str | None):
    """Return the backend record ``name`` (None: ``MPICOMP_KERNELS``'s); if any rank cannot
    start it (no GPU there), every rank raises a RuntimeError saying why."""
    rec = mine = None
    try:
        rec = kernel_backend(name)
    except RuntimeError as e:
        mine = e
    errors = plain.allgather_object(comm, None if mine is None else str(mine))
    if mine is not None:
        raise mine
    for rank, why in enumerate(errors):
        if why is not None:
            raise RuntimeError(f"rank {rank}: {why}")
    return rec


@contextlib.contextmanager
def _traces_in(comm, trace_dir: str | None):
    """Yield the directory the traces go to, the same path on every rank: ``trace_dir``
    (made if missing, kept), else a temporary directory removed afterwards. Rank 0 alone
    writes trace files, so it makes the directory, on its own node."""

    def make() -> str:
        if trace_dir is None:
            return tempfile.mkdtemp(prefix="mpicomp-bench-")
        os.makedirs(trace_dir, exist_ok=True)
        return trace_dir

    where = _on_rank_0(comm, make)
    try:
        yield where
    finally:
        if trace_dir is None and comm.rank == 0:
            shutil.rmtree(where, ignore_errors=True)


@contextlib.contextmanager
def _host_kernels(name: str | None):
    """Select backend ``name`` for NumPy arrays while a CompressedComm is made (None: leave
    ``MPICOMP_KERNELS`` alone): it and the codecs it makes (its own, and the float32 one
    below ``min_numel``) read the variable then, and keep that backend. Restored after."""
    if name is None:
        yield
        return
    saved = os.environ.get(K.ENV)
    os.environ[K.ENV] = name
    try:
        yield
    finally:
        if saved is None:
            del os.environ[K.ENV]
        else:
            os.environ[K.ENV] = saved


def phase_split(path: str) -> dict:
    """Return the per-call phase seconds of a bench trace and the transport it recorded.

    The first call (the warm-up, as ``mpicomp trace summary`` takes it:
    ``mpicomp.trace.report.warmup_mask``) is left out. For each later call the slowest rank's
    event (largest ``t_total``) is kept; ``encode_s``, ``exchange_s`` (the trace's
    ``t_comm``: every message, waiting for other ranks included) and ``decode_s`` are the
    medians over calls of its ``t_encode``, ``t_comm`` and ``t_decode``; ``transport`` is
    the trace's ``device_transport`` attribute.

    Raises:
        ValueError: ``path`` is not a readable mpicomp trace, or holds no timed call.
    """
    from mpicomp.trace.report import read, warmup_mask

    events, _, attrs = read(path)
    warm = warmup_mask(events)
    timed = events[~warm] if warm.any() else events[:0]  # one call: the warm-up alone
    if timed.size == 0:
        raise ValueError(f"{path}: no call after the warm-up")
    _, first = np.unique(timed["call"], return_index=True)  # rows: by call, then rank
    per_call = np.split(timed, first[1:])
    slowest = np.stack([rows[np.argmax(rows["t_total"])] for rows in per_call])
    return {
        "encode_s": float(np.median(slowest["t_encode"])),
        "exchange_s": float(np.median(slowest["t_comm"])),
        "decode_s": float(np.median(slowest["t_decode"])),
        "transport": attrs.get("device_transport"),
    }


def _host_float32(rec, n: int) -> np.ndarray:
    """Return ``n`` float32 values of host memory, pinned where ``rec``'s device can pin
    (as CompressedComm's staging buffers are), else ordinary."""
    pinned = getattr(getattr(rec, "device", None), "pinned", None)
    nbytes = 4 * n
    raw = pinned(nbytes) if pinned is not None else np.empty(nbytes, np.uint8)
    return raw[:nbytes].view(np.float32)


def device_references(comm, rec, x, reps: int) -> tuple[float, float | None]:
    """Return the times of ``MPI_Allreduce`` of device array ``x`` (float32): staged, and
    direct (None unless ``cuda_aware()``); the slowest rank's, median of ``reps``.

    Staged: ``x`` copied into a pinned host buffer, ``comm.Allreduce`` of host buffers,
    the sum copied back into a device array, then a device synchronize: all three timed.
    Direct: a device synchronize (MPI knows nothing of pending kernels), then
    ``comm.Allreduce`` of the device arrays themselves, which only a CUDA-aware MPI takes.
    """
    sync = getattr(rec, "synchronize", None) or (lambda: None)
    out = rec.xp.empty_like(x)
    send, recv = _host_float32(rec, x.size), _host_float32(rec, x.size)

    def staged():
        rec.to_host(x, out=send, why="bench: staged MPI_Allreduce, device to host")
        plain.allreduce(comm, send, recv, MPI.SUM)
        out.set(recv)
        sync()

    def direct():
        sync()
        plain.allreduce(comm, x, out, MPI.SUM)

    t_staged = slowest_median(comm, staged, reps)
    t_direct = slowest_median(comm, direct, reps) if cuda_aware()[0] else None
    return t_staged, t_direct


def measure(
    comm,
    numel: int,
    codecs,
    reps: int,
    progress=None,
    *,
    trace_dir: str | None = None,
    tc_dev: str | list[str] | None = None,
    backend: str | None = None,
    schedules=None,
    model=None,
) -> list[dict]:
    """Return one row per codec and schedule of all-reduces of ``numel`` float32 values
    on ``comm``.

    Args:
        comm: the communicator to benchmark on (every rank calls this).
        numel: elements of the gradient (each rank draws its own).
        codecs: (name, params) pairs, as ``mpicomp.tools.bench.codec_set`` returns.
        reps: timed repetitions per measurement, after one warm-up.
        progress: a stream for one line per codec on rank 0 (None: silent).
        trace_dir: a directory (made on rank 0 if missing): each codec's calls are
            traced to ``<numel>-<codec>[-<params>].h5`` there (docs/trace-format.md)
            and kept. Without it they are traced to a temporary directory, removed
            once the phase split is read. The timed calls are traced either way.
        tc_dev: network devices (``DEV`` or ``NETNS/DEV``, a list or one name) whose
            root qdiscs count bytes (``tc -s qdisc``, read on rank 0): each row gets
            their bytes of its measurement (warm-up included), summed and per device,
            to check against what the ranks say they received.
        backend: the kernel backend (None: what ``MPICOMP_KERNELS`` selects). A host
            backend (``numba``, ``cuda-emulated``) computes on NumPy gradients; on a
            device backend (``cuda``: CuPy) each rank's gradient is placed on the
            device and CompressedComm gets the device array.
        schedules: which ``CompressedComm(schedule=...)`` each codec runs (see
            :func:`schedules_of`): None its default, ``"all"`` every candidate of
            ``schedule="auto"`` here and ``"auto"``, or a list of names.
        model: what every CompressedComm predicts its time with (``mpicomp.model.Model``
            or a file; see :func:`run_model`); None: measured here when ``schedules``
            is given, else no predictions.

    Returns:
        One dict per codec and schedule: ``numel``, ``nranks``, ``codec``, ``params``,
        ``schedule``, ``backend``,
        ``time_s`` and ``allreduce_s`` (slowest rank, median), ``time_ratio`` (their
        quotient), ``speedup`` (its inverse), ``bytes_sent``/``bytes_recv`` (per call,
        the largest over ranks), ``allreduce_bytes`` (float32 ring, per rank),
        ``sent_ratio``/``recv_ratio``, ``sent_total``/``recv_total`` (per call, summed over ranks),
        ``encode_s``/``exchange_s``/``decode_s`` (per call: the slowest rank's phases,
        median over the timed calls; see :func:`phase_split`), ``chosen`` (the schedule
        the call ran by: ``auto``'s choice), ``predicted_s`` and ``allreduce_predicted_s``
        (the model's times of ``chosen`` and of the float32 MPI_Allreduce; None without
        a model), ``hosts`` and ``ranks_per_host``, and with ``tc_dev``:
        ``device_bytes`` (per call, summed over the devices), ``device_links`` (per
        call, per device) and ``device_over_recv``
        (device bytes over ``recv_total``: every byte crosses the device once, on its
        way to the rank that receives it); the float32 MPI_Allreduce's own device bytes
        are ``allreduce_device_bytes`` and ``allreduce_device_links`` (the staged
        one on a device backend).
        On a device backend also ``transport`` (``"direct"`` or ``"staged"``: how
        CompressedComm's device buffers reached MPI), ``allreduce_staged_s`` and
        ``allreduce_direct_s`` (:func:`device_references`; direct None when the MPI
        library is not CUDA-aware) and ``time_ratio_staged``/``time_ratio_direct``
        (``time_s`` over each; None without direct); ``allreduce_s`` is the reference of
        the row's own transport.

    Raises:
        RuntimeError: the backend cannot start on some rank, or rank 0 could not make
            ``trace_dir`` or read a trace (on every rank).
    """
    rec = _backend_on_every_rank(comm, backend)
    device = rec.xp is not np
    sync = (getattr(rec, "synchronize", None) or (lambda: None)) if device else (lambda: None)
    n, size = numel, comm.size
    host = probe.gradient(n, seed=comm.rank)
    x = rec.xp.asarray(host) if device else host
    counter = _Counter(comm, [tc_dev] if isinstance(tc_dev, str) else tc_dev)
    before = counter.read()
    if device:
        t_staged, t_direct = device_references(comm, rec, x, reps)
    else:
        out = np.empty_like(host)
        t_staged = slowest_median(comm, lambda: plain.allreduce(comm, host, out, MPI.SUM), reps)
        t_direct = None
    after = counter.read()
    ref_links = None if before is None else _per_call(before, after, reps + 1)
    ring_bytes = 2 * (size - 1) * 4 * n // size  # float32 ring all-reduce, per rank
    topology = _topology(comm)
    if schedules is not None or model is not None:
        model = run_model(comm, codecs, model, n)
    rows = []
    runs = [(nm, pr, sch) for nm, pr in codecs for sch in schedules_of(nm, pr, schedules, topology)]
    with _traces_in(comm, trace_dir) as where:
        countdown = Countdown(len(runs), progress if comm.rank == 0 else None)
        for name, params, schedule in runs:
            countdown.next(f"{n:,} elements, {f'{name} {label(params)}'.strip()}, {schedule}")
            path = _trace_path(where, n, name, params, schedule)
            # Written at close only: no flush inside the timed calls.
            with _host_kernels(None if device else rec.name):
                cc = CompressedComm(
                    comm,
                    name,
                    trace=path,
                    trace_flush_every=None,
                    schedule=schedule,
                    model=model,
                    **params,
                )
            # A low-rank codec factors matrices: the flat gradient stands for one.
            g = matrix_view(x) if kind_of(cc.codec).shaped else x
            with cc:
                traffic = Traffic()

                def call(cc=cc, g=g):
                    cc.allreduce(g, name="grad")
                    sync()  # a device result is done when the clock stops

                cc.recorder = traffic
                before = counter.read()
                t = slowest_median(comm, call, reps)
                after = counter.read()
                chosen, predicted = cc.schedule_for(n)
            phases = _on_rank_0(comm, lambda path=path: phase_split(path))
            calls = reps + 1  # the warm-up call is traced too: bytes are a mean per call
            sent, recv, total, total_recv = bytes_per_call(comm, traffic, calls)
            direct = device and phases["transport"] == "direct" and t_direct is not None
            t_ref = t_direct if direct else t_staged
            row = {
                "numel": n,
                "nranks": size,
                "codec": name,
                "params": dict(params),
                "schedule": schedule,
                "backend": rec.name if device else cc.kernels.name,
                "time_s": t,
                "allreduce_s": t_ref,
                "time_ratio": t / t_ref,
                "speedup": t_ref / t,
                "bytes_sent": sent,
                "bytes_recv": recv,
                "sent_total": int(round(total)),
                "recv_total": int(round(total_recv)),
                "allreduce_bytes": ring_bytes,
                "sent_ratio": sent / ring_bytes if ring_bytes else None,
                "recv_ratio": recv / ring_bytes if ring_bytes else None,
                "encode_s": phases["encode_s"],
                "exchange_s": phases["exchange_s"],
                "decode_s": phases["decode_s"],
                "chosen": chosen,
                "predicted_s": _finite(predicted),
                "allreduce_predicted_s": (
                    None if model is None else predict(FLOAT32, cc.codec, n, topology, model)
                ),
                "hosts": topology.hosts,
                "ranks_per_host": topology.per_host,
            }
            if device:
                row["transport"] = phases["transport"]
                row["allreduce_staged_s"] = t_staged
                row["allreduce_direct_s"] = t_direct
                row["time_ratio_staged"] = t / t_staged
                row["time_ratio_direct"] = None if t_direct is None else t / t_direct
            if trace_dir is not None:
                row["trace"] = path
            if before is not None:
                links = _per_call(before, after, calls)
                device_bytes = sum(links.values())
                row["device_links"] = {dev: int(round(v)) for dev, v in links.items()}
                row["device_bytes"] = int(round(device_bytes))
                row["device_over_recv"] = device_bytes / total_recv if total_recv else None
                row["allreduce_device_bytes"] = int(round(sum(ref_links.values())))
                row["allreduce_device_links"] = {d: int(round(v)) for d, v in ref_links.items()}
            rows.append(row)
    return rows
