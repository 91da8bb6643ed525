"""What the training comparisons share: the codec list, byte counting, the table, the plot.

``jobs.train`` (NumPy MLP, averaging through ``CompressedComm``) and ``jobs.train_torch``
(a torch CNN through ``mpicomp.torch.DistributedOptimizer``) differ in how they compute
and average gradients; the codec list, measuring and reporting are here.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from mpicomp.collectives.traffic import Traffic
from mpicomp.tools.bench.workload import parse_codec, split_codecs


@dataclass(frozen=True)
class Run:
    """One codec configuration of the comparison."""

    label: str
    codec: str
    params: dict = field(default_factory=dict)


def _label(codec: str, params: dict) -> str:
    # the label names the run's trace file: keep it to characters every file system takes
    fmt = lambda v: "-".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)  # noqa: E731
    label = codec + "".join(f"_{k}{fmt(v)}" for k, v in params.items())
    return re.sub(r"[^A-Za-z0-9._-]", "-", label)


def _run(codec: str, **params) -> Run:
    return Run(_label(codec, params), codec, params)


# The default comparison: the float32 baseline first (ratios are relative to it).
RUNS = [
    _run("none"),
    _run("fp16"),
    _run("qsgd_maxnorm", bits=8),
    _run("qsgd_maxnorm", bits=4),
    _run("qsgd_maxnorm", bits=2),
    _run("qsgd_maxnorm_multiscale", bits=2),
    _run("grandk_maxnorm", bits=8, k=0.25),
    _run("threelc", sparsity=1.0),
    _run("threelc", sparsity=1.5),
    _run("fft"),
    _run("signsgd"),
    _run("fastsgd"),
    _run("topk"),
]


def parse_runs(text: str | None) -> list[Run]:
    """Return the runs named by a comma list (None: the default comparison).

    Each entry is a label of the default list (``qsgd_maxnorm_bits4``), a codec name
    (all its default runs, or the codec's own defaults when it has none), or
    ``name:key=value:key=value`` for any other parameters (values are Python literals,
    e.g. ``scales=(2,8)``, or plain words).

    Raises:
        ValueError: an empty list or a malformed entry.
    """
    if text is None:
        return list(RUNS)
    runs: list[Run] = []
    for entry in split_codecs(text):  # the spelling mpicomp's --codecs reads too
        if ":" in entry:
            name, params = parse_codec(entry)
            runs.append(_run(name, **params))
            continue
        hits = [r for r in RUNS if r.label == entry] or [r for r in RUNS if r.codec == entry]
        runs.extend(hits or [_run(entry)])
    if not runs:
        raise ValueError(f"no codec in --codecs {text!r}")
    return runs


def add_common_args(
    ap: argparse.ArgumentParser,
    *,
    steps: int,
    lr: float,
    out: str,
    codecs: str | None = None,
    hidden: bool = True,
) -> None:
    """Add the options both training jobs take (``--hidden`` only where the model is an MLP)."""
    ap.add_argument("--steps", type=int, default=steps, help="SGD steps per codec")
    ap.add_argument("--batch", type=int, default=64, help="global batch, split over the ranks")
    ap.add_argument("--lr", type=float, default=lr, help="peak learning rate (cosine decay)")
    ap.add_argument("--momentum", type=float, default=0.9, help="heavy-ball momentum")
    if hidden:
        ap.add_argument("--hidden", default="128", help="hidden layer widths, comma list")
    ap.add_argument(
        "--codecs",
        default=codecs,
        help="comma list of labels, codec names or name:key=value:key=value entries "
        "(None: every codec run of the comparison, see docs/training.md)",
    )
    ap.add_argument("--out", default=out, help="directory for traces, results.json, loss.png")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    ap.add_argument("--no-trace", action="store_true", help="write no HDF5 trace per run")
    ap.add_argument("--no-plot", action="store_true", help="write no loss.png")


def check_args(args) -> None:
    """Refuse option values that cannot train.

    Raises:
        ValueError: a non-positive step count, batch or learning rate, a bad hidden list.
    """
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps!r}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch!r}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr!r}")
    if not 0 <= args.momentum < 1:
        raise ValueError(f"--momentum must be in [0, 1), got {args.momentum!r}")
    if not hasattr(args, "hidden"):
        return
    try:
        hidden = [int(h) for h in args.hidden.split(",") if h.strip()]
    except ValueError:
        hidden = []
    if not hidden or min(hidden) < 1:
        raise ValueError(f"--hidden must be a comma list of widths >= 1, got {args.hidden!r}")
    args.hidden = hidden


def require_matplotlib() -> None:
    """Fail before training, not after, when the plot cannot be drawn.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "loss.png needs matplotlib: pip install 'mpicomp[jobs]', or pass --no-plot"
        ) from e


def cosine_lr(lr: float, step: int, steps: int) -> float:
    """Return the learning rate of ``step`` (0-based) under cosine annealing to 0."""
    return lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))


def supports_trace() -> bool:
    """Return whether this mpicomp's CompressedComm takes ``trace=``."""
    from mpicomp.comm import CompressedComm

    return "trace" in inspect.signature(CompressedComm.__init__).parameters


