"""The GPU lane's one table (``mpicomp.tools.bench.lane``) from the files its steps leave."""

import json

from test_bench_profile import _csv, _kernel, _mark

from mpicomp.tools.bench import lane, profile


def _kernels_row(codec, params, enc, dec, **more):
    row = {"codec": codec, "params": params, "numel": 1000, "encode_gbps": enc}
    return {**row, "decode_gbps": dec, "memcpy_gbps": 1000.0, **more}


def _allreduce_row(codec, params, numel, t, staged, direct=None):
    row = {"codec": codec, "params": params, "numel": numel, "time_s": t, "allreduce_s": staged}
    return {**row, "allreduce_staged_s": staged, "allreduce_direct_s": direct}


def test_the_lane_table_puts_every_step_in_one_row_per_codec(tmp_path):
    q = {"bits": 2}
    kernels = [
        _kernels_row("qsgd_maxnorm", q, 600.0, 250.0),
        _kernels_row("fft", {}, 40.0, 80.0, fft_pair_gbps=100.0),
    ]
    (tmp_path / "kernels.json").write_text(json.dumps(kernels))
    staged = [
        {**_kernels_row("qsgd_maxnorm", q, 1, 1), "allreduce": [
            _allreduce_row("qsgd_maxnorm", q, 1_000_000, 0.002, 0.004),
            _allreduce_row("qsgd_maxnorm", q, 25_600_000, 0.02, 0.1),
        ]},
        _allreduce_row("fft", {}, 1_000_000, 0.008, 0.004),
    ]  # fmt: skip
    (tmp_path / "allreduce-staged.json").write_text(json.dumps(staged))
    direct = [_allreduce_row("qsgd_maxnorm", q, 25_600_000, 0.01, 0.1, 0.05)]
    (tmp_path / "allreduce-direct.json").write_text(json.dumps(direct))
    rows = [
        {"codec": "qsgd_maxnorm", "params": q, "phase": p, "mark": i + 1, "numel": 1000,
         "input_bytes": a, "output_bytes": b}
        for i, (p, a, b) in enumerate([("encode", 4000, 281), ("decode", 281, 4000)])
    ]  # fmt: skip
    (tmp_path / "profile-rows.json").write_text(json.dumps(rows))
    log = [_mark(1), ("enc", _kernel(10, 4000, 281, occupancy=80)), _mark(2)]
    log += [("dec", _kernel(10, 2 * 4281, 0, occupancy=40, memory=10, compute=5))]
    (tmp_path / "ncu.csv").write_text(_csv(log))

    text = lane.summarize(tmp_path)
    head, rule, qsgd, fft = text.splitlines()[:4]
    assert head.startswith("| codec | params | enc × ref | dec × ref | enc DRAM × ideal")
    assert (
        "| 1M × staged MPI_Allreduce | 25.6M × staged MPI_Allreduce | 25.6M staged / direct |"
        in head
    )
    assert qsgd == (
        "| `qsgd_maxnorm` | bits=2 | 0.60 | 0.25 | 1.00 | 2.00 | 80/40 % | memory/latency "
        "| 2.00 | 5.00 | 2.00 |"
    )
    assert fft == "| `fft` |  (ref: rfft+irfft) | 0.40 | 0.80 |  |  |  |  | 0.50 |  |  |"
    assert "25.6M: MPI_Allreduce staged 100.00 ms, direct 50.00 ms" in text


def test_a_lane_whose_steps_left_nothing_prints_an_empty_table(tmp_path, capsys):
    (tmp_path / "ncu.csv").write_text("==PROF== ERROR: no GPU\n")
    (tmp_path / "profile-rows.json").write_text("[]")
    assert lane.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("\n") == 2  # the head and its rule
    assert lane.main([]) == 2
    assert profile.METRICS  # the table's columns come from the profile's metrics
