"""The ``mpicomp`` logger: every record carries the MPI rank of the process that made it.

The library reports through ``logging.getLogger("mpicomp")`` and never prints. Each
record gets a ``rank`` attribute (``MPI.COMM_WORLD``'s rank, or ``-`` before MPI starts
or after it ends), so one format line tells the ranks apart::

    logging.basicConfig(format="%(asctime)s rank %(rank)s %(name)s %(levelname)s: %(message)s")

Without any logging configuration Python prints warnings and worse to stderr (its
last-resort handler); ``logging.getLogger("mpicomp").setLevel(logging.INFO)`` plus a
handler shows what each communicator chose (codec, backend, transport, threads).
"""

from __future__ import annotations

import logging

__all__ = ["LOGGERS", "log", "rank_filter"]


class _RankFilter(logging.Filter):
    """Set ``record.rank`` on every record of the ``mpicomp`` logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return True


def _rank() -> int | str:
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.Get_rank()
    except Exception:  # no MPI library: still log
        pass
    return "-"


#: The filter that sets ``record.rank``.
rank_filter = _RankFilter()

#: The loggers the library writes to. Each gets the filter here, since a parent's filters
#: do not see records logged on its children; ``kernels/`` and ``collectives/`` take
#: theirs by name and import nothing of this module.
LOGGERS = ("mpicomp", "mpicomp.compile")

for _logger in map(logging.getLogger, LOGGERS):
    if not any(isinstance(f, _RankFilter) for f in _logger.filters):
        _logger.addFilter(rank_filter)

log = logging.getLogger("mpicomp")
