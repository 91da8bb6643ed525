"""One rank's mistake in a public entry of ``mpicomp.torch`` raises on every rank, in the
call that made it, and moves no state (docs/reliability.md, "PyTorch adapters").

Each case calls an entry alike on every rank but the last, which makes the mistake
(so that no message passes by naming rank 0 alone). The rank at fault raises its own
``TypeError``/``ValueError`` where it refused its own arguments; every other rank
raises ``RankError``; where the ranks merely disagree, every rank raises
``RankError`` naming what differs. A hang fails by the module's timeout."""

import numpy as np
import pytest

from conftest import world

torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")

from test_mpi_fsdp import _batch, _mesh_of_hosts_of_two, _model, _shard  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

import mpicomp.torch as mt  # noqa: E402
from mpicomp import CompressedComm, PeerClosed, RankError  # noqa: E402

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(120)]
torch.set_num_threads(1)  # ranks share the cores


def _odd() -> bool:
    comm = world()
    return comm.rank == comm.size - 1


def _raises_on_every_rank(call, own=None, match=None):
    """Run ``call(odd)``; assert this rank raised: ``own`` on the rank at fault (None:
    RankError there too), RankError elsewhere; ``match`` in the message where given.
    Return the error."""
    odd = _odd()
    want = own if (odd and own is not None) else RankError
    with pytest.raises(want, match=match) as caught:
        call(odd)
    return caught.value


def _linear(seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _backward(model, step=0, poison=False):
    for p in model.parameters():
        p.grad = None
    g = torch.Generator().manual_seed(100 * step + world().rank)
    x = torch.randn(4, 6, generator=g)
    if poison:
        x[0, 0] = float("nan")
    model(x).square().mean().backward()


# -- a CompressedComm given with a codec or options on one rank --------------------------


@pytest.mark.parametrize("extra", [{"codec": "qsgd_maxnorm"}, {"bits": 4}, {"timeout": 30}])
@pytest.mark.parametrize("entry", ["DistributedOptimizer", "ZeroOptimizer", "HookState"])
def test_a_compressed_comm_with_a_codec_or_option_on_one_rank(entry, extra):
    with CompressedComm(world(), "qsgd_maxnorm", bits=4) as cc:
        model = _linear()

        def make(odd):
            given = extra if odd else {}
            if entry == "DistributedOptimizer":
                inner = torch.optim.SGD(model.parameters(), lr=0.1)
                return mt.DistributedOptimizer(inner, cc, model.named_parameters(), **given)
            if entry == "ZeroOptimizer":
                return mt.ZeroOptimizer(
                    model.named_parameters(), torch.optim.SGD, cc, lr=0.1, **given
                )
            return mt.HookState(cc, **given)

        own = TypeError
        _raises_on_every_rank(make, own)
        # Nothing was left behind: the same call made alike works.
        made = make(False)
        if hasattr(made, "close"):
            made.close()


# -- the sharded calls under them: reduce_scatter and allgather -------------------------

_SHARDED = {
    "reduce_scatter op": lambda cc, x, odd: cc.reduce_scatter(x, "w", op="sum" if odd else "mean"),
    "reduce_scatter name": lambda cc, x, odd: cc.reduce_scatter(x, "v" if odd else "w"),
    "ireduce_scatter size": lambda cc, x, odd: cc.ireduce_scatter(x[odd:], "w").wait(),
    "allgather precision": lambda cc, x, odd: cc.allgather(
        x[:4], "w", precision="bfloat16" if odd else "float32"
    ),
    "allgather numel": lambda cc, x, odd: cc.allgather(x[:4], "w", numel=3 if odd else 4),
    "iallgather size": lambda cc, x, odd: cc.iallgather(x[: 4 + odd], "w").wait(),
}


@pytest.mark.parametrize("codec", ["none", "qsgd_maxnorm", "topk"])
@pytest.mark.parametrize("mistake", list(_SHARDED))
def test_a_sharded_call_made_differently_on_one_rank(codec, mistake):
    with CompressedComm(world(), codec, min_numel=0) as cc:
        x = np.linspace(-1, 1, 40, dtype=np.float32)
        _raises_on_every_rank(lambda odd: _SHARDED[mistake](cc, x, odd))
        assert cc.reduce_scatter(x, "w").shape == (-(-40 // cc.size),)  # and the next call


# -- ZeroOptimizer ---------------------------------------------------------------------


def test_zero_refuses_an_optimizer_that_steps_with_a_closure_when_made():
    model = _linear()
    with pytest.raises(TypeError, match="LBFGS.step needs a closure"):
        mt.ZeroOptimizer(model.named_parameters(), torch.optim.LBFGS, world(), lr=0.1)


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda m: m.to(torch.bfloat16), "dtype float32 on"),
        (lambda m: m[2].bias.requires_grad_(False), "requires_grad True on"),
    ],
    ids=["dtype", "requires_grad"],
)
def test_zero_names_the_parameter_whose_dtype_or_requires_grad_differs(change, said):
    model = _linear()

    def make(odd):
        if odd:
            change(model)
        return mt.ZeroOptimizer(model.named_parameters(), torch.optim.SGD, world(), lr=0.1)

    error = _raises_on_every_rank(make)
    assert f"parameter '2.bias': {said}" in str(error), error
    assert f"on rank {world().size - 1}" in str(error), error


