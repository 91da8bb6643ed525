"""Codec throughput on one process: encode and decode GB/s beside a copy of the same buffer
(memcpy on the host, a device-to-device copy on a GPU), bits per element.

``mpicomp bench`` times these on rank 0 alone, on the kernel backend it is given (the
gradient lives where that backend computes: a CuPy array for ``cuda``), with the closures
and the clock ``CompressedComm(schedule="auto")`` measures codec speeds with
(``mpicomp._probe``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import mpicomp.kernels as K
from mpicomp._probe import gradient, median_seconds, one_rank_round_trip
from mpicomp.bench._countdown import Countdown
from mpicomp.bench.workload import codec_set, label
from mpicomp.codecs import codec as make_codec


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
        ``encode_gbps``, ``decode_gbps``, ``memcpy_gbps`` (GB/s of float32 input,
        1 GB = 1e9 bytes; the copy is device to device on a GPU), ``bits_per_element``
        (one rank's wire) and ``rel_error`` (‖decode(encode(x)) − x‖ / ‖x‖, one rank,
        no error feedback); ``fft``'s row also ``fft_pair_gbps``, a bare ``rfft`` and
        ``irfft`` of the same gradient on the backend's array module.

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
    host = gradient(numel, seed)
    gb = host.nbytes / 1e9
    norm = float(np.linalg.norm(host.astype(np.float64))) or 1.0
    x = rec.xp.asarray(host)  # on the backend's device
    dst = rec.xp.empty_like(x)
    sync = getattr(rec, "synchronize", None)
    memcpy = gb / median_seconds(lambda: rec.xp.copyto(dst, x), reps, sync)
    rows = []
    countdown = Countdown(len(todo), progress)
    for name, params in todo:
        countdown.next(f"{name} {label(params)}".strip())
        codec = make_codec(name, **params)
        codec.kernels = rec if rec.xp is np else codec.kernels  # the backend of NumPy arrays
        enc, dec, wire = one_rank_round_trip(codec, x)
        t_enc = median_seconds(enc, reps, sync)
        t_dec = median_seconds(dec, reps, sync)
        got = rec.to_host(dec(), why="bench: decoded gradient").reshape(-1)
        err = float(np.linalg.norm((got - host).astype(np.float64)))
        rows.append(
            {
                "codec": name,
                "params": dict(params),
                "backend": rec.name,
                "numel": numel,
                "encode_gbps": gb / t_enc,
                "decode_gbps": gb / t_dec,
                "memcpy_gbps": memcpy,
                "bits_per_element": 8 * wire() / numel,
                "rel_error": err / norm,
            }
        )
        if name == "fft":  # FFT's yardstick: the bare transform pair (cuFFT on a GPU)
            rows[-1]["fft_pair_gbps"] = gb / median_seconds(_fft_pair(rec.xp, x), reps, sync)
    return rows
