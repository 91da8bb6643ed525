"""The sharded collectives: every codec's ``CompressedComm.reduce_scatter`` against
``MPI_Reduce_scatter`` of float32, and ``CompressedComm.allgather`` (float32, bfloat16)
against ``MPI_Allgather`` of float32.

For each gradient size n on N ranks, the layout is FSDP's (docs/sharded.md): rows of
S = ceil(n / N) elements. The references get buffers already padded to N * S elements,
so the time of padding is the compressed call's alone: ``MPI_Reduce_scatter`` with N
equal counts of S (``MPI_Reduce_scatter_block``'s sum) and ``MPI_Allgather`` of S
elements. Each call is timed as ``mpicomp.tools.bench.allreduce.measure`` times an
all-reduce (the slowest rank's time, median of the repetitions after a warm-up; bytes
per call from a ``Traffic``, the largest over ranks; the encode / exchange / decode split
from a trace), and every row's bytes are compared with the 4(N-1)S bytes a float32
reduce-scatter (or allgather) sends and receives per rank: (N-1)/N * 4n where N divides n.
``mpicomp bench --reduce-scatter`` runs :func:`measure`; ``mpicomp.tools.bench.report``
prints its rows.

Host arrays only: a device backend is refused on every rank.
"""

from __future__ import annotations

import os

import numpy as np

from mpicomp.codecs import codec as make_codec
from mpicomp.collectives import plain
from mpicomp.collectives.traffic import Traffic
from mpicomp.comm import CompressedComm
from mpicomp.model import probe
from mpicomp.reduction import kind_of
from mpicomp.reduction.rows import PRECISIONS
from mpicomp.tools.bench._countdown import Countdown
from mpicomp.tools.bench.allreduce import (
    _backend_on_every_rank,
    _Counter,
    _host_kernels,
    _on_rank_0,
    _per_call,
    _topology,
    _trace_path,
    _traces_in,
    bytes_per_call,
    phase_split,
    run_model,
    schedules_of,
    slowest_median,
)
from mpicomp.tools.bench.workload import label

#: A row's ``collective``: the CompressedComm method it times.
REDUCE_SCATTER, ALLGATHER = "reduce_scatter", "allgather"


