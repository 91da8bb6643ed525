"""mpicomp.torch across ranks: DistributedOptimizer against one process on the whole
batch and against the same buckets through CompressedComm, identical weights on every
rank, parameters used on some ranks only, NaN on one rank, broadcasts, and the DDP
communication hook on a gloo process group made from the MPI ranks."""

import warnings

import numpy as np
import pytest

from conftest import world

torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")

import mpicomp  # noqa: E402
import mpicomp.torch as mt  # noqa: E402
from mpicomp import RankError  # noqa: E402

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


def _sgd(params):
    """The optimizer the training here steps with (with momentum: state a step carries)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _distributed(comm, model, codec=None, **options):
    """A DistributedOptimizer over ``_sgd`` of ``model``'s parameters."""
    return mt.DistributedOptimizer(
        _sgd(model.parameters()), comm, model.named_parameters(), codec, **options
    )


def _same_on_every_rank(comm, a: np.ndarray) -> bool:
    everyone = comm.allgather(a.tobytes())
    return all(e == everyone[0] for e in everyone)


def test_uncompressed_training_matches_one_process_on_the_whole_batch():
    comm = world()
    model, ref = _model(), _model()
    opt = _distributed(comm, model, min_numel=16, bucket_numel=100)
    ref_opt = _sgd(ref.parameters())
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


# PowerSGD factors each weight matrix of a bucket: the shapes matter, and the biases go as
# they are.
BUCKET_CODECS = [*CODECS, ("powersgd", {"rank": 2, "start_iter": 1, "min_compression_rate": 1.0})]


@pytest.mark.parametrize("codec,params", BUCKET_CODECS, ids=[c for c, _ in BUCKET_CODECS])
def test_compressed_steps_equal_the_same_buckets_through_compressedcomm(codec, params):
    """Byte for byte: the optimizer's bucket calls are CompressedComm calls on the
    float32 concatenation of each bucket's gradients, with their shapes, started in
    bucket order."""
    comm = world()
    model, ref = _model(), _model()
    opt = _distributed(comm, model, codec, min_numel=64, bucket_numel=200, **params)
    ref_opt = _sgd(ref.parameters())
    cc = mpicomp.CompressedComm(comm, codec, min_numel=64, **params)
    named = dict(ref.named_parameters())
    for step in range(3):
        batch = _batches(step, comm.size)[comm.rank]
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref, batch).backward()
        for index, names in enumerate(opt.buckets):
            grads = [named[n].grad for n in names]
            flat = torch.cat([g.reshape(-1) for g in grads])
            shapes = [tuple(g.shape) for g in grads]
            avg, _ = cc.start(flat, f"bucket{index}", shapes=shapes).wait()
            for g, part in zip(grads, avg.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))
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
    opt = _distributed(
        comm, model, "qsgd_maxnorm", nonfinite="skip_step", min_numel=16, bucket_numel=100
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


def test_a_nan_on_one_rank_raises_on_every_rank_and_the_next_step_trains():
    """nonfinite="raise" (the default): ValueError where the NaN is, RankError on the
    others; nothing written, no residual moved; the next iteration trains."""
    comm = world()
    odd = comm.rank == comm.size - 1
    model = _model()
    opt = _distributed(comm, model, "topk", ratio=0.1, min_numel=16, bucket_numel=100)
    for step in range(2):
        opt.zero_grad()
        _loss(model, _batches(step, comm.size)[comm.rank]).backward()
        opt.step()
    residuals = {k: v.clone() for k, v in opt.state_dict()["mpicomp"]["residuals"].items()}
    before = _weights(model).copy()
    opt.zero_grad()
    hook = model[0].weight.register_hook(lambda g: g * float("nan")) if odd else None
    _loss(model, _batches(2, comm.size)[comm.rank]).backward()
    local = [p.grad.clone() for p in model.parameters()]
    if odd:
        hook.remove()
        with pytest.raises(ValueError, match="holds NaN or Inf") as info:
            opt.step()
        assert type(info.value) is ValueError
    else:
        with pytest.raises(RankError, match=f"rank.*{comm.size - 1}"):
            opt.step()
    for a, p in zip(local, model.parameters(), strict=True):  # nothing written (NaNs too)
        assert a.numpy().tobytes() == p.grad.numpy().tobytes()
    assert _weights(model).tobytes() == before.tobytes()
    after = opt.state_dict()["mpicomp"]["residuals"]
    assert all(torch.equal(residuals[k], after[k]) for k in residuals)
    opt.zero_grad()
    _loss(model, _batches(3, comm.size)[comm.rank]).backward()
    opt.step()
    assert opt.steps == 4 and _weights(model).tobytes() != before.tobytes()
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
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    want = r"differently: parameter '0\.weight': shape \(47, 12\) on rank 0, \(48, 12\) on ranks? 1"
    with pytest.raises(RankError, match=want):
        mt.DistributedOptimizer(inner, comm, model.named_parameters(), min_numel=8)


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
    opt = _sgd(model.parameters())
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


def _ddp_train(model, hook_state, steps, hook=mt.comm_hook):
    from torch.nn.parallel import DistributedDataParallel as DDP

    comm = world()
    ddp = DDP(model, bucket_cap_mb=0.001)  # several small buckets
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, hook)
    opt = _sgd(ddp.parameters())
    for step in range(steps):
        opt.zero_grad()
        _loss(ddp, _batches(step, comm.size)[comm.rank]).backward()
        opt.step()
    return _weights(model)


