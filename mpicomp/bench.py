"""Codec throughput on one process: encode and decode GB/s beside memcpy, bits per element.

``mpicomp bench`` runs :func:`run`; ``jobs/codec_tour.py`` and ``jobs/bench.py`` reuse the
gradient and the codec set from here (the per-codec closures are in ``mpicomp.roundtrip``).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

import mpicomp
from mpicomp.roundtrip import one_rank_round_trip

# One representative parameter set per codec (two for QSGD-MaxNorm: 8 and 2 bits, the
# ends of its useful range), in the order the tables print them.
BENCH_SET: list[tuple[str, dict]] = [
    ("none", {}),
    ("fp16", {}),
    ("topk", {"ratio": 0.01}),
    ("signsgd", {}),
    ("qsgd_maxnorm", {"bits": 8}),
    ("qsgd_maxnorm", {"bits": 2}),
    ("qsgd_maxnorm_multiscale", {"bits": 2}),
    ("grandk_maxnorm", {"bits": 4}),
    ("grandk_maxnorm_multiscale", {"bits": 2}),
    ("threelc", {"sparsity": 1.5}),
    ("fft", {}),
    ("fastsgd", {}),
]

# Elements per output channel of a ResNet-50 3x3 conv with 512 input channels.
_CHANNEL = 512 * 3 * 3


def conv_gradient(shape: tuple[int, ...] = (512, 512, 3, 3), seed: int = 0) -> np.ndarray:
    """Return a float32 tensor shaped like a ResNet-50 3x3 conv gradient.

    Real conv gradients are heavy-tailed and their scale varies by output channel:
    Laplace values times a log-normal scale per channel, times 1e-3.
    """
    rng = np.random.default_rng(seed)
    scale = rng.lognormal(0.0, 1.0, size=(shape[0],) + (1,) * (len(shape) - 1))
    return (rng.laplace(size=shape) * scale * 1e-3).astype(np.float32)


def gradient(numel: int, seed: int = 0) -> np.ndarray:
    """Return ``numel`` float32 values drawn as :func:`conv_gradient` draws them, flat."""
    channels = max(1, -(-numel // _CHANNEL))
    return conv_gradient((channels, 512, 3, 3), seed).reshape(-1)[:numel].copy()


def codec_set(names: Sequence[str] | None = None) -> list[tuple[str, dict]]:
    """Return the (name, params) pairs of ``BENCH_SET`` for ``names`` (all when None).

    A name outside ``BENCH_SET`` but registered gets its default parameters.

    Raises:
        ValueError: a name is not a codec.
    """
    if names is None:
        return list(BENCH_SET)
    known = mpicomp.codecs.available()
    out: list[tuple[str, dict]] = []
    for name in names:
        if name not in known:
            raise ValueError(f"unknown codec {name!r}; available: {', '.join(known)}")
        out += [(n, p) for n, p in BENCH_SET if n == name] or [(name, {})]
    return out


def parse_count(text: str) -> int:
    """Return the integer that ``text`` spells: ``1000``, ``1e6``, ``4K``, ``1M``, ``25.6M``.

    Suffixes are decimal: K = 1e3, M = 1e6, G = 1e9.

    Raises:
        ValueError: ``text`` is not a whole, non-negative count.
    """
    s = str(text).strip()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(s[-1:].lower(), 1)
    body = s[:-1] if scale != 1 else s
    try:
        value = float(body) * scale
    except ValueError:
        raise ValueError(f"not a count: {text!r}") from None
    if not math.isfinite(value) or not value.is_integer() or value < 0:
        raise ValueError(f"not a whole non-negative count: {text!r}")
    return int(value)


def label(params: dict) -> str:
    """Return ``params`` as ``k=v,k=v`` (empty for defaults)."""
    return ",".join(f"{k}={v}" for k, v in params.items())


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Return the median wall time of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up: numba compilation and first-touch allocation
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(
    codecs: Sequence[str] | None = None,
    numel: int = 1 << 20,
    reps: int = 5,
    seed: int = 0,
    progress=None,
) -> list[dict]:
    """Measure every codec of ``codecs`` on one gradient of ``numel`` float32 values.

    Args:
        codecs: codec names (``BENCH_SET``'s parameters); None for all of ``BENCH_SET``.
        numel: elements of the gradient.
        reps: timed repetitions per measurement, after one warm-up.
        seed: seed of the gradient.
        progress: a text stream for one line per codec (None: silent).

    Returns:
        One dict per codec and backend: ``codec``, ``params``, ``backend``, ``numel``,
        ``encode_gbps``, ``decode_gbps``, ``memcpy_gbps`` (GB/s of float32 input,
        1 GB = 1e9 bytes), ``bits_per_element`` (one rank's wire) and ``rel_error``
        (‖decode(encode(x)) − x‖ / ‖x‖, one rank, no error feedback).

    Raises:
        ValueError: an unknown codec, or ``numel``/``reps`` below 1.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be an integer >= 1, got {numel!r}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an integer >= 1, got {reps!r}")
    todo = codec_set(codecs)
    x = gradient(numel, seed)
    gb = x.nbytes / 1e9
    norm = float(np.linalg.norm(x.astype(np.float64))) or 1.0
    dst = np.empty_like(x)
    memcpy = gb / median_seconds(lambda: np.copyto(dst, x), reps)
    rows = []
    for i, (name, params) in enumerate(todo, 1):
        if progress is not None:
            what = f"{name} {label(params)}".strip()
            print(f"bench: {what} ({i}/{len(todo)})", file=progress, flush=True)
        enc, dec, wire = one_rank_round_trip(mpicomp.codec(name, **params), x)
        t_enc = median_seconds(enc, reps)
        t_dec = median_seconds(dec, reps)
        err = float(np.linalg.norm((np.asarray(dec()).reshape(-1) - x).astype(np.float64)))
        rows.append(
            {
                "codec": name,
                "params": dict(params),
                "backend": "cpu",
                "numel": numel,
                "encode_gbps": gb / t_enc,
                "decode_gbps": gb / t_dec,
                "memcpy_gbps": memcpy,
                "bits_per_element": 8 * wire() / numel,
                "rel_error": err / norm,
            }
        )
    return rows


def format_table(rows: list[dict], out=None) -> None:
    """Print ``rows`` of :func:`run` as a table (to stdout by default)."""
    out = sys.stdout if out is None else out
    if not rows:
        return
    head = (
        f"{'codec':<28}{'params':<14}{'backend':<9}{'bits/elem':>10}{'rel.err':>9}"
        f"{'enc GB/s':>10}{'x/memcpy':>9}{'dec GB/s':>10}{'x/memcpy':>9}"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        m = r["memcpy_gbps"]
        print(
            f"{r['codec']:<28}{label(r['params']):<14}{r['backend']:<9}"
            f"{r['bits_per_element']:>10.3f}{r['rel_error']:>9.4f}"
            f"{r['encode_gbps']:>10.2f}{r['encode_gbps'] / m:>9.2f}"
            f"{r['decode_gbps']:>10.2f}{r['decode_gbps'] / m:>9.2f}",
            file=out,
        )


def _idle_barrier(comm) -> None:
    """A barrier that sleeps instead of spinning: ranks waiting for rank 0's kernel timings
    must not take its cores (MPI barriers busy-poll)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


class Report:
    """What ``mpicomp bench`` measured: kernel rows with their all-reduce entries."""

    def __init__(self, rows: list[dict], allreduce: list[dict], nranks: int, numel):
        self.rows = rows
        self.allreduce = allreduce
        self.nranks = nranks
        self.numel = numel

    def print(self, reps: int, allreduce_reps: int, out=None) -> None:
        """Print both tables with their headers (to stdout by default)."""
        import numba

        out = sys.stdout if out is None else out
        kernels = [r for r in self.rows if r["encode_gbps"] is not None]
        if kernels:
            print(
                f"mpicomp {mpicomp.__version__} bench: {self.numel:,} float32 elements "
                f"({self.numel * 4 / 2**20:.1f} MiB), one process, cpu backend "
                f"(numba {numba.config.NUMBA_NUM_THREADS} threads), median of {reps} "
                f"after a warm-up\nmemcpy (np.copyto) of the same buffer, same run: "
                f"{kernels[0]['memcpy_gbps']:.2f} GB/s (the x/memcpy columns divide by it)",
                file=out,
            )
            format_table(kernels, out)
            print(
                "GB/s: float32 input bytes / time (1 GB = 1e9 B); bits/elem: one rank's wire "
                "(payload with header, or ring codes at the first step's width);\n"
                "rel.err: ||decode(encode(g)) - g|| / ||g||, one rank, no error feedback.",
                file=out,
            )
        if self.allreduce:
            from mpicomp.bench_allreduce import format_table as allreduce_table

            print(
                f"\nall-reduce on {self.nranks} rank(s): CompressedComm.allreduce against "
                f"MPI_Allreduce of float32, the slowest rank's time, median of "
                f"{allreduce_reps} after a warm-up;\nspeedup = MPI_Allreduce time / "
                "compressed time; bytes per rank per call, 'x ring' over a float32 ring's "
                "2(N-1)/N*4n",
                file=out,
            )
            allreduce_table(self.allreduce, out)


def full_run(
    comm,
    codecs: Sequence[str] | None,
    numel: int | None,
    sizes: Sequence[int],
    *,
    reps: int = 5,
    allreduce_reps: int = 3,
    seed: int = 0,
    trace_dir: str | None = None,
    tc_dev: str | None = None,
    progress=None,
) -> Report:
    """Run what ``mpicomp bench`` measures on ``comm``: kernels on rank 0, then all-reduces.

    Args:
        comm: an ``mpi4py.MPI.Comm``; every rank calls this.
        codecs: codec names (``BENCH_SET``'s parameters); None for all.
        numel: kernel gradient size; None skips the kernel timings.
        sizes: all-reduce sizes (may be empty).
        reps, allreduce_reps: timed repetitions of a kernel / of an all-reduce.
        seed: seed of the kernel gradient (each rank's all-reduce gradient is seeded
            by its rank).
        trace_dir, tc_dev: see ``mpicomp.bench_allreduce.measure``.
        progress: a text stream for progress lines on rank 0 (None: silent).

    Returns:
        A :class:`Report` whose ``rows`` hold one dict per codec and backend: the keys
        of :func:`run` (kernel figures None when skipped) and ``allreduce``, the list of
        that codec's all-reduce rows (``mpicomp.bench_allreduce.measure``), one per size.
        On ranks other than 0 the kernel figures are None.
    """
    todo = codec_set(codecs)
    quiet = progress if comm.rank == 0 else None
    kernel_rows = error = None
    if numel is not None and comm.rank == 0:
        try:
            kernel_rows = run(codecs, numel, reps, seed, progress=quiet)
        except Exception as e:  # raised on every rank below: none is left waiting
            error = e
    _idle_barrier(comm)
    failed = comm.bcast(None if error is None else f"{type(error).__name__}: {error}", root=0)
    if error is not None:
        raise error
    if failed is not None:
        raise RuntimeError(f"rank 0's kernel timings failed: {failed}")
    allreduce = []
    if sizes:
        from mpicomp.bench_allreduce import measure

        for n in sizes:
            allreduce += measure(
                comm, n, todo, allreduce_reps, quiet, trace_dir=trace_dir, tc_dev=tc_dev
            )
    rows = []
    for i, (name, params) in enumerate(todo):
        row = (
            kernel_rows[i]
            if kernel_rows
            else {
                "codec": name,
                "params": dict(params),
                "backend": "cpu",
                "numel": numel,
                "encode_gbps": None,
                "decode_gbps": None,
                "memcpy_gbps": None,
                "bits_per_element": None,
                "rel_error": None,
            }
        )
        row["allreduce"] = [
            a for a in allreduce if a["codec"] == name and a["params"] == dict(params)
        ]
        rows.append(row)
    return Report(rows, allreduce, comm.size, numel)
