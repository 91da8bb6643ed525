"""The data-parallel training loop of the comparison jobs, and their shared ``main``.

A job supplies a *model*: an object with ``names`` (parameter names, in order),
``grads(x, y, scale) -> (loss, [gradient per name])``, ``apply(averages, lr)`` (one
optimizer step with the averaged gradients) and ``params() -> {name: ndarray}`` (a
NumPy copy of the weights in ``jobs._mlp`` layout, to evaluate). Everything else,
sharding, averaging through ``CompressedComm``, timing, reporting, is here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import textwrap
import time
from collections.abc import Callable, Iterable

import numpy as np

import mpicomp
from jobs import _compare as cmp
from jobs import _mlp
from jobs._data import Digits, ShardSampler, batch_split, load_digits


class _Trainer:
    """One codec run: its model, its batches, its CompressedComm, what it measured."""

    def __init__(self, comm, run: cmp.Run, model, data, args, trace_path: str | None):
        self.comm, self.run, self.model, self.data, self.args = comm, run, model, data, args
        # every run draws the same batches: the same seed, a sampler of its own
        self.sampler = ShardSampler(len(data.y_train), args.batch, comm.rank, comm.size, args.seed)
        # The local mean gradient times this weight averages over ranks to the global
        # batch's mean, whatever the split (local batches differ by at most one sample).
        self.weight = comm.size * self.sampler.local / args.batch
        self.eval_every = max(1, args.steps // 100)
        self.snapshots = {0: model.params()}
        self.result = cmp.Result(run.label, run.codec, dict(run.params), args.steps, [], [])
        self.result.trace = trace_path
        self.t_step: list[float] = []
        self.t_comm: list[float] = []
        self.loss = float("nan")  # the last local batch loss, for progress lines
        self.cc, self.traffic = cmp.open_comm(comm, run, trace_path)

    @property
    def active(self) -> bool:
        return not self.result.diverged

    def close_on(self, stack: contextlib.ExitStack) -> None:
        stack.enter_context(self.cc)

    def step(self, step: int) -> None:
        """Take SGD step ``step`` (0-based); on NaN/Inf, mark the run diverged."""
        t0 = time.perf_counter()
        idx = self.sampler.next()
        x, y = self.data.x_train[idx], self.data.y_train[idx]
        with np.errstate(over="ignore", invalid="ignore"):  # divergence is caught below
            self.loss, grads = self.model.grads(x, y, self.weight)
        t1 = time.perf_counter()
        try:
            avg = self.cc.allreduce_many(grads, names=self.model.names)
        except (ValueError, RuntimeError):
            # Every rank raises in the same call (CompressedComm's agreement); it is
            # divergence when some rank's gradient overflowed, a bug otherwise.
            if not _any_rank(self.comm, not _finite(grads)):
                raise
            self.result.diverged = step + 1
            return
        t2 = time.perf_counter()
        self.model.apply(avg, cmp.cosine_lr(self.args.lr, step, self.args.steps))
        self.t_step.append(time.perf_counter() - t0)
        self.t_comm.append(t2 - t1)
        done = step + 1
        if done % self.eval_every == 0 or done == self.args.steps:
            self.snapshots[done] = self.model.params()
            if not _finite(self.snapshots[done].values()):  # the same weights on every rank
                self.result.diverged = done

    def finish(self) -> cmp.Result:
        """Score the snapshots, gather bytes and times over ranks; return the result."""
        r = self.result
        self.traffic.steps.clear()  # only the totals are needed from here
        r.loss_steps = list(self.snapshots)
        r.losses = _train_losses(self.comm, self.snapshots, self.data)
        cmp.summarize(self.comm, r, self.traffic, self.t_step, self.t_comm)
        r.final_train_loss = r.losses[-1]
        with np.errstate(over="ignore", invalid="ignore"):
            r.test_accuracy = _mlp.accuracy(self.model.params(), self.data.x_test, self.data.y_test)
        return r


def train_all(comm, runs: list[cmp.Run], make_model, data, args, trace: bool, say):
    """Train one fresh model per run, all runs in turn at every step (:func:`interleave`);
    return the results.

    The weights are kept every ``steps // 100`` steps and scored on the whole training
    set afterwards, outside the timed loop. A run stops early (``Result.diverged``) when a
    gradient or a weight becomes NaN/Inf.
    """
    trainers = (
        _Trainer(
            comm,
            run,
            make_model(args.sizes, args.seed, args.momentum),
            data,
            args,
            os.path.join(args.out, f"{run.label}.h5") if trace else None,
        )
        for run in runs
    )
    return interleave(trainers, args.steps, say)


def interleave(trainers: Iterable, steps: int, say) -> list:
    """Build the trainers, take ``steps`` steps of every one still active, all in turn at
    every step, and return each one's ``finish()``; say on the way which diverge and,
    every quarter of the steps, the batch losses.

    Interleaving the runs step by step puts every codec under the same machine load,
    so their step times compare even on a shared machine. A trainer has ``active``,
    ``step(step)``, ``loss`` (its last batch loss), ``result`` (its ``label`` and
    ``diverged``), ``finish()`` and ``close_on(stack)``, which puts on an ExitStack what
    must close before ``finish()``: leaving by an exception, nothing waits for a trace
    gather that could hang.
    """
    report_every = max(1, steps // 4)
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        running = []
        for t in trainers:  # built one by one: an error closes those built before
            t.close_on(stack)
            running.append(t)
        for step in range(steps):
            for t in running:
                if t.active:
                    t.step(step)
                    if not t.active:
                        say(f"  {t.result.label}: diverged at step {t.result.diverged} (NaN/Inf)")
            done = step + 1
            if done % report_every == 0 or done == steps:
                losses = ", ".join(f"{t.result.label} {t.loss:.3g}" for t in running if t.active)
                say(
                    textwrap.fill(
                        f"step {done}/{steps} ({time.perf_counter() - t_start:.0f} s), "
                        f"batch loss on rank 0: {losses}",
                        width=100,
                        subsequent_indent="    ",
                    )
                )
    return [t.finish() for t in running]


def _finite(arrays) -> bool:
    return all(bool(np.isfinite(np.asarray(a)).all()) for a in arrays)


def _any_rank(comm, flag: bool) -> bool:
    from mpi4py import MPI

    return bool(comm.allreduce(int(flag), op=MPI.MAX))


def _train_losses(comm, snapshots: dict, data) -> list[float]:
    """Return the whole-training-set loss of every snapshot (ranks share the work)."""
    steps = list(snapshots)
    mine = np.zeros(len(steps))
    for i in range(comm.rank, len(steps), comm.size):
        with np.errstate(over="ignore", invalid="ignore"):  # a diverged run's weights
            mine[i] = _mlp.loss(snapshots[steps[i]], data.x_train, data.y_train)
    total = np.empty_like(mine)
    comm.Allreduce(mine, total)
    return total.tolist()


def run_main(
    argv,
    prog: str,
    description: str,
    make_model: Callable,
    *,
    steps: int,
    lr: float,
    out: str,
    codecs: str | None = None,
) -> int:
    """Parse ``argv``, train one model per codec run, report on rank 0; return 0.

    Args:
        argv: the command line (None: ``sys.argv[1:]``).
        prog: the job's module name, for --help and the results.
        description: one line for --help.
        make_model: ``make_model(sizes, seed, momentum)`` returns a fresh model.
        steps, lr, out, codecs: defaults of --steps, --lr, --out and --codecs (None:
            every run of ``jobs._compare.RUNS``).
    """
    from mpi4py import MPI

    ap = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    cmp.add_common_args(ap, steps=steps, lr=lr, out=out, codecs=codecs)
    ap.add_argument(
        "--warmup",
        choices=["all", "rank", "off"],
        default="all",
        help="before training, compile every run's kernels through an all-reduce of all "
        "ranks (all), of each rank alone, sending nothing (rank: what only several ranks "
        "need then compiles in the first steps), or not at all (off)",
    )
    args = ap.parse_args(argv)
    cmp.check_args(args)
    comm = MPI.COMM_WORLD
    size = comm.size
    runs, say, data = prepare(comm, args)
    trace = not args.no_trace
    if trace and not cmp.supports_trace():
        say("note: this mpicomp's CompressedComm takes no trace=; running without traces")
        trace = False

    args.sizes = [data.n_features, *args.hidden, data.n_classes]
    say(
        f"{prog}: digits {len(data.y_train)} train / {len(data.y_test)} test, MLP "
        f"{'-'.join(map(str, args.sizes))}, {size} ranks, global batch {args.batch} "
        f"({batch_split(args.batch, size)} per rank), {args.steps} steps, "
        f"lr {args.lr} cosine, momentum {args.momentum}, seed {args.seed}"
    )
    # One BLAS thread per rank, as NUMBA_NUM_THREADS=1: ranks already share the cores,
    # and OpenBLAS threads spinning next to busy-polling MPI ranks slow everything.
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        if args.warmup != "off":
            _compile(comm if args.warmup == "all" else MPI.COMM_SELF, comm, runs, say)
        results = train_all(comm, runs, make_model, data, args, trace, say)
    if comm.rank == 0:
        _report(results, args, argv, prog, size, trace)
    comm.Barrier()  # rank 0's files are complete when main returns on any rank
    return 0


def prepare(comm, args) -> tuple[list[cmp.Run], Callable[[str], None], Digits]:
    """Return what a training job needs before it trains, every rank: the runs of
    --codecs, each codec made once (a bad name or parameter fails here, before any rank
    trains); ``say``, which prints on rank 0; the digits. Unless --no-plot, fail now
    when the plot cannot be drawn; make --out before any rank writes into it."""
    runs = cmp.parse_runs(args.codecs)
    for run in runs:
        mpicomp.codec(run.codec, **run.params)

    def say(msg: str) -> None:
        if comm.rank == 0:
            print(msg, flush=True)

    if not args.no_plot:
        cmp.require_matplotlib()
    data = load_digits()
    if comm.rank == 0:
        os.makedirs(args.out, exist_ok=True)
    comm.Barrier()  # the directory exists before any rank writes into it
    return runs, say, data


def _compile(on, comm, runs: list[cmp.Run], say) -> None:
    """Compile (or load) every run's kernels before training by all-reduces on ``on``
    (``comm``, or each rank alone: MPI.COMM_SELF), saying what takes long: one process
    of the host compiles each kernel, the others load it (kernels/numba_cache.py)."""
    from mpi4py import MPI

    from mpicomp import warmup

    warmup.log_compiles()
    start = time.perf_counter()
    say(
        f"compiling (or loading) the numba kernels of {len(runs)} runs (a minute or two on a first run)"
    )
    for run in runs:
        (seconds,) = warmup.warm([mpicomp.codec(run.codec, **run.params)], on).values()
        seconds = comm.allreduce(seconds, op=MPI.MAX)  # the slowest rank's
        say(f"  {run.label}: {seconds:.1f} s")
    say(f"kernels ready in {time.perf_counter() - start:.0f} s")


def _report(results, args, argv, prog: str, size: int, trace: bool) -> None:
    """Print the table and write results.json, loss.png (rank 0)."""
    print()
    print(cmp.table(results))
    meta = cmp.run_meta(prog, args, argv, size, sizes=args.sizes)
    title = f"{prog}: digits MLP {'-'.join(map(str, args.sizes))}, {size} ranks"
    cmp.write_outputs(args, results, meta, f"{title}, global batch {args.batch}", trace)
