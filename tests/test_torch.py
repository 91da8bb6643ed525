"""mpicomp.torch on one rank: DistributedOptimizer's buckets, hooks, warm-up, gradient
accumulation, unused parameters, NaN steps, checkpoints and schedulers.

With one rank the average of a gradient is the gradient itself (float32 sums of one
term are exact), so the wrapped optimizer must take exactly the steps of the plain
one; compressed codecs must not (that is how warm-up steps are told apart).
"""

import io
import warnings

import pytest

torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")

import mpicomp  # noqa: E402
import mpicomp.torch as mt  # noqa: E402
from mpicomp import RankError  # noqa: E402
from mpicomp.torch.shared import Staging  # noqa: E402


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


def _model(seed=0, dtype=torch.float32):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)
        ).to(dtype)


def _batch(step, n=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 12, generator=g).to(dtype), torch.randint(0, 3, (n,), generator=g)


def _loss(model, step, dtype=torch.float32):
    x, y = _batch(step, dtype=dtype)
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def _wrap(model, codec="none", lr=0.1, **kw):
    kw.setdefault("min_numel", 8)
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return mt.DistributedOptimizer(inner, _self(), model.named_parameters(), codec, **kw)


def _train(model, opt, steps, dtype=torch.float32):
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step, dtype).backward()
        opt.step()


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- DistributedOptimizer -----------------------------------------------------------------


def test_one_rank_uncompressed_takes_exactly_the_plain_optimizers_steps():
    plain, wrapped = _model(), _model()
    ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt = _wrap(wrapped)
    _train(plain, ref, 4)
    _train(wrapped, opt, 4)
    assert _same(plain, wrapped)
    assert opt.steps == 4 and not opt.skipped


def test_buckets_take_parameters_in_reverse_order_up_to_bucket_numel():
    model = _model()
    opt = _wrap(model, bucket_numel=60)
    # sizes: 0.weight 480, 0.bias 40, 2.weight 120, 2.bias 3; reversed, at most 60 each
    # unless a parameter alone is larger.
    assert opt.buckets == (("2.bias",), ("2.weight",), ("0.bias",), ("0.weight",))
    opt = _wrap(_model(), bucket_numel=1000)
    assert opt.buckets == (("2.bias", "2.weight", "0.bias", "0.weight"),)


def test_a_new_dtype_starts_a_new_bucket():
    model = _model()
    model[2].to(torch.bfloat16)
    opt = _wrap(model, bucket_numel=10_000)
    assert opt.buckets == (("2.bias", "2.weight"), ("0.bias", "0.weight"))


def _recording_starts(monkeypatch, opt) -> list[str]:
    """Return the list to which each call ``opt`` starts on its CompressedComm appends
    its name (bucket0, bucket1, ...), as it starts."""
    started = []
    start = opt.comm.start

    def recorded(x, name="", **kwargs):
        started.append(name)
        return start(x, name, **kwargs)

    monkeypatch.setattr(opt.comm, "start", recorded)
    return started


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_starts_every_bucket_during_backward(overlap, monkeypatch):
    model = _model()
    opt = _wrap(model, bucket_numel=60, overlap=overlap)
    started = _recording_starts(monkeypatch, opt)
    every = [f"bucket{i}" for i in range(len(opt.buckets))]
    assert len(every) == 4
    for step in range(2):  # the second step starts them afresh
        opt.zero_grad()
        _loss(model, step).backward()
        assert started == (every if overlap else [])
        opt.step()
        assert started == every
        started.clear()


def test_bfloat16_gradients_come_back_as_bfloat16_averages():
    plain, wrapped = _model(dtype=torch.bfloat16), _model(dtype=torch.bfloat16)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt = _wrap(wrapped)
    _train(plain, ref, 3, torch.bfloat16)
    _train(wrapped, opt, 3, torch.bfloat16)
    assert all(p.grad.dtype == torch.bfloat16 for p in wrapped.parameters())
    assert _same(plain, wrapped)  # bf16 -> float32 -> bf16 is exact


def test_gradients_accumulate_over_backward_passes_per_step(monkeypatch):
    plain, wrapped = _model(), _model()
    ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt = _wrap(wrapped, backward_passes_per_step=2, bucket_numel=60)
    started = _recording_starts(monkeypatch, opt)
    for model, o in ((plain, ref), (wrapped, opt)):
        for step in range(2):
            o.zero_grad()
            _loss(model, 2 * step).backward()
            assert started == []  # one pass: nothing started
            _loss(model, 2 * step + 1).backward()
            if o is opt:
                assert started == [f"bucket{i}" for i in range(len(opt.buckets))]
                started.clear()
            o.step()
    assert _same(plain, wrapped)


