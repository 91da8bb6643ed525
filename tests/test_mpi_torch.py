"""mpicomp.torch across ranks: DistributedOptimizer against one process on the whole
batch and against the same buckets through CompressedComm, identical weights on every
rank, parameters used on some ranks only, NaN on one rank, broadcasts, and the DDP
communication hook on a gloo process group made from the MPI ranks."""

import os
import socket
import warnings

import numpy as np
import pytest
from conftest import world

torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")

import mpicomp  # noqa: E402
import mpicomp.torch as mt  # noqa: E402
from mpicomp._reduce import RankError  # noqa: E402

pytestmark = pytest.mark.mpi
torch.set_num_threads(1)  # ranks share the cores

CODECS = [
    ("qsgd_maxnorm", {"bits": 4}),
    ("signsgd", {}),
    ("topk", {"ratio": 0.1}),
    ("threelc", {}),
]


def _model(seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.ReLU(), torch.nn.Linear(48, 3))


def _batches(step, size, n=8):
    """Every rank's batch of one step (rank r trains on the r-th)."""
    g = torch.Generator().manual_seed(100 + step)
    return [
        (torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g))
        for _ in range(size)
    ]


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _weights(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def _same_on_every_rank(comm, a: np.ndarray) -> bool:
    everyone = comm.allgather(a.tobytes())
    return all(e == everyone[0] for e in everyone)


def test_uncompressed_training_matches_one_process_on_the_whole_batch():
    comm = world()
    model, ref = _model(), _model()
    opt = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        comm,
        model.named_parameters(),
        min_numel=16,
        bucket_numel=100,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        batches = _batches(step, comm.size)
        opt.zero_grad()
        _loss(model, batches[comm.rank]).backward()
        opt.step()
        ref_opt.zero_grad()
        whole = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        _loss(ref, whole).backward()
        ref_opt.step()
    np.testing.assert_allclose(_weights(model), _weights(ref), rtol=0, atol=2e-6)
    assert _same_on_every_rank(comm, _weights(model))
    opt.close()


@pytest.mark.parametrize("codec,params", CODECS, ids=[c for c, _ in CODECS])
def test_compressed_steps_equal_the_same_buckets_through_compressedcomm(codec, params):
    """Byte for byte: the optimizer's bucket calls are CompressedComm calls on the
    float32 concatenation of each bucket's gradients, started in bucket order."""
    comm = world()
    model, ref = _model(), _model()
    opt = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        comm,
        model.named_parameters(),
        codec,
        min_numel=64,
        bucket_numel=200,
        **params,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    cc = mpicomp.CompressedComm(comm, codec, min_numel=64, **params)
    named = dict(ref.named_parameters())
    for step in range(3):
        batch = _batches(step, comm.size)[comm.rank]
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref, batch).backward()
        for b in opt._buckets:
            params_b = [named[n] for n in b.names]
            flat = torch.cat([p.grad.reshape(-1) for p in params_b])
            avg = cc.allreduce(flat, name=f"bucket{b.index}")
            for p, lo, hi in zip(params_b, b.offsets, b.offsets[1:], strict=False):
                p.grad.copy_(avg[lo:hi].view_as(p))
        ref_opt.step()
    assert _weights(model).tobytes() == _weights(ref).tobytes()
    assert _same_on_every_rank(comm, _weights(model))
    cc.close()
    opt.close()


