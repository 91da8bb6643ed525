"""Top-k sparsification kernels: gather kept (index, value) pairs; validate and scatter them back."""

import numba as nb
import numpy as np


@nb.njit(cache=True)
def mpicomp_topk_scatter(indices, values, n, out):
    """Scatter ``values`` at strictly increasing ``indices`` < n into zeroed ``out``.

    Returns 0 on success, 1 if an index is out of range or not increasing, 2 if a
    value is not finite (then ``out`` is incomplete and must be discarded).
    """
    prev = -1
    for j in range(indices.size):
        i = np.int64(indices[j])
        if i <= prev or i >= n:
            return 1
        v = values[j]
        if not np.isfinite(v):
            return 2
        out[i] = v
        prev = i
    return 0
