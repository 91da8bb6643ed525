"""mpicomp: compressed gradient all-reduce over MPI.

``mpicomp.codec(name, **params)`` makes a codec; ``mpicomp.codecs.available()``
lists their names.
"""

__version__ = "0.1.0"

from mpicomp import codecs
from mpicomp.codecs import codec
from mpicomp.errors import PayloadError

__all__ = ["PayloadError", "__version__", "codec", "codecs"]
