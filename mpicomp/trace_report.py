"""Reading HDF5 traces: ``read``, ``summarize`` (the CLI's table) and ``plot``.

Needs only h5py and NumPy (matplotlib for ``plot``), no MPI: the format comes from
``mpicomp.trace_format``, not from the writer (``mpicomp.trace``).
"""

from __future__ import annotations

import os

import numpy as np

from mpicomp.trace_format import (
    EVENT_DTYPE,
    EVENTS,
    READABLE,
    STEP_DTYPE,
    STEPS,
    VERSION_ATTR,
    import_h5py,
    upgraded,
)


def read(path) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """Return a trace's events, its steps (None below level 2) and its run attributes.

    Raises:
        ValueError: ``path`` does not exist, is not HDF5, is not an mpicomp trace, or
            has a format version this mpicomp does not read.
    """
    h5py = import_h5py()
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"trace path must be a file path, got {path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {os.fspath(path)!r}")
    if not h5py.is_hdf5(path):
        raise ValueError(f"not an HDF5 file: {os.fspath(path)!r}")
    with h5py.File(path, "r") as f:
        version = f.attrs.get(VERSION_ATTR)
        if version is None or EVENTS not in f:
            raise ValueError(f"not an mpicomp trace (no {VERSION_ATTR}): {os.fspath(path)!r}")
        if int(version) not in READABLE:
            raise ValueError(
                f"trace format version {int(version)} of {os.fspath(path)!r} is not supported "
                f"(this mpicomp reads versions {', '.join(map(str, READABLE))})"
            )
        # Older versions come back in today's columns, the missing times NaN.
        events = upgraded(f[EVENTS][()], EVENT_DTYPE)
        steps = upgraded(f[STEPS][()], STEP_DTYPE) if STEPS in f else None
        attrs = {k: _plain(v) for k, v in f.attrs.items()}
    return events, steps, attrs


def _plain(value):
    """Return an HDF5 attribute as a Python value (str, int, float, bool)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


def _groups(events: np.ndarray) -> list[tuple[str, str, np.ndarray]]:
    """Return (codec, name, row mask) per (codec, tensor name, schedule), in order of
    first call (a tensor whose calls ran by several schedules has a row for each)."""
    keys = np.char.add(np.char.add(events["codec"], b"\0"), events["name"])
    keys = np.char.add(np.char.add(keys, b"\0"), events["schedule"])
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    out = []
    for g in np.argsort(first, kind="stable"):
        mask = inverse.reshape(-1) == g
        row = events[first[g]]
        out.append((_plain(row["codec"]), _plain(row["name"]), mask))
    return out


def _ratio(bytes_in: float, sent: float) -> str:
    return f"{bytes_in / sent:.1f}x" if sent > 0 else "-"


def summarize(path) -> str:
    """Return a text table of a trace: per (codec, tensor name), bytes, ratio, latency, phases.

    Columns: schedule (how the calls moved their bytes; empty before format 3); calls
    (collective calls, each made by every rank); sent/call and recv/call (mean bytes per
    rank per call); ratio (float32 input bytes / bytes sent); latency p50/p90/p99 of
    t_total over every rank's calls (ms); pred ms (the model's median prediction, "-"
    without one); the share of t_total spent in encode, comm and decode (the rest is
    bookkeeping).

    Raises:
        ValueError: ``path`` is not a readable mpicomp trace (see ``read``).
    """
    events, steps, attrs = read(path)
    lines = [f"mpicomp trace {os.fspath(path)} (format {attrs.get(VERSION_ATTR)})"]

    def add(label: str, key: str):
        if key in attrs:
            lines.append(f"  {label:<14}{attrs[key]}")

    add("mpicomp", "mpicomp_version")
    add("ranks", "world_size")
    if "mpi_library_version" in attrs:
        first = " ".join(str(attrs["mpi_library_version"]).splitlines()[0].split())
        lines.append(f"  {'MPI library':<14}{first} ({attrs.get('mpi_vendor', '?')})")
    if "codec" in attrs:
        lines.append(f"  {'codec':<14}{attrs['codec']} {attrs.get('codec_params', '{}')}")
    options = [
        f"{k}={attrs[k]}"
        for k in ("min_numel", "bucket_numel", "error_feedback", "sharded", "schedule")
        if k in attrs
    ]
    if options:
        lines.append(f"  {'options':<14}{' '.join(options)}")
    add("backend", "backend")
    add("cuda_aware", "cuda_aware")
    add("command", "command_line")
    lines.append(
        f"  {'started':<14}{attrs.get('start_time', '?')}, ended {attrs.get('end_time', 'not closed')}"
    )
    lines.append(
        f"  {'detail level':<14}{attrs.get('trace_level', '?')}, {events.size} events"
        + (f", {steps.size} steps" if steps is not None else "")
    )
    lines.append("")
    if events.size == 0:
        lines.append("no events recorded")
        return "\n".join(lines)
    nranks = max(int(attrs.get("world_size", 0)), len(np.unique(events["rank"])))
    head = SUMMARY_COLUMNS
    rows = [_summary_row(c, n or "(unnamed)", events[m], nranks) for c, n, m in _groups(events)]
    rows.append(_summary_row("all", "", events, nranks))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(  # noqa: E731
        str(c).ljust(w) if i < 3 else str(c).rjust(w)
        for i, (c, w) in enumerate(zip(r, widths, strict=True))
    )
    lines.append(fmt(head))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(r) for r in rows)
    return "\n".join(lines)


#: The columns of the summary table (and of ``mpicomp trace summary --json``'s rows).
SUMMARY_COLUMNS = ("codec", "tensor", "schedule", "calls", "sent/call", "recv/call", "ratio",
                   "p50 ms", "p90 ms", "p99 ms", "pred ms", "encode", "comm", "decode")  # fmt: skip


def _summary_row(codec: str, name: str, ev: np.ndarray, nranks: int) -> tuple:
    if len(name) > 40:
        name = name[:39] + "~"
    total = ev["t_total"].sum()
    share = lambda col: f"{100 * ev[col].sum() / total:.0f}%" if total > 0 else "-"  # noqa: E731
    p50, p90, p99 = np.percentile(ev["t_total"], [50, 90, 99]) * 1e3
    schedules = {_plain(s) for s in np.unique(ev["schedule"])}
    predicted = ev["t_predicted"][np.isfinite(ev["t_predicted"])]
    return (
        codec,
        name,
        "/".join(sorted(schedules)) or "-",  # none recorded before format 3
        -(-ev.size // nranks),
        f"{ev['bytes_sent'].mean():.0f}",
        f"{ev['bytes_recv'].mean():.0f}",
        _ratio(float(ev["bytes_in"].sum()), float(ev["bytes_sent"].sum())),
        f"{p50:.3f}",
        f"{p90:.3f}",
        f"{p99:.3f}",
        f"{np.median(predicted) * 1e3:.3f}" if predicted.size else "-",
        share("t_encode"),
        share("t_comm"),
        share("t_decode"),
    )


_PLOT_GROUPS = 12  # bars in the phase panel: the tensors that took the most time


def _phase_bars(ax, events: np.ndarray) -> None:
    """Stack each (codec, tensor)'s encode/comm/decode/other share of t_total, in %."""
    groups = _groups(events)
    busy = [events[m]["t_total"].sum() for _, _, m in groups]
    groups = [groups[i] for i in np.argsort(busy)[::-1][:_PLOT_GROUPS]]
    totals = np.array([events[m]["t_total"].sum() for _, _, m in groups])
    totals[totals <= 0] = np.inf
    x = np.arange(len(groups))
    bottom = np.zeros(len(groups))
    for column, label in (("t_encode", "encode"), ("t_comm", "comm"), ("t_decode", "decode")):
        share = np.array([events[m][column].sum() for _, _, m in groups]) / totals * 100
        ax.bar(x, share, bottom=bottom, label=label)
        bottom += share
    ax.bar(x, np.clip(100 - bottom, 0, None), bottom=bottom, label="other", color="0.8")
    labels = []
    for codec, name, m in groups:
        mean_ms = events[m]["t_total"].mean() * 1e3
        labels.append(f"{codec}\n{(name or '(unnamed)')[:20]}\n{mean_ms:.3g} ms/call")
    ax.set_xticks(x, labels, fontsize="x-small")
    ax.set_ylim(0, 100)
    ax.set_ylabel("% of t_total")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")


