"""The compressed-Adam mode (``adam_warmup``) of DistributedOptimizer and ZeroOptimizer
across ranks: its update against a NumPy reference of every rank's step, checkpoints
that resume to the same bits, a NaN that skips a step moving nothing, one rank's
mistake raising on every rank, and the warning for codecs adaptive optimizers do not train
with. What it trains is measured by ``python -m jobs.peers --models lm`` (docs/training.md)."""

import io

import numpy as np
import pytest

from conftest import world

torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")

import mpicomp.torch as mt  # noqa: E402
from mpicomp import RankError  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]
torch.set_num_threads(1)  # ranks share the cores

SHAPES = [(5, 3), (5,), (2, 5)]
BETAS, EPS, LR = (0.9, 0.99), 1e-8, 0.01


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grad(step: int, rank: int, i: int) -> np.ndarray:
    """Rank ``rank``'s gradient of parameter ``i`` in ``step``: its own, and large
    enough against ``EPS`` that the update's every term counts."""
    rng = np.random.default_rng([step, rank, i])
    return (rng.standard_normal(SHAPES[i]) + rank - 1).astype(np.float32)


def _reference(steps, warmup, size, weight_decay, decoupled) -> list[np.ndarray]:
    """Every rank's parameters after ``steps``, in float64: Adam/AdamW on the average of
    the ranks' gradients, the second moment frozen after ``warmup`` steps (its bias
    correction too) as a floor under the averages' own running one
    (mpicomp/torch/adam.py)."""
    b1, b2 = BETAS
    p = [x.detach().double().numpy() for x in _params()]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    seen = [None] * len(p)
    for step in range(steps):
        t = step + 1
        for i in range(len(p)):
            g = np.mean([_grad(step, r, i).astype(np.float64) for r in range(size)], axis=0)
            if not decoupled:
                g = g + weight_decay * p[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            if step < warmup:
                v[i] = b2 * v[i] + (1 - b2) * g**2
                second = v[i] / (1 - b2**t)
            else:
                frozen = v[i] / (1 - b2**warmup)
                seen[i] = b2 * (frozen if seen[i] is None else seen[i]) + (1 - b2) * g**2
                second = np.maximum(frozen, seen[i])
            if decoupled:
                p[i] = p[i] * (1 - LR * weight_decay)
            p[i] = p[i] - LR / (1 - b1**t) * m[i] / (np.sqrt(second) + EPS)
    return p


def _make(kind, params, adam_class, weight_decay, codec="none", **kw):
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    hyper = dict(lr=LR, eps=EPS, weight_decay=weight_decay)
    if issubclass(adam_class, torch.optim.Adam):
        hyper["betas"] = BETAS
    if kind == "distributed":
        inner = adam_class(params, **hyper)
        return mt.DistributedOptimizer(inner, world(), named, codec, **kw)
    return mt.ZeroOptimizer(named, adam_class, world(), codec, **hyper, **kw)


def _step(opt, params, step):
    for i, p in enumerate(params):
        p.grad = torch.from_numpy(_grad(step, world().rank, i))
    opt.step()


@pytest.mark.parametrize("kind", ["distributed", "zero"])
@pytest.mark.parametrize(
    "adam_class, weight_decay", [(torch.optim.AdamW, 0.1), (torch.optim.Adam, 0.05)]
)
def test_the_update_is_the_reference_on_every_rank(kind, adam_class, weight_decay):
    """Warm-up, the switch, and steps past it, against the NumPy reference."""
    steps, warmup = 7, 3
    params = _params()
    opt = _make(kind, params, adam_class, weight_decay, adam_warmup=warmup, min_numel=1)
    for step in range(steps):
        _step(opt, params, step)
    opt.close()
    want = _reference(steps, warmup, world().size, weight_decay, adam_class is torch.optim.AdamW)
    for p, w in zip(params, want, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=2e-5, atol=2e-6)
    # and the reference is not plain Adam: freezing changed the parameters
    plain = _reference(steps, steps, world().size, weight_decay, adam_class is torch.optim.AdamW)
    assert max(np.abs(a - b).max() for a, b in zip(want, plain, strict=True)) > 1e-4


@pytest.mark.parametrize("kind", ["distributed", "zero"])
def test_a_checkpoint_past_the_warm_up_resumes_to_the_same_bits(kind):
    def train(stop_at=None):
        params = _params()
        opt = _make(kind, params, torch.optim.AdamW, 0.01, "topk", ratio=0.3, adam_warmup=2)
        for step in range(6):
            if step == stop_at:
                saved = io.BytesIO()
                torch.save(opt.state_dict(), saved)
                weights = [p.detach().clone() for p in params]
                opt.close()
                params = _params()
                with torch.no_grad():
                    for p, w in zip(params, weights, strict=True):
                        p.copy_(w)
                opt = _make(kind, params, torch.optim.AdamW, 0.01, "topk", ratio=0.3, adam_warmup=2)
                saved.seek(0)
                opt.load_state_dict(torch.load(saved, weights_only=True))
            _step(opt, params, step)
        opt.close()
        return torch.cat([p.detach().reshape(-1) for p in params])

    assert torch.equal(train(), train(stop_at=4))


@pytest.mark.parametrize("kind", ["distributed", "zero"])
def test_a_nan_past_the_warm_up_skips_the_step_on_every_rank_moving_nothing(kind):
    params = _params()
    opt = _make(kind, params, torch.optim.AdamW, 0.01, "topk", ratio=0.3,
                adam_warmup=1, nonfinite="skip_step")  # fmt: skip
    for step in range(3):
        _step(opt, params, step)
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.state.values()]
    for i, p in enumerate(params):
        p.grad = torch.from_numpy(_grad(3, world().rank, i))
    if world().rank == world().size - 1:
        params[0].grad[0, 0] = float("nan")
    with pytest.warns(mpicomp_nonfinite()):
        opt.step()
    assert opt.skipped
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    after = [{k: v for k, v in s.items() if torch.is_tensor(v)} for s in opt.state.values()]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(after, state, strict=True) for k in b)
    _step(opt, params, 4)  # and it trains on
    assert not opt.skipped and all(torch.isfinite(p).all() for p in params)
    opt.close()


