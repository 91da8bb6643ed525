"""How the benchmarks print: headers, tables and JSON, for ``mpicomp bench`` and the jobs."""

from __future__ import annotations

import json
import sys

import numba

import mpicomp
from mpicomp.bench.workload import label


def title(what: str) -> str:
    """Return the first words of a report's header: ``mpicomp <version> <what>``."""
    return f"mpicomp {mpicomp.__version__} {what}"


def mpi_library() -> str:
    """Return the MPI library in use as ``vendor version`` (``MPICH 5.0.2``)."""
    # Imported here: importing mpicomp.bench must not initialize MPI (jobs.netem reads
    # the vendor with mpi4py.rc.initialize off after importing it).
    from mpi4py import MPI

    vendor, version = MPI.get_vendor()
    return f"{vendor} {'.'.join(map(str, version))}"


def print_json(rows: list[dict], out=None) -> None:
    """Print ``rows`` as one indented JSON list (to stdout by default)."""
    print(json.dumps(rows, indent=1), file=sys.stdout if out is None else out)


def format_table(rows: list[dict], out=None) -> None:
    """Print kernel rows (``mpicomp.bench.run``) as a table (to stdout by default)."""
    out = sys.stdout if out is None else out
    if not rows:
        return
    head = (
        f"{'codec':<28}{'params':<14}{'backend':<14}{'bits/elem':>10}{'rel.err':>9}"
        f"{'enc GB/s':>10}{'x/memcpy':>9}{'dec GB/s':>10}{'x/memcpy':>9}"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        m = r["memcpy_gbps"]
        print(
            f"{r['codec']:<28}{label(r['params']):<14}{r['backend']:<14}"
            f"{r['bits_per_element']:>10.3f}{r['rel_error']:>9.4f}"
            f"{r['encode_gbps']:>10.2f}{r['encode_gbps'] / m:>9.2f}"
            f"{r['decode_gbps']:>10.2f}{r['decode_gbps'] / m:>9.2f}",
            file=out,
        )


def format_allreduce_table(rows: list[dict], out=None) -> None:
    """Print all-reduce rows (``mpicomp.bench.allreduce.measure``) as a table (to stdout
    by default)."""
    out = sys.stdout if out is None else out
    device = any("device_bytes" in r for r in rows)
    head = (
        f"{'elements':>12}  {'codec':<27}{'params':<13}{'time ms':>10}{'speedup':>9}"
        f"{'sent B/rank':>14}{'x ring':>8}{'recv B/rank':>14}{'x ring':>8}"
        + (f"{'device B':>15}{'/recv':>7}" if device else "")
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    last = None
    for r in rows:
        if r["numel"] != last:
            last = r["numel"]
            ref = r["allreduce_bytes"]
            dev = f"{r['allreduce_device_bytes']:>15,}{'':>7}" if "device_bytes" in r else ""
            print(
                f"{r['numel']:>12,}  {'MPI_Allreduce float32':<40}{1e3 * r['allreduce_s']:>10.2f}"
                f"{1:>9.2f}{ref:>14,}{'1.00' if ref else '-':>8}{ref:>14,}"
                f"{'1.00' if ref else '-':>8}{dev}",
                file=out,
            )

        def ratio(v):
            return "-" if v is None else f"{v:.3f}"

        dev = ""
        if "device_bytes" in r:
            dev = f"{r['device_bytes']:>15,}{ratio(r['device_over_recv']):>7}"
        print(
            f"{r['numel']:>12,}  {r['codec']:<27}{label(r['params']):<13}"
            f"{1e3 * r['time_s']:>10.2f}{r['speedup']:>9.2f}"
            f"{r['bytes_sent']:>14,}{ratio(r['sent_ratio']):>8}"
            f"{r['bytes_recv']:>14,}{ratio(r['recv_ratio']):>8}{dev}",
            file=out,
        )


class Report:
    """What ``mpicomp bench`` measured: kernel rows with their all-reduce entries."""

    def __init__(self, rows: list[dict], allreduce: list[dict], nranks: int, numel):
        self.rows = rows
        self.allreduce = allreduce
        self.nranks = nranks
        self.numel = numel

    def print(self, reps: int, allreduce_reps: int, out=None) -> None:
        """Print both tables with their headers (to stdout by default)."""
        out = sys.stdout if out is None else out
        kernels = [r for r in self.rows if r["encode_gbps"] is not None]
        if kernels:
            backend = kernels[0]["backend"]
            if backend == "numba":
                backend += f" backend ({numba.config.NUMBA_NUM_THREADS} threads)"
            else:
                backend += " backend"
            gpu = backend.startswith("cuda ")
            copy = "device-to-device copy (cupy.copyto)" if gpu else "memcpy (np.copyto)"
            print(
                f"{title('bench')}: {self.numel:,} float32 elements "
                f"({self.numel * 4 / 2**20:.1f} MiB), one process, {backend}, median of "
                f"{reps} after a warm-up\n{copy} of the same buffer, same run: "
                f"{kernels[0]['memcpy_gbps']:.2f} GB/s (the x/memcpy columns divide by it)",
                file=out,
            )
            format_table(kernels, out)
            print(
                "GB/s: float32 input bytes / time (1 GB = 1e9 B); bits/elem: one rank's wire "
                "(payload with header, or ring codes at the first step's width);\n"
                "rel.err: ||decode(encode(g)) - g|| / ||g||, one rank, no error feedback.",
                file=out,
            )
        if self.allreduce:
            print(
                f"\nall-reduce on {self.nranks} rank(s): CompressedComm.allreduce against "
                f"MPI_Allreduce of float32, the slowest rank's time, median of "
                f"{allreduce_reps} after a warm-up;\nspeedup = MPI_Allreduce time / "
                "compressed time; bytes per rank per call, 'x ring' over a float32 ring's "
                "2(N-1)/N*4n",
                file=out,
            )
            format_allreduce_table(self.allreduce, out)
