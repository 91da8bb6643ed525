"""``mpicomp info --all-ranks --json`` on N ranks: rank 0 prints every rank, others nothing."""

import json
import platform

import pytest


@pytest.mark.mpi
def test_info_all_ranks_json_has_every_rank(capsys):
    from mpi4py import MPI

    from mpicomp.tools import cli

    world = MPI.COMM_WORLD
    assert cli.main(["info", "--all-ranks", "--json"]) == 0
    out = capsys.readouterr().out
    hosts = world.gather(platform.node(), root=0)
    if world.rank != 0:
        assert out == ""
        return
    doc = json.loads(out)
    ranks = doc["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world.size))
    assert [r["host"] for r in ranks] == hosts
    for host in set(hosts):
        local = sorted(r["local rank"] for r in ranks if r["host"] == host)
        assert local == list(range(hosts.count(host)))
    assert len({r["libmpi"] for r in ranks}) == 1
    assert isinstance(doc["warnings"], list)
    assert not any("disagree" in w for w in doc["warnings"])


@pytest.mark.mpi
def test_info_all_ranks_table_on_rank_zero_only(capsys):
    from mpi4py import MPI

    from mpicomp.tools import cli

    world = MPI.COMM_WORLD
    assert cli.main(["info", "--all-ranks"]) == 0
    out = capsys.readouterr().out
    if world.rank != 0:
        assert out == ""
        return
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("rank  host"))
    assert set(lines[head + 1]) == {"-", " "}  # the rule under the head
    rows = lines[head + 2 : head + 2 + world.size]
    assert max(map(len, lines)) <= 120
    assert [int(r.split()[0]) for r in rows] == list(range(world.size))
    assert any(line.startswith("warnings") for line in lines[head:])
