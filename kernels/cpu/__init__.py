"""The numba backend: NumPy arrays on the CPU, one module of ``@njit`` kernels per family.

``record()`` builds the backend record ``mpicomp.kernels.backend("numba")`` returns: per
family, its launchers under the names every backend shares. Codecs and collectives
reach these kernels only through that record.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.families import FAMILIES, find_launchers


def numba_threadsafe() -> bool:
    """Return True if numba's parallel kernels may run on two threads at once.

    numba's ``workqueue`` layer (the fallback without OpenMP or TBB) aborts the process
    when two threads launch parallel kernels concurrently; ``omp`` and ``tbb`` do not.
    The layer is chosen at the first parallel launch, so this launches a tiny one.
    """
    import numba

    from mpicomp.kernels.cpu.checks import mpicomp_parallel_probe

    mpicomp_parallel_probe(2)
    return numba.threading_layer() != "workqueue"


def _on_host(a, out=None, *, why: str = ""):
    """The record's ``to_host``: NumPy arrays are on the host already (nothing counted)."""
    if out is None:
        return np.asarray(a)
    np.copyto(out, a)
    return out


# The modules of a family's launchers, where not only kernels/cpu/<family>.py.
_MODULES = {"fft": ("fft", "rfft", "checks"), "topk": ("topk", "checks")}

# How a numba launcher is spelled: a Python function of the launcher's name, else the
# family's kernel itself, else a kernel shared by families (checks.py).
_SPELLINGS = ("{name}", "mpicomp_{family}_{name}", "mpicomp_{name}")


def record() -> SimpleNamespace:
    """Return the numba backend's record: ``name``, ``xp`` and its launchers by family
    (``mpicomp.kernels.LAUNCHERS``, found in the family's modules by ``_SPELLINGS``)."""
    families = {}
    for family in FAMILIES:
        modules = [
            importlib.import_module(f"{__name__}.{m}") for m in _MODULES.get(family, (family,))
        ]
        families[family] = SimpleNamespace(**find_launchers(family, modules, _SPELLINGS))
    return SimpleNamespace(
        name="numba", xp=np, to_host=_on_host, threadsafe=numba_threadsafe, **families
    )
