"""CUDA twins of the numba kernels: ``<family>.cu`` sources with their launchers.

Each family has ``kernels/cuda/<family>.cu`` (``extern "C"`` kernels named
``mpicomp_<family>_<what>``) and ``kernels/cuda/<family>.py``, which mirrors
``kernels/cpu/<family>.py``: its launchers are module-level functions with the numba
twin's names and arguments, in the twin's order, each taking the ``device.Device`` it
launches on first (``qsgd``, which caches a device array per GPU, makes them the methods
of one class instead). A launcher's docstring is the twin's where that is a line; a longer
one is summed up in a line that names the twin, with what differs on the GPU.
``launchers(dev)`` binds them to a device (``bind``), and ``record(dev)`` gathers the
families into a backend record. The sources run on a GPU through CuPy, or on the CPU
through ``emulated.py`` (docs/kernels.md).

What every family's launchers share: ``family_kernel`` (a family's kernels by name),
``contiguous`` (the check of an array a kernel reads or writes through a pointer) and the
launch shapes and flat inputs of ``device.Device``.
"""

from __future__ import annotations

import importlib
from types import MethodType, SimpleNamespace

import numpy as np

from mpicomp.kernels.families import find_launchers


def family_kernel(family: str, defines: dict[str, str]):
    """Return ``kernel(dev, what)``: ``dev``'s kernel ``mpicomp_<family>_<what>``, from
    ``family``'s module built with the macros ``defines``."""

    def kernel(dev, what: str):
        return dev.kernel(family, f"mpicomp_{family}_{what}", defines)

    return kernel


def contiguous(a, what: str, name: str = "out", size: int = 0, dtype=None, view=None):
    """Return array ``a``, which a kernel reads or writes through a raw pointer, as one
    flat view of its memory (viewed as dtype ``view`` when given).

    Args:
        a: the caller's array (an output is written where it lies: never copied).
        what: the family and launcher, e.g. ``"topk select"``: the messages start with it.
        name: the argument's name in the messages.
        size: the fewest elements (of ``view``, when given) it must have.
        dtype: the dtype it must have, when given.

    Raises:
        ValueError: ``a`` is not C-contiguous (a strided view would be read or written
            wrongly) or not of ``dtype``, or it has fewer than ``size`` elements.
    """
    if not a.flags.c_contiguous or (dtype is not None and a.dtype != dtype):
        kind = "" if dtype is None else f" {np.dtype(dtype)}"
        raise ValueError(f"{what}: {name} must be a C-contiguous{kind} array")
    a = a.reshape(-1)
    if view is not None:
        a = a.view(view)
    if a.size < size:
        unit = "bytes" if a.itemsize == 1 else f"elements of {a.dtype}"
        raise ValueError(f"{what}: {name} has {a.size} {unit}, needs {size}")
    return a


def bind(dev, family: str) -> SimpleNamespace:
    """Return ``family``'s launchers (``mpicomp.kernels.LAUNCHERS``), the functions of
    ``kernels/cuda/<family>.py`` of those names (``name_`` where the name is a builtin's:
    3LC's ``max_``), bound to ``dev`` with their names and docstrings."""
    module = importlib.import_module(f"{__name__}.{family}")
    found = find_launchers(family, (module,), ("{name}", "{name}_"))
    # A bound method, unlike a functools.partial, keeps the function's name and docstring.
    return SimpleNamespace(**{name: MethodType(fn, dev) for name, fn in found.items()})


def record(dev, families) -> SimpleNamespace:
    """Return a backend record of ``dev``'s launchers for ``families``.

    Launches on the emulated device are serialized (its shared memory is static), and
    CuPy launches from several threads are safe: the record is thread-safe either way.
    """
    found = {
        f: importlib.import_module(f"mpicomp.kernels.cuda.{f}").launchers(dev) for f in families
    }
    return SimpleNamespace(
        name=dev.name,
        xp=dev.xp,
        to_host=dev.to_host,
        synchronize=dev.synchronize,
        device=dev,
        threadsafe=lambda: True,
        **found,
    )
