"""jobs.peers: DDP's hooks against mpicomp, one launch per configuration (jobs/peers/)."""

import io
import json
import os
import subprocess
import sys
import types

import pytest

from jobs.peers import driver

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_available_codec_is_a_configuration_and_auto_repeats_them():
    import mpicomp

    configs = driver.mpicomp_configs("all", "all")
    plain = [c for c in configs if "schedule" not in c.spec]
    assert {c.spec["codec"] for c in plain} == set(mpicomp.codecs.available())
    auto = [c for c in configs if c.spec.get("schedule") == "auto"]
    assert [c.label for c in auto] == [c.label + "_auto" for c in plain]
    # a codec the training jobs compare at several settings brings each of them
    assert [c.label for c in driver.mpicomp_configs("none,threelc", "threelc_sparsity1.5")] == [
        "mpicomp_none", "mpicomp_threelc_sparsity1.0", "mpicomp_threelc_sparsity1.5",
        "mpicomp_threelc_sparsity1.5_auto",
    ]  # fmt: skip
    # PowerSGD through mpicomp as through DDP: each rank, compressing from the same step
    if "powersgd" in mpicomp.codecs.available():
        psgd = [c for c in plain if c.spec["codec"] == "powersgd"]
        assert [(c.spec["params"]["rank"], c.spec["params"]["start_iter"]) for c in psgd] == [
            (1, 2), (4, 2)
        ]  # fmt: skip
    with pytest.raises(ValueError, match="--auto signsgd: not among the runs"):
        driver.mpicomp_configs("none", "signsgd")
    ddp = driver.ddp_configs([1, 4], 2, None)
    assert [c.label for c in ddp] == [
        "ddp", "ddp_fp16", "ddp_bf16", "ddp_powersgd_rank1", "ddp_powersgd_rank4"
    ]  # fmt: skip
    assert ddp[3].spec["rank"] == 1 and ddp[3].spec["start"] == 2


def test_time_to_target_is_the_first_evaluation_at_ddp_float32s_final_accuracy():
    rows = [
        {"config": "ddp", "status": "ok", "ms_step": 10.0, "final_accuracy": 0.9,
         "accuracy": [(0, 0.1), (10, 0.8), (20, 0.9)]},
        {"config": "fast", "status": "ok", "ms_step": 5.0, "accuracy": [(0, 0.1), (10, 0.91)]},
        {"config": "short", "status": "ok", "ms_step": 1.0, "accuracy": [(0, 0.1), (20, 0.89)]},
        {"config": "broken", "status": "failed (exit 1): ValueError: x"},
    ]  # fmt: skip
    driver.add_targets(rows)
    assert [r["steps_to_target"] for r in rows] == [20, 10, None, None]
    assert rows[0]["seconds_to_target"] == pytest.approx(0.2)
    assert rows[1]["seconds_to_target"] == pytest.approx(0.05)
    assert all(r["target_accuracy"] == 0.9 for r in rows)
    rows[0]["status"] = "timed out after 1 s"  # no reference: no target for anyone
    driver.add_targets(rows)
    assert all(r["target_accuracy"] is None and r["seconds_to_target"] is None for r in rows)


def test_times_to_accuracy_count_only_where_ddp_float32_plateaued_and_say_what_came_after():
    climbing = [(0, 0.1), (10, 0.5), (20, 0.7), (30, 0.8), (40, 0.9)]
    flat = [(0, 0.1), (10, 0.95), (20, 0.95), (30, 0.951), (40, 0.952)]
    assert driver.plateau(climbing) == (False, pytest.approx(0.4))  # 0.9 over 0.5
    assert driver.plateau(flat)[0] and not driver.plateau(flat[:3])[0]
    rows = [
        {"config": "ddp", "status": "ok", "ms_step": 10.0, "final_accuracy": 0.952,
         "accuracy": flat},
        {"config": "kept", "status": "ok", "ms_step": 5.0,
         "accuracy": [(0, 0.1), (10, 0.96), (20, 0.955), (40, 0.951)]},
        {"config": "lost", "status": "ok", "ms_step": 5.0,
         "accuracy": [(0, 0.1), (10, 0.96), (20, 0.9), (40, 0.8)]},
        {"config": "blew", "status": "diverged at step 35", "ms_step": 2.0, "diverged": 35,
         "accuracy": [(0, 0.1), (10, 0.953), (20, 0.9), (30, 0.7)]},
    ]  # fmt: skip
    driver.add_targets(rows)
    assert all(r["plateaued"] for r in rows)
    assert [r["fell_to"] for r in rows] == [None, None, 0.8, 0.7]
    reach = [driver._reach(r, 0.952, 40) for r in rows]
    assert reach[1] == "0.05 s (step 10)"
    assert reach[2] == "0.05 s (step 10), then fell to 0.800"
    assert reach[3] == "0.02 s (step 10), then diverged at step 35"
    rows[0]["accuracy"] = climbing  # the reference still rising: the table says so
    driver.add_targets(rows)
    out = io.StringIO()
    args = types.SimpleNamespace(eval_every=10, steps=40)
    driver.table(rows, args, out=out)
    assert "DDP float32 was still rising at step 40" in out.getvalue()


