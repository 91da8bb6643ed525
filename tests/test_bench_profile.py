"""The Nsight Compute table of the GPU lane (``mpicomp.tools.bench.profile``): its phases'
bookkeeping on the CPU, and its arithmetic on an ncu CSV of known values."""

import json

import pytest

from mpicomp.tools.bench import profile as P


def _csv(kernels) -> str:
    """An ncu ``--csv`` log: noise lines, the header, one line per kernel and metric."""
    head = [
        "==PROF== Connected to process 1234",
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
        '"Metric Value"',
    ]
    lines = []
    for i, (name, metrics) in enumerate(kernels):
        for metric, value in metrics.items():
            lines.append(
                f'"{i}","1234","python","h","{name}","1","7","(256, 1, 1)","(8, 1, 1)","0",'
                f'"9.0","Command line profiler metrics","{metric}","","{value}"'
            )
    return "\n".join(head + lines) + "\n==PROF== Disconnected from process 1234\n"


def _kernel(ns, read, written, occupancy=50.0, memory=80.0, compute=20.0):
    return {
        P.DURATION: f"{ns:,}",
        P.READ: f"{read:,}",
        P.WRITTEN: f"{written:,}",
        P.OCCUPANCY: occupancy,
        P.MEMORY: memory,
        P.COMPUTE: compute,
        P.GRID: 4,
    }


def _mark(number):
    return ("mpicomp_profile_mark", {P.DURATION: 1000, P.READ: 0, P.WRITTEN: 0, P.GRID: number})


def test_phases_are_numbered_in_launch_order_with_what_they_must_move():
    rows = P.run(["qsgd_maxnorm", "topk"], 4096, "numba")
    assert [(r["codec"], r["phase"], r["mark"]) for r in rows] == [
        ("qsgd_maxnorm", "encode", 1),
        ("qsgd_maxnorm", "decode", 2),
        ("qsgd_maxnorm", "encode", 3),
        ("qsgd_maxnorm", "decode", 4),
        ("topk", "encode", 5),
        ("topk", "decode", 6),
    ]
    enc, dec = rows[4], rows[5]
    assert enc["input_bytes"] == dec["output_bytes"] == 4 * 4096
    assert enc["output_bytes"] == dec["input_bytes"] > 8 * 41  # 41 pairs and a header
    assert json.loads(json.dumps(rows)) == rows  # what --rows writes


def test_the_table_gives_each_phase_its_kernels_bytes_and_limiter():
    n = 1000
    rows = [
        {"codec": "c", "params": {}, "phase": p, "mark": i + 1, "numel": n,
         "input_bytes": a, "output_bytes": b}
        for i, (p, a, b) in enumerate([("encode", 4000, 250), ("decode", 250, 4000)])
    ]  # fmt: skip
    kernels = [
        ("cupy_warmup_leftover", _kernel(5, 9, 9)),  # before any marker: no phase's
        _mark(1),
        ("mpicomp_x_norms", _kernel(1000, 4000, 0, occupancy=90, memory=85, compute=10)),
        ("mpicomp_x_quantize", _kernel(3000, 4000, 250, occupancy=30, memory=10, compute=20)),
        _mark(2),
        ("mpicomp_x_decode", _kernel(2000, 250, 4000, memory=30, compute=60)),
    ]
    found = P.kernels_of(_csv(kernels))
    assert [k["name"] for k in found][:2] == ["cupy_warmup_leftover", "mpicomp_profile_mark"]
    enc, dec = P.table(found, rows)
    assert enc["kernels"] == 2 and enc["dram_bytes"] == 8250 and enc["ideal_bytes"] == 4250
    assert enc["seconds"] == pytest.approx(4e-6)
    assert enc["occupancy"] == pytest.approx((90 * 1000 + 30 * 3000) / 4000)
    assert (enc["slowest"], enc["limiter"]) == ("mpicomp_x_quantize", "latency")
    assert (dec["kernels"], dec["dram_bytes"], dec["limiter"]) == (1, 4250, "compute")
    text = P.markdown([enc, dec])
    assert "| `c` |  | encode | 2 | 8.25 | 4.25 | 1.94 | 0.004 | 1 | 45 % " in text
    assert "`mpicomp_x_decode` (compute)" in text


def test_a_log_without_ncus_csv_is_refused_by_name():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        P.kernels_of("==PROF== ERROR: profiling is not supported on this device\n")


def test_the_command_line_prints_the_metrics_and_the_table(tmp_path, capsys):
    assert P.main(["--metrics"]) == 0
    assert capsys.readouterr().out.strip().split(",") == list(P.METRICS)
    rows = tmp_path / "rows.json"
    assert P.main(["--codecs", "signsgd", "--numel", "2048", "--backend", "numba",
                   "--rows", str(rows)]) == 0  # fmt: skip
    log = tmp_path / "ncu.csv"
    log.write_text(_csv([_mark(1), ("k", _kernel(100, 8192, 284)), _mark(2)]))  # 284: the payload
    assert P.main(["--table", str(log), str(rows)]) == 0
    out = capsys.readouterr().out
    assert "| `signsgd` |  | encode | 1 | 4.14 | 4.14 | 1.00 |" in out
    assert "| `signsgd` |  | decode | 0 | 0.00 |" in out
