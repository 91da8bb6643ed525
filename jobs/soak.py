"""Soak: many all-reduces through CompressedComm; memory must not grow, results must not drift.

Launch with ``mpiexec -n 4 python -m mpi4py -m jobs.soak [--small 10000] [--large 200]
[--codecs threelc,topk] [--small-numel 1000,2500,4096,10000] [--large-numel 1M]``.
The small and large calls are shared round-robin among the codecs, each codec on one
CompressedComm kept open throughout (its defaults: names, error feedback where default).
After a warm-up (every codec, every size, three times; large twice), each rank records its resident set
(/proc/self/statm) and what tracemalloc holds; at the end it records them again. A fixed
input is reduced right after the warm-up and again at the end from the same saved
state (``state_dict`` / ``load_state_dict``: same step, same residuals), and the two
results must be the same bits. Exits 1 when memory grew past the bound or a result changed.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tracemalloc
from time import perf_counter

import numpy as np
from mpi4py import MPI

import mpicomp
from mpicomp.tools.bench import parse_count

# Growth allowed between warm-up and end: allocator slack, not a leak per call.
RSS_SLACK = 32 << 20
TRACED_SLACK = 1 << 20


def rss_bytes() -> int:
    """Return this process's resident set size in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _inputs(numel: int, rank: int, count: int = 3) -> list[np.ndarray]:
    # A few inputs per size, reused: making 1M random values per call would dominate.
    rng = np.random.default_rng([numel, rank])
    return [(rng.standard_normal(numel) * 1e-3).astype(np.float32) for _ in range(count)]


