"""CUDA launchers of the top-k family (``topk.cu``), twins of ``kernels/cpu/topk.py``.

Same names, arguments, outputs and return values as the numba record's ``topk``:
``select`` (a radix select of the k-th largest magnitude and a prefix-sum compaction, all on
the device), ``scatter`` and ``all_finite``. Each brings one flag or error code to the host.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.cuda.device import int_kind

#: Elements per thread of a compaction tile (CUDA-side only: the result does not depend on it).
ITEMS = 8
DEFINES = {"MPICOMP_TOPK_ITEMS": str(ITEMS)}

# Radix-select passes over the 31 bits of |x|'s pattern: (shift, bits), top digits first.
PASSES = ((20, 11), (10, 10), (0, 10))


def _kind(a, what: str) -> np.int32:
    """Return the kernels' code of index array ``a``'s dtype (bool is no index)."""
    if a.dtype == np.bool_:
        raise TypeError(f"topk {what}: indices must be integers, got bool")
    return int_kind(a, f"topk {what}: indices")


def _address(a) -> int:
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


def launchers(dev) -> SimpleNamespace:
    """Return the ``topk`` launchers bound to ``dev``."""
    xp = dev.xp

    def kernel(name):
        return dev.kernel("topk", f"mpicomp_topk_{name}", DEFINES)

    def flat(a):
        return xp.ascontiguousarray(a).reshape(-1)

    def aligned(a):
        # Payload views may start anywhere; a GPU faults on a misaligned word access.
        return a if _address(a) % a.itemsize == 0 else a.copy()

    def floats(x, what):
        x = flat(x)
        if x.dtype != np.float32:
            raise TypeError(f"topk {what}: values must be float32, got {x.dtype}")
        return aligned(x).view(np.uint32)  # bit patterns: denormals survive -ftz

    def output(a, size, what):
        # The kernels write through a raw pointer: a strided view would be written wrongly.
        if not a.flags.c_contiguous:
            raise ValueError(f"topk {what}: output arrays must be C-contiguous")
        a = a.reshape(-1)
        if a.size < size:
            raise ValueError(f"topk {what}: an output has {a.size} elements, needs {size}")
        return a

    def grid(n):
        return (dev.grid(n),), (dev.threads,)

    def select(x, k, out_idx, out_val):
        """Write the top-``k`` (index, value) pairs of float32 ``x``, indices increasing; of
        magnitudes tied at the threshold the lower indices are kept (``0 < k <= x.size``).

        Returns:
            False if ``x`` holds NaN or Inf (nothing is written), else True.
        """
        u = floats(x, "select")
        n, k = u.size, int(k)
        if not 0 < k <= n:
            raise ValueError(f"topk select: k must lie in [1, {n}], got {k}")
        out_idx, out_val = output(out_idx, k, "select"), output(out_val, k, "select")
        if out_val.dtype != np.float32:
            raise TypeError(f"topk select: out_val must be float32, got {out_val.dtype}")
        kind = _kind(out_idx, "select")
        idx, val = aligned(out_idx), aligned(out_val)
        state = xp.asarray(np.array([0, k, 0], np.uint64))  # T's digits, left to find, NaN/Inf
        hist = xp.zeros(sum(1 << bits for _, bits in PASSES), np.uint64)
        at = 0
        for shift, bits in PASSES:
            h = hist[at : at + (1 << bits)]
            args = (u, np.int64(n), np.int32(shift), np.int32(bits), state, h)
            kernel("histogram")(*grid(n), args)
            kernel("choose")((1,), (32,), (h, np.int32(shift), np.int32(bits), state))
            at += 1 << bits
        ntiles = -(-n // (ITEMS * dev.threads))
        tiles = xp.empty((3, ntiles), np.int64)  # p > T, p == T (then before), output start
        gt, eq, start = tiles[0], tiles[1], tiles[2]
        blocks = (dev.grid(ntiles * dev.threads),), (dev.threads,)
        kernel("count")(*blocks, (u, np.int64(n), state, gt, eq))
        kernel("scan")((1,), (dev.threads,), (np.int64(ntiles), state, gt, eq, start))
        args = (u, np.int64(n), state, eq, start, idx, kind, val.view(np.uint32))
        kernel("write")(*blocks, args)
        if dev.to_host(state[2:], why="topk.select: non-finite flag")[0]:
            return False
        if idx is not out_idx:
            out_idx[:k] = idx[:k]
        if val is not out_val:
            out_val[:k] = val[:k]
        return True

    def scatter(indices, values, n, out):
        """Scatter ``values`` at strictly increasing ``indices`` < n into zeroed ``out``.

        Returns 0 on success, 1 if an index is out of range or not increasing, 2 if a
        value is not finite (then ``out`` is incomplete and must be discarded).
        """
        indices = aligned(flat(indices))
        values = floats(values, "scatter")
        if values.size < indices.size:
            raise ValueError(f"topk scatter: {values.size} values for {indices.size} indices")
        out = output(out, int(n), "scatter")
        if out.dtype != np.float32:
            raise TypeError(f"topk scatter: out must be float32, got {out.dtype}")
        if indices.size == 0:
            return 0
        err = xp.full(1, np.iinfo(np.uint64).max, np.uint64)  # min of j << 2 | code
        args = (indices, _kind(indices, "scatter"), np.int64(indices.size), values)
        args += (np.int64(n), out.view(np.uint32), err)
        kernel("scatter")(*grid(indices.size), args)
        err = int(dev.to_host(err, why="topk.scatter: bad-index flag")[0])
        return 0 if err == np.iinfo(np.uint64).max else err & 3

    def all_finite(x):
        """Return True if every element of float32 ``x`` is finite."""
        u = floats(x, "all_finite")
        if u.size == 0:
            return True
        flags = xp.zeros(1, np.uint64)
        kernel("all_finite")(*grid(u.size), (u, np.int64(u.size), flags))
        return not dev.to_host(flags, why="topk.all_finite: flag")[0]

    return SimpleNamespace(select=select, scatter=scatter, all_finite=all_finite)
