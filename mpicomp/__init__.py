"""mpicomp: compressed gradient all-reduce over MPI.

``mpicomp.codec(name, **params)`` makes a codec; ``mpicomp.codecs.available()``
lists their names.
"""

from mpicomp import (
    _log,  # noqa: F401  (the rank filter, on the loggers before any record)
    _moved,
)
from mpicomp._version import __version__
from mpicomp.kernels import numba_cache

numba_cache.configure()  # before the codecs define their numba kernels
_moved.install()  # the flat layout's module paths, with a DeprecationWarning

from mpicomp import codecs  # noqa: E402
from mpicomp.codecs import codec  # noqa: E402
from mpicomp.errors import NonFiniteWarning, PayloadError, PeerClosed, RankError  # noqa: E402

__all__ = [
    "CompressedComm",
    "Handle",
    "NonFiniteWarning",
    "PayloadError",
    "PeerClosed",
    "RankError",
    "__version__",
    "codec",
    "codecs",
]


def __getattr__(name):
    # Lazy: importing mpicomp for its codecs must not initialize MPI.
    if name in ("CompressedComm", "Handle"):
        from mpicomp import comm

        return getattr(comm, name)
    raise AttributeError(f"module 'mpicomp' has no attribute {name!r}")
