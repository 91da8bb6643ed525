"""CUDA launchers of the bit-packing family (``bits.cu``), twins of ``kernels/cpu/bits.py``.

The launchers are the numba twin's, in its order, each taking the device it launches on
before the twin's arguments (``launchers(dev)`` binds them): codes of any integer dtype,
streams of uint8 in ``kernels/bits.py``'s layout, results written into the caller's
arrays. Packing launches one thread per 32-bit output word, unpacking one per element;
nothing comes back to the host.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.bits import MAX_WIDTH, packed_size
from mpicomp.kernels.cuda import bind, contiguous, family_kernel
from mpicomp.kernels.cuda.device import int_kind

DEFINES = {"MPICOMP_BITS_MAX_WIDTH": str(MAX_WIDTH)}

_kernel = family_kernel("bits", DEFINES)


def _width(width, what: str) -> np.int32:
    if not 1 <= int(width) <= MAX_WIDTH:
        raise ValueError(f"bits {what}: width must lie in [1, {MAX_WIDTH}], got {width!r}")
    return np.int32(width)


def _out(a, what: str, size: int = 0, view=None):
    """Return output array ``a`` flat (``contiguous``): codes of any integer dtype, or a
    stream's bytes (``view`` uint8, ``size`` in bytes)."""
    if a.dtype == np.bool_:
        raise TypeError(f"bits {what}: need an integer output array, got bool")
    return contiguous(a, f"bits {what}", size=size, view=view)


def _words(dev, nbytes: int):
    """Return the (grid, block) of one thread per 32-bit word of an ``nbytes`` stream."""
    return dev.launch_shape((nbytes + 3) // 4)


def pack_shifted(dev, codes, shift, width, out):
    """Pack codes[i] + shift (integer codes of any dtype; each sum in [0, 2**width)) into ``out``."""
    codes = dev.flat(codes, codes=True)
    w = _width(width, "pack_shifted")
    nbytes = packed_size(codes.size, int(w))
    out = _out(out, "pack_shifted", nbytes, np.uint8)
    if nbytes:
        args = (codes, int_kind(codes, "bits pack_shifted"), np.int64(codes.size), np.int64(shift))
        _kernel(dev, "pack_shifted")(*_words(dev, nbytes), (*args, w, out, np.int64(nbytes)))


def unpack_shifted(dev, stream, width, shift, out):
    """Write out[i] = (code i of ``stream``) - shift, for the out.size codes of ``width`` bits."""
    stream = dev.flat(stream, np.uint8)
    w = _width(width, "unpack_shifted")
    out = _out(out, "unpack_shifted")
    if out.size:
        args = (stream, np.int64(stream.size), w, np.int64(shift), out)
        args += (int_kind(out, "bits unpack_shifted"), np.int64(out.size))
        _kernel(dev, "unpack_shifted")(*dev.launch_shape(out.size), args)


def pack(dev, codes, width, out):
    """Pack unsigned ``codes`` (< 2**width, width 1..32) into ``out``, LSB-first."""
    pack_shifted(dev, codes, 0, width, out)


def unpack(dev, stream, width, out):
    """Unpack ``out.size`` codes of ``width`` bits (1..32) from ``stream``, LSB-first."""
    unpack_shifted(dev, stream, width, 0, out)


def add_repack(dev, stream, width, mine, shift, out_width, out):
    """As ``kernels.cpu.bits.mpicomp_bits_add_repack``: pack (code i of ``stream``) + mine[i]
    + shift at ``out_width`` bits into ``out`` (one ring step)."""
    stream, mine = dev.flat(stream, np.uint8), dev.flat(mine, codes=True)
    w, ow = _width(width, "add_repack"), _width(out_width, "add_repack")
    nbytes = packed_size(mine.size, int(ow))
    out = _out(out, "add_repack", nbytes, np.uint8)
    if nbytes:
        args = (stream, np.int64(stream.size), w, mine, int_kind(mine, "bits add_repack"))
        args += (np.int64(mine.size), np.int64(shift), ow, out, np.int64(nbytes))
        _kernel(dev, "add_repack")(*_words(dev, nbytes), args)


def add_unpack(dev, stream, width, mine, shift, out):
    """Write out[i] = (code i of ``stream``) + mine[i] + shift: a ring step's sums, unpacked."""
    stream, mine = dev.flat(stream, np.uint8), dev.flat(mine, codes=True)
    w = _width(width, "add_unpack")
    out = _out(out, "add_unpack", mine.size)
    if mine.size:
        args = (stream, np.int64(stream.size), w, mine, int_kind(mine, "bits add_unpack"))
        args += (np.int64(shift), out, int_kind(out, "bits add_unpack"), np.int64(mine.size))
        _kernel(dev, "add_unpack")(*dev.launch_shape(mine.size), args)


def min_repack(dev, stream, width, mine, out):
    """Pack min(code i of ``stream``, mine[i]) at ``width`` bits into ``out`` (mine >= 0)."""
    stream, mine = dev.flat(stream, np.uint8), dev.flat(mine, codes=True)
    w = _width(width, "min_repack")
    nbytes = packed_size(mine.size, int(w))
    out = _out(out, "min_repack", nbytes, np.uint8)
    if nbytes:
        args = (stream, np.int64(stream.size), w, mine, int_kind(mine, "bits min_repack"))
        args += (np.int64(mine.size), out, np.int64(nbytes))
        _kernel(dev, "min_repack")(*_words(dev, nbytes), args)


def launchers(dev) -> SimpleNamespace:
    """Return the ``bits`` launchers bound to ``dev``."""
    return bind(dev, "bits")
