"""The blocks of QSGD-MaxNorm's norms: which elements share one norm.

A coded vector of m elements (x, or GlobalRandK's x[coordinates]) holds its tensors end
to end, its *segments* (one for a lone tensor, one per member for a fused bucket). Each
segment is cut into blocks of ``block`` consecutive elements, the last one shorter, and no
block crosses a segment's end; ``block=0`` makes each segment one block. Every rank cuts
the same blocks: they depend on (m, segments, block) alone. Empty segments have no block.

The kernels take a cut as ``starts`` (block b: starts[b] <= i < starts[b + 1]) and
``regular`` (> 0: block b is [b * regular, (b + 1) * regular), a lone segment cut every
``regular`` elements); the block norms add *pieces*, a block cut every CHUNK elements from
its start (``pieces``, and ``first[b]``: block b's first piece), as kernels/qsgd.py says.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from mpicomp.kernels import place
from mpicomp.kernels.qsgd import CHUNK

_KEEP = 64  # cuts a codec keeps per (device, segments, block), the newest first


class Blocks(NamedTuple):
    """One cut of a coded vector: int64 ``starts`` (count + 1), ``pieces`` and ``first``
    (arrays of one device) and ``regular``."""

    starts: object
    pieces: object
    first: object
    regular: int

    @property
    def count(self) -> int:
        """The number of blocks (of norms)."""
        return self.starts.size - 1


def _ranges(lo: np.ndarray, lengths: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (the starts of [lo, lo + length) cut every ``step`` elements, for every range
    in order; the index of each range's first cut, and the total, as a prefix sum)."""
    per = -(-lengths // step)
    first = np.zeros(per.size + 1, np.int64)
    np.cumsum(per, out=first[1:])
    offset = np.arange(first[-1], dtype=np.int64) - np.repeat(first[:-1], per)
    return np.repeat(lo, per) + offset * step, first


def cut(segments: tuple[int, ...], block: int) -> Blocks:
    """Return the host arrays of the blocks of ``segments`` (sizes, end to end) cut every
    ``block`` elements (0: one block per segment)."""
    sizes = np.array([s for s in segments if s > 0], np.int64)
    m = int(sizes.sum())
    ends = np.cumsum(sizes)
    if block == 0:
        starts = np.concatenate([[0], ends]).astype(np.int64)
    else:
        lo, _ = _ranges(ends - sizes, sizes, block)
        starts = np.append(lo, np.int64(m))
    lo, first = _ranges(starts[:-1], np.diff(starts), CHUNK)
    pieces = np.append(lo, np.int64(m))
    regular = block if block > 0 and sizes.size <= 1 else 0
    return Blocks(starts, pieces, first, regular)


def member_sizes(numel: int, shapes) -> tuple[int, ...]:
    """Return the sizes of the tensors ``shapes`` names, checked to hold ``numel`` elements
    end to end; ``(numel,)`` for None or no shapes (one tensor).

    Raises:
        ValueError: a shape is not non-negative integers, or they do not add to ``numel``.
    """
    if shapes is None or len(shapes) == 0:
        return (numel,)
    sizes = []
    for shape in shapes:
        dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
            raise ValueError(f"shapes must hold shapes of non-negative integers, got {shape!r}")
        sizes.append(math.prod(int(d) for d in dims))
    if sum(sizes) != numel:
        raise ValueError(f"shapes hold {sum(sizes)} elements end to end, x has {numel}")
    return tuple(sizes)


class Cuts:
    """The cuts a codec used recently, on the devices it used them on."""

    def __init__(self):
        self._cache = OrderedDict()

    def on(self, kernels, segments: tuple[int, ...], block: int) -> Blocks:
        """Return the cut of ``segments`` every ``block`` elements on ``kernels``' device."""
        at = (place(kernels), segments, block)
        hit = self._cache.get(at)
        if hit is not None:
            self._cache.move_to_end(at)
            return hit
        host = cut(segments, block)
        xp = kernels.xp
        made = Blocks(*(xp.asarray(a) for a in host[:3]), host.regular)
        self._cache[at] = made
        while len(self._cache) > _KEEP:
            self._cache.popitem(last=False)
        return made
