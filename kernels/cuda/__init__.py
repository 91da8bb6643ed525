"""CUDA twins of the numba kernels: ``<family>.cu`` sources with their launchers.

Each family has ``kernels/cuda/<family>.cu`` (``extern "C"`` kernels named
``mpicomp_<family>_<what>``) and ``kernels/cuda/<family>.py``, which mirrors
``kernels/cpu/<family>.py``: its launchers are module-level functions with the numba
twin's names, arguments and docstrings, in the twin's order, each taking the
``device.Device`` it launches on first (``qsgd``, which caches a device array per GPU,
makes them the methods of one class instead). ``launchers(dev)`` binds them to a device
(``bind``), and ``record(dev)`` gathers the families into a backend record. The sources run
on a GPU through CuPy, or on the CPU through ``emulated.py`` (docs/kernels.md).
"""

from __future__ import annotations

import importlib
from types import MethodType, SimpleNamespace


def bind(dev, **launchers) -> SimpleNamespace:
    """Return ``launchers`` (by record name: functions whose first argument is a
    ``Device``) bound to ``dev``, with the numba twin's signatures and docstrings."""
    # A bound method, unlike a functools.partial, keeps the function's name and docstring.
    return SimpleNamespace(**{name: MethodType(fn, dev) for name, fn in launchers.items()})


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