def test_a_parameter_without_a_gradient_keeps_none_and_is_not_stepped():
    model = _model()
    extra = torch.nn.Parameter(torch.ones(5))
    model.register_parameter("unused", extra)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    opt = mt.DistributedOptimizer(inner, _self(), model.named_parameters(), min_numel=8)
    _train(model, opt, 2)
    assert extra.grad is None
    assert torch.equal(extra.detach(), torch.ones(5))  # weight decay never touched it


def test_warm_up_steps_are_uncompressed_then_the_codec_takes_over():
    model = _model()
    opt = _wrap(model, "qsgd_maxnorm", bits=2, start_step=1, bucket_numel=10_000)
    grads = []
    for step in range(2):
        opt.zero_grad()
        _loss(model, step).backward()
        local = [p.grad.clone() for p in model.parameters()]
        opt.synchronize()
        grads.append(
            [torch.equal(a, p.grad) for a, p in zip(local, model.parameters(), strict=True)]
        )
        opt.step()
    assert all(grads[0])  # warm-up: a float32 average of one rank is the gradient
    assert not any(grads[1])  # 2-bit codes are not


def test_a_nan_skips_the_optimizer_step_and_keeps_momentum(recwarn):
    model = _model()
    opt = _wrap(model, nonfinite="skip_step")
    _train(model, opt, 1)
    before = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    opt.zero_grad()
    # The gradient turns NaN as it is made: buckets start during backward.
    hook = model[0].weight.register_hook(lambda g: g * float("nan"))
    _loss(model, 1).backward()
    hook.remove()
    with pytest.warns(mpicomp.NonFiniteWarning, match="optimizer step 1 skipped"):
        opt.step()
    assert opt.skipped and opt.steps == 2
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    for m, p in zip(momentum, model.parameters(), strict=True):
        assert torch.equal(m, opt.state[p]["momentum_buffer"])
    _train(model, opt, 1)
    assert not opt.skipped
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_nan_skip_rolls_back_the_residuals_of_every_bucket():
    model = _model()
    opt = _wrap(model, "topk", ratio=0.05, nonfinite="skip_step", bucket_numel=60, overlap=False)
    _train(model, opt, 2)
    saved = {k: v.clone() for k, v in opt.state_dict()["mpicomp"]["residuals"].items()}
    opt.zero_grad()
    _loss(model, 5).backward()
    model[0].weight.grad[0, 0] = float("inf")  # only the last bucket holds it
    with pytest.warns(mpicomp.NonFiniteWarning):
        opt.step()
    after = opt.state_dict()["mpicomp"]["residuals"]
    assert set(after) == set(saved) and len(saved) == 3  # bucket0 is below min_numel
    assert all(torch.equal(saved[k], after[k]) for k in saved)


def test_checkpoints_carry_residuals_and_steps_through_torch_save():
    a, b = _model(), _model()
    opt_a = _wrap(a, "topk", ratio=0.05, bucket_numel=60)
    _train(a, opt_a, 3)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    opt_b = _wrap(b, "topk", ratio=0.05, bucket_numel=60)
    b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    assert opt_b.steps == 3
    for step in range(3, 5):  # both continue identically only if residuals came along
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            _loss(model, step).backward()
            opt.step()
    assert _same(a, b)


def test_a_checkpoint_without_residuals_continues_differently():
    """The check above can fail: dropping the residuals changes the next steps."""
    a, b = _model(), _model()
    opt_a = _wrap(a, "topk", ratio=0.05, bucket_numel=60)
    _train(a, opt_a, 3)
    state = opt_a.state_dict()
    state["mpicomp"]["residuals"] = {}
    opt_b = _wrap(b, "topk", ratio=0.05, bucket_numel=60)
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(state)
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        _loss(model, 3).backward()
        opt.step()
    assert not _same(a, b)


def test_float16_gradients_are_never_averaged_to_inf():
    """The bucket is float32; the averages go back into float16 gradients: checked."""
    model = torch.nn.Linear(40, 2).half()
    opt = _wrap(model, "qsgd_maxnorm", bits=2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 40000.0)  # finite in float16; QSGD's 2-bit mean is not
    with pytest.raises(RankError, match="overflows float16"):
        opt.step()
    assert all(torch.equal(p.grad, torch.full_like(p, 40000.0)) for p in model.parameters())


