"""collectives/float_ring.py across ranks: float16 and float32 sums on mpicomp's ring give
the bits of NumPy adding every rank's array in the ring's documented order, the same on
every rank, in place; bad buffers are named."""

import numpy as np
import pytest

from conftest import gather_all, ring_order_sum, world
from mpicomp.collectives.float_ring import allreduce_float16, allreduce_float32
from mpicomp.collectives.traffic import Traffic


def _fp16_add(partial, nxt):
    """fp16's ring: each addition in float32, rounded to float16."""
    return (partial.astype(np.float32) + nxt.astype(np.float32)).astype(np.float16)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 7, 1001])
@pytest.mark.parametrize("timeout", [None, 30.0])
def test_float32_and_float16_sums_are_the_rings_order_of_numpy_additions(n, timeout):
    comm = world()
    rng = np.random.default_rng(comm.rank)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
    every = gather_all(comm, x)
    buf = x.copy()
    allreduce_float32(comm, buf, timeout=timeout)
    assert buf.tobytes() == ring_order_sum(every).tobytes()
    half = x.astype(np.float16)
    allreduce_float16(comm, half, timeout=timeout)
    assert half.tobytes() == ring_order_sum(every.astype(np.float16), _fp16_add).tobytes()
    for r, other in enumerate(gather_all(comm, half)):  # the same bits on every rank
        assert other.tobytes() == half.tobytes(), r


@pytest.mark.mpi
def test_each_step_reports_its_bytes_at_the_wires_width():
    comm = world()
    t = Traffic()
    allreduce_float32(comm, np.ones((4, 25), np.float32), recorder=t)  # any shape
    steps = comm.size - 1
    chunk = -(-100 // comm.size)
    assert [op for op, *_ in t.steps] == ["f32.reduce_scatter"] * steps + ["f32.allgather"] * steps
    assert all(bits == 32 for *_, bits in t.steps)
    assert t.sent <= 2 * steps * 4 * chunk


@pytest.mark.mpi
def test_bad_buffers_are_named_on_the_rank_that_passed_them():
    comm = world()
    with pytest.raises(TypeError, match="allreduce_float16: buf must be float16, got float32"):
        allreduce_float16(comm, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="allreduce_float32: buf must be C-contiguous"):
        allreduce_float32(comm, np.ones((4, 4), np.float32)[:, 1])
