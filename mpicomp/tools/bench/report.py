"""How the benchmarks print: headers, tables and JSON, for ``mpicomp bench`` and the jobs."""

from __future__ import annotations

import json
import sys

import numba

from mpicomp._version import __version__
from mpicomp.tools.bench.workload import codec_label, format_count
from mpicomp.tools.table import lines as table_lines
from mpicomp.tools.table import note, plural


def title(what: str) -> str:
    """Return the first words of a report's header: ``mpicomp <version> <what>``."""
    return f"mpicomp {__version__} {what}"


def mpi_library() -> str:
    """Return the MPI library in use as ``vendor version`` (``MPICH 5.0.2``)."""
    # Imported here: importing mpicomp.tools.bench must not initialize MPI (jobs.netem reads
    # the vendor with mpi4py.rc.initialize off after importing it).
    from mpi4py import MPI

    vendor, version = MPI.get_vendor()
    return f"{vendor} {'.'.join(map(str, version))}"


def print_json(rows: list[dict], out=None) -> None:
    """Print ``rows`` as one indented JSON list (to stdout by default)."""
    print(json.dumps(rows, indent=1), file=sys.stdout if out is None else out)


def _gbps(v: float) -> str:
    """Return GB/s to three significant digits, no exponent: 806, 12.4, 6.19, 0.0412."""
    if v >= 10:
        return f"{v:.0f}" if v >= 100 else f"{v:.1f}"
    return f"{v:.2f}" if v >= 1 else f"{v:.3g}"


def _spread(r: dict, key: str) -> str:
    """Return a row's slowest and fastest repetition of ``key`` as ``min-max``."""
    low, high = r.get(f"{key}_min"), r.get(f"{key}_max")
    return "-" if low is None or high is None else f"{_gbps(low)}-{_gbps(high)}"


def format_table(rows: list[dict], out=None) -> None:
    """Print kernel rows (``mpicomp.tools.bench.run``) as a table (to stdout by default): median
    GB/s, the repetitions' min-max, and x/memcpy of the median; the backend is the
    report's header's."""
    out = sys.stdout if out is None else out
    if not rows:
        return
    head = ["codec", "bits/elem", "rel.err", "enc GB/s", "min-max", "x/memcpy"]
    head += ["dec GB/s", "min-max", "x/memcpy"]
    cells = []
    for r in rows:
        m = r["memcpy_gbps"]
        cells.append([
            codec_label(r["codec"], r["params"]),
            f"{r['bits_per_element']:.3f}", f"{r['rel_error']:.4f}",
            _gbps(r["encode_gbps"]), _spread(r, "encode_gbps"), f"{r['encode_gbps'] / m:.2f}",
            _gbps(r["decode_gbps"]), _spread(r, "decode_gbps"), f"{r['decode_gbps'] / m:.2f}",
        ])  # fmt: skip
    right = range(1, len(head))
    print("\n".join(table_lines(head, cells, right=right, squeeze=((0, 16),))), file=out)


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _times(v) -> str:
    return "-" if v is None else f"{v:.2f}"


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
    from mpicomp.reduction import FLOAT32  # here: importing this module leaves MPI alone

    out = []
    for auto in (r for r in rows if r.get("schedule") == "auto"):
        key = (auto["codec"], auto["params"], auto["numel"])
        peers = [
            r for r in rows
            if (r["codec"], r["params"], r["numel"]) == key and r.get("schedule") != "auto"
        ]  # fmt: skip
        times = {r["schedule"]: r["time_s"] for r in peers}
        times[FLOAT32] = auto["allreduce_s"]
        predicted = {r["schedule"]: r.get("predicted_s") for r in peers}
        predicted[FLOAT32] = auto.get("allreduce_predicted_s")
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
        "\n"
        + note(
            "schedule='auto' chose the fastest of its candidates (float32: MPI_Allreduce) "
            f"{right} of {len(verdicts)} times; regret = the chosen schedule's time over the "
            "fastest's, same run; auto/fastest: the auto row's own time over the fastest's"
        ),
        file=out,
    )
    head = ["elements", "codec", "chose", "fastest", "regret", "auto/fastest"]
    rows = [
        [
            format_count(v["numel"]),
            codec_label(v["codec"], v["params"]),
            v["chosen"],
            v["fastest"],
            f"{v['regret']:.2f}",
            f"{v['auto_over_fastest']:.2f}",
        ]
        for v in verdicts
    ]
    print("\n".join(table_lines(head, rows, right=(0, 4, 5), squeeze=((1, 16),))), file=out)


