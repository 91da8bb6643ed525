"""All-reduce benchmark: every codec through CompressedComm against MPI_Allreduce of float32.

Launch with ``mpiexec -n N python -m mpi4py -m jobs.bench [--sizes 1M,25.6M] [--codecs
qsgd_maxnorm,threelc] [--reps 3] [--json]``. For each gradient size and codec, one
``CompressedComm(...).allreduce`` per repetition after a warm-up call: the time is the
slowest rank's, median over repetitions; the bytes are what a
``mpicomp.collectives.traffic.Traffic`` attached as ``recorder`` counted per call, the
largest over ranks. Both are compared with ``comm.Allreduce`` of the same float32
buffer in the same run: its time, and the 2(N-1)/N * 4n bytes a ring (bandwidth-optimal)
float32 all-reduce sends and receives per rank.
"""

from __future__ import annotations

import argparse
import sys

from mpi4py import MPI

from jobs._report import heading, parse, show, usage_errors
from mpicomp.tools.bench import codec_set
from mpicomp.tools.bench.allreduce import measure
from mpicomp.tools.bench.report import format_allreduce_table
from mpicomp.tools.bench.workload import parse_counts


def main(argv=None) -> int:
    """Run the benchmark on MPI.COMM_WORLD; rank 0 prints a table or JSON."""
    ap = argparse.ArgumentParser(prog="jobs.bench", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes",
        default="1M,25.6M",
        help="comma-separated element counts (default 1M and ResNet-50's 25.6M)",
    )
    ap.add_argument("--codecs", default=None, help="comma-separated codec names (all)")
    args = parse(ap, argv, 3, "timed repetitions")
    with usage_errors(ap):
        sizes = parse_counts(args.sizes)
        names = [c.strip() for c in args.codecs.split(",") if c.strip()] if args.codecs else None
        codecs = codec_set(names)
    if not sizes or min(sizes) < 1:
        ap.error(f"--sizes must be counts >= 1, got {args.sizes!r}")

    comm = MPI.COMM_WORLD
    rows = []
    for n in sizes:
        rows += measure(comm, n, codecs, args.reps, progress=sys.stderr)
    kernels = f"{rows[0]['backend'] if rows else 'no'} kernels"
    header = heading("all-reduce bench", comm, kernels) + (
        f"\ntime: the slowest rank's, median of {args.reps} calls after a warm-up; "
        "bytes: per rank per call (Traffic), the largest over ranks;\n"
        "'x ring' divides by the 2(N-1)/N*4n bytes a float32 ring all-reduce sends "
        "(and receives) per rank"
    )
    show(comm, rows, args.json, header, format_allreduce_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
