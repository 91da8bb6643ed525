"""End-to-end all-reduce: every codec through CompressedComm against MPI_Allreduce of float32.

For each gradient size and codec, one ``CompressedComm(...).allreduce`` per repetition
after a warm-up call: the time is the slowest rank's, median over repetitions; the bytes
are what a ``mpicomp.collectives.traffic.Traffic`` attached as ``recorder`` counted per call,
the largest over ranks. Both are compared with ``comm.Allreduce`` of the same float32
buffer in the same run: its time, and the 2(N-1)/N * 4n bytes a ring (bandwidth-optimal)
float32 all-reduce sends and receives per rank. ``mpicomp bench`` and ``jobs/bench.py``
run :func:`measure`; ``mpicomp.bench.report`` prints its rows.

The one module of ``mpicomp.bench`` that imports ``mpi4py.MPI`` at import time, so the
package's ``__init__`` imports it only when an all-reduce is measured.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from time import perf_counter

import numpy as np
from mpi4py import MPI

import mpicomp
from mpicomp.bench.workload import gradient, label
from mpicomp.collectives.traffic import Traffic


def slowest_median(comm, fn, reps: int, warmup: bool = True) -> float:
    """Return the median over ``reps`` calls of the slowest rank's time of ``fn()``.

    One warm-up call first (unless ``warmup`` is False); a barrier before each timed
    call, so every rank starts together.
    """
    if warmup:
        fn()
    times = np.empty(reps)
    for i in range(reps):
        comm.Barrier()
        t0 = perf_counter()
        fn()
        times[i] = perf_counter() - t0
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return float(np.median(slowest))


def tc_sent_bytes(dev: str) -> int:
    """Return the bytes ``tc -s qdisc show dev DEV`` says the device's root qdisc sent.

    Raises:
        RuntimeError: ``tc`` is missing, fails, or prints no counter for ``dev``.
    """
    tc = shutil.which("tc") or next(
        (p for p in ("/usr/sbin/tc", "/sbin/tc") if os.access(p, os.X_OK)), None
    )
    if tc is None:
        raise RuntimeError("tc (iproute2) not found: needed for --tc-dev")
    out = subprocess.run(
        [tc, "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True, check=False
    )
    found = re.search(r"Sent (\d+) bytes", out.stdout)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"tc -s qdisc show dev {dev}: {out.stderr.strip() or out.stdout!r}")
    return int(found.group(1))


class _Counter:
    """Device bytes around a measurement, read on rank 0 (the counter is per host)."""

    def __init__(self, comm, dev: str | None):
        self.comm, self.dev = comm, dev

    def read(self) -> int | None:
        if self.dev is None:
            return None
        value = error = None
        if self.comm.rank == 0:
            try:
                value = tc_sent_bytes(self.dev)
            except RuntimeError as e:
                error = str(e)
        value, error = self.comm.bcast((value, error), root=0)
        if error is not None:  # on every rank, so none waits for the others
            raise RuntimeError(error)
        return value


def _trace_path(trace_dir: str | None, numel: int, name: str, params: dict) -> str | None:
    if trace_dir is None:
        return None
    tag = "-".join([str(numel), name] + [f"{k}{v}" for k, v in params.items()])
    return os.path.join(trace_dir, f"{tag}.h5")


def measure(
    comm,
    numel: int,
    codecs,
    reps: int,
    progress=None,
    *,
    trace_dir: str | None = None,
    tc_dev: str | None = None,
) -> list[dict]:
    """Return one row per codec of all-reduces of ``numel`` float32 values on ``comm``.

    Args:
        comm: the communicator to benchmark on (every rank calls this).
        numel: elements of the gradient (each rank draws its own).
        codecs: (name, params) pairs, as ``mpicomp.bench.codec_set`` returns.
        reps: timed repetitions per measurement, after one warm-up.
        progress: a stream for one line per codec on rank 0 (None: silent).
        trace_dir: a directory (made on rank 0 if missing): each codec's calls are
            traced to ``<numel>-<codec>[-<params>].h5`` there (docs/trace-format.md).
        tc_dev: a network device whose root qdisc counts bytes (``tc -s qdisc``, read on
            rank 0): each row gets the device bytes of its measurement (warm-up
            included), to check against what the ranks say they sent.

    Returns:
        One dict per codec: ``numel``, ``nranks``, ``codec``, ``params``, ``backend``,
        ``time_s`` and ``allreduce_s`` (slowest rank, median), ``time_ratio`` (their
        quotient), ``speedup`` (its inverse), ``bytes_sent``/``bytes_recv`` (per call,
        the largest over ranks), ``allreduce_bytes`` (float32 ring, per rank),
        ``sent_ratio``/``recv_ratio``, ``sent_total``/``recv_total`` (per call, summed over ranks),
        and with ``tc_dev``: ``device_bytes`` (per call) and ``device_over_recv``
        (device bytes over ``recv_total``: every byte crosses the device once, on its
        way to the rank that receives it); the float32 MPI_Allreduce's own device bytes
        are ``allreduce_device_bytes``.
    """
    n, size = numel, comm.size
    x = gradient(n, seed=comm.rank)
    out = np.empty_like(x)
    counter = _Counter(comm, tc_dev)
    if trace_dir is not None and comm.rank == 0:
        os.makedirs(trace_dir, exist_ok=True)
    before = counter.read()
    t_ref = slowest_median(comm, lambda: comm.Allreduce(x, out, op=MPI.SUM), reps)
    after = counter.read()
    ref_device = None if before is None else (after - before) / (reps + 1)
    ring_bytes = 2 * (size - 1) * 4 * n // size  # float32 ring all-reduce, per rank
    rows = []
    for i, (name, params) in enumerate(codecs, 1):
        if progress is not None and comm.rank == 0:
            what = f"{name} {label(params)}".strip()
            print(f"bench: {n:,} elements, {what} ({i}/{len(codecs)})", file=progress, flush=True)
        path = _trace_path(trace_dir, n, name, params)
        with mpicomp.CompressedComm(comm, name, trace=path, **params) as cc:
            traffic = Traffic()

            def call(cc=cc):
                cc.allreduce(x, name="grad")

            cc.recorder = traffic
            before = counter.read()
            t = slowest_median(comm, call, reps)
            after = counter.read()
        calls = reps + 1  # the warm-up call is traced too: bytes are a mean per call
        mine = np.array([traffic.sent, traffic.recv], dtype=np.float64) / calls
        most = np.empty_like(mine)
        comm.Allreduce(mine, most, op=MPI.MAX)
        total, total_recv = comm.allreduce(mine, op=MPI.SUM)
        sent, recv = (int(round(v)) for v in most)
        row = {
            "numel": n,
            "nranks": size,
            "codec": name,
            "params": dict(params),
            "backend": cc.kernels.name,
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
        }
        if path is not None:
            row["trace"] = path
        if before is not None:
            device = (after - before) / calls
            row["device_bytes"] = int(round(device))
            row["device_over_recv"] = device / total_recv if total_recv else None
            row["allreduce_device_bytes"] = int(round(ref_device))
        rows.append(row)
    return rows
