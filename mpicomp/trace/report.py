"""Reading HDF5 traces: ``read``, ``summarize`` (the CLI's table) and ``plot``.

Needs only h5py and NumPy (matplotlib for ``plot``), no MPI: the format comes from
``mpicomp.trace.format``, not from the writer (``mpicomp.trace``).
"""

from __future__ import annotations

import os
import textwrap

import numpy as np

from mpicomp.tools.table import WIDTH, cut, plural
from mpicomp.tools.table import lines as table_lines
from mpicomp.trace.format import (
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
    if os.path.isdir(path):
        raise ValueError(
            f"{os.fspath(path)!r} is a directory, not a trace file (`mpicomp trace summary "
            "DIR` reads every trace in a directory)"
        )
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


def warmup_mask(events: np.ndarray) -> np.ndarray:
    """Return which events are warm-up calls: the first call of each (codec, tensor name,
    schedule) group, on every rank, unless it is the group's only call.

    A first call compiles or loads the codec's kernels and allocates the tensor's
    buffers (residuals, staging), so it can take seconds where the others take
    milliseconds; the summary and the plot leave these out of latencies and shares.
    """
    warm = np.zeros(events.size, dtype=bool)
    for _, _, mask in _groups(events):
        calls = events["call"][mask]
        first = calls.min()
        if (calls != first).any():
            warm |= mask & (events["call"] == first)
    return warm


def _ms(seconds: float) -> float:
    return round(float(seconds) * 1e3, 6)


def summary_rows(events: np.ndarray, nranks: int, all_calls: bool = False) -> list[dict]:
    """Return the summary's rows as numbers: one per (codec, tensor name, schedule), in
    order of first call, then the ``all`` row.

    Each row: ``codec``, ``tensor`` (the name; ``(unnamed)`` if none; empty in the
    ``all`` row), ``schedule`` (several joined by ``/``; empty before format 3),
    ``calls`` (collective calls counted, each made by every rank), ``warmup_calls``
    (left out: :func:`warmup_mask`; 0 with ``all_calls``), ``sent_per_call`` and
    ``recv_per_call`` (mean bytes per rank per call), ``ratio`` (bytes in over bytes
    sent; None when nothing was sent), ``p50_ms``, ``p90_ms``, ``p99_ms`` (of ``t_total``
    over every rank's calls), ``pred_ms`` (the model's median prediction; None without
    one), ``encode_share``, ``comm_share``, ``decode_share`` (each phase's part of
    ``t_total``, 0 to 1; None when no time was recorded). Every figure of a row is over
    its calls after the warm-up.
    """
    warm = np.zeros(events.size, dtype=bool) if all_calls else warmup_mask(events)
    groups = [(c, n or "(unnamed)", m) for c, n, m in _groups(events)]
    everything = np.ones(events.size, dtype=bool)
    return [
        _summary_row(codec, name, events, mask, warm, nranks)
        for codec, name, mask in [*groups, ("all", "", everything)]
    ]


def _summary_row(codec, name, events, mask, warm, nranks) -> dict:
    ev = events[mask & ~warm]
    total = float(ev["t_total"].sum())
    share = lambda col: float(ev[col].sum()) / total if total > 0 else None  # noqa: E731
    p50, p90, p99 = np.percentile(ev["t_total"], [50, 90, 99])
    predicted = ev["t_predicted"][np.isfinite(ev["t_predicted"])]
    sent = float(ev["bytes_sent"].sum())
    return {
        "codec": codec,
        "tensor": name,
        "schedule": "/".join(sorted({_plain(s) for s in np.unique(ev["schedule"])})),
        "calls": -(-ev.size // nranks),
        "warmup_calls": -(-int((mask & warm).sum()) // nranks),
        "sent_per_call": float(ev["bytes_sent"].mean()),
        "recv_per_call": float(ev["bytes_recv"].mean()),
        "ratio": float(ev["bytes_in"].sum()) / sent if sent > 0 else None,
        "p50_ms": _ms(p50),
        "p90_ms": _ms(p90),
        "p99_ms": _ms(p99),
        "pred_ms": _ms(np.median(predicted)) if predicted.size else None,
        "encode_share": share("t_encode"),
        "comm_share": share("t_comm"),
        "decode_share": share("t_decode"),
    }


def trace_files(path) -> list[str]:
    """Return the trace files ``path`` names: itself, or a directory's ``*.h5`` files
    (``mpicomp bench --trace DIR`` writes one per codec, size and schedule), sorted.

    Raises:
        ValueError: a directory without ``.h5`` files.
    """
    if not os.path.isdir(path):
        return [os.fspath(path)]
    found = sorted(
        os.path.join(path, f)
        for f in os.listdir(path)
        if f.endswith((".h5", ".hdf5")) and os.path.isfile(os.path.join(path, f))
    )
    if not found:
        raise ValueError(f"no trace files (*.h5) in directory {os.fspath(path)!r}")
    return found


def summary(path, all_calls: bool = False) -> dict:
    """Return what the summary of one trace file shows, as JSON-ready data:
    ``{"file", "run": its attributes (with "events" and "steps" counts), "rows":
    summary_rows}``.

    Raises:
        ValueError: ``path`` is not a readable mpicomp trace (see ``read``).
    """
    events, steps, attrs = read(path)
    rows = []
    if events.size:
        nranks = max(int(attrs.get("world_size", 0)), len(np.unique(events["rank"])))
        rows = summary_rows(events, nranks, all_calls)
    run = {k: v for k, v in attrs.items() if isinstance(v, (str, int, float, bool))}
    run["events"] = int(events.size)
    run["steps"] = None if steps is None else int(steps.size)
    return {"file": os.fspath(path), "run": run, "rows": rows}


def summarize(path, all_calls: bool = False) -> str:
    """Return a text table of a trace (of every trace of a directory, one after the
    other): per (codec, tensor name, schedule), bytes, ratio, latency, phases.

    Columns: schedule (how the calls moved their bytes; empty before format 3); calls
    (collective calls, each made by every rank); sent B and recv B (mean bytes per rank
    per call); ratio (float32 input bytes / bytes sent);
    p50/p90/p99 ms of t_total over every rank's calls; pred ms (the model's median
    prediction, only when the trace has one); enc/comm/dec %: the share of t_total spent
    in encode, comm and decode (the rest is bookkeeping). The first call of each row is
    left out of the latencies and shares (:func:`warmup_mask`) unless ``all_calls``.
    At most 120 columns: long tensor names are cut in the middle.

    Raises:
        ValueError: a file that is not a readable mpicomp trace (see ``read``), or a
            directory without trace files.
    """
    return "\n\n".join(_summarize_one(f, all_calls) for f in trace_files(path))


def _summarize_one(path, all_calls: bool) -> str:
    events, steps, attrs = read(path)
    lines = [f"mpicomp trace {os.fspath(path)} (format {attrs.get(VERSION_ATTR)})"]

    def add(label: str, value) -> None:
        lines.append(
            textwrap.fill(
                f"  {label:<14}{value}",
                WIDTH,
                subsequent_indent=" " * 16,
                break_long_words=True,
                break_on_hyphens=False,
            )
        )

    for label, key in (("mpicomp", "mpicomp_version"), ("ranks", "world_size")):
        if key in attrs:
            add(label, attrs[key])
    if "mpi_library_version" in attrs:
        first = " ".join(str(attrs["mpi_library_version"]).splitlines()[0].split())
        add("MPI library", f"{first} ({attrs.get('mpi_vendor', '?')})")
    if "codec" in attrs:
        add("codec", f"{attrs['codec']} {attrs.get('codec_params', '{}')}")
    options = [
        f"{k}={attrs[k]}"
        for k in ("min_numel", "bucket_numel", "error_feedback", "sharded", "schedule")
        if k in attrs
    ]
    if options:
        add("options", " ".join(options))
    for label, key in (("backend", "backend"), ("cuda_aware", "cuda_aware")):
        if key in attrs:
            add(label, attrs[key])
    if "command_line" in attrs:
        add("command", attrs["command_line"])
    add("started", f"{attrs.get('start_time', '?')}, ended {attrs.get('end_time', 'not closed')}")
    add(
        "detail level",
        f"{attrs.get('trace_level', '?')}, {plural(events.size, 'event')}"
        + (f", {plural(steps.size, 'step')}" if steps is not None else ""),
    )
    if events.size == 0:
        lines += ["", "no events recorded"]
        return "\n".join(lines)
    nranks = max(int(attrs.get("world_size", 0)), len(np.unique(events["rank"])))
    rows = summary_rows(events, nranks, all_calls)
    warm = rows[-1]["warmup_calls"]
    if not all_calls:
        add(
            "warm-up",
            f"the first call of each row is left out: {plural(warm, 'call')} (it compiles "
            "kernels and allocates buffers; --all-calls keeps them)",
        )
    lines.append("")
    pred = any(r["pred_ms"] is not None for r in rows)
    head = ["codec", "tensor", "schedule", "calls", "sent B", "recv B", "ratio"]
    head += ["p50/p90/p99 ms"] + (["pred ms"] if pred else []) + ["enc/comm/dec %"]
    body = [_cells(r, pred) for r in rows]
    right = range(3, len(head))
    lines += table_lines(head, body, right=right, squeeze=((1, 16), (2, 8), (0, 12), (1, 8)))
    return "\n".join(lines)


def _sig(ms: float) -> str:
    """Milliseconds to three significant digits, no exponent: 241, 18.3, 0.412."""
    if ms >= 100:
        return f"{ms:.0f}"
    return f"{ms:.3g}" if ms >= 0.001 else f"{ms:.4f}"


def _cells(r: dict, pred: bool) -> list[str]:
    shares = [r[f"{p}_share"] for p in ("encode", "comm", "decode")]
    cells = [r["codec"], r["tensor"], r["schedule"] or "-", str(r["calls"])]
    cells += [f"{r['sent_per_call']:.0f}", f"{r['recv_per_call']:.0f}"]
    cells += ["-" if r["ratio"] is None else f"{r['ratio']:.1f}x"]
    cells += ["/".join(_sig(r[k]) for k in ("p50_ms", "p90_ms", "p99_ms"))]
    if pred:
        cells += ["-" if r["pred_ms"] is None else _sig(r["pred_ms"])]
    cells += ["-" if None in shares else "/".join(f"{100 * v:.0f}" for v in shares)]
    return cells


_PLOT_GROUPS = 12  # bars in the phase panel: the tensors that took the most time


def _phase_bars(ax, events: np.ndarray, warm: np.ndarray) -> None:
    """Stack each (codec, tensor)'s encode/comm/decode/other share of t_total, in %, over
    its calls after the warm-up."""
    groups = [(c, n, m & ~warm) for c, n, m in _groups(events)]
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
        labels.append(f"{codec}\n{cut(name or '(unnamed)', 18)}\n{mean_ms:.3g} ms/call")
    ax.set_xticks(x, labels, fontsize="x-small")
    ax.set_ylim(0, 100)
    ax.set_ylabel("% of t_total (after warm-up)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")


_PLOT_LINES = 6  # tensors drawn per call in the top panels: those that took the most time


def _by_call(ev: np.ndarray, values: np.ndarray):
    """Return the calls of ``ev`` and, per call, the mean, min and max of ``values`` over
    ranks."""
    calls = np.unique(ev["call"])
    at = np.searchsorted(calls, ev["call"])
    lo = np.full(calls.size, np.inf)
    hi = np.full(calls.size, -np.inf)
    np.minimum.at(lo, at, values)
    np.maximum.at(hi, at, values)
    mean = np.bincount(at, values, calls.size) / np.bincount(at, None, calls.size)
    return calls, mean, lo, hi


def _bytes(n: float) -> str:
    """An axis label of bytes: 0, 500, 1.5K, 2M."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:g}{suffix}"
    return f"{n:g}"


def plot(path, out_png) -> None:
    """Draw :func:`figure` of the trace at ``path`` into a PNG, ``out_png``.

    Raises:
        ValueError: ``path`` is not a readable mpicomp trace, or it holds no events.
        RuntimeError: matplotlib is not installed.
    """
    figure(path).savefig(out_png, dpi=100, bbox_inches="tight")


def figure(path):
    """Return a matplotlib ``Figure`` of bytes sent and t_total per call, and of the phase
    split per tensor.

    The top panels draw, for the (codec, tensor name, schedule) groups that took the
    most time (six at most), one line per group over its calls (x: the ``call``
    column, whole numbers): the mean over ranks, with the min-max band across ranks.
    The bytes panel starts at 0 and draws, dashed in the same colour, what a float32
    ring all-reduce of the same tensor sends per rank (2(N-1)/N of its input bytes);
    the trace holds no float32 timing of them, so the time panel has no such line.
    Warm-up calls (:func:`warmup_mask`) are red marks on the time panel (log scale),
    left out of its lines and of the bottom panel, which stacks, for the groups that
    took the most time, the share of t_total spent in encode, comm, decode and the rest.

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
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter
    except ImportError:
        raise RuntimeError("plot needs matplotlib: pip install mpicomp[plot]") from None

    nranks = max(int(attrs.get("world_size", 0)), len(np.unique(events["rank"])))
    warm = warmup_mask(events)
    groups = _groups(events)
    busy = [events[m]["t_total"].sum() for _, _, m in groups]
    drawn = [groups[i] for i in np.argsort(busy, kind="stable")[::-1][:_PLOT_LINES]]
    names = [n for _, n, _ in groups]

    fig = Figure(figsize=(10, 10), layout="constrained")
    FigureCanvasAgg(fig)
    ax_bytes, ax_time, ax_phase = fig.subplots(3, 1)
    top = 1.0
    for k, (codec, name, mask) in enumerate(drawn):
        color = f"C{k}"
        ev = events[mask]
        label = f"{codec} {cut(name or '(unnamed)', 28)}"
        if names.count(name) > 1:  # the same tensor by several schedules or codecs
            label += f" ({_plain(ev['schedule'][0]) or '-'})"
        calls, mean, lo, hi = _by_call(ev, ev["bytes_sent"].astype(np.float64))
        ax_bytes.fill_between(calls, lo, hi, color=color, alpha=0.2, linewidth=0)
        ax_bytes.plot(calls, mean, ".-", color=color, markersize=3, label=label)
        ring = 2 * (nranks - 1) / nranks * ev["bytes_in"].astype(np.float64)
        _, ring_mean, _, _ = _by_call(ev, ring)
        ax_bytes.plot(calls, ring_mean, "--", color=color, linewidth=1)
        top = max(top, float(hi.max()), float(ring_mean.max()))
        timed = events[mask & ~warm]
        if timed.size:
            calls_t, mean_t, lo_t, hi_t = _by_call(timed, timed["t_total"] * 1e3)
            ax_time.fill_between(calls_t, lo_t, hi_t, color=color, alpha=0.2, linewidth=0)
            ax_time.plot(calls_t, mean_t, ".-", color=color, markersize=3, label=label)
    first = events[warm]
    if first.size:
        calls_w, mean_w, _, _ = _by_call(first, first["t_total"] * 1e3)
        ax_time.plot(calls_w, mean_w, "x", color="red", label="warm-up (a first call)")
    ax_bytes.set_ylim(0, top * 1.05)
    ax_bytes.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _bytes(v)))
    ax_bytes.set_ylabel("bytes sent per rank")
    handles, labels = ax_bytes.get_legend_handles_labels()
    handles.append(Line2D([], [], linestyle="--", color="0.3", linewidth=1))
    labels.append("dashed: float32 ring\nall-reduce, 2(N-1)/N x 4n")
    ax_bytes.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax_time.set_yscale("log")  # a warm-up call can take 1000x the others
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax_time.yaxis.set_major_formatter(plain)
    low, high = ax_time.get_ylim()
    # Label the minor ticks where few decades leave room: all within one, 2s and 5s
    # within three (else only the decades).
    decades = np.log10(high / low) if low > 0 else np.inf
    minor = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else "")
    minor = plain if decades < 1 else minor if decades < 3 else NullFormatter()
    ax_time.yaxis.set_minor_formatter(minor)
    ax_time.set_ylabel("t_total (ms), mean over ranks")
    ax_time.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    for ax in (ax_bytes, ax_time):
        ax.set_xlabel("call")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(float(events["call"].min()) - 0.5, float(events["call"].max()) + 0.5)
    _phase_bars(ax_phase, events, warm)
    more = len(groups) - len(drawn)
    fig.suptitle(
        f"{attrs.get('codec', 'trace')} on {plural(nranks, 'rank')}: "
        f"{os.path.basename(os.fspath(path))}"
        + (f" ({plural(more, 'tensor')} more not drawn per call)" if more > 0 else "")
    )
    return fig


__all__ = [
    "figure",
    "plot",
    "read",
    "summarize",
    "summary",
    "summary_rows",
    "trace_files",
    "warmup_mask",
]
