"""One numba cache directory per MPI rank, so ranks never write one cache together.

numba's on-disk cache (``cache=True``) is not safe when several processes compile the
same functions at once: the ABI tags baked into symbol names come from a per-process
counter, so index and object files written by different ranks can disagree and a later
load calls a null symbol (numba issues #4807, #10128). A multi-rank job that finds the
cache cold (a fresh clone, a new node) then crashes with SIGSEGV. Under an MPI launcher,
mpicomp therefore points numba at ``$MPICOMP_NUMBA_CACHE/rank<r>`` (default
``$XDG_CACHE_HOME/mpicomp/numba``, ``~/.cache/...``), one directory per rank, unless
``NUMBA_CACHE_DIR`` is set; with ``MPICOMP_NUMBA_CACHE`` set, a single process uses
``rank0``. A directory may be seeded by copying another rank's while no
job runs (the Makefile's test lanes do). Otherwise a single
process keeps numba's default (``__pycache__`` beside the sources).
"""

from __future__ import annotations

import os

# The launcher's rank variables: MPICH/Hydra and PMI-2, Open MPI, PMIx, Slurm, MVAPICH.
_RANK_VARS = (
    "PMI_RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "SLURM_PROCID",
    "MV2_COMM_WORLD_RANK",
)


def rank_cache_dir(environ=os.environ) -> str | None:
    """Return this rank's numba cache directory, or None (not launched by MPI, or the
    user chose ``NUMBA_CACHE_DIR``)."""
    if environ.get("NUMBA_CACHE_DIR"):
        return None
    rank = next((environ[v] for v in _RANK_VARS if environ.get(v, "").isdigit()), None)
    root = environ.get("MPICOMP_NUMBA_CACHE")
    if rank is None:
        if not root:
            return None
        rank = 0  # a single process under an explicit root counts as rank 0
    if not root:
        home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(home, "mpicomp", "numba")
    return os.path.join(root, f"rank{int(rank)}")


def configure() -> None:
    """Point numba's cache at this rank's directory; call before any kernel is defined."""
    path = rank_cache_dir()
    if path is None:
        return
    import numba

    numba.config.CACHE_DIR = path  # read when each cache=True function is decorated
