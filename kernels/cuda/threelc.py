"""CUDA launchers of the 3LC family (``threelc.cu``), twins of ``kernels/cpu/threelc.py``.

The launchers are the numba twin's, in its order, each taking the device it launches on
before the twin's arguments (``launchers(dev)`` binds them; ``max`` is ``max_`` here, so
as not to hide the builtin). M stays on the device: ``max`` writes its 4 bytes (the
payload's) into ``scale`` when given, and ``quartic_encode`` / ``quartic_decode`` take
them there (or a float). What comes back to the host (one counted read each, through
``readback.read``: later, with its batch, inside one): M with its NaN/Inf mark in
``max``, the length in ``zero_run_encode`` / ``zero_run_length`` / ``zero_run_decode``,
the error flags in ``quartic_decode``. ``quartic_encode`` reads nothing.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels import threelc as k3
from mpicomp.kernels.cuda import bind, family_kernel
from mpicomp.kernels.readback import read

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


def _scale_value(host) -> float:
    """Return M of its 4 bytes as ``max`` returns it: 0.0 for the NaN mark of NaN/Inf."""
    m = host.view("<f4")[0]
    return 0.0 if np.isnan(m) else float(m)


def _finite(host) -> bool:
    return not np.isnan(host.view("<f4")[0])


def _scale_bytes(dev, scale):
    """Return M's 4 bytes on the device: ``scale`` itself, or those of a float."""
    if hasattr(scale, "dtype") and getattr(scale, "ndim", 0) == 1:
        if scale.dtype != np.uint8 or scale.size != 4:
            raise ValueError("threelc: scale must be a float or its 4 uint8 bytes")
        return scale
    return dev.xp.asarray(np.asarray(np.float32(scale)).reshape(1).view(np.uint8))


def max_(dev, x, r, use_r, s, scale=None):
    """Return (M, ok): M = max|x + r| * s in float32 (clamped to FLT_MAX); ok False on NaN/Inf
    (M then 0.0). ``scale``, 4 uint8 on the device, receives M's bytes (a quiet NaN when not
    ok): M is computed there, rounded as the twin's float32 product (denormals kept)."""
    n = x.size
    top = dev.xp.zeros(1, dtype=np.uint32)
    scale = dev.xp.empty(4, dtype=np.uint8) if scale is None else _scale_bytes(dev, scale)
    _kernel(dev, "max")(*dev.launch_shape(n), (x, r, np.int32(bool(use_r)), np.int64(n), top))
    s_bits = np.float32(s).view(np.uint32)
    _kernel(dev, "scale")((1,), (32,), (top, s_bits, scale))
    why = "threelc.max: M"
    return read(dev, scale, why, _scale_value), read(dev, scale, why, _finite)


def quartic_encode(dev, x, r, use_r, scale, out):
    """Write byte j = sum_k (trit[k*L + j] + 1) * 3^(4-k) to out[j]; set r = (x + r) - trit*M.
    M: a float or its 4 bytes (``max``'s); a NaN M writes nothing."""
    n, L = x.size, out.size
    scale = _scale_bytes(dev, scale)
    args = (x, r, np.int32(bool(use_r)), scale, np.int64(n), np.int64(L), out)
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
    return read(dev, total, "threelc.zero_run_encode: length", _first_int)


def _first_int(host) -> int:
    return int(host[0])


def zero_run_length(dev, src, limit):
    """Return the zero-run-decoded length of src, or -1 as soon as it exceeds ``limit``."""
    if src.size == 0:
        return 0  # the twin compares with limit only after a byte
    limit = int(limit)

    def length(host) -> int:
        # Every byte adds >= 1: the running total exceeds limit at some point iff at the end.
        total = int(host[0])
        return -1 if total > limit else total

    total = _decoded_length(dev, src)[0]
    return read(dev, total, "threelc.zero_run_length: length", length)


def zero_run_decode(dev, src, dst):
    """Expand codes 243..255 of src into 2..14 bytes 121 in dst (what falls past dst is
    dropped, the rest of dst is 121); return the length of the whole expansion."""
    total, offs, geo = _decoded_length(dev, src)
    Ld = dst.size
    _kernel(dev, "zero_run_expand")(
        (max(int(geo[2]), dev.grid(Ld)),),
        (dev.threads,),
        (src, *geo, offs, total, dst, np.int64(Ld)),
    )
    return read(dev, total, "threelc.zero_run_decode: length", _first_int)


def _code(host) -> int:
    bad = int(host[0])
    for flag, code in (
        (_BAD_BYTE, k3.ERR_BYTE),
        (_BAD_PAD, k3.ERR_PAD),
        (_BAD_ZERO, k3.ERR_ZERO_SCALE),
    ):
        if bad & flag:
            return code
    return k3.OK


def quartic_decode(dev, src, scale, out):
    """Write out[k*L + j] = (digit k of src[j] - 1) * M; return an error code (0 if valid).
    M: a float or its 4 bytes (a payload's, on the device). Nothing is written on error."""
    L, n = src.size, out.size
    if L == 0:
        return k3.OK
    scale = _scale_bytes(dev, scale)
    flags = dev.xp.zeros(1, dtype=np.uint32)
    _kernel(dev, "quartic_check")(
        *dev.launch_shape(L), (src, np.int64(L), np.int64(n), scale, flags)
    )
    args = (src, scale, np.int64(L), np.int64(n), flags, out.view(np.uint32))
    _kernel(dev, "quartic_decode")(*dev.launch_shape(L), args)
    return read(dev, flags, "threelc.quartic_decode: bad-code flag", _code)


def launchers(dev) -> SimpleNamespace:
    """Return the ``threelc`` launchers bound to ``dev``."""
    return bind(dev, "threelc")
