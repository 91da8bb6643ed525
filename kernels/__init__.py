"""Device code of mpicomp, and the one place that looks at array types.

A *backend* is a record: ``name``, ``xp`` (the array module its arrays belong to),
``to_host`` (brings one of its arrays to the host as a NumPy array: on a GPU a counted
synchronization, so callers use it for the few bytes they must read, such as a payload
header) and one attribute per kernel family (``FAMILIES``) whose public callables are the
family's host-side launchers (``LAUNCHERS``, named once in ``kernels/families.py``).
Launchers have the same signatures on every backend; callers allocate outputs through
``record.xp`` and pass them in. Codecs and collectives never import a backend's
modules: they call the launchers of the record ``backend_of(x)`` returns.

Backends present: ``numba`` (NumPy arrays on the CPU, ``kernels/cpu/``), ``cuda`` (CuPy
arrays, the sources of ``kernels/cuda/`` through ``cupy.RawModule``) and ``cuda-emulated``
(NumPy arrays, the same sources compiled for the CPU by g++). Another one
registers with ``register_backend(name, record)`` (a record, or a function returning
one, called at first use so its imports stay lazy) and is chosen for NumPy arrays by
the environment variable ``MPICOMP_KERNELS``, read when a codec or a CompressedComm is
made. What both twins of a family share (constants, error codes, layout arithmetic)
lives in ``kernels/<family>.py``, beside this file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.families import FAMILIES, LAUNCHERS

__all__ = [
    "DEFAULT",
    "ENV",
    "FAMILIES",
    "LAUNCHERS",
    "available",
    "backend",
    "backend_of",
    "place",
    "register_array_type",
    "register_backend",
]

#: The environment variable naming the backend for NumPy arrays.
ENV = "MPICOMP_KERNELS"

#: The backend for NumPy arrays when ``MPICOMP_KERNELS`` is unset or empty.
DEFAULT = "numba"

# name -> record, or a function of no arguments that makes the record at first use.
_REGISTRY: dict[str, object] = {}
# array class -> the backend computing on its arrays (NumPy's is chosen per codec instead).
_ARRAY_TYPES: dict[type, str] = {}


def register_backend(name: str, record) -> None:
    """Add (or replace) the backend ``name``.

    Args:
        name: what ``backend(name)`` and ``MPICOMP_KERNELS`` call it.
        record: an object with ``name``, ``xp``, ``to_host`` and one attribute per family of
            ``FAMILIES``, each holding that family's launchers; or a callable of no
            arguments returning such a record, called at the first ``backend(name)``.

    Raises:
        TypeError: ``name`` is not a non-empty str, or the record lacks an attribute.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a backend name must be a non-empty str, got {name!r}")
    if not _is_factory(record):
        _check_record(name, record)
    _REGISTRY[name] = record


def available() -> list[str]:
    """Return the names of the registered backends, sorted."""
    return sorted(_REGISTRY)


def backend(name: str | None = None):
    """Return the record of backend ``name`` (None: the one ``MPICOMP_KERNELS`` selects).

    Raises:
        ValueError: no backend of that name is registered.
    """
    if name is None:
        name = os.environ.get(ENV) or DEFAULT
    try:
        record = _REGISTRY[name]
    except KeyError:
        where = f" (from {ENV})" if name == os.environ.get(ENV) else ""
        raise ValueError(
            f"unknown kernel backend {name!r}{where}; available: {', '.join(available())}"
        ) from None
    if _is_factory(record):
        record = record()  # a lazy registration: import and build it once
        _check_record(name, record)
        _REGISTRY[name] = record
    return record


def register_array_type(cls: type, name: str) -> None:
    """Make ``backend_of`` send arrays of class ``cls`` (and its subclasses) to backend ``name``.

    CuPy's ``cupy.ndarray`` goes to ``cuda`` without registration (so CuPy is never imported
    here); this is for other device array types, such as the tests' host-backed ones.
    """
    if not isinstance(cls, type) or issubclass(cls, (np.ndarray, np.generic)):
        raise TypeError(f"expected a device array class, got {cls!r}")
    _ARRAY_TYPES[cls] = name


def backend_of(x, host=None):
    """Return the backend record that computes on array ``x``.

    NumPy arrays (and NumPy scalars) go to ``host``, a record chosen earlier (codecs and
    CompressedComm read ``MPICOMP_KERNELS`` when they are made), or else to
    ``backend()``. CuPy arrays go to ``cuda``, the classes of ``register_array_type`` to
    their backend.

    Raises:
        TypeError: ``x`` is not an array of a backend present.
    """
    if isinstance(x, (np.ndarray, np.generic)):
        return backend() if host is None else host
    for cls in type(x).__mro__:
        name = _ARRAY_TYPES.get(cls)
        if name is not None:
            return backend(name)
    cls = type(x)
    if cls.__module__.split(".")[0] == "cupy" and cls.__name__ == "ndarray":
        return backend("cuda")
    raise TypeError(f"expected a NumPy or CuPy array, got {cls.__module__}.{cls.__name__}")


def place(record) -> tuple[str, int]:
    """Return where ``record`` computes now: its name and, on a GPU, the current device's
    id (0 elsewhere). Device arrays a codec keeps (constant tables) are cached per place."""
    device = getattr(record, "device", None)
    return record.name, (device.current() if device is not None else 0)


def launchers(record, family: str) -> dict[str, Callable]:
    """Return the public callables of ``record``'s ``family``: its launchers, by name."""
    fam = getattr(record, family)
    public = {k: getattr(fam, k) for k in dir(fam) if not k.startswith("_")}
    return {k: f for k, f in public.items() if callable(f) and not isinstance(f, type)}


def threadsafe(record) -> bool:
    """Return True if launchers of ``record`` may run on two threads at once.

    A record may say so itself (``record.threadsafe()``); one that does not is judged
    by numba's threading layer, the one hazard known here (its ``workqueue`` layer
    aborts when two threads launch parallel kernels together).
    """
    check = getattr(record, "threadsafe", None)
    if check is not None:
        return bool(check())
    from mpicomp.kernels.cpu import numba_threadsafe

    return numba_threadsafe()


def _missing(obj) -> list[str]:
    """Return the record attributes ``obj`` lacks."""
    return [a for a in ("name", "xp", "to_host", *FAMILIES) if not hasattr(obj, a)]


def _is_factory(obj) -> bool:
    """Return True for a lazy registration: a callable that is not itself a record."""
    return callable(obj) and bool(_missing(obj))


def _check_record(name: str, record) -> None:
    missing = _missing(record)
    if missing:
        raise TypeError(f"kernel backend {name!r} lacks {', '.join(missing)}")


def _numba_record() -> SimpleNamespace:
    from mpicomp.kernels.cpu import record

    return record()


def _emulated_record() -> SimpleNamespace:
    from mpicomp.kernels.cuda import record
    from mpicomp.kernels.cuda.device import Device

    return record(Device.emulated(), FAMILIES)


def _cuda_record() -> SimpleNamespace:
    from mpicomp.kernels.cuda import record
    from mpicomp.kernels.cuda.device import Device

    return record(Device.cuda(), FAMILIES)


register_backend(DEFAULT, _numba_record)
#: The CUDA sources of every family run on the CPU (NumPy arrays): kernels/cuda/emulated.py.
register_backend("cuda-emulated", _emulated_record)
#: The CUDA sources on the current GPU through CuPy (CuPy arrays).
register_backend("cuda", _cuda_record)
