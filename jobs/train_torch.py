"""The training comparison with PyTorch: a CNN through ``mpicomp.torch.DistributedOptimizer``.

Every rank trains ``jobs._cnn.make_cnn(seed)`` (Conv-BN-ReLU, 9,978 parameters) on its
own shard of the digits training set; ``torch.optim.SGD(lr, momentum=0.9)`` is wrapped
in ``mpicomp.torch.DistributedOptimizer``, which averages the gradients through a
``CompressedComm`` while backward still runs (``--overlap on``), or all at once in
``step()`` (``--overlap off``). One run per codec (``--codecs``, the syntax of
jobs.train), every codec against float32 (``none``): the same initial weights (rank 0's,
broadcast by ``mpicomp.torch.broadcast_parameters``), the same shards and batches, the
same cosine learning-rate schedule, all runs interleaved step by step so that they
share the machine's load alike. Rank 0 prints a table (final training loss, test
accuracy, bytes per step, step time against ``none``) and writes results.json, loss.png
and one HDF5 trace per run into --out (default runs/train_torch). See docs/training.md.

Run: ``NUMBA_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m jobs.train_torch
[--codecs none,qsgd_maxnorm_bits4,threelc] [--overlap on|off|both] [--steps N]
[--out DIR]`` (``--help`` for all). Needs PyTorch: ``pip install 'mpicomp[torch]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from jobs import _compare as cmp
from jobs._loop import _any_rank, interleave, prepare

# The baseline and one codec of each kind: ring quantizers, 3LC, sign vote, sparsifier.
DEFAULT_CODECS = (
    "none,qsgd_maxnorm_bits4,qsgd_maxnorm_multiscale_bits2,threelc_sparsity1.0,signsgd,topk"
)
# Two buckets for the CNN (parameters in reverse order, as DDP): the classifier and the
# second BatchNorm (5,194 values), then the convolutions and the first BatchNorm
# (4,784). The first is reduced while backward computes the second's gradients.
DEFAULT_BUCKET_NUMEL = 8192
OVERLAP_MODES = {"on": (True,), "off": (False,), "both": (True, False)}


@dataclass
class TorchResult(cmp.Result):
    """``jobs._compare.Result`` and how the run averaged."""

    overlap: bool = True
    # max over ranks and parameters of |w_rank - w_rank0| at the end: 0.0 when every rank
    # holds the same weights, as data-parallel SGD must
    weight_spread: float = float("nan")


class _Trainer:
    """One run: a codec, an overlap mode, its model, optimizer, batches and measures."""

    def __init__(self, comm, run: cmp.Run, overlap: bool, label: str, data, args, trace):
        import torch

        from jobs._cnn import make_cnn
        from jobs._data import ShardSampler
        from mpicomp.collectives.traffic import Traffic
        from mpicomp.torch import DistributedOptimizer, broadcast_parameters

        self.torch, self.comm, self.run, self.data, self.args = torch, comm, run, data, args
        self.model = make_cnn(args.seed)
        # What a user does: every rank starts from rank 0's weights (and buffers).
        broadcast_parameters(self.model, comm, root=0)
        # lr is set before every step (cosine schedule); 0 here is a placeholder
        sgd = torch.optim.SGD(self.model.parameters(), lr=0.0, momentum=args.momentum)
        options = dict(run.params, bucket_numel=args.bucket_numel)
        if trace is not None:
            options["trace"] = trace
        self.opt = DistributedOptimizer(
            sgd, comm, self.model.named_parameters(), run.codec, overlap=overlap, **options
        )
        # The collectives hand every exchange to the recorder: bytes counted, not estimated.
        self.traffic = Traffic()
        self.opt.comm.recorder = self.traffic
        # every run draws the same batches: the same seed, a sampler of its own
        self.sampler = ShardSampler(len(data.y_train), args.batch, comm.rank, comm.size, args.seed)
        # The local mean gradient times this weight averages over ranks to the global
        # batch's mean, whatever the split (local batches differ by at most one sample).
        self.weight = comm.size * self.sampler.local / args.batch
        self.eval_every = max(1, args.steps // 50)
        self.snapshots = {0: self._state()}
        self.result = TorchResult(
            label, run.codec, dict(run.params), args.steps, [], [], overlap=overlap
        )
        self.result.trace = trace
        self.t_step: list[float] = []
        self.t_comm: list[float] = []
        self.loss = float("nan")  # the last local batch loss, for progress lines

    @property
    def active(self) -> bool:
        return not self.result.diverged

    def close_on(self, stack: contextlib.ExitStack) -> None:
        # LIFO: leaving by an exception, the CompressedComm closes first without its
        # final trace gather (other ranks may be elsewhere: it could hang); leaving
        # normally it writes the trace; then close() removes the hooks.
        stack.callback(self.opt.close)
        stack.enter_context(self.opt.comm)

    def _state(self) -> dict[str, np.ndarray]:
        """A NumPy copy of this rank's parameters and BatchNorm buffers."""
        return {k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()}

    def _params_finite(self) -> bool:
        # parameters only: they are the same on every rank, the BatchNorm buffers are not
        return all(bool(self.torch.isfinite(p).all()) for p in self.model.parameters())

    def step(self, step: int) -> None:
        """Take SGD step ``step`` (0-based); on NaN/Inf, mark the run diverged."""
        torch = self.torch
        t0 = time.perf_counter()
        idx = self.sampler.next()
        x, y = torch.from_numpy(self.data.x_train[idx]), torch.from_numpy(self.data.y_train[idx])
        for group in self.opt.param_groups:
            group["lr"] = cmp.cosine_lr(self.args.lr, step, self.args.steps)
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        (loss * self.weight).backward()  # with overlap, the gradient hooks start the buckets
        self.loss = float(loss.item())
        t1 = time.perf_counter()
        try:
            self.opt.step()  # waits for the reductions, writes the averages, steps SGD
        except (ValueError, RuntimeError):
            # Every rank raises in the same step (CompressedComm's agreement, nonfinite=
            # "raise"); it is divergence when some rank's gradient is NaN/Inf, a bug else.
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            local_bad = not all(bool(torch.isfinite(g).all()) for g in grads)
            if not _any_rank(self.comm, local_bad):
                raise
            self.result.diverged = step + 1
            return
        t2 = time.perf_counter()
        self.t_step.append(t2 - t0)
        self.t_comm.append(t2 - t1)
        done = step + 1
        if done % self.eval_every == 0 or done == self.args.steps:
            self.snapshots[done] = self._state()
            if not self._params_finite():  # the same weights on every rank: the same answer
                self.result.diverged = done

    def finish(self) -> TorchResult:
        """Score rank 0's snapshots, gather bytes, times and the weight spread."""
        r = self.result
        self.traffic.steps.clear()  # only the totals are needed from here
        r.weight_spread = _weight_spread(self.comm, self.model)
        # BatchNorm running statistics are each rank's own (they are buffers, not
        # gradients: nothing averages them). The job evaluates rank 0's model, its
        # weights and its running statistics, as a user who saves rank 0's checkpoint.
        snapshots = self.comm.bcast(self.snapshots if self.comm.rank == 0 else None, root=0)
        r.loss_steps = list(snapshots)
        r.losses = _train_losses(self.comm, snapshots, self.data, self.args.seed)
        cmp.summarize(self.comm, r, self.traffic, self.t_step, self.t_comm)
        r.final_train_loss = r.losses[-1]
        last = snapshots[r.loss_steps[-1]]
        r.test_accuracy = _evaluate(last, self.data.x_test, self.data.y_test, self.args.seed)[1]
        return r


