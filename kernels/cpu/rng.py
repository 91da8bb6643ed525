"""Counter-based random numbers: the same value for (seed, step, stream, index) on every
rank, backend and re-run; no generator state to carry."""

import numba as nb
import numpy as np

from mpicomp.kernels import rng as _shared
from mpicomp.kernels.numba_cache import guard

_GOLDEN = np.uint64(_shared.GOLDEN)
_M1 = np.uint64(_shared.M1)
_M2 = np.uint64(_shared.M2)
_STEP_MUL = np.uint64(_shared.STEP_MUL)
_STREAM_MUL = np.uint64(_shared.STREAM_MUL)


@nb.njit(inline="always", cache=True)
def mpicomp_mix64(z):
    """Return the splitmix64 finalizer of uint64 ``z``."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@nb.njit(inline="always", cache=True)
def mpicomp_key(seed, step, stream):
    """Return the 64-bit key of one (seed, step, stream) draw."""
    k = mpicomp_mix64(np.uint64(seed) ^ (np.uint64(step) * _STEP_MUL))
    return mpicomp_mix64(k ^ (np.uint64(stream) * _STREAM_MUL))


@nb.njit(inline="always", cache=True)
def mpicomp_bits(key, index):
    """Return 64 random bits for element ``index`` under ``key``."""
    # A key passed from Python arrives as int64; int64 + uint64 would promote to float64.
    return mpicomp_mix64(np.uint64(key) + (np.uint64(index) + np.uint64(1)) * _GOLDEN)


@nb.njit(inline="always", cache=True)
def mpicomp_uniform(key, index):
    """Return a float32 uniform in [0, 1) with 24 random bits for element ``index``."""
    return np.float32(mpicomp_bits(key, index) >> np.uint64(40)) * np.float32(5.9604645e-08)


@nb.njit(cache=True)
def uniform_array(seed, step, stream, n):
    """Return the first ``n`` uniforms of one draw (for tests and references)."""
    out = np.empty(n, np.float32)
    key = mpicomp_key(seed, step, stream)
    for i in range(n):
        out[i] = mpicomp_uniform(key, i)
    return out


# Compiled under the cache directory's lock, one process at a time (kernels/numba_cache.py).
guard(globals())
