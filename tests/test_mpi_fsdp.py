"""mpicomp.torch.fsdp across ranks, on a gloo process group made from the MPI ranks:
FSDP2 (``fully_shard``) through mpicomp's ReduceScatter against FSDP's own
reduce-scatter (bit for bit with codec none at 2 ranks, bfloat16 reduce_dtype too),
compressed codecs training with every rank's full parameters identical, the divide
factor, refused groups, ops and installs; compressed HSDP on hosts of two ranks made
by a split (ranks // 2) against torch's own HSDP."""

import numpy as np
import pytest

from conftest import world

torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")

from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402

import mpicomp.torch as mt  # noqa: E402
import mpicomp.torch.fsdp  # noqa: E402, F401  (the module this file is named after)
from mpicomp import CompressedComm, RankError  # noqa: E402

pytestmark = pytest.mark.mpi
torch.set_num_threads(1)  # ranks share the cores

CODECS = [
    ("qsgd_maxnorm", {"bits": 4}),
    ("signsgd", {}),
    ("topk", {"ratio": 0.25}),
    ("threelc", {}),
]


def _model(seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        # Linear(48, 3) has 3 rows: padded to shard them over 2, 4 or 5 ranks.
        return torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.ReLU(), torch.nn.Linear(48, 3))


def _shard(model, mesh=None, mp=None):
    """fully_shard every Linear, then the root (FSDP's usual wrapping)."""
    kw = {} if mp is None else {"mp_policy": mp}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


# A fixed linear map, learnt from every rank's own batches: a loss that must go down.
_TARGET = torch.randn(12, 3, generator=torch.Generator().manual_seed(7))


def _batch(step, rank, n=16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 12, generator=g)
    return x, x @ _TARGET


def _train(model, steps, rank, lr=0.05):
    """SGD with momentum on ``rank``'s batches; return the losses (this rank's)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full(model) -> np.ndarray:
    """Every parameter, gathered whole (``full_tensor``), end to end."""
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]).numpy()


def _local_grads(model) -> np.ndarray:
    """This rank's sharded gradients, end to end, as float32."""
    return torch.cat([p.grad.to_local().reshape(-1).float() for p in model.parameters()]).numpy()


def _same_on_every_rank(comm, a: np.ndarray) -> bool:
    everyone = comm.allgather(a.tobytes())
    return all(e == everyone[0] for e in everyone)


def _needs_ranks(least):
    if world().size < least:
        pytest.skip(f"needs {least} ranks or more")


# -- FSDP2 through mpicomp's reduce-scatter ----------------------------------------------


def test_uncompressed_training_matches_fsdps_own_reduce_scatter(gloo):
    comm = world()
    ours = _shard(_model())
    cc = mt.compress_fsdp(ours, comm, "none")
    theirs = _shard(_model())
    try:
        _train(ours, 3, comm.rank)
        _train(theirs, 3, comm.rank)
        a, b = _full(ours), _full(theirs)
        ga, gb = _local_grads(ours), _local_grads(theirs)
    finally:
        cc.close()
    if comm.size <= 2:  # sums of two float32 in either order, halved: the same bits
        assert a.tobytes() == b.tobytes()
        assert ga.tobytes() == gb.tobytes()
    else:  # gloo and mpicomp sum the ranks in other orders
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-7)
    assert _same_on_every_rank(comm, a)


