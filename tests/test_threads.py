"""The kernels' thread count: CPUs / ranks on the host by default, NUMBA_NUM_THREADS when
set, held in every thread that launches kernels (numba's count is per thread)."""

import threading
from collections import Counter
from types import SimpleNamespace

import numba
import numpy as np
import pytest

import mpicomp
import mpicomp.kernels as K
from mpicomp.call import threads
from mpicomp.tools import diagnostics


def test_ranks_sharing_the_cpus_divide_them():
    host = [{0, 1}, {0, 1}]
    assert threads.share({0, 1}, host) == (1, "2 CPUs / 2 ranks on this host")
    three = [set(range(8))] * 3
    assert threads.share(set(range(8)), three) == (2, "8 CPUs / 3 ranks on this host")
    assert threads.share({0}, [{0}] * 4).threads == 1  # never 0


def test_ranks_bound_to_cores_of_their_own_keep_them():
    bound = [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    assert threads.share({2, 3}, bound) == (2, "2 CPUs / 1 rank of 4 on this host using them")
    overlapping = [{0, 1, 2, 3}, {2, 3, 4, 5}, {6, 7}]  # the third shares with neither
    assert threads.share({0, 1, 2, 3}, overlapping).threads == 2


def test_the_default_leaves_no_host_oversubscribed_for_info_to_warn_about():
    cpus = set(range(8))
    for ranks in (1, 2, 3, 8, 12):
        facts = [
            {
                "rank": r,
                "host": "n0",
                "host cpus": len(cpus),
                "cpu count": len(cpus),
                "numba threads": threads.share(cpus, [cpus] * ranks).threads,
                "BLAS threads": 1,
            }
            for r in range(ranks)
        ]
        said = [w for w in diagnostics.warnings(facts) if "numba threads" in w]
        if ranks <= 8:
            assert said == [], said
        else:  # one thread each is already the least: the advice is fewer ranks
            (w,) = said
            assert f"{ranks} ranks on 8 CPUs" in w and "start at most 8 ranks" in w, w


def test_numba_num_threads_in_the_environment_wins(monkeypatch):
    from mpi4py import MPI

    monkeypatch.setattr(threads, "cpus", lambda: {0})
    pool = numba.config.NUMBA_NUM_THREADS
    monkeypatch.setenv("NUMBA_NUM_THREADS", str(pool))
    assert threads.decide(MPI.COMM_SELF) == (pool, f"NUMBA_NUM_THREADS={pool}")
    monkeypatch.delenv("NUMBA_NUM_THREADS")
    assert threads.decide(MPI.COMM_SELF) == (1, "1 CPU / 1 rank on this host")


@pytest.fixture
def one_cpu(monkeypatch):
    """This process as if it had one CPU, numba's pool unchanged (2 or more here); the
    kept decision and this thread's numba count put back afterwards."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba's pool has one thread: a cap of one cannot be told apart")
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cpus", lambda: {0})
    monkeypatch.setattr(threads, "_decided", None)
    monkeypatch.setattr(threads, "_applied", threading.local())
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


def _watching_record(seen: list) -> SimpleNamespace:
    """A kernel backend forwarding to numba's that notes (thread, numba threads) per launch."""
    record = K.backend("numba")

    def forward(fn):
        def launcher(*args, **kwargs):
            seen.append((threading.current_thread().name, numba.get_num_threads()))
            return fn(*args, **kwargs)

        return launcher

    families = {
        fam: SimpleNamespace(**{k: forward(fn) for k, fn in K.launchers(record, fam).items()})
        for fam in K.FAMILIES
    }
    return SimpleNamespace(name="watching", xp=np, to_host=record.to_host, **families)


def test_kernels_run_capped_in_the_callers_thread_and_the_workers(one_cpu, monkeypatch):
    from mpi4py import MPI

    seen: list = []
    K.register_backend("watching", _watching_record(seen))
    monkeypatch.setenv(K.ENV, "watching")
    x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
    try:
        with mpicomp.CompressedComm(MPI.COMM_SELF, "qsgd_maxnorm", background=True) as cc:
            assert cc.background and cc.threads == (1, "1 CPU / 1 rank on this host")
            cc.allreduce(x, name="w")
            cc.iallreduce(x, name="w").wait()
    finally:
        K._REGISTRY.pop("watching")
    by_thread = Counter(name for name, _ in seen)
    worker = [name for name in by_thread if name.startswith("mpicomp-worker")]
    assert threading.current_thread().name in by_thread and worker, by_thread
    assert {n for _, n in seen} == {1}, Counter(seen)
    # numba's count is per thread: a thread mpicomp never ran in still has the pool.
    other = []
    t = threading.Thread(target=lambda: other.append(numba.get_num_threads()))
    t.start()
    t.join()
    assert other == [numba.config.NUMBA_NUM_THREADS]


def test_a_lower_count_the_user_set_stands(one_cpu, monkeypatch):
    from mpi4py import MPI

    monkeypatch.setattr(threads, "cpus", lambda: set(range(numba.config.NUMBA_NUM_THREADS)))
    numba.set_num_threads(1)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "fp16") as cc:
        assert cc.threads.threads == numba.config.NUMBA_NUM_THREADS
        assert numba.get_num_threads() == 1


def test_info_says_the_kernel_threads_and_why(one_cpu):
    fields = diagnostics.info()
    assert fields["numba threads"] == 1
    assert fields["numba threads from"] == "1 CPU / 1 rank on this host"
    assert "numba (in use; 1 thread)" in fields["backends"]


def test_torch_threads_are_capped_with_numba_s(one_cpu):
    """torch's intra-op threads at another count than numba's, in the OpenMP runtime
    they share, made a training step 3x slower: a CompressedComm caps both."""
    torch = pytest.importorskip("torch")
    from mpi4py import MPI

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with mpicomp.CompressedComm(MPI.COMM_SELF, "fp16"):
            assert torch.get_num_threads() == 1 and numba.get_num_threads() == 1
            # torch's own count, its BLAS's (MKL) too, not only this thread's OpenMP one
            info = torch.__config__.parallel_info()
            assert "mkl_get_max_threads() : 1" in info or "mkl_get_max" not in info, info
    finally:
        torch.set_num_threads(before)


def test_numba_num_threads_set_leaves_every_count_as_it_is(one_cpu, monkeypatch):
    torch = pytest.importorskip("torch")
    from mpi4py import MPI

    pool = numba.config.NUMBA_NUM_THREADS
    monkeypatch.setenv("NUMBA_NUM_THREADS", str(pool))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with mpicomp.CompressedComm(MPI.COMM_SELF, "fp16") as cc:
            assert cc.threads == (pool, f"NUMBA_NUM_THREADS={pool}") and threads.kept() is None
            assert numba.get_num_threads() == pool and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
