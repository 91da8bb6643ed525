"""Codec tour: every codec on one gradient-shaped tensor, one process.

Prints, per codec: bits per element on the wire, relative L2 error of what one rank
would get back, and encode / decode throughput in GB/s of float32 input (median of
repetitions after a warm-up). Run: ``python -m jobs.codec_tour [--reps R] [--seed S]``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import mpicomp
from jobs._report import print_table
from mpicomp.tools.bench import conv_gradient, label, median_seconds, one_rank_round_trip
from mpicomp.tools.bench.report import title

# Every codec of mpicomp.codecs.available() (tests/test_jobs.py checks it), once, with the
# settings it is toured at, in the order the table prints them.
SETTINGS = {
    "none": [{}],
    "fp16": [{}],
    "topk": [{"ratio": 0.01}],
    "signsgd": [{}],
    "qsgd_maxnorm": [{"bits": 8}, {"bits": 4}, {"bits": 2}],
    "qsgd_maxnorm_multiscale": [{"bits": 2}],
    "grandk_maxnorm": [{"bits": 4}],
    "grandk_maxnorm_multiscale": [{"bits": 2}],
    "threelc": [{"sparsity": 1.0}, {"sparsity": 1.5}],
    "fft": [{}],
    "fastsgd": [{}],
    "powersgd": [{"rank": 1}, {"rank": 4}],
}
TOUR = [(name, params) for name, settings in SETTINGS.items() for params in settings]

NOTES = """\
bits/elem: what one rank sends per element: its payload (header included), its ring codes,
  or PowerSGD's factors P and Q (float32)
rel.err: ||decode(encode(g)) - g|| / ||g||, one rank, no error feedback. QSGD and GRandK are
  unbiased: their error averages down over ranks and steps, and one rank's can exceed 1
  (QSGD at 2 bits has one level each side of 0; GRandK keeps K of the n coordinates, each
  scaled by n/K). 3LC, top-k, FFT, FastSGD and PowerSGD carry theirs
  to the next step by error feedback; PowerSGD's is near 1 here, as the tensor's entries
  are independent draws, which no low-rank matrix approximates."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per codec")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    x = conv_gradient(seed=args.seed)
    norm = float(np.linalg.norm(x.astype(np.float64)))
    gb = x.nbytes / 1e9
    print(f"{title('codec tour')}: gradient {x.shape} float32 "
          f"({x.size:,} elements, {x.nbytes / 2**20:.1f} MiB), one process, "
          f"median of {args.reps} after a warm-up", flush=True)  # fmt: skip
    dst = np.empty_like(x)
    memcpy = gb / median_seconds(lambda: np.copyto(dst, x), args.reps)
    print(f"memcpy of the same buffer, same run: {memcpy:.2f} GB/s "
          "(the x/memcpy columns divide by it)")  # fmt: skip
    header = f"{'codec':<28}{'params':<16}{'bits/elem':>10}{'ratio':>9}{'rel.err':>10}{'enc GB/s':>10}{'x/memcpy':>9}{'dec GB/s':>10}{'x/memcpy':>9}"

    def lines():  # each measured as the table prints it
        for name, params in TOUR:
            codec = mpicomp.codec(name, **params)
            enc, dec, wire = one_rank_round_trip(codec, x)
            t_enc = median_seconds(enc, args.reps)
            t_dec = median_seconds(dec, args.reps)
            y = dec()
            err = float(np.linalg.norm((y - x).astype(np.float64))) / norm
            bits = 8 * wire() / x.size
            yield (f"{name:<28}{label(params):<16}{bits:>10.3f}{32 / bits:>8.1f}x{err:>10.4f}"
                   f"{gb / t_enc:>10.2f}{gb / t_enc / memcpy:>9.2f}{gb / t_dec:>10.2f}{gb / t_dec / memcpy:>9.2f}")  # fmt: skip

    print_table(header, lines())
    print(NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
