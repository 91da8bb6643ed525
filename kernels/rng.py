"""The counter-based random numbers every backend draws: splitmix64 of (seed, step,
stream, index). Its constants live here once; ``key`` is computed on the host (a
launcher receives it as a uint64), the per-element draws in each backend's kernels."""

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
STEP_MUL = 0xD6E8FEB86659FD93
STREAM_MUL = 0xA0761D6478BD642F

_MASK = (1 << 64) - 1


def mix64(z: int) -> int:
    """Return the splitmix64 finalizer of the 64-bit integer ``z``."""
    z = ((z ^ (z >> 30)) * M1) & _MASK
    z = ((z ^ (z >> 27)) * M2) & _MASK
    return z ^ (z >> 31)


def key(seed: int, step: int, stream: int) -> np.uint64:
    """Return the 64-bit key of one (seed, step, stream) draw, as kernels take it."""
    k = mix64(int(seed) ^ ((int(step) * STEP_MUL) & _MASK))
    return np.uint64(mix64(k ^ ((int(stream) * STREAM_MUL) & _MASK)))
