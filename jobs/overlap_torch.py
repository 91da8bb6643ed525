"""Overlap benchmark with PyTorch: backward-only, all-reduce-only and overlapped steps.

Launch with ``mpiexec -n N python -m mpi4py -m jobs.overlap_torch [--params 10M]
[--layers 8] [--batch 64] [--codecs none,qsgd_maxnorm_bits4,threelc_sparsity1.0]
[--reps 5] [--torch-threads 1] [--json]``. The model is an MLP of ``--layers`` square
``Linear`` layers (width chosen to give about ``--params`` parameters) and a 10-class
head, on the CPU with ``torch.set_num_threads(--torch-threads)`` (0: torch's default, a
thread per core in every rank); each rank trains on a fixed batch of its own. For
each codec, in the same run, five timings of one step:

- ``forward``: the forward pass and loss alone (no communication);
- ``backward``: ``zero_grad``, forward, backward and the plain optimizer's step, no
  communication: the step's compute;
- ``allreduce``: ``DistributedOptimizer(overlap=False).synchronize()`` with the
  gradients already computed: the step's communication (copies into the buckets,
  encode, the collective, decode, the write-back);
- ``sequential``: forward, backward, then ``step()`` with ``overlap=False``;
- ``overlapped``: forward, backward, then ``step()`` with ``overlap=True`` (each
  bucket's reduction starts from the gradient hooks while backward still runs).

Times are the slowest rank's, median over ``--reps`` rounds after a warm-up round;
each round times the five one after another, so outside load weighs on all alike.
The table gives ``max(backward, allreduce)``, the overhead of the overlapped step
above it (ms, and as a fraction of it) and ``seq/ovl`` = sequential / overlapped.
``max`` is a floor, not quite reachable: no reduction starts before backward does,
so the forward pass hides nothing, the optimizer step waits for the last reduction,
and the last bucket (the first layers) is ready only when backward ends. When the
communication is the longer, expect about ``fwd + allreduce`` plus the optimizer
step and part of one bucket's reduction.

Reading it: on shared memory the reduction is CPU work (MPI's copies, the codec's
encode and decode) on the background thread, competing for the same cores as
backward, so overlapping saves little and costs some; on a slow link (``python -m
jobs.netem --overlap-torch``) the reduction mostly waits on the wire and that wait
hides behind backward.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from time import perf_counter

import numba
import numpy as np
import torch
from mpi4py import MPI

import mpicomp
import mpicomp.torch as mt
from jobs._compare import parse_runs
from jobs._report import heading, parse, print_table, show, usage_errors
from mpicomp.tools.bench import label, parse_count

CLASSES = 10
DEFAULT_CODECS = "none,qsgd_maxnorm_bits4,threelc_sparsity1.0"


def width_for(params: int, layers: int) -> int:
    """Return the width ``w`` whose MLP (``layers - 1`` square ``Linear(w, w)`` with bias
    and a ``Linear(w, 10)`` head) has the parameter count nearest ``params`` (w >= 1)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    square = layers - 1
    if square == 0:
        return max(1, round((params - CLASSES) / CLASSES))
    # square * (w^2 + w) + 10 w + 10 = params
    b = square + CLASSES
    w = (-b + math.sqrt(b * b + 4 * square * max(params - CLASSES, 0))) / (2 * square)
    return max(1, round(w))


def make_model(params: int, layers: int, seed: int = 0) -> torch.nn.Sequential:
    """Return the MLP of about ``params`` parameters (the same on every rank)."""
    w = width_for(params, layers)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        mods: list[torch.nn.Module] = []
        for _ in range(layers - 1):
            mods += [torch.nn.Linear(w, w), torch.nn.ReLU()]
        mods.append(torch.nn.Linear(w, CLASSES))
        return torch.nn.Sequential(*mods)