@pytest.mark.parametrize("damage", ["nan residual", "missing key", "other optimizer"])
def test_a_refused_checkpoint_loads_nothing(damage):
    a = _model()
    opt = _wrap(a, "topk", ratio=0.05, bucket_numel=60)
    _train(a, opt, 2)
    saved = opt.state_dict()
    _train(a, opt, 1)
    before = opt.state_dict()
    state = {**saved, "mpicomp": dict(saved["mpicomp"])}
    if damage == "nan residual":
        state["mpicomp"]["residuals"] = {
            k: torch.full_like(v, float("nan")) for k, v in state["mpicomp"]["residuals"].items()
        }
    elif damage == "missing key":
        del state["mpicomp"]["comm_step"]
    else:
        state["param_groups"] = state["param_groups"] * 2
    with pytest.raises(ValueError, match={"missing key": "comm_step"}.get(damage)):
        opt.load_state_dict(state)
    after = opt.state_dict()
    assert after["mpicomp"]["steps"] == before["mpicomp"]["steps"]
    assert after["mpicomp"]["comm_step"] == before["mpicomp"]["comm_step"]
    for k, v in before["mpicomp"]["residuals"].items():
        assert torch.equal(after["mpicomp"]["residuals"][k], v)
    for s_after, s_before in zip(after["state"].values(), before["state"].values(), strict=True):
        assert torch.equal(s_after["momentum_buffer"], s_before["momentum_buffer"])


def test_learning_rate_schedulers_drive_the_wrapped_optimizer():
    model = _model()
    opt = _wrap(model, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)
    assert isinstance(opt, torch.optim.Optimizer)


