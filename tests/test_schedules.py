"""The cost model of the schedules (mpicomp.model.cost): its byte counts against the
documented per-rank formulas (tests/conftest.py's references, checked against traces in
test_mpi_ring.py and test_mpi_direct.py), its messages, and the times it predicts."""

import math

import pytest

import mpicomp
from conftest import direct_traffic, ring_traffic
from mpicomp.kernels.bits import packed_size
from mpicomp.model.cost import AGREEMENT_BYTES, Cost, Network, bounded, cost, gathered


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
    paper = mpicomp.codec("qsgd_maxnorm", bits=4, block=0, per_tensor=False)
    assert cost("ring", paper, n, N) == head + bounded("ring", n, N, 14, False)
    # 250 block norms: a MaxAllReduce of its own, its head and a tail of 234 float32
    qsgd = mpicomp.codec("qsgd_maxnorm", bits=4)
    norms = head + Cost(_log2(N), _log2(N) * 234 * 4)
    assert cost("ring", qsgd, n, N) == head + norms + bounded("ring", n, N, 14, False)
    grandk = mpicomp.codec("grandk_maxnorm", bits=4, k=800)  # 7 blocks of the 800: a head
    assert cost("direct", grandk, n, N) == head + head + bounded("direct", 800, N, 14, False)
    lone = mpicomp.codec("grandk_maxnorm", bits=4, k=800, block=1024)  # in the agreement
    assert cost("direct", lone, n, N) == head + bounded("direct", 800, N, 14, False)
    # float32: MPI's allreduce moves 2(N-1)/N of the buffer in 2 log2 N messages; fp16's
    # own ring the same bytes of float16 in 2(N-1) steps.
    assert cost("float32", qsgd, n, N) == head + Cost(4, 2 * 3 * 4 * n // 4)
    assert cost("allreduce", mpicomp.codec("fp16"), n, N) == head + Cost(6, 2 * 3 * 2 * n // 4)
    threelc = mpicomp.codec("threelc")
    assert cost("allgather", threelc, n, N, payload=1000) == head + gathered("allgather", N, 1000)
    assert cost("float32", qsgd, n, 1) == Cost(0, 0)


@pytest.mark.parametrize(
    "numel, block, extra",
    [
        (1024, 1024, Cost(0, 0)),  # one block: the norm rides in the agreement
        (1025, 1024, Cost(2, 2 * AGREEMENT_BYTES)),  # two: a head of its own
        (17 * 64, 64, Cost(4, 2 * AGREEMENT_BYTES + 2 * 4)),  # and a tail of one norm
        # 4096 norms past the head: MPICH's reduce-scatter and allgather of 16 KiB
        (4112 * 64, 64, Cost(2 + 4, 2 * AGREEMENT_BYTES + 2 * 3 * 4 * 4096 // 4)),
        (10**6, 0, Cost(0, 0)),
    ],
)
def test_block_norms_cost_one_more_maxallreduce(numel, block, extra):
    N = 4
    qsgd = mpicomp.codec("qsgd_maxnorm", bits=4, block=block)
    head = Cost(_log2(N), _log2(N) * AGREEMENT_BYTES)
    assert cost("ring", qsgd, numel, N) == head + extra + bounded("ring", numel, N, 14, False)
    assert cost("ring", qsgd, numel, 1) == Cost(0, 0)


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


# -- topology, compute and the choice (mpicomp.model.cost.predict / choose) --------------

from mpicomp.model.cost import (  # noqa: E402
    FLOAT32,
    Topology,
    choose,
    compute_seconds,
    predict,
    schedules_of,
)
from mpicomp.model.measured import Model, Speed, codec_key  # noqa: E402

GBIT = 1e9 / 8  # bytes per second


FREE = Speed(0.0, 0.0, 2.0)
LINK_1GBIT = Network(50e-6, GBIT)


def _model(codec, speed=FREE, inter=LINK_1GBIT, intra=None):
    intra = intra or Network(1e-6, 100 * GBIT)
    return Model(intra, inter, {codec_key(codec): speed})


def test_the_candidates_are_the_codecs_own_schedules_the_hierarchy_and_float32():
    qsgd, fp16, none = (mpicomp.codec(n) for n in ("qsgd_maxnorm", "fp16", "none"))
    flat, hosts = Topology(1, 4), Topology(2, 2)
    assert schedules_of(qsgd, flat) == ("ring", "direct", FLOAT32)
    assert schedules_of(qsgd, hosts) == ("ring", "direct", "hier:ring", "hier:direct", FLOAT32)
    assert schedules_of(mpicomp.codec("fft"), hosts)[:4] == (
        "allgather", "sharded", "hier:allgather", "hier:sharded"
    )  # fmt: skip
    # none: MPI_Allreduce or mpicomp's float32 ring; fp16's allreduce is its float16 ring
    assert schedules_of(fp16, hosts) == ("allreduce", FLOAT32)
    assert schedules_of(none, hosts) == ("allreduce", "ring")
    assert not Topology(3, 2, even=False).hierarchical and not Topology(1, 8).hierarchical


def test_small_tensors_go_uncompressed_and_large_ones_compressed_on_a_slow_link():
    signsgd = mpicomp.codec("signsgd")
    model = _model(signsgd, Speed(1e-10, 1e-10))  # 40 GB/s kernels
    topo = Topology(8, 1)
    # 2(N-1) ring steps of latency against 2 log2 N: float32 wins while latency rules.
    assert choose(signsgd, 256, topo, model)[0] == FLOAT32
    chosen, times = choose(signsgd, 25_600_000, topo, model)
    assert chosen == "direct" and times["direct"] < times["ring"] < times[FLOAT32]
    # Slow kernels on a fast link: compression does not pay at any size.
    fast = _model(signsgd, Speed(2e-9, 2e-9), inter=Network(2e-6, 100 * GBIT))
    assert choose(signsgd, 25_600_000, topo, fast)[0] == FLOAT32


def test_two_ranks_tie_ring_and_direct_and_the_default_wins_the_tie():
    qsgd = mpicomp.codec("qsgd_maxnorm", bits=4)
    chosen, times = choose(qsgd, 1_000_000, Topology(2, 1), _model(qsgd, Speed(1e-10, 1e-10)))
    assert times["ring"] == times["direct"] and chosen == "ring"


def test_all_to_all_bytes_share_the_hosts_link_and_ring_bytes_do_not():
    signsgd = mpicomp.codec("signsgd")
    model, n = _model(signsgd), 8 * 8 * 10_000
    flat, paired = Topology(8, 1), Topology(4, 2)
    assert predict("ring", signsgd, n, paired, model) == predict("ring", signsgd, n, flat, model)
    alltoall = 7 * packed_size(n // 8, 1)  # the direct schedule's codes, 1 bit each
    extra = predict("direct", signsgd, n, paired, model) - predict(
        "direct", signsgd, n, flat, model
    )
    assert extra == pytest.approx(alltoall / GBIT)


def test_the_hierarchy_pays_for_compute_heavy_codecs_with_ranks_to_spare():
    fft = mpicomp.codec("fft")
    slow = Speed(20e-9, 20e-9, 2.0)  # FFT-like kernels: 0.2 GB/s
    topo, n = Topology(4, 2), 25_600_000
    chosen, times = choose(fft, n, topo, _model(fft, slow))
    # Each rank compresses 1/R of the host's sum among H ranks instead of all of it among N.
    assert chosen.startswith("hier:") and times[chosen] < times["allgather"]
    # Each of the 8 ranks encodes n/2 and decodes 4 payloads of it, instead of n and 8.
    topk = mpicomp.codec("topk")
    assert compute_seconds("allgather", topk, slow, n // 2, 4) == pytest.approx(
        compute_seconds("allgather", topk, slow, n, 8) * (1 + 4) / (1 + 8) / 2
    )


def test_decoding_n_payloads_costs_n_decodes_unless_the_codec_sums_first():
    speed, n = Speed(1e-9, 2e-9, 1.0), 10_000
    topk, fft = mpicomp.codec("topk"), mpicomp.codec("fft")
    assert compute_seconds("allgather", topk, speed, n, 4) == pytest.approx((1 + 4 * 2) * 1e-9 * n)
    assert compute_seconds("allgather", fft, speed, n, 4) == pytest.approx((1 + 2) * 1e-9 * n)
    assert compute_seconds(FLOAT32, topk, speed, n, 4) == 0
    assert compute_seconds("ring", mpicomp.codec("signsgd"), speed, n, 4) == pytest.approx(3e-9 * n)


def test_predictions_refuse_what_the_topology_or_the_model_lacks():
    qsgd = mpicomp.codec("qsgd_maxnorm")
    with pytest.raises(ValueError, match="needs several hosts"):
        predict("hier:ring", qsgd, 1000, Topology(1, 4), _model(qsgd))
    other = _model(mpicomp.codec("qsgd_maxnorm", bits=2))
    with pytest.raises(ValueError, match=r"no speed for qsgd_maxnorm:\{.*bits.: 8"):
        predict("ring", qsgd, 1000, Topology(1, 4), other)
    with pytest.raises(ValueError, match="hosts >= 1"):
        Topology(0, 1)


def test_a_model_survives_its_json_file(tmp_path):
    qsgd = mpicomp.codec("qsgd_maxnorm", bits=4)
    model = _model(qsgd, Speed(1.5e-9, 2.5e-9, 4.0), inter=Network(3e-5, 1.1e8))
    model.save(tmp_path / "m.json")
    back = Model.load(tmp_path / "m.json")
    assert (back.intra, back.inter, back.speeds) == (model.intra, model.inter, model.speeds)
    assert back.source == str(tmp_path / "m.json") and back.speed(qsgd).bits == 4.0
    (tmp_path / "bad.json").write_text('{"format": "mpicomp-model-1", "intra": {}}')
    with pytest.raises(ValueError, match=r"bad\.json: a malformed mpicomp model"):
        Model.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an mpicomp model"):
        Model.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match="Speed.encode must be"):
        Speed(-1.0, 0.0)
    with pytest.raises(TypeError, match="intra must be"):
        Model(1e-6)


def test_schedule_names_beyond_the_codecs_own():
    from mpicomp.call.options import Options

    for codec, ok, bad in (
        ("threelc", ["hier:sharded", "auto", "float32"], ["hier:ring", "ring"]),
        ("signsgd", ["hier:direct", "auto"], ["hier:allgather", "hier:"]),
        ("fp16", ["float32", "auto"], ["hier:allreduce", "ring"]),
        ("none", ["auto", "allreduce", "ring"], ["direct", "hier:allreduce"]),
    ):
        c = mpicomp.codec(codec)
        for name in ok:
            assert Options.resolve(c, schedule=name).schedule == name
        for name in bad:
            with pytest.raises(ValueError, match=f"schedule={name!r}: codec {codec!r}"):
                Options.resolve(c, schedule=name)


def test_the_verdicts_read_autos_choice_against_the_fastest_measured():
    from mpicomp.tools.bench.report import chooser_verdicts

    def row(schedule, t, chosen=None, numel=1000):
        return {
            "codec": "signsgd", "params": {}, "numel": numel, "schedule": schedule,
            "chosen": chosen or schedule, "time_s": t, "allreduce_s": 0.5,
            "predicted_s": t / 2, "allreduce_predicted_s": 0.25,
        }  # fmt: skip

    rows = [row("ring", 0.4), row("direct", 0.2), row("auto", 0.21, "direct")]
    rows += [row("ring", 0.9, numel=9), row("direct", 0.8, numel=9), row("auto", 0.5, "ring", 9)]
    first, second = chooser_verdicts(rows)
    assert (first["chosen"], first["fastest"], first["right"], first["regret"]) == (
        "direct", "direct", True, 1.0
    )  # fmt: skip
    assert first["times"] == {"ring": 0.4, "direct": 0.2, "float32": 0.5}
    assert first["predicted"]["float32"] == 0.25
    # float32 (MPI_Allreduce, 0.5 s) was fastest; auto's ring took 0.9 s there.
    assert (second["fastest"], second["right"]) == ("float32", False)
    assert second["regret"] == pytest.approx(0.9 / 0.5)
    assert second["auto_over_fastest"] == pytest.approx(0.5 / 0.5)


def test_auto_takes_mpicomps_float32_ring_only_where_mpi_allreduce_measured_slower():
    none = mpicomp.codec("none")
    link = Network(50e-6, 1.25e8)  # 1 Gbit/s per host
    numel, topo = 8_546_314, Topology(4, 1)
    as_modelled = Model(link, link, source="given")
    assert choose(none, numel, topo, as_modelled)[0] == "allreduce"  # fewer messages
    # gloo-like: MPICH's all-reduce over TCP reached 0.7 of what the link gives a ring
    slow = Model(link, link, source="given", mpi_allreduce=1.4)
    chosen, times = choose(none, numel, topo, slow)
    assert chosen == "ring"
    assert times["allreduce"] == pytest.approx(1.4 * times["ring"], rel=0.01)
    # small tensors: latency, where the library's 2 log2 N messages win whatever its bandwidth
    assert choose(none, 1000, topo, slow)[0] == "allreduce"
    # the factor travels in a saved model, and files from before it read as 1
    assert Model.from_json(slow.to_json()).mpi_allreduce == 1.4
    old = slow.to_json()
    del old["mpi_allreduce"]
    assert Model.from_json(old).mpi_allreduce == 1.0
    with pytest.raises(ValueError, match="mpi_allreduce must be"):
        Model(link, mpi_allreduce=0.0)
