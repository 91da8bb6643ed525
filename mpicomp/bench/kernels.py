"""Codec throughput on one process: encode and decode GB/s beside memcpy, bits per element.

``mpicomp bench`` times these on rank 0 alone; the per-codec closures it times are in
``mpicomp.bench.roundtrip``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

import mpicomp
from mpicomp.bench.roundtrip import one_rank_round_trip
from mpicomp.bench.workload import codec_set, gradient, label


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
