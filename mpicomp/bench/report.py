"""How the benchmarks print: headers, tables and JSON, for ``mpicomp bench`` and the jobs."""

from __future__ import annotations

import json
import sys

import numba

from mpicomp._version import __version__
from mpicomp.bench.workload import label


def title(what: str) -> str:
    """Return the first words of a report's header: ``mpicomp <version> <what>``."""
    return f"mpicomp {__version__} {what}"


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


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _times(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _phases(r: dict) -> str:
    """Return a row's encode/exchange/decode milliseconds as ``e/x/d`` ("-" without them)."""
    split = [r.get(k) for k in ("encode_s", "exchange_s", "decode_s")]
    if any(v is None for v in split):
        return "-"
    return "/".join(f"{1e3 * v:.2f}" for v in split)


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"


def schedule_label(r: dict) -> str:
    """Return a row's schedule, with what ``auto`` chose: ``auto -> direct``."""
    schedule = r.get("schedule", "")
    return f"auto -> {r['chosen']}" if schedule == "auto" and r.get("chosen") else schedule


def chooser_verdicts(rows: list[dict]) -> list[dict]:
    """Return, for every codec and size with an ``auto`` row, what it chose against
    what was fastest in the same run.

    The candidates are the rows of the other schedules of that codec and size and the
    float32 MPI_Allreduce (``allreduce_s``). Each verdict: ``codec``, ``params``,
    ``numel``, ``chosen``, ``fastest``, ``right`` (chosen is fastest),
    ``regret`` (the chosen schedule's measured time over the fastest's; 1.0 when right),
    ``auto_s`` (the auto row's own time) and ``auto_over_fastest`` (it over the fastest
    row's: the same schedule timed twice differs by the run's noise, which this shows),
    ``times`` (schedule to seconds) and ``predicted`` (schedule to the model's seconds).
    """
    out = []
    for auto in (r for r in rows if r.get("schedule") == "auto"):
        key = (auto["codec"], auto["params"], auto["numel"])
        peers = [
            r for r in rows
            if (r["codec"], r["params"], r["numel"]) == key and r.get("schedule") != "auto"
        ]  # fmt: skip
        times = {r["schedule"]: r["time_s"] for r in peers}
        times["float32"] = auto["allreduce_s"]
        predicted = {r["schedule"]: r.get("predicted_s") for r in peers}
        predicted["float32"] = auto.get("allreduce_predicted_s")
        fastest = min(times, key=times.__getitem__)
        chosen = auto["chosen"]
        out.append({
            "codec": auto["codec"], "params": auto["params"], "numel": auto["numel"],
            "chosen": chosen, "fastest": fastest, "right": chosen == fastest,
            "regret": times.get(chosen, auto["time_s"]) / times[fastest],
            "auto_s": auto["time_s"], "auto_over_fastest": auto["time_s"] / times[fastest],
            "times": times, "predicted": predicted,
        })  # fmt: skip
    return out


def format_verdicts(verdicts: list[dict], out=None) -> None:
    """Print ``chooser_verdicts`` and how often the choice was the fastest."""
    out = sys.stdout if out is None else out
    if not verdicts:
        return
    right = sum(v["right"] for v in verdicts)
    print(
        "\nschedule='auto' chose the fastest of its candidates (float32: MPI_Allreduce) "
        f"{right} of {len(verdicts)} times; regret = the chosen schedule's time over the "
        "fastest's, same run; auto/fastest: the auto row's own time over the fastest's",
        file=out,
    )
    for v in verdicts:
        print(
            f"{v['numel']:>12,}  {v['codec']:<27}{label(v['params']):<13}chose {v['chosen']:<16}"
            f"fastest {v['fastest']:<16}regret {v['regret']:.2f}  "
            f"auto/fastest {v['auto_over_fastest']:.2f}",
            file=out,
        )


def format_allreduce_table(rows: list[dict], out=None) -> None:
    """Print all-reduce rows (``mpicomp.bench.allreduce.measure``) as a table (to stdout
    by default).

    Rows of a device backend (with ``transport``) add the path their device buffers
    took and their time over each MPI_Allreduce reference (staged, direct), with one
    reference line each; every row ends with its encode/exchange/decode split.
    """
    out = sys.stdout if out is None else out
    tc = any("device_bytes" in r for r in rows)
    device = any("transport" in r for r in rows)
    phases = "enc/xchg/dec ms"
    head = (
        f"{'elements':>12}  {'codec':<27}{'params':<13}{'schedule':<22}{'time ms':>10}"
        f"{'pred ms':>9}{'speedup':>9}"
        f"{'sent B/rank':>14}{'x ring':>8}{'recv B/rank':>14}{'x ring':>8}"
        + (f"{'device B':>15}{'/recv':>7}" if tc else "")
        + (f"{'path':>8}{'/staged':>9}{'/direct':>9}" if device else "")
        + f"{phases:>22}"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    last = None
    for r in rows:
        if r["numel"] != last:
            last = r["numel"]
            _reference_lines(r, tc, device, out)
        dev = ""
        if tc:
            dev = (
                f"{r['device_bytes']:>15,}{_ratio(r['device_over_recv']):>7}"
                if "device_bytes" in r
                else f"{'':>22}"
            )
        path = ""
        if device:
            path = (
                f"{r['transport']:>8}{_times(r['time_ratio_staged']):>9}"
                f"{_times(r['time_ratio_direct']):>9}"
                if "transport" in r
                else f"{'':>26}"
            )
        print(
            f"{r['numel']:>12,}  {r['codec']:<27}{label(r['params']):<13}"
            f"{schedule_label(r):<22}{1e3 * r['time_s']:>10.2f}{_ms(r.get('predicted_s')):>9}"
            f"{r['speedup']:>9.2f}"
            f"{r['bytes_sent']:>14,}{_ratio(r['sent_ratio']):>8}"
            f"{r['bytes_recv']:>14,}{_ratio(r['recv_ratio']):>8}{dev}{path}"
            f"{_phases(r):>22}",
            file=out,
        )


def _reference_lines(r: dict, tc: bool, device: bool, out) -> None:
    """Print the MPI_Allreduce line(s) of ``r``'s size: one on the host; staged, and
    direct when measured, on a device."""
    ref = r["allreduce_bytes"]
    one = "1.00" if ref else "-"
    dev = ""
    if tc:
        dev = f"{r['allreduce_device_bytes']:>15,}{'':>7}" if "device_bytes" in r else f"{'':>22}"
    if "transport" in r:
        staged, direct = r["allreduce_staged_s"], r["allreduce_direct_s"]
        lines = [("staged", staged)] + ([("direct", direct)] if direct is not None else [])
    else:
        lines = [("", r["allreduce_s"])]
    for path, t in lines:
        what = f"MPI_Allreduce float32{' ' + path if path else ''}"
        extra = ""
        if device:
            extra = f"{'':>26}"
            if path:
                over_direct = None if direct is None else t / direct
                extra = f"{path:>8}{_times(t / staged):>9}{_times(over_direct):>9}"
        print(
            f"{r['numel']:>12,}  {what:<62}{1e3 * t:>10.2f}{_ms(r.get('allreduce_predicted_s')):>9}"
            f"{r['allreduce_s'] / t:>9.2f}{ref:>14,}{one:>8}{ref:>14,}{one:>8}{dev}{extra}",
            file=out,
        )


class Report:
    """What ``mpicomp bench`` measured: kernel rows with their all-reduce entries, and
    the model of ``--save-model`` (a ``mpicomp.model.Model``, else None)."""

    def __init__(self, rows: list[dict], allreduce: list[dict], nranks: int, numel, model=None):
        self.rows = rows
        self.allreduce = allreduce
        self.nranks = nranks
        self.numel = numel
        self.model = model

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
            first = self.allreduce[0]
            device = "transport" in first
            where = "device arrays" if device else "host arrays"
            print(
                f"\nall-reduce on {self.nranks} rank(s), {where}, {first['backend']} kernels: "
                "CompressedComm.allreduce against MPI_Allreduce of float32, the slowest "
                f"rank's time, median of {allreduce_reps} after a warm-up;\nspeedup = "
                "MPI_Allreduce time / compressed time; bytes per rank per call, 'x ring' "
                "over a float32 ring's 2(N-1)/N*4n;\nenc/xchg/dec ms: per call, the slowest "
                "rank's encode / exchange (every message, waiting included) / decode, "
                "median (from a trace of the timed calls)",
                file=out,
            )
            if device:
                print(
                    "path: how CompressedComm's device buffers reached MPI (staged through "
                    "pinned host buffers, or direct to a CUDA-aware MPI); /staged, /direct: "
                    "compressed time over\nMPI_Allreduce of the same device buffer staged "
                    "(device to pinned host, MPI_Allreduce, host to device) or direct (only "
                    "when MPI is CUDA-aware); speedup: over the reference of the row's path",
                    file=out,
                )
            format_allreduce_table(self.allreduce, out)
            format_verdicts(chooser_verdicts(self.allreduce), out)