def _interleaved(comm, timings: dict, reps: int) -> dict[str, float]:
    """Time every function of ``timings`` once per round, one warm-up round then
    ``reps`` rounds (so that load from outside weighs on every timing alike); return
    each one's median over the rounds of the slowest rank's time.

    ``fn(start)`` does its untimed preparation, then calls ``start()`` (a barrier, then
    the clock starts) and does the timed work; the clock stops when it returns, or at
    the ``perf_counter()`` value it returns (what it does after that is not timed).
    """
    t0 = [0.0]

    def start() -> None:
        comm.Barrier()
        t0[0] = perf_counter()

    def once(fn) -> float:
        stop = fn(start)
        return (perf_counter() if stop is None else stop) - t0[0]

    for fn in timings.values():
        once(fn)
    times = np.array([[once(fn) for fn in timings.values()] for _ in range(reps)])
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return {k: float(t) for k, t in zip(timings, np.median(slowest, axis=0), strict=True)}


def _batch(comm, batch: int, width: int):
    """This rank's fixed batch: inputs (batch, width) and labels."""
    g = torch.Generator().manual_seed(1000 + comm.rank)
    return torch.randn(batch, width, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def _sgd(model) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def measure(
    comm,
    model: torch.nn.Module,
    codec: str,
    params: dict | None,
    batch: int,
    reps: int,
    bucket_numel: int | None = None,
) -> dict:
    """Time one training step of ``model`` five ways (see the module docstring).

    Args:
        comm: the communicator (every rank calls this with the same arguments).
        model: the model (its parameters move: plain SGD steps with a small rate).
        codec: the codec name; ``params`` its parameters (None: defaults).
        batch: samples per rank.
        reps: timed rounds (each times every kind of step once), after a warm-up round.
        bucket_numel: the DistributedOptimizer's bucket size (None: its default).

    Returns:
        A dict: ``ranks``, ``codec``, ``params`` (a label), ``model_params``, ``batch``,
        ``buckets``, ``t_forward``, ``t_backward``, ``t_allreduce``, ``t_sequential``,
        ``t_overlapped``, ``t_max`` (max of backward and allreduce), ``overhead_s``
        (overlapped - t_max), ``overhead`` (that over t_max), ``speedup`` (sequential
        / overlapped) and ``background`` (False: no MPI_THREAD_MULTIPLE, nothing
        overlapped). Seconds.
    """
    params = dict(params or {})
    options = dict(params)
    if bucket_numel is not None:
        options["bucket_numel"] = int(bucket_numel)
    width = next(m for m in model if isinstance(m, torch.nn.Linear)).in_features
    x, y = _batch(comm, batch, width)
    loss_fn = torch.nn.functional.cross_entropy

    twin = copy.deepcopy(model)  # the overlapped step's: its gradient hooks fire alone

    def forward(start):
        start()
        loss_fn(model(x), y)

    def compute(net, opt):
        def step(start):
            start()
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()

        return step

    def distributed(net, overlap: bool) -> mt.DistributedOptimizer:
        return mt.DistributedOptimizer(
            _sgd(net), comm, net.named_parameters(), codec, overlap=overlap, **options
        )

    plain = _sgd(model)
    sequential = distributed(model, overlap=False)
    try:
        overlapped = distributed(twin, overlap=True)
    except BaseException:
        sequential.close()
        raise

    def allreduce(start):
        sequential.zero_grad()
        loss_fn(model(x), y).backward()  # overlap=False: no reduction starts here
        start()
        sequential.synchronize()
        stop = perf_counter()
        sequential.step()  # synchronized already: the wrapped optimizer's step only
        return stop

    try:
        t = _interleaved(
            comm,
            {
                "forward": forward,
                "backward": compute(model, plain),
                "allreduce": allreduce,
                "sequential": compute(model, sequential),
                "overlapped": compute(twin, overlapped),
            },
            reps,
        )
        buckets = len(sequential._buckets)
        background = overlapped.comm.background
    finally:
        sequential.close()
        overlapped.close()
    t_forward, t_backward, t_allreduce = t["forward"], t["backward"], t["allreduce"]
    t_sequential, t_overlapped = t["sequential"], t["overlapped"]
    t_max = max(t_backward, t_allreduce)
    return {
        "ranks": comm.size,
        "codec": codec,
        "params": label(params),
        "model_params": sum(p.numel() for p in model.parameters()),
        "batch": batch,
        "buckets": buckets,
        "t_forward": t_forward,
        "t_backward": t_backward,
        "t_allreduce": t_allreduce,
        "t_sequential": t_sequential,
        "t_overlapped": t_overlapped,
        "t_max": t_max,
        "overhead_s": t_overlapped - t_max,
        "overhead": (t_overlapped - t_max) / t_max,
        "speedup": t_sequential / t_overlapped,
        "background": background,
    }


def format_table(rows: list[dict], out=None) -> None:
    """Print ``rows`` of :func:`measure` as a table (to stdout by default)."""
    head = (
        f"{'codec':<14}{'params':<12}{'fwd':>7}{'backward':>9}{'allreduce':>10}"
        f"{'sequential':>11}{'overlapped':>11}{'max(b,a)':>9}{'overhead':>9}{'':>7}"
        f"{'seq/ovl':>8}"
    )
    print_table(head, map(_line, rows), out)


def _line(r: dict) -> str:
    ms = {k: 1e3 * r[k] for k in r if k.startswith("t_") or k == "overhead_s"}
    return (
        f"{r['codec']:<14}{r['params']:<12}{ms['t_forward']:>7.1f}{ms['t_backward']:>9.1f}"
        f"{ms['t_allreduce']:>10.1f}{ms['t_sequential']:>11.1f}{ms['t_overlapped']:>11.1f}"
        f"{ms['t_max']:>9.1f}{ms['overhead_s']:>9.1f}{100 * r['overhead']:>+6.0f}%"
        f"{r['speedup']:>8.2f}"
        + ("" if r["background"] else "  (no MPI_THREAD_MULTIPLE: nothing overlapped)")
    )


def main(argv=None) -> int:
    """Run the benchmark on MPI.COMM_WORLD; rank 0 prints a table or JSON."""
    ap = argparse.ArgumentParser(prog="jobs.overlap_torch", description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="10M", help="model parameters, about (10M)")
    ap.add_argument("--layers", type=int, default=8, help="Linear layers, the head included (8)")
    ap.add_argument("--batch", type=int, default=64, help="samples per rank (64)")
    ap.add_argument(
        "--bucket-numel",
        default=None,
        help="DistributedOptimizer bucket size in elements (the CompressedComm default)",
    )
    ap.add_argument(
        "--codecs",
        default=DEFAULT_CODECS,
        help="comma list of labels (qsgd_maxnorm_bits4), codec names or "
        f"name:key=value entries, as jobs.train ({DEFAULT_CODECS})",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's intra-op threads per rank; 0: torch's default, one per core (1)",
    )
    args = parse(ap, argv, 5, "timed steps per measurement")
    with usage_errors(ap, TypeError):
        n_params = parse_count(args.params)
        bucket_numel = None if args.bucket_numel is None else parse_count(args.bucket_numel)
        runs = parse_runs(args.codecs)
        for r in runs:
            mpicomp.codec(r.codec, **r.params)  # unknown names and parameters fail here
    if n_params < 1 or args.layers < 1 or args.batch < 1:
        ap.error("--params, --layers and --batch must be >= 1")
    if args.torch_threads < 0:
        ap.error("--torch-threads must be >= 0 (0: torch's default)")
    if bucket_numel is not None and bucket_numel < 1:
        ap.error("--bucket-numel must be >= 1")

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)  # 1 by default: the ranks share the cores
    comm = MPI.COMM_WORLD
    model = make_model(n_params, args.layers)
    rows = []
    for r in runs:
        rows.append(measure(comm, model, r.codec, r.params, args.batch, args.reps, bucket_numel))
        if comm.rank == 0:
            print(f"overlap_torch: {r.label} done", file=sys.stderr, flush=True)
    r0 = rows[0]
    threads = [
        f"thread level {MPI.Query_thread()}",
        f"torch threads {torch.get_num_threads()}",
        f"numba threads {numba.get_num_threads()}",
    ]
    header = heading("overlap_torch bench", comm, *threads) + (
        f"\nMLP of {r0['model_params']:,} parameters ({args.layers} Linear layers), batch "
        f"{args.batch} per rank, {r0['buckets']} buckets; ms per step, the slowest rank's, "
        f"median of {args.reps} rounds after a warm-up\n"
        "backward: fwd+bwd+plain step, no communication; allreduce: synchronize() alone; "
        "overhead: overlapped - max(backward, allreduce)"
    )
    show(comm, rows, args.json, header, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
