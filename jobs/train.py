"""Data-parallel training of a NumPy MLP on the digits data set, once per codec, compared.

Every rank trains on its own shard of the training set; gradients are averaged by
``mpicomp.CompressedComm.allreduce_many``. Each codec run starts from the same
weights and sees the same batches. Rank 0 prints a table (final training loss, test
accuracy, bytes per step, step time) and writes loss.png, results.json and one HDF5
trace per codec run into --out (default runs/train). See docs/training.md.

Run: ``NUMBA_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m jobs.train [--steps N]
[--codecs none,qsgd_maxnorm,threelc:sparsity=1.2] [--out DIR]`` (``--help`` for all).
"""

from __future__ import annotations

import os
import sys

import numpy as np

from jobs import _compare, _mlp
from jobs._loop import run_main

# The comparison's runs (jobs._compare.RUNS) and one of each codec they leave out, so that
# the default covers mpicomp.codecs.available() (tests/test_jobs.py checks it). These two
# stay out of RUNS, where a bare codec name picks its runs: jobs.peers runs them at other
# settings. PowerSGD starts at step 10 (its default, 1000, is past this job's 300 steps);
# GRandK's K is a quarter of the 9,610 parameters, as in RUNS (its default, 10,000, is more).
EXTRA_RUNS = ("grandk_maxnorm_multiscale:k=0.25", "powersgd:start_iter=10")
CODECS = ",".join([*(r.label for r in _compare.RUNS), *EXTRA_RUNS])


class NumpyMLP:
    """The ``jobs._mlp`` network with SGD and heavy-ball momentum (v = m·v + g, w -= lr·v)."""

    def __init__(self, sizes: list[int], seed: int, momentum: float):
        self._params = _mlp.init_mlp(sizes, seed)
        self.names = list(self._params)
        self._velocity = {k: np.zeros_like(v) for k, v in self._params.items()}
        self._momentum = np.float32(momentum)

    def grads(self, x: np.ndarray, y: np.ndarray, scale: float):
        """Return (mean loss, [scale * gradient per name]) on one local batch."""
        loss, grads = _mlp.loss_and_grads(self._params, x, y, scale)
        return loss, [grads[k] for k in self.names]

    def apply(self, averages: list[np.ndarray], lr: float) -> None:
        """Take one SGD step with the averaged gradients."""
        lr = np.float32(lr)
        for k, g in zip(self.names, averages, strict=True):
            v = self._velocity[k]
            v *= self._momentum
            v += g
            self._params[k] -= lr * v

    def params(self) -> dict[str, np.ndarray]:
        """Return a copy of the weights."""
        return {k: v.copy() for k, v in self._params.items()}


def main(argv=None) -> int:
    """Run the comparison on every rank of MPI.COMM_WORLD; return 0."""
    return run_main(
        argv,
        "jobs.train",
        __doc__.splitlines()[0],
        NumpyMLP,
        steps=300,
        lr=0.05,
        out=os.path.join("runs", "train"),
        codecs=CODECS,
    )


if __name__ == "__main__":
    sys.exit(main())
