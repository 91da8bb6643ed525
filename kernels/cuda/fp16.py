"""CUDA launchers of the float16 family (``fp16.cu``), twins of ``kernels/cpu/fp16.py``.

The launchers are the numba twin's ``add``, ``all_finite``, ``encode`` and ``decode``, in
its order, each taking the device it launches on before the twin's arguments
(``launchers(dev)`` binds them). ``encode``, ``decode`` and ``all_finite`` bring one small
array of per-block partials to the host (one counted synchronization each; ``decode``'s
through ``readback.read``: later in a batch, never inside ``readback.ignored()``); ``add``
none. The kernels move groups of 4 elements per vector access, ``ROWS`` groups per thread
and round, on a grid that fills the GPU (``_shape``; fp16.cu explains the scheme).

NaN results follow x86's rule as the numba twin's (see fp16.cu). Where ``decode`` divides
and the quotient falls below 2^-126, the kernel rounds it onto the denormal grid from the
double quotient: exact, because a quotient of two floats is never within half a double ulp
of a midpoint of the float grid unless it is that midpoint. A scale that is itself a
float32 denormal is flushed to zero on a GPU (``-ftz=true``): there the quotient is Inf.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.checksum import BASE, combine
from mpicomp.kernels.cuda import bind, contiguous, family_kernel
from mpicomp.kernels.readback import read

#: Threads per block of the element kernels at most (their __launch_bounds__).
THREADS = 256
#: Groups of 4 elements a thread moves per round, by kernel (fp16.cu: ROWS).
ROWS = {"encode": 2, "decode": 4, "decode_scaled": 2, "add": 2, "all_finite": 4}
#: Blocks of THREADS per SM each kernel is compiled to fit (__launch_bounds__: at most
#: 65536 / (256 * b) registers a thread; ptxas fits these without spills).
BLOCKS = {"encode": 5, "decode": 6, "decode_scaled": 4, "add": 7, "all_finite": 6}
DEFINES = {"MPICOMP_ADLER_BASE": f"{BASE}ull", "MPICOMP_FP16_THREADS": str(THREADS)}
DEFINES.update({f"MPICOMP_FP16_BLOCKS_{k.upper()}": str(b) for k, b in BLOCKS.items()})

_kernel = family_kernel("fp16", DEFINES)


def _shape(dev, name: str, n: int) -> tuple[tuple[int], tuple[int]]:
    """Return the (grid, block) of kernel ``name`` over ``n`` elements: a thread per ROWS groups
    of 4 per round, and one wave of blocks: ``Device.cuda``'s ``max_blocks`` is 4 blocks of 256
    threads per SM, the kernel fits BLOCKS[name] (its grid-stride rounds give every block the
    same work, so a second, partial wave would leave SMs idle at the end)."""
    threads = min(dev.threads, THREADS)
    most = max(1, dev.max_blocks * BLOCKS[name] // 4) * max(1, dev.threads // threads)
    per_block = 4 * ROWS[name] * threads
    return (int(max(1, min(-(-n // per_block), most))),), (threads,)


def _same_size(what: str, a, b) -> None:
    # The kernels index both arrays by one counter: a short one would be written past.
    if a.ndim != 1 or b.ndim != 1 or a.size != b.size:
        raise ValueError(f"{what}: arrays of shapes {a.shape} and {b.shape}, need equal 1-D sizes")


def _contiguous(what: str, **arrays) -> None:
    for name, a in arrays.items():
        contiguous(a, what, name)


def add(dev, a, b) -> None:
    """Set float16-bits array ``b`` (uint16) to float16(float32(a) + float32(b))."""
    _same_size("fp16 add", a, b)
    _contiguous("fp16 add", a=a, b=b)
    if b.size:
        _kernel(dev, "add")(*_shape(dev, "add", b.size), (a, b, np.int64(b.size)))


def all_finite(dev, h):
    """Return True if no float16 bits of ``h`` (uint16) are NaN or Inf (exponent all ones)."""
    h = dev.flat(h)
    if h.size == 0:
        return True
    shape = _shape(dev, "all_finite", h.size)
    flags = dev.xp.empty(shape[0][0], np.uint32)
    _kernel(dev, "all_finite")(*shape, (h, np.int64(h.size), flags))
    return not dev.to_host(flags, why="fp16.all_finite: flags").any()


def encode(dev, x, h16, h8=None):
    """As ``kernels.cpu.fp16.encode``: float32 ``x`` rounded to float16 bits in ``h16``;
    (ok, Adler-32 of ``h8`` or 0). One kernel pass; per-block flags and byte sums are
    brought to the host once and combined there."""
    _same_size("fp16 encode", x, h16)
    if h8 is not None and h8.size != 2 * h16.size:
        raise ValueError(f"fp16 encode: h8 has {h8.size} bytes, h16 needs {2 * h16.size}")
    _contiguous("fp16 encode", x=x, h16=h16)
    n = x.size
    if n == 0:
        return True, 0
    shape = _shape(dev, "encode", n)
    blocks = shape[0][0]
    partials = dev.xp.empty(3 * blocks, np.uint64)
    want = np.int32(h8 is not None)
    args = (x.view(np.uint32), h16, np.int64(n), want, partials)
    _kernel(dev, "encode")(*shape, args)
    p = dev.to_host(partials, why="fp16.encode: block flags and sums").reshape(blocks, 3)
    if not want:
        return not p[:, 0].any(), 0
    # Exact sums mod BASE: s2 of the bytes from (0, 0) is m * s1 - sum(i * b_i).
    s1 = int(p[:, 1].sum()) % BASE
    s2 = (2 * n * s1 - int(p[:, 2].sum())) % BASE
    return not p[:, 0].any(), combine(0, (s2 << 16) | s1, 2 * n)


def decode(dev, h16, out, scale=1.0) -> bool:
    """As ``kernels.cpu.fp16.decode``: ``out`` = float16 bits ``h16`` as float32, / ``scale``;
    False when some value is NaN/Inf."""
    _same_size("fp16 decode", h16, out)
    _contiguous("fp16 decode", h16=h16, out=out)
    n = h16.size
    if n == 0:
        return True
    by = np.float32(scale)
    divide = by != np.float32(1)
    if divide and by == 0:
        raise ZeroDivisionError("division by zero")  # as the numba twin raises
    name = "decode_scaled" if divide else "decode"
    shape = _shape(dev, name, n)
    flags = dev.xp.empty(shape[0][0], np.uint32)
    args = (h16, out.view(np.uint32), np.int64(n)) + ((by,) if divide else ()) + (flags,)
    _kernel(dev, name)(*shape, args)
    return read(dev, flags, "fp16.decode: non-finite flags", _none_set)


def _none_set(flags) -> bool:
    return not flags.any()


def launchers(dev) -> SimpleNamespace:
    """Return the ``fp16`` launchers bound to ``dev``."""
    return bind(dev, "fp16")