def _evaluate(state: dict, x: np.ndarray, y: np.ndarray, seed: int) -> tuple[float, float]:
    """Return (mean cross-entropy, accuracy) of the CNN with ``state`` in eval mode."""
    import torch

    from jobs._cnn import make_cnn

    model = make_cnn(seed)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    model.eval()  # BatchNorm normalizes with the running statistics
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
        accuracy = (logits.argmax(dim=1) == torch.from_numpy(y)).double().mean()
    return float(loss), float(accuracy)


def _train_losses(comm, snapshots: dict, data, seed: int) -> list[float]:
    """Return the whole-training-set loss of every snapshot (ranks share the work)."""
    steps = list(snapshots)
    mine = np.zeros(len(steps))
    for i in range(comm.rank, len(steps), comm.size):
        mine[i] = _evaluate(snapshots[steps[i]], data.x_train, data.y_train, seed)[0]
    total = np.empty_like(mine)
    comm.Allreduce(mine, total)
    return total.tolist()


def _weight_spread(comm, model) -> float:
    """Return max over ranks of max |w - rank 0's w| over the parameters (0.0: identical)."""
    from mpi4py import MPI

    mine = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    root = mine.copy()
    comm.Bcast(root, root=0)
    local = 0.0
    if not np.array_equal(mine, root, equal_nan=True):
        with np.errstate(invalid="ignore"):  # a diverged run's inf - inf
            diff = np.abs(mine - root)
        local = float(np.max(np.where(np.isnan(diff), np.inf, diff)))
    return float(comm.allreduce(local, op=MPI.MAX))


