"""mpicomp.torch.ZeroOptimizer across ranks: 1/N of the optimizer state per rank (against
the unsharded optimizer's own state), training equal to DistributedOptimizer's
uncompressed and within a codec's own noise compressed, identical replicas, bfloat16
allgathers, checkpoints, and what one rank gets wrong raising on every rank."""

import io

import numpy as np
import pytest

from conftest import world

torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")

import mpicomp  # noqa: E402
import mpicomp.torch as mt  # noqa: E402
from mpicomp import RankError  # noqa: E402

pytestmark = pytest.mark.mpi
torch.set_num_threads(1)  # ranks share the cores


def _model(seed=0, width=48):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(12, width), torch.nn.ReLU(), torch.nn.Linear(width, 3)
        )


def _batch(step, rank, n=8):
    """Rank ``rank``'s batch of one step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _train(model, opt, steps, first=0):
    comm = world()
    for step in range(first, first + steps):
        opt.zero_grad()
        _loss(model, _batch(step, comm.rank)).backward()
        opt.step()


def _weights(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def _same_on_every_rank(a: np.ndarray) -> bool:
    everyone = world().allgather(a.tobytes())
    return all(e == everyone[0] for e in everyone)


def _zero(model, codec=None, optimizer=torch.optim.Adam, **kw):
    kw.setdefault("lr", 0.01)
    return mt.ZeroOptimizer(model.named_parameters(), optimizer, world(), codec, **kw)


def _distributed(model, codec=None, optimizer=torch.optim.Adam, lr=0.01, **kw):
    inner = optimizer(model.parameters(), lr=lr)
    return mt.DistributedOptimizer(inner, world(), model.named_parameters(), codec, **kw)


def test_each_rank_holds_a_size_th_of_the_unsharded_optimizers_state():
    """Counted, not timed: Adam's moments of this rank's rows (the rows are the model's
    own float32 parameters), against plain Adam's state of the whole model."""
    comm = world()
    model, ref = _model(), _model()
    opt = _zero(model, min_numel=16, bucket_numel=200)
    _train(model, opt, 1)
    plain = torch.optim.Adam(ref.parameters(), lr=0.01)
    _train(ref, plain, 1)
    unsharded = sum(t.nbytes for s in plain.state.values() for t in s.values())
    mine = opt.state_bytes()
    assert mine == sum(t.nbytes for s in opt.state.values() for t in s.values())
    assert mine <= 1.1 * unsharded / comm.size, (mine, unsharded, comm.size)
    # Every rank's rows together are the whole model, padded to equal rows.
    n = sum(p.numel() for p in model.parameters())
    rows = comm.allreduce(sum(s["exp_avg"].numel() for s in opt.state.values()))
    assert n <= rows < n + comm.size * len(opt.buckets)
    opt.close()


def test_uncompressed_training_equals_distributed_optimizers_and_replicas_agree():
    model, ref = _model(), _model()
    opt = _zero(model, min_numel=16, bucket_numel=200)
    ref_opt = _distributed(ref, min_numel=16, bucket_numel=200)
    _train(model, opt, 4)
    _train(ref, ref_opt, 4)
    np.testing.assert_allclose(_weights(model), _weights(ref), rtol=0, atol=1e-6)
    assert _same_on_every_rank(_weights(model))
    assert len(opt.buckets) > 1
    opt.close()
    ref_opt.close()


CODECS = [("qsgd_maxnorm", {"bits": 2}), ("topk", {"ratio": 0.1}), ("threelc", {})]


@pytest.mark.parametrize("codec,params", CODECS, ids=[c for c, _ in CODECS])
def test_compressed_training_stays_within_the_codecs_own_noise(codec, params):
    """The codec's noise: how far DistributedOptimizer with it lands from uncompressed
    training. ZeroOptimizer with it (rows compressed apart) lands no farther than
    twice that (measured: 0.75 to 1.2 times at 2-4 ranks), and not at zero."""
    kw = dict(min_numel=16, bucket_numel=400, optimizer=torch.optim.SGD, lr=0.1)
    runs = {}
    for name, make, c in (
        ("float32", _distributed, None),
        ("distributed", _distributed, codec),
        ("zero", _zero, codec),
    ):
        model = _model()
        opt = make(model, c, **kw, **({} if c is None else params))
        _train(model, opt, 5)
        runs[name] = _weights(model)
        opt.close()
    noise = np.linalg.norm(runs["distributed"] - runs["float32"])
    ours = np.linalg.norm(runs["zero"] - runs["float32"])
    assert 0 < ours <= 2 * noise, (ours, noise)
    assert _same_on_every_rank(runs["zero"])


def test_bfloat16_gathers_give_every_rank_the_same_bfloat16_parameters():
    comm = world()
    model, ref = _model(), _model()
    opt = _zero(model, gather_precision="bfloat16", min_numel=16)
    ref_opt = _zero(ref, min_numel=16)
    first = _loss(model, _batch(0, comm.rank)).item()
    _train(model, opt, 6)
    _train(ref, ref_opt, 6)
    w = _weights(model)
    assert _same_on_every_rank(w)
    assert np.array_equal(w, torch.from_numpy(w).bfloat16().float().numpy())
    assert not np.array_equal(w, _weights(ref))
    np.testing.assert_allclose(w, _weights(ref), rtol=0, atol=0.02)
    assert _loss(model, _batch(0, comm.rank)).item() < first
    # A float32 master row besides Adam's moments: more than the float32 run's.
    assert opt.state_bytes() > ref_opt.state_bytes()
    opt.close()
    ref_opt.close()


