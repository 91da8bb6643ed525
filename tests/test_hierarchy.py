"""mpicomp/reduction/hierarchy.py on one rank (a host of one, one host): the flat schedule
runs between hosts on this rank's shard with the shard's own tensors, and what it
raises or skips reaches the caller (several hosts: tests/test_mpi_schedules.py)."""

import numpy as np
import pytest
from mpi4py import MPI

import mpicomp
from mpicomp.reduction import float_sum
from mpicomp.reduction.agreement import Call, Skipped
from mpicomp.reduction.hierarchy import PREFIX, Hosts, run


@pytest.fixture
def hosts():
    h = Hosts(MPI.COMM_SELF.Dup(), MPI.COMM_SELF.Dup())
    yield h
    h.free()


def _x(n=1000, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_one_host_of_one_rank_averages_to_the_input(hosts):
    x = _x()
    out = run(Call(MPI.COMM_SELF), mpicomp.codec("none"), x, inner=float_sum.run, hosts=hosts)
    assert out.dtype == np.float32 and out.tobytes() == x.tobytes()
    assert PREFIX + "ring" == "hier:ring"


def test_the_flat_schedule_runs_between_hosts_on_the_shards_own_tensors(hosts):
    seen = []

    def inner(call, codec, flat):
        seen.append((call.comm is hosts.cross, call.shapes, flat.size))
        return flat * np.float32(2)

    x = _x(10)
    call = Call(MPI.COMM_SELF, shapes=((2, 3), (4,)))
    out = run(call, mpicomp.codec("none"), x, inner=inner, hosts=hosts)
    assert seen == [(True, ((6,), (4,)), 10)]
    np.testing.assert_array_equal(out, x * np.float32(2))


@pytest.mark.parametrize(
    "raised, expect", [(ValueError("bad shard"), ValueError), (Skipped([], "skipped"), Skipped)]
)
def test_what_the_exchange_between_hosts_raises_reaches_the_caller(hosts, raised, expect):
    def inner(call, codec, flat):
        raise raised

    with pytest.raises(expect):
        run(Call(MPI.COMM_SELF), mpicomp.codec("none"), _x(10), inner=inner, hosts=hosts)


def test_nan_is_refused_before_any_exchange(hosts):
    x = _x(10)
    x[2] = np.nan

    def inner(call, codec, flat):
        raise AssertionError("no exchange between hosts for a refused input")

    with pytest.raises(ValueError, match="holds NaN or Inf"):
        run(Call(MPI.COMM_SELF), mpicomp.codec("none"), x, inner=inner, hosts=hosts)