def test_a_failure_is_named_by_its_last_error_line():
    log = (
        "[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "x.py", line 1, in <module>\n'
        "/x.py:3: FutureWarning: something\n"
        "[rank0]: TypeError: BF16 all reduce communication hook required CUDA 11+\n"
        "Abort(1) on node 0 (rank 0 in comm 0): application called MPI_Abort\n"
    )
    assert driver._failure(log) == "TypeError: BF16 all reduce communication hook required CUDA 11+"
    assert driver._failure("") == "no output"


class _Sleeper:
    """A network whose launch never ends: the configuration's timeout must end it."""

    name, iface, tc_devs = "unshaped", "lo", []

    def command(self, argv):
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_launch_that_hangs_becomes_a_row_at_its_timeout(tmp_path):
    os.makedirs(tmp_path / "logs")
    args = driver._parse(["--out", str(tmp_path), "--timeout", "1", "--codecs", "none"])
    config = driver.Config("mpicomp_none", {"kind": "mpicomp", "codec": "none", "params": {}})
    row = driver.run_config(_Sleeper(), "mlp", config, args)
    assert row["status"] == "timed out after 1 s" and row["seconds"] < 30
    assert row["config"] == "mpicomp_none" and row["network"] == "unshaped"


def test_unshaped_comparison_writes_every_row_and_a_failure_is_a_row(tmp_path):
    # 2 ranks, the MLP 64-32-10, 4 steps: DDP float32, DDP's fp16 hook, mpicomp fp16, and
    # an unknown codec that fails alone; bf16 left out by --skip (still a row).
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    out = subprocess.run(
        [sys.executable, "-m", "jobs.peers", "--ranks", "2", "--models", "mlp",
         "--mlp-hidden", "32", "--steps", "4", "--warmup", "1", "--eval-every", "2",
         "--codecs", "fp16,nosuchcodec", "--auto", "none", "--powersgd-ranks", "",
         "--skip", "ddp_bf16", "--timeout", "240", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=_REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "peers.json").read_text())
    runs = {r["config"]: r for r in summary["runs"]}
    assert list(runs) == ["ddp", "ddp_fp16", "ddp_bf16", "mpicomp_fp16", "mpicomp_nosuchcodec"]
    assert runs["ddp_bf16"]["status"] == "skipped (--skip)"
    bad = runs["mpicomp_nosuchcodec"]
    assert bad["status"].startswith("failed") and "nosuchcodec" in bad["status"], bad
    for label in ("ddp", "ddp_fp16", "mpicomp_fp16"):
        r = runs[label]
        assert r["status"] == "ok", (r["status"], open(r["log"]).read()[-2000:])
        assert r["network"] == "unshaped" and r["model"] == "mlp" and r["ranks"] == 2
        assert r["model_params"] == 64 * 32 + 32 + 32 * 10 + 10
        assert len(r["step_ms"]) == 4 and r["ms_step"] > 0
        assert [s for s, _ in r["accuracy"]] == [0, 2, 4]
        assert r["final_accuracy"] == r["accuracy"][-1][1]
        assert r["target_accuracy"] == runs["ddp"]["final_accuracy"]
        assert r["bytes_per_step_tc"] is None  # unshaped: no tc
    assert runs["ddp"]["bytes_per_step_traced"] is None  # DDP's bytes: n/a unshaped
    assert runs["mpicomp_fp16"]["codec"] == "fp16" and runs["mpicomp_fp16"]["params"] == {}
    assert runs["ddp_fp16"]["kind"] == "ddp" and runs["ddp_fp16"]["hook"] == "fp16"
    # fp16 through mpicomp: 2 bytes per parameter from each of the 2 ranks, at least
    assert runs["mpicomp_fp16"]["bytes_per_step_traced"] >= 2 * 2 * runs["ddp"]["model_params"]
    # the same weights, batches and averaging: float32 DDP reaches its own final accuracy
    assert runs["ddp"]["steps_to_target"] == 4
    assert "mpicomp_nosuchcodec" in out.stdout and "time to DDP f32's" in out.stdout
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_exchanges_alone_average_and_are_timed(tmp_path):
    # 2 ranks, the MLP 64-16-10's gradients: every exchange of jobs.peers.exchange, each
    # checked against a float64 average by the worker itself (it fails otherwise).
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, "-m", "jobs.peers", "--exchange", "--ranks", "2", "--models", "mlp",
         "--mlp-hidden", "16", "--exchange-repeats", "2", "--timeout", "240",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=_REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (result,) = json.loads((tmp_path / "peers.json").read_text())["exchange"]
    assert result["status"] == "ok", open(result["log"]).read()[-2000:]
    assert result["model_params"] == 64 * 16 + 16 + 16 * 10 + 10 and result["ranks"] == 2
    names = ["gloo float32", "gloo fp16", "MPI_Allreduce float32"]
    names += [f"mpicomp {c} {how}" for c in ("none", "fp16") for how in ("flat", "optimizer")]
    assert sorted(result["ms"]) == sorted(names)
    assert all(len(result["ms_all"][n]) == 2 and result["ms"][n] > 0 for n in names)
    assert all(result["rel_err"][n] < 1e-6 for n in names if "fp16" not in n)
    assert all(0 < result["rel_err"][n] < 1e-2 for n in names if "fp16" in n)
    assert "gloo f32 / x" in out.stdout
