"""Codec tour: every codec on one gradient-shaped tensor, one process.

Prints, per codec: bits per element on the wire, relative L2 error of what one rank
would get back, and encode / decode throughput in GB/s of float32 input (median of
repetitions after a warm-up). Run: ``python -m jobs.codec_tour [--numel N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np

import mpicomp
from mpicomp.kernels.cpu.bits import mpicomp_bits_pack, mpicomp_bits_unpack, packed_size


def conv_gradient(shape=(512, 512, 3, 3), seed=0) -> np.ndarray:
    """Return a float32 tensor shaped like a ResNet-50 3x3 conv gradient.

    Real conv gradients are heavy-tailed and their scale varies by output channel:
    Laplace values times a log-normal scale per channel, times 1e-3.
    """
    rng = np.random.default_rng(seed)
    scale = rng.lognormal(0.0, 1.0, size=(shape[0],) + (1,) * (len(shape) - 1))
    return (rng.laplace(size=shape) * scale * 1e-3).astype(np.float32)


def _ring_width(bound: int) -> int:
    # One rank's codes in [-bound, bound] as unsigned offsets: ceil(log2(2*bound + 1)) bits.
    return math.ceil(math.log2(2 * bound + 1))


def one_rank_round_trip(codec, x: np.ndarray):
    """Return (encode, decode, wire_bytes) closures for one rank of ``codec``.

    For byte-payload codecs these are encode/decode. For the summable codecs the
    wire is the codes bit-packed at the ring's first-step width (plus the shared
    scale indices for multi-scale); for signSGD, one sign bit per element.
    """
    if hasattr(codec, "encode") and codec.aggregation != "integer_sum":
        state = {}

        def enc():
            state["p"] = codec.encode(x)

        def dec():
            return codec.decode(state["p"])

        return enc, dec, lambda: state["p"].size

    if codec.aggregation == "majority":
        state = {}

        def enc():
            state["p"] = codec.signs(x)
            state["s"] = codec.scale(x)

        def dec():
            return codec.expand(state["p"], x.size, state["s"]).reshape(x.shape)

        return enc, dec, lambda: state["p"].size + 4

    width = _ring_width(codec.bound)
    multiscale = hasattr(codec, "scale_index")
    state = {}

    def enc():
        norm = codec.local_norm(x)
        extra = (codec.scale_index(x, norm),) if multiscale else ()
        codes = codec.quantize(x, norm, *extra, step=0, stream=0)
        packed = np.empty(packed_size(codes.size, width), np.uint8)
        mpicomp_bits_pack((codes.astype(np.int64) + codec.bound).astype(np.uint32), width, packed)
        state.update(norm=norm, extra=extra, packed=packed, ncodes=codes.size)

    def dec():
        codes = np.empty(state["ncodes"], np.uint32)
        mpicomp_bits_unpack(state["packed"], width, codes)
        codes = codes.astype(np.int64) - codec.bound
        return codec.dequantize(codes, state["norm"], *state["extra"], shape=x.shape)

    def wire():
        index_bytes = state["ncodes"] * codec.index_bits / 8 if multiscale else 0
        return state["packed"].size + index_bytes + 4

    return enc, dec, wire


def _median_seconds(fn, reps: int) -> float:
    fn()  # warm-up: numba compilation and first-touch allocation
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


TOUR = [
    ("none", {}),
    ("fp16", {}),
    ("topk", {"ratio": 0.01}),
    ("signsgd", {}),
    ("qsgd_maxnorm", {"bits": 8}),
    ("qsgd_maxnorm", {"bits": 4}),
    ("qsgd_maxnorm", {"bits": 2}),
    ("qsgd_maxnorm_multiscale", {"bits": 2}),
    ("grandk_maxnorm", {"bits": 4}),
    ("grandk_maxnorm_multiscale", {"bits": 2}),
    ("threelc", {"sparsity": 1.0}),
    ("threelc", {"sparsity": 1.5}),
    ("fft", {}),
    ("fastsgd", {}),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per codec")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    x = conv_gradient(seed=args.seed)
    norm = float(np.linalg.norm(x.astype(np.float64)))
    gb = x.nbytes / 1e9
    print(f"mpicomp {mpicomp.__version__} codec tour: gradient {x.shape} float32 "
          f"({x.size:,} elements, {x.nbytes / 2**20:.1f} MiB), one process, "
          f"median of {args.reps} after a warm-up", flush=True)  # fmt: skip
    dst = np.empty_like(x)
    memcpy = gb / _median_seconds(lambda: np.copyto(dst, x), args.reps)
    print(f"memcpy of the same buffer, same run: {memcpy:.2f} GB/s "
          "(the x/memcpy columns divide by it)")  # fmt: skip
    header = f"{'codec':<28}{'params':<16}{'bits/elem':>10}{'ratio':>9}{'rel.err':>10}{'enc GB/s':>10}{'x/memcpy':>9}{'dec GB/s':>10}{'x/memcpy':>9}"
    print(header)
    print("-" * len(header))
    for name, params in TOUR:
        codec = mpicomp.codec(name, **params)
        enc, dec, wire = one_rank_round_trip(codec, x)
        t_enc = _median_seconds(enc, args.reps)
        t_dec = _median_seconds(dec, args.reps)
        y = dec()
        err = float(np.linalg.norm((y - x).astype(np.float64))) / norm
        bits = 8 * wire() / x.size
        label = ",".join(f"{k}={v}" for k, v in params.items())
        print(f"{name:<28}{label:<16}{bits:>10.3f}{32 / bits:>8.1f}x{err:>10.4f}"
              f"{gb / t_enc:>10.2f}{gb / t_enc / memcpy:>9.2f}{gb / t_dec:>10.2f}{gb / t_dec / memcpy:>9.2f}",
              flush=True)  # fmt: skip
    print("bits/elem: payload (header included) or ring codes of one rank, per element; "
          "rel.err: ||decode(encode(g)) - g|| / ||g||, one rank, no error feedback\n"
          "(QSGD/GRandK are unbiased: their error averages down over ranks and steps; "
          "3LC, top-k, FFT and FastSGD carry theirs to the next step by error feedback).")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