def test_checkpoints_of_every_rank_resume_identically(shared_dir):
    comm = world()
    a, b = _model(), _model(seed=1)
    kw = dict(bits=4, min_numel=16, bucket_numel=200)
    opt_a = _zero(a, "qsgd_maxnorm", **kw)
    _train(a, opt_a, 3)
    path = shared_dir / f"rank{comm.rank}.pt"
    torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    opt_b = _zero(b, "qsgd_maxnorm", **kw)
    b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    _train(a, opt_a, 2, 3)
    _train(b, opt_b, 2, 3)
    assert _weights(a).tobytes() == _weights(b).tobytes()
    opt_a.close()
    opt_b.close()


def test_another_ranks_checkpoint_raises_on_every_rank():
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    opt = _zero(_model(), min_numel=16)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    everyone = comm.allgather(buf.getvalue())
    odd = comm.rank == comm.size - 1
    mine = everyone[0 if odd else comm.rank]  # the last rank takes rank 0's
    state = torch.load(io.BytesIO(mine), weights_only=True)
    culprit = comm.size - 1
    want = "rank 0's of" if odd else rf"rank\(s\) \[{culprit}\]"
    with pytest.raises(ValueError if odd else RankError, match=want):
        opt.load_state_dict(state)
    opt.close()


def test_different_models_raise_on_every_rank_instead_of_mixing():
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    model = _model(width=48 if comm.rank else 47)
    want = r"differently: parameter '0\.weight': shape \(47, 12\) on rank 0, \(48, 12\) on ranks? 1"
    with pytest.raises(RankError, match=want):
        _zero(model)


def test_an_optimizer_argument_differing_on_one_rank_raises_on_every_rank():
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    lr = 0.02 if comm.rank == comm.size - 1 else 0.01
    with pytest.raises(RankError, match=rf"optimizer_arguments: .* on rank {comm.size - 1}"):
        _zero(_model(), lr=lr)
    _zero(_model()).close()  # works after


def test_a_nan_on_one_rank_raises_on_every_rank_and_the_next_step_trains():
    comm = world()
    odd = comm.rank == comm.size - 1
    model = _model()
    opt = _zero(model, "topk", ratio=0.1, min_numel=16, bucket_numel=200)
    _train(model, opt, 2)
    residuals = {k: v.clone() for k, v in opt.state_dict()["mpicomp"]["residuals"].items()}
    before = _weights(model).copy()
    opt.zero_grad()
    hook = model[0].weight.register_hook(lambda g: g * float("nan")) if odd else None
    _loss(model, _batch(2, comm.rank)).backward()
    if odd:
        hook.remove()
        with pytest.raises(ValueError, match="holds NaN or Inf") as info:
            opt.step()
        assert type(info.value) is ValueError
    else:
        with pytest.raises(RankError, match=f"rank.*{comm.size - 1}"):
            opt.step()
    assert _weights(model).tobytes() == before.tobytes()
    after = opt.state_dict()["mpicomp"]["residuals"]
    assert all(torch.equal(residuals[k], after[k]) for k in residuals)
    _train(model, opt, 1, 3)
    assert opt.steps == 4 and _weights(model).tobytes() != before.tobytes()
    assert _same_on_every_rank(_weights(model))
    opt.close()


def test_a_nan_on_one_rank_under_skip_step_skips_the_step_on_every_rank():
    comm = world()
    model = _model()
    opt = _zero(model, "qsgd_maxnorm", nonfinite="skip_step", min_numel=16, bucket_numel=200)
    before = _weights(model).copy()
    opt.zero_grad()
    hook = None
    if comm.rank == comm.size - 1:
        hook = model[0].weight.register_hook(lambda g: g * float("nan"))
    _loss(model, _batch(0, comm.rank)).backward()
    with pytest.warns(mpicomp.NonFiniteWarning, match=f"rank.*{comm.size - 1}"):
        opt.step()
    assert opt.skipped and not opt.state  # no moment made
    assert _weights(model).tobytes() == before.tobytes()
    if hook is not None:
        hook.remove()
    _train(model, opt, 1, 1)
    assert not opt.skipped and _weights(model).tobytes() != before.tobytes()
    assert _same_on_every_rank(_weights(model))
    opt.close()


class _FailsOnRankOne(torch.optim.SGD):
    """SGD whose step raises on rank 1 alone (a local error after the reduce-scatter)."""

    def step(self, closure=None):
        if world().rank == 1:
            raise ValueError("this rank's inner step failed")
        return super().step(closure)


@pytest.mark.mpi(min_size=2)
def test_an_inner_step_failing_on_one_rank_raises_on_every_rank_before_the_allgather():
    model = _model()
    opt = _zero(model, optimizer=_FailsOnRankOne)
    opt.zero_grad()
    _loss(model, _batch(0, world().rank)).backward()
    error = ValueError if world().rank == 1 else RankError
    with pytest.raises(error, match="inner step failed|ZeroOptimizer.step failed"):
        opt.step()
    opt.close()