def _sig(ms: float) -> str:
    """Milliseconds to three significant digits, no exponent: 503, 24.6, 0.312."""
    if ms >= 100:
        return f"{ms:.0f}"
    return f"{ms:.3g}" if ms >= 0.001 else f"{ms:.4f}"


def _phases(r: dict) -> str:
    """Return a row's encode/exchange/decode milliseconds as ``e/x/d`` ("-" without them)."""
    split = [r.get(k) for k in ("encode_s", "exchange_s", "decode_s")]
    if any(v is None for v in split):
        return "-"
    return "/".join(_sig(1e3 * v) for v in split)


def _bytes(n: float) -> str:
    """Bytes to three significant digits, decimal units: 712, 16.4K, 154M."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{suffix}" if v >= 100 else f"{v:.3g}{suffix}"
    return f"{n:.0f}"


def format_allreduce_table(rows: list[dict], out=None) -> None:
    """Print all-reduce rows (``mpicomp.tools.bench.allreduce.measure``) as tables of at most 120
    columns (to stdout by default).

    Per size, the MPI_Allreduce reference line(s) first, then one row per codec and
    schedule: time, ``pred ms`` (only where some row has a model's prediction), speedup,
    bytes per rank (three digits: the JSON has them exact) and their ratio to a float32
    ring, and the encode/exchange/decode split. With ``--tc-dev`` (``device_bytes``) or
    on a device backend (``transport``: one reference line each for staged and direct) a
    second table follows: the bytes the devices counted, and the path the device buffers
    took with the time over each MPI_Allreduce reference.
    """
    out = sys.stdout if out is None else out
    tc = any("device_bytes" in r for r in rows)
    device = any("transport" in r for r in rows)
    pred = any(r.get(k) is not None for r in rows for k in ("predicted_s", "allreduce_predicted_s"))
    head = ["size", "codec", "schedule", "time ms"] + (["pred ms"] if pred else [])
    head += ["speedup", "sent B", "x ring", "recv B", "x ring", "enc/xchg/dec ms"]
    extra_head = ["size", "codec", "schedule"] + (["device B", "/recv"] if tc else [])
    extra_head += ["path", "/staged", "/direct"] if device else []
    body, extra = [], []
    last = None
    for r in rows:
        if r["numel"] != last:
            last = r["numel"]
            refs, ref_extra = _reference_rows(r, tc, device, pred)
            body += refs
            extra += ref_extra
        key = [format_count(r["numel"]), codec_label(r["codec"], r["params"]), schedule_label(r)]
        cells = [*key, f"{1e3 * r['time_s']:.2f}"] + ([_ms(r.get("predicted_s"))] if pred else [])
        cells += [f"{r['speedup']:.2f}", _bytes(r["bytes_sent"]), _ratio(r["sent_ratio"])]
        cells += [_bytes(r["bytes_recv"]), _ratio(r["recv_ratio"]), _phases(r)]
        body.append(cells)
        more = list(key)
        if tc:
            more += (
                [f"{r['device_bytes']:,}", _ratio(r["device_over_recv"])]
                if "device_bytes" in r
                else ["", ""]
            )
        if device:
            more += (
                [r["transport"], _times(r["time_ratio_staged"]), _times(r["time_ratio_direct"])]
                if "transport" in r
                else ["", "", ""]
            )
        extra.append(more)
    squeeze = ((2, 14), (1, 24), (2, 10), (1, 12))
    right = [i for i in range(len(head)) if i not in (1, 2)]
    print("\n".join(table_lines(head, body, right=right, squeeze=squeeze)), file=out)
    if tc or device:
        what = []
        if tc:
            what.append(
                "device B: the bytes per call the devices' qdiscs counted (tc -s qdisc), "
                "summed; /recv: over the bytes the ranks received"
            )
        if device:
            what.append(
                "path: how CompressedComm's device buffers reached MPI (staged through "
                "pinned host buffers, or direct to a CUDA-aware MPI); /staged, /direct: "
                "compressed time over MPI_Allreduce of the same device buffer staged or "
                "direct (only when MPI is CUDA-aware)"
            )
        print("\n" + note("; ".join(what) + "."), file=out)
        right = [i for i, h in enumerate(extra_head) if i > 2 and h != "path"]
        print("\n".join(table_lines(extra_head, extra, right=right, squeeze=squeeze)), file=out)


def format_sharded_table(rows: list[dict], out=None) -> None:
    """Print reduce-scatter and allgather rows (``mpicomp.tools.bench.reduce_scatter.measure``)
    as a table of at most 120 columns (to stdout by default).

    Per size: the ``MPI_Reduce_scatter float32`` line, a row per codec and schedule (with
    the plan it ran by where that differs: ``auto -> direct``, ``ring -> float32`` below
    ``min_numel``), then
    the ``MPI_Allgather float32`` line and a row per precision: time, speedup over the
    MPI line above, bytes per rank and their ratio to a float32 reduce-scatter's, and the
    encode/exchange/decode split; with ``--tc-dev`` the bytes the devices counted.
    """
    out = sys.stdout if out is None else out
    tc = any("device_bytes" in r for r in rows)
    head = ["size", "codec", "schedule", "time ms", "speedup", "sent B", "x f32"]
    head += ["recv B", "x f32", "enc/xchg/dec ms"] + (["device B", "/recv"] if tc else [])
    body = []
    last = None
    for r in rows:
        scatter = r["precision"] is None
        if (r["numel"], scatter) != last:  # each collective's MPI reference first
            last = r["numel"], scatter
            mpi = "MPI_Reduce_scatter" if scatter else "MPI_Allgather"
            wire = r["mpi_bytes"]
            cells = [format_count(r["numel"]), f"{mpi} float32", "", f"{1e3 * r['mpi_s']:.2f}"]
            cells += ["1.00", _bytes(r["mpi_sent"]), _ratio(r["mpi_sent"] / wire if wire else None)]
            cells += [_bytes(r["mpi_recv"]), _ratio(r["mpi_recv"] / wire if wire else None), ""]
            if tc:
                cells += [f"{r['mpi_device_bytes']:,}" if "mpi_device_bytes" in r else "", ""]
            body.append(cells)
        name = codec_label(r["codec"], r["params"]) if scatter else f"allgather {r['precision']}"
        ran = (
            r["schedule"]
            if r["chosen"] in (None, r["schedule"])
            else f"{r['schedule']} -> {r['chosen']}"
        )
        cells = [format_count(r["numel"]), name, ran if scatter else ""]
        cells += [f"{1e3 * r['time_s']:.2f}", f"{r['speedup']:.2f}"]
        cells += [_bytes(r["bytes_sent"]), _ratio(r["sent_ratio"])]
        cells += [_bytes(r["bytes_recv"]), _ratio(r["recv_ratio"]), _phases(r)]
        if tc:
            cells += (
                [f"{r['device_bytes']:,}", _ratio(r["device_over_recv"])]
                if "device_bytes" in r
                else ["", ""]
            )
        body.append(cells)
    right = [i for i in range(len(head)) if i not in (1, 2)]
    squeeze = ((2, 14), (1, 24), (2, 10), (1, 12))
    print("\n".join(table_lines(head, body, right=right, squeeze=squeeze)), file=out)


def _reference_rows(r: dict, tc: bool, device: bool, pred: bool) -> tuple[list, list]:
    """Return the MPI_Allreduce row(s) of ``r``'s size, of the main table and of the
    second one: one on the host; staged, and direct when measured, on a device."""
    ref = r["allreduce_bytes"]
    one = "1.00" if ref else "-"
    if "transport" in r:
        staged, direct = r["allreduce_staged_s"], r["allreduce_direct_s"]
        refs = [("staged", staged)] + ([("direct", direct)] if direct is not None else [])
    else:
        refs = [("", r["allreduce_s"])]
    main, extra = [], []
    for path, t in refs:
        key = [format_count(r["numel"]), f"MPI_Allreduce float32{' ' + path if path else ''}", ""]
        cells = [*key, f"{1e3 * t:.2f}"] + ([_ms(r.get("allreduce_predicted_s"))] if pred else [])
        cells += [f"{r['allreduce_s'] / t:.2f}", _bytes(ref), one, _bytes(ref), one, ""]
        main.append(cells)
        more = list(key)
        if tc:
            more += [f"{r['allreduce_device_bytes']:,}", ""] if "device_bytes" in r else ["", ""]
        if device:
            more += ["", "", ""]
            if path:
                over_direct = None if direct is None else t / direct
                more[-3:] = [path, _times(t / staged), _times(over_direct)]
        extra.append(more)
    return main, extra


class Report:
    """What ``mpicomp bench`` measured: kernel rows with their all-reduce entries, the
    model of ``--save-model`` (a ``mpicomp.model.Model``, else None), and with
    ``--reduce-scatter`` the reduce-scatter and allgather rows (``sharded``)."""

    def __init__(
        self,
        rows: list[dict],
        allreduce: list[dict],
        nranks: int,
        numel,
        model=None,
        sharded: list[dict] | None = None,
    ):
        self.rows = rows
        self.allreduce = allreduce
        self.nranks = nranks
        self.numel = numel
        self.model = model
        self.sharded = sharded or []

    def json_rows(self) -> list[dict]:
        """Return what ``--json`` prints: the codec rows (each with its all-reduce and
        reduce-scatter rows), then the allgather rows, which belong to no codec."""
        return self.rows + [r for r in self.sharded if r["precision"] is not None]

    def print(self, reps: int, allreduce_reps: int, out=None) -> None:
        """Print both tables with their headers (to stdout by default)."""
        out = sys.stdout if out is None else out
        kernels = [r for r in self.rows if r["encode_gbps"] is not None]
        if kernels:
            backend = kernels[0]["backend"]
            if backend == "numba":
                threads = kernels[0].get("threads") or numba.get_num_threads()
                backend += f" backend ({plural(threads, 'thread')})"
            else:
                backend += " backend"
            gpu = backend.startswith("cuda ")
            copy = "device-to-device copy (cupy.copyto)" if gpu else "memcpy (np.copyto)"
            text = (
                f"{title('bench')}: {self.numel:,} float32 elements "
                f"({self.numel * 4 / 2**20:.1f} MiB), one process, {backend}; median and "
                f"min-max of {reps} after a warm-up, BLAS, OpenMP and torch threads held to "
                f"one meanwhile.\n{copy} of the same buffer, same run: "
                f"{kernels[0]['memcpy_gbps']:.2f} GB/s (x/memcpy: a median over it)."
            )
            print(note(text), file=out)
            format_table(kernels, out)
            text = (
                "GB/s: float32 input bytes / time (1 GB = 1e9 B); bits/elem: one rank's wire "
                "(payload with header, or ring codes at the first step's width);\n"
                "rel.err: ||decode(encode(g)) - g|| / ||g||, one rank, no error feedback."
            )
            print(note(text), file=out)
        if self.allreduce:
            first = self.allreduce[0]
            device = "transport" in first
            where = "device arrays" if device else "host arrays"
            text = (
                f"all-reduce on {plural(self.nranks, 'rank')}, {where}, {first['backend']} kernels: "
                "CompressedComm.allreduce against MPI_Allreduce of float32, the slowest "
                f"rank's time, median of {allreduce_reps} after a warm-up.\nspeedup = "
                "MPI_Allreduce time / compressed time; sent B, recv B: bytes per rank per "
                "call (K = 1e3, M = 1e6; --json has them exact), 'x ring' over a float32 "
                "ring's 2(N-1)/N*4n.\nenc/xchg/dec ms: per call, the slowest "
                "rank's encode / exchange (every message, waiting included) / decode, "
                "median (from a trace of the timed calls)."
            )
            if device:
                text += (
                    "\nOn the device, speedup is over the MPI_Allreduce reference of the "
                    "row's own path: staged (device to pinned host, MPI_Allreduce, host to "
                    "device) or direct (device buffers to a CUDA-aware MPI)."
                )
            print("\n" + note(text), file=out)
            format_allreduce_table(self.allreduce, out)
            format_verdicts(chooser_verdicts(self.allreduce), out)
        if self.sharded:
            first = self.sharded[0]
            text = (
                f"reduce-scatter and allgather on {plural(self.nranks, 'rank')}, host arrays, "
                f"{first['backend']} kernels, FSDP's layout (rows of S = ceil(n/N) elements): "
                "CompressedComm.reduce_scatter against MPI_Reduce_scatter of the float32 "
                "buffer padded to N*S, CompressedComm.allgather (float32, bfloat16) against "
                "MPI_Allgather of S float32; the slowest rank's time, median of "
                f"{allreduce_reps} after a warm-up.\nspeedup = the MPI reference's time / "
                "the row's; sent B, recv B: bytes per rank per call, 'x f32' over a float32 "
                "reduce-scatter's 4(N-1)S ((N-1)/N*4n where N divides n); an allgather's "
                "sent B counts its shard once (the buffer given to MPI)."
            )
            print("\n" + note(text), file=out)
            format_sharded_table(self.sharded, out)
