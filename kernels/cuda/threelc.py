"""CUDA launchers of the 3LC family (``threelc.cu``), twins of ``kernels/cpu/threelc.py``.

The launchers are the numba twin's, in its order, each taking the device it launches on
before the twin's arguments (``launchers(dev)`` binds them; ``max`` is ``max_`` here, so
as not to hide the builtin). What comes back to the host (one counted sync each): the max
pattern in ``max``, the length in ``zero_run_encode`` / ``zero_run_length`` /
``zero_run_decode``, the error flags in ``quartic_decode``. ``quartic_encode`` syncs
nothing.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels import threelc as k3
from mpicomp.kernels.cuda import bind, family_kernel

#: Bytes per thread of a zero-run tile (a tile is threads * ITEMS bytes of one span).
ITEMS = 8
# Error flags of the quartic check; the launcher maps them to the twin's codes in its order.
_BAD_BYTE, _BAD_PAD, _BAD_ZERO = 1, 2, 4

DEFINES = {
    "MPICOMP_THREELC_ZERO_BYTE": str(k3.ZERO_BYTE),
    "MPICOMP_THREELC_MAX_QUARTIC": str(k3.MAX_QUARTIC),
    "MPICOMP_THREELC_RUN_BASE": str(k3.RUN_BASE),
    "MPICOMP_THREELC_MAX_RUN": str(k3.MAX_RUN),
    "MPICOMP_THREELC_ITEMS": str(ITEMS),
    "MPICOMP_THREELC_BAD_BYTE": f"{_BAD_BYTE}u",
    "MPICOMP_THREELC_BAD_PAD": f"{_BAD_PAD}u",
    "MPICOMP_THREELC_BAD_ZERO": f"{_BAD_ZERO}u",
}

_EXP_MASK = 0x7F800000
_FLT_MAX = np.float32(3.4028235e38)


_kernel = family_kernel("threelc", DEFINES)


def _spans(dev, size: int) -> tuple[int, int]:
    """Return (nspans, span): one span per block, at least a tile each."""
    nspans = max(1, min(dev.max_blocks, -(-size // (dev.threads * ITEMS))))
    return nspans, max(1, -(-size // nspans))


def _decoded_length(dev, src):
    """Return (total, offs, (L, span, nspans)) of src's zero-run expansion, on the device."""
    L = src.size
    nspans, span = _spans(dev, L)
    sums, offs = (dev.xp.empty(nspans, dtype=np.int64) for _ in range(2))
    total = dev.xp.empty(1, dtype=np.int64)
    geo = (np.int64(L), np.int64(span), np.int64(nspans))
    _kernel(dev, "zero_run_sums")((nspans,), (dev.threads,), (src, *geo, sums))
    _kernel(dev, "zero_run_offsets")((1,), (32,), (sums, np.int64(nspans), offs, total))
    return total, offs, geo


def max_(dev, x, r, use_r, s):
    """Return (M, ok): M = max|x + r| * s in float32 (clamped to FLT_MAX); ok False on NaN/Inf."""
    n = x.size
    top = dev.xp.zeros(1, dtype=np.uint32)
    _kernel(dev, "max")(*dev.launch_shape(n), (x, r, np.int32(bool(use_r)), np.int64(n), top))
    top = np.uint32(dev.to_host(top, why="threelc.max: largest magnitude")[0])
    if top >= _EXP_MASK:
        return 0.0, False
    # The product on the host, in NumPy float32: a GPU would flush a denormal max to zero.
    with np.errstate(over="ignore"):
        scale = top.view(np.float32) * np.float32(s)
    return float(min(scale, _FLT_MAX)), True


def quartic_encode(dev, x, r, use_r, scale, out):
    """Write byte j = sum_k (trit[k*L + j] + 1) * 3^(4-k) to out[j]; set r = (x + r) - trit*M."""
    n, L = x.size, out.size
    args = (x, r, np.int32(bool(use_r)), np.float32(scale), np.int64(n), np.int64(L), out)
    _kernel(dev, "quartic_encode")(*dev.launch_shape(L), args)


def zero_run_encode(dev, src, dst):
    """Write src with each run of k bytes 121 (2 <= k <= 14) replaced by 243 + k - 2; return length."""
    L = src.size
    if L == 0:
        return 0
    nspans, span = _spans(dev, L)
    last, lead, rest, pin, offs = (dev.xp.empty(nspans, dtype=np.int64) for _ in range(5))
    total = dev.xp.empty(1, dtype=np.int64)
    geo = (np.int64(L), np.int64(span), np.int64(nspans))
    _kernel(dev, "zero_run_summary")((nspans,), (dev.threads,), (src, *geo, last, lead, rest))
    _kernel(dev, "zero_run_tail")(
        (1,), (32,), (last, lead, rest, np.int64(nspans), *geo[:2], pin, offs, total)
    )
    _kernel(dev, "zero_run_write")((nspans,), (dev.threads,), (src, *geo, pin, offs, dst))
    return int(dev.to_host(total, why="threelc.zero_run_encode: length")[0])


def zero_run_length(dev, src, limit):
    """Return the zero-run-decoded length of src, or -1 as soon as it exceeds ``limit``."""
    if src.size == 0:
        return 0  # the twin compares with limit only after a byte
    total = int(dev.to_host(_decoded_length(dev, src)[0], why="threelc.zero_run_length: length")[0])
    # Every byte adds >= 1: the running total exceeds limit at some point iff at the end.
    return -1 if total > int(limit) else total


def zero_run_decode(dev, src, dst):
    """Expand codes 243..255 of src into 2..14 bytes 121 in dst; return False if dst is too short."""
    total, offs, geo = _decoded_length(dev, src)
    Ld = dst.size
    _kernel(dev, "zero_run_expand")(
        (max(int(geo[2]), dev.grid(Ld)),),
        (dev.threads,),
        (src, *geo, offs, total, dst, np.int64(Ld)),
    )
    # A byte past dst makes the total exceed it: False exactly when the twin's is.
    return int(dev.to_host(total, why="threelc.zero_run_decode: length")[0]) == Ld


def quartic_decode(dev, src, scale, out):
    """Write out[k*L + j] = (digit k of src[j] - 1) * M; return an error code (0 if valid)."""
    L, n = src.size, out.size
    if L == 0:
        return k3.OK
    scale = np.float32(scale)
    flags = dev.xp.zeros(1, dtype=np.uint32)
    # M == 0 decided here, in IEEE: a GPU comparison would take a denormal M for zero.
    zero = np.int32(scale == np.float32(0))
    _kernel(dev, "quartic_check")(
        *dev.launch_shape(L), (src, np.int64(L), np.int64(n), zero, flags)
    )
    bad = int(dev.to_host(flags, why="threelc.quartic_decode: bad-code flag")[0])
    for flag, code in (
        (_BAD_BYTE, k3.ERR_BYTE),
        (_BAD_PAD, k3.ERR_PAD),
        (_BAD_ZERO, k3.ERR_ZERO_SCALE),
    ):
        if bad & flag:
            return code
    args = (src, scale.view(np.uint32), np.int64(L), np.int64(n), out.view(np.uint32))
    _kernel(dev, "quartic_decode")(*dev.launch_shape(L), args)
    return k3.OK


def launchers(dev) -> SimpleNamespace:
    """Return the ``threelc`` launchers bound to ``dev``."""
    return bind(
        dev,
        max=max_,
        quartic_encode=quartic_encode,
        zero_run_encode=zero_run_encode,
        zero_run_length=zero_run_length,
        zero_run_decode=zero_run_decode,
        quartic_decode=quartic_decode,
    )
