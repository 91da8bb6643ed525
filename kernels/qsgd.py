"""What the QSGD-MaxNorm family's twins share: error bits, the norm's summation order and
the slack of the norm bound."""

import numpy as np

# Error results are bit masks.
ERR_VALUE = 1  # NaN/Inf, or |v| above the norm bound
ERR_INDEX = 2  # a scale index outside the scale set
ERR_UNSAFE = 4  # a scale index whose scale would push a code past s_min
ERR_RANGE = 8  # a code sum outside +-limit

#: Elements per partial sum of the squared norm (float64, added in chunk order): the
#: norm's bits depend on it, so both twins use this one.
CHUNK = 1 << 16

#: |v| / norm may exceed 1 by this factor (norms computed elsewhere, rounded).
LIMIT = np.float32(1.000001)
