"""CUDA twins of the numba kernels: ``<family>.cu`` sources with their launchers.

Each family has ``kernels/cuda/<family>.cu`` (``extern "C"`` kernels named
``mpicomp_<family>_<what>``) and ``kernels/cuda/<family>.py``, whose ``launchers(dev)``
returns the family's launchers bound to a ``device.Device``, with the numba record's
names and signatures. ``record(dev)`` gathers them into a backend record. The sources run
on a GPU through CuPy, or on the CPU through ``emulated.py`` (docs/kernels.md).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace


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