def mpicomp_nonfinite():
    from mpicomp.errors import NonFiniteWarning

    return NonFiniteWarning


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["distributed", "zero"])
@pytest.mark.parametrize(
    "mistake", ["other warm-up", "warm-up of 0", "not Adam", "with start_step"]
)
def test_one_ranks_mistake_raises_on_every_rank(kind, mistake):
    if mistake == "with start_step" and kind == "zero":
        pytest.skip("start_step is DistributedOptimizer's")
    odd = world().rank == world().size - 1
    params = _params()
    kw = {"adam_warmup": 3}
    adam_class, own = torch.optim.AdamW, None
    if odd and mistake == "other warm-up":
        kw["adam_warmup"] = 4
    elif odd and mistake == "warm-up of 0":
        kw["adam_warmup"], own = 0, ValueError
    elif odd and mistake == "not Adam":
        adam_class, own = torch.optim.RMSprop, TypeError
    elif odd and mistake == "with start_step":
        kw["start_step"], own = 2, ValueError
    want = own if own is not None else RankError
    with pytest.raises(want, match="adam_warmup|start_step"):
        _make(kind, params, adam_class, 0.0, **kw)


@pytest.mark.parametrize("kind", ["distributed", "zero"])
def test_codecs_adaptive_optimizers_do_not_train_with_warn_unless_the_mode_is_on(kind):
    params = _params()
    with pytest.warns(
        mt.UntrainedWarning, match="'threelc' barely trains under AdamW.*adam_warmup"
    ):
        _make(kind, params, torch.optim.AdamW, 0.0, "threelc").close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _make(kind, params, torch.optim.AdamW, 0.0, "threelc", adam_warmup=2).close()
        _make(kind, params, torch.optim.AdamW, 0.0, "topk", ratio=0.1).close()
        _make(kind, params, torch.optim.AdamW, 0.0, "qsgd_maxnorm").close()


def test_past_the_warm_up_the_codec_sees_each_gradient_divided_by_adams_denominator():
    """signSGD's average is +-scale (the ranks' mean of mean |x|, then the vote): of
    g / d, with d = sqrt(v / (1 - beta2**frozen_step)) + eps, multiplied back by d."""
    warmup, size = 2, world().size
    params = _params()
    inner = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS)
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    opt = mt.DistributedOptimizer(
        inner, world(), named, "signsgd", tie="positive", min_numel=1, adam_warmup=warmup
    )
    for step in range(warmup):
        _step(opt, params, step)
    b2 = BETAS[1]
    d = [
        np.sqrt(inner.state[p]["exp_avg_sq"].double().numpy() / (1 - b2**warmup)) + EPS
        for p in params
    ]
    for i, p in enumerate(params):
        p.grad = torch.from_numpy(_grad(warmup, world().rank, i))
    opt.synchronize()
    order = list(reversed(range(len(params))))  # one bucket, in reverse order
    scaled = [
        np.concatenate([(_grad(warmup, r, i) / d[i]).ravel() for i in order]) for r in range(size)
    ]
    scale = np.mean([np.abs(x).mean() for x in scaled])
    votes = np.sum([x > 0 for x in scaled], axis=0)
    vote = np.where(2 * votes >= size, 1.0, -1.0)
    lo = 0
    for i in order:
        n = params[i].numel()
        want = (vote[lo : lo + n] * scale).reshape(SHAPES[i]) * d[i]
        np.testing.assert_allclose(params[i].grad.numpy(), want, rtol=1e-4)
        lo += n
    opt.step()
    opt.close()


def test_zero_and_distributed_take_the_same_steps_past_the_warm_up():
    def train(kind):
        params = _params()
        opt = _make(kind, params, torch.optim.AdamW, 0.01, "signsgd", tie="positive",
                    min_numel=1, adam_warmup=2)  # fmt: skip
        for step in range(5):
            _step(opt, params, step)
        opt.close()
        return [p.detach().numpy().copy() for p in params]

    for a, b in zip(train("distributed"), train("zero"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_value_no_warm_up_gradient_reached_stays_in_the_codecs_range():
    """An embedding row unused during the warm-up has v = 0; its first gradient after
    it, divided by Adam's eps alone, would pass fp16's 65,504 and be refused."""
    emb = torch.nn.Embedding(8, 4)
    with torch.no_grad():
        emb.weight.copy_(torch.arange(32.0).reshape(8, 4) / 32)
    inner = torch.optim.AdamW(emb.parameters(), lr=LR)
    opt = mt.DistributedOptimizer(
        inner, world(), emb.named_parameters(), "fp16", min_numel=1, adam_warmup=2
    )
    for step, rows in enumerate([[0, 1], [0, 1], [0, 7], [7]]):  # row 7 after the warm-up
        opt.zero_grad()
        emb(torch.tensor(rows)).sum().mul(0.01 * (step + 1)).backward()
        opt.step()
    assert torch.isfinite(emb.weight).all()
    assert not torch.equal(emb.weight[7], torch.arange(28.0, 32.0) / 32)  # it moved
    opt.close()
