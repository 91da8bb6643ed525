"""Per-rank numba cache directories under MPI launchers (numba's cache is not multi-process safe)."""

import os

from mpicomp._numba_cache import rank_cache_dir


def test_one_directory_per_rank_under_each_launcher(tmp_path):
    base = {"XDG_CACHE_HOME": str(tmp_path), "MPICOMP_NUMBA_CACHE": ""}
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        path = rank_cache_dir({**base, var: "3"})
        assert path == os.path.join(str(tmp_path), "mpicomp", "numba", "rank3"), var
    assert rank_cache_dir({**base, "PMI_RANK": "0"}) != rank_cache_dir({**base, "PMI_RANK": "1"})


def test_a_root_of_its_own(tmp_path):
    env = {"PMI_RANK": "4", "MPICOMP_NUMBA_CACHE": str(tmp_path)}
    assert rank_cache_dir(env) == os.path.join(str(tmp_path), "rank4")
    # one process under that root (the single-process test lane) is rank 0
    single = rank_cache_dir({"MPICOMP_NUMBA_CACHE": str(tmp_path)})
    assert single == os.path.join(str(tmp_path), "rank0")


def test_single_process_and_the_users_choice_keep_numbas_default(tmp_path):
    assert rank_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) is None
    assert rank_cache_dir({"PMI_RANK": "2", "NUMBA_CACHE_DIR": "/somewhere"}) is None
    assert rank_cache_dir({"PMI_RANK": "not-a-rank"}) is None
    home = rank_cache_dir({"PMI_RANK": "1", "MPICOMP_NUMBA_CACHE": ""})
    assert home == os.path.join(os.path.expanduser("~"), ".cache", "mpicomp", "numba", "rank1")
