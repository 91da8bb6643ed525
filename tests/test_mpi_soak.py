"""A scaled-down soak (jobs/soak.py): hundreds of calls, memory bounded, results unchanged."""

import pytest

from conftest import world

CODECS = "none,fp16,qsgd_maxnorm,signsgd,threelc,topk,fastsgd"


@pytest.mark.mpi
class TestSoak:
    def test_memory_stays_bounded_and_results_stay_the_same(self):
        from jobs import soak

        comm = world()
        args = soak.parse_args(
            ["--small", "300", "--large", "5", "--codecs", CODECS, "--large-numel", "200K"]
        )
        r = soak.run(comm, args)
        assert sum(s for s, _ in r["calls"].values()) >= 300
        assert sum(n for _, n in r["calls"].values()) >= 5
        assert set(r["same"]) == set(CODECS.split(","))
        assert soak.verdict(r, tracing=True) == []

    def test_every_rank_gets_the_same_bits(self):
        from jobs import soak

        comm = world()
        s = soak.Soak(comm, CODECS.split(","), [1000, 4096], 20000)
        try:
            for i in range(len(s.codecs) * 2):
                s.small_call(i)
            mine = {c: s.fixed_result(c, save=True) for c in s.codecs}
        finally:
            s.close()
        every = comm.allgather(mine)
        for c in s.codecs:
            assert all(e[c] == mine[c] for e in every), c