def _sizing(last: dict):
    """Return a DDP hook that runs ``mt.comm_hook`` and keeps in ``last`` each bucket's
    size by index, as last seen (DDP rebuilds its buckets after the first iteration)."""

    def hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
        last[bucket.index()] = bucket.buffer().numel()
        return mt.comm_hook(state, bucket)

    return hook


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
    last = {}
    _ddp_train(_model(), state, 3, _sizing(last))
    assert last  # the hook ran
    residuals = state.comm.state_dict()["residuals"]
    sizes = {name: r.size for name, r in residuals.items()}
    assert sizes == {f"ddp_bucket{i}": n for i, n in last.items() if n >= 16}


@pytest.mark.parametrize(
    "ddp_options,nan_step",
    [({"find_unused_parameters": True}, 2), ({"static_graph": True}, 0)],
    ids=["two-buckets", "static-graph-first-iteration"],
)
def test_a_nan_under_the_ddp_hook_raises_mpicomps_error_on_every_rank(gloo, ddp_options, nan_step):
    """Not torch's "Unable to cast ... to Tensor": backward() raises the ValueError on
    the rank holding the NaN and RankError on the others; no residual moves, the
    gradients are the same on every rank, and the next iteration trains. (With
    find_unused_parameters, DDP keeps two buckets, the NaN in the second; a static
    graph's first iteration runs the hook from autograd's final callbacks.)"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    comm = world()
    odd = comm.rank == comm.size - 1
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.001, **ddp_options)
    state = mt.HookState(comm, "topk", ratio=0.1, min_numel=16)
    last = {}
    ddp.register_comm_hook(state, _sizing(last))
    opt = _sgd(ddp.parameters())

    def backward(step, nan=False):
        opt.zero_grad()
        hook = model[0].weight.register_hook(lambda g: g * float("nan")) if nan else None
        try:
            _loss(ddp, _batches(step, comm.size)[comm.rank]).backward()
        finally:
            if hook is not None:
                hook.remove()

    for step in range(nan_step):
        backward(step)
        opt.step()
    residuals = {k: v.copy() for k, v in state.comm.state_dict()["residuals"].items()}
    before = _weights(model).copy()
    if odd:
        with pytest.raises(ValueError, match="holds NaN or Inf") as info:
            backward(nan_step, nan=odd)
        assert type(info.value) is ValueError
    else:
        with pytest.raises(RankError, match=f"rank.*{comm.size - 1}"):
            backward(nan_step, nan=odd)
    for name, r in state.comm.state_dict()["residuals"].items():
        assert r.tobytes() == residuals[name].tobytes() if name in residuals else not r.any()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert _same_on_every_rank(comm, grads.numpy())
    assert model[0].weight.grad.eq(0).all()  # the failed bucket's gradients
    for step in range(nan_step + 1, nan_step + 3):  # the failed iteration is not taken
        backward(step)
        opt.step()
    assert _weights(model).tobytes() != before.tobytes()
    assert _same_on_every_rank(comm, _weights(model))
    assert state.iteration == nan_step + 3
    assert len(state.comm.state_dict()["residuals"]) == len(last)


def test_plain_parameters_on_one_rank_raise_on_every_rank_at_construction():
    """One rank passes model.parameters() where the others pass named ones: it raises
    the TypeError, the others RankError, before the CompressedComm is made (no hang)."""
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    model = _model()
    odd = comm.rank == comm.size - 1
    params = model.parameters() if odd else model.named_parameters()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError if odd else RankError, match="named_parameters must be"):
        mt.DistributedOptimizer(inner, comm, params, "topk", ratio=0.1)
    opt = mt.DistributedOptimizer(inner, comm, model.named_parameters())  # works after
    opt.close()


@pytest.mark.parametrize(
    ("option", "value", "field"),
    [
        ("start_step", 3, "start_step"),
        ("backward_passes_per_step", 2, "backward_passes_per_step"),
        ("overlap", False, "overlap"),
        ("bits", 4, "codec.bits"),
        ("min_numel", 8, "min_numel"),
    ],
)
def test_an_option_differing_on_one_rank_raises_on_every_rank_at_construction(option, value, field):
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    model = _model()
    odd = comm.rank == comm.size - 1
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {option: value} if odd else {}
    with pytest.raises(
        RankError, match=rf"differently: (.*; )?{field}: .* on rank {comm.size - 1}"
    ):
        mt.DistributedOptimizer(inner, comm, model.named_parameters(), "qsgd_maxnorm", **options)
    opt = mt.DistributedOptimizer(inner, comm, model.named_parameters())  # works after
    opt.close()


@pytest.mark.parametrize("start_step", [3, -1])
def test_a_hook_state_start_step_differing_on_one_rank_raises_on_every_rank(start_step):
    """A start_step that differs (3) or is refused (-1) on one rank: that rank's own
    error there, RankError naming it on the others, none left waiting; the next works."""
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    odd = comm.rank == comm.size - 1
    culprit = comm.size - 1
    if start_step > 0:
        error, message = RankError, f"differently: start_step: .* on rank {culprit}"
    elif odd:
        error, message = ValueError, "start_step must be >= 0"
    else:
        error, message = RankError, f"rank {culprit} failed making this HookState: ValueError"
    with pytest.raises(error, match=message):
        mt.HookState(comm, "topk", start_step=start_step if odd else 0, ratio=0.1)
    mt.HookState(comm, "topk", start_step=1, ratio=0.1).comm.close()  # works after


def test_a_failure_making_the_buckets_on_one_rank_raises_on_every_rank(monkeypatch):
    """After the communicators are made: an allocation that fails on one rank (a GPU
    out of memory) reaches the others instead of leaving them in the first step."""
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    odd = comm.rank == comm.size - 1
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    if odd:

        def out_of_memory(*args, **kwargs):
            raise RuntimeError("CUDA out of memory (stand-in)")

        monkeypatch.setattr(torch, "empty", out_of_memory)  # the buckets' buffers
    with pytest.raises(RuntimeError, match="out of memory" if odd else r"rank\(s\) \[\d\]") as e:
        mt.DistributedOptimizer(inner, comm, model.named_parameters())
    assert isinstance(e.value, RankError) != odd
    monkeypatch.undo()
    mt.DistributedOptimizer(inner, comm, model.named_parameters()).close()  # works after


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
