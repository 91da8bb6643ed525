"""One numba cache for every process, compiled into under a lock (mpicomp/numba_cache.py):
where it is, that processes starting together compile a kernel once and load it
otherwise, and that a slow compile is announced."""

import os
import subprocess
import sys
import time

from mpicomp.kernels.numba_cache import cache_root

# A kernel of its own (a fresh cache entry), compiled by several processes started at once.
JOB = """
import logging, os, sys, time

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import numba as nb
import numpy as np

from mpicomp.kernels import numba_cache

numba_cache.ANNOUNCE_AFTER_S = float(sys.argv[2])


@nb.njit(cache=True)
def fresh_kernel(x):
    total = 0.0
    for i in range(x.size):
        total += np.sin(x[i]) * np.cos(x[i] * 2.0) + np.sqrt(abs(x[i]))
    return total


numba_cache.guard(globals())
while not os.path.exists(sys.argv[1]):  # start together
    time.sleep(0.005)
fresh_kernel(np.arange(10.0))
hits = sum(fresh_kernel.stats.cache_hits.values())
misses = sum(fresh_kernel.stats.cache_misses.values())
print(f"hits {hits} misses {misses}", flush=True)
"""


def _start_together(tmp_path, processes: int, announce_after: float) -> list[tuple[str, str]]:
    script, go = tmp_path / "job.py", tmp_path / "go"
    script.write_text(JOB)
    env = dict(os.environ, MPICOMP_NUMBA_CACHE=str(tmp_path / "cache"), NUMBA_NUM_THREADS="1")
    env.pop("NUMBA_CACHE_DIR", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(go), str(announce_after)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(processes)
    ]
    time.sleep(3)  # every process imported numba and waits
    go.touch()
    out = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), out
    return out


def test_processes_starting_together_compile_once_and_load_what_it_wrote(tmp_path):
    out = _start_together(tmp_path, 3, announce_after=60)
    counts = sorted(o.strip().splitlines()[-1] for o, _ in out)
    assert counts == ["hits 0 misses 1", "hits 1 misses 0", "hits 1 misses 0"], out
    # And a later process loads it too.
    again = _start_together(tmp_path, 1, announce_after=60)
    assert again[0][0].strip().endswith("hits 1 misses 0")


def test_a_slow_compile_is_announced_with_its_time(tmp_path):
    (out, err), = _start_together(tmp_path, 1, announce_after=0)  # fmt: skip
    assert "mpicomp.compile: compiling __main__.fresh_kernel (first use" in err, err
    assert "mpicomp.compile: compiled __main__.fresh_kernel in " in err, err
    (out, err), = _start_together(tmp_path, 1, announce_after=0)  # loaded: said nothing  # fmt: skip
    assert "compiling" not in err and out.strip().endswith("hits 1 misses 0"), (out, err)


def test_one_directory_for_every_process_unless_the_user_chose_one(tmp_path):
    assert cache_root({"MPICOMP_NUMBA_CACHE": str(tmp_path)}) == str(tmp_path)
    for env in ({}, {"PMI_RANK": "3"}, {"OMPI_COMM_WORLD_RANK": "1"}):
        root = cache_root({**env, "XDG_CACHE_HOME": str(tmp_path), "MPICOMP_NUMBA_CACHE": ""})
        assert root == os.path.join(str(tmp_path), "mpicomp", "numba"), env
    home = cache_root({"MPICOMP_NUMBA_CACHE": ""})
    assert home == os.path.join(os.path.expanduser("~"), ".cache", "mpicomp", "numba")
    assert cache_root({"PMI_RANK": "2", "NUMBA_CACHE_DIR": "/somewhere"}) is None
