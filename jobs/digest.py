"""Digests of what every codec and schedule returns: one line per (codec, schedule), the
SHA-256 of every average a few calls return on this rank, the same on every rank.

What a change that must not move a byte is checked against (a restructure, a refactor of
a collective): run it before and after, at a few rank counts, and compare the output.
Run: ``mpiexec -n N python -m mpi4py -m jobs.digest [--numel N] [--steps S]``.
Hierarchical schedules run at 4 ranks or more in an even number, as hosts of two ranks
(``local_comm``); ``"auto"`` is left out (it depends on this machine's measured speeds).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np
from mpi4py import MPI

import mpicomp
from mpicomp.reduction import schedule_names

# Codecs whose error feedback can be turned off: digested both ways.
FEEDBACK = ("topk", "threelc")


def digest(comm, name: str, schedule: str, numel: int, steps: int, **options) -> str:
    """Return the SHA-256 of the averages of ``steps`` calls: an ``allreduce`` of
    ``numel`` elements and an ``allreduce_many`` of three tensors, each step's inputs
    drawn from (step, rank)."""
    h = hashlib.sha256()
    with mpicomp.CompressedComm(comm, name, schedule=schedule, min_numel=16, **options) as cc:
        for step in range(steps):
            rng = np.random.default_rng(1000 * step + comm.rank)
            x = rng.standard_normal(numel).astype(np.float32)
            tensors = [rng.standard_normal(s).astype(np.float32) for s in ((30, 40), 100, numel)]
            h.update(np.ascontiguousarray(cc.allreduce(x, name="x")).tobytes())
            for out in cc.allreduce_many(tensors, names=["y", "z", "x2"]):
                h.update(np.ascontiguousarray(out).tobytes())
    return h.hexdigest()[:16]


def digests(comm, numel: int = 5000, steps: int = 3) -> dict[str, str]:
    """Return {"codec/schedule[/no feedback]": digest} for every codec and schedule that
    runs on ``comm``."""
    hosts = comm.size >= 4 and comm.size % 2 == 0
    out = {}
    for name in mpicomp.codecs.available():
        for schedule in schedule_names(mpicomp.codec(name)):
            if schedule == "auto" or (schedule.startswith("hier:") and not hosts):
                continue
            options = {}
            if schedule.startswith("hier:"):
                options["local_comm"] = comm.Split(comm.rank // 2, comm.rank)
            try:
                for feedback in (None, False) if name in FEEDBACK else (None,):
                    key = f"{name}/{schedule}" + ("/no feedback" if feedback is False else "")
                    out[key] = digest(
                        comm, name, schedule, numel, steps, error_feedback=feedback, **options
                    )
            finally:
                if "local_comm" in options:
                    options["local_comm"].Free()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.digest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=5000, help="elements of the larger tensors (5000)")
    ap.add_argument("--steps", type=int, default=3, help="calls per codec and schedule (3)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    mine = digests(comm, args.numel, args.steps)
    every = comm.gather(mine)
    if comm.rank == 0:
        for key, value in mine.items():
            differ = {d[key] for d in every} != {value}
            print(f"{key} {value}" + ("  RANKS DIFFER" if differ else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
