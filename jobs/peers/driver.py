"""Torch DDP's communication hooks, FSDP2 and ZeRO against mpicomp, side by side, in one command.

``python -m jobs.peers`` trains the same model from the same weights on the same batches
with the same optimizer once per configuration:

- torch ``DistributedDataParallel`` over gloo: no hook (float32), the fp16 and bf16
  compression hooks, PowerSGD at each rank of ``--powersgd-ranks`` (torch's own hook,
  its error feedback and warm start, plain all-reduce for the first
  ``--powersgd-start`` steps, the whole model in one bucket);
- ``mpicomp.torch.DistributedOptimizer`` with every codec of
  ``mpicomp.codecs.available()`` (the runs of the training jobs' comparison for the
  codecs it lists, a codec's defaults else), and each of those again with
  ``schedule="auto"`` (``--auto``);
- with ``--sharded``, sharded training: torch FSDP2 (``fully_shard``) over gloo in
  float32 (``fsdp``, the sharded rows' reference) and with
  ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``, FSDP2 with mpicomp's
  compressed reduce-scatter (``compress_fsdp``), compressed HSDP (FSDP2 within a host,
  mpicomp between hosts: ``compress_hsdp``), torch's ``ZeroRedundancyOptimizer`` with
  DDP, and ``mpicomp.torch.ZeroOptimizer``; mpicomp's with each codec of
  ``--sharded-codecs``;
- with ``--adam-warmup N`` (AdamW only), each ``DistributedOptimizer`` and
  ``ZeroOptimizer`` row again in mpicomp's compressed-Adam mode (``adam_warmup=N``: N
  steps averaged uncompressed under plain AdamW, then AdamW's second moment frozen and
  the gradients through the codec, with its error feedback, into the momentum),
  labelled ``..._adamN``.

Models (``--models``, jobs/peers/models.py): the digits MLP, a small ResNet and a
transformer classifier, scored by test accuracy and trained with SGD (momentum 0.9,
``--lr`` 0.1); and ``lm``, a causal transformer language model (tied embedding, 2
pre-LayerNorm blocks of width 64 at the small size) on a synthetic order-1 Markov
language with a known entropy floor (~1.25 nats per token against a unigram entropy of
~3.8; both printed), trained with AdamW (betas 0.9, 0.999, ``--weight-decay`` 0.01,
``--lr`` 0.02) for 300 steps (``Preset.lm_steps``) and scored by held-out loss: the
mean next-token cross-entropy over its test split, lower better. ``--optimizer`` gives
every model the one named (every peer kind steps it: torch's ZeroRedundancyOptimizer
and mpicomp's ZeroOptimizer as their optimizer class); ``--lr`` and ``--steps``, where
given, hold for every model. The learning rate follows a cosine from ``--lr`` to 0,
after ``--lr-warmup`` steps of linear ramp (AdamW's first tenth of the steps; none for
SGD).

Each configuration is one MPI launch (jobs/peers/worker.py) under ``--timeout``: a
peer that fails or hangs becomes a row saying so, and the next one runs. Networks
(``--networks``): ``unshaped`` (the machine's loopback, no root), and the emulated
networks of jobs.netem (root): ``shared`` (every rank on one loopback shaped to
``--rate``, a shared segment) and ``hosts`` (``--hosts`` emulated hosts, each with a
link of its own shaped to ``--rate``). MPI runs over TCP on all of them (jobs.netem's
environment), as gloo does.

Per configuration: ms/step (the slowest rank's, median after ``--warmup`` steps), bytes
per step (tc's counters on the emulated networks; unshaped, what mpicomp's calls report,
"n/a" for torch's), the optimizer's memory per rank (its state tensors, the largest
rank's), the model's metric (test accuracy; the lm's held-out loss) every
``--eval-every`` steps, and the time to reach the final value of DDP float32 on the same
network and model: its first evaluation at least as good, an accuracy as high or a
loss as low (steps x ms/step, or "never" within ``--steps``; a run that reaches it and
then diverges or ends worse by more than ``Metric.tolerance`` says so); where DDP
float32 had not plateaued the table says so under it, since a time to the value of a
run still improving is an early-training figure. Where FSDP2 float32 ran, a second table
gives every row's time to its final value. Output: a table per network and model on
stdout, ``OUT/peers.json`` (its rows' ``accuracy``, ``final_accuracy`` and
``target_accuracy`` hold the model's metric, which ``metric`` names: the lm's losses),
``OUT/accuracy.png`` (the metric against steps x ms/step, log; the lm's entropy floor
drawn) and each launch's log under ``OUT/logs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

from jobs._compare import parse_runs
from jobs._report import print_table
from jobs.netem import namespace
from jobs.netem.job import host_launch, mpi_env, mpi_vendor, mpiexec, uncounted
from jobs.peers import models
from mpicomp.tools.advise import parse_rate

NETWORKS = ("unshaped", "shared", "hosts")
REFERENCE = "ddp"  # the float32 baseline: its final accuracy is every row's target
SHARDED_REFERENCE = "fsdp"  # FSDP2 float32: the second target, where it ran
FAMILIES = ("fsdp", "hsdp", "zero")  # --sharded
GATHERS = {"float32": "", "bfloat16": "_gather_bf16"}  # ZeroOptimizer's, label suffixes


@dataclass(frozen=True)
class Config:
    """One configuration: its label and what the worker is told (``spec``)."""

    label: str
    spec: dict


@dataclass(frozen=True)
class Preset:
    models: str
    steps: int
    ranks: int
    auto: str
    sizes: models.Sizes
    lm_steps: int  # the lm's --steps: AdamW's float32 run plateaus near its floor by then


PRESETS = {
    # a few minutes on 2 cores: one small model, few steps
    "small": Preset("mlp", 30, 2, "qsgd_maxnorm_bits4", models.SMALL, 300),
    # the full comparison: the 8.55M-parameter MLP, a ResNet, a transformer block
    "full": Preset("mlp,resnet,transformer", 150, 4, "all", models.FULL, 1000),
}
#: --lr's default by optimizer (peak, cosine)
LR = {"sgd": 0.1, "adamw": 2e-2}


def ddp_configs(powersgd_ranks: list[int], start: int, bucket_mb: float | None) -> list[Config]:
    """DDP over gloo: no hook first (the reference), then the hooks."""
    base = {"kind": "ddp", "bucket_mb": bucket_mb}
    out = [Config(REFERENCE, base)]
    out += [Config(f"ddp_{h}", {**base, "hook": h}) for h in ("fp16", "bf16")]
    out += [
        Config(f"ddp_powersgd_rank{r}", {**base, "hook": "powersgd", "rank": r, "start": start})
        for r in powersgd_ranks
    ]
    return out


def mpicomp_configs(
    codecs: str,
    auto: str,
    strict: bool = True,
    powersgd_ranks: tuple[int, ...] = (1, 4),
    powersgd_start: int = 2,
) -> list[Config]:
    """``DistributedOptimizer`` runs: ``codecs`` (``all``: every available codec, see
    the module docstring; else jobs.train's syntax), then those of ``auto`` (``all``,
    ``none`` or labels of ``codecs``; not ``strict``: those that are) again with
    ``schedule="auto"``.

    mpicomp's ``powersgd`` is run as DDP's PowerSGD is: named without parameters, once
    per rank of ``powersgd_ranks``; its ``start_iter`` (1000 by default, as torch's)
    is ``powersgd_start`` unless given.

    Raises:
        ValueError: a malformed entry, or an ``--auto`` label that is not a run.
    """
    import mpicomp

    if codecs == "all":  # the float32 and float16 baselines first
        names = mpicomp.codecs.available()
        codecs = ",".join(sorted(names, key=lambda n: (n not in ("none", "fp16"), n != "none")))
    runs = []
    for r in parse_runs(codecs):
        if r.codec != "powersgd":
            runs.append(r)
            continue
        ranks = [r.params["rank"]] if "rank" in r.params else powersgd_ranks
        for rank in ranks:
            params = {**r.params, "rank": rank}
            params.setdefault("start_iter", powersgd_start)
            pairs = ":".join(f"{k}={v}" for k, v in params.items())
            runs += parse_runs(f"powersgd:{pairs}")
    out = [
        Config(f"mpicomp_{r.label}", {"kind": "mpicomp", "codec": r.codec, "params": r.params})
        for r in runs
    ]
    labels = {r.label: r for r in runs}
    if auto == "all":
        chosen = list(labels)
    elif auto == "none":
        chosen = []
    else:
        chosen = [a.strip() for a in auto.split(",") if a.strip()]
        missing = [a for a in chosen if a not in labels]
        chosen = [a for a in chosen if a in labels]
        if missing and strict:
            raise ValueError(
                f"--auto {', '.join(missing)}: not among the runs ({', '.join(labels)})"
            )
    for label in chosen:
        r = labels[label]
        spec = {"kind": "mpicomp", "codec": r.codec, "params": r.params, "schedule": "auto"}
        out.append(Config(f"mpicomp_{label}_auto", spec))
    return out


def sharded_configs(families, codecs: str, gathers=("float32",)) -> list[Config]:
    """Sharded training, by family of ``families`` (``FAMILIES``): ``fsdp``: FSDP2 float32
    (the reference), its bfloat16 reduce, and FSDP2 through mpicomp's reduce-scatter;
    ``hsdp``: compressed HSDP; ``zero``: torch's ZeroRedundancyOptimizer with DDP, and
    ZeroOptimizer at each allgather precision of ``gathers``. mpicomp's with every run of
    ``codecs`` (jobs.train's syntax).

    Raises:
        ValueError: an unknown family or precision, a malformed codec entry, or a codec
            without a reduce-scatter (powersgd).
    """
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        choices = ", ".join(("all", *FAMILIES))
        raise ValueError(f"--sharded: unknown {', '.join(unknown)}; choose from {choices}")
    wrong = [g for g in gathers if g not in GATHERS]
    if wrong:
        choices = ", ".join(GATHERS)
        raise ValueError(f"--zero-gather: unknown {', '.join(wrong)}; choose from {choices}")
    runs = parse_runs(codecs) if families else []
    if any(r.codec == "powersgd" for r in runs):
        raise ValueError(
            "--sharded-codecs: powersgd has no reduce-scatter (its aggregation needs every "
            "rank's whole tensor); its rows are DistributedOptimizer's (--codecs)"
        )
    out = []
    if "fsdp" in families:
        out.append(Config(SHARDED_REFERENCE, {"kind": "fsdp"}))
        out.append(Config("fsdp_bf16", {"kind": "fsdp", "reduce_dtype": "bfloat16"}))
    for family in ("fsdp", "hsdp"):
        if family in families:
            for r in runs:
                spec = {"kind": f"mpicomp_{family}", "codec": r.codec, "params": r.params}
                out.append(Config(f"mpicomp_{family}_{r.label}", spec))
    if "zero" in families:
        out.append(Config("zero_ddp", {"kind": "zero_ddp"}))
        for r in runs:
            for g in gathers:
                spec = {"kind": "mpicomp_zero", "codec": r.codec, "params": r.params}
                spec["gather_precision"] = g
                out.append(Config(f"mpicomp_zero_{r.label}{GATHERS[g]}", spec))
    return out


def adam_configs(configs: list[Config], warmup: int | None) -> list[Config]:
    """``configs`` with, after each ``DistributedOptimizer`` and ``ZeroOptimizer`` one, its
    twin in compressed-Adam mode (``adam_warmup=warmup``: ``warmup`` uncompressed AdamW
    steps, then the second moment frozen and the first through the codec), labelled
    ``_adam{warmup}``; ``configs`` as they are where ``warmup`` is None."""
    if warmup is None:
        return list(configs)
    out = []
    for c in configs:
        out.append(c)
        if c.spec["kind"] in ("mpicomp", "mpicomp_zero"):
            out.append(Config(f"{c.label}_adam{warmup}", {**c.spec, "adam_warmup": warmup}))
    return out


def for_model(args, model: str) -> argparse.Namespace:
    """``args`` with ``model``'s settings where the flags leave them open: its optimizer
    (``models.OPTIMIZERS``), that optimizer's learning rate (``LR``), its steps (the
    preset's; ``lm_steps`` for the lm), an evaluation every tenth of them, and the
    learning rate's linear warm-up (AdamW's: the first tenth of the steps)."""
    preset = PRESETS[args.preset]
    out = argparse.Namespace(**vars(args))
    out.optimizer = args.optimizer or models.OPTIMIZERS[model]
    out.lr = LR[out.optimizer] if args.lr is None else args.lr
    if args.steps is None:
        out.steps = preset.lm_steps if model == "lm" else preset.steps
    out.eval_every = args.eval_every or max(1, out.steps // 10)
    if args.lr_warmup is None:  # AdamW's first tenth; none for SGD, as it always ran
        out.lr_warmup = out.steps // 10 if out.optimizer == "adamw" else 0
    return out


def _skipped(config: Config, skip: set[str]) -> bool:
    return config.label in skip or config.spec.get("codec") in skip


class Network:
    """Where the ranks run: the command prefix, MPI's environment and launch arguments,
    gloo's interface and the qdiscs that count the bytes (none unshaped)."""

    def __init__(self, name: str, args, vendor: str):
        self.name, self.args, self.vendor = name, args, vendor
        self.ranks = args.ranks
        self.net = None
        self.uncounted = None  # why tc misses some bytes in this layout, or None

    def __enter__(self):
        args = self.args
        if self.name == "unshaped":
            self.prefix, self.launch, self.iface, self.tc_devs = [], [], "lo", []
            self.env = mpi_env(self.vendor)
            return self
        if self.name == "shared":
            self.net = namespace.Namespace(f"mpicomp-peers-{os.getpid()}")
        else:
            self.net = namespace.Hosts(args.hosts, base=f"mpicomp-peers-{os.getpid()}")
        self.net.__enter__()  # NeedsRoot when this cannot be done here
        try:
            self.net.shape(parse_rate(args.rate))
            self.prefix, self.tc_devs = self.net.prefix(), self.net.tc_devs()
            if self.name == "shared":
                self.launch, self.iface = [], "lo"
                self.env = mpi_env(self.vendor)
            else:
                self.ranks = args.hosts * args.ranks_per_host
                self.launch = host_launch(self.vendor, self.net, args.ranks_per_host)
                self.iface = namespace.NIC
                self.env = mpi_env(self.vendor, hosts=True, intra_host=args.intra_host)
                self.uncounted = uncounted(args)
        except BaseException:
            self.net.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.net is not None:
            self.net.__exit__(*exc)

    def describe(self) -> str:
        if self.name == "unshaped":
            return "unshaped: the machine's loopback, MPI and gloo over TCP"
        if self.name == "shared":
            return f"shared: every rank on one loopback shaped to {self.args.rate} (tc tbf)"
        return (
            f"hosts: {self.args.hosts} emulated hosts x {self.args.ranks_per_host} ranks, a "
            f"link each shaped to {self.args.rate} both ways, within a host over "
            f"{self.args.intra_host}"
        )

    def command(self, argv: list[str]) -> list[str]:
        """The command line that runs ``python -m mpi4py ARGV`` on the ranks."""
        cmd = self.prefix + ["env"] + [f"{k}={v}" for k, v in self.env.items()]
        cmd += [mpiexec(), *self.launch, "-n", str(self.ranks)]
        return cmd + [sys.executable, "-m", "mpi4py", *argv]


def _failure(log: str) -> str:
    """The last error line of a launch's log, without the rank prefixes."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in log.splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Warning)\b", line)]
    errors = [line for line in errors if not re.match(r"^\w*Warning\b", line)]
    return (errors or [line for line in lines if line] or ["no output"])[-1][:300]


def _launch(network: Network, argv: list[str], tag: str, args) -> tuple[dict, dict | None]:
    """Run ``python -m mpi4py ARGV --result PATH`` on the ranks under ``--timeout``, logging
    to OUT/logs/TAG.log. Return ({"log", "seconds"}, plus "status" saying why when it gave
    no result) and the result rank 0 wrote (None then); never raises for what it does."""
    log_path = os.path.join(args.out, "logs", f"{tag}.log")
    result = os.path.join(args.out, "logs", f"{tag}.json")
    with contextlib.suppress(FileNotFoundError):
        os.remove(result)
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            network.command([*argv, "--result", result]),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:
            _kill(proc)
            raise
        if rc is None:
            _kill(proc)
    meta = {"log": log_path, "seconds": time.monotonic() - started}
    if rc is None:
        return {**meta, "status": f"timed out after {args.timeout:g} s"}, None
    if rc != 0 or not os.path.exists(result):
        with open(log_path) as f:
            return {**meta, "status": f"failed (exit {rc}): {_failure(f.read())}"}, None
    with open(result) as f:
        return meta, json.load(f)


def run_config(network: Network, model: str, config: Config, args) -> dict:
    """Launch one configuration under ``--timeout``; return its row (never raises for
    what the launch does)."""
    args = for_model(args, model)
    argv = ["-m", "jobs.peers.worker", "--model", model, "--config", json.dumps(config.spec)]
    argv += ["--sizes", json.dumps(asdict(args.sizes))]
    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv += ["--eval-every", str(args.eval_every), "--batch", str(args.batch)]
    argv += ["--lr", str(args.lr), "--seed", str(args.seed), "--iface", network.iface]
    argv += ["--optimizer", args.optimizer, "--weight-decay", str(args.weight_decay)]
    argv += ["--lr-warmup", str(args.lr_warmup)]
    argv += ["--tc-dev", ",".join(network.tc_devs)]
    argv += ["--host-ranks", str(args.hsdp_host_ranks)]
    row = {"network": network.name, "model": model, "config": config.label, **config.spec}
    meta, result = _launch(network, argv, f"{network.name}-{model}-{config.label}", args)
    row.update(meta)
    if result is not None:
        row.update(result)
        row["status"] = f"diverged at step {row['diverged']}" if row["diverged"] else "ok"
    return row


def run_exchange(network: Network, model: str, args) -> dict:
    """Launch jobs.peers.exchange (the float32 and fp16 exchanges alone) on one network
    and model, print its table, and return its result (or a status saying why none)."""
    argv = ["-m", "jobs.peers.exchange", "--model", model, "--iface", network.iface]
    argv += ["--sizes", json.dumps(asdict(args.sizes))]
    argv += ["--repeats", str(args.exchange_repeats)]
    meta, result = _launch(network, argv, f"{network.name}-{model}-exchange", args)
    row = {"network": network.name, "model": model, **meta}
    if result is None:
        print(f"  exchange: {row['status']}", flush=True)
        return row
    row.update(result, status="ok")
    print(
        f"\n{network.name}, {model}: {row['model_params']:,} float32 gradients averaged over "
        f"{row['ranks']} ranks, alone (median of {row['repeats']}, slowest rank)"
    )
    base = row["ms"]["gloo float32"]
    print(f"{'exchange':32s} {'ms':>9s} {'gloo f32 / x':>13s}")
    for name, ms in row["ms"].items():
        print(f"{name:32s} {ms:9.1f} {base / ms:13.2f}")
    return row


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def plateau(accuracy: list, metric: models.Metric = models.ACCURACY) -> tuple[bool, float]:
    """Return whether a run's evaluations (``[(step, value), ...]`` of ``metric``) have
    plateaued, and how much better the last half's best is than the first half's: it has
    where that is at most ``metric.tolerance``. Fewer than 4 evaluations never have."""
    acc = [a for _, a in accuracy]
    if len(acc) < 4:
        return False, float("nan")
    half = len(acc) // 2
    rise = metric.gain(metric.best(acc[:half]), metric.best(acc[half:]))
    return rise <= metric.tolerance, rise


def add_targets(rows: list[dict], metric: models.Metric = models.ACCURACY) -> None:
    """Give every row of one network and model its time to DDP float32's final value of
    ``metric`` (its first evaluation at least as good: an accuracy as high, a loss as
    low), whether DDP float32 had plateaued (``plateaued``, ``rise``: a time to the value
    of a run still improving is an early-training figure, not a time to accuracy), and,
    for a row that reached the target, its final value when it ended more than
    ``metric.tolerance`` worse (``fell_to``: it reached the target and lost it). Where
    FSDP2 float32 ran (``SHARDED_REFERENCE``), the same against its final value under
    ``vs_fsdp``. The rows' ``accuracy``, ``final_accuracy`` and ``target_accuracy``
    hold ``metric``'s values, whichever it is."""
    for r, fields in zip(rows, _targets(rows, REFERENCE, metric), strict=True):
        r.update(fields)
    if any(r["config"] == SHARDED_REFERENCE for r in rows):
        for r, fields in zip(rows, _targets(rows, SHARDED_REFERENCE, metric), strict=True):
            r["vs_fsdp"] = fields


def _targets(rows: list[dict], reference: str, metric: models.Metric) -> list[dict]:
    """``add_targets``'s fields of every row against the final value of ``reference``."""
    ref = next((r for r in rows if r["config"] == reference and r["status"] == "ok"), None)
    target = ref["final_accuracy"] if ref else None
    flat, rise = plateau(ref["accuracy"], metric) if ref else (False, float("nan"))
    out = []
    for r in rows:
        f = {"target_accuracy": target, "plateaued": flat, "rise": rise}
        f["steps_to_target"] = f["seconds_to_target"] = f["fell_to"] = None
        out.append(f)
        if target is None or not r.get("ms_step") or not r.get("accuracy"):
            continue
        if r["status"] != "ok" and not r["status"].startswith("diverged"):
            continue
        hit = next((step for step, acc in r["accuracy"] if metric.reached(acc, target)), None)
        f["steps_to_target"] = hit
        if hit is not None:
            f["seconds_to_target"] = hit * r["ms_step"] / 1e3
            last = r["accuracy"][-1][1]
            if r["status"] != "ok" or metric.gain(target, last) < -metric.tolerance:
                f["fell_to"] = last
    return out


def _reach(r: dict, target, steps: int, metric: models.Metric = models.ACCURACY) -> str:
    """The table's last column: the time to the target, and what came after."""
    if r["seconds_to_target"] is not None:
        reach = f"{r['seconds_to_target']:.2f} s (step {r['steps_to_target']})"
        if r["status"] != "ok":
            return f"{reach}, then {r['status']}"
        if r["fell_to"] is not None:
            return f"{reach}, then {metric.worse} to {r['fell_to']:.3f}"
        return reach
    if r["status"] != "ok":
        return r["status"]
    return "-" if target is None else f"never in {steps} steps"


def _fmt_bytes(r: dict) -> str:
    b = r.get("bytes_per_step_tc")
    if b is None:
        b = r.get("bytes_per_step_traced")
    return "n/a" if b is None else f"{b / 1e6:.3f}"


def _acc_at(r: dict, step: int) -> str:
    acc = dict((s, a) for s, a in r.get("accuracy", []))
    return "-" if step not in acc else f"{acc[step]:.3f}"


def _fmt_optimizer(r: dict) -> str:
    b = r.get("optimizer_bytes")
    return "-" if not b else f"{max(b) / 1e6:.3f}"


def _ran(r: dict) -> bool:
    return r["status"] == "ok" or r["status"].startswith("diverged")


def table(rows: list[dict], args, out=sys.stdout, metric: models.Metric = models.ACCURACY) -> None:
    """Print one network and model's rows, scored by ``metric``; and, where FSDP2 float32
    ran, every row's time to its final value."""
    ref = next((r for r in rows if r["config"] == REFERENCE and r.get("ms_step")), None)
    mid = args.eval_every * max(1, args.steps // args.eval_every // 2)
    target = rows[0].get("target_accuracy")
    goal = "time to DDP f32's " + ("(no reference)" if target is None else metric.target(target))
    shaped = any(r.get("bytes_per_step_tc") is not None for r in rows)
    w = _label_width(rows)
    short = metric.short
    head = (
        f"{'configuration':<{w}}{'ms/step':>9}{'x DDP':>7}{'MB/step':>9}{'opt MB':>9}"
        f"{f'{short}@{mid}':>10}{f'{short}@{args.steps}':>10}  {goal}"
    )

    def line(r: dict) -> str:
        if not _ran(r):
            return f"{r['config']:<{w}}{r['status']}"
        ms = r["ms_step"]
        speed = f"{ref['ms_step'] / ms:.2f}" if ref and ms else "-"
        reach = _reach(r, target, args.steps, metric)
        return (
            f"{r['config']:<{w}}{ms:>9.1f}{speed:>7}{_fmt_bytes(r):>9}{_fmt_optimizer(r):>9}"
            f"{_acc_at(r, mid):>10}{_acc_at(r, args.steps):>10}  {reach}"
        )

    print_table(head, map(line, rows), out)
    print(
        "MB/step: "
        + (
            "tc's counters of the emulated network over the timed steps, all ranks"
            if shaped
            else "what mpicomp's calls received, all ranks (MPI_Allreduce calls count "
            "their 4n logical bytes; HSDP's between hosts only); n/a: torch's, whose "
            "bytes only tc sees"
        ),
        file=out,
    )
    print(
        "opt MB: the optimizer's state tensors on the rank that holds the most (SGD's "
        "momentum, AdamW's two moments; ZeroOptimizer's float32 master rows where it "
        "keeps them)",
        file=out,
    )
    if not metric.higher:
        print(
            f"{short}: {metric.name}, the mean next-token cross-entropy over the test "
            "split (nats; lower is better)",
            file=out,
        )
    _rising(rows[0], "DDP float32", args.steps, out, metric)
    if "vs_fsdp" in rows[0]:
        _sharded_table(rows, args, out, metric)


def _label_width(rows: list[dict]) -> int:
    return max([40] + [len(r["config"]) + 2 for r in rows])


def _rising(fields: dict, name: str, steps: int, out, metric: models.Metric) -> None:
    """Say under a table when its reference had not plateaued."""
    if fields["target_accuracy"] is None or fields["plateaued"]:
        return
    rise = fields["rise"]
    side = "above" if metric.higher else "below"
    why = (
        "too few evaluations to tell"
        if rise != rise  # NaN: fewer than 4
        else f"its last half's best {rise:.3f} {side} its first half's"
    )
    print(
        f"{name} was still {metric.moving} at step {steps} ({why}): times to its "
        f"{metric.name} are early-training figures; run more --steps for a time to "
        f"{metric.name}",
        file=out,
    )


def _sharded_table(rows: list[dict], args, out, metric: models.Metric) -> None:
    """Every row against FSDP2 float32: its speed and its time to FSDP2's final value."""
    ref = next((r for r in rows if r["config"] == SHARDED_REFERENCE and r.get("ms_step")), None)
    target = rows[0]["vs_fsdp"]["target_accuracy"]
    no_ref = target is None
    goal = "time to FSDP2 f32's " + ("(no reference)" if no_ref else metric.target(target))
    w = _label_width(rows)
    head = f"{'configuration':<{w}}{'ms/step':>9}{'x FSDP2':>9}{'opt MB':>9}  {goal}"

    def line(r: dict) -> str:
        if not _ran(r):
            return f"{r['config']:<{w}}{r['status']}"
        ms = r["ms_step"]
        speed = f"{ref['ms_step'] / ms:.2f}" if ref and ms else "-"
        reach = _reach({**r, **r["vs_fsdp"]}, target, args.steps, metric)
        return f"{r['config']:<{w}}{ms:>9.1f}{speed:>9}{_fmt_optimizer(r):>9}  {reach}"

    print(file=out)
    print_table(head, map(line, rows), out)
    _rising(rows[0]["vs_fsdp"], "FSDP2 float32", args.steps, out, metric)


def plot(path: str, groups: dict, title: str, floors: dict | None = None) -> None:
    """Each model's metric (``models.METRICS``) against steps x ms/step, one panel per
    network and model; ``floors``: a model's least possible value, drawn (the lm's
    entropy floor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(groups)
    fig, axes = plt.subplots(1, len(keys), figsize=(7 * len(keys), 5), dpi=100, squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, key in zip(axes[0], keys, strict=True):
        rows = [r for r in groups[key] if r.get("ms_step") and r.get("accuracy")]
        for i, r in enumerate(rows):
            # log time: one slow configuration would squeeze the others into a corner
            xs = [s * r["ms_step"] / 1e3 for s, _ in r["accuracy"] if s > 0]
            ys = [a for s, a in r["accuracy"] if s > 0]
            ddp = r["kind"] in ("ddp", "zero_ddp", "fsdp")  # torch's own: dashed
            style = dict(color="black", lw=2.2, zorder=5) if r["config"] == REFERENCE else {}
            if not style:
                style = dict(color=cmap(i % 20), lw=1.6 if ddp else 1.1, ls="--" if ddp else "-")
            ax.plot(xs, ys, label=r["config"], **style)
        target = groups[key][0].get("target_accuracy")
        if target is not None:
            ax.axhline(target, color="grey", ls=":", lw=1)
        floor = (floors or {}).get(key[1])
        if floor is not None:
            ax.axhline(floor, color="red", ls=":", lw=1, label="entropy floor")
        steps = next((r["steps"] for r in rows), None)
        ax.set_title(f"{key[0]}, {key[1]}" + (f", {steps} steps" if steps else ""))
        ax.set_xscale("log")
        ax.set_xlabel("steps x median ms/step (s, log)")
        ax.set_ylabel(models.METRICS[key[1]].name)
        ax.grid(True, alpha=0.3)
        if rows:
            ax.legend(fontsize=6, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _commit() -> str | None:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or None if out.returncode == 0 else None


def _words(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def _parse(argv):
    ap = argparse.ArgumentParser(prog="jobs.peers", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="small",
        help="defaults of --models, --steps, --ranks and the sizes: small (the MLP "
        "64-256-256-10, 30 steps, 2 ranks: minutes on 2 cores) or full (the full comparison: "
        "MLP 64-2048-2048-2048-10, ResNet width 64 on 32x32, transformer width 256, 150 "
        "steps, 4 ranks)",
    )
    ap.add_argument(
        "--models",
        default=None,
        help=f"comma list of {', '.join(models.MODELS)} (lm: a causal transformer language "
        "model under AdamW, scored by held-out loss)",
    )
    ap.add_argument("--mlp-hidden", default=None, help="the MLP's hidden widths (preset's)")
    ap.add_argument("--resnet-width", type=int, default=None, help="the ResNet's first width")
    ap.add_argument("--transformer-width", type=int, default=None, help="d_model (preset's)")
    ap.add_argument("--networks", default="unshaped", help=f"comma list of {', '.join(NETWORKS)}")
    ap.add_argument("--rate", default="1gbit", help="the emulated links' rate (1gbit)")
    ap.add_argument("--ranks", type=int, default=None, help="ranks (unshaped, shared)")
    ap.add_argument("--hosts", type=int, default=4, help="emulated hosts of `hosts` (4)")
    ap.add_argument("--ranks-per-host", type=int, default=1, help="with `hosts` (1)")
    ap.add_argument("--intra-host", choices=("shm", "tcp"), default="shm", help="as jobs.netem")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps per configuration (the preset's: 30 small, 150 full; the "
        "lm's 300 small, 1000 full)",
    )
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of ms/step (3)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps (steps / 10)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank (32)")
    ap.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate, cosine (the optimizer's: 0.1 sgd, 0.02 adamw)",
    )
    ap.add_argument(
        "--lr-warmup",
        type=int,
        default=None,
        metavar="STEPS",
        help="steps of linear learning-rate ramp before the cosine (the optimizer's: none "
        "for sgd, a tenth of --steps for adamw)",
    )
    ap.add_argument(
        "--optimizer",
        choices=("sgd", "adamw"),
        default=None,
        help="every configuration's optimizer: sgd (momentum 0.9) or adamw (betas 0.9, "
        "0.999); the model's by default (sgd; adamw for lm)",
    )
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's weight decay (0.01)")
    ap.add_argument(
        "--adam-warmup",
        type=int,
        default=None,
        metavar="N",
        help="AdamW only: each DistributedOptimizer and ZeroOptimizer row again (label "
        "suffix _adamN) in mpicomp's compressed-Adam mode, adam_warmup=N: N uncompressed "
        "steps, then the second moment frozen and the gradients through the codec (with "
        "its error feedback) into the momentum (none by default)",
    )
    ap.add_argument("--seed", type=int, default=0, help="weights and batches (0)")
    ap.add_argument(
        "--codecs",
        default="all",
        help="mpicomp runs: all (every codec of mpicomp.codecs.available()), or labels, "
        "names and name:key=value entries as jobs.train",
    )
    ap.add_argument(
        "--auto",
        default=None,
        help="runs of --codecs to repeat with schedule='auto': all, none, or labels "
        "(the preset's: qsgd_maxnorm_bits4 small, all full)",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="configurations to leave out (labels, or codec names), each still a row saying so",
    )
    ap.add_argument(
        "--sharded",
        default="",
        help="sharded training's rows too: all, or a comma list of fsdp (FSDP2 float32, "
        "its bf16 reduce, FSDP2 through mpicomp), hsdp (compressed HSDP), zero (torch's "
        "ZeroRedundancyOptimizer with DDP, mpicomp's ZeroOptimizer); none by default",
    )
    ap.add_argument(
        "--sharded-codecs",
        default="none,qsgd_maxnorm_bits4,signsgd,threelc_sparsity1.0",
        help="mpicomp's sharded rows' codecs, as --codecs (every codec but powersgd) "
        "(none,qsgd_maxnorm_bits4,signsgd,threelc_sparsity1.0)",
    )
    ap.add_argument(
        "--zero-gather",
        default="float32",
        help="ZeroOptimizer's allgather precisions, a row each: float32, bfloat16 (float32)",
    )
    ap.add_argument(
        "--hsdp-host-ranks",
        type=int,
        default=2,
        help="compressed HSDP's ranks per host on unshaped and shared (2); on hosts, "
        "each emulated host's ranks",
    )
    ap.add_argument(
        "--rows",
        default="",
        help="run only the configurations whose labels match one of these comma-separated "
        "patterns (fnmatch: 'ddp,fsdp*,*zero*'); all by default",
    )
    ap.add_argument("--powersgd-ranks", default="1,4", help="PowerSGD's ranks (1,4)")
    ap.add_argument(
        "--powersgd-start",
        type=int,
        default=2,
        help="PowerSGD's start_powerSGD_iter: plain all-reduce before it (2, the least torch "
        "takes with error feedback)",
    )
    ap.add_argument(
        "--ddp-bucket-mb",
        type=float,
        default=None,
        help="bucket_cap_mb of DDP without PowerSGD (DDP's default, 25)",
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds per configuration (300)")
    ap.add_argument("--out", default=os.path.join("runs", "peers"), help="output directory")
    ap.add_argument("--no-plot", action="store_true", help="write no accuracy.png")
    ap.add_argument(
        "--exchange",
        action="store_true",
        help="instead of training: time the float32 and fp16 exchanges alone, gloo's, "
        "MPI_Allreduce's and mpicomp's (jobs/peers/exchange.py)",
    )
    ap.add_argument("--exchange-repeats", type=int, default=8, help="with --exchange (8)")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    args.models = [m.strip() for m in (args.models or preset.models).split(",") if m.strip()]
    args.networks = [n.strip() for n in args.networks.split(",") if n.strip()]
    args.ranks = preset.ranks if args.ranks is None else args.ranks
    strict = args.auto is not None  # the preset's runs only where --codecs has them
    args.auto = preset.auto if args.auto is None else args.auto
    args.sizes = preset.sizes
    if args.mlp_hidden:
        hidden = tuple(int(h) for h in args.mlp_hidden.split(",") if h.strip())
        args.sizes = replace(args.sizes, mlp_hidden=hidden)
    if args.resnet_width:
        args.sizes = replace(args.sizes, resnet_width=args.resnet_width)
    if args.transformer_width:
        args.sizes = replace(args.sizes, transformer_width=args.transformer_width)
    try:
        for m in args.models:
            if m not in models.MODELS:
                raise ValueError(f"--models: unknown {m!r}; choose from {', '.join(models.MODELS)}")
        for n in args.networks:
            if n not in NETWORKS:
                raise ValueError(f"--networks: unknown {n!r}; choose from {', '.join(NETWORKS)}")
        parse_rate(args.rate)
        ranks = [int(r) for r in args.powersgd_ranks.split(",") if r.strip()]
        args.configs = ddp_configs(ranks, args.powersgd_start, args.ddp_bucket_mb)
        args.configs += mpicomp_configs(
            args.codecs, args.auto, strict, tuple(ranks), args.powersgd_start
        )
        families = _words(args.sharded)
        families = list(FAMILIES) if families == ["all"] else families
        args.configs += sharded_configs(
            families, args.sharded_codecs, _words(args.zero_gather) or ["float32"]
        )
        if args.adam_warmup is not None:
            if args.adam_warmup < 1:
                raise ValueError("--adam-warmup must be >= 1 (AdamW's second moment comes first)")
            if "adamw" not in {for_model(args, m).optimizer for m in args.models}:
                raise ValueError(
                    "--adam-warmup: compressed Adam needs AdamW: --optimizer adamw, or a "
                    "model that steps it (lm)"
                )
        args.configs = adam_configs(args.configs, args.adam_warmup)
        patterns = _words(args.rows)
        if patterns:
            args.configs = [
                c for c in args.configs if any(fnmatch.fnmatchcase(c.label, p) for p in patterns)
            ]
            if not args.configs:
                raise ValueError(f"--rows {args.rows}: no configuration matches")
    except ValueError as e:
        ap.error(str(e))
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    steps = [for_model(args, m).steps for m in args.models]
    if min(steps) <= args.warmup or args.warmup < 0 or args.ranks < 1 or args.batch < 1:
        ap.error("--steps must exceed --warmup (>= 0); --ranks and --batch must be >= 1")
    if "hosts" in args.networks and not 1 <= args.hosts <= namespace.MAX_HOSTS:
        ap.error(f"--hosts must be 1..{namespace.MAX_HOSTS}")
    if args.timeout <= 0:
        ap.error("--timeout must be > 0")
    if args.hsdp_host_ranks < 1:
        ap.error("--hsdp-host-ranks must be >= 1")
    hsdp = any(c.spec["kind"] == "mpicomp_hsdp" for c in args.configs)
    loopback = [n for n in args.networks if n != "hosts"]
    if hsdp and loopback and args.ranks % args.hsdp_host_ranks:
        ap.error(
            f"--hsdp-host-ranks {args.hsdp_host_ranks} does not divide --ranks {args.ranks}: "
            f"HSDP's hosts on {', '.join(loopback)} must hold as many ranks each"
        )
    return args


def main(argv=None) -> int:
    """Run every configuration on every network and model; return 0, or 2 when a network
    cannot be made (not root)."""
    args = _parse(argv)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    vendor = mpi_vendor()
    started = time.time()
    settings = {m: _settings(args, m) for m in args.models}
    summary = {
        "meta": {
            "job": "jobs.peers",
            "argv": list(sys.argv[1:] if argv is None else argv),
            "date": datetime.date.today().isoformat(),
            "commit": _commit(),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "mpi": vendor,
            "steps": _common(s["steps"] for s in settings.values()),
            "warmup": args.warmup,
            "batch_per_rank": args.batch,
            "lr": _common(s["lr"] for s in settings.values()),
            "models": settings,  # each model's optimizer, lr, steps (and the lm's entropies)
            "rate": args.rate,
            "sizes": asdict(args.sizes),
            "hsdp_host_ranks": args.hsdp_host_ranks,
        },
        "networks": [],
        "runs": [],
        "exchange": [],
    }
    groups: dict[tuple[str, str], list[dict]] = {}
    code = 0
    try:
        for name in args.networks:
            try:
                network = Network(name, args, vendor)
                with network:
                    print(f"\n== {network.describe()}, {network.ranks} ranks", flush=True)
                    summary["networks"].append(
                        {"network": name, "ranks": network.ranks, "uncounted": network.uncounted}
                    )
                    for model in args.models:
                        if args.exchange:
                            summary["exchange"].append(run_exchange(network, model, args))
                            continue
                        rows = _run_model(network, model, args)
                        groups[(name, model)] = rows
                        summary["runs"] += rows
            except namespace.NeedsRoot as e:
                print(f"\n== {name}: skipped: {e}", flush=True)
                summary["networks"].append({"network": name, "skipped": str(e)})
                code = 2
    except KeyboardInterrupt:
        print("jobs.peers: interrupted; namespaces removed", file=sys.stderr)
        return 130
    summary["meta"]["seconds"] = time.time() - started
    path = os.path.join(args.out, "peers.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nwrote {path} ({summary['meta']['seconds']:.0f} s)")
    if groups and not args.no_plot:
        png = os.path.join(args.out, "accuracy.png")
        title = f"jobs.peers: batch {args.batch} per rank"
        floors = {m: s.get("floor") for m, s in settings.items()}
        plot(png, groups, title, floors)
        print(f"wrote {png}")
    return code


def _settings(args, model: str) -> dict:
    """What ``model`` runs with (``for_model``), and its language's entropies (the lm)."""
    margs = for_model(args, model)
    keys = ("optimizer", "lr", "lr_warmup", "steps", "eval_every")
    out = {k: getattr(margs, k) for k in keys}
    if out["optimizer"] == "adamw":
        out["weight_decay"] = args.weight_decay
    data = models.load(model, args.sizes) if model == "lm" else None
    if data is not None:
        out.update(floor=data.floor, unigram=data.unigram)
    return out


def _common(values):
    """The one value every model has, or None."""
    values = set(values)
    return values.pop() if len(values) == 1 else None


def _run_model(network: Network, model: str, args) -> list[dict]:
    """Every configuration on one network and model, reported as it goes."""
    n = models.n_params(models.build(model, args.sizes, args.seed))
    margs = for_model(args, model)
    print(
        f"\n{network.name}, {model} ({n:,} parameters), {network.ranks} ranks, batch "
        f"{args.batch} per rank, {margs.steps} steps of {margs.optimizer} at lr {margs.lr:g} "
        f"(cosine, {margs.lr_warmup} steps' warm-up; ms/step: median after {args.warmup})",
        flush=True,
    )
    metric = models.METRICS[model]
    if model == "lm":
        data = models.load(model, args.sizes)
        print(
            f"its language: entropy floor {data.floor:.4f} nats/token (the true chain's "
            f"expected {metric.name}), unigram entropy {data.unigram:.4f}",
            flush=True,
        )
    rows = []
    for config in args.configs:
        if _skipped(config, args.skip):
            row = {"network": network.name, "model": model, "config": config.label}
            rows.append({**row, **config.spec, "status": "skipped (--skip)"})
            continue
        if config.spec.get("adam_warmup") and margs.optimizer != "adamw":
            row = {"network": network.name, "model": model, "config": config.label}
            why = f"skipped (--adam-warmup: AdamW's; {model} steps {margs.optimizer})"
            rows.append({**row, **config.spec, "status": why})
            continue
        row = run_config(network, model, config, args)
        rows.append(row)
        ms = f"{row['ms_step']:.1f} ms/step" if row.get("ms_step") else ""
        print(f"  {config.label}: {row['status']} {ms} ({row['seconds']:.0f} s)", flush=True)
    add_targets(rows, metric)
    table(rows, margs, metric=metric)
    if network.uncounted:
        print(f"MB/step: not every byte: {network.uncounted}", flush=True)
    return rows
