"""What the QSGD-MaxNorm family's twins share: error bits, the norm's summation order and
the slack of the norm bound.

Block norms: the coded vector (x, or x[idx]) is cut into blocks, block b holding elements
starts[b] <= i < starts[b + 1]; element i is quantized against norms[b]. ``regular`` > 0
says the blocks are [b * regular, (b + 1) * regular) (the last one shorter): then both
twins find the block of i as i // regular, else by a binary search of ``starts``. A
block's squared norm adds its *pieces* (the block cut every CHUNK elements from its
start) in order, each piece in the 8 lanes of the whole-tensor norm.
"""

import numpy as np

# Error results are bit masks.
ERR_VALUE = 1  # NaN/Inf, or |v| above the norm bound
ERR_INDEX = 2  # a scale index outside the scale set
ERR_UNSAFE = 4  # a scale index whose scale would push a code past s_min
ERR_RANGE = 8  # a code sum outside +-limit
ERR_NORM = 16  # a block's norm that is not a finite float32 >= 0
ERR_OVERFLOW = 32  # a block's norm beyond float32's range (``norms`` only)

#: Elements per partial sum of the squared norm (float64, added in chunk order): the
#: norm's bits depend on it, so both twins use this one.
CHUNK = 1 << 16

#: |v| / norm may exceed 1 by this factor (norms computed elsewhere, rounded).
LIMIT = np.float32(1.000001)

#: The largest float32: a block norm above it overflows (ERR_OVERFLOW), a norm given
#: above it (or NaN, or below 0) is refused (ERR_NORM).
F32_MAX = np.float32(np.finfo(np.float32).max)
