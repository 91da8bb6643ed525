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


def test_sharded_rows_by_family_each_codec_and_gather_precision():
    labels = [c.label for c in driver.sharded_configs(["zero"], "signsgd", ["float32", "bfloat16"])]
    assert labels == ["zero_ddp", "mpicomp_zero_signsgd", "mpicomp_zero_signsgd_gather_bf16"]
    configs = driver.sharded_configs(list(driver.FAMILIES), "none,qsgd_maxnorm_bits4")
    specs = {c.label: c.spec for c in configs}
    assert list(specs) == [
        "fsdp", "fsdp_bf16", "mpicomp_fsdp_none", "mpicomp_fsdp_qsgd_maxnorm_bits4",
        "mpicomp_hsdp_none", "mpicomp_hsdp_qsgd_maxnorm_bits4", "zero_ddp",
        "mpicomp_zero_none", "mpicomp_zero_qsgd_maxnorm_bits4",
    ]  # fmt: skip
    assert specs["fsdp_bf16"] == {"kind": "fsdp", "reduce_dtype": "bfloat16"}
    assert specs["mpicomp_hsdp_qsgd_maxnorm_bits4"] == {
        "kind": "mpicomp_hsdp", "codec": "qsgd_maxnorm", "params": {"bits": 4}
    }  # fmt: skip
    assert specs["mpicomp_zero_none"]["gather_precision"] == "float32"
    assert driver.sharded_configs([], "none") == []
    with pytest.raises(ValueError, match="powersgd has no reduce-scatter"):
        driver.sharded_configs(["fsdp"], "none,powersgd")
    with pytest.raises(ValueError, match="--sharded: unknown ddp"):
        driver.sharded_configs(["ddp"], "none")
    with pytest.raises(ValueError, match="--zero-gather: unknown float16"):
        driver.sharded_configs(["zero"], "none", ["float16"])


