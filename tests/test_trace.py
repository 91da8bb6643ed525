"""HDF5 traces in one process (COMM_SELF): the writer's rows and limits, a file that
survives a crash, and what summarize() and plot() make of a trace."""

import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

import mpicomp
from conftest import gradient_like
from mpicomp import trace
from mpicomp.trace import format, recorder, report


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


# Version 1's events: version 2's without t_start (readers must still take them).
# Version 1 had neither t_start (version 2) nor schedule and t_predicted (version 3).
V1_EVENT_DTYPE = np.dtype(
    [f for f in format.EVENT_DTYPE.descr if f[0] not in ("t_start", "schedule", "t_predicted")]
)


def _synthetic(path, version=1):
    """Write a version-1 trace as docs/trace-format.md describes it, with h5py alone,
    known numbers.

    Two ranks; "fc1.weight" (qsgd_maxnorm, 1000 elements, 500 bytes sent: ratio 8) on
    calls 0, 2, ..., 18 with t_total = 1..10 ms; "fc1.bias" (none, 10 elements) between.
    Phases: 25% encode, 50% comm, 20% decode.
    """
    rows = []
    for call in range(20):
        big = call % 2 == 0
        for rank in range(2):
            t = (call // 2 + 1) * 1e-3 if big else 1e-4
            numel = 1000 if big else 10
            rows.append(
                (call, call, rank, b"allreduce" if big else b"allreduce below min_numel",
                 b"qsgd_maxnorm" if big else b"none", b"fc1.weight" if big else b"fc1.bias",
                 numel, 4 * numel, 500 if big else 232, 600 if big else 232,
                 0.25 * t, 0.5 * t, 0.2 * t, t)
            )  # fmt: skip
    with h5py.File(path, "w") as f:
        f.attrs["mpicomp_trace_version"] = version
        f.attrs["mpicomp_version"] = "0.1.0"
        f.attrs["mpi_library_version"] = "MPICH Version: 9.9\nMPICH Device: ch4"
        f.attrs["mpi_vendor"] = "MPICH 9.9"
        f.attrs["world_size"] = 2
        f.attrs["codec"] = "qsgd_maxnorm"
        f.attrs["codec_params"] = '{"bits": 4, "seed": 0}'
        f.attrs["trace_level"] = 1
        f.create_dataset("events", data=np.array(rows, dtype=V1_EVENT_DTYPE), maxshape=(None,))


def _table(text: str) -> dict[str, list[str]]:
    """The summary's rows by tensor name, split into cells."""
    return {line.split()[1]: line.split() for line in text.splitlines() if "fc1." in line}


def test_summarize_reports_codecs_bytes_ratio_latency_and_phases(tmp_path):
    path = tmp_path / "synthetic.h5"
    _synthetic(path)
    text = report.summarize(path)
    assert "MPICH Version: 9.9" in text and "qsgd_maxnorm" in text and '"bits": 4' in text
    rows = _table(text)
    weight, bias = rows["fc1.weight"], rows["fc1.bias"]
    # codec, tensor, schedule (- before format 3), calls, sent B, recv B, ratio,
    # p50/p90/p99 ms, enc/comm/dec % (no pred column: no prediction in the trace)
    assert weight[0] == "qsgd_maxnorm" and bias[0] == "none"
    # The first call of each tensor (1 ms of 1..10 ms) is left out: 9 calls of 2..10 ms.
    assert weight[2:7] == ["-", "9", "500", "600", "8.0x"]
    p50, p90, p99 = map(float, weight[7].split("/"))
    assert (p50, p90, p99) == pytest.approx((6.0, 9.3, 10.0), abs=0.01)
    assert weight[8] == "25/50/20"
    assert bias[2:8] == ["-", "9", "232", "232", "0.2x", "0.1/0.1/0.1"]
    assert "the first call of each row is left out: 2 calls" in text
    # With --all-calls every call counts: the median of 1..10 ms, each on 2 ranks.
    weight = _table(report.summarize(path, all_calls=True))["fc1.weight"]
    assert weight[3] == "10" and weight[7].split("/")[:2] == ["5.5", "9.1"]


def test_warm_up_is_the_first_call_of_each_group_with_more_than_one(tmp_path):
    path = tmp_path / "synthetic.h5"
    _synthetic(path)
    events, _, _ = report.read(path)
    warm = report.warmup_mask(events)
    # call 0 (fc1.weight) and call 1 (fc1.bias), on both ranks
    assert sorted(set(events["call"][warm].tolist())) == [0, 1] and warm.sum() == 4
    one = events[events["call"] == 0]  # a group of one call keeps it: nothing else to show
    assert not report.warmup_mask(one).any()


def test_summary_data_are_numbers_and_every_row_fits_120_columns(tmp_path):
    path = tmp_path / "synthetic.h5"
    _synthetic(path)
    doc = report.summary(path)
    weight = doc["rows"][0]
    assert weight["tensor"] == "fc1.weight" and weight["calls"] == 9
    assert weight["warmup_calls"] == 1 and weight["ratio"] == pytest.approx(8.0)
    assert weight["encode_share"] == pytest.approx(0.25) and weight["pred_ms"] is None
    assert doc["rows"][-1]["codec"] == "all" and doc["rows"][-1]["calls"] == 18
    # Long names are cut in the middle to keep the table within 120 columns.
    with h5py.File(path, "a") as f:
        ev = f["events"][()]
        ev["name"][ev["name"] == b"fc1.weight"] = b"encoder.layers.11.attention.fc1.weight" * 3
        ev["codec"][ev["codec"] == b"none"] = b"grandk_maxnorm_multiscale"
        f["events"][...] = ev
    lines = report.summarize(path).splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    assert any("~" in line and line.startswith("qsgd_maxnorm") for line in lines)


def test_summarize_a_directory_reads_every_trace_in_it(tmp_path):
    for name in ("a.h5", "b.h5"):
        _synthetic(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a trace, not read")
    text = report.summarize(tmp_path)
    assert text.count("mpicomp trace ") == 2
    assert f"mpicomp trace {tmp_path / 'a.h5'}" in text and str(tmp_path / "b.h5") in text
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no trace files"):
        report.summarize(empty)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path, out = tmp_path / "synthetic.h5", tmp_path / "trace.png"
    _synthetic(path)
    report.plot(path, out)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 10_000


def test_plot_bytes_from_zero_beside_float32_and_whole_call_ticks(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "synthetic.h5"
    _synthetic(path)
    fig = report.figure(path)
    ax_bytes, ax_time, ax_phase = fig.axes[:3]
    # A constant 500 bytes is drawn from 0, not as variation around 500.
    assert ax_bytes.get_ylim()[0] == 0
    dashed = [ln for ln in ax_bytes.get_lines() if ln.get_linestyle() == "--"]
    # fc1.weight's float32 ring at 2 ranks: 2(N-1)/N x 4000 bytes = 4000 per call.
    assert any((ln.get_ydata() == 4000).all() for ln in dashed)
    for ax in (ax_bytes, ax_time):
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    # The warm-up calls are marks of their own; the lines start at each tensor's second.
    marks = [ln for ln in ax_time.get_lines() if ln.get_marker() == "x"]
    assert [list(ln.get_xdata()) for ln in marks] == [[0, 1]]
    assert min(min(ln.get_xdata()) for ln in ax_time.get_lines() if ln not in marks) == 2


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "synthetic.h5"
    _synthetic(path)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match=r"pip install mpicomp\[plot\]"):
        report.plot(path, tmp_path / "x.png")


def test_paths_that_are_not_traces_raise_value_error(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not hdf5")
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(3)
    future = tmp_path / "future.h5"
    _synthetic(future, version=format.FORMAT_VERSION + 1)
    cases = [
        (tmp_path / "missing.h5", "no such file"),
        (text, "not an HDF5 file"),
        (other, "not an mpicomp trace"),
        (future, f"version {format.FORMAT_VERSION + 1}"),
    ]
    for path, message in cases:
        for fn in (report.read, report.summarize):
            with pytest.raises(ValueError, match=message):
                fn(path)
        with pytest.raises(ValueError, match=message):
            report.plot(path, tmp_path / "x.png")
    for fn in (report.read, lambda p: report.plot(p, tmp_path / "x.png")):
        with pytest.raises(ValueError, match="is a directory, not a trace file"):
            fn(tmp_path)


def test_tracer_rows_names_and_growth_past_the_first_buffer(tmp_path):
    path = tmp_path / "grow.h5"
    long_name = "é" * 100  # 200 bytes of UTF-8: cut to 128 bytes, 64 whole characters
    with trace.Tracer(_self(), path, level=2, flush_every=None) as t:
        for c in range(300):  # beyond the first 128 rows and 2048 steps, without a flush
            t.begin(1000 + c, "allreduce", "signsgd", long_name if c == 0 else f"p{c}", c)
            for s in range(1, 9):
                t.record("ring.step", s, c, 2 * c, s)
            t.end()
    events, steps, attrs = report.read(path)
    assert events["call"].tolist() == list(range(300))
    assert events["step"].tolist() == list(range(1000, 1300))
    assert events["name"][0].decode() == "é" * 64
    assert events["name"][299] == b"p299"
    assert (events["bytes_in"] == 4 * np.arange(300)).all()
    assert (events["bytes_sent"] == 8 * np.arange(300)).all()
    assert (events["bytes_recv"] == 16 * np.arange(300)).all()
    assert steps.size == 300 * 8
    assert steps["call"].tolist() == [c for c in range(300) for _ in range(8)]
    assert steps["bits"].tolist() == list(range(1, 9)) * 300
    assert attrs["flush_every"] == 0 and attrs["world_size"] == 1


def test_tracer_checks_its_arguments(tmp_path):
    comm = _self()
    with pytest.raises(TypeError, match="path"):
        trace.Tracer(comm, 123)
    with pytest.raises(ValueError, match="level"):
        trace.Tracer(comm, tmp_path / "t.h5", level=0)
    with pytest.raises(ValueError, match="flush_every"):
        trace.Tracer(comm, tmp_path / "t.h5", flush_every=0)
    with pytest.raises(TypeError, match="flush_every"):
        trace.Tracer(comm, tmp_path / "t.h5", flush_every="10")
    t = trace.Tracer(comm, tmp_path / "t.h5")
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.begin(0, "allreduce", "none", "x", 1)


def test_compressed_comm_trace_records_phases_and_run_attributes(tmp_path):
    path = tmp_path / "cc.h5"
    x = gradient_like(4099, seed=3)
    with mpicomp.CompressedComm(_self(), "threelc", sparsity=1.5, trace=path) as cc:
        for _ in range(3):
            y = cc.allreduce(x, name="fc1.weight")
    events, steps, attrs = report.read(path)
    assert steps is None and events.size == 3
    assert y.shape == x.shape
    assert (events["t_encode"] > 0).all() and (events["t_decode"] > 0).all()
    assert (events["t_encode"] + events["t_comm"] + events["t_decode"] <= events["t_total"]).all()
    assert attrs["codec"] == "threelc" and '"sparsity": 1.5' in attrs["codec_params"]
    assert attrs["error_feedback"] is True and attrs["sharded"] is False
    assert attrs["backend"] == "numba" and attrs["cuda_aware"] is False
    assert attrs["mpicomp_version"] == mpicomp.__version__
    assert attrs["start_time"].endswith("+00:00") and "end_time" in attrs


def test_untraced_calls_never_read_the_clock(monkeypatch):
    def boom():
        raise AssertionError("perf_counter called without a trace")

    monkeypatch.setattr(recorder, "perf_counter", boom)
    x = gradient_like(2000, seed=1)
    for name in ("none", "qsgd_maxnorm", "signsgd", "threelc"):
        with mpicomp.CompressedComm(_self(), name) as cc:
            cc.allreduce(x, name="w")
            cc.allreduce_many([x, x[:10]])


def test_a_process_that_dies_keeps_the_flushed_rows(tmp_path):
    path = tmp_path / "died.h5"
    script = textwrap.dedent(
        f"""
        import os
        from mpi4py import MPI
        from mpicomp.trace import Tracer
        t = Tracer(MPI.COMM_SELF, {str(path)!r}, flush_every=4)
        for c in range(10):
            t.begin(c, "allreduce", "none", "w", 8)
            t.end()
        os._exit(3)  # no close, no atexit: as a killed job
        """
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True)
    assert done.returncode == 3, done.stderr.decode()
    events, _, attrs = report.read(path)
    assert events["call"].tolist() == list(range(8)) and "end_time" not in attrs
