"""3LC kernels (paper 001 §3): max pass, 3-value quantization + quartic encoding with
fused error feedback, zero-run encoding and the validating decoders.

Every kernel is a plain per-element, per-byte or per-block loop in float32 without
fastmath, so the CUDA twins (same names, same docstrings) give the same bytes.
"""

import numba as nb
import numpy as np

# Quartic byte of five zero trits (digits 1, 1, 1, 1, 1): the byte zero-run encoding shortens.
ZERO_BYTE = 121
# Largest quartic byte (digits 2, 2, 2, 2, 2); 243..255 are zero-run codes.
MAX_QUARTIC = 242
RUN_BASE = 243
MAX_RUN = 14

# Error codes of mpicomp_threelc_quartic_decode.
OK = 0
ERR_BYTE = 1
ERR_PAD = 2
ERR_ZERO_SCALE = 3

# Elements per block of the max pass: each block reduces serially, blocks in parallel;
# max is exact, so the result does not depend on the blocking.
_BLOCK = 1 << 16
_FLT_MAX = np.float32(3.4028235e38)
_HALF = np.float32(0.5)


@nb.njit(parallel=True, cache=True)
def mpicomp_threelc_max(x, r, use_r, s):
    """Return (M, ok): M = max|x + r| * s in float32 (clamped to FLT_MAX); ok False on NaN/Inf."""
    n = x.size
    nblocks = (n + _BLOCK - 1) // _BLOCK
    block_max = np.zeros(nblocks, np.float32)
    block_bad = np.zeros(nblocks, np.uint8)
    for b in nb.prange(nblocks):
        m = np.float32(0)
        bad = 0
        for i in range(b * _BLOCK, min(n, b * _BLOCK + _BLOCK)):
            v = x[i] + r[i] if use_r else x[i]
            a = abs(v)
            # False for NaN and Inf alike.
            if not (a <= _FLT_MAX):
                bad = 1
            m = max(m, a)
        block_max[b] = m
        block_bad[b] = bad
    m = np.float32(0)
    bad = 0
    for b in range(nblocks):
        m = max(m, block_max[b])
        bad |= block_bad[b]
    scale = m * np.float32(s)
    # max|x| * s can overflow for s > 1; FLT_MAX still bounds every |x| (trits stay exact).
    if scale > _FLT_MAX:
        scale = _FLT_MAX
    return scale, bad == 0


@nb.njit(parallel=True, cache=True)
def mpicomp_threelc_quartic_encode(x, r, use_r, scale, out):
    """Write byte j = sum_k (trit[k*L + j] + 1) * 3^(4-k) to out[j]; set r = (x + r) - trit*M."""
    n = x.size
    L = out.size
    scale = np.float32(scale)
    for j in nb.prange(L):
        byte = 0
        for k in range(5):
            i = k * L + j
            digit = 0  # the pad value
            if i < n:
                v = x[i] + r[i] if use_r else x[i]
                digit = 1
                # round-half-to-even(v / M) for |v / M| <= 1: exactly +-0.5 rounds to 0.
                if scale > np.float32(0):
                    q = v / scale
                    if q > _HALF:
                        digit = 2
                    elif q < -_HALF:
                        digit = 0
                if use_r:
                    if digit == 2:
                        r[i] = v - scale
                    elif digit == 0:
                        r[i] = v + scale
                    else:
                        r[i] = v
            byte = byte * 3 + digit
        out[j] = np.uint8(byte)


@nb.njit(cache=True)
def mpicomp_threelc_zero_run_encode(src, dst):
    """Write src with each run of k bytes 121 (2 <= k <= 14) replaced by 243 + k - 2; return length."""
    L = src.size
    i = 0
    k = 0
    while i < L:
        b = src[i]
        if b == ZERO_BYTE:
            j = i + 1
            while j < L and j - i < MAX_RUN and src[j] == ZERO_BYTE:
                j += 1
            run = j - i
            dst[k] = np.uint8(ZERO_BYTE if run == 1 else RUN_BASE + run - 2)
            i = j
        else:
            dst[k] = b
            i += 1
        k += 1
    return k


@nb.njit(cache=True)
def mpicomp_threelc_zero_run_length(src, limit):
    """Return the zero-run-decoded length of src, or -1 as soon as it exceeds ``limit``."""
    total = 0
    for i in range(src.size):
        b = np.int64(src[i])
        total += b - (RUN_BASE - 2) if b >= RUN_BASE else 1
        if total > limit:
            return -1
    return total


@nb.njit(cache=True)
def mpicomp_threelc_zero_run_decode(src, dst):
    """Expand codes 243..255 of src into 2..14 bytes 121 in dst; return False if dst is too short."""
    L = dst.size
    k = 0
    for i in range(src.size):
        b = np.int64(src[i])
        run = b - (RUN_BASE - 2) if b >= RUN_BASE else 1
        if k + run > L:
            return False
        if run == 1:
            dst[k] = np.uint8(b)
        else:
            for t in range(run):
                dst[k + t] = np.uint8(ZERO_BYTE)
        k += run
    return k == L


@nb.njit(parallel=True, cache=True)
def mpicomp_threelc_quartic_decode(src, scale, out):
    """Write out[k*L + j] = (digit k of src[j] - 1) * M; return an error code (0 if valid)."""
    n = out.size
    L = src.size
    scale = np.float32(scale)
    bad_byte = 0
    bad_pad = 0
    bad_zero = 0
    for j in nb.prange(L):
        b = np.int64(src[j])
        if b > MAX_QUARTIC:
            bad_byte += 1
            continue
        # Digits from the last partition (3^0) to the first (3^4).
        for k in range(4, -1, -1):
            digit = b % 3
            b //= 3
            i = k * L + j
            if i < n:
                if digit == 2:
                    out[i] = scale
                elif digit == 0:
                    out[i] = -scale
                else:
                    out[i] = np.float32(0)
                if digit != 1 and scale == np.float32(0):
                    bad_zero += 1
            elif digit != 0:
                bad_pad += 1
    if bad_byte:
        return ERR_BYTE
    if bad_pad:
        return ERR_PAD
    if bad_zero:
        return ERR_ZERO_SCALE
    return OK
