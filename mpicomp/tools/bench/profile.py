"""Nsight Compute's view of the codecs' kernels: ``python -m mpicomp.tools.bench.profile``.

``run`` launches one encode and one decode of each codec of the bench set on a
gradient on the GPU, after a warm-up, between ``cudaProfilerStart`` and
``cudaProfilerStop``, with a marker kernel before each phase. Run under ``ncu
--profile-from-start off`` (``.ci/gpu``'s ``profile`` step), ncu measures those kernels
alone, in launch order, and ``table`` assigns each to its codec and phase by the marker
before it (its grid size is the phase's number). Each row then says how far the phase is
from what its work needs: the DRAM bytes it moved per element against the ideal of
reading its input once and writing its output once, its duration, the achieved occupancy
of its kernels and what limits its longest one.

Usage on a GPU machine::

    ncu --csv --log-file ncu.csv --profile-from-start off --metrics $(python -m \\
        mpicomp.tools.bench.profile --metrics) python -m mpicomp.tools.bench.profile --numel 100M \\
        --rows rows.json
    python -m mpicomp.tools.bench.profile --table ncu.csv rows.json

Without ncu, ``run`` works on any backend (the profiler calls do nothing off a GPU), so
the tests check the phases' bookkeeping and ``table``'s arithmetic on the CPU.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections.abc import Sequence

import numpy as np

from mpicomp.codecs import codec as make_codec
from mpicomp.kernels.cuda import profiling
from mpicomp.model.probe import gradient, one_rank_round_trip
from mpicomp.tools.bench.kernels import kernel_backend
from mpicomp.tools.bench.workload import codec_set, label, parse_count

DURATION = "gpu__time_duration.sum"  # ns
READ = "dram__bytes_read.sum"  # bytes
WRITTEN = "dram__bytes_write.sum"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"  # achieved occupancy, %
MEMORY = "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"  # % of peak
COMPUTE = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
GRID = "launch__grid_size"
METRICS = (DURATION, READ, WRITTEN, OCCUPANCY, MEMORY, COMPUTE, GRID)

#: Below this share of both the memory and the compute peaks a kernel waits on latency
#: (too few threads or bytes in flight, or a serial part) rather than on a unit.
BUSY = 40.0

PHASES = ("encode", "decode")


def run(codecs: Sequence[str] | None = None, numel: int = 1 << 20, backend: str = "cuda"):
    """Encode and decode each codec of ``codecs`` once on the profiler's watch; return
    one dict per phase: ``codec``, ``params``, ``phase``, ``mark`` (the marker's grid
    size), ``numel``, ``input_bytes`` and ``output_bytes`` (what the phase must read and
    write: float32 in and the wire out for an encode, the other way for a decode)."""
    rec = kernel_backend(backend)
    x = rec.xp.asarray(gradient(numel))
    sync = getattr(rec, "synchronize", None) or (lambda: None)
    device = getattr(rec, "device", None)
    mark, (start, stop) = profiling.marker(device), profiling.window(device)
    rows = []
    for name, params in codec_set(codecs):
        codec = make_codec(name, **params)
        codec.kernels = rec if rec.xp is np else codec.kernels  # the backend of NumPy arrays
        enc, dec, wire = one_rank_round_trip(codec, x)
        enc(), dec()  # warm-up: compiles, tables, the memory pool
        sync()
        start()
        for phase, fn in zip(PHASES, (enc, dec), strict=True):
            mark(len(rows) + PHASES.index(phase) + 1)  # the row's "mark" below
            fn()
        sync()
        stop()
        dense, sent = 4 * numel, wire()
        for phase, (read, written) in zip(PHASES, ((dense, sent), (sent, dense)), strict=True):
            rows.append(
                {
                    "codec": name,
                    "params": dict(params),
                    "phase": phase,
                    "mark": len(rows) + 1,
                    "numel": numel,
                    "input_bytes": read,
                    "output_bytes": written,
                }
            )
    return rows


def kernels_of(csv_text: str) -> list[dict]:
    """Return ncu's CSV (``--csv``, one line per kernel and metric) as one dict per
    kernel in launch order: ``name`` and each metric's value (float)."""
    lines = csv_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu CSV header (a line starting with "ID") in the log')
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("Metric Name"):
            continue
        k = kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})
        value = row["Metric Value"].replace(",", "")
        try:
            k[row["Metric Name"]] = float(value)
        except ValueError:
            k[row["Metric Name"]] = value
    return [kernels[i] for i in sorted(kernels, key=int)]