class _Branchy(torch.nn.Module):
    """A model whose second head only ranks that ask for it use (an unused parameter
    elsewhere); the third is never used."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(3)
            self.body = torch.nn.Linear(12, 16)
            self.head = torch.nn.Linear(16, 3)
            self.aux = torch.nn.Linear(16, 3)
            self.never = torch.nn.Linear(16, 3)

    def forward(self, x, use_aux):
        h = torch.relu(self.body(x))
        return self.head(h) + (self.aux(h) if use_aux else 0)


def test_parameters_used_on_some_ranks_only_get_the_same_average_everywhere():
    comm = world()
    model = _Branchy()
    opt = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), comm, model.named_parameters(), min_numel=8
    )
    for step in range(2):
        opt.zero_grad()
        _loss(
            lambda x: model(x, use_aux=comm.rank == 0), _batches(step, comm.size)[comm.rank]
        ).backward()
        opt.synchronize()
        aux = model.aux.weight.grad
        assert aux is not None  # rank 0 used it: every rank gets rank 0's gradient / N
        assert _same_on_every_rank(comm, aux.numpy())
        assert model.never.weight.grad is None and model.never.bias.grad is None
        opt.step()
    assert _same_on_every_rank(comm, _weights(model))
    opt.close()


def test_a_nan_on_one_rank_skips_the_step_on_every_rank():
    comm = world()
    model = _model()
    opt = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        comm,
        model.named_parameters(),
        "qsgd_maxnorm",
        nonfinite="skip_step",
        min_numel=16,
        bucket_numel=100,
    )
    before = _weights(model).copy()
    opt.zero_grad()
    hook = None
    if comm.rank == comm.size - 1:
        hook = model[0].weight.register_hook(lambda g: g * float("nan"))
    _loss(model, _batches(0, comm.size)[comm.rank]).backward()
    with pytest.warns(mpicomp.NonFiniteWarning, match=f"rank.*{comm.size - 1}"):
        opt.step()
    assert opt.skipped
    assert _weights(model).tobytes() == before.tobytes()
    if hook is not None:
        hook.remove()
    opt.zero_grad()
    _loss(model, _batches(1, comm.size)[comm.rank]).backward()
    opt.step()
    assert not opt.skipped and _weights(model).tobytes() != before.tobytes()
    assert _same_on_every_rank(comm, _weights(model))
    opt.close()


def test_different_models_raise_on_every_rank_instead_of_mixing():
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    width = 48 if comm.rank else 47
    model = torch.nn.Sequential(
        torch.nn.Linear(12, width), torch.nn.ReLU(), torch.nn.Linear(width, 3)
    )
    opt = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), comm, model.named_parameters(), min_numel=8
    )
    _loss(model, _batches(0, comm.size)[comm.rank]).backward()
    with pytest.raises((ValueError, RankError)):
        opt.step()
    opt.close()


def test_broadcast_parameters_gives_every_rank_roots_values():
    comm = world()
    model = _model(seed=comm.rank)  # different on every rank
    model.register_buffer("count", torch.tensor(comm.rank, dtype=torch.int64))
    model.half_weights = torch.nn.Parameter(torch.full((3,), comm.rank, dtype=torch.bfloat16))
    root = comm.size - 1
    mt.broadcast_parameters(model, comm, root=root)
    want = dict(_model(seed=root).named_parameters())
    for name, p in model.named_parameters():
        if name == "half_weights":
            assert torch.equal(p, torch.full((3,), root, dtype=torch.bfloat16))
        else:
            assert torch.equal(p, want[name])
    assert int(model.count) == root


def test_broadcast_parameters_with_other_shapes_raises_on_every_rank():
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    model = torch.nn.Linear(4, 5 if comm.rank == 1 else 4)
    if comm.rank == 1:
        with pytest.raises(ValueError, match="weight"):
            mt.broadcast_parameters(model, comm)
    else:
        with pytest.raises(RankError, match=r"rank\(s\) \[1\]"):
            mt.broadcast_parameters(model, comm)
    mt.broadcast_parameters(torch.nn.Linear(4, 4), comm)  # the next call works


def test_broadcast_optimizer_state_gives_every_rank_roots_momentum():
    comm = world()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if comm.rank == 0:  # only the root has stepped: the others have no state yet
        _loss(model, _batches(0, 1)[0]).backward()
        opt.step()
        opt.param_groups[0]["lr"] = 0.025
    mt.broadcast_optimizer_state(opt, comm, root=0)
    assert opt.param_groups[0]["lr"] == 0.025
    momenta = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    assert _same_on_every_rank(comm, momenta.numpy())
    assert momenta.abs().sum() > 0


def test_broadcast_optimizer_state_to_another_optimizer_raises_on_every_rank():
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    model = _model()
    groups = [{"params": [model[0].weight]}, {"params": list(model.parameters())[1:]}]
    opt = torch.optim.SGD(model.parameters() if comm.rank != 1 else groups, lr=0.1)
    if comm.rank == 1:
        with pytest.raises(ValueError, match="rank 1: cannot load rank 0's optimizer state"):
            mt.broadcast_optimizer_state(opt, comm)
    else:
        with pytest.raises(RankError):
            mt.broadcast_optimizer_state(opt, comm)


# -- the DDP communication hook ------------------------------------------------------------


@pytest.fixture
def gloo():
    """A gloo process group over the MPI ranks (rank and size from COMM_WORLD)."""
    import torch.distributed as dist

    comm = world()
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size
    )
    yield dist
    dist.destroy_process_group()


def _ddp_train(model, hook_state, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    comm = world()
    ddp = DDP(model, bucket_cap_mb=0.001)  # several small buckets
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, mt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        _loss(ddp, _batches(step, comm.size)[comm.rank]).backward()
        opt.step()
    return _weights(model)


def test_the_ddp_hook_uncompressed_matches_ddps_own_allreduce(gloo):
    comm = world()
    ours = _ddp_train(_model(), mt.HookState(comm, "none"), 4)
    theirs = _ddp_train(_model(), None, 4)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6)
    assert _same_on_every_rank(comm, ours)


@pytest.mark.parametrize("codec,params", CODECS, ids=[c for c, _ in CODECS])
def test_the_ddp_hook_compressed_keeps_every_rank_identical(gloo, codec, params):
    comm = world()
    state = mt.HookState(comm, codec, start_step=1, min_numel=16, **params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no residual-shape errors after the bucket rebuild
        ours = _ddp_train(_model(), state, 4)
    assert state.iteration == 4
    assert _same_on_every_rank(comm, ours)
    uncompressed = _ddp_train(_model(), mt.HookState(comm, "none"), 4)
    assert ours.tobytes() != uncompressed.tobytes()  # the codec did act
    assert np.abs(ours - uncompressed).max() < 0.5


def test_the_ddp_hook_drops_a_residual_when_ddp_rebuilds_its_buckets(gloo):
    comm = world()
    state = mt.HookState(comm, "topk", ratio=0.1, min_numel=16)  # compressed from iteration 0
    _ddp_train(_model(), state, 3)
    residuals = state.comm.state_dict()["residuals"]
    sizes = {name: r.size for name, r in residuals.items()}
    assert sizes == {f"ddp_bucket{i}": n for i, n in state._sizes.items() if n >= 16}


def test_a_tensor_mpicomp_cannot_take_on_one_rank_raises_on_every_rank():
    """One rank's model lives on torch's meta device (no data: nothing to send)."""
    comm = world()
    odd = comm.rank == comm.size - 1
    model = _model().to("meta") if odd else _model()
    opt = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), comm, model.named_parameters(), min_numel=8
    )
    x, y = _batches(0, comm.size)[comm.rank]
    if odd:
        x, y = x.to("meta"), y.to("meta")
    _loss(model, (x, y)).backward()
    with pytest.raises(TypeError if odd else RankError):
        opt.step()
    opt.close()