class _FailingSGD(torch.optim.SGD):
    """SGD whose step raises where ``fail`` is set (one rank's inner optimizer)."""

    fail = False

    def step(self, closure=None):
        if _FailingSGD.fail:
            raise RuntimeError("this rank's inner step failed")
        return super().step(closure)


def _zero_state(opt) -> list:
    """This rank's rows (the inner optimizer's parameters) and the inner state, copied."""
    rows = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    return rows + [v.clone() for s in opt.state.values() for v in s.values()]


def test_a_zero_step_failing_on_one_rank_moves_nothing_on_any_rank():
    model = _linear()
    opt = mt.ZeroOptimizer(
        model.named_parameters(), _FailingSGD, world(), "topk", lr=0.1, momentum=0.9,
        ratio=0.5, min_numel=0,
    )  # fmt: skip
    try:
        _backward(model, 0)
        opt.step()  # the momentum exists: a failed step could move it
        before = _zero_state(opt)
        params = [p.detach().clone() for p in model.parameters()]
        residuals = {k: v.copy() for k, v in opt.comm.state_dict()["residuals"].items()}
        _backward(model, 1)
        _FailingSGD.fail = _odd()
        try:
            _raises_on_every_rank(lambda odd: opt.step(), RuntimeError)
        finally:
            _FailingSGD.fail = False
        after = _zero_state(opt)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert all(torch.equal(p, q) for p, q in zip(params, model.parameters(), strict=True))
        now = opt.comm.state_dict()["residuals"]
        assert set(now) == set(residuals)
        assert all(np.array_equal(now[k], residuals[k]) for k in now)
        _backward(model, 1)
        opt.step()  # and training goes on
    finally:
        opt.close()


def test_zero_closing_after_backward_on_one_rank_raises_peer_closed_on_the_others():
    model = _linear()
    opt = mt.ZeroOptimizer(model.named_parameters(), torch.optim.SGD, world(), lr=0.1)
    _backward(model, 0)
    if _odd():
        opt.close()
    else:
        with pytest.raises(PeerClosed, match="closed its ZeroOptimizer"):
            opt.step()
        opt.close()


def test_zero_load_state_dict_refused_on_one_rank_changes_no_rank():
    model = _linear()
    opt = mt.ZeroOptimizer(
        model.named_parameters(), torch.optim.Adam, world(), "topk", lr=0.01, ratio=0.5,
        min_numel=0,
    )  # fmt: skip
    try:
        _backward(model, 0)
        opt.step()
        saved = opt.state_dict()
        _backward(model, 1)
        opt.step()
        now = _zero_state(opt)
        damaged = dict(saved)
        ours = dict(saved["mpicomp"])
        if _odd():
            bad = {k: torch.full_like(v, float("nan")) for k, v in ours["residuals"].items()}
            ours["residuals"] = bad
        damaged["mpicomp"] = ours
        _raises_on_every_rank(lambda odd: opt.load_state_dict(damaged), ValueError, None)
        assert all(torch.equal(a, b) for a, b in zip(now, _zero_state(opt), strict=True))
        ours = dict(saved["mpicomp"])
        if _odd():
            del ours["comm_step"]
        _raises_on_every_rank(
            lambda odd: opt.load_state_dict({**saved, "mpicomp": ours}),
            ValueError,
            "comm_step" if _odd() else None,
        )
        opt.load_state_dict(saved)  # the whole state loads
    finally:
        opt.close()


