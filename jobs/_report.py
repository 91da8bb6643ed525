"""What the benchmark jobs share: their --reps and --json, usage errors, a table of
fixed-width lines under its head and a rule, its heading, and rank 0's report of the rows every rank
measured (a JSON list with --json, else a header and the table)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterable

from mpicomp.tools.bench.report import mpi_library, print_json, title


def parse(ap: argparse.ArgumentParser, argv, reps: int, what: str) -> argparse.Namespace:
    """Add --reps (``what``, ``reps`` by default) and --json to ``ap``, and parse ``argv``
    (None: ``sys.argv[1:]``); a --reps under 1 is a usage error."""
    ap.add_argument("--reps", type=int, default=reps, help=f"{what} ({reps})")
    ap.add_argument("--json", action="store_true", help="print a JSON list of rows on stdout")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps!r}")
    return args


@contextlib.contextmanager
def usage_errors(ap: argparse.ArgumentParser, *also: type[Exception]):
    """Make a ValueError (or one of ``also``) raised in the block ``ap``'s usage error:
    its message and the usage, exit status 2."""
    try:
        yield
    except (ValueError, *also) as e:
        ap.error(str(e))


def heading(what: str, comm, *facts: str) -> str:
    """Return the first line of a benchmark job's report: ``mpicomp <version> <what>: N
    ranks, <MPI library>``, then ``facts``, comma-separated."""
    return ", ".join([f"{title(what)}: {comm.size} ranks", mpi_library(), *facts])


def print_table(head: str, lines: Iterable[str], out=None) -> None:
    """Print ``head``, a rule of dashes as wide, then ``lines`` (to stdout by default),
    each as soon as it is made: a generator that measures as it goes shows its rows one
    by one."""
    out = sys.stdout if out is None else out
    print(head, "-" * len(head), sep="\n", file=out, flush=True)
    for line in lines:
        print(line, file=out, flush=True)


def show(
    comm, rows: list[dict], as_json: bool, header: str, table: Callable[[list[dict]], None]
) -> None:
    """On rank 0 of ``comm``, print ``rows``: a JSON list alone on stdout (``as_json``),
    else ``header`` and ``table(rows)``; the other ranks print nothing."""
    if comm.rank != 0:
        return
    if as_json:
        print_json(rows)
        return
    print(header)
    table(rows)
