"""Benchmarks: codec kernels on one process, compressed all-reduce against MPI_Allreduce,
and the compressed reduce-scatter and allgather against MPI's.

``mpicomp bench`` runs :func:`full_run`, the one entry of a whole bench (kernels,
all-reduces, and with ``--save-model`` the model, :func:`measure_model`); ``mpicomp
advise`` runs :func:`run`. The modules, each importing only those before it:

- ``workload``: the codec set, counts and parameter labels;
- ``kernels``: codec throughput on one process (:func:`run`);
- ``allreduce``: the all-reduce measurement across ranks (imports ``mpi4py.MPI``);
- ``reduce_scatter``: the reduce-scatter and allgather measurement, on ``allreduce``'s
  helpers;
- ``report``: headers, tables and JSON.

The gradient, one rank's encode/decode/wire closures and the clock are the runtime's
(``mpicomp.model.probe``: ``CompressedComm(schedule="auto")`` times codecs with them too);
this package imports them, never the reverse. This module re-exports what needs no MPI;
the jobs import ``allreduce`` themselves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mpicomp.kernels as K
from mpicomp.codecs import codec as make_codec
from mpicomp.collectives import plain
from mpicomp.model import probe
from mpicomp.model.measured import speeds_from_bench
from mpicomp.model.probe import conv_gradient, gradient, median_seconds, one_rank_round_trip
from mpicomp.tools.bench.kernels import run
from mpicomp.tools.bench.report import Report, format_table, print_json
from mpicomp.tools.bench.workload import (
    BENCH_SET,
    codec_set,
    label,
    parse_codec,
    parse_count,
    split_codecs,
)
from mpicomp.tools.table import plural

__all__ = [
    "BENCH_SET",
    "Report",
    "codec_set",
    "conv_gradient",
    "format_table",
    "full_run",
    "gradient",
    "label",
    "measure_model",
    "median_seconds",
    "one_rank_round_trip",
    "parse_codec",
    "parse_count",
    "print_json",
    "run",
    "split_codecs",
]


def _idle_barrier(comm) -> None:
    """A barrier that sleeps instead of spinning: ranks waiting for rank 0's kernel timings
    must not take its cores (MPI barriers busy-poll). An infinite timeout: the polling
    wait of a timeout (sleeps of up to 1 ms), never expiring, for kernel timings take
    minutes where a timeout is seconds."""
    plain.barrier(comm, timeout=math.inf)


def full_run(
    comm,
    codecs: Sequence[str] | None,
    numel: int | None,
    sizes: Sequence[int],
    *,
    reps: int = 5,
    allreduce_reps: int = 3,
    seed: int = 0,
    trace_dir: str | None = None,
    tc_dev: str | list[str] | None = None,
    progress=None,
    backend: str | None = None,
    schedules=None,
    model=None,
    with_model: bool = False,
    model_numel: int | None = None,
    sharded_sizes: Sequence[int] = (),
) -> Report:
    """Run what ``mpicomp bench`` measures on ``comm``: kernels on rank 0, then
    all-reduces, then (``with_model``) the schedule chooser's model.

    Args:
        comm: an ``mpi4py.MPI.Comm``; every rank calls this.
        codecs: codec names (``BENCH_SET``'s parameters); None for all.
        numel: kernel gradient size; None skips the kernel timings.
        sizes: all-reduce sizes (may be empty).
        sharded_sizes: reduce-scatter and allgather sizes (may be empty), measured after
            the all-reduces (``mpicomp.tools.bench.reduce_scatter.measure``).
        reps, allreduce_reps: timed repetitions of a kernel / of an all-reduce.
        seed: seed of the kernel gradient (each rank's all-reduce gradient is seeded
            by its rank).
        trace_dir, tc_dev, schedules, model: see ``mpicomp.tools.bench.allreduce.measure``
            (they apply to the reduce-scatters too).
        progress: a text stream for progress lines on rank 0 (None: silent).
        backend: the kernel backend of the kernel timings (see :func:`run`) and of the
            all-reduces (None: what ``MPICOMP_KERNELS`` selects); on a device backend
            (``cuda``) the all-reduces take device arrays (see
            ``mpicomp.tools.bench.allreduce.measure``).
        with_model: also measure the model ``mpicomp bench --save-model`` writes
            (:func:`measure_model`): the network now, the codecs' speeds from the kernel
            rows, or measured on every rank on ``model_numel`` elements (None:
            ``mpicomp.model.probe.SPEED_NUMEL``) when ``numel`` is None.

    Returns:
        A :class:`Report` whose ``rows`` hold one dict per codec and backend: the keys
        of :func:`run` (kernel figures None when skipped) and ``allreduce``, the list of
        that codec's all-reduce rows (``mpicomp.tools.bench.allreduce.measure``), one per size
        and schedule; with ``sharded_sizes`` also ``reduce_scatter``, its reduce-scatter
        rows (``mpicomp.tools.bench.reduce_scatter.measure``; none for ``powersgd``).
        ``sharded``: every reduce-scatter and allgather row.
        On ranks other than 0 the kernel figures are None. ``model``: the model of
        ``with_model`` (the same on every rank), else None.
    """
    todo = codec_set(codecs)
    quiet = progress if comm.rank == 0 else None
    if quiet is not None:  # what will be measured, before minutes of it
        plan = []
        if numel is not None:
            codecs_told = plural(len(todo), "codec setting")
            plan.append(f"encode/decode of {codecs_told} on {numel:,} elements")
        if sizes:
            plan.append(
                f"all-reduces of {', '.join(f'{n:,}' for n in sizes)} elements on "
                f"{plural(comm.size, 'rank')}"
            )
        if sharded_sizes:
            plan.append(
                f"reduce-scatters and allgathers of {', '.join(f'{n:,}' for n in sharded_sizes)} "
                f"elements on {plural(comm.size, 'rank')}"
            )
        print(f"bench: {', then '.join(plan)}; the time left follows", file=quiet, flush=True)
    kernel_rows = error = None
    if numel is not None and comm.rank == 0:
        try:
            kernel_rows = run(codecs, numel, reps, seed, progress=quiet, backend=backend)
        except Exception as e:  # raised on every rank below: none is left waiting
            error = e
    _idle_barrier(comm)
    failed = plain.bcast_object(comm, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed is not None:
        raise RuntimeError(f"rank 0's kernel timings failed: {failed}")
    allreduce, sharded = [], []
    if sizes or sharded_sizes:
        # Here, not at the top: importing mpicomp.tools.bench must not initialize MPI.
        from mpicomp.tools.bench import reduce_scatter
        from mpicomp.tools.bench.allreduce import measure, run_model

        if schedules is not None or model is not None:  # once: every size alike
            model = run_model(comm, todo, model, max([*sizes, *sharded_sizes]))

        for n in sizes:
            allreduce += measure(
                comm,
                n,
                todo,
                allreduce_reps,
                quiet,
                trace_dir=trace_dir,
                tc_dev=tc_dev,
                backend=backend,
                schedules=schedules,
                model=model,
            )
        for n in sharded_sizes:
            sharded += reduce_scatter.measure(
                comm,
                n,
                todo,
                allreduce_reps,
                quiet,
                trace_dir=trace_dir,
                tc_dev=tc_dev,
                backend=backend,
                schedules=schedules,
                model=model,
            )
    rows = []
    for i, (name, params) in enumerate(todo):
        row = (
            kernel_rows[i]
            if kernel_rows
            else {
                "codec": name,
                "params": dict(params),
                "backend": backend or K.backend().name,
                "numel": numel,
                "threads": None,
                "encode_gbps": None,
                "encode_gbps_min": None,
                "encode_gbps_max": None,
                "decode_gbps": None,
                "decode_gbps_min": None,
                "decode_gbps_max": None,
                "memcpy_gbps": None,
                "bits_per_element": None,
                "rel_error": None,
            }
        )
        row["allreduce"] = [
            a for a in allreduce if a["codec"] == name and a["params"] == dict(params)
        ]
        if sharded_sizes:
            row["reduce_scatter"] = [
                a
                for a in sharded
                if a["collective"] == reduce_scatter.REDUCE_SCATTER
                and (a["codec"], a["params"]) == (name, dict(params))
            ]
        rows.append(row)
    measured = None
    if with_model:  # speeds from the kernel rows; without them, measured on every rank
        kernels = rows if numel is not None else None
        measured = measure_model(comm, kernels, codecs, model_numel or probe.SPEED_NUMEL)
    return Report(rows, allreduce, comm.size, numel, measured, sharded)


def measure_model(comm, rows: list[dict] | None, codecs: Sequence[str] | None, numel: int):
    """Return the schedule chooser's model of ``comm``, the same on every rank (collective):
    its networks measured now, and codec speeds.

    Args:
        comm: an ``mpi4py.MPI.Comm``; every rank calls this.
        rows: ``full_run``'s rows, whose kernel figures on rank 0 give the speeds, or
            None to measure the speeds of ``codecs`` on every rank now.
        codecs: codec names (``BENCH_SET``'s parameters; None for all) when ``rows``
            is None.
        numel: elements of the gradient those speeds are measured on.

    Returns:
        A ``mpicomp.model.Model`` (``source`` ``"measured"``).
    """
    node = probe.host_comm(comm)  # what CompressedComm measures "intra" on
    try:
        model = probe.measure(comm, node, codecs=[])
    finally:
        node.Free()
    if rows is None:
        made = [make_codec(name, **params) for name, params in codec_set(codecs)]
        return model.with_speeds(probe.measured_speeds(comm, made, numel))
    # Only rank 0 timed the kernels.
    speeds = plain.bcast_object(comm, speeds_from_bench(rows) if comm.rank == 0 else None)
    return model.with_speeds(speeds)