def test_rows_filter_the_configurations_and_sharded_adds_them(tmp_path):
    out = ["--out", str(tmp_path)]
    default = [c.label for c in driver._parse(out).configs]
    assert not any("fsdp" in label or "zero" in label for label in default)
    args = driver._parse([*out, "--sharded", "all", "--sharded-codecs", "signsgd",
                          "--rows", "ddp,fsdp*,*zero*"])  # fmt: skip
    assert [c.label for c in args.configs] == [
        "ddp", "fsdp", "fsdp_bf16", "zero_ddp", "mpicomp_zero_signsgd"
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        driver._parse([*out, "--rows", "nothing*"])
    with pytest.raises(SystemExit):  # 3 ranks do not make hosts of 2
        driver._parse([*out, "--sharded", "hsdp", "--ranks", "3"])


def test_sharded_rows_get_a_time_to_fsdp2_float32s_accuracy_too():
    rows = [
        {"config": "ddp", "status": "ok", "ms_step": 10.0, "final_accuracy": 0.9,
         "accuracy": [(0, 0.1), (10, 0.8), (20, 0.9)]},
        {"config": "fsdp", "status": "ok", "ms_step": 20.0, "final_accuracy": 0.8,
         "accuracy": [(0, 0.1), (10, 0.7), (20, 0.8)]},
        {"config": "mpicomp_fsdp_signsgd", "status": "ok", "ms_step": 5.0,
         "accuracy": [(0, 0.1), (10, 0.85), (20, 0.88)], "optimizer_bytes": [4000, 6000]},
    ]  # fmt: skip
    driver.add_targets(rows)
    assert [r["steps_to_target"] for r in rows] == [20, None, None]  # DDP's 0.9
    vs = [r["vs_fsdp"] for r in rows]
    assert all(v["target_accuracy"] == 0.8 for v in vs)
    assert [v["steps_to_target"] for v in vs] == [10, 20, 10]  # DDP reached 0.8 at 10
    assert vs[2]["seconds_to_target"] == pytest.approx(0.05)
    out = io.StringIO()
    driver.table(rows, types.SimpleNamespace(eval_every=10, steps=20), out=out)
    text = out.getvalue()
    assert "time to FSDP2 f32's 0.800" in text and "FSDP2 float32 was still rising" in text
    sharded = text[text.index("x FSDP2") :]
    line = next(x for x in sharded.splitlines() if x.startswith("mpicomp_fsdp_signsgd"))
    assert line.split()[1:5] == ["5.0", "4.00", "0.006", "0.05"]  # ms, x FSDP2, opt MB, s
    del rows[1]  # no FSDP2 row: no second target, no second table
    for r in rows:
        r.pop("vs_fsdp")
    driver.add_targets(rows)
    assert "vs_fsdp" not in rows[0]


def test_sharded_rows_train_end_to_end(tmp_path):
    # 2 ranks, the MLP 64-32-10, 4 steps: FSDP2 float32; FSDP2 through mpicomp's
    # reduce-scatter with codec none, which must train as FSDP's own; compressed HSDP
    # (hosts of one rank: the compressed all-reduce carries every byte); torch's ZeRO
    # with DDP; mpicomp's ZeroOptimizer, its allgather in bfloat16.
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    out = subprocess.run(
        [sys.executable, "-m", "jobs.peers", "--ranks", "2", "--models", "mlp",
         "--mlp-hidden", "32", "--steps", "4", "--warmup", "1", "--eval-every", "2",
         "--sharded", "all", "--sharded-codecs", "none,qsgd_maxnorm_bits4",
         "--zero-gather", "bfloat16", "--hsdp-host-ranks", "1",
         "--rows", "fsdp,mpicomp_fsdp_none,mpicomp_hsdp_qsgd*,zero_ddp,mpicomp_zero_qsgd*",
         "--timeout", "240", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=_REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {r["config"]: r for r in json.loads((tmp_path / "peers.json").read_text())["runs"]}
    assert list(runs) == [
        "fsdp", "mpicomp_fsdp_none", "mpicomp_hsdp_qsgd_maxnorm_bits4", "zero_ddp",
        "mpicomp_zero_qsgd_maxnorm_bits4_gather_bf16",
    ]  # fmt: skip
    n = 64 * 32 + 32 + 32 * 10 + 10
    for r in runs.values():
        assert r["status"] == "ok", (r["config"], r["status"], open(r["log"]).read()[-2000:])
        assert r["model_params"] == n and r["ranks"] == 2 and len(r["step_ms"]) == 4
        assert [s for s, _ in r["accuracy"]] == [0, 2, 4]
        assert r["vs_fsdp"]["target_accuracy"] == runs["fsdp"]["final_accuracy"]
        assert r["target_accuracy"] is None  # no DDP float32 row
    fsdp, ours = runs["fsdp"], runs["mpicomp_fsdp_none"]
    assert ours["accuracy"] == fsdp["accuracy"]  # float32 through mpicomp: FSDP's own bits
    # SGD's momentum sharded: every layer's rows split in two, half the model each
    assert fsdp["optimizer_bytes"] == ours["optimizer_bytes"] == [2 * n, 2 * n]
    assert fsdp["bytes_per_step_traced"] is None and ours["bytes_per_step_traced"] > 0
    # torch's ZeRO splits by whole tensors, unevenly; ours by rows; with bfloat16 gathers
    # it keeps float32 master rows beside the momentum
    assert sum(runs["zero_ddp"]["optimizer_bytes"]) == 4 * n
    assert 2 * n < max(runs["zero_ddp"]["optimizer_bytes"]) < 4 * n
    zero = runs["mpicomp_zero_qsgd_maxnorm_bits4_gather_bf16"]
    assert all(4 * n <= b <= 4 * n + 64 for b in zero["optimizer_bytes"])
    # 4-bit codes between the hosts: under half of float32's 4 bytes per parameter and rank
    hsdp = runs["mpicomp_hsdp_qsgd_maxnorm_bits4"]
    assert 0 < hsdp["bytes_per_step_traced"] < 0.5 * 2 * 4 * n
    assert "time to FSDP2 f32's" in out.stdout and "x FSDP2" in out.stdout


def test_the_lm_language_has_an_exact_entropy_floor_well_below_its_unigram_entropy():
    import numpy as np

    from jobs.peers import models

    s = models.SMALL
    data = models.load("lm", s)
    assert data.x_train.shape[1] == data.y_train.shape[1] == s.lm_seq
    assert data.x_test.shape == data.y_test.shape and data.x_test.dtype == np.int64
    assert (data.y_train[:, :-1] == data.x_train[:, 1:]).all()  # the next tokens
    assert 0.8 < data.floor < 1.5 and data.unigram > 3.5
    # the floor is the true chain's loss: its mean -log p(next | token) on the test split
    # is the floor to within sampling error, and the tokens' frequencies have its unigram
    p, pi = models.chain(s.lm_vocab)
    nll = -np.log(p[data.x_test, data.y_test]).mean()
    assert abs(nll - data.floor) < 0.03
    freq = np.bincount(data.x_train.ravel(), minlength=s.lm_vocab) / data.x_train.size
    assert abs(-(freq * np.log(freq)).sum() - data.unigram) < 0.03
    assert models.METRICS["lm"] == models.LOSS and not models.LOSS.higher
    assert models.OPTIMIZERS["lm"] == "adamw" and models.OPTIMIZERS["mlp"] == "sgd"


def test_the_lm_ties_its_head_to_its_embedding_and_sees_no_later_token():
    torch = pytest.importorskip("torch")
    from jobs.peers import models, worker

    s = models.SMALL
    model = models.build("lm", s, seed=0)
    w, v, seq = s.lm_width, s.lm_vocab, s.lm_seq
    block = 4 * w * w + 4 * w + 8 * w * w + 5 * w + 4 * w  # attention, feed-forward, norms
    assert models.n_params(model) == v * w + seq * w + s.lm_layers * block + 2 * w < 300_000
    assert models.n_params(models.build("lm", models.FULL, 0)) > 10 * models.n_params(model)
    assert model.head.weight is model.embed.weight
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert "head.weight" not in dict(model.named_parameters())  # one tensor, trained once
    x = torch.randint(0, v, (2, seq), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[:, 20] = (x[:, 20] + 1) % v
    for mode in ("train", "eval"):  # eval without grad: torch's fast path, mask and all
        getattr(model, mode)()
        with torch.set_grad_enabled(mode == "train"):
            a, b = model(x), model(changed)
        assert a.shape == (2, seq, v)
        assert torch.allclose(a[:, :20], b[:, :20], atol=1e-6), mode
        assert not torch.allclose(a[:, 20:], b[:, 20:], atol=1e-3), mode
    # untrained (logits near 0): held-out loss ~ log(vocab), between the floor and above
    data = models.load("lm", s)
    loss = worker.score(model, data, models.LOSS)
    assert abs(loss - torch.log(torch.tensor(float(v))).item()) < 0.1
    # AdamW's learning rate: a linear ramp over the warm-up, then the cosine
    ramp = types.SimpleNamespace(lr=0.02, steps=300, lr_warmup=30)
    assert worker.learning_rate(ramp, 0) == pytest.approx(0.02 / 30, rel=1e-3)
    assert worker.learning_rate(ramp, 14) == pytest.approx(0.01, rel=1e-2)
    assert worker.learning_rate(ramp, 29) < 0.02 and worker.learning_rate(ramp, 299) < 1e-5
    assert worker.learning_rate(types.SimpleNamespace(lr=0.1, steps=30, lr_warmup=0), 0) == 0.1
    cls, keywords = worker.optimizer_of("adamw", 0.9, 0.01)
    assert cls is torch.optim.AdamW and keywords["weight_decay"] == 0.01
    assert keywords["betas"] == (0.9, 0.999) and "momentum" not in keywords


def test_a_loss_reaches_the_reference_from_below_and_rising_after_is_said():
    from jobs.peers import models

    ref = [(0, 4.1), (100, 1.31), (200, 1.305), (300, 1.302), (400, 1.30)]
    rows = [
        {"config": "ddp", "status": "ok", "ms_step": 10.0, "final_accuracy": 1.30,
         "accuracy": ref},
        {"config": "fast", "status": "ok", "ms_step": 5.0,
         "accuracy": [(0, 4.1), (100, 1.29), (400, 1.285)]},
        {"config": "slow", "status": "ok", "ms_step": 1.0,
         "accuracy": [(0, 4.1), (200, 1.5), (400, 1.32)]},
        {"config": "rose", "status": "ok", "ms_step": 5.0,
         "accuracy": [(0, 4.1), (200, 1.28), (400, 1.40)]},
    ]  # fmt: skip
    driver.add_targets(rows, models.LOSS)
    assert [r["steps_to_target"] for r in rows] == [400, 100, None, 200]
    assert rows[1]["seconds_to_target"] == pytest.approx(0.5)
    assert [r["fell_to"] for r in rows] == [None, None, None, 1.40]
    assert all(r["plateaued"] for r in rows)  # the last half's best 0.01 below the first's
    assert driver._reach(rows[3], 1.30, 400, models.LOSS) == "1.00 s (step 200), then rose to 1.400"
    driver.add_targets(rows)  # read as accuracies, the same numbers say the opposite
    assert [r["steps_to_target"] for r in rows] == [0, 0, 0, 0]
    # a reference loss still falling: the table says so, in its metric's words
    rows[0]["accuracy"] = [(0, 4.1), (100, 2.0), (200, 1.6), (300, 1.4), (400, 1.30)]
    assert driver.plateau(rows[0]["accuracy"], models.LOSS) == (False, pytest.approx(0.7))
    assert driver.plateau(rows[0]["accuracy"])[0]  # as accuracies: falling, so "flat"
    # the loss's tolerance: 0.04 nats better in the last half is flat, 0.06 is not
    assert driver.plateau([(0, 4.1), (1, 1.34), (2, 1.32), (3, 1.30)], models.LOSS)[0]
    assert not driver.plateau([(0, 4.1), (1, 1.36), (2, 1.32), (3, 1.30)], models.LOSS)[0]
    driver.add_targets(rows, models.LOSS)
    out = io.StringIO()
    driver.table(rows, types.SimpleNamespace(eval_every=100, steps=400), out, models.LOSS)
    text = out.getvalue()
    assert "loss@200" in text and "loss@400" in text and "acc@" not in text
    assert "time to DDP f32's held-out loss 1.300" in text
    assert "DDP float32 was still falling at step 400" in text


class _Recorder:
    """A network that records the worker's command line and launches nothing."""

    name, iface, tc_devs = "unshaped", "lo", []

    def command(self, argv):
        self.argv = argv
        return [sys.executable, "-c", "pass"]


def test_the_optimizer_and_compressed_adam_flags(tmp_path):
    out = ["--out", str(tmp_path)]
    args = driver._parse([*out, "--models", "mlp,lm"])
    mlp, lm = driver.for_model(args, "mlp"), driver.for_model(args, "lm")
    assert (mlp.optimizer, mlp.lr, mlp.steps, mlp.eval_every, mlp.lr_warmup) == (
        "sgd", 0.1, 30, 3, 0
    )  # fmt: skip
    assert (lm.optimizer, lm.lr, lm.steps, lm.eval_every, lm.lr_warmup) == (
        "adamw", 0.02, 300, 30, 30
    )  # fmt: skip
    args = driver._parse([*out, "--optimizer", "adamw", "--lr", "0.005", "--steps", "50"])
    mlp = driver.for_model(args, "mlp")
    assert (mlp.optimizer, mlp.lr, mlp.steps, mlp.eval_every) == ("adamw", 0.005, 50, 5)
    assert driver.for_model(driver._parse([*out, "--lr-warmup", "7"]), "lm").lr_warmup == 7
    assert not any("adam_warmup" in c.spec for c in args.configs)  # only where asked
    # the worker is told the model's optimizer and learning rate
    os.makedirs(tmp_path / "logs")
    args = driver._parse([*out, "--models", "lm", "--weight-decay", "0.1"])
    network = _Recorder()
    row = driver.run_config(network, "lm", driver.Config("ddp", {"kind": "ddp"}), args)
    assert row["status"].startswith("failed")  # no result written
    argv = " ".join(network.argv)
    assert "--optimizer adamw" in argv and "--lr 0.02 " in argv and "--steps 300 " in argv
    assert "--weight-decay 0.1" in argv and "--lr-warmup 30" in argv
    # --adam-warmup: a twin after each DistributedOptimizer and ZeroOptimizer row
    args = driver._parse([*out, "--models", "lm", "--codecs", "none,topk", "--auto", "none",
                          "--sharded", "zero", "--sharded-codecs", "signsgd",
                          "--adam-warmup", "50", "--powersgd-ranks", ""])  # fmt: skip
    specs = {c.label: c.spec for c in args.configs}
    assert list(specs) == [
        "ddp", "ddp_fp16", "ddp_bf16", "mpicomp_none", "mpicomp_none_adam50", "mpicomp_topk",
        "mpicomp_topk_adam50", "zero_ddp", "mpicomp_zero_signsgd",
        "mpicomp_zero_signsgd_adam50",
    ]  # fmt: skip
    assert specs["mpicomp_topk_adam50"] == {**specs["mpicomp_topk"], "adam_warmup": 50}
    assert specs["mpicomp_zero_signsgd_adam50"]["adam_warmup"] == 50
    assert sum("adam_warmup" in s for s in specs.values()) == 3
    for bad in (
        ["--models", "mlp", "--adam-warmup", "5"],  # SGD: no Adam to compress
        ["--models", "lm", "--optimizer", "sgd", "--adam-warmup", "5"],
        ["--models", "lm", "--adam-warmup", "0"],
        ["--optimizer", "adam"],
    ):
        with pytest.raises(SystemExit):
            driver._parse([*out, *bad])
