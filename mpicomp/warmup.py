"""Fill the numba cache before a job, and log what compiles: the public home of
``mpicomp.tools.warmup`` (the tools live apart from the runtime; this path is the API's)."""

from mpicomp.tools.warmup import log_compiles, warm

__all__ = ["log_compiles", "warm"]
