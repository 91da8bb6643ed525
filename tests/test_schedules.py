"""The cost model of the schedules (mpicomp.schedules): its byte counts against the
documented per-rank formulas (tests/conftest.py's references, checked against traces in
test_mpi_ring.py and test_mpi_direct.py), its messages, and the times it predicts."""

import math

import pytest
from conftest import direct_traffic, ring_traffic

import mpicomp
from mpicomp.schedules import AGREEMENT_BYTES, Cost, Network, bounded, cost, gathered


def _log2(n):
    return math.ceil(math.log2(n)) if n > 1 else 0


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("span,majority", [(1, True), (14, False), (254, False), (3, False)])
def test_bounded_bytes_are_the_per_rank_formula_when_chunks_are_equal(nranks, span, majority):
    n = 8 * nranks * 37  # every chunk the same: every rank sends and receives alike
    final = 1 if majority else (nranks * span).bit_length()
    ring = ring_traffic(n, nranks, 0, 8, lambda i: (i * span).bit_length(), final)
    direct = direct_traffic(n, nranks, 0, 8, span.bit_length(), final)
    assert bounded("ring", n, nranks, span, majority).bytes == ring[0] == ring[1]
    assert bounded("direct", n, nranks, span, majority).bytes == direct[0] == direct[1]
    steps = 2 * (nranks - 1)
    assert bounded("ring", n, nranks, span, majority).messages == steps


@pytest.mark.parametrize("n", [1, 9, 1001, 10_007])
@pytest.mark.parametrize("nranks", [3, 4, 5])
def test_bounded_bytes_bound_every_ranks_bytes_with_unequal_chunks(n, nranks):
    """The critical path takes the largest chunk at each step: no rank moves more."""
    for r in range(nranks):
        sent, recv, _ = direct_traffic(n, nranks, r, 8, 4, (14 * nranks).bit_length())
        assert max(sent, recv) <= bounded("direct", n, nranks, 14, False).bytes
        sent, recv, _ = ring_traffic(
            n, nranks, r, 8, lambda i: (14 * i).bit_length(), (14 * nranks).bit_length()
        )
        assert max(sent, recv) <= bounded("ring", n, nranks, 14, False).bytes


def test_the_direct_schedule_moves_fewer_bytes_from_three_ranks_on():
    n = 25_600_000
    for span, majority in ((1, True), (14, False), (254, False)):
        assert bounded("direct", n, 2, span, majority) == bounded("ring", n, 2, span, majority)
        for nranks in (3, 4, 8, 16):
            ring = bounded("ring", n, nranks, span, majority).bytes
            assert bounded("direct", n, nranks, span, majority).bytes < ring
    # signSGD at 4 ranks: 1.5 bits per element against the ring's 2 (docs/collectives.md).
    assert bounded("direct", n, 4, 1, True).bytes * 8 / n == pytest.approx(1.5)
    assert bounded("ring", n, 4, 1, True).bytes * 8 / n == pytest.approx(2.0)


def test_a_whole_call_adds_the_agreement_and_the_codecs_own_messages():
    n, N = 8 * 4 * 1000, 4
    head = Cost(_log2(N), _log2(N) * AGREEMENT_BYTES)
    signsgd = mpicomp.codec("signsgd")
    scales = Cost(_log2(N), 8 * _log2(N))
    assert cost("direct", signsgd, n, N) == head + scales + bounded("direct", n, N, 1, True)
    qsgd = mpicomp.codec("qsgd_maxnorm", bits=4)
    assert cost("ring", qsgd, n, N) == head + bounded("ring", n, N, 14, False)
    grandk = mpicomp.codec("grandk_maxnorm", bits=4, k=800)
    assert cost("direct", grandk, n, N) == head + bounded("direct", 800, N, 14, False)
    # float32, fp16: MPI's allreduce moves 2(N-1)/N of the buffer in 2 log2 N messages.
    assert cost("float32", qsgd, n, N) == head + Cost(4, 2 * 3 * 4 * n // 4)
    assert cost("allreduce", mpicomp.codec("fp16"), n, N) == head + Cost(4, 2 * 3 * 2 * n // 4)
    threelc = mpicomp.codec("threelc")
    assert cost("allgather", threelc, n, N, payload=1000) == head + gathered("allgather", N, 1000)
    assert cost("float32", qsgd, n, 1) == Cost(0, 0)


def test_sharded_receives_about_two_payloads_whatever_the_ranks():
    for nranks in (4, 8, 16):
        sharded = gathered("sharded", nranks, 10**6).bytes
        assert sharded < 2.1 * 10**6 < gathered("allgather", nranks, 10**6).bytes


def test_wrong_schedules_and_networks_raise_naming_the_problem():
    qsgd = mpicomp.codec("qsgd_maxnorm")
    with pytest.raises(
        ValueError, match=r"codec 'qsgd_maxnorm' \(integer_sum\) has no schedule 'sharded'"
    ):
        cost("sharded", qsgd, 100, 4)
    with pytest.raises(ValueError, match="needs payload bytes"):
        cost("allgather", mpicomp.codec("topk"), 100, 4)
    with pytest.raises(ValueError, match="alpha must be"):
        Network(-1e-6, 1e9)
    with pytest.raises(ValueError, match="beta must be"):
        Network(1e-6, 0)
    with pytest.raises(ValueError, match="beta must be"):
        Network(1e-6, math.inf)


def test_the_network_predicts_latency_plus_bytes_over_bandwidth():
    net = Network(alpha=50e-6, beta=125e6)  # 1 Gbit/s
    assert net.time(Cost(6, 125_000_000)) == pytest.approx(1 + 6 * 50e-6)
    signsgd = mpicomp.codec("signsgd")
    small, large = 1024, 25_600_000
    # Few elements: latency decides, and the float32 allreduce's 2 log2 N messages beat
    # the 2(N-1) ring steps at 8 ranks; many elements: bytes decide.
    assert net.time(cost("float32", signsgd, small, 8)) < net.time(cost("ring", signsgd, small, 8))
    assert net.time(cost("direct", signsgd, large, 8)) < net.time(cost("ring", signsgd, large, 8))
    assert net.time(cost("ring", signsgd, large, 8)) < net.time(cost("float32", signsgd, large, 8))
