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

from mpicomp.tools.bench import codec_set, parse_count
from mpicomp.tools.bench.allreduce import measure
from mpicomp.tools.bench.report import format_allreduce_table, mpi_library, print_json, title


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
        print_json(rows)
        return 0
    print(
        f"{title('all-reduce bench')}: {comm.size} ranks, {mpi_library()}, "
        f"{rows[0]['backend'] if rows else 'no'} kernels\n"
        f"time: the slowest rank's, median of {args.reps} calls after a warm-up; "
        "bytes: per rank per call (Traffic), the largest over ranks;\n"
        "'x ring' divides by the 2(N-1)/N*4n bytes a float32 ring all-reduce sends "
        "(and receives) per rank"
    )
    format_allreduce_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
