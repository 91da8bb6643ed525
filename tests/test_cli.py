"""The ``mpicomp`` command line: info, bench, trace, and usage errors (one process)."""

import json
import math
import subprocess
import sys

import pytest
from _devices import gpu_present

from mpicomp.tools import bench, cli


def _run(*args, timeout=120):
    """Run ``python -m mpicomp ARGS`` in a fresh process; return (code, stdout, stderr)."""
    p = subprocess.run(
        [sys.executable, "-m", "mpicomp", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p.returncode, p.stdout, p.stderr


def test_info_names_the_mpi_library(capsys):
    import numba
    from mpi4py import MPI

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120
    # A long value (the codecs) goes on in indented lines below its key.
    out = out.replace("\n" + " " * 20, " ")
    fields = dict(line.split(":", 1) for line in out.splitlines())
    fields = {k: v.strip() for k, v in fields.items()}
    vendor = MPI.get_vendor()[0]
    assert vendor in fields["MPI vendor"]
    first = MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]
    assert fields["MPI library"] == " ".join(first.split())
    assert fields["MPI standard"] == "{}.{}".format(*MPI.Get_version())
    assert fields["codecs"].split(", ") == sorted(fields["codecs"].split(", "))
    assert "threelc" in fields["codecs"]
    threads = numba.config.NUMBA_NUM_THREADS
    # (The tests' own backends may be registered too.)
    names = [b.split(" (")[0] for b in fields["backends"].split(", ")]
    assert {"cuda", "cuda-emulated", "numba"} <= set(names) and names == sorted(names)
    assert f"numba (in use; {threads} thread{'' if threads == 1 else 's'})" in fields["backends"]
    for key in ("mpicomp", "numpy", "numba", "mpi4py", "h5py", "CUDA-aware MPI", "GPUs"):
        assert fields[key]


def test_info_json_matches_the_library(capsys):
    from mpi4py import MPI

    assert cli.main(["info", "--json"]) == 0
    fields = json.loads(capsys.readouterr().out)
    assert fields["MPI vendor"].startswith(MPI.get_vendor()[0])
    assert fields["MPI world size"] == MPI.COMM_WORLD.size  # numbers as numbers
    import numba

    assert fields["numba threads"] == numba.config.NUMBA_NUM_THREADS
    # The decision (the MPICH wheel is built without CUDA) and the path device arrays take.
    assert fields["CUDA-aware MPI"].startswith("no (")
    assert fields["CUDA-aware MPI"].endswith("; device arrays are staged through host memory")
    import mpicomp.kernels as K

    assert [b.split(" (")[0] for b in fields["backends"].split(", ")] == K.available()


def test_mpicomp_cuda_aware_overrides_the_detection(monkeypatch):
    from mpicomp.reduction import transport

    for value, word in (("1", "yes"), ("0", "no")):
        monkeypatch.setenv("MPICOMP_CUDA_AWARE", value)
        transport.cuda_aware.cache_clear()
        text = cli.info()["CUDA-aware MPI"]
        assert text.startswith(f"{word} (MPICOMP_CUDA_AWARE={value})")
        assert text.endswith("handed to MPI directly" if value == "1" else "host memory")
    monkeypatch.setenv("MPICOMP_CUDA_AWARE", "maybe")
    transport.cuda_aware.cache_clear()
    assert "MPICOMP_CUDA_AWARE='maybe' is not a boolean" in cli.info()["CUDA-aware MPI"]
    monkeypatch.delenv("MPICOMP_CUDA_AWARE")
    transport.cuda_aware.cache_clear()


def test_info_names_the_backend_mpicomp_kernels_selects(monkeypatch):
    monkeypatch.setenv("MPICOMP_KERNELS", "no-such-backend")
    text = cli.info()["backends"]
    assert "numba" in text and "no-such-backend" in text and "in use" not in text


def test_module_help_works():
    code, out, err = _run("--help")
    assert code == 0, err
    assert "usage: mpicomp" in out
    for command in ("info", "bench", "trace"):
        assert command in out


@pytest.mark.parametrize(
    "argv, expect",
    [
        ([], "required"),
        (["frobnicate"], "invalid choice"),
        (["trace"], "required"),
        (["trace", "summary"], "FILE"),
        (["trace", "plot"], "FILE"),
        (["trace", "summary", "/nonexistent/run.h5"], "no such file"),
        (["bench", "--codecs", "nope"], "unknown codec 'nope'"),
        (["bench", "--codecs", "threelc,"], None),  # a trailing comma is fine: parses
        (["bench", "--numel", "-5"], "--numel"),
        (["bench", "--numel", "1.5"], "--numel"),
        (["bench", "--numel", "abc"], "--numel"),
        (["bench", "--reps", "0"], "--reps"),
        (["bench", "--schedules", "tree"], "unknown schedule 'tree'; 'all' or names among"),
        (["bench", "--schedules", ","], "unknown schedule ''"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, expect, capsys):
    if expect is None:  # parse only: do not run the benchmark
        assert cli._parser().parse_args(argv).codecs == ["threelc"]
        return
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: mpicomp" in err
    assert "error:" in err and expect in err
    assert "Traceback" not in err


def test_bench_schedules_parse_to_all_or_names():
    parse = cli._parser().parse_args
    assert parse(["bench", "--schedules", "all"]).schedules == "all"
    assert parse(["bench", "--schedules", "direct,sharded"]).schedules == ["direct", "sharded"]
    assert parse(["bench"]).schedules is None


def test_usage_errors_print_the_subcommands_usage_and_exit_2(capsys):
    for argv, expect in [
        (["bench", "--backend", "cuda9"], "unknown backend 'cuda9'; known: "),
        (["bench", "--no-kernels", "--no-allreduce"], "leave nothing to measure"),
        (["advise"], "give the link's bandwidth"),
    ]:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"usage: mpicomp {argv[0]}" in err and expect in err, err
        assert f"error: {argv[0]}:" not in err  # the prog says it once


def test_help_has_examples_and_points_to_the_docs():
    code, out, err = _run("--help")
    assert code == 0 and "examples:" in out and "mpicomp compile" in out
    assert "docs/running.md" in out


def test_output_cut_short_by_the_reader_ends_quietly():
    """``mpicomp ... | head -1``: exit 141 (128 + SIGPIPE) as Unix tools end, no traceback."""
    # A command printing more than a pipe holds (info, made long here).
    long_info = (
        "import sys; from mpicomp.tools import cli; "
        "cli.info = lambda: {f'line {i}': i for i in range(10**5)}; "
        "sys.exit(cli.main(['info']))"
    )
    p = subprocess.run(
        ["bash", "-c", f'{sys.executable} -c "{long_info}" | head -1; exit ${{PIPESTATUS[0]}}'],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.stdout.split() == ["line", "0:", "0"], p.stdout[:200]
    assert p.returncode == 141 and "Traceback" not in p.stderr, p.stderr


def test_info_says_none_visible_without_a_gpu(monkeypatch):
    pytest.importorskip("cupy")
    if gpu_present():
        pytest.skip("a GPU is present")
    assert cli.info()["GPUs"] == "none visible"


def test_bad_argument_in_a_fresh_process_has_no_traceback():
    code, out, err = _run("bench", "--numel", "-5")
    assert code == 2
    assert "usage: mpicomp bench" in err and "Traceback" not in err
    assert out == ""


def test_trace_of_a_file_that_is_not_a_trace(tmp_path, capsys):
    bad = tmp_path / "junk.h5"
    bad.write_bytes(b"not hdf5 at all")
    for argv in (["trace", "summary", str(bad)], ["trace", "plot", str(bad), "-o", "x.png"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mpicomp trace {argv[1]}: error:")
        assert "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def test_trace_errors_from_the_reader_become_exit_code_2(tmp_path, capsys, monkeypatch):
    import mpicomp.trace.report

    f = tmp_path / "run.h5"
    f.write_bytes(b"")

    def fail(*args):
        raise RuntimeError("plot needs matplotlib")

    monkeypatch.setattr(mpicomp.trace.report, "plot", fail)
    monkeypatch.setattr(
        mpicomp.trace.report, "summarize", lambda path, all_calls: f"table of {path}"
    )
    assert cli.main(["trace", "plot", str(f)]) == 2
    assert "plot needs matplotlib" in capsys.readouterr().err
    assert cli.main(["trace", "summary", str(f)]) == 0
    assert capsys.readouterr().out.strip() == f"table of {f}"


def test_bench_times_the_backend_it_is_given(capsys):
    argv = ["bench", "--json", "--numel", "3000", "--reps", "1", "--codecs", "signsgd"]
    assert cli.main([*argv, "--no-allreduce", "--backend", "cuda-emulated"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["backend"] == "cuda-emulated" and row["rel_error"] < 1.0
    # Without a GPU, `--backend cuda` says why on stderr and fails (on every rank).
    if not gpu_present():
        assert cli.main([*argv, "--no-allreduce", "--backend", "cuda"]) == 1
        assert "kernel backend 'cuda' is not available here" in capsys.readouterr().err
    assert cli.main([*argv, "--no-allreduce", "--backend", "nope"]) == 2  # a usage error
    assert "unknown backend 'nope'" in capsys.readouterr().err


def test_bench_json_rows(capsys):
    argv = ["bench", "--json", "--numel", "10000", "--reps", "1", "--codecs", "threelc,none"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)  # stdout holds the JSON alone
    assert [r["codec"] for r in rows] == ["threelc", "none"]
    for r in rows:
        for key in ("backend", "encode_gbps", "decode_gbps", "memcpy_gbps", "bits_per_element"):
            assert key in r
        assert r["backend"] == "numba" and r["numel"] == 10000
        # Throughputs are measurements: only their form is checked here, never their size.
        for key in ("encode_gbps", "decode_gbps", "memcpy_gbps"):
            assert isinstance(r[key], float) and math.isfinite(r[key])
    none = rows[1]
    # 32 bits per element plus the fixed header, spread over 10,000 elements
    assert 32 < none["bits_per_element"] < 32.1 and none["rel_error"] == 0
    assert rows[0]["bits_per_element"] < 2  # 3LC: at most 1.6 bits before zero-run, + header
    assert "bench: threelc" in captured.err  # progress goes to stderr


def test_bench_table(capsys):
    assert cli.main(["bench", "--numel", "2K", "--reps", "1", "--codecs", "fp16", "-q"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "memcpy (np.copyto)" in captured.out
    (line,) = [ln for ln in captured.out.splitlines() if ln.startswith("fp16 ")]
    assert line.split()[1] == "16.096"  # 2000 float16 + the 24-byte header: 16 + 192/2000


@pytest.mark.parametrize(
    "text, value",
    [("1000", 1000), ("1e6", 10**6), ("4K", 4000), ("1M", 10**6), ("25.6M", 25_600_000)],
)
def test_parse_count(text, value):
    assert bench.parse_count(text) == value


@pytest.mark.parametrize("text", ["", "M", "1.5", "-3", "1x", "nan", "inf"])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError, match="count"):
        bench.parse_count(text)


def test_codec_set_expands_names_to_the_bench_parameters():
    assert bench.codec_set(["qsgd_maxnorm"]) == [
        ("qsgd_maxnorm", {"bits": 8}),
        ("qsgd_maxnorm", {"bits": 2}),
    ]
    assert bench.codec_set(None) == bench.BENCH_SET
    with pytest.raises(ValueError, match="unknown codec 'nope'"):
        bench.codec_set(["nope"])


def test_gradient_is_the_conv_gradient_flattened():
    g = bench.gradient(5000, seed=3)
    full = bench.conv_gradient((2, 512, 3, 3), seed=3).reshape(-1)
    assert g.dtype.name == "float32" and g.shape == (5000,)
    assert (g == full[:5000]).all()


def test_bench_on_one_rank_times_the_kernels_and_says_how_to_run_the_allreduce(capsys):
    """Without a launcher there is nothing to all-reduce with: no table of speedups and
    bytes of one rank, but a line saying how to launch it."""
    argv = ["bench", "--numel", "2K", "--reps", "1", "--codecs", "fp16"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "MPI_Allreduce float32" not in captured.out and "speedup" not in captured.out
    assert captured.out.rstrip().splitlines()[-1] == (
        "all-reduce: skipped on one rank; `mpiexec -n N python -m mpi4py -m mpicomp bench` "
        "measures it against MPI_Allreduce"
    )
    assert "all-reduces of" not in captured.err  # nor announced
    # --json: the note goes to stderr, stdout holds the JSON alone
    assert cli.main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    (row,) = json.loads(captured.out)
    assert row["allreduce"] == [] and "all-reduce: skipped on one rank" in captured.err
    # Options of the all-reduce alone have nothing to do there, and the note says so.
    assert cli.main([*argv, "--sizes", "1M", "--tc-dev", "no-such-dev"]) == 0
    note = capsys.readouterr().out.rstrip()
    assert note.endswith("MPI_Allreduce (--sizes, --tc-dev: for the all-reduce, unused)")
    assert cli.main([*argv, "--no-kernels"]) == 2  # nothing left to measure
    err = capsys.readouterr().err
    assert "--no-kernels on one rank leaves nothing to measure" in err
    assert "launch with `mpiexec -n N python -m mpi4py -m mpicomp bench ...`" in err
    assert cli.main([*argv, "--no-allreduce"]) == 0  # asked for: no note
    assert "skipped" not in capsys.readouterr().out


def test_bench_help_says_the_backend_applies_to_the_allreduce_too(capsys):
    assert cli.main(["bench", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "of the encode/decode timings and of the all-reduces" in help_text


def _allreduce_row(codec, **extra):
    row = {
        "numel": 4096,
        "nranks": 2,
        "codec": codec,
        "params": {},
        "backend": "numba",
        "time_s": 0.004,
        "allreduce_s": 0.001,
        "time_ratio": 4.0,
        "speedup": 0.25,
        "bytes_sent": 712,
        "bytes_recv": 712,
        "sent_total": 1424,
        "recv_total": 1424,
        "allreduce_bytes": 16384,
        "sent_ratio": 712 / 16384,
        "recv_ratio": 712 / 16384,
        "encode_s": 0.001,
        "exchange_s": 0.002,
        "decode_s": 0.0005,
    }
    row.update(extra)
    return row


def _table_of(rows) -> list[str]:
    import io

    from mpicomp.tools.bench.report import format_allreduce_table

    out = io.StringIO()
    format_allreduce_table(rows, out)
    return out.getvalue().splitlines()


def test_allreduce_table_columns():
    head, _, ref, row = _table_of([_allreduce_row("signsgd")])
    columns = ["size", "codec", "schedule", "time", "ms", "speedup", "sent", "B", "x", "ring"]
    assert head.split() == [*columns, "recv", "B", "x", "ring", "enc/xchg/dec", "ms"]
    # no "pred ms" column without a model, no path columns on the host
    assert ref.split()[:3] == ["4,096", "MPI_Allreduce", "float32"]
    assert ref.split()[3:] == ["1.00", "1.00", "16.4K", "1.00", "16.4K", "1.00"]
    assert row.split() == ["4,096", "signsgd", "4.00", "0.25", "712", "0.043"] + [
        "712",
        "0.043",
        "1/2/0.5",
    ]
    params = {"params": {"bits": 2}, "predicted_s": 0.003, "allreduce_predicted_s": 0.002}
    head, _, ref, row = _table_of([_allreduce_row("qsgd_maxnorm", **params)])
    assert head.split()[5:7] == ["pred", "ms"] and ref.split()[4] == "2.00"
    assert row.split()[:5] == ["4,096", "qsgd_maxnorm:bits=2", "4.00", "3.00", "0.25"]
    device = {"backend": "cuda", "transport": "direct", "allreduce_staged_s": 0.002}
    device |= {"allreduce_direct_s": 0.001, "time_ratio_staged": 2.0, "time_ratio_direct": 4.0}
    lines = _table_of([_allreduce_row("signsgd", **device)])
    head, _, staged, direct, row = lines[:5]
    # the reference lines: time ms, speedup (over the row's own path: direct)
    assert staged.split()[1:6] == ["MPI_Allreduce", "float32", "staged", "2.00", "0.50"]
    assert direct.split()[1:6] == ["MPI_Allreduce", "float32", "direct", "1.00", "1.00"]
    # then the paths, in a table of their own below the note that explains them
    second = lines.index(next(ln for ln in lines if ln.startswith("size") and "path" in ln))
    assert lines[second].split() == ["size", "codec", "schedule", "path", "/staged", "/direct"]
    staged, direct, row = lines[second + 2 :]
    assert staged.split()[-3:] == ["staged", "1.00", "2.00"]
    assert direct.split()[-3:] == ["direct", "0.50", "1.00"]
    assert row.split()[1:] == ["signsgd", "direct", "2.00", "4.00"]
    # staged only (MPI not CUDA-aware): one reference line, '-' for direct
    device |= {"transport": "staged", "allreduce_direct_s": None, "time_ratio_direct": None}
    lines = _table_of([_allreduce_row("signsgd", **device)])
    assert lines[-2].split()[-3:] == ["staged", "1.00", "-"]
    assert lines[-1].split()[-3:] == ["staged", "2.00", "-"]


def test_every_table_of_the_bench_fits_120_columns():
    from mpicomp.tools.bench.report import Report

    long = {"params": {"bits": 2, "scales": (2, 4, 8)}, "predicted_s": 0.003}
    host = [
        _allreduce_row("signsgd", allreduce_predicted_s=0.002),
        _allreduce_row("grandk_maxnorm_multiscale", **long),
        _allreduce_row("grandk_maxnorm_multiscale", schedule="auto", chosen="hier:allgather"),
        _allreduce_row("grandk_maxnorm_multiscale", schedule="hier:allgather"),
    ]
    tc = {"device_bytes": 10**9, "device_over_recv": 1.0, "allreduce_device_bytes": 10**9}
    device = {"backend": "cuda", "transport": "direct", "allreduce_staged_s": 0.002}
    device |= {"allreduce_direct_s": 0.001, "time_ratio_staged": 2.0, "time_ratio_direct": 4.0}
    for rows in (host, [dict(r, **tc, **device) for r in host]):
        import io

        out = io.StringIO()
        Report([], rows, 4, None).print(5, 3, out)
        lines = out.getvalue().splitlines()
        assert "schedule='auto' chose the fastest" in out.getvalue()  # the verdicts too
        assert max(map(len, lines)) <= 120, max(lines, key=len)


# -- advise's schedule table --------------------------------------------------------------


def _kernel_row(codec, bits, gbps, **params):
    """A row as `mpicomp bench --json` prints it (kernel figures only)."""
    return {
        "codec": codec,
        "params": params,
        "backend": "numba",
        "numel": 25_600_000,
        "encode_gbps": gbps,
        "decode_gbps": gbps,
        "memcpy_gbps": 10.0,
        "bits_per_element": bits,
        "rel_error": 0.5,
    }


@pytest.fixture
def bench_file(tmp_path):
    rows = [
        _kernel_row("none", 32.0, 8.0),
        _kernel_row("signsgd", 1.0, 4.0),
        _kernel_row("threelc", 0.5, 2.0, sparsity=1.5),
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    return path


def _advise_json(capsys, *argv):
    assert cli.main(["advise", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_advise_sizes_chooses_per_size_by_the_model(capsys, bench_file):
    import mpicomp
    from mpicomp.model.cost import Topology, schedules_of

    argv = ["1gbit", "--sizes", "4K,25.6M", "--hosts", "4", "--alpha", "1ms"]
    rows = _advise_json(capsys, *argv, "--bench", str(bench_file))
    got = {(r["codec"], r["numel"]): r for r in rows}
    assert list(got) == [(c, n) for c in ("none", "signsgd", "threelc") for n in (4000, 25_600_000)]
    # A 1 ms message makes the 2 log2 N + 2 messages of float32 cheapest for a small tensor;
    # at 25.6M the 1-bit votes sent straight to their owners win.
    assert got["signsgd", 4000]["choice"] == "float32"
    assert got["signsgd", 25_600_000]["choice"] == "direct"
    # float32 on 4 ranks: the agreement (2 rounds of 192 bytes), then MPI_Allreduce's
    # 2 log2 4 messages carrying 2 (N-1)/N of the 16,000 bytes, at 125 MB/s.
    assert got["signsgd", 4000]["seconds"]["float32"] == pytest.approx(6e-3 + 24384 / 125e6)
    for r in rows:
        codec = mpicomp.codec(r["codec"], **r["params"])
        assert list(r["seconds"]) == list(schedules_of(codec, Topology(4, 1)))
        assert not any(s.startswith("hier:") for s in r["seconds"])  # one rank per host
        assert r["choice"] == min(r["seconds"], key=r["seconds"].get)
        plain = r["seconds"].get("float32", r["seconds"].get("allreduce"))
        assert r["speedup"] == pytest.approx(plain / r["seconds"][r["choice"]])
    assert got["signsgd", 25_600_000]["speedup"] > 5  # 32x fewer bytes on a slow link


def test_advise_sizes_with_ranks_per_host_adds_the_hierarchical_columns(capsys, bench_file):
    argv = ["advise", "10gbit", "--sizes", "25.6M", "--hosts", "4", "--ranks-per-host", "2"]
    argv += ["--codecs", "signsgd,threelc", "--bench", str(bench_file)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120
    header, ring_codecs, gather_codecs = out.split("\n\n")
    assert header.startswith("4 hosts x 2 ranks; within a host: alpha 50 us, 100 Gbit/s;")
    assert "between hosts: alpha 50 us, 10 Gbit/s;" in " ".join(header.split())
    # One table per set of candidates: every column of each is a candidate of its rows.
    head, rule, signsgd = ring_codecs.splitlines()
    columns = ["codec", "size", "ring", "direct", "hier:ring", "hier:direct", "float32"]
    assert head.split() == [*columns, "choice", "speedup"] and set(rule) == {"-", " "}
    cells = dict(zip([*columns, "choice", "speedup"], signsgd.split(), strict=True))
    assert cells["codec"] == "signsgd" and cells["size"] == "25.6M"
    assert cells["choice"] in ("ring", "direct", "hier:ring", "hier:direct")
    head, rule, threelc = gather_codecs.splitlines()
    columns = ["codec", "size", "allgather", "sharded", "hier:allgather", "hier:sharded"]
    columns += ["float32", "choice", "speedup"]
    assert head.split() == columns
    cells = dict(zip(columns, threelc.split(), strict=True))
    assert cells["codec"] == "threelc:sparsity=1.5"  # the parameters unlike the defaults
    times = {s: float(cells[s]) for s in columns[2:7]}
    assert cells["choice"] == min(times, key=times.get)


def test_advise_model_file_gives_the_networks_and_speeds(capsys, bench_file, tmp_path):
    from mpicomp.model.cost import Network
    from mpicomp.model.measured import Model, speeds_from_bench
    from mpicomp.tools import advise

    speeds = speeds_from_bench(json.loads(bench_file.read_text()))
    path = tmp_path / "model.json"
    Model(Network(20e-6, 100e9 / 8), Network(20e-6, 1e9 / 8), speeds).save(path)
    by_model = _advise_json(capsys, "--model", str(path), "--hosts", "4", "--ranks-per-host", "2")
    # Without --sizes a model gets the default sweep, every codec it has a speed for.
    assert [r["numel"] for r in by_model] == 3 * list(advise.DEFAULT_SIZES)
    argv = ["1gbit", "--alpha", "20us", "--hosts", "4", "--ranks-per-host", "2"]
    sizes = ",".join(map(str, advise.DEFAULT_SIZES))
    by_rates = _advise_json(capsys, *argv, "--sizes", sizes, "--bench", str(bench_file))
    assert by_model == by_rates
    slower = _advise_json(
        capsys, *argv, "--intra", "10gbit", "--sizes", "1M", "--bench", str(bench_file)
    )
    (same,) = [r for r in by_rates if r["codec"] == "signsgd" and r["numel"] == 10**6]
    (slow,) = [r for r in slower if r["codec"] == "signsgd"]
    # --intra is the hierarchical schedules' reduce within the host; a flat one never uses it.
    assert slow["seconds"]["hier:ring"] > same["seconds"]["hier:ring"]
    assert slow["seconds"]["ring"] == same["seconds"]["ring"]


def test_advise_without_sizes_or_model_keeps_the_eq4_table(capsys, bench_file):
    assert cli.main(["advise", "1gbit", "--bench", str(bench_file)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("link 1 Gbit/s per rank, 4 ranks.") and "Eq.4 k_min" in out


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["1gbit", "--sizes", "4K", "--alpha", "-1"], "argument --alpha: not a time >= 0: '-1'"),
        (["1gbit", "--sizes", "4K", "--alpha", "5 parsecs"], "not a time >= 0"),
        (["1gbit", "--sizes", "4K", "--intra", "fast"], "argument --intra: not a rate: 'fast'"),
        (["--sizes", "4K"], "give the link's bandwidth (e.g. 1gbit) or --model FILE"),
        (["--model", "BENCH"], "BENCH: not an mpicomp model"),
        (["--model", "MISSING"], "No such file"),
        (
            ["1gbit", "--model", "BENCH"],
            "--model brings the networks and speeds; leave out BANDWIDTH",
        ),
        (["1gbit", "--hosts", "2"], "--hosts is for the schedule table: give --sizes too"),
        (["1gbit", "--sizes", "4K", "--hosts", "1"], "needs >= 2 ranks"),
        (["1gbit", "--sizes", "4K", "--ranks", "6", "--hosts", "2"], "--ranks 6 is not --hosts x"),
        (["1gbit", "--sizes", "4K", "--ranks", "5", "--ranks-per-host", "2"], "not a multiple"),
        (["1gbit", "--sizes", "4K", "--codecs", "topk"], "no row of topk; `mpicomp bench"),
    ],
)
def test_advise_schedule_table_rejects_bad_input(argv, expect, capsys, bench_file, tmp_path):
    files = {"BENCH": str(bench_file), "MISSING": str(tmp_path / "missing.json")}
    argv = [files.get(a, a) for a in argv]
    if "--bench" not in argv and "--model" not in argv and "1gbit" in argv:
        argv += ["--bench", str(bench_file)]  # never measure kernels here
    assert cli.main(["advise", *argv]) == 2
    captured = capsys.readouterr()
    expect = expect.replace("BENCH", str(bench_file))
    assert expect in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_parse_seconds():
    from mpicomp.tools.advise import parse_seconds

    for text, value in (
        ("50us", 5e-5),
        ("50µs", 5e-5),
        ("0.5ms", 5e-4),
        ("5e-5", 5e-5),
        ("2s", 2.0),
        ("0", 0.0),
    ):
        assert parse_seconds(text) == pytest.approx(value), text
    for bad in ("", "us", "-1us", "nan", "inf", "1h"):
        with pytest.raises(ValueError, match="not a time"):
            parse_seconds(bad)


def test_bench_save_model_checks_its_arguments_before_measuring(capsys, tmp_path):
    argv = ["bench", "--numel", "1K", "--codecs", "none", "--reps", "1", "-q"]
    missing = tmp_path / "no-such-dir" / "model.json"
    assert cli.main([*argv, "--no-allreduce", "--save-model", str(missing)]) == 2
    assert f"--save-model: no directory {str(missing.parent)!r}" in capsys.readouterr().err
    argv += ["--no-kernels", "--backend", "cuda-emulated", "--save-model", str(tmp_path / "m")]
    assert cli.main(argv) == 2
    assert "leave out --no-kernels to save --backend's" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# A script doing a job's first call: with announcements from 0 s, any compile is said.
FIRST_CALL = """
import numpy as np
from mpi4py import MPI

import mpicomp
import mpicomp.warmup
from mpicomp.kernels import numba_cache

numba_cache.ANNOUNCE_AFTER_S = 0.0
mpicomp.warmup.log_compiles()
with mpicomp.CompressedComm(MPI.COMM_SELF, "topk", ratio=0.05, min_numel=1) as cc:
    cc.allreduce(np.ones(1000, np.float32), name="w")
print("done")
"""


def test_compile_fills_the_cache_a_job_then_loads_from(tmp_path):
    import os

    env = dict(os.environ, MPICOMP_NUMBA_CACHE=str(tmp_path / "cache"), NUMBA_NUM_THREADS="1")
    env.pop("NUMBA_CACHE_DIR", None)
    p = subprocess.run(
        [sys.executable, "-m", "mpicomp", "compile", "--codecs", "topk"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert str(tmp_path / "cache") in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith("  topk: ")
    script = tmp_path / "first_call.py"
    script.write_text(FIRST_CALL)
    q = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert q.returncode == 0 and q.stdout.strip() == "done", q.stderr
    assert "compiling" not in q.stderr, q.stderr  # everything loaded from the cache
    # The same first call in an empty cache compiles, and says so.
    env["MPICOMP_NUMBA_CACHE"] = str(tmp_path / "empty")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "rank 0: compiling topk." in r.stderr, r.stderr


def test_compile_refuses_an_unknown_codec():
    code, out, err = _run("compile", "--codecs", "qsgd")
    assert code == 2 and "qsgd" in err and "Traceback" not in err


def test_bench_announces_what_it_will_measure(capsys):
    argv = ["bench", "--numel", "3000", "--reps", "1", "--codecs", "fp16,signsgd"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first == (
        "bench: encode/decode of 2 codec settings on 3,000 elements; the time left follows"
    )
    assert cli.main(["bench", "--numel", "3000", "--reps", "1", "--codecs", "fp16"]) == 0
    assert "of 1 codec setting on" in capsys.readouterr().err  # "1 codec setting", not "settings"
