"""Overlap benchmark: a simulated backward pass with blocking vs nonblocking all-reduces.

Launch with ``mpiexec -n N python -m mpi4py -m jobs.overlap [--numel 4M] [--buckets 8]
[--codecs none,qsgd_maxnorm] [--reps 3] [--json]``. A backward pass produces ``buckets``
gradient buckets of ``numel`` float32 values, one after another; the "compute" of a
bucket is a float32 NumPy matmul (which releases the GIL) sized so that it takes about
as long as one bucket's all-reduce, measured first. Two schedules of the same work:

- sequential: compute bucket i, then ``allreduce`` it, for every i;
- overlapped: compute bucket i, ``iallreduce`` it and go on computing bucket i + 1
  while it runs; wait for every handle at the end.

Times are the slowest rank's, median over ``reps`` passes after a warm-up. The best the
overlapped schedule can do is ``max(compute, reduce) + min(one compute, one reduce)``
(the first compute and the last all-reduce have nothing to hide behind); that bound is
printed beside it. Overlap pays when the all-reduce waits on a link; on shared memory
the MPI copies, the encode/decode and the matmul compete for the same cores, so give
every rank at least two (``OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1`` and N at most
half the cores), or measure on an emulated link (``measure`` takes any communicator).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

import mpicomp
from jobs._report import heading, parse, print_table, show, usage_errors
from mpicomp.tools.bench import codec_set, gradient, label, parse_count
from mpicomp.tools.bench.allreduce import slowest_median

_MIN_SIDE, _MAX_SIDE = 16, 8192  # the matmul's side: from a few us to about a second


class Compute:
    """A stand-in for one bucket's backward compute: ``c = a @ b`` of side ``side``.

    Args:
        side: the square matrices' side (work grows as its cube).
    """

    def __init__(self, side: int):
        rng = np.random.default_rng(side)
        self.side = side
        self.a = rng.standard_normal((side, side), dtype=np.float32)
        self.b = rng.standard_normal((side, side), dtype=np.float32)
        self.c = np.empty((side, side), dtype=np.float32)

    def __call__(self) -> None:
        np.matmul(self.a, self.b, out=self.c)


def calibrate(comm, seconds: float, reps: int) -> Compute:
    """Return a ``Compute`` taking about ``seconds`` on the slowest rank (the same side everywhere)."""
    side = 256
    for _ in range(3):  # the cube law converges in a step or two; cache effects need more
        took = slowest_median(comm, Compute(side), reps)
        side = int(
            np.clip(round(side * (seconds / max(took, 1e-9)) ** (1 / 3)), _MIN_SIDE, _MAX_SIDE)
        )
    return Compute(int(comm.allreduce(side, op=MPI.MAX)))


def measure(comm, numel: int, codec: str, buckets: int, reps: int, params=None) -> dict:
    """Time a simulated backward pass of ``buckets`` buckets, sequential and overlapped.

    Args:
        comm: the communicator (every rank calls this).
        numel: float32 elements of each bucket's gradient.
        codec: the codec name; ``params`` its parameters (None: defaults).
        buckets: gradient buckets per pass (>= 1).
        reps: timed passes per schedule, after one warm-up each.

    Returns:
        A dict: ``ranks``, ``codec``, ``params``, ``numel``, ``buckets``, ``side`` (the
        matmul's), ``t_compute`` and ``t_reduce`` (one bucket), ``t_sequential``,
        ``t_overlapped`` and ``t_bound`` (one pass; the bound is the best overlap can
        do), ``saving`` (1 - overlapped / sequential), ``bound_saving``, ``background``
        (False: MPI lacks MPI_THREAD_MULTIPLE and nothing overlaps). Seconds.
    """
    params = dict(params or {})
    grads = [gradient(numel, seed=1000 * comm.rank + i) for i in range(buckets)]
    names = [f"bucket{i}" for i in range(buckets)]
    with mpicomp.CompressedComm(comm, codec, **params) as cc:
        t_reduce = slowest_median(comm, lambda: cc.allreduce(grads[0], name=names[0]), reps)
        compute = calibrate(comm, t_reduce, reps)
        t_compute = slowest_median(comm, compute, reps)

        def sequential():
            for g, n in zip(grads, names, strict=True):
                compute()
                cc.allreduce(g, name=n)

        def overlapped():
            handles = []
            for g, n in zip(grads, names, strict=True):
                compute()  # runs while the buckets started before are reduced
                handles.append(cc.iallreduce(g, name=n))
            for h in handles:
                h.wait()

        t_seq = slowest_median(comm, sequential, reps)
        t_ovl = slowest_median(comm, overlapped, reps)
        background = cc.background
    t_bound = max(t_compute, t_reduce) * buckets + min(t_compute, t_reduce)
    return {
        "ranks": comm.size,
        "codec": codec,
        "params": label(params),
        "numel": numel,
        "buckets": buckets,
        "side": compute.side,
        "t_compute": t_compute,
        "t_reduce": t_reduce,
        "t_sequential": t_seq,
        "t_overlapped": t_ovl,
        "t_bound": t_bound,
        "saving": 1 - t_ovl / t_seq,
        "bound_saving": 1 - t_bound / t_seq,
        "background": background,
    }


def format_table(rows: list[dict], out=None) -> None:
    """Print ``rows`` of :func:`measure` as a table (to stdout by default)."""
    head = (
        f"{'codec':<26}{'params':<12}{'numel':>10}{'bkts':>5}{'compute':>9}{'reduce':>9}"
        f"{'sequential':>11}{'overlapped':>11}{'bound':>9}{'saving':>8}{'bound':>7}"
    )
    print_table(head, map(_line, rows), out)


def _line(r: dict) -> str:
    ms = {k: 1e3 * r[k] for k in ("t_compute", "t_reduce", "t_sequential", "t_overlapped")}
    return (
        f"{r['codec']:<26}{r['params']:<12}{r['numel']:>10}{r['buckets']:>5}"
        f"{ms['t_compute']:>9.2f}{ms['t_reduce']:>9.2f}{ms['t_sequential']:>11.2f}"
        f"{ms['t_overlapped']:>11.2f}{1e3 * r['t_bound']:>9.2f}"
        f"{100 * r['saving']:>7.1f}%{100 * r['bound_saving']:>6.1f}%"
        + ("" if r["background"] else "  (no MPI_THREAD_MULTIPLE: ran eagerly)")
    )


def main(argv=None) -> int:
    """Run the benchmark on MPI.COMM_WORLD; rank 0 prints a table or JSON."""
    ap = argparse.ArgumentParser(prog="jobs.overlap", description=__doc__.splitlines()[0])
    ap.add_argument("--numel", default="4M", help="elements per bucket (4M)")
    ap.add_argument("--buckets", type=int, default=8, help="buckets per backward pass (8)")
    ap.add_argument(
        "--codecs", default="none,qsgd_maxnorm,threelc", help="comma-separated codec names"
    )
    args = parse(ap, argv, 3, "timed passes per schedule")
    with usage_errors(ap):
        numel = parse_count(args.numel)
        codecs = codec_set([c.strip() for c in args.codecs.split(",") if c.strip()])
    if numel < 1:
        ap.error(f"--numel must be >= 1, got {args.numel!r}")
    if args.buckets < 1:
        ap.error(f"--buckets must be >= 1, got {args.buckets!r}")

    comm = MPI.COMM_WORLD
    rows = []
    for name, params in codecs:
        rows.append(measure(comm, numel, name, args.buckets, args.reps, params))
        if comm.rank == 0:
            print(f"overlap: {name} {label(params)} done", file=sys.stderr, flush=True)
    header = heading("overlap bench", comm, f"thread level {MPI.Query_thread()}") + (
        f"\nms per backward pass of {args.buckets} buckets (compute: one matmul sized to one "
        "bucket's all-reduce); the slowest rank's, median of "
        f"{args.reps} passes after a warm-up; 'bound': max(compute, reduce) + one bucket"
    )
    show(comm, rows, args.json, header, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