def test_two_zero_optimizers_on_one_compressed_comm_keep_their_own_residuals():
    """A GAN's two models on one CompressedComm train as each on its own."""

    def train(shared: bool) -> list:
        comms = [CompressedComm(world(), "topk", ratio=0.5, min_numel=0)]
        comms.append(
            comms[0] if shared else CompressedComm(world(), "topk", ratio=0.5, min_numel=0)
        )
        models = [_linear(1), _linear(2)]
        opts = [
            mt.ZeroOptimizer(m.named_parameters(), torch.optim.SGD, c, lr=0.1)
            for m, c in zip(models, comms, strict=True)
        ]
        for step in range(3):
            for m, o in zip(models, opts, strict=True):
                _backward(m, step)
                o.step()
        for o in opts:
            o.close()
        if shared:
            assert opts[1].names == "optimizer1." and opts[0].names == ""
        for c in dict.fromkeys(comms):  # in order: a close is collective
            c.close()
        return [p.detach().clone() for m in models for p in m.parameters()]

    alone, shared = train(False), train(True)
    assert all(torch.equal(a, b) for a, b in zip(alone, shared, strict=True))


# -- the broadcasts ----------------------------------------------------------------------


def test_broadcasts_with_another_root_on_one_rank():
    model = _linear()
    error = _raises_on_every_rank(
        lambda odd: mt.broadcast_parameters(model, world(), root=1 if odd else 0)
    )
    assert "root" in str(error)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _raises_on_every_rank(
        lambda odd: mt.broadcast_optimizer_state(opt, world(), root=world().size if odd else 0),
        ValueError,
    )
    mt.broadcast_parameters(model, world(), root=0)


# -- init_process_group ------------------------------------------------------------------


def test_init_process_group_timeouts_that_differ_or_are_not_positive():
    _raises_on_every_rank(
        lambda odd: mt.init_process_group(world(), "gloo", timeout=0 if odd else 60),
        ValueError,
        "positive" if _odd() else None,
    )
    error = _raises_on_every_rank(
        lambda odd: mt.init_process_group(world(), "gloo", timeout=30 if odd else 60)
    )
    assert "timeout" in str(error)
    import torch.distributed as dist

    assert not dist.is_initialized()


# -- FSDP2: ReduceScatter, compress_fsdp, host_mesh, compress_hsdp -------------------------


def test_reduce_scatter_with_another_op_size_or_divide_factor_on_one_rank(gloo):
    comm = world()
    with CompressedComm(comm, "none") as cc:
        rs = mt.ReduceScatter(cc, "x")
        out, x = torch.empty(2), torch.ones(2 * comm.size)
        op = gloo.ReduceOp
        _raises_on_every_rank(lambda odd: rs(out, x, gloo.group.WORLD, op.SUM if odd else op.AVG))
        _raises_on_every_rank(
            lambda odd: rs(out, torch.ones(2 * comm.size + odd), gloo.group.WORLD, op.AVG),
            ValueError,
            "size times the output" if _odd() else None,
        )
        _raises_on_every_rank(
            lambda odd: rs(out, x, gloo.group.WORLD, op.MAX if odd else op.AVG), ValueError
        )
        error = _raises_on_every_rank(
            lambda odd: rs(out, x, gloo.group.WORLD, op.PREMUL_SUM(1 / (4 if odd else 3)))
        )
        assert "divided by" in str(error)
        rs(out, x, gloo.group.WORLD, op.AVG)  # and the next call works
        assert torch.equal(out, torch.ones(2))


def test_a_float16_sum_beyond_its_range_raises_on_every_rank(gloo):
    """FSDP sums float16 gradients (ReduceOp.SUM): a row past 65,504 is no Inf."""
    comm = world()
    with CompressedComm(comm, "none") as cc:
        rs = mt.ReduceScatter(cc, "x")
        out = torch.empty(2, dtype=torch.float16)
        big = torch.full((2 * comm.size,), 40000.0, dtype=torch.float16)
        with pytest.raises(RankError, match="sum over ranks overflows float16"):
            rs(out, big, gloo.group.WORLD, gloo.ReduceOp.SUM)
        rs(out, big / 4, gloo.group.WORLD, gloo.ReduceOp.SUM)  # 10,000 a rank: in range
        assert torch.equal(out, torch.full((2,), 10000.0 * comm.size, dtype=torch.float16))