def scatter_codecs(codecs) -> list[tuple[str, dict]]:
    """Return the (name, params) pairs of ``codecs`` whose kind has a reduce-scatter
    (all but ``powersgd``'s low-rank kind)."""
    return [
        (name, params)
        for name, params in codecs
        if next(iter(kind_of(make_codec(name, **params)).schedules.values())).scatter is not None
    ]


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
    """Return the rows of the sharded collectives of ``numel`` float32 values on ``comm``:
    one reduce-scatter per codec that has one and schedule, then one allgather per
    precision.

    Args:
        comm: the communicator to benchmark on (every rank calls this).
        numel: elements of the gradient (each rank draws its own; the allgather's shard
            is this rank's row of it).
        codecs: (name, params) pairs, as ``mpicomp.tools.bench.codec_set`` returns;
            those without a reduce-scatter (``powersgd``) get no row.
        reps, progress, trace_dir, tc_dev, schedules, model: as for
            ``mpicomp.tools.bench.allreduce.measure`` (a reduce-scatter is the first
            phase of the schedule it names); trace files are
            ``<numel>-reduce_scatter-<codec>[-<params>]-<schedule>.h5`` and
            ``<numel>-allgather-<precision>.h5``.
        backend: a host kernel backend (None: what ``MPICOMP_KERNELS`` selects).

    Returns:
        One dict per call timed: ``collective`` (``"reduce_scatter"`` or
        ``"allgather"``), ``numel``, ``nranks``, ``shard`` (S), ``codec`` and ``params``
        (the allgather's: ``none``), ``precision`` (the allgather's wire; None for a
        reduce-scatter), ``schedule`` (the reduce-scatter's ``CompressedComm(schedule=...)``)
        and ``chosen`` (the plan it ran by: ``auto``'s choice, ``float32`` below
        ``min_numel``), both None for an allgather, ``backend``, ``time_s``,
        ``mpi_s`` (the reference: ``MPI_Reduce_scatter`` or ``MPI_Allgather`` of
        float32, the slowest rank's median), ``time_ratio`` (``time_s / mpi_s``),
        ``speedup`` (its inverse), ``bytes_sent``/``bytes_recv`` (per call, the largest
        over ranks), ``sent_total``/``recv_total`` (summed over ranks),
        ``mpi_sent``/``mpi_recv`` (the reference's, counted alike: an ``MPI_Allgather``
        sends its shard once), ``mpi_bytes`` (4(N-1)S: a float32 reduce-scatter's, sent
        and received per rank), ``sent_ratio``/``recv_ratio`` (over it; None on one rank),
        ``encode_s``/``exchange_s``/``decode_s`` (``allreduce.phase_split``), and with
        ``tc_dev`` ``device_bytes``, ``device_links``, ``device_over_recv`` and the
        reference's ``mpi_device_bytes``/``mpi_device_links``.

    Raises:
        RuntimeError: the backend cannot start on some rank or computes on device
            arrays, or rank 0 could not make ``trace_dir`` or read a trace (on every
            rank).
    """
    rec = _backend_on_every_rank(comm, backend)
    if rec.xp is not np:  # the same backend on every rank: all raise alike
        raise RuntimeError(
            f"the reduce-scatter rows time host arrays; backend {rec.name!r} computes on "
            "device arrays (give a host backend: numba or cuda-emulated)"
        )
    n, size = numel, comm.size
    shard = -(-n // size)
    padded = np.zeros(size * shard, np.float32)
    padded[:n] = probe.gradient(n, seed=comm.rank)
    x = padded[:n]
    mine = padded[comm.rank * shard : (comm.rank + 1) * shard].copy()
    counter = _Counter(comm, [tc_dev] if isinstance(tc_dev, str) else tc_dev)
    calls = reps + 1  # the warm-up is counted too: bytes are a mean per call

    def reference(collective):
        """Time ``collective`` of float32 through MPI; return its time, bytes per call
        (Traffic's count, as for the rows) and the devices' bytes per call."""
        traffic = Traffic()
        if collective == REDUCE_SCATTER:
            out = np.empty(shard, np.float32)
            counts = [shard] * size

            def fn():
                plain.reduce_scatter(comm, padded, out, counts, recorder=traffic)
        else:
            out = np.empty(size * shard, np.float32)

            def fn():
                plain.allgather(comm, mine, out, recorder=traffic)

        before = counter.read()
        t = slowest_median(comm, fn, reps)
        after = counter.read()
        links = None if before is None else _per_call(before, after, calls)
        return t, bytes_per_call(comm, traffic, calls)[:2], links

    refs = {collective: reference(collective) for collective in (REDUCE_SCATTER, ALLGATHER)}
    wire = 4 * (size - 1) * shard  # float32 per rank, sent and received alike
    topology = _topology(comm)
    if schedules is not None or model is not None:
        model = run_model(comm, codecs, model, n)
    runs = [
        (REDUCE_SCATTER, name, params, None, schedule)
        for name, params in scatter_codecs(codecs)
        for schedule in schedules_of(name, params, schedules, topology)
    ]
    runs += [(ALLGATHER, "none", {}, precision, None) for precision in PRECISIONS]
    rows = []
    with _traces_in(comm, trace_dir) as where:
        countdown = Countdown(len(runs), progress if comm.rank == 0 else None)
        for collective, name, params, precision, schedule in runs:
            if precision is None:
                what = f"{name} {label(params)}".strip() + f", {schedule}"
                path = _trace_path(where, n, f"{collective}-{name}", params, schedule)
            else:
                what = precision
                path = os.path.join(where, f"{n}-{collective}-{precision}.h5")
            countdown.next(f"{n:,} elements, {collective} {what}")
            with _host_kernels(rec.name):  # written at close only: no flush while timed
                cc = CompressedComm(
                    comm,
                    name,
                    trace=path,
                    trace_flush_every=None,
                    schedule=schedule,
                    model=model if precision is None else None,
                    **params,
                )
            with cc:
                if precision is None:

                    def call(cc=cc):
                        cc.reduce_scatter(x, name="grad")

                    chosen = cc.schedule_for(n)[0]
                else:

                    def call(cc=cc, precision=precision):
                        cc.allgather(mine, name="params", numel=n, precision=precision)

                    chosen = None
                traffic = Traffic()
                cc.recorder = traffic
                before = counter.read()
                t = slowest_median(comm, call, reps)
                after = counter.read()
                backend_name = cc.kernels.name
            phases = _on_rank_0(comm, lambda path=path: phase_split(path))
            sent, recv, total, total_recv = bytes_per_call(comm, traffic, calls)
            t_ref, (ref_sent, ref_recv), ref_links = refs[collective]
            row = {
                "collective": collective,
                "numel": n,
                "nranks": size,
                "shard": shard,
                "codec": name,
                "params": dict(params),
                "precision": precision,
                "schedule": schedule,
                "chosen": chosen,
                "backend": backend_name,
                "time_s": t,
                "mpi_s": t_ref,
                "time_ratio": t / t_ref,
                "speedup": t_ref / t,
                "bytes_sent": sent,
                "bytes_recv": recv,
                "sent_total": int(round(total)),
                "recv_total": int(round(total_recv)),
                "mpi_sent": ref_sent,
                "mpi_recv": ref_recv,
                "mpi_bytes": wire,
                "sent_ratio": sent / wire if wire else None,
                "recv_ratio": recv / wire if wire else None,
                "encode_s": phases["encode_s"],
                "exchange_s": phases["exchange_s"],
                "decode_s": phases["decode_s"],
            }
            if trace_dir is not None:
                row["trace"] = path
            if before is not None:
                links = _per_call(before, after, calls)
                device_bytes = sum(links.values())
                row["device_links"] = {dev: int(round(v)) for dev, v in links.items()}
                row["device_bytes"] = int(round(device_bytes))
                row["device_over_recv"] = device_bytes / total_recv if total_recv else None
                row["mpi_device_bytes"] = int(round(sum(ref_links.values())))
                row["mpi_device_links"] = {d: int(round(v)) for d, v in ref_links.items()}
            rows.append(row)
    return rows