def _parse(argv):
    ap = argparse.ArgumentParser(
        prog="jobs.train_torch",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cmp.add_common_args(
        ap,
        steps=300,
        lr=0.05,
        out=os.path.join("runs", "train_torch"),
        codecs=DEFAULT_CODECS,
        hidden=False,  # the CNN's widths are fixed
    )
    ap.add_argument(
        "--overlap",
        choices=sorted(OVERLAP_MODES),
        default="on",
        help="start each bucket's reduction during backward (on), in step() (off), or "
        "run every codec both ways (both: labels end in _overlap and _no-overlap)",
    )
    ap.add_argument(
        "--bucket-numel",
        type=int,
        default=DEFAULT_BUCKET_NUMEL,
        help="largest bucket, in values (the default cuts the CNN into two buckets)",
    )
    args = ap.parse_args(argv)
    if args.bucket_numel < 1:
        raise ValueError(f"--bucket-numel must be >= 1, got {args.bucket_numel!r}")
    cmp.check_args(args)
    return args


def main(argv=None) -> int:
    """Run the comparison on every rank of MPI.COMM_WORLD; return 0, or 2 without PyTorch."""
    try:
        import torch
    except ImportError:
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            print(
                "jobs.train_torch needs PyTorch: pip install 'mpicomp[torch]' "
                "(or run jobs.train, the NumPy version)",
                file=sys.stderr,
            )
        return 2
    from mpi4py import MPI

    from jobs._data import batch_split

    # One intra-op thread per rank: several ranks share the cores (as NUMBA_NUM_THREADS=1).
    torch.set_num_threads(1)
    args = _parse(argv)
    comm = MPI.COMM_WORLD
    size = comm.size
    runs, say, data = prepare(comm, args)
    modes = OVERLAP_MODES[args.overlap]
    # (run, overlap, label): each codec's modes side by side
    plan = [
        (run, ov, run.label + ("" if len(modes) == 1 else "_overlap" if ov else "_no-overlap"))
        for run in runs
        for ov in modes
    ]
    trace = not args.no_trace
    say(
        f"jobs.train_torch: digits {len(data.y_train)} train / {len(data.y_test)} test, "
        f"CNN (jobs/_cnn.py), {size} ranks, global batch {args.batch} "
        f"({batch_split(args.batch, size)} per rank), {args.steps} steps, lr {args.lr} "
        f"cosine, momentum {args.momentum}, seed {args.seed}, bucket_numel "
        f"{args.bucket_numel}, overlap {args.overlap}, torch {torch.__version__}"
    )
    results = _train_all(comm, plan, data, args, trace, say)
    if comm.rank == 0:
        _report(results, args, argv, size, trace)
    comm.Barrier()  # rank 0's files are complete when main returns on any rank
    return 0


def _train_all(comm, plan, data, args, trace: bool, say) -> list[TorchResult]:
    """Train one fresh model per (run, overlap), all in turn at every step
    (``jobs._loop.interleave``: the same machine load for every run)."""
    trainers = (
        _Trainer(
            comm,
            run,
            overlap,
            label,
            data,
            args,
            os.path.join(args.out, f"{label}.h5") if trace else None,
        )
        for run, overlap, label in plan
    )
    return interleave(trainers, args.steps, say)


def _report(results: list[TorchResult], args, argv, size: int, trace: bool) -> None:
    """Print the table(s) and write results.json, loss.png (rank 0)."""
    import torch

    modes = OVERLAP_MODES[args.overlap]
    for ov in modes:
        mine = [r for r in results if r.overlap == ov]
        if len(modes) > 1:  # one table per mode, headed by it: the codec labels fit the column
            suffix = "_overlap" if ov else "_no-overlap"
            mine = [replace(r, label=r.label.removesuffix(suffix)) for r in mine]
        mode = "on" if ov else "off"
        print(f"\noverlap {mode} (x base: against none with overlap {mode})")
        print(cmp.table(mine))
    spread = max(r.weight_spread for r in results)
    print(f"\nlargest difference of the final weights between ranks: {spread:g}")
    meta = cmp.run_meta(
        "jobs.train_torch",
        args,
        argv,
        size,
        model="jobs._cnn.make_cnn",
        overlap=args.overlap,
        bucket_numel=args.bucket_numel,
        evaluated="rank 0's model (its BatchNorm running statistics)",
        torch=torch.__version__,
    )
    title = f"jobs.train_torch: digits CNN, {size} ranks, global batch {args.batch}"
    cmp.write_outputs(args, results, meta, title, trace)


if __name__ == "__main__":
    sys.exit(main())