def plot(path, out_png) -> None:
    """Draw bytes sent and t_total per call, and the phase split per tensor, into a PNG.

    Per call (x axis: the ``call`` column): the mean over ranks with the min-max band
    across ranks; the bottom panel stacks, for the (codec, tensor name) groups that took
    the most time, the share of t_total spent in encode, comm, decode and the rest.

    Raises:
        ValueError: ``path`` is not a readable mpicomp trace, or it holds no events.
        RuntimeError: matplotlib is not installed.
    """
    events, _, attrs = read(path)
    if events.size == 0:
        raise ValueError(f"trace {os.fspath(path)!r} holds no events to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("plot needs matplotlib: pip install mpicomp[plot]") from None

    calls = np.unique(events["call"])
    per_call = np.searchsorted(calls, events["call"])

    def by_call(column: str, scale: float):
        values = events[column] * scale
        lo = np.full(calls.size, np.inf)
        hi = np.full(calls.size, -np.inf)
        np.minimum.at(lo, per_call, values)
        np.maximum.at(hi, per_call, values)
        mean = np.bincount(per_call, values, calls.size) / np.bincount(per_call, None, calls.size)
        return mean, lo, hi

    fig = Figure(figsize=(9, 9), layout="constrained")
    FigureCanvasAgg(fig)
    ax_bytes, ax_time, ax_phase = fig.subplots(3, 1)
    for ax, column, scale, label in (
        (ax_bytes, "bytes_sent", 1.0, "bytes sent per rank"),
        (ax_time, "t_total", 1e3, "t_total (ms)"),
    ):
        mean, lo, hi = by_call(column, scale)
        ax.fill_between(calls, lo, hi, alpha=0.3, step="mid", label="min-max over ranks")
        ax.plot(calls, mean, drawstyle="steps-mid", label="mean over ranks")
        ax.set_xlabel("call")
        ax.set_ylabel(label)
        if column == "t_total":  # the first call also compiles kernels: a log axis keeps the rest
            ax.set_yscale("log")
        ax.legend(loc="upper right", fontsize="small")
    _phase_bars(ax_phase, events)
    title = f"{attrs.get('codec', 'trace')} on {attrs.get('world_size', '?')} ranks: {os.path.basename(os.fspath(path))}"
    fig.suptitle(title)
    fig.savefig(out_png, dpi=100)


__all__ = ["plot", "read", "summarize"]