def test_bad_arguments_are_named():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        mt.DistributedOptimizer(object(), _self())
    with pytest.raises(TypeError, match=r"optimizer must be .*got a module \(Sequential\)"):
        mt.DistributedOptimizer(model, _self())
    with pytest.raises(ValueError, match="backward_passes_per_step must be >= 1, got 0"):
        mt.DistributedOptimizer(inner, _self(), backward_passes_per_step=0)
    with pytest.raises(TypeError, match="backward_passes_per_step must be an int >= 1, got float"):
        mt.DistributedOptimizer(inner, _self(), backward_passes_per_step=1.5)
    with pytest.raises(ValueError, match="start_step must be >= 0"):
        mt.DistributedOptimizer(inner, _self(), start_step=-1)
    with pytest.raises(TypeError, match="start_step must be an int >= 0, got NoneType"):
        mt.DistributedOptimizer(inner, _self(), start_step=None)
    with pytest.raises(TypeError, match="overlap must be True or False, got str 'False'"):
        mt.DistributedOptimizer(inner, _self(), overlap="False")
    with pytest.raises(ValueError, match=r"not in named_parameters \(group0.param2 \(3, 40\)"):
        mt.DistributedOptimizer(inner, _self(), list(model.named_parameters())[:2])
    twice = [("w", p) for p in model.parameters()]
    with pytest.raises(ValueError, match="names 'w' more than once"):
        mt.DistributedOptimizer(inner, _self(), twice)
    cc = mpicomp.CompressedComm(_self())
    with pytest.raises(TypeError, match="pass neither"):
        mt.DistributedOptimizer(inner, cc, codec="topk")
    opt = mt.DistributedOptimizer(inner, cc, model.named_parameters())
    with pytest.raises(RuntimeError, match="before wrapping"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    with pytest.raises(TypeError, match="already a DistributedOptimizer"):
        mt.DistributedOptimizer(opt, _self())
    opt.close()
    cc.close()


def test_plain_parameters_where_named_ones_belong_are_refused_by_name():
    """model.parameters() (Horovod's users' slip) raised 'too many values to unpack'."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        TypeError,
        match=r"named_parameters must be \(name, tensor\) pairs such as "
        r"model.named_parameters\(\); got a Parameter of shape \(40, 12\) "
        r"\(model.parameters\(\) has no names",
    ):
        mt.DistributedOptimizer(inner, _self(), model.parameters())
    with pytest.raises(TypeError, match="named_parameters must be .*got a module"):
        mt.DistributedOptimizer(inner, _self(), model)
    with pytest.raises(TypeError, match=r"got str 'topk' \(a codec\? pass codec='topk'\)"):
        mt.DistributedOptimizer(inner, _self(), "topk")
    with pytest.raises(TypeError, match=r"got an item a tuple of \(int, Parameter\)"):
        mt.DistributedOptimizer(inner, _self(), list(enumerate(model.parameters())))
    with pytest.raises(TypeError, match="named_parameters must be .*got int 3"):
        mt.DistributedOptimizer(inner, _self(), 3)


def test_named_parameters_may_be_a_dict():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = mt.DistributedOptimizer(inner, _self(), dict(model.named_parameters()))
    assert sorted(n for bucket in opt.buckets for n in bucket) == sorted(
        n for n, _ in model.named_parameters()
    )
    opt.close()


def test_one_tensor_under_two_names_is_refused():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters()) + [("tied", model[0].weight)]
    with pytest.raises(ValueError, match="one tensor under two names, '0.weight' and 'tied'"):
        mt.DistributedOptimizer(inner, _self(), named)


def test_a_comm_that_is_not_a_communicator_is_named():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    # Horovod's order: DistributedOptimizer(optimizer, named_parameters=...)
    with pytest.raises(TypeError, match=r"comm must be an mpi4py communicator .*comes after comm"):
        mt.DistributedOptimizer(inner, model.named_parameters())
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator .*got NoneType"):
        mt.DistributedOptimizer(inner, None)
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator"):
        mt.HookState("topk")
    with pytest.raises(TypeError, match="start_step must be an int >= 0, got float"):
        mt.HookState(_self(), start_step=0.5)


def test_default_names_cover_every_parameter():
    model = _model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _self())
    names = sorted(n for bucket in opt.buckets for n in bucket)
    assert names == [f"group0.param{i}" for i in range(4)]


def test_cuda_staging_buffers_are_pinned_and_warn_once_per_owner(monkeypatch):
    pinned = []
    monkeypatch.setattr(
        torch, "empty", lambda n, dtype, pin_memory=False: pinned.append(pin_memory)
    )
    staging = Staging("owner")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        staging.buffer(10)
        staging.buffer(20)
    assert pinned == [True, True]
    assert [str(w.message).startswith("owner: CUDA tensors are staged") for w in seen] == [True]
    assert seen[0].filename == __file__  # the caller's line, not mpicomp's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of PyTorch and a GPU")
@pytest.mark.parametrize("codec,params", [("qsgd_maxnorm", {"bits": 4}), ("topk", {"ratio": 0.1})])
def test_cuda_gradients_on_the_gpu_average_to_the_cpu_bytes(codec, params):
    """The same gradients on the GPU and on the CPU: the GPU buckets (CUDA kernels, or
    pinned staging without CuPy) give the numba path's averages byte for byte."""
    cpu, gpu = _model(), _model().cuda()
    opts = [_wrap(m, codec, overlap=False, bucket_numel=60, **params) for m in (cpu, gpu)]
    for step in range(3):
        _loss(cpu, step).backward()
        for p, q in zip(cpu.parameters(), gpu.parameters(), strict=True):
            q.grad = p.grad.cuda()
        for opt in opts:
            opt.synchronize()
        for p, q in zip(cpu.parameters(), gpu.parameters(), strict=True):
            assert q.grad.device.type == "cuda"
            assert p.grad.numpy().tobytes() == q.grad.cpu().numpy().tobytes()
        for opt in opts:
            opt.step()
            opt.zero_grad()


# -- comm_hook without DDP (a stand-in for DDP's GradBucket) ------------------------------


class _GradBucket:
    def __init__(self, buffer, index=0, last=True):
        self._buffer, self._index, self._last = buffer, index, last

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def test_a_failed_hook_call_raises_mpicomps_own_error_out_of_backward():
    """What DDP's reducer does with a hook's future is no part of this: the error comes
    out of backward() from a final callback of autograd, with its own type, and the
    residuals of every bucket of that pass stay as they were."""
    state = mt.HookState(_self(), "topk", ratio=0.25, min_numel=1)
    w = torch.nn.Parameter(torch.ones(8))
    futures = []

    def ddp_like(p):  # two buckets: a finite one, then this gradient
        g = torch.linspace(1, 2, 8)
        futures.append(mt.comm_hook(state, _GradBucket(g, index=0, last=False)))
        futures.append(mt.comm_hook(state, _GradBucket(p.grad.reshape(-1), index=1)))

    w.register_post_accumulate_grad_hook(ddp_like)
    (w * 2).sum().backward()
    residuals = {k: v.copy() for k, v in state.comm.state_dict()["residuals"].items()}
    assert sorted(residuals) == ["ddp_bucket0", "ddp_bucket1"]
    assert all(r.any() for r in residuals.values())
    w.grad = None
    with pytest.raises(ValueError, match="'ddp_bucket1' holds NaN or Inf") as info:
        (w * float("nan")).sum().backward()
    assert type(info.value) is ValueError  # not torch's RuntimeError around it
    assert futures[2].wait().any()  # the finite bucket was averaged
    assert futures[3].wait().eq(0).all()  # the failed one: zeros
    after = state.comm.state_dict()["residuals"]
    assert all(after[k].tobytes() == residuals[k].tobytes() for k in residuals)
    w.grad = None
    (w * 2).sum().backward()  # the next pass runs as usual
    assert futures[5].wait().any()
    assert state.iteration == 3
    state.comm.close()


def test_a_hook_called_outside_backward_fails_its_future_with_mpicomps_error():
    state = mt.HookState(_self())
    future = mt.comm_hook(state, _GradBucket(torch.tensor([1.0, float("inf")])))
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        future.wait()
    state.comm.close()


def test_a_hook_state_that_is_not_a_hookstate_is_named():
    with pytest.raises(TypeError, match="comm_hook's state must be a mpicomp.torch.HookState"):
        mt.comm_hook(_self(), _GradBucket(torch.ones(4)))
