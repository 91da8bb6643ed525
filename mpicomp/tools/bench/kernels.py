"""Codec throughput on one process: encode and decode GB/s beside a copy of the same buffer
(memcpy on the host, a device-to-device copy on a GPU), bits per element.

``mpicomp bench`` times these on rank 0 alone, on the kernel backend it is given (the
gradient lives where that backend computes: a CuPy array for ``cuda``), with the closures
``CompressedComm(schedule="auto")`` measures codec speeds with (``mpicomp.model.probe``), and
with the other thread pools of the process held to one thread (``other_pools_quiet``).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager

import numba
import numpy as np
from threadpoolctl import threadpool_limits

import mpicomp.kernels as K
from mpicomp.codecs import codec as make_codec
from mpicomp.model.probe import gradient, one_rank_round_trip
from mpicomp.tools.bench._countdown import Countdown
from mpicomp.tools.bench.workload import codec_set, label


def kernel_backend(name: str | None):
    """Return the backend record ``name`` (None: what ``MPICOMP_KERNELS`` selects).

    Raises:
        RuntimeError: the backend is unknown or cannot start here (``cuda`` without CuPy
            or without a GPU), with the reason.
    """
    try:
        return K.backend(name)
    except Exception as e:  # ImportError, CUDARuntimeError, ...: say why, on every rank
        raise RuntimeError(f"kernel backend {name!r} is not available here: {e}") from e


def _fft_pair(xp, x):
    return lambda: xp.fft.irfft(xp.fft.rfft(x), n=x.size)


@contextmanager
def other_pools_quiet():
    """Hold BLAS and OpenMP pools (threadpoolctl) and torch's intra-op threads, if torch
    is loaded, to one thread while the kernels are timed.

    OpenBLAS's threads, woken by the error measure (a BLAS norm), spin for a while after
    it returns, on the cores numba's threads then need: without this, fp16's encode in
    two runs of the same bench on 2 cores took 16.97 and 1.00 GB/s. numba's own OpenMP
    pool is not limited by this (it gives its thread count at each launch).
    """
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    with threadpool_limits(limits=1):
        if torch is not None:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            if torch is not None:
                torch.set_num_threads(before)


#: The shortest repetition timed: a call shorter than this is repeated within one, since
#: the time of a single sub-millisecond call varied by 40 % from run to run.
MIN_REPETITION_S = 0.01


def seconds(fn, reps: int, sync=None) -> list[float]:
    """Return the seconds per call of ``fn`` in ``reps`` repetitions, after a warm-up call;
    a repetition makes as many calls as last ``MIN_REPETITION_S`` (one, for slow calls).
    ``sync`` (a GPU's synchronize) runs before the clock starts and before it stops."""
    sync = sync or (lambda: None)
    fn()  # warm-up: compilation and first-touch allocation
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    calls = max(1, min(1000, math.ceil(MIN_REPETITION_S / max(time.perf_counter() - t0, 1e-9))))
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return times


def _rates(gb: float, times: list[float], key: str) -> dict[str, float]:
    """Return GB/s as ``key`` (the median time's), ``key_min`` and ``key_max``."""
    return {
        key: gb / statistics.median(times),
        f"{key}_min": gb / max(times),
        f"{key}_max": gb / min(times),
    }


def run(
    codecs: Sequence[str] | None = None,
    numel: int = 1 << 20,
    reps: int = 5,
    seed: int = 0,
    progress=None,
    backend: str | None = None,
) -> list[dict]:
    """Measure every codec of ``codecs`` on one gradient of ``numel`` float32 values.

    Args:
        codecs: codec names (``BENCH_SET``'s parameters); None for all of ``BENCH_SET``.
        numel: elements of the gradient.
        reps: timed repetitions per measurement, after one warm-up.
        seed: seed of the gradient.
        progress: a text stream for one line per codec (None: silent).
        backend: the kernel backend (``numba``, ``cuda``, ``cuda-emulated``; None: what
            ``MPICOMP_KERNELS`` selects).

    Returns:
        One dict per codec and backend: ``codec``, ``params``, ``backend``, ``numel``,
        ``threads`` (numba's threads in this thread: the kernels' on the CPU),
        ``encode_gbps``, ``decode_gbps`` (the median time's), ``encode_gbps_min``,
        ``encode_gbps_max``, ``decode_gbps_min``, ``decode_gbps_max`` (the slowest and
        fastest repetition's), ``memcpy_gbps`` (GB/s of float32 input, 1 GB = 1e9 bytes;
        the copy is device to device on a GPU), ``bits_per_element`` (one rank's wire)
        and ``rel_error`` (‖decode(encode(x)) − x‖ / ‖x‖, one rank, no error feedback);
        ``fft``'s row also ``fft_pair_gbps``, a bare ``rfft`` and ``irfft`` of the same
        gradient on the backend's array module.

    Raises:
        ValueError: an unknown codec, or ``numel``/``reps`` below 1.
        RuntimeError: the backend is not available here.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be an integer >= 1, got {numel!r}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an integer >= 1, got {reps!r}")
    todo = codec_set(codecs)
    rec = kernel_backend(backend)
    with other_pools_quiet():
        return _measure(todo, rec, numel, reps, seed, progress)


def _measure(todo, rec, numel: int, reps: int, seed: int, progress) -> list[dict]:
    host = gradient(numel, seed)
    gb = host.nbytes / 1e9
    norm = float(np.linalg.norm(host.astype(np.float64))) or 1.0
    x = rec.xp.asarray(host)  # on the backend's device
    dst = rec.xp.empty_like(x)
    sync = getattr(rec, "synchronize", None)
    memcpy = gb / statistics.median(seconds(lambda: rec.xp.copyto(dst, x), reps, sync))
    rows = []
    countdown = Countdown(len(todo), progress)
    for name, params in todo:
        countdown.next(f"{name} {label(params)}".strip())
        codec = make_codec(name, **params)
        codec.kernels = rec if rec.xp is np else codec.kernels  # the backend of NumPy arrays
        enc, dec, wire = one_rank_round_trip(codec, x)
        # A codec whose products are BLAS's (powersgd) gets as many BLAS threads as the
        # kernels have, as numba's kernels get theirs.
        blas = 1 if codec.on_kernels else numba.get_num_threads()
        with threadpool_limits(limits=blas, user_api="blas"):
            t_enc = seconds(enc, reps, sync)
            t_dec = seconds(dec, reps, sync)
        got = rec.to_host(dec(), why="bench: decoded gradient").reshape(-1)
        err = float(np.linalg.norm((got - host).astype(np.float64)))
        rows.append(
            {
                "codec": name,
                "params": dict(params),
                "backend": rec.name,
                "numel": numel,
                "threads": numba.get_num_threads(),
                **_rates(gb, t_enc, "encode_gbps"),
                **_rates(gb, t_dec, "decode_gbps"),
                "memcpy_gbps": memcpy,
                "bits_per_element": 8 * wire() / numel,
                "rel_error": err / norm,
            }
        )
        if name == "fft":  # FFT's yardstick: the bare transform pair (cuFFT on a GPU)
            pair = seconds(_fft_pair(rec.xp, x), reps, sync)
            rows[-1]["fft_pair_gbps"] = gb / statistics.median(pair)
    return rows