def limiter(kernel: dict) -> str:
    """Return what limits ``kernel``: ``memory``, ``compute`` or ``latency``."""
    memory, compute = kernel.get(MEMORY, 0.0), kernel.get(COMPUTE, 0.0)
    if max(memory, compute) < BUSY:
        return "latency"
    return "memory" if memory >= compute else "compute"


def table(kernels: list[dict], rows: list[dict]) -> list[dict]:
    """Return ``rows`` with what ncu measured of each phase's ``kernels`` (those after its
    marker, up to the next marker): ``kernels``, ``dram_bytes``, ``ideal_bytes``,
    ``seconds``, ``occupancy`` (duration-weighted, %), ``slowest`` and its ``limiter``."""
    by_mark: dict[int, list[dict]] = {}
    current = None
    for k in kernels:
        if k["name"] == profiling.MARK:
            current = by_mark.setdefault(int(k.get(GRID, 0)), [])
        elif current is not None:
            current.append(k)
    out = []
    for row in rows:
        ks = by_mark.get(row["mark"], [])
        ns = sum(k.get(DURATION, 0.0) for k in ks)
        slowest = max(ks, key=lambda k: k.get(DURATION, 0.0)) if ks else {}
        weighted = sum(k.get(OCCUPANCY, 0.0) * k.get(DURATION, 0.0) for k in ks)
        out.append(
            {
                **row,
                "kernels": len(ks),
                "dram_bytes": sum(k.get(READ, 0.0) + k.get(WRITTEN, 0.0) for k in ks),
                "ideal_bytes": row["input_bytes"] + row["output_bytes"],
                "seconds": ns * 1e-9,
                "occupancy": weighted / ns if ns else 0.0,
                "slowest": slowest.get("name", ""),
                "limiter": limiter(slowest) if slowest else "",
            }
        )
    return out


def markdown(measured: list[dict]) -> str:
    """Return ``table``'s rows as a Markdown table (bytes per element, × the ideal,
    GB/s of float32, occupancy, the slowest kernel and its limiter)."""
    head = (
        "| codec | params | phase | kernels | DRAM B/elem | ideal B/elem | × ideal | ms "
        "| GB/s | occupancy | slowest kernel (limiter) |\n"
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n"
    )
    lines = []
    for r in measured:
        n = r["numel"]
        ratio = r["dram_bytes"] / r["ideal_bytes"] if r["ideal_bytes"] else float("nan")
        gbps = 4 * n / r["seconds"] / 1e9 if r["seconds"] else float("nan")
        lines.append(
            f"| `{r['codec']}` | {label(r['params'])} | {r['phase']} | {r['kernels']} "
            f"| {r['dram_bytes'] / n:.2f} | {r['ideal_bytes'] / n:.2f} | {ratio:.2f} "
            f"| {1e3 * r['seconds']:.3f} | {gbps:,.0f} | {r['occupancy']:.0f} % "
            f"| `{r['slowest']}` ({r['limiter']}) |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mpicomp.tools.bench.profile", description=__doc__
    )
    parser.add_argument("--metrics", action="store_true", help="print ncu's --metrics list")
    parser.add_argument("--numel", type=parse_count, default=100_000_000)
    parser.add_argument("--codecs", help="comma-separated codec names (default: the bench set)")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--rows", help="write the phases as JSON here")
    parser.add_argument("--table", nargs=2, metavar=("NCU_CSV", "ROWS_JSON"))
    args = parser.parse_args(argv)
    if args.metrics:
        print(",".join(METRICS))
        return 0
    if args.table:
        with open(args.table[0]) as f:
            kernels = kernels_of(f.read())
        with open(args.table[1]) as f:
            rows = json.load(f)
        sys.stdout.write(markdown(table(kernels, rows)))
        return 0
    codecs = args.codecs.split(",") if args.codecs else None
    rows = run(codecs, args.numel, args.backend)
    if args.rows:
        with open(args.rows, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
