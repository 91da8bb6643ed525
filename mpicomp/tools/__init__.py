"""The tools around the runtime: the ``mpicomp`` command line (``cli``), its benchmarks
(``bench``), ``advise``, ``info`` (``diagnostics``) and the cache warm-up (``warmup``).
The training path imports none of them (tests/test_imports.py)."""