def test_fsdp_divide_factors_that_differ_raise_out_of_backward_on_every_rank(gloo):
    model = _shard(_model())
    cc = mt.compress_fsdp(model, world(), "none")
    try:
        for module in model.modules():  # each FSDPModule has its own
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(4.0 if _odd() else 3.0)
        x, y = _batch(0, world().rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        error = _raises_on_every_rank(lambda odd: loss.backward())
        assert "divided by" in str(error)
    finally:
        cc.close()


def test_compress_fsdp_names_the_parameter_whose_size_differs(gloo):
    model = _model()
    if _odd():
        model[2] = torch.nn.Linear(48, 4)
    _shard(model)
    error = _raises_on_every_rank(lambda odd: mt.compress_fsdp(model, world(), "none"))
    assert "parameter '2.weight': shape (3, 48) on" in str(error), error


def test_compress_fsdp_given_a_compressed_comm_and_a_codec_on_one_rank(gloo):
    model = _shard(_model())
    with CompressedComm(world(), "none") as cc:
        _raises_on_every_rank(
            lambda odd: mt.compress_fsdp(model, cc, "topk" if odd else None), TypeError
        )


def test_host_mesh_given_a_host_on_one_rank_only(gloo):
    from mpi4py import MPI

    comm = world()
    host = comm.Split_type(MPI.COMM_TYPE_SHARED)  # collective: made on every rank
    try:
        error = _raises_on_every_rank(lambda odd: mt.host_mesh(comm, host=host if odd else None))
        assert "host: " in str(error), error
        assert mt.host_mesh(comm, host=host).size() == host.size  # given on every rank
    finally:
        host.Free()


@pytest.mark.parametrize("differs", [{"codec": "signsgd"}, {"bits": 2}, {"nonfinite": "zero"}])
def test_compress_hsdp_compares_codec_and_options_over_every_rank(gloo, differs):
    """With one host, nothing was compared: each rank trained with its own codec."""
    model = _shard(_model(), mesh=mt.host_mesh(world()))
    given = {"codec": "qsgd_maxnorm"}

    def make(odd):
        return mt.compress_hsdp(model, world(), **{**given, **(differs if odd else {})})

    _raises_on_every_rank(make)
    make(False).close()


# -- FSDP2 survives an error in backward ------------------------------------------------


def _fsdp_training(nonfinite, steps=12, poison_at=3):
    """Train a sharded model through compress_fsdp, one rank's batch NaN at
    ``poison_at``; return (losses, whether the poisoned step's parameters moved)."""
    rank = world().rank
    model = _shard(_model())
    cc = mt.compress_fsdp(model, world(), "qsgd_maxnorm", bits=4, nonfinite=nonfinite)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, moved = [], None
    try:
        for step in range(steps):
            x, y = _batch(step, rank)
            if step == poison_at and _odd():
                x[0, 0] = float("nan")
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            before = [p.to_local().detach().clone() for p in model.parameters()]
            if step == poison_at:
                if nonfinite == "raise":
                    _raises_on_every_rank(lambda odd, loss=loss: loss.backward(), ValueError, "NaN")
                else:
                    from mpicomp import NonFiniteWarning

                    with pytest.warns(NonFiniteWarning, match="step is skipped"):
                        loss.backward()
                assert all(p.grad is None for p in model.parameters())
                opt.step()  # nothing to step: every gradient is None
                after = [p.to_local() for p in model.parameters()]
                moved = not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
                continue
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        cc.close()
    return losses, moved


@pytest.mark.parametrize("nonfinite", ["raise", "skip_step"])
def test_fsdp_trains_on_after_an_error_in_backward(gloo, nonfinite):
    losses, moved = _fsdp_training(nonfinite)
    assert moved is False
    # Training went on: mpicomp was called (the loss falls after the error too).
    assert losses[-1] < 0.5 * losses[3], losses


def test_hsdp_a_failure_among_one_shards_replicas_drops_the_step_on_every_rank(gloo):
    """Shard 0's replicas fail their average; shard 1's succeed: every rank raises."""
    comm = world()
    mesh = _mesh_of_hosts_of_two()
    model = _shard(_model(), mesh)
    cc = mt.compress_hsdp(model, comm, "none")
    first = mesh.get_local_rank() == 0

    def refuse(*args, **kwargs):
        raise ValueError("shard 0's replicas refuse their average")

    if first:
        cc.start = refuse  # this instance's calls only
    try:
        x, y = _batch(0, comm.rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        with pytest.raises(ValueError if first else RankError, match="shard"):
            loss.backward()
        assert all(p.grad is None for p in model.parameters())
    finally:
        if first:
            del cc.start
        cc.close()
