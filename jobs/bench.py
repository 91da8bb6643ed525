"""All-reduce benchmark: every codec through CompressedComm against MPI_Allreduce of float32.

Launch with ``mpiexec -n N python -m mpi4py -m jobs.bench [--sizes 1M,25.6M] [--codecs
qsgd_maxnorm,threelc] [--reps 3] [--json]``. For each gradient size and codec, one
``CompressedComm(...).allreduce`` per repetition after a warm-up call: the time is the
slowest rank's, median over repetitions; the bytes are what a
``mpicomp.collectives.traffic.Traffic`` attached as ``tracer`` counted per call, the
largest over ranks. Both are compared with ``comm.Allreduce`` of the same float32
buffer in the same run: its time, and the 2(N-1)/N * 4n bytes a ring (bandwidth-optimal)
float32 all-reduce sends and receives per rank.
"""

from __future__ import annotations

import argparse
import sys
from time import perf_counter

import numpy as np
from mpi4py import MPI

import mpicomp
from mpicomp.bench import codec_set, gradient, label, parse_count
from mpicomp.collectives.traffic import Traffic


def slowest_median(comm, fn, reps: int) -> float:
    """Return the median over ``reps`` calls of the slowest rank's time of ``fn()``.

    One warm-up call first; a barrier before each timed call, so every rank starts together.
    """
    fn()
    times = np.empty(reps)
    for i in range(reps):
        comm.Barrier()
        t0 = perf_counter()
        fn()
        times[i] = perf_counter() - t0
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return float(np.median(slowest))


def measure(comm, numel: int, codecs, reps: int, progress=None) -> list[dict]:
    """Return one row per codec of all-reduces of ``numel`` float32 values on ``comm``.

    Args:
        comm: the communicator to benchmark on (every rank calls this).
        numel: elements of the gradient (each rank draws its own).
        codecs: (name, params) pairs, as ``mpicomp.bench.codec_set`` returns.
        reps: timed repetitions per measurement, after one warm-up.
        progress: a stream for one line per codec on rank 0 (None: silent).
    """
    n, size = numel, comm.size
    x = gradient(n, seed=comm.rank)
    out = np.empty_like(x)
    t_ref = slowest_median(comm, lambda: comm.Allreduce(x, out, op=MPI.SUM), reps)
    ring_bytes = 2 * (size - 1) * 4 * n // size  # float32 ring all-reduce, per rank
    rows = []
    for i, (name, params) in enumerate(codecs, 1):
        if progress is not None and comm.rank == 0:
            what = f"{name} {label(params)}".strip()
            print(f"bench: {n:,} elements, {what} ({i}/{len(codecs)})", file=progress, flush=True)
        with mpicomp.CompressedComm(comm, name, **params) as cc:
            traffic = Traffic()

            def call(cc=cc):
                cc.allreduce(x, name="grad")

            cc.tracer = traffic
            t = slowest_median(comm, call, reps)
        calls = reps + 1  # the warm-up call is traced too: bytes are a mean per call
        mine = np.array([traffic.sent, traffic.recv], dtype=np.float64) / calls
        most = np.empty_like(mine)
        comm.Allreduce(mine, most, op=MPI.MAX)
        sent, recv = (int(round(v)) for v in most)
        rows.append(
            {
                "numel": n,
                "nranks": size,
                "codec": name,
                "params": dict(params),
                "backend": "cpu",
                "time_s": t,
                "allreduce_s": t_ref,
                "time_ratio": t / t_ref,
                "bytes_sent": sent,
                "bytes_recv": recv,
                "allreduce_bytes": ring_bytes,
                "sent_ratio": sent / ring_bytes if ring_bytes else None,
                "recv_ratio": recv / ring_bytes if ring_bytes else None,
            }
        )
    return rows


def _table(rows: list[dict]) -> None:
    head = (
        f"{'elements':>12}  {'codec':<27}{'params':<13}{'time ms':>10}{'x Allreduce':>12}"
        f"{'sent B/rank':>14}{'x ring':>8}{'recv B/rank':>14}{'x ring':>8}"
    )
    print(head)
    print("-" * len(head))
    last = None
    for r in rows:
        if r["numel"] != last:
            last = r["numel"]
            ref = r["allreduce_bytes"]
            print(
                f"{r['numel']:>12,}  {'MPI_Allreduce float32':<40}{1e3 * r['allreduce_s']:>10.2f}"
                f"{1:>12.2f}{ref:>14,}{'1.00' if ref else '-':>8}{ref:>14,}"
                f"{'1.00' if ref else '-':>8}"
            )

        def ratio(v):
            return "-" if v is None else f"{v:.3f}"

        print(
            f"{r['numel']:>12,}  {r['codec']:<27}{label(r['params']):<13}"
            f"{1e3 * r['time_s']:>10.2f}{r['time_ratio']:>12.2f}"
            f"{r['bytes_sent']:>14,}{ratio(r['sent_ratio']):>8}"
            f"{r['bytes_recv']:>14,}{ratio(r['recv_ratio']):>8}"
        )


def main(argv=None) -> int:
    """Run the benchmark on MPI.COMM_WORLD; rank 0 prints a table or JSON."""
    ap = argparse.ArgumentParser(prog="jobs.bench", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes",
        default="1M,25.6M",
        help="comma-separated element counts (default 1M and ResNet-50's 25.6M)",
    )
    ap.add_argument("--codecs", default=None, help="comma-separated codec names (all)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (3)")
    ap.add_argument("--json", action="store_true", help="print a JSON list of rows on stdout")
    args = ap.parse_args(argv)
    try:
        sizes = [parse_count(s) for s in args.sizes.split(",") if s.strip()]
        names = [c.strip() for c in args.codecs.split(",") if c.strip()] if args.codecs else None
        codecs = codec_set(names)
    except ValueError as e:
        ap.error(str(e))
    if not sizes or min(sizes) < 1:
        ap.error(f"--sizes must be counts >= 1, got {args.sizes!r}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps!r}")

    comm = MPI.COMM_WORLD
    rows = []
    for n in sizes:
        rows += measure(comm, n, codecs, args.reps, progress=sys.stderr)
    if comm.rank != 0:
        return 0
    if args.json:
        import json

        print(json.dumps(rows, indent=1))
        return 0
    vendor, version = MPI.get_vendor()
    print(
        f"mpicomp {mpicomp.__version__} all-reduce bench: {comm.size} ranks, "
        f"{vendor} {'.'.join(map(str, version))}, cpu backend\n"
        f"time: the slowest rank's, median of {args.reps} calls after a warm-up; "
        "bytes: per rank per call (Traffic), the largest over ranks;\n"
        "'x ring' divides by the 2(N-1)/N*4n bytes a float32 ring all-reduce sends "
        "(and receives) per rank"
    )
    _table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
