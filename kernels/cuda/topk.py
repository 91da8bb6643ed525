"""CUDA launchers of the top-k family (``topk.cu``), twins of ``kernels/cpu/topk.py``.

The launchers are the numba twin's ``scatter`` and ``select``, in its order, then
``all_finite`` (``kernels/cpu/checks.py`` on the numba side), each taking the device it
launches on before the twin's arguments (``launchers(dev)`` binds them); same outputs and
return values. ``select`` is a radix select of the k-th largest magnitude and a prefix-sum
compaction, all on the device. Each brings one flag or error code to the host:
``select`` and ``scatter`` through ``readback.read`` (later, with its batch, inside
one), ``all_finite`` at once. ``select`` reads x three times where the threshold's top-digit bin
fits its candidate buffer (topk.cu: the scheme; docs/kernels.md: the bytes).
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
#: Groups of 4 elements a thread loads per round of the histogram pass (topk.cu: TOPK_ROWS).
ROWS = 2
#: The candidate buffer holds n // CAND_SHARE patterns, at least CAND_MIN (at most n): the
#: threshold's top-digit bin (1/8 of an octave) is mostly far smaller; where it is not (many
#: equal magnitudes), the last digit and the counts are taken from x.
CAND_SHARE = 8
CAND_MIN = 1024


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
    indices are kept. ``0 < k <= x.size``. A radix select of the threshold over the digits of
    |x|'s bit pattern: a histogram pass over x, a pass that also keeps the elements of the
    threshold's top-digit bin (the candidates, when they fit a buffer of ``_room(n)``), the
    last digit from the candidates; then a prefix sum over tiles places each kept pair, and a
    pass over x writes them (topk.cu explains the scheme).

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
    # T's digits, left to find, NaN/Inf, candidates fit, candidates kept.
    state = xp.asarray(np.array([0, k, 0, 0, 0], np.uint64))
    hist = xp.zeros(sum(1 << bits for _, bits in PASSES), np.uint64)
    h1, h2, h3 = hist[:2048], hist[2048:3072], hist[3072:]
    cap = _room(n)
    cand = xp.empty(cap, np.uint32)
    ntiles = -(-n // (ITEMS * dev.threads))
    tiles = xp.empty(6 * (ntiles + 1), np.int64)
    above, pairs = tiles[:ntiles], tiles[ntiles : 3 * ntiles]  # above T's bin; (start, count)
    gt, eq = tiles[3 * ntiles : 4 * ntiles], tiles[4 * ntiles : 5 * ntiles + 1]
    start = tiles[5 * ntiles + 1 :]
    n64, cap64, nt64 = np.int64(n), np.int64(cap), np.int64(ntiles)
    rows = _grid(dev, -(-n // (ROWS * 4 * dev.threads)), n)  # passes over rows of groups
    over_tiles = _grid(dev, ntiles, n)
    choose = (1,), (dev.threads,)
    (shift1, bits1), (shift2, bits2), (shift3, bits3) = PASSES
    _kernel(dev, "histogram")(*rows, (u, n64, np.int32(shift1), np.int32(bits1), state, h1))
    _kernel(dev, "choose")(*choose, (h1, np.int32(shift1), np.int32(bits1), cap64, state))
    _kernel(dev, "refine")(*over_tiles, (u, n64, state, h2, cand, above, pairs))
    _kernel(dev, "choose")(*choose, (h2, np.int32(shift2), np.int32(bits2), cap64, state))
    # The last digit: from the candidates, or (they did not fit) from x; the other returns.
    _kernel(dev, "histogram_cand")(*dev.launch_shape(cap), (cand, state, h3))
    _kernel(dev, "histogram")(*rows, (u, n64, np.int32(shift3), np.int32(bits3), state, h3))
    _kernel(dev, "choose")(*choose, (h3, np.int32(shift3), np.int32(bits3), cap64, state))
    tally = _grid(dev, -(-ntiles * 32 // dev.threads), n)
    _kernel(dev, "tally")(*tally, (nt64, state, cand, above, pairs, gt, eq))
    _kernel(dev, "count")(*over_tiles, (u, n64, state, gt, eq))
    _kernel(dev, "scan")((1,), (min(1024, 4 * dev.threads),), (nt64, state, gt, eq, start))
    args = (u, n64, state, eq, start, idx, kind, val.view(np.uint32))
    _kernel(dev, "write")(*over_tiles, args)
    if idx is not out_idx:
        out_idx[:k] = idx[:k]
    if val is not out_val:
        out_val[:k] = val[:k]
    return read(dev, state[2:3], "topk.select: non-finite flag", _clear)


def _room(n: int) -> int:
    """Return the size of the candidate buffer for ``n`` elements (CAND_SHARE, CAND_MIN)."""
    return int(min(n, max(CAND_MIN, n // CAND_SHARE)))


def _grid(dev, blocks: int, n: int) -> tuple[tuple[int], tuple[int]]:
    """Return (grid, block) for ``blocks`` blocks of work: at most twice the device's
    grid-stride blocks (on a GPU, 8 blocks of 256 threads per SM), and enough that no block
    counts 2^31 elements (the histograms' per-block counts are 32-bit)."""
    most = max(2 * dev.max_blocks, -(-n // (1 << 31)))
    return (int(max(1, min(blocks, most))),), (dev.threads,)


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
    return bind(dev, "topk")