def _bfloat16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16 (to nearest even), as float32."""
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).bfloat16().float().numpy()


def test_bfloat16_reduce_dtype_rounds_the_float32_average_once(gloo):
    comm = world()
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    ours = _shard(_model(), mp=mp)
    cc = mt.compress_fsdp(ours, comm, "none")
    theirs = _shard(_model(), mp=mp)
    plain = _model()  # every rank's own gradient, unsharded
    try:
        for model in (ours, theirs, plain):
            x, y = _batch(0, comm.rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
        ga, gb = _local_grads(ours), _local_grads(theirs)
        full = torch.cat([p.grad.full_tensor().reshape(-1) for p in ours.parameters()]).numpy()
    finally:
        cc.close()
    # The reference: each rank's gradient as FSDP casts it to bfloat16, averaged in
    # float64, rounded once to bfloat16.
    mine = torch.cat([p.grad.reshape(-1) for p in plain.parameters()]).numpy()
    every = np.stack([_bfloat16(g) for g in comm.allgather(mine)])
    want = _bfloat16(every.astype(np.float64).mean(axis=0))
    assert np.any(want != 0)
    # float32's sum of a few bfloat16 values is exact, its division by N rounds: the
    # bfloat16 rounding after it may then land one step off, rarely.
    np.testing.assert_allclose(full, want, rtol=2**-7, atol=0)
    assert np.mean(full == want) > 0.97
    if comm.size <= 2:  # gloo's sum of two rounded once to bfloat16, halved: the same bits
        assert ga.tobytes() == gb.tobytes()


@pytest.mark.parametrize("codec,params", CODECS, ids=[c for c, _ in CODECS])
def test_a_compressed_codec_trains_and_keeps_every_replica_identical(gloo, codec, params):
    comm = world()
    model = _shard(_model())
    cc = mt.compress_fsdp(model, comm, codec, min_numel=16, **params)
    try:
        losses = _train(model, 12, comm.rank, lr=0.05)
        full = _full(model)
        residuals = cc.state_dict()["residuals"]
    finally:
        cc.close()
    mean = np.mean(comm.allgather(losses), axis=0)
    assert mean[-3:].mean() < 0.6 * mean[:3].mean(), mean
    assert _same_on_every_rank(comm, full)
    if comm.size > 1 and codec in ("topk", "threelc"):  # error feedback: per module and row
        assert {k.split("#")[0] for k in residuals} == {"fsdp:0", "fsdp:2"}, sorted(residuals)
    reference = _shard(_model())
    cc = mt.compress_fsdp(reference, comm, "none")
    try:
        _train(reference, 12, comm.rank, lr=0.05)
        uncompressed = _full(reference)
    finally:
        cc.close()
    if comm.size > 1:
        assert full.tobytes() != uncompressed.tobytes()  # the codec did act


def test_the_divide_factor_divides_the_sum(gloo):
    _needs_ranks(2)
    comm = world()
    factor = 3.0
    ours, theirs = _shard(_model()), _shard(_model())
    for m in ours.modules():  # FSDP asks for ReduceOp.PREMUL_SUM(1/3)
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(factor)
    cc = mt.compress_fsdp(ours, comm, "none")
    try:
        for model in (ours, theirs):
            x, y = _batch(0, comm.rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
        ga, gb = _local_grads(ours), _local_grads(theirs)  # theirs: the average
    finally:
        cc.close()
    np.testing.assert_allclose(ga, gb * comm.size / factor, rtol=1e-5, atol=1e-7)


def test_a_process_group_of_other_ranks_is_refused_on_every_rank(gloo):
    _needs_ranks(2)
    comm = world()
    mine, _ = gloo.new_subgroups_by_enumeration([[r] for r in range(comm.size)])  # alone
    with CompressedComm(comm, "none") as cc:
        rs = mt.ReduceScatter(cc, "x")
        out = torch.empty(4)
        with pytest.raises(ValueError, match="process group is not the CompressedComm's ranks"):
            rs(out, torch.ones(4 * comm.size), mine, gloo.ReduceOp.AVG)
        rs(out, torch.full((4 * comm.size,), 2.0), gloo.group.WORLD, gloo.ReduceOp.SUM)
        assert torch.equal(out, torch.full((4,), 2.0 * comm.size))


def test_ops_fsdp_does_not_use_and_async_calls_are_refused(gloo):
    comm = world()
    with CompressedComm(comm, "none") as cc:
        rs = mt.ReduceScatter(cc, "x")
        out, x = torch.empty(2), torch.ones(2 * comm.size)
        with pytest.raises(ValueError, match="ReduceOp.AVG, ReduceOp.SUM or"):
            rs(out, x, gloo.group.WORLD, gloo.ReduceOp.MAX)
        with pytest.raises(ValueError, match="async_op=True"):
            rs(out, x, gloo.group.WORLD, gloo.ReduceOp.AVG, async_op=True)
        rs(out, x, gloo.group.WORLD, gloo.ReduceOp.PREMUL_SUM(0.5))
        assert torch.equal(out, torch.full((2,), 0.5 * comm.size))


def test_a_model_without_fsdp_modules_is_refused(gloo):
    comm = world()
    with pytest.raises(ValueError, match="has no FSDPModule"):
        mt.compress_fsdp(_model(), comm, "none")
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        mt.compress_fsdp(list(_model().parameters()), comm, "none")


def test_other_models_on_one_rank_raise_on_every_rank(gloo):
    _needs_ranks(2)
    comm = world()
    model = _model()
    if comm.rank == comm.size - 1:
        model.append(torch.nn.Linear(3, 3))
    _shard(model)
    with pytest.raises(RankError, match="compress_fsdp"):
        mt.compress_fsdp(model, comm, "none")


def test_a_codec_without_a_reduce_scatter_says_so_on_every_rank(gloo):
    _needs_ranks(2)
    comm = world()
    model = _shard(_model())
    cc = mt.compress_fsdp(model, comm, "powersgd", min_numel=16)
    try:
        x, y = _batch(0, comm.rank)
        with pytest.raises(ValueError, match="has no reduce-scatter"):
            torch.nn.functional.mse_loss(model(x), y).backward()
    finally:
        cc.close()


# -- compressed HSDP: hosts of two ranks --------------------------------------------------


def _hosts_of_two():
    """An MPI split standing for hosts of two ranks: ranks 2h and 2h+1 are host h."""
    comm = world()
    return comm.Split(comm.rank // 2, comm.rank)


def _needs_hosts_of_two():
    size = world().size
    if size < 4 or size % 2:
        pytest.skip("needs an even number of ranks, 4 or more: hosts of two ranks")


def _mesh_of_hosts_of_two():
    """``host_mesh`` over hosts of two ranks (skipped where the ranks make none)."""
    _needs_hosts_of_two()
    host = _hosts_of_two()
    try:
        return mt.host_mesh(world(), host)
    finally:
        host.Free()


def test_uncompressed_hsdp_matches_torchs_own_hsdp(gloo):
    from torch.distributed.device_mesh import DeviceMesh

    comm = world()
    mesh = _mesh_of_hosts_of_two()
    assert mesh.ndim == 1 and mesh.size() == 2 and mesh.get_local_rank() == comm.rank % 2
    ours = _shard(_model(), mesh)
    cc = mt.compress_hsdp(ours, comm, "none")
    assert cc.size == comm.size // 2
    layout = [[2 * h, 2 * h + 1] for h in range(comm.size // 2)]
    native = DeviceMesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
    theirs = _shard(_model(), native)
    try:
        _train(ours, 3, comm.rank)
        _train(theirs, 3, comm.rank)
        a, b = _full(ours), _full(theirs)  # gathered within the host
    finally:
        cc.close()
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    if comm.size == 4:  # halved sums of two, twice, in both: the same bits
        assert a.tobytes() == b.tobytes()
    assert _same_on_every_rank(comm, a)


HSDP_CODECS = [("qsgd_maxnorm", {"bits": 4}), ("topk", {"ratio": 0.25})]


@pytest.mark.parametrize("codec,params", HSDP_CODECS, ids=[c for c, _ in HSDP_CODECS])
def test_compressed_hsdp_trains_and_keeps_every_replica_identical(gloo, codec, params):
    comm = world()
    mesh = _mesh_of_hosts_of_two()
    model = _shard(_model(), mesh)
    cc = mt.compress_hsdp(model, comm, codec, min_numel=16, **params)
    try:
        losses = _train(model, 12, comm.rank, lr=0.05)
        full = _full(model)
        residuals = cc.state_dict()["residuals"]
    finally:
        cc.close()
    mean = np.mean(comm.allgather(losses), axis=0)
    assert mean[-3:].mean() < 0.6 * mean[:3].mean(), mean
    assert _same_on_every_rank(comm, full)
    if codec == "topk":  # error feedback: a residual per module
        assert set(residuals) == {"hsdp:0", "hsdp:2"}, sorted(residuals)


def test_hosts_of_different_sizes_are_refused_on_every_rank(gloo):
    comm = world()
    if comm.size < 3 or comm.size % 2 == 0:
        pytest.skip("needs an odd number of ranks, 3 or more")
    host = _hosts_of_two()  # the last host holds one rank
    try:
        with pytest.raises(ValueError, match="hosts hold different numbers of ranks"):
            mt.host_mesh(comm, host)
    finally:
        host.Free()


def test_hsdp_refuses_a_model_sharded_over_every_rank_in_two_dimensions(gloo):
    _needs_hosts_of_two()
    from torch.distributed.device_mesh import DeviceMesh

    comm = world()
    layout = [[2 * h, 2 * h + 1] for h in range(comm.size // 2)]
    model = _shard(_model(), DeviceMesh("cpu", layout, mesh_dim_names=("replicate", "shard")))
    with pytest.raises(ValueError, match="2-D mesh"):
        mt.compress_hsdp(model, comm, "none")


def test_fsdp_over_a_host_mesh_refuses_the_communicator_of_every_rank(gloo):
    _needs_hosts_of_two()
    comm = world()
    host = _hosts_of_two()
    try:
        model = _shard(_model(), mt.host_mesh(comm, host))
    finally:
        host.Free()
    with pytest.raises(ValueError, match="process group is not the CompressedComm's ranks"):
        mt.compress_fsdp(model, comm, "none")
