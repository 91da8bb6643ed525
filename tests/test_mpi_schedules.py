"""Schedules across real ranks: ``schedule="auto"`` makes one choice on every rank (rank
0's model), the hierarchical schedules against NumPy references of every rank's gradient
with their exact traced bytes, and errors on every rank. Hosts are emulated by
``local_comm``: ranks 2h and 2h + 1 form host h. Run with ``mpiexec -n N python -m
mpi4py -m pytest --with-mpi -m mpi``."""

import math

import h5py
import numpy as np
import pytest

import mpicomp
from conftest import gather_all, ring_order_sum, ring_traffic, world
from mpicomp.collectives import bounded
from mpicomp.collectives.sharded import shard_bounds
from mpicomp.collectives.traffic import Traffic
from mpicomp.errors import RankError
from mpicomp.model.cost import Network, Topology, choose
from mpicomp.model.measured import Model, Speed, codec_key

N_ELEMS = 20_011  # odd: shards and chunks of unequal lengths


# Ranks share the cores: one kernel thread each (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_numba_thread_per_rank")


@pytest.fixture
def pairs():
    """Yield the emulated host communicator: ranks 2h and 2h + 1 on host h; freed after."""
    comm = world()
    local = comm.Split(comm.rank // 2, comm.rank)
    yield local
    local.Free()


def _hierarchical(comm) -> bool:
    return comm.size >= 4 and comm.size % 2 == 0


@pytest.fixture
def host_pairs(pairs):
    """``pairs`` where the ranks make several hosts of two; the test skips elsewhere."""
    if not _hierarchical(world()):
        pytest.skip("needs an even number of ranks >= 4 (hosts of two)")
    return pairs


def _model(speed: Speed, codec, inter_gbit=1.0) -> Model:
    return Model(
        Network(2e-6, 10e9), Network(50e-6, inter_gbit * 1e9 / 8), {codec_key(codec): speed}
    )


def _grad(comm, n=N_ELEMS, seed=0):
    return np.random.default_rng([comm.rank, n, seed]).standard_normal(n).astype(np.float32)


@pytest.mark.mpi
def test_auto_makes_rank_0s_choice_on_every_rank_whatever_each_rank_was_given():
    comm = world()
    codec = mpicomp.codec("signsgd")
    # Each rank brings another model: compute so slow on rank 0 that only the
    # uncompressed float32 pays, free elsewhere. Rank 0's is the one every rank uses.
    speed = Speed(1e-6, 1e-6) if comm.rank == 0 else Speed(0.0, 0.0)
    cc = mpicomp.CompressedComm(comm, codec, schedule="auto", model=_model(speed, codec))
    with cc:
        cc.allreduce(_grad(comm), name="w")
        chosen, predicted = cc.schedule_for(N_ELEMS)
    everyone = comm.allgather((chosen, predicted))
    assert len(set(everyone)) == 1
    if comm.size > 1:
        expected, times = choose(codec, N_ELEMS, cc.topology, _model(Speed(1e-6, 1e-6), codec))
        assert chosen == expected == "float32"
        assert predicted == times["float32"]


@pytest.mark.mpi
def test_auto_measures_a_model_when_given_none_and_chooses_alike(monkeypatch):
    from mpicomp.model import probe

    comm = world()
    monkeypatch.delenv("MPICOMP_MODEL", raising=False)
    # Small probes (what is measured, not how well: 4 ranks share 2 cores here).
    monkeypatch.setattr(probe, "PROBE_MAX_BYTES", 1 << 21)
    real = probe.measured_speeds
    monkeypatch.setattr(
        probe,
        "measured_speeds",
        lambda comm, codecs, numel=0, **kw: real(comm, codecs, 1 << 16, **kw),
    )
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", bits=4, schedule="auto") as cc:
        y = cc.allreduce(_grad(comm), name="w")
        model = cc.model
        assert model.source == "measured"
        assert model.intra.beta > 0 and model.inter.alpha >= 0
        assert codec_key(cc.codec) in model.speeds
        plan = cc.schedule_for(N_ELEMS)
    assert len(set(comm.allgather((plan, model.to_json()["intra"]["beta"])))) == 1
    np.testing.assert_array_equal(gather_all(comm, y)[0], y)  # one average everywhere


def _host_sums(comm, x):
    """Return the per-host sums of every rank's ``x`` (host h: ranks 2h, 2h + 1), float64."""
    every = gather_all(comm, x).astype(np.float64)
    return every.reshape(comm.size // 2, 2, -1).sum(axis=1)


@pytest.mark.mpi
@pytest.mark.parametrize("inner", ["ring", "direct"])
def test_hierarchical_qsgd_quantizes_each_hosts_sum_once(inner, host_pairs):
    """Every element of the result is within one quantization step of the true average:
    each host's sum is quantized on the grid of the largest host-sum L2 norm (QSGD)."""
    comm = world()
    x = _grad(comm)
    cc = mpicomp.CompressedComm(
        comm, "qsgd_maxnorm", bits=8, schedule=f"hier:{inner}", local_comm=host_pairs
    )
    with cc:
        assert cc.topology == Topology(comm.size // 2, 2, True, comm.size)
        y = cc.allreduce(x, name="w")
    sums = _host_sums(comm, x)
    bounds = shard_bounds(x.size, 2)
    hosts, levels = sums.shape[0], 2 ** (8 - 1) - 1
    for a, b in bounds:  # each local rank's shard has its own norm
        norm = np.linalg.norm(sums[:, a:b], axis=1).max()
        step = norm / levels * hosts / comm.size
        assert np.abs(y[a:b] - sums[:, a:b].sum(axis=0) / comm.size).max() <= step * 1.0001
    every = gather_all(comm, y)
    assert (every == every[0]).all()


@pytest.mark.mpi
@pytest.mark.parametrize("inner", ["ring", "direct"])
def test_hierarchical_qsgd_keeps_the_norms_of_a_fused_buckets_tensors_apart(inner, host_pairs):
    """A bucket of a small tensor and a large one: a local rank's shard holds the end of
    the one and the start of the other, and no norm block may span both (per_tensor)."""
    comm = world()
    rng = np.random.default_rng(comm.rank)
    small = (rng.standard_normal(1500) * 1e-3).astype(np.float32)  # ends mid-block of shard 0
    large = (rng.standard_normal(2501) * 1e3).astype(np.float32)
    cc = mpicomp.CompressedComm(
        comm, "qsgd_maxnorm", bits=8, schedule=f"hier:{inner}", local_comm=host_pairs
    )
    with cc:
        got_small, got_large = cc.allreduce_many([small, large], ["small", "large"])
    for mine, got in ((small, got_small), (large, got_large)):
        want = gather_all(comm, mine).astype(np.float64).mean(axis=0)
        assert np.linalg.norm(got - want) <= 0.05 * np.linalg.norm(want)


@pytest.mark.mpi
def test_hierarchical_ring_and_direct_give_the_same_results(host_pairs):
    comm = world()
    x = _grad(comm, seed=3)
    out = {}
    for inner in ("ring", "direct"):
        for codec, params in (("qsgd_maxnorm", {"bits": 4}), ("signsgd", {})):
            with mpicomp.CompressedComm(
                comm, codec, schedule=f"hier:{inner}", local_comm=host_pairs, **params
            ) as cc:
                out[inner, codec] = cc.allreduce(x, name="w")
    for codec in ("qsgd_maxnorm", "signsgd"):
        np.testing.assert_array_equal(out["ring", codec], out["direct", codec])


@pytest.mark.mpi
def test_hierarchical_signsgd_is_the_majority_of_the_hosts_sums(host_pairs):
    comm = world()
    x = _grad(comm, seed=5)
    with mpicomp.CompressedComm(comm, "signsgd", schedule="hier:ring", local_comm=host_pairs) as cc:
        y = cc.allreduce(x, name="w")
    sums = _host_sums(comm, x)
    votes = (sums >= 0).sum(axis=0)
    hosts = sums.shape[0]
    decided = votes * 2 != hosts  # ties are broken by the codec's draw
    np.testing.assert_array_equal(
        np.sign(y[decided]), np.where(votes[decided] * 2 > hosts, 1.0, -1.0)
    )


@pytest.mark.mpi
@pytest.mark.parametrize("codec,params", [("threelc", {}), ("topk", {"ratio": 0.05})])
@pytest.mark.parametrize("inner", ["allgather", "sharded"])
def test_hierarchical_gather_codecs_average_the_hosts_decoded_sums(
    codec, params, inner, host_pairs
):
    """Without error feedback a host's sum is what its local rank compresses: the result
    is the average of the decoded host sums (the codec applied to each, here by NumPy)."""
    comm = world()
    x = _grad(comm, seed=7)
    c = mpicomp.codec(codec, **params)
    with mpicomp.CompressedComm(
        comm, c, schedule=f"hier:{inner}", local_comm=host_pairs, error_feedback=False
    ) as cc:
        y = cc.allreduce(x, name="w")
    every = gather_all(comm, x).reshape(comm.size // 2, 2, -1)
    host_sums = every[:, 0] + every[:, 1]  # float32, as MPI sums two ranks
    hosts = host_sums.shape[0]

    def round_trip(v):
        return c.decode(c.encode(np.ascontiguousarray(v))).astype(np.float64)

    expected = np.empty(x.size, dtype=np.float64)
    for a, b in shard_bounds(x.size, 2):  # each local rank's shard of each host's sum
        if inner == "allgather":
            expected[a:b] = np.sum([round_trip(s[a:b]) for s in host_sums], axis=0)
            continue
        # Pushed to owners by sub-shard, averaged there, compressed again and pulled.
        for lo, hi in shard_bounds(b - a, hosts):
            pushed = np.sum([round_trip(s[a + lo : a + hi]) for s in host_sums], axis=0)
            average = (pushed / hosts).astype(np.float32)
            expected[a + lo : a + hi] = round_trip(average) * hosts
    np.testing.assert_allclose(y, expected / comm.size, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_hierarchical_bytes_are_the_reduce_scatter_the_ring_between_hosts_and_the_allgather(
    host_pairs,
):
    comm = world()
    cc = mpicomp.CompressedComm(comm, "signsgd", schedule="hier:ring", local_comm=host_pairs)
    cc.recorder = traffic = Traffic()
    with cc:
        cc.allreduce(_grad(comm), name="w")
    ops = traffic.by_op()
    a, b = shard_bounds(N_ELEMS, 2)[comm.rank % 2]
    shard, hosts = b - a, comm.size // 2
    assert ops["mpi.reduce_scatter"] == (4 * (N_ELEMS - shard), 4 * shard)
    assert ops["mpi.allgatherv"] == (4 * shard, 4 * (N_ELEMS - shard))
    assert ops["mpi.allreduce"] == (2, 2)  # overflow flag over all, status within the host
    # Between hosts: the majority ring of the shard over H ranks (host h is rank h there).
    sent, recv, _ = ring_traffic(
        shard, hosts, comm.rank // 2, bounded.CHUNK_ALIGN, lambda i: math.ceil(math.log2(i + 1)), 1
    )
    ring_ops = [v for k, v in ops.items() if k.startswith("ring.")]
    assert tuple(map(sum, zip(*ring_ops, strict=True))) == (sent, recv)


@pytest.mark.mpi
def test_hierarchical_schedules_refuse_a_topology_without_them_on_every_rank(pairs):
    comm = world()
    if _hierarchical(comm):
        pytest.skip("these ranks make hosts of two")
    with pytest.raises(ValueError, match=r"schedule='hier:ring' needs several hosts"):
        mpicomp.CompressedComm(comm, "signsgd", schedule="hier:ring", local_comm=pairs)
    # auto never picks one there.
    codec = mpicomp.codec("signsgd")
    model = _model(Speed(0.0, 0.0), codec, inter_gbit=0.01)
    with mpicomp.CompressedComm(comm, codec, schedule="auto", local_comm=pairs, model=model) as cc:
        cc.allreduce(_grad(comm), name="w")
        assert not cc.schedule_for(N_ELEMS)[0].startswith("hier:")


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["raise", "skip_step", "zero"])
def test_a_nan_on_one_rank_of_a_hierarchical_call_reaches_every_rank(policy, host_pairs):
    comm = world()
    x = _grad(comm)
    if comm.rank == comm.size - 1:
        x[17] = np.nan
    cc = mpicomp.CompressedComm(
        comm,
        "qsgd_maxnorm",
        bits=8,
        schedule="hier:ring",
        local_comm=host_pairs,
        nonfinite=policy,
    )
    with cc:
        if policy == "raise":
            error = ValueError if comm.rank == comm.size - 1 else RankError
            with pytest.raises(error, match="NaN or Inf"):
                cc.allreduce(x, name="w")
        elif policy == "skip_step":
            with pytest.warns(mpicomp.NonFiniteWarning, match=f"rank.s. {comm.size - 1}"):
                y = cc.allreduce(x, name="w")
            assert not y.any()
        else:
            y = cc.allreduce(x, name="w")
            assert np.isfinite(y).all()
        # The communicator is still in step: a clean call follows on every rank.
        assert np.isfinite(cc.allreduce(_grad(comm), name="w")).all()


@pytest.mark.mpi
def test_the_trace_records_each_calls_schedule_and_prediction(shared_dir):
    comm = world()
    path = shared_dir / "auto.h5"
    codec = mpicomp.codec("qsgd_maxnorm", bits=4)
    model = _model(Speed(1e-9, 1e-9, 4.0), codec)
    with mpicomp.CompressedComm(
        comm, codec, schedule="auto", model=model, trace=path, min_numel=1000
    ) as cc:
        cc.allreduce(_grad(comm), name="big")
        cc.allreduce(_grad(comm, 100), name="small")
        plan = cc.schedule_for(N_ELEMS)
    if comm.rank == 0:
        with h5py.File(path, "r") as f:
            assert f.attrs["mpicomp_trace_version"] == 3
            events = f["events"][:]
        big = events[events["name"] == b"big"]
        small = events[events["name"] == b"small"]
        assert (big["schedule"] == plan[0].encode()).all()
        assert np.allclose(big["t_predicted"], plan[1]) and np.isfinite(plan[1])
        assert (small["schedule"] == b"float32").all()  # below min_numel
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_hosts_sum_that_overflows_float32_raises_or_skips_on_every_rank(policy, host_pairs):
    comm = world()
    x = _grad(comm)
    if comm.rank < 2:  # both ranks of host 0: finite, but their sum is not
        x[-3:] = np.float32(3e38)
    with mpicomp.CompressedComm(
        comm, "qsgd_maxnorm", schedule="hier:ring", local_comm=host_pairs, nonfinite=policy
    ) as cc:
        if policy == "raise":
            with pytest.raises(RankError, match="sum over a host's ranks overflows float32"):
                cc.allreduce(x, name="w")
        else:
            with pytest.warns(mpicomp.NonFiniteWarning, match="overflows float32"):
                assert not cc.allreduce(x, name="w").any()
        assert np.isfinite(cc.allreduce(_grad(comm), name="w")).all()


@pytest.mark.mpi
@pytest.mark.parametrize("outcome", ["fails", "skips"])
def test_one_local_rank_failing_between_hosts_reaches_every_rank(outcome, host_pairs, monkeypatch):
    """Local rank 1's exchange between hosts raises (or skips) on every host; local rank
    0's succeeds: every rank must raise (or skip) alike, none wait in the allgather."""
    comm = world()
    from mpicomp.reduction import integer_sum
    from mpicomp.reduction.agreement import Skipped

    ring = integer_sum.KIND.schedules["ring"]
    armed = [True]

    def flaky(call, codec, flat):
        if armed[0] and host_pairs.rank == 1:
            if outcome == "fails":
                raise MemoryError("planted: out of device memory")
            raise Skipped([], "planted skip")
        return ring.run(call, codec, flat)

    monkeypatch.setitem(integer_sum.KIND.schedules, "ring", ring._replace(run=flaky))
    with mpicomp.CompressedComm(
        comm, "qsgd_maxnorm", schedule="hier:ring", local_comm=host_pairs, nonfinite="skip_step"
    ) as cc:
        if outcome == "fails":
            mine = MemoryError if host_pairs.rank == 1 else RankError
            with pytest.raises(
                mine, match="planted" if host_pairs.rank == 1 else "this host failed"
            ):
                cc.allreduce(_grad(comm), name="w")
        else:
            with pytest.warns(mpicomp.NonFiniteWarning):
                assert not cc.allreduce(_grad(comm), name="w").any()
        armed[0] = False
        assert np.isfinite(cc.allreduce(_grad(comm), name="w")).all()


@pytest.mark.mpi
@pytest.mark.parametrize("inner", ["allgather", "sharded"])
def test_a_corrupt_payload_between_hosts_on_a_device_fails_the_whole_host(
    inner, host_pairs, monkeypatch
):
    """On cuda-emulated a gathered or pulled payload's checks are read after its decode:
    still inside the exchange between hosts, so that the failure counts in the host's
    outcome. Rank 1 finds a payload corrupt: it raises the PayloadError, its host's other
    rank a RankError (none returns a result while a host-mate failed). The other hosts
    finished their step, so the next call is refused on every rank, by the agreement,
    never a hang."""
    from mpicomp.errors import PayloadError

    comm = world()
    monkeypatch.setenv(mpicomp.kernels.ENV, "cuda-emulated")
    with mpicomp.CompressedComm(
        comm, "threelc", schedule=f"hier:{inner}", local_comm=host_pairs, error_feedback=False
    ) as cc:
        method = "decode_gathered" if inner == "allgather" else "decode_flat"
        real = getattr(cc.codec, method)

        def corrupt(payload, numel):
            if inner == "allgather":
                payload = [p.copy() for p in payload]
                payload[-1][-1] ^= 0x10
            else:
                payload = payload.copy()
                payload[-1] ^= 0x10
            return real(payload, numel)

        if comm.rank == 1:
            monkeypatch.setattr(cc.codec, method, corrupt)
        if comm.rank // 2 == 0:  # rank 1's host
            caught = PayloadError if comm.rank == 1 else RankError
            with pytest.raises(caught, match="checksum" if comm.rank == 1 else "this host"):
                cc.allreduce(_grad(comm), name="w")
        else:
            cc.allreduce(_grad(comm), name="w")
        monkeypatch.undo()
        with pytest.raises(RankError, match="step"):
            cc.allreduce(_grad(comm), name="w")


@pytest.mark.mpi
@pytest.mark.parametrize("inner", ["allgather", "sharded"])
def test_hierarchical_error_feedback_keeps_a_residual_per_local_shard(inner, host_pairs):
    comm = world()
    x = _grad(comm, seed=9)
    with mpicomp.CompressedComm(
        comm, "topk", ratio=0.01, schedule=f"hier:{inner}", local_comm=host_pairs
    ) as cc:
        first = cc.allreduce(x, name="w")
        second = cc.allreduce(x, name="w")
        residuals = cc.state_dict()["residuals"]
    a, b = shard_bounds(x.size, 2)[host_pairs.rank]
    mine = f"w#shard@{host_pairs.rank}/2"
    if inner == "allgather":
        assert set(residuals) == {mine} and residuals[mine].size == b - a
    else:  # pushed by sub-shard to the hosts, one residual each
        assert set(residuals) == {f"{mine}#shard{h}" for h in range(comm.size // 2)}
    # What top-k dropped the first time is sent the second time: results differ.
    assert not np.array_equal(first, second)
    every = gather_all(comm, second)
    assert (every == every[0]).all()


@pytest.mark.mpi
@pytest.mark.parametrize("n", [0, 1, 7, N_ELEMS])
def test_none_on_mpicomps_float32_ring_is_the_ring_order_sum_on_every_rank(n):
    comm = world()
    x = _grad(comm, n)
    keep = x.copy()
    with mpicomp.CompressedComm(comm, "none", schedule="ring", min_numel=0) as cc:
        y = cc.allreduce(x, name="w")
    np.testing.assert_array_equal(x, keep)  # summed in a buffer of its own, not the input
    expected = ring_order_sum(gather_all(comm, x)) / np.float32(comm.size)
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(gather_all(comm, y)[0], y)


@pytest.mark.mpi
def test_auto_picks_the_float32_ring_where_mpi_allreduce_measured_slow():
    comm = world()
    none = mpicomp.codec("none")
    slow = _model(Speed(0.0, 0.0), none)
    slow = Model(slow.intra, slow.inter, source="given", mpi_allreduce=2.0)
    with mpicomp.CompressedComm(comm, none, schedule="auto", model=slow, min_numel=0) as cc:
        y = cc.allreduce(_grad(comm), name="w")
        chosen, _ = cc.schedule_for(N_ELEMS)
    if comm.size > 1:
        assert chosen == "ring"
        expected = ring_order_sum(gather_all(comm, _grad(comm))) / np.float32(comm.size)
        np.testing.assert_array_equal(y, expected)


@pytest.mark.mpi
def test_none_under_auto_measures_a_model_and_averages(monkeypatch):
    comm = world()
    monkeypatch.delenv("MPICOMP_MODEL", raising=False)
    x = _grad(comm)
    with mpicomp.CompressedComm(comm, "none", schedule="auto") as cc:
        y = cc.allreduce(x, name="w")
        assert cc.model.source == "measured"
        assert cc.schedule_for(N_ELEMS)[0] in ("allreduce", "ring")
    expected = gather_all(comm, x).astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_the_float_rings_refuse_a_buffer_they_cannot_sum_in_place():
    from mpicomp.collectives.float_ring import allreduce_float16, allreduce_float32

    comm = world()
    with pytest.raises(TypeError, match="buf must be float32, got float64"):
        allreduce_float32(comm, np.zeros(8))
    with pytest.raises(ValueError, match="C-contiguous"):
        allreduce_float32(comm, np.zeros((4, 4), np.float32)[:, 1])
    with pytest.raises(TypeError, match="buf must be float16"):
        allreduce_float16(comm, np.zeros(8, np.float32))
