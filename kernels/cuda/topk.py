"""CUDA launchers of the top-k family (``topk.cu``), twins of ``kernels/cpu/topk.py``.

The launchers are the numba twin's ``scatter`` and ``select``, in its order, then
``all_finite`` (``kernels/cpu/checks.py`` on the numba side), each taking the device it
launches on before the twin's arguments (``launchers(dev)`` binds them); same outputs and
return values. ``select`` is a radix select of the k-th largest magnitude and a prefix-sum
compaction, all on the device. Each brings one flag or error code to the host:
``select`` and ``scatter`` through ``readback.read`` (later, with its batch, inside
one), ``all_finite`` at once.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.cuda import bind, contiguous, family_kernel
from mpicomp.kernels.cuda.device import int_kind
from mpicomp.kernels.readback import read

#: Elements per thread of a compaction tile (CUDA-side only: the result does not depend on it).
ITEMS = 8
DEFINES = {"MPICOMP_TOPK_ITEMS": str(ITEMS)}

_kernel = family_kernel("topk", DEFINES)

# Radix-select passes over the 31 bits of |x|'s pattern: (shift, bits), top digits first.
PASSES = ((20, 11), (10, 10), (0, 10))


def _kind(a, what: str) -> np.int32:
    """Return the kernels' code of index array ``a``'s dtype (bool is no index)."""
    if a.dtype == np.bool_:
        raise TypeError(f"topk {what}: indices must be integers, got bool")
    return int_kind(a, f"topk {what}: indices")


def _address(a) -> int:
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


def _aligned(a):
    # Payload views may start anywhere; a GPU faults on a misaligned word access.
    return a if _address(a) % a.itemsize == 0 else a.copy()


def _floats(dev, x, what: str):
    x = dev.flat(x)
    if x.dtype != np.float32:
        raise TypeError(f"topk {what}: values must be float32, got {x.dtype}")
    return _aligned(x).view(np.uint32)  # bit patterns: denormals survive -ftz


def scatter(dev, indices, values, n, out):
    """As ``kernels.cpu.topk.mpicomp_topk_scatter``: ``values`` at increasing ``indices`` < n
    into zeroed ``out``; returns 0, 1 (a bad index) or 2 (a value not finite)."""
    indices = _aligned(dev.flat(indices))
    values = _floats(dev, values, "scatter")
    if values.size < indices.size:
        raise ValueError(f"topk scatter: {values.size} values for {indices.size} indices")
    out = contiguous(out, "topk scatter", size=int(n))
    if out.dtype != np.float32:
        raise TypeError(f"topk scatter: out must be float32, got {out.dtype}")
    if indices.size == 0:
        return 0
    err = dev.xp.full(1, np.iinfo(np.uint64).max, np.uint64)  # min of j << 2 | code
    args = (indices, _kind(indices, "scatter"), np.int64(indices.size), values)
    args += (np.int64(n), out.view(np.uint32), err)
    _kernel(dev, "scatter")(*dev.launch_shape(indices.size), args)
    return read(dev, err, "topk.scatter: bad-index flag", _scatter_code)


def _scatter_code(host) -> int:
    err = int(host[0])
    return 0 if err == np.iinfo(np.uint64).max else err & 3


def select(dev, x, k, out_idx, out_val):
    """Write the top-``k`` (index, value) pairs of float32 ``x`` into the output arrays.

    Indices come out strictly increasing; of magnitudes tied at the threshold, the lower
    indices are kept. ``0 < k <= x.size``. Three histogram passes over the digits of
    |x|'s bit pattern find the threshold, a prefix sum over tiles places each kept pair.

    Returns:
        False if ``x`` holds NaN or Inf (the outputs are then undefined), else True.
    """
    u = _floats(dev, x, "select")
    n, k = u.size, int(k)
    if not 0 < k <= n:
        raise ValueError(f"topk select: k must lie in [1, {n}], got {k}")
    out_idx = contiguous(out_idx, "topk select", "out_idx", size=k)
    out_val = contiguous(out_val, "topk select", "out_val", size=k)
    if out_val.dtype != np.float32:
        raise TypeError(f"topk select: out_val must be float32, got {out_val.dtype}")
    kind = _kind(out_idx, "select")
    idx, val = _aligned(out_idx), _aligned(out_val)
    xp = dev.xp
    state = xp.asarray(np.array([0, k, 0], np.uint64))  # T's digits, left to find, NaN/Inf
    hist = xp.zeros(sum(1 << bits for _, bits in PASSES), np.uint64)
    at = 0
    for shift, bits in PASSES:
        h = hist[at : at + (1 << bits)]
        args = (u, np.int64(n), np.int32(shift), np.int32(bits), state, h)
        _kernel(dev, "histogram")(*dev.launch_shape(n), args)
        _kernel(dev, "choose")((1,), (32,), (h, np.int32(shift), np.int32(bits), state))
        at += 1 << bits
    ntiles = -(-n // (ITEMS * dev.threads))
    tiles = xp.empty((3, ntiles), np.int64)  # p > T, p == T (then before), output start
    gt, eq, start = tiles[0], tiles[1], tiles[2]
    blocks = dev.launch_shape(ntiles * dev.threads)
    _kernel(dev, "count")(*blocks, (u, np.int64(n), state, gt, eq))
    _kernel(dev, "scan")((1,), (dev.threads,), (np.int64(ntiles), state, gt, eq, start))
    args = (u, np.int64(n), state, eq, start, idx, kind, val.view(np.uint32))
    _kernel(dev, "write")(*blocks, args)
    if idx is not out_idx:
        out_idx[:k] = idx[:k]
    if val is not out_val:
        out_val[:k] = val[:k]
    return read(dev, state[2:3], "topk.select: non-finite flag", _clear)


def _clear(host) -> bool:
    return not host[0]


def all_finite(dev, x):
    """Return True if every element of float32 ``x`` is finite."""
    u = _floats(dev, x, "all_finite")
    if u.size == 0:
        return True
    flags = dev.xp.zeros(1, np.uint64)
    _kernel(dev, "all_finite")(*dev.launch_shape(u.size), (u, np.int64(u.size), flags))
    return not dev.to_host(flags, why="topk.all_finite: flag")[0]


def launchers(dev) -> SimpleNamespace:
    """Return the ``topk`` launchers bound to ``dev``."""
    return bind(dev, select=select, scatter=scatter, all_finite=all_finite)