def open_comm(comm, run: Run, trace_path: str | None):
    """Return (CompressedComm for ``run``, the Traffic counter it reports to).

    Args:
        comm: the job's communicator (a duplicate is kept by CompressedComm).
        run: the codec and its parameters.
        trace_path: the HDF5 trace to write at close, or None.
    """
    import mpicomp

    kwargs = dict(run.params)
    if trace_path is not None:
        kwargs["trace"] = trace_path
    cc = mpicomp.CompressedComm(comm, run.codec, **kwargs)
    # CompressedComm hands ``cc.recorder`` every exchange step of its collectives (the
    # HDF5 trace, ``cc.trace``, gets them as well): the bytes are counted, not estimated.
    traffic = Traffic()
    cc.recorder = traffic
    return cc, traffic


@dataclass
class Result:
    """What one codec run measured (the same on every rank after ``summarize``)."""

    label: str
    codec: str
    params: dict
    steps: int
    loss_steps: list[int]
    losses: list[float]
    final_train_loss: float = math.nan
    test_accuracy: float = math.nan
    bytes_sent: float = math.nan  # per step per rank, mean over ranks
    bytes_recv: float = math.nan
    ms_step: float = math.nan  # median over steps of the slowest rank's step
    ms_comm: float = math.nan  # the same for the allreduce_many call alone
    trace: str | None = None
    diverged: int = 0  # the step at which a gradient or weight became NaN/Inf (0: never)


def summarize(comm, result: Result, traffic: Traffic, t_step, t_comm) -> None:
    """Fill ``result``'s bytes and times from every rank's counters (a collective call)."""
    calls = result.diverged or result.steps  # a diverged run stops in the same call everywhere
    mine = np.array([traffic.sent, traffic.recv], dtype=np.float64)
    total = np.empty_like(mine)
    comm.Allreduce(mine, total)
    result.bytes_sent, result.bytes_recv = (total / comm.size / calls).tolist()
    for attr, times in (("ms_step", t_step), ("ms_comm", t_comm)):
        local = np.asarray(times, dtype=np.float64)
        slowest = np.empty_like(local)
        comm.Allreduce(local, slowest, op=_max_op())
        # the median is robust to the first step (kernel loading) and to the other jobs
        # of a shared machine; the slowest rank sets the pace of a synchronous step
        setattr(result, attr, 1e3 * float(np.median(slowest)) if slowest.size else math.nan)


def _max_op():
    from mpi4py import MPI

    return MPI.MAX


def _ratio(base: float | None, value: float) -> str:
    if base is None or not value:
        return "-"
    return f"{base / value:.1f}x"


def table(results: list[Result], baseline: str = "none") -> str:
    """Return the comparison as a fixed-width text table."""
    base = next((r for r in results if r.codec == baseline and not r.params), None)
    head = (
        f"{'codec':<36}{'train loss':>11}{'test acc':>9}{'sent B/step':>12}{'ratio':>8}"
        f"{'recv B/step':>12}{'ms/step':>9}{'x base':>8}{'comm ms':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        speed = f"{r.ms_step / base.ms_step:.2f}" if base else "-"
        loss = (
            f"{r.final_train_loss:>11.4f}" if not r.diverged else f"{'div@' + str(r.diverged):>11}"
        )
        lines.append(
            f"{r.label:<36}{loss}{100 * r.test_accuracy:>8.1f}%"
            f"{r.bytes_sent:>12,.0f}{_ratio(base and base.bytes_sent, r.bytes_sent):>8}"
            f"{r.bytes_recv:>12,.0f}{r.ms_step:>9.2f}{speed:>8}{r.ms_comm:>9.2f}"
        )
    return "\n".join(lines)


def run_meta(job: str, args, argv, ranks: int, **more) -> dict:
    """Return results.json's ``meta``: the job, its ranks and command line (``argv``;
    None: ``sys.argv[1:]``), the options both jobs take, ``more``, the host and the MPI
    library."""
    from mpi4py import MPI

    return {
        "job": job,
        "ranks": ranks,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "momentum": args.momentum,
        "seed": args.seed,
        **more,
        "host": platform.node(),
        "mpi": MPI.Get_library_version().splitlines()[0],
    }


def write_results(out: str, results: list[Result], meta: dict) -> str:
    """Write ``results.json`` (every loss curve and measure) into ``out``; return its path."""
    path = os.path.join(out, "results.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "runs": [asdict(r) for r in results]}, f, indent=1)
    return path


def write_outputs(args, results: list[Result], meta: dict, title: str, trace: bool) -> None:
    """Write results.json and, unless --no-plot, loss.png titled ``title`` into --out;
    say what was written, the traces too (rank 0)."""
    print(f"\nwrote {write_results(args.out, results, meta)}")
    if not args.no_plot:
        png = os.path.join(args.out, "loss.png")
        plot(png, results, title)
        print(f"wrote {png}")
    if trace:
        print(f"wrote {len(results)} traces: {os.path.join(args.out, '<label>.h5')}")


def plot(path: str, results: list[Result], title: str) -> None:
    """Draw every run's training loss against the step, log y, into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    cmap = plt.get_cmap("tab20")
    for i, r in enumerate(results):
        if r.codec == "none" and not r.params:  # the baseline, drawn on top of the others
            ax.plot(r.loss_steps, r.losses, "-", color="black", lw=2.2, zorder=5, label=r.label)
            continue
        style = "-" if i < 10 else "--"
        ax.plot(r.loss_steps, r.losses, style, color=cmap(i % 20), lw=1.4, label=r.label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (whole training set)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
