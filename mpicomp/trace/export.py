"""Traces as timelines: the Chrome trace-event JSON that Perfetto (ui.perfetto.dev) and
chrome://tracing open, one process per rank.

Each call is one span on the rank's first row (``op name``, with its codec, sizes and
bytes as arguments, and ``warmup``: whether it is the first call of its tensor, which
``mpicomp trace summary`` leaves out); the second row holds its phases, encode, exchange and decode,
drawn back to back in that order with their total durations (within a call the
phases interleave, e.g. a gather codec decodes as payloads arrive: the trace keeps
their totals, not each slice); at trace level 2 the third row holds the exchange
steps, each from the previous step's end (or the call's start) to its own end.
"""

from __future__ import annotations

import json
import os

import numpy as np

from mpicomp.trace.report import read, warmup_mask

__all__ = ["FORMATS", "chrome", "export"]

FORMATS = ("chrome",)
_US = 1e6  # trace-event times are microseconds


def chrome(path) -> dict:
    """Return the trace at ``path`` as a Chrome trace-event document (a dict).

    Raises:
        ValueError: not a trace (as ``mpicomp.trace.report.read``), or a format-1 trace,
            which has no start times.
    """
    events, steps, attrs = read(path)
    if events.size and np.isnan(events["t_start"]).any():
        raise ValueError(
            f"{os.fspath(path)!r} is a format-1 trace: it has no start times to place "
            "its events on a timeline (traces from this mpicomp have them)"
        )
    out: list[dict] = []
    for rank in sorted({int(r) for r in events["rank"]}):
        out.append(_meta(rank, "process_name", f"rank {rank}"))
        for tid, label in enumerate(("calls", "phases", "exchange steps")):
            out.append(_meta(rank, "thread_name", label, tid))
    by_call = {}
    warm = warmup_mask(events) if events.size else np.zeros(0, dtype=bool)
    for ev, first in zip(events, warm, strict=True):
        rank, start = int(ev["rank"]), float(ev["t_start"])
        op, name = ev["op"].decode(), ev["name"].decode()
        by_call[(int(ev["call"]), rank)] = start
        args = {
            "codec": ev["codec"].decode(),
            "name": name,
            "call": int(ev["call"]),
            "step": int(ev["step"]),
            "numel": int(ev["numel"]),
            "bytes_in": int(ev["bytes_in"]),
            "bytes_sent": int(ev["bytes_sent"]),
            "bytes_recv": int(ev["bytes_recv"]),
            "schedule": ev["schedule"].decode(),
            "warmup": bool(first),  # a tensor's first call: compiles, allocates
        }
        if np.isfinite(ev["t_predicted"]):
            args["predicted_ms"] = float(ev["t_predicted"]) * 1e3
        out.append(_span(f"{op} {name}".strip(), "call", rank, 0, start, ev["t_total"], args))
        at = start
        for phase, column in (
            ("encode", "t_encode"),
            ("exchange", "t_comm"),
            ("decode", "t_decode"),
        ):
            out.append(_span(phase, "phase", rank, 1, at, ev[column], {"call": int(ev["call"])}))
            at += float(ev[column])
    if steps is not None:
        last: dict[tuple[int, int], float] = {}
        for s in steps:
            key = (int(s["call"]), int(s["rank"]))
            begin = last.get(key, by_call.get(key, float(s["t_end"])))
            end = float(s["t_end"])
            args = {"sent": int(s["sent"]), "recv": int(s["recv"]), "bits": int(s["bits"])}
            name = f"{s['op'].decode()} {int(s['substep'])}"
            out.append(_span(name, "step", key[1], 2, begin, end - begin, args))
            last[key] = end
    other = {
        k: str(attrs[k]) for k in ("codec", "world_size", "mpi_vendor", "start_time") if k in attrs
    }
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def export(path, out, fmt: str = "chrome") -> int:
    """Write the trace at ``path`` to ``out`` as ``fmt`` (``"chrome"``); return the
    number of trace events written."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (have: {', '.join(FORMATS)})")
    doc = chrome(path)
    with open(out, "w") as f:
        json.dump(doc, f)
    return len(doc["traceEvents"])


def _span(name: str, cat: str, rank: int, tid: int, start: float, dur, args: dict) -> dict:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": start * _US,
        "dur": max(float(dur), 0.0) * _US,
        "pid": rank,
        "tid": tid,
        "args": args,
    }


def _meta(rank: int, what: str, name: str, tid: int = 0) -> dict:
    return {"name": what, "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
