"""jobs/bench.py on every world size: rows, byte counts and the JSON output; the
all-reduce rows on a device backend (staged and direct references, phase split) and on
the host backend given; errors raised on every rank."""

import json
import math

import pytest

from conftest import world

N = 2000


@pytest.mark.mpi
class TestAllreduceBench:
    def test_rows_and_the_exact_bytes_of_none(self):
        from mpicomp.tools.bench.allreduce import measure

        comm = world()
        codecs = [("none", {}), ("qsgd_maxnorm", {"bits": 2}), ("threelc", {})]
        rows = measure(comm, N, codecs, reps=1)
        assert [(r["codec"], r["params"]) for r in rows] == codecs
        ring = 2 * (comm.size - 1) * 4 * N // comm.size
        for r in rows:
            assert r["numel"] == N and r["nranks"] == comm.size
            assert r["allreduce_bytes"] == ring
            assert r["time_s"] > 0 and r["allreduce_s"] > 0
            assert r["time_ratio"] == pytest.approx(r["time_s"] / r["allreduce_s"])
            if comm.size == 1:
                assert r["sent_ratio"] is None and r["recv_ratio"] is None
            else:
                assert r["sent_ratio"] == pytest.approx(r["bytes_sent"] / ring)
        # none: the 192-byte agreement head, then MPI_Allreduce of the float32 buffer
        # (logical bytes, the buffer handed to MPI), every call the same.
        # One rank sends nothing at all.
        wire = 1 if comm.size > 1 else 0
        assert rows[0]["bytes_sent"] == rows[0]["bytes_recv"] == (4 * N + 192) * wire
        # 2-bit QSGD (s = 1): after the agreement, the MaxAllReduce of its ceil(2000 / 128)
        # = 16 block norms (all in the head); N ring chunks of C elements; reduce-scatter
        # step i sends at ceil(log2(2i + 1)) bits, the allgather's N - 1 steps at
        # ceil(log2(2N + 1)) bits (docs/collectives.md). Every rank sends exactly that when
        # the chunks are equal.
        size = comm.size
        chunk = math.ceil(math.ceil(N / size) / 8) * 8
        widths = [math.ceil(math.log2(2 * i + 1)) for i in range(1, size)]
        widths += [math.ceil(math.log2(2 * size + 1))] * (size - 1)
        expected = (2 * 192 + sum(chunk * w // 8 for w in widths)) * wire
        if chunk * size == N or size == 1:
            assert rows[1]["bytes_sent"] == rows[1]["bytes_recv"] == expected
        else:
            assert 2 * 192 < rows[1]["bytes_sent"] <= expected
        # 3LC: each payload at most 1.6 bits per element (+ header), from N - 1 other ranks
        assert (
            rows[2]["bytes_recv"] <= (192 + 8 * size + (size - 1) * (N * 8 // 5 // 8 + 64)) * wire
        )

    def test_every_schedule_gets_a_row_with_its_exact_bytes(self):
        from conftest import direct_traffic
        from mpicomp.tools.bench.allreduce import measure

        comm = world()
        codecs = [("signsgd", {}), ("threelc", {}), ("none", {})]
        rows = measure(comm, 8 * 128 * comm.size, codecs, reps=1, schedules="all")  # >= min_numel
        got = [(r["codec"], r["schedule"]) for r in rows]
        # On one host: each codec's own schedules, then auto (none: MPI's or mpicomp's ring).
        assert got == [
            ("signsgd", "ring"),
            ("signsgd", "direct"),
            ("signsgd", "auto"),
            ("threelc", "allgather"),
            ("threelc", "sharded"),
            ("threelc", "auto"),
            ("none", "allreduce"),
            ("none", "ring"),
            ("none", "auto"),
        ]
        # Every row carries the schedule it ran by and the model's prediction of it;
        # auto's is the cheapest predicted of the codec's candidates.
        for r in rows:
            assert r["chosen"] == r["schedule"] or r["schedule"] == "auto"
            assert r["predicted_s"] is not None and r["allreduce_predicted_s"] is not None
        auto = rows[2]
        assert auto["chosen"] in ("ring", "direct", "float32")
        assert auto["predicted_s"] <= min(r["predicted_s"] for r in rows[:2]) + 1e-12
        assert auto["predicted_s"] <= auto["allreduce_predicted_s"] + 1e-12
        # signSGD direct: the agreement, the scales (8 bytes), 1-bit votes to the owners
        # and 1-bit decisions back (equal chunks: every rank the same).
        n, size = rows[1]["numel"], comm.size
        votes = direct_traffic(n, size, 0, 8, 1, 1)
        if size > 1:
            assert rows[1]["bytes_sent"] == 192 + 8 + votes[0]
            assert rows[1]["bytes_recv"] == 192 + 8 * (size - 1) + votes[1]
        named = measure(comm, 512, codecs, reps=1, schedules=["direct"])
        assert [r["schedule"] for r in named] == ["direct", "allgather", "allreduce"]

    def test_main_prints_json_on_rank_0_only(self, capsys):
        from jobs.bench import main

        comm = world()
        argv = ["--sizes", "1K,1.5K", "--codecs", "signsgd", "--reps", "1", "--json"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        if comm.rank != 0:
            assert out == ""
            return
        rows = json.loads(out)
        assert [(r["numel"], r["codec"]) for r in rows] == [(1000, "signsgd"), (1500, "signsgd")]
        for r in rows:
            for key in ("time_s", "allreduce_s", "time_ratio", "bytes_sent", "bytes_recv"):
                assert key in r

    def test_bad_arguments_exit_2_on_every_rank(self, capsys):
        from jobs.bench import main

        for argv in (["--codecs", "nope"], ["--sizes", "-1"], ["--sizes", "0"], ["--reps", "0"]):
            with pytest.raises(SystemExit) as e:
                main(argv)
            assert e.value.code == 2
        assert "usage: jobs.bench" in capsys.readouterr().err

    def test_mpicomp_bench_json_rows_carry_their_allreduce(self, capsys, shared_dir):
        from mpicomp.tools.cli import main

        comm = world()
        trace_dir = str(shared_dir / "traces")
        argv = ["bench", "--numel", "3000", "--sizes", "2K", "--codecs", "none,qsgd_maxnorm"]
        argv += ["--reps", "1", "--allreduce-reps", "1", "--json", "-q", "--trace", trace_dir]
        assert main(argv) == 0
        out = capsys.readouterr().out
        if comm.rank != 0:
            assert out == ""
            return
        rows = json.loads(out)  # stdout holds the JSON alone
        assert [(r["codec"], r["params"]) for r in rows] == [
            ("none", {}),
            ("qsgd_maxnorm", {"bits": 8}),
            ("qsgd_maxnorm", {"bits": 2}),
        ]
        for r in rows:
            assert r["backend"] == "numba" and r["numel"] == 3000
            assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0 and r["memcpy_gbps"] > 0
            if comm.size == 1:  # nothing to all-reduce with: skipped (the CLI says so)
                assert r["allreduce"] == []
                continue
            (a,) = r["allreduce"]
            assert a["numel"] == 2000 and a["nranks"] == comm.size
            assert a["speedup"] == pytest.approx(a["allreduce_s"] / a["time_s"])
            # the trace of that codec's calls says what Traffic counted (warm-up + 1 call)
            from mpicomp.trace.report import read

            events, _, attrs = read(a["trace"])
            assert len(events) == 2 * comm.size
            assert int(events["bytes_sent"].sum()) == 2 * a["sent_total"]
            assert int(events["bytes_recv"].sum()) == 2 * a["recv_total"]
        assert rows[0]["bits_per_element"] == pytest.approx(
            32 + 8 * 16 / 3000 + 8 * 4 / 3000, rel=0.01
        )


@pytest.mark.mpi
def test_every_rank_shares_one_numba_cache():
    # One directory, each kernel compiled by one rank under its lock (kernels/numba_cache.py).
    import numba

    from mpicomp.kernels.numba_cache import cache_root

    comm = world()
    if "NUMBA_CACHE_DIR" in __import__("os").environ:
        pytest.skip("NUMBA_CACHE_DIR chosen by the user")
    assert numba.config.CACHE_DIR == cache_root()
    assert comm.allgather(numba.config.CACHE_DIR) == [cache_root()] * comm.size


# The CUDA sources run on the CPU through g++ (kernels/cuda/emulated.py).
needs_gxx = pytest.mark.skipif(
    __import__("shutil").which("g++") is None, reason="g++ is not on PATH: no emulated kernels"
)
DEVICE_CODECS = ["topk", "qsgd_maxnorm"]
PHASES = ("encode_s", "exchange_s", "decode_s")


@pytest.fixture(params=["staged", "direct"])
def transport(request, monkeypatch):
    """Both ways device buffers reach MPI (MPICOMP_CUDA_AWARE=1: any MPI reads the
    host-backed arrays of tests/_device_arrays.py, whose memory is host memory)."""
    from mpicomp.reduction import transport

    monkeypatch.setenv(transport.ENV, "1" if request.param == "direct" else "0")
    transport.cuda_aware.cache_clear()
    yield request.param
    transport.cuda_aware.cache_clear()


def _check_phases(r):
    split = [r[k] for k in PHASES]
    assert all(v >= 0 for v in split), r
    # Phases are parts of the slowest rank's call, which the timed call contains
    # (with 2 repetitions the medians are means, so the sum stays within time_s).
    assert sum(split) <= 1.05 * r["time_s"], r


@pytest.mark.mpi
@needs_gxx
def test_device_rows_carry_both_references_and_the_phase_split(transport):
    import _device_arrays as D

    from mpicomp.tools.bench import codec_set, full_run
    from mpicomp.tools.bench.allreduce import measure

    comm = world()
    D.install()
    report = full_run(comm, DEVICE_CODECS, None, [4096], allreduce_reps=2, backend=D.BACKEND)
    rows = report.allreduce
    host = measure(comm, 4096, codec_set(DEVICE_CODECS), 1, backend="numba")
    assert [(r["codec"], r["params"]) for r in rows] == [(r["codec"], r["params"]) for r in host]
    direct = transport == "direct"
    for r, h in zip(rows, host, strict=True):
        assert r["backend"] == D.BACKEND and r["transport"] == transport
        assert r["allreduce_staged_s"] > 0
        assert (r["allreduce_direct_s"] is not None) == direct
        assert (r["time_ratio_direct"] is not None) == direct
        ref = r["allreduce_direct_s"] if direct else r["allreduce_staged_s"]
        assert r["allreduce_s"] == ref
        assert r["time_ratio"] == pytest.approx(r["time_s"] / ref)
        assert r["time_ratio_staged"] == pytest.approx(r["time_s"] / r["allreduce_staged_s"])
        _check_phases(r)
        # Device arrays put the same bytes on the wire as host arrays.
        for key in ("bytes_sent", "bytes_recv", "sent_total", "recv_total"):
            assert r[key] == h[key], key
        assert "transport" not in h and h["backend"] == "numba"
        _check_phases(h)
    # full_run files them under their codec's row
    assert [a for row in report.rows for a in row["allreduce"]] == rows


@pytest.mark.mpi
@needs_gxx
def test_host_backend_given_runs_the_allreduce_rows(monkeypatch):
    import os

    from mpicomp.kernels import ENV
    from mpicomp.tools.bench import full_run

    comm = world()
    monkeypatch.delenv(ENV, raising=False)
    report = full_run(
        comm, ["qsgd_maxnorm"], None, [2048], allreduce_reps=1, backend="cuda-emulated"
    )
    assert len(report.allreduce) == 2
    for r in report.allreduce:
        assert r["backend"] == "cuda-emulated" and "transport" not in r
        assert r["allreduce_s"] > 0 and all(r[k] >= 0 for k in PHASES)
    assert ENV not in os.environ  # selected while CompressedComm was made, then restored
    (row,) = full_run(comm, ["none"], None, [2048], allreduce_reps=1).allreduce
    assert row["backend"] == "numba"


@pytest.mark.mpi
def test_a_backend_missing_on_one_rank_raises_on_every_rank(monkeypatch):
    import mpicomp.tools.bench.allreduce as A

    comm = world()
    with pytest.raises(RuntimeError, match="unknown kernel backend 'nope'"):
        A.measure(comm, 2000, [("none", {})], 1, backend="nope")
    if comm.size == 1:
        return

    real = A.kernel_backend

    def no_gpu_on_the_last_rank(name):
        if comm.rank == comm.size - 1:
            raise RuntimeError(f"kernel backend {name!r} is not available here: no GPU")
        return real(name)

    monkeypatch.setattr(A, "kernel_backend", no_gpu_on_the_last_rank)
    # The other ranks name the rank that failed instead of waiting for it.
    match = "no GPU" if comm.rank == comm.size - 1 else f"rank {comm.size - 1}: .*no GPU"
    with pytest.raises(RuntimeError, match=match):
        A.measure(comm, 2000, [("none", {})], 1, backend="numba")


@pytest.mark.mpi
def test_a_trace_dir_rank_0_cannot_make_raises_on_every_rank(shared_dir):
    from mpicomp.tools.bench.allreduce import measure

    comm = world()
    blocker = shared_dir / "a-file"
    if comm.rank == 0:
        blocker.write_text("not a directory")
    comm.Barrier()
    with pytest.raises(RuntimeError, match="rank 0: NotADirectoryError"):
        measure(comm, 2000, [("none", {})], 1, trace_dir=str(blocker / "traces"))


@pytest.mark.mpi
def test_save_model_writes_the_networks_and_the_speeds_of_the_codecs_timed(capsys, shared_dir):
    import mpicomp
    from mpicomp.model.cost import Network
    from mpicomp.model.measured import Model, codec_key
    from mpicomp.tools.cli import main

    comm = world()
    kernels, measured = shared_dir / "kernels.json", shared_dir / "measured.json"
    argv = ["bench", "--numel", "64K", "--codecs", "signsgd,threelc", "--reps", "1", "-q"]
    assert main([*argv, "--no-allreduce", "--json", "--save-model", str(kernels)]) == 0
    out, err = capsys.readouterr()
    # Without kernel timings the speeds are measured on every rank, at --numel.
    argv = ["bench", "--numel", "64K", "--codecs", "signsgd", "--no-kernels", "--sizes", "2K"]
    assert main([*argv, "--allreduce-reps", "1", "-q", "--save-model", str(measured)]) == 0
    comm.Barrier()
    by_kernels, by_ranks = Model.load(kernels), Model.load(measured)
    signsgd, threelc = mpicomp.codec("signsgd"), mpicomp.codec("threelc", sparsity=1.5)
    assert set(by_kernels.speeds) == {codec_key(signsgd), codec_key(threelc)}
    assert set(by_ranks.speeds) == {codec_key(signsgd)}
    # The same 64K gradient: the same payload bits, however the time was measured.
    assert by_ranks.speed(signsgd).bits == by_kernels.speed(signsgd).bits
    for model in (by_kernels, by_ranks):
        assert all(s.encode > 0 and s.decode > 0 for s in model.speeds.values())
        if comm.size == 1:  # nothing to measure: a free network
            assert model.intra == model.inter == Network(0.0, 1e12)
        else:
            assert model.intra.alpha > 0 and model.inter.alpha > 0
            assert 0 < model.intra.beta < 1e12 and 0 < model.inter.beta < 1e12
    if comm.rank != 0:
        assert out == "" and err == ""
        return
    # Rank 0 timed the kernels: the speeds are its rows' throughputs, per element.
    rows = {r["codec"]: r for r in json.loads(out)}
    for codec in (signsgd, threelc):
        row, speed = rows[codec.name], by_kernels.speed(codec)
        assert speed.encode == pytest.approx(4 / (row["encode_gbps"] * 1e9))
        assert speed.decode == pytest.approx(4 / (row["decode_gbps"] * 1e9))
        assert speed.bits == row["bits_per_element"]
    intra = by_kernels.intra
    line = f"mpicomp bench: wrote the model to {kernels}: within a host alpha "
    line += f"{intra.alpha * 1e6:.4g} us, beta {intra.beta * 8 / 1e9:.4g} Gbit/s;"
    assert err.startswith(line) and err.rstrip().endswith("; 2 codec speeds")


# -- the sharded collectives (mpicomp bench --reduce-scatter) ------------------------------


@pytest.mark.mpi
def test_reduce_scatter_rows_for_every_codec_with_their_exact_bytes():
    from mpicomp.tools.bench import BENCH_SET, codec_set
    from mpicomp.tools.bench.reduce_scatter import measure

    comm = world()
    size = comm.size
    n = 1024 * size + 3  # above min_numel; rows padded wherever size does not divide n
    shard = -(-n // size)
    rows = measure(comm, n, codec_set(None), reps=1)
    scatters = [r for r in rows if r["collective"] == "reduce_scatter"]
    # Every codec but powersgd (a low-rank factorization has no reduce-scatter), then the
    # allgathers.
    assert [(r["codec"], r["params"]) for r in scatters] == [
        (name, params) for name, params in BENCH_SET if name != "powersgd"
    ]
    assert [(r["collective"], r["precision"]) for r in rows[len(scatters) :]] == [
        ("allgather", "float32"),
        ("allgather", "bfloat16"),
    ]
    wire = 4 * (size - 1) * shard  # a float32 reduce-scatter's, per rank: (N-1)/N * 4n padded
    one = 1 if size > 1 else 0  # one rank sends nothing at all
    for r in rows:
        assert (r["numel"], r["nranks"], r["shard"], r["mpi_bytes"]) == (n, size, shard, wire)
        assert r["time_s"] > 0 and r["mpi_s"] > 0
        assert r["time_ratio"] == pytest.approx(r["time_s"] / r["mpi_s"])
        assert r["speedup"] == pytest.approx(r["mpi_s"] / r["time_s"])
        assert all(r[k] >= 0 for k in PHASES)
        if size == 1:
            assert r["sent_ratio"] is None and r["recv_ratio"] is None
        else:
            assert r["sent_ratio"] == pytest.approx(r["bytes_sent"] / wire)
            assert r["recv_ratio"] == pytest.approx(r["bytes_recv"] / wire)
        # The MPI references, counted as the rows are: MPI_Reduce_scatter moves N - 1
        # rows each way; MPI_Allgather is handed this rank's row once.
        assert r["mpi_recv"] == wire
        assert r["mpi_sent"] == (wire if r["precision"] is None else 4 * shard * one)
    by = {(r["codec"], r["precision"]): r for r in rows}
    # none: the 192-byte agreement head, then one all-to-all of the float32 rows; fp16 the
    # same at 2 bytes an element.
    assert by["none", None]["bytes_sent"] == by["none", None]["bytes_recv"] == (192 + wire) * one
    assert by["fp16", None]["bytes_sent"] == (192 + wire // 2) * one
    # The allgathers: the head, this rank's row out, N - 1 rows in; bfloat16 at half.
    ag32, ag16 = by["none", "float32"], by["none", "bfloat16"]
    assert (ag32["bytes_sent"], ag32["bytes_recv"]) == ((192 + 4 * shard) * one, (192 + wire) * one)
    assert (ag16["bytes_sent"], ag16["bytes_recv"]) == (
        (192 + 2 * shard) * one,
        (192 + wire // 2) * one,
    )
    for r in scatters[2:]:  # every compressing codec sends less than float32
        assert r["bytes_sent"] < by["none", None]["bytes_sent"] or size == 1, r["codec"]

    # signSGD's direct reduce-scatter: the head, the scales' allgather (8 bytes a rank),
    # then one bit per element of each other rank's row to its owner.
    (sign, *_) = measure(comm, n, [("signsgd", {})], reps=1, schedules=["direct"])
    assert (sign["schedule"], sign["chosen"]) == ("direct", "direct")
    votes = (size - 1) * math.ceil(shard / 8)
    assert sign["bytes_sent"] == (192 + 8 + votes) * one
    assert sign["bytes_recv"] == (192 + 8 * (size - 1) + votes) * one


@pytest.mark.mpi
def test_mpicomp_bench_reduce_scatter_prints_json_and_a_table(capsys):
    import io

    from mpicomp.tools.bench.report import Report
    from mpicomp.tools.cli import main

    comm = world()
    argv = ["bench", "--no-kernels", "--no-allreduce", "--reduce-scatter", "--sizes", "2K"]
    argv += ["--codecs", "none,powersgd", "--allreduce-reps", "1", "--json", "-q"]
    if comm.size == 1:  # nothing to reduce-scatter with: a usage error
        assert main(argv) == 2 and "several ranks" in capsys.readouterr().err
        return
    assert main(argv) == 0
    out = capsys.readouterr().out
    if comm.rank != 0:
        assert out == ""
        return
    # The codec rows, each with its reduce-scatter rows (powersgd: none), then the
    # allgathers, which belong to no codec.
    none, powersgd, ag32, ag16 = json.loads(out)
    assert none["codec"] == "none" and none["allreduce"] == []
    assert [(r["numel"], r["collective"]) for r in none["reduce_scatter"]] == [
        (2000, "reduce_scatter")
    ]
    assert powersgd["codec"] == "powersgd" and powersgd["reduce_scatter"] == []
    assert (ag32["precision"], ag16["precision"]) == ("float32", "bfloat16")
    # The table: each collective under its MPI reference, within 120 columns.
    text = io.StringIO()
    Report([], [], comm.size, None, sharded=none["reduce_scatter"] + [ag32, ag16]).print(1, 1, text)
    lines = text.getvalue().splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    labels = ["MPI_Reduce_scatter float32", "none ", "MPI_Allgather float32"]
    labels += ["allgather float32", "allgather bfloat16"]
    body = [line.lstrip() for line in lines if line.lstrip().startswith("2K ")]
    assert len(body) == len(labels), body
    for line, label in zip(body, labels, strict=True):
        assert line[2:].lstrip().startswith(label), line


@pytest.mark.mpi
def test_reduce_scatter_rows_refuse_a_device_backend_on_every_rank(monkeypatch, capsys):
    from types import SimpleNamespace

    import mpicomp.tools.bench.allreduce as A
    from mpicomp.tools.bench.reduce_scatter import measure
    from mpicomp.tools.cli import main

    comm = world()
    monkeypatch.setattr(A, "kernel_backend", lambda name: SimpleNamespace(xp=None, name="cuda"))
    with pytest.raises(RuntimeError, match="time host arrays; backend 'cuda'"):
        measure(comm, 2000, [("none", {})], 1, backend="cuda")
    assert main(["bench", "--reduce-scatter", "--backend", "cuda", "--sizes", "2K"]) == 2
    assert "--reduce-scatter times host arrays" in capsys.readouterr().err
