"""Timelines: trace format 2's start times, the Chrome/Perfetto export against the HDF5
rows, version-1 files, and CompressedComm(on_call=...) with and without a file."""

import json
import logging

import h5py
import numpy as np
import pytest
from test_trace import _synthetic

import mpicomp
from conftest import gradient_like
from mpicomp.tools import cli
from mpicomp.trace import report
from mpicomp.trace.export import chrome

US = 1e6


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


def _run(path=None, on_call=None, level=2):
    kw = {"trace": path, "trace_level": level} if path is not None else {}
    with mpicomp.CompressedComm(
        _self(), "topk", ratio=0.1, min_numel=64, on_call=on_call, **kw
    ) as cc:
        for step in range(3):
            cc.allreduce(gradient_like(500, seed=step), name="w")
            cc.allreduce(gradient_like(10, seed=step), name="b")
        cc.allreduce_many([gradient_like(300), gradient_like(20)], names=["x", "y"])


def test_on_call_gets_every_event_the_file_holds(tmp_path):
    seen = []
    _run(tmp_path / "t.h5", seen.append)
    events, _, attrs = report.read(tmp_path / "t.h5")
    assert attrs["mpicomp_trace_version"] == 3 and "epoch_unix" in attrs
    assert len(seen) == events.size == 7  # 6 calls, then one fused bucket
    for ev, row in zip(seen, events, strict=True):
        assert ev["op"] == row["op"].decode() and ev["name"] == row["name"].decode()
        for key in ("numel", "bytes_sent", "bytes_recv", "t_start", "t_total", "t_comm"):
            assert ev[key] == row[key], key
    starts = events["t_start"]
    assert (starts[1:] >= starts[:-1] + events["t_total"][:-1]).all()


def test_on_call_without_a_trace_file_and_a_raising_callback(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = []
    _run(on_call=seen.append)
    assert [e["name"] for e in seen[:2]] == ["w", "b"] and len(seen) == 7
    assert list(tmp_path.iterdir()) == []  # no file of any kind

    def broken(event):
        raise KeyError("dashboard down")

    with caplog.at_level(logging.ERROR, logger="mpicomp"):
        _run(on_call=broken)  # every call still returns
    assert caplog.text.count("on_call raised") == 7 and "dashboard down" in caplog.text


def test_chrome_export_places_every_row_of_the_trace(tmp_path):
    path = tmp_path / "t.h5"
    _run(path)
    events, steps, _ = report.read(path)
    doc = json.loads(json.dumps(chrome(path)))  # plain JSON all the way
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    calls = [e for e in spans if e["cat"] == "call"]
    assert len(calls) == events.size
    for e, row in zip(calls, events, strict=True):
        assert e["pid"] == row["rank"] and e["args"]["bytes_sent"] == row["bytes_sent"]
        assert e["ts"] == pytest.approx(row["t_start"] * US)
        assert e["dur"] == pytest.approx(row["t_total"] * US)
        phases = [p for p in spans if p["cat"] == "phase" and p["args"]["call"] == row["call"]]
        assert [p["name"] for p in phases] == ["encode", "exchange", "decode"]
        assert phases[0]["ts"] == e["ts"]
        assert phases[-1]["ts"] + phases[-1]["dur"] <= e["ts"] + e["dur"] + 1e-3
    # w and b (3 calls each) have a warm-up; x and y (one call each) none.
    warm = [(e["args"]["name"], e["args"]["call"]) for e in calls if e["args"]["warmup"]]
    assert warm == [("w", 0), ("b", 1)]
    step_spans = [e for e in spans if e["cat"] == "step"]
    assert len(step_spans) == steps.size > 0
    assert sum(s["args"]["sent"] for s in step_spans) == int(events["bytes_sent"].sum())
    assert all(s["dur"] >= 0 for s in step_spans)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {"rank 0", "calls", "phases", "exchange steps"} <= names


def test_a_version_1_trace_reads_without_times_and_does_not_export(tmp_path, capsys):
    old = tmp_path / "v1.h5"
    _synthetic(old)
    events, _, _ = report.read(old)
    assert events.size == 40 and np.isnan(events["t_start"]).all()
    assert (events["bytes_sent"] > 0).all()  # the columns it has are intact
    with pytest.raises(ValueError, match="format-1 trace"):
        chrome(old)
    assert cli.main(["trace", "export", str(old)]) == 2
    assert "no start times" in capsys.readouterr().err


def test_cli_export_writes_json(tmp_path, capsys):
    path = tmp_path / "t.h5"
    _run(path, level=1)
    assert (
        cli.main(
            ["trace", "export", str(path), "--format", "chrome", "-o", str(tmp_path / "r.json")]
        )
        == 0
    )
    doc = json.loads((tmp_path / "r.json").read_text())
    assert sum(e["ph"] == "X" and e["cat"] == "call" for e in doc["traceEvents"]) == 7
    assert "wrote" in capsys.readouterr().err
    # plot and export draw one file; a directory is a usage error saying so
    assert cli.main(["trace", "export", str(tmp_path)]) == 2
    assert "is a directory: trace export takes one trace file" in capsys.readouterr().err
    with h5py.File(path) as f:
        assert f["events"].dtype.names[-3:] == ("t_start", "schedule", "t_predicted")
