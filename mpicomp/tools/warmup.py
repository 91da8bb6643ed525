"""Fill the numba cache ahead of a job: ``python -m mpicomp compile`` (``warm``).

The first call of each codec compiles its numba kernels for this CPU, seconds to a minute
per codec; later processes load them from the cache (``kernels/numba_cache.py``: one
directory shared by every process, written by one at a time). ``warm`` makes those first
calls now, on a login node or in a Slurm prolog, through ``CompressedComm`` as a job
would: an all-reduce of a small and of a large gradient (the large one reaches the blocked
FFT and the multi-block packing) and a fused pair, plus the sharded schedule of the
gathering codecs. Run under ``mpiexec -n N`` it also compiles what N ranks' reductions
need (ring codes grow wider with the rank count); alone, the single-rank paths.
"""

from __future__ import annotations

import time

import numpy as np

#: Gradient sizes each codec is reduced at: small, and past every blocked path (the
#: blocked FFT starts at 2**18 elements).
SIZES = (1000, 300_000)


def warm(codecs=None, comm=None, sizes=SIZES, on_codec=None) -> dict[str, float]:
    """Compile (or load) the kernels ``codecs`` use (names or made codecs; default every
    codec) on ``comm`` (default ``MPI.COMM_WORLD``; collective); return the seconds each
    took here, by name (a made codec: its repr), also handed to ``on_codec(name, seconds)``
    as each finishes."""
    from mpi4py import MPI

    from mpicomp.codecs import available
    from mpicomp.codecs import codec as make_codec
    from mpicomp.comm import CompressedComm
    from mpicomp.reduction import sharded as sharded_plan

    comm = MPI.COMM_WORLD if comm is None else comm
    codecs = available() if codecs is None else list(codecs)
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(n).astype(np.float32) * 1e-3 for n in sizes]
    took = {}
    for codec in codecs:
        start = time.perf_counter()
        label = codec if isinstance(codec, str) else repr(codec)
        made = make_codec(codec) if isinstance(codec, str) else codec
        shardable = sharded_plan(made) is not None
        for sharded in (False, True) if shardable else (False,):
            with CompressedComm(comm, made, min_numel=1, sharded=sharded) as cc:
                for g in grads:
                    cc.allreduce(g, name=f"g{g.size}")
                cc.allreduce_many(grads, [f"fused{g.size}" for g in grads])
        took[label] = time.perf_counter() - start
        if on_codec is not None:
            on_codec(label, took[label])
    return took


def log_compiles(stream=None) -> None:
    """Show the ``mpicomp.compile`` logger's INFO lines (what compiles, progress every
    15 s, how long) on ``stream`` (default stderr), each with its rank; once per process."""
    import logging
    import sys

    log = logging.getLogger("mpicomp.compile")
    if any(getattr(h, "_mpicomp_compiles", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("rank %(rank)s: %(message)s"))
    handler._mpicomp_compiles = True
    log.addHandler(handler)
    log.setLevel(logging.INFO)
