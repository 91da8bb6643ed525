"""signSGD's majority vote three ways, same run: bytes per rank and time of each.

Launch with ``mpiexec -n N python -m mpi4py -m jobs.signsgd_compare [--numel 25.6M]
[--reps 5] [--json]``. Every rank draws a float32 gradient; each scheme turns it into the
majority of the ranks' signs, as packed bits (LSB-first, ceil(n/8) bytes) on every rank:

- ``ring``: the all-reducible signSGD paper, ``ring_allreduce_bounded(majority=True)``:
  votes summed around a ring at ceil(log2(i+1)) bits per element in reduce-scatter step i, the owner decides its
  chunk, the decisions travel back at 1 bit per element.
- ``allgather``: every rank's packed signs to every rank (``allgather_bytes_ring``), then
  every rank counts the N sign vectors and decides the whole vector itself.
- ``allgatherv``: the same through MPI's ``Allgatherv`` (``allgather_bytes``).
- ``alltoall_allgather``: 1-bit Adam's compressed all-reduce (Tang et al. 2021): chunk c of
  every rank's packed signs to rank c (``alltoall_bytes``), the owner counts and decides
  its chunk, 1 bit per element again, and an allgather (``allgather_bytes_ring``) of the
  decided chunks.

All four use the library's tie rule: bit = 1 where 2*count > N, so a tie (even N) gives 0,
i.e. -1 (``majority=True``; ``mpicomp_signsgd_majority`` with ``TIE_NEGATIVE``), and all
four are checked against a NumPy majority of the ranks' signs (counted by a plain
``Allreduce``). Chunks are the ring's: C = 8*ceil(n/(8N)) elements, so they fall on bytes.

Time: from the float32 gradient to the decision bits (the sign packing included), the
slowest rank's, median of ``reps`` calls after a warm-up. Bytes: what a ``Traffic`` recorder
counted in the warm-up call (size exchanges included; collectives done by one MPI call
count the logical bytes), the largest over ranks, beside the exact formula.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import numba as nb
import numpy as np
from mpi4py import MPI

from jobs._report import parse, print_table, show, usage_errors
from mpicomp.collectives.allgather import allgather_bytes, allgather_bytes_ring
from mpicomp.collectives.ring import ring_allreduce_bounded
from mpicomp.collectives.sharded import alltoall_bytes
from mpicomp.collectives.traffic import Traffic
from mpicomp.kernels import backend
from mpicomp.kernels.numba_cache import guard
from mpicomp.kernels.signsgd import TIE_NEGATIVE
from mpicomp.tools.bench import gradient
from mpicomp.tools.bench.allreduce import slowest_median
from mpicomp.tools.bench.report import mpi_library
from mpicomp.tools.bench.workload import parse_counts

#: The schemes, in the order the table prints them.
SCHEMES = ("ring", "allgather", "allgatherv", "alltoall_allgather")

#: Vote counts live in one byte per element: at most this many ranks.
MAX_RANKS = 255

# B = ceil(n/8) bytes of packed signs; L_c elements and B_c = ceil(L_c/8) bytes in chunk c.
FORMULAS = {
    "ring": "sum_{i<N} ceil(L*ceil(log2(i+1))/8) + (N-1)*ceil(L/8) per neighbour chunk L; "
    "~ n/(8N) * (sum_{i<N} ceil(log2(i+1)) + N-1)",
    "allgather": "sent 8 + (N-1)*B, recv 8(N-1) + (N-1)*B",
    "allgatherv": "sent 8 + B (logical), recv 8(N-1) + (N-1)*B",
    "alltoall_allgather": "push: sent 8(N-1) + B - B_r, recv 8(N-1) + (N-1)*B_r; "
    "pull: sent 8 + B - B_{r+1}, recv 8(N-1) + B - B_r; ~ 2(N-1)/N * n/8",
}


def _spread_table() -> np.ndarray:
    """Return T[v]: the 8 bits of byte v spread to one byte lane each, as a uint64.

    Lane k (element k of the byte) is byte k of the uint64 in memory, on either byte order.
    """
    v = np.arange(256, dtype=np.uint64)
    lane = [8 * k if sys.byteorder == "little" else 8 * (7 - k) for k in range(8)]
    return np.bitwise_or.reduce(
        [((v >> np.uint64(k)) & np.uint64(1)) << np.uint64(lane[k]) for k in range(8)]
    )


_SPREAD = _spread_table()


@nb.njit(parallel=True, cache=True, nogil=True)
def count_votes(rows, spread, lanes):
    """Write lanes[b] = the vote counts of elements 8b..8b+7, one byte each.

    Args:
        rows: uint8 (R, m): R packed sign vectors (bit i = vote of element i).
        spread: ``_SPREAD``.
        lanes: uint64 (m,): the counts; R <= 255, so a lane never carries into the next.
    """
    nrows, m = rows.shape
    for b in nb.prange(m):
        acc = np.uint64(0)
        for r in range(nrows):
            acc += spread[rows[r, b]]
        lanes[b] = acc


def decide(rows: np.ndarray, nelem: int, nranks: int) -> np.ndarray:
    """Return the majority bits of ``nelem`` elements from the ranks' packed signs.

    Args:
        rows: uint8 (nranks, ceil(nelem/8)), one packed sign vector per rank.
        nelem: elements in each vector.
        nranks: ranks that voted (the rows).

    Returns:
        uint8, ceil(nelem/8) bytes: bit = 1 where 2*count > nranks (ties give 0), the rule
        of ``ring_allreduce_bounded(majority=True)``.

    Raises:
        ValueError: more than ``MAX_RANKS`` ranks.
    """
    if nranks > MAX_RANKS:
        raise ValueError(f"decide: counts are one byte: at most {MAX_RANKS} ranks, got {nranks}")
    lanes = np.empty(rows.shape[1], dtype=np.uint64)
    count_votes(rows, _SPREAD, lanes)
    out = np.empty((nelem + 7) // 8, dtype=np.uint8)
    # int64 counts and these argument types are the library's own call: one compiled
    # signature. A second signature of a cached kernel, compiled in a process that loaded
    # the first from numba's cache, can clash with it (numba #10128) and crash.
    counts = lanes.view(np.uint8)[:nelem].astype(np.int64)
    backend().signsgd.majority(counts, nranks, TIE_NEGATIVE, np.uint64(0), 0, out)
    return out


# --- inputs and layout ----------------------------------------------------------------------


def votes(x: np.ndarray) -> np.ndarray:
    """Return one uint8 vote per element: 1 where x > 0, else 0 (the ring's input)."""
    out = np.empty(x.size, dtype=np.uint8)
    if not backend().signsgd.votes(x, out):
        raise ValueError("signsgd_compare: the gradient holds NaN or Inf")
    return out


def signs(x: np.ndarray) -> np.ndarray:
    """Return the votes of ``x`` packed 8 per byte, LSB-first (the allgathers' input)."""
    out = np.empty((x.size + 7) // 8, dtype=np.uint8)
    if not backend().signsgd.pack(x, out):
        raise ValueError("signsgd_compare: the gradient holds NaN or Inf")
    return out


def chunks(n: int, nranks: int) -> list[tuple[int, int]]:
    """Return the ring's chunks [lo, hi): C = 8*ceil(n/(8N)) elements, so lo is a whole byte."""
    C = 8 * -(-n // (8 * nranks))
    return [(min(n, c * C), min(n, (c + 1) * C)) for c in range(nranks)]


def _joined(views: list[np.ndarray]) -> np.ndarray:
    """Return ``views`` as one 1-D array: a view when they lie end to end in one buffer, as
    the library's collectives return them; otherwise a copy."""
    total = sum(v.size for v in views)
    base = views[0].base if views else None
    if total and isinstance(base, np.ndarray) and base.dtype == np.uint8 and base.ndim == 1:
        start = views[0].ctypes.data
        at = start
        for v in views:
            if v.size and v.ctypes.data != at:
                break
            at += v.size
        else:
            offset = start - base.ctypes.data
            if 0 <= offset and offset + total <= base.size:
                return base[offset : offset + total]
    return np.concatenate(views) if views else np.empty(0, dtype=np.uint8)


# --- the schemes: gradient in, packed majority bits out, the same on every rank ------------


def by_ring(comm, x: np.ndarray, recorder=None) -> np.ndarray:
    """Majority through the all-reducible signSGD paper's width-growing ring."""
    return ring_allreduce_bounded(comm, votes(x), 1, majority=True, signed=False, recorder=recorder)


def by_allgather(comm, x: np.ndarray, recorder=None, *, library: bool = False) -> np.ndarray:
    """Majority from every rank's packed signs, gathered on every rank (hand ring, or
    MPI's ``Allgatherv`` with ``library``); every rank decides the whole vector."""
    packed = signs(x)
    gather = allgather_bytes if library else allgather_bytes_ring
    rows = _joined(gather(comm, packed, recorder=recorder)).reshape(comm.size, packed.size)
    return decide(rows, x.size, comm.size)


def by_alltoall_allgather(comm, x: np.ndarray, recorder=None) -> np.ndarray:
    """Majority as 1-bit Adam reduces: alltoall of the signs' chunks, owner decides, allgather."""
    packed = signs(x)
    bounds = chunks(x.size, comm.size)
    # Byte ceil of both ends: lo is a multiple of 8 or n (an empty chunk at the end).
    parts = [packed[-(-lo // 8) : -(-hi // 8)] for lo, hi in bounds]
    pushed = alltoall_bytes(comm, parts, recorder=recorder)
    lo, hi = bounds[comm.rank]
    mine = decide(_joined(pushed).reshape(comm.size, parts[comm.rank].size), hi - lo, comm.size)
    return _joined(allgather_bytes_ring(comm, mine, recorder=recorder))


_RUN: dict[str, Callable] = {
    "ring": by_ring,
    "allgather": by_allgather,
    "allgatherv": lambda comm, x, recorder=None: by_allgather(comm, x, recorder, library=True),
    "alltoall_allgather": by_alltoall_allgather,
}


def reference(comm, x: np.ndarray) -> np.ndarray:
    """Return the NumPy majority of every rank's signs (counts by a plain ``Allreduce``)."""
    mine = (x > 0).astype(np.uint8)
    counts = np.empty_like(mine)
    comm.Allreduce(mine, counts, op=MPI.SUM)  # exact: at most MAX_RANKS votes
    return np.packbits(np.multiply(counts, 2, dtype=np.uint16) > comm.size, bitorder="little")


def expected_bytes(scheme: str, n: int, nranks: int, rank: int) -> tuple[int, int]:
    """Return the exact (sent, received) bytes that ``rank`` traces in one call of ``scheme``.

    Raises:
        ValueError: an unknown scheme.
    """
    N, r = nranks, rank
    B = (n + 7) // 8
    L = [hi - lo for lo, hi in chunks(n, N)]
    Bc = [(m + 7) // 8 for m in L]
    if N == 1:
        return 0, 0  # one rank: nothing crosses the wire
    if scheme == "ring":
        steps = range(1, N)
        width = [0] + [i.bit_length() for i in steps]  # ceil(log2(i+1))
        sent = sum((L[(r - i) % N] * width[i] + 7) // 8 for i in steps)
        sent += sum(Bc[(r - j + 1) % N] for j in steps)
        recv = sum((L[(r - i - 1) % N] * width[i] + 7) // 8 for i in steps)
        recv += sum(Bc[(r - j) % N] for j in steps)
        return sent, recv
    if scheme == "allgather":
        return 8 + (N - 1) * B, 8 * (N - 1) + (N - 1) * B
    if scheme == "allgatherv":
        return 8 + B, 8 * (N - 1) + (N - 1) * B
    if scheme == "alltoall_allgather":
        push = 8 * (N - 1) + B - Bc[r], 8 * (N - 1) + (N - 1) * Bc[r]
        pull = 8 + B - Bc[(r + 1) % N], 8 * (N - 1) + B - Bc[r]
        return push[0] + pull[0], push[1] + pull[1]
    raise ValueError(f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")


# --- measuring ------------------------------------------------------------------------------


def measure(comm, numel: int, reps: int, progress=None) -> list[dict]:
    """Return one row per scheme of majority votes over ``numel`` elements on ``comm``.

    Args:
        comm: the communicator (every rank calls this); the schemes run on a ``Dup()``.
        numel: elements of each rank's gradient (``mpicomp.tools.bench.gradient``, seeded by rank).
        reps: timed calls per scheme, after one traced warm-up call.
        progress: a stream for one line per scheme on rank 0 (None: silent).

    Returns:
        Rows with ``scheme``, ``ranks``, ``numel``, ``bytes_sent_per_rank`` and
        ``bytes_recv_per_rank`` (largest over ranks), ``recv_bits_per_element``,
        ``formula`` with ``formula_sent_per_rank``/``formula_recv_per_rank`` (largest over
        ranks), ``bytes_match`` (measured == formula on every rank), ``seconds`` (slowest
        rank, median), ``reps`` and ``decisions_match`` (the NumPy reference on every rank).

    Raises:
        ValueError: ``reps`` < 1, ``numel`` < 0, or more than ``MAX_RANKS`` ranks.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps!r}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel!r}")
    if comm.size > MAX_RANKS:
        raise ValueError(f"at most {MAX_RANKS} ranks (one-byte vote counts), got {comm.size}")
    comm = comm.Dup()  # the rings use fixed tags
    try:
        x = gradient(numel, seed=comm.rank)
        want = reference(comm, x)
        rows = []
        for k, scheme in enumerate(SCHEMES, 1):
            if progress is not None and comm.rank == 0:
                what = f"{numel:,} elements on {comm.size} ranks, {scheme} ({k}/{len(SCHEMES)})"
                print(f"signsgd_compare: {what}", file=progress, flush=True)
            run = _RUN[scheme]
            traffic = Traffic()
            wrong = not np.array_equal(run(comm, x, traffic), want)  # also the warm-up
            seconds = slowest_median(comm, lambda run=run: run(comm, x), reps, warmup=False)
            sent, recv = expected_bytes(scheme, numel, comm.size, comm.rank)
            mismatch = (traffic.sent, traffic.recv) != (sent, recv)
            mine = np.array([traffic.sent, traffic.recv, sent, recv, mismatch, wrong], np.int64)
            most = np.empty_like(mine)
            comm.Allreduce(mine, most, op=MPI.MAX)
            rows.append(
                {
                    "scheme": scheme,
                    "ranks": comm.size,
                    "numel": numel,
                    "bytes_sent_per_rank": int(most[0]),
                    "bytes_recv_per_rank": int(most[1]),
                    "recv_bits_per_element": 8 * int(most[1]) / numel if numel else None,
                    "formula": FORMULAS[scheme],
                    "formula_sent_per_rank": int(most[2]),
                    "formula_recv_per_rank": int(most[3]),
                    "bytes_match": not most[4],
                    "seconds": seconds,
                    "reps": reps,
                    "decisions_match": not most[5],
                }
            )
        return rows
    finally:
        comm.Free()


def _table(rows: list[dict]) -> None:
    head = (
        f"{'scheme':<20}{'N':>3}{'elements':>13}{'sent B/rank':>14}{'recv B/rank':>14}"
        f"{'recv bit/el':>12}{'= formula':>10}{'ms':>10}{'x ring':>8}{'decisions':>10}"
    )
    ring_s = {(r["ranks"], r["numel"]): r["seconds"] for r in rows if r["scheme"] == "ring"}

    def line(r: dict) -> str:
        bits = r["recv_bits_per_element"]
        base = ring_s.get((r["ranks"], r["numel"]))
        return (
            f"{r['scheme']:<20}{r['ranks']:>3}{r['numel']:>13,}{r['bytes_sent_per_rank']:>14,}"
            f"{r['bytes_recv_per_rank']:>14,}{'-' if bits is None else f'{bits:.3f}':>12}"
            f"{'yes' if r['bytes_match'] else 'NO':>10}{1e3 * r['seconds']:>10.1f}"
            f"{r['seconds'] / base if base else math.nan:>8.2f}"
            f"{'same' if r['decisions_match'] else 'WRONG':>10}"
        )

    print_table(head, map(line, rows))
    print("\nbytes per rank (B = ceil(n/8), chunk c: L_c elements, B_c = ceil(L_c/8) bytes):")
    for scheme in SCHEMES:
        print(f"  {scheme:<20}{FORMULAS[scheme]}")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def main(argv=None) -> int:
    """Compare the schemes on MPI.COMM_WORLD; rank 0 prints a table or JSON.

    Returns 1 when some scheme's decisions or bytes differ from the reference.
    """
    ap = argparse.ArgumentParser(prog="jobs.signsgd_compare", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--numel", default="25.6M", help="elements per rank, a comma list (default 25.6M)"
    )
    args = parse(ap, argv, 5, "timed calls per scheme")
    with usage_errors(ap):
        sizes = parse_counts(args.numel)
    if not sizes:
        ap.error(f"--numel must name a count, got {args.numel!r}")

    comm = MPI.COMM_WORLD
    rows = []
    for n in sizes:
        rows += measure(comm, n, args.reps, progress=sys.stderr)
    ok = all(r["bytes_match"] and r["decisions_match"] for r in rows)
    cores = _cores()
    header = (
        f"signSGD majority, ring vs allgather vs alltoall+allgather: {comm.size} ranks on "
        f"{cores} cores, {mpi_library()}, numba threads {nb.get_num_threads()}\n"
        f"time: gradient to decision bits, the slowest rank's, median of {args.reps} calls "
        "after a warm-up; bytes: per rank per call (Traffic), the largest over ranks"
    )
    if comm.size > cores:
        header += f"\n{comm.size} ranks oversubscribe {cores} cores: times are contention-bound"
    show(comm, rows, args.json, header, _table)
    return 0 if ok else 1


guard(globals())  # compiled one process at a time (kernels/numba_cache.py)


if __name__ == "__main__":
    sys.exit(main())
