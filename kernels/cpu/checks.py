"""Checks shared by codecs' kernels."""

import numba as nb
import numpy as np

from mpicomp.kernels.numba_cache import guard


@nb.njit(cache=True)
def mpicomp_all_finite(x):
    """Return True if every element of float32 ``x`` is finite."""
    acc = np.float32(0)
    for i in range(x.size):
        acc += x[i] * np.float32(0)  # NaN*0 and Inf*0 are NaN: one pass, no branch
    return acc == acc


@nb.njit(parallel=True, cache=True)
def mpicomp_parallel_probe(n):
    """Launch a parallel region (so numba picks its threading layer); return sum(range(n))."""
    total = 0
    for i in nb.prange(n):
        total += i
    return total


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