class Soak:
    """One CompressedComm per codec, driven through a fixed schedule of calls."""

    def __init__(self, comm, codecs: list[str], small_numel: list[int], large_numel: int):
        self.comm = comm
        self.codecs = codecs
        self.comms = {c: mpicomp.CompressedComm(comm, c) for c in codecs}
        self.small = {n: _inputs(n, comm.rank) for n in small_numel}
        self.large = _inputs(large_numel, comm.rank, 2)
        self.fixed = _inputs(4096, comm.rank, 1)[0]
        self.calls = {c: [0, 0] for c in codecs}
        self.seconds = dict.fromkeys(codecs, 0.0)
        self.saved: dict = {}
        self.first: dict = {}

    def small_call(self, i: int) -> None:
        """Make small call ``i``: codec and size round-robin, input from the pool."""
        codec = self.codecs[i % len(self.codecs)]
        sizes = list(self.small)
        numel = sizes[(i // len(self.codecs)) % len(sizes)]
        x = self.small[numel][i % len(self.small[numel])]
        self._call(codec, x, f"small{numel}", 0)

    def large_call(self, i: int) -> None:
        """Make large call ``i`` with the next codec."""
        codec = self.codecs[i % len(self.codecs)]
        self._call(codec, self.large[i % len(self.large)], "large", 1)

    def _call(self, codec: str, x: np.ndarray, name: str, kind: int) -> None:
        t0 = perf_counter()
        out = self.comms[codec].allreduce(x, name=name)
        self.seconds[codec] += perf_counter() - t0
        self.calls[codec][kind] += 1
        if out.shape != x.shape or not np.all(np.isfinite(out)):
            raise RuntimeError(f"soak: {codec} returned a wrong or non-finite result for {name!r}")

    def fixed_result(self, codec: str, save: bool) -> bytes:
        """Return the bits of the fixed input's average from the saved state (saving it first)."""
        cc = self.comms[codec]
        if save:
            self.saved[codec] = copy.deepcopy(cc.state_dict())
        else:
            cc.load_state_dict(copy.deepcopy(self.saved[codec]))
        return cc.allreduce(self.fixed, name="fixed").tobytes()

    def close(self) -> None:
        """Close every CompressedComm."""
        for cc in self.comms.values():
            cc.close()


def parse_args(argv=None) -> argparse.Namespace:
    """Return the command-line options."""
    p = argparse.ArgumentParser(prog="jobs.soak", description=__doc__.split("\n")[0])
    p.add_argument("--small", type=int, default=10000, help="small all-reduces in all")
    p.add_argument("--large", type=int, default=200, help="large all-reduces in all")
    p.add_argument("--codecs", default="all", help="comma-separated names, or all")
    p.add_argument("--small-numel", default="1000,2500,4096,10000", help="sizes of small calls")
    p.add_argument("--large-numel", default="1M", help="size of large calls (K/M suffixes)")
    p.add_argument("--no-tracemalloc", action="store_true", help="RSS only (faster)")
    args = p.parse_args(argv)
    if args.small < 0 or args.large < 0:
        raise ValueError(f"--small and --large must be >= 0, got {args.small} and {args.large}")
    return args


def run(comm, args) -> dict:
    """Run the soak on ``comm``; return this rank's figures."""
    codecs = mpicomp.codecs.available() if args.codecs == "all" else args.codecs.split(",")
    small_numel = [parse_count(s) for s in args.small_numel.split(",")]
    soak = Soak(comm, codecs, small_numel, parse_count(args.large_numel))
    if not args.no_tracemalloc:
        tracemalloc.start()
    t_start = perf_counter()
    try:
        # Three rounds of every size and two large calls per codec: buffers made on a
        # tensor's second use (spares) and bounded caches (GlobalRandK coordinates) fill here.
        warm, warm_large = len(codecs) * len(small_numel) * 3, len(codecs) * 2
        for i in range(warm):
            soak.small_call(i)
        for i in range(warm_large):
            soak.large_call(i)
        first = {c: soak.fixed_result(c, save=True) for c in codecs}
        rss0 = rss_bytes()
        traced0 = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0
        every = max(1, args.small // max(1, args.large))
        large_done = 0
        for i in range(args.small):
            soak.small_call(warm + i)
            if large_done < args.large and i % every == every - 1:
                soak.large_call(warm_large + large_done)
                large_done += 1
        while large_done < args.large:
            soak.large_call(warm_large + large_done)
            large_done += 1
        rss1 = rss_bytes()
        traced1 = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0
        same = {c: soak.fixed_result(c, save=False) == first[c] for c in codecs}
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        soak.close()
    return {
        "rank": comm.rank,
        "rss_warm": rss0,
        "rss_end": rss1,
        "traced_warm": traced0,
        "traced_end": traced1,
        "same": same,
        "calls": soak.calls,
        "seconds": soak.seconds,
        "wall": perf_counter() - t_start,
        "warmup_calls": warm + warm_large,
    }


def verdict(r: dict, tracing: bool) -> list[str]:
    """Return what went wrong on one rank (empty when nothing did)."""
    bad = []
    if r["rss_end"] - r["rss_warm"] > RSS_SLACK:
        bad.append(f"rank {r['rank']}: RSS grew by {(r['rss_end'] - r['rss_warm']) >> 20} MiB")
    if tracing and r["traced_end"] - r["traced_warm"] > TRACED_SLACK:
        grew = (r["traced_end"] - r["traced_warm"]) >> 10
        bad.append(f"rank {r['rank']}: traced Python memory grew by {grew} KiB")
    bad += [f"rank {r['rank']}: {c} result changed" for c, ok in r["same"].items() if not ok]
    return bad


def main(argv=None) -> int:
    """Run the soak on MPI.COMM_WORLD and print the summary on rank 0; return the exit code."""
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    mine = run(comm, args)
    every = comm.gather(mine, root=0)
    if comm.rank != 0:
        return 0
    tracing = not args.no_tracemalloc
    first = every[0]
    print(f"soak on {comm.size} ranks: {args.small} small + {args.large} large all-reduces, "
          f"after {first['warmup_calls']} warm-up calls; {first['wall']:.1f} s")  # fmt: skip
    print(f"{'codec':<28}{'small':>7}{'large':>7}{'s/rank':>9}  same bits")
    for c, (ns, nl) in first["calls"].items():
        same = all(r["same"][c] for r in every)
        print(f"{c:<28}{ns:>7}{nl:>7}{first['seconds'][c]:>9.2f}  {'yes' if same else 'NO'}")
    print(
        f"{'rank':<6}{'RSS warm MiB':>14}{'RSS end MiB':>13}{'traced warm KiB':>17}{'traced end KiB':>16}"
    )
    for r in every:
        print(
            f"{r['rank']:<6}{r['rss_warm'] / 2**20:>14.1f}{r['rss_end'] / 2**20:>13.1f}"
            f"{r['traced_warm'] / 2**10:>17.1f}{r['traced_end'] / 2**10:>16.1f}"
        )
    bad = [b for r in every for b in verdict(r, tracing)]
    print("\n".join(bad) if bad else "soak: no memory growth, no change in results")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
