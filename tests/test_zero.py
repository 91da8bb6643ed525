"""mpicomp.torch.ZeroOptimizer on one rank: the plain optimizer's steps exactly, buckets
as views of the parameters, keywords split between the CompressedComm and the
optimizer, groups, schedulers, checkpoints, parameters written between steps,
gradient accumulation, NaN steps, bfloat16.

With one rank a rank's row is the whole bucket and the average of a gradient is the
gradient itself: an elementwise optimizer must take exactly the unsharded one's steps.
"""

import io

import pytest

torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")

import mpicomp  # noqa: E402
import mpicomp.torch as mt  # noqa: E402


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


def _model(seed=0, dtype=torch.float32):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)
        ).to(dtype)


def _loss(model, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 12, generator=g).to(dtype), torch.randint(0, 3, (16,), generator=g)
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def _zero(model, codec=None, optimizer=torch.optim.Adam, **kw):
    kw.setdefault("min_numel", 8)
    kw.setdefault("lr", 0.01)
    return mt.ZeroOptimizer(model.named_parameters(), optimizer, _self(), codec, **kw)


def _train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("overlap", [True, False])
def test_one_rank_takes_exactly_the_plain_optimizers_steps(overlap):
    model, ref = _model(), _model()
    opt = _zero(model, bucket_numel=100, weight_decay=0.01, overlap=overlap)
    _train(model, opt, 4)
    _train(ref, torch.optim.Adam(ref.parameters(), lr=0.01, weight_decay=0.01), 4)
    assert len(opt.buckets) > 1 and _same(model, ref)
    assert opt.steps == 4 and not opt.skipped


def test_parameter_groups_keep_their_hyperparameters_and_frozen_ones_are_left_alone():
    model, ref = _model(), _model()
    for m in (model, ref):
        m[0].bias.requires_grad_(False)
    decay = [(n, p) for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [(n, p) for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = mt.ZeroOptimizer(
        [{"params": decay, "weight_decay": 0.5}, {"params": rest}],
        torch.optim.SGD,
        _self(),
        lr=0.1,
        momentum=0.9,
        min_numel=8,
    )
    frozen = model[0].bias.detach().clone()
    ref_opt = torch.optim.SGD(
        [
            {"params": [ref[0].weight, ref[2].weight], "weight_decay": 0.5},
            {"params": [ref[0].bias, ref[2].bias]},
        ],
        lr=0.1,
        momentum=0.9,
    )
    _train(model, opt, 3)
    _train(ref, ref_opt, 3)
    assert _same(model, ref) and torch.equal(model[0].bias, frozen)
    assert opt.buckets == (("2.bias",), ("2.weight", "0.weight"))  # a new group, a new bucket
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0]


def test_buckets_are_views_of_the_parameters_up_to_bucket_numel_and_per_dtype():
    model = _model()
    model[2].to(torch.bfloat16)
    opt = _zero(model, bucket_numel=100)
    # Reverse order; 2.weight (120) alone passes 100; a new dtype starts a new bucket.
    assert opt.buckets == (("2.bias",), ("2.weight",), ("0.bias",), ("0.weight",))
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 4
    # bfloat16 parameters keep a float32 master row; float32 ones are their own rows.
    masters = sum(p.numel() * 4 for p in model[2].parameters())
    x, y = torch.randn(16, 12), torch.randint(0, 3, (16,))
    logits = model[2](model[1](model[0](x)).bfloat16())
    torch.nn.functional.cross_entropy(logits.float(), y).backward()
    opt.step()
    state = sum(t.nbytes for s in opt.state.values() for t in s.values())
    assert opt.state_bytes() == state + masters


def test_learning_rate_schedulers_drive_the_inner_optimizer():
    model = _model()
    opt = _zero(model, lr=1.0, optimizer=torch.optim.SGD)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        _train(model, opt, 1, step)
        sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)
    assert isinstance(opt, torch.optim.Optimizer)


def test_a_scheduler_still_drives_the_optimizer_after_a_checkpoint_is_loaded():
    """torch's load_state_dict makes new groups: the ZeroOptimizer's must be those."""
    model = _model()
    opt = _zero(model, lr=1.0, optimizer=torch.optim.SGD)
    _train(model, opt, 1)
    opt.load_state_dict(opt.state_dict())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(model, opt, 1, 1)
    sched.step()
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.5)


def test_keywords_go_to_the_codec_options_or_the_optimizer_and_bad_ones_are_named():
    model = _model()
    opt = _zero(model, "qsgd_maxnorm", bits=2, betas=(0.8, 0.9), bucket_numel=100)
    assert opt.comm.codec.params["bits"] == 2 and opt.comm.options.bucket_numel == 100
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    opt.close()
    with pytest.raises(
        TypeError, match=r"'bitz' \(did you mean 'bits'\?\).*nor an argument of Adam"
    ):
        _zero(model, "qsgd_maxnorm", bitz=2)
    with pytest.raises(TypeError, match=r"pass its class, Adam"):
        mt.ZeroOptimizer(model.named_parameters(), torch.optim.Adam(model.parameters()), _self())
    with pytest.raises(ValueError, match="'powersgd' has no reduce-scatter"):
        _zero(model, "powersgd")
    with pytest.raises(ValueError, match="gather_precision must be one of"):
        _zero(model, gather_precision="float16")
    with pytest.raises(TypeError, match="model.parameters\\(\\) has no names"):
        mt.ZeroOptimizer(model.parameters(), torch.optim.Adam, _self())
    with pytest.raises(TypeError, match="'0.weight' is torch.float64"):
        _zero(_model(dtype=torch.float64))


def test_a_keyword_both_take_is_refused():
    class Seeded(torch.optim.SGD):
        def __init__(self, params, lr=0.1, seed=0):
            super().__init__(params, lr=lr)

    with pytest.raises(TypeError, match="'seed' are taken by the CompressedComm and by Seeded"):
        _zero(_model(), "qsgd_maxnorm", optimizer=Seeded, seed=3)


def test_checkpoints_resume_identically_through_torch_save():
    for precision in ("float32", "bfloat16"):
        a, b = _model(), _model(seed=1)
        kw = dict(bucket_numel=100, ratio=0.1, gather_precision=precision)
        opt_a = _zero(a, "topk", **kw)
        _train(a, opt_a, 3)
        buf = io.BytesIO()
        torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        opt_b = _zero(b, "topk", **kw)
        b.load_state_dict(saved["model"])  # the model first: then the master rows
        opt_b.load_state_dict(saved["opt"])
        assert opt_b.steps == 3
        _train(a, opt_a, 2, 3)
        _train(b, opt_b, 2, 3)
        assert _same(a, b), precision


def test_a_checkpoint_without_its_master_rows_or_residuals_continues_differently():
    """The check above can fail: the bfloat16 model alone is not the master rows, and
    dropping the residuals changes the next steps."""
    for drop in ("masters", "residuals"):
        a, b = _model(), _model()
        kw = dict(ratio=0.1, gather_precision="bfloat16")
        opt_a = _zero(a, "topk", **kw)
        _train(a, opt_a, 3)
        state = opt_a.state_dict()
        opt_b = _zero(b, "topk", **kw)
        b.load_state_dict(a.state_dict())
        if drop == "masters":
            opt_b.optimizer.load_state_dict({k: v for k, v in state.items() if k != "mpicomp"})
            opt_b.steps = 3
        else:
            state["mpicomp"]["residuals"] = {}
            opt_b.load_state_dict(state)
        _train(a, opt_a, 1, 3)
        _train(b, opt_b, 1, 3)
        assert not _same(a, b), drop


def test_another_ranks_checkpoint_is_refused():
    opt = _zero(_model())
    state = opt.state_dict()
    state["mpicomp"]["rank"] = 1
    with pytest.raises(ValueError, match="rank 1's of 1 ranks; this is rank 0 of 1"):
        opt.load_state_dict(state)
    with pytest.raises(ValueError, match="not a ZeroOptimizer's state_dict"):
        opt.load_state_dict(torch.optim.Adam(_model().parameters()).state_dict())


def test_parameters_written_between_steps_are_what_the_next_step_starts_from():
    """Parameters written after the ZeroOptimizer was made (in place, or given new
    data): the next step starts from them, master rows too, as the plain optimizer's."""
    for precision, in_place in (("float32", False), ("float32", True), ("bfloat16", True)):
        model, ref = _model(), _model()
        opt = _zero(model, optimizer=torch.optim.SGD, lr=0.1, gather_precision=precision)
        _train(model, opt, 2)
        other = _model(seed=7)
        if in_place:
            model.load_state_dict(other.state_dict())
        else:
            for p, q in zip(model.parameters(), other.parameters(), strict=True):
                p.data = q.detach().clone()
        ref.load_state_dict(other.state_dict())
        _train(model, opt, 1, 2)
        _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 1, 2)
        if precision == "float32":
            assert _same(model, ref)
        else:  # the same step, rounded to bfloat16
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p, q.bfloat16().float())


def test_gradients_accumulate_over_backward_passes_per_step():
    model, ref = _model(), _model()
    opt = _zero(model, optimizer=torch.optim.SGD, lr=0.1, backward_passes_per_step=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        _loss(m, 0).backward()
        _loss(m, 1).backward()
        o.step()
    assert _same(model, ref)


def test_gradients_changed_after_they_were_sent_warn_that_the_change_is_ignored():
    model, ref = _model(), _model()
    opt = _zero(model, optimizer=torch.optim.SGD, lr=0.1)
    opt.zero_grad()
    _loss(model, 0).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.warns(mt.GradientsIgnoredWarning, match="step 0: the gradients of '2.bias'"):
        opt.step()
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 1)  # unclipped
    assert _same(model, ref)


def test_a_nan_skips_the_step_and_rolls_back_the_residuals_of_every_bucket():
    model = _model()
    with pytest.warns(mt.UntrainedWarning, match="'topk' barely trains under Adam"):
        opt = _zero(model, "topk", ratio=0.05, nonfinite="skip_step", bucket_numel=60)
    _train(model, opt, 2)
    saved = {k: v.clone() for k, v in opt.state_dict()["mpicomp"]["residuals"].items()}
    before = [p.detach().clone() for p in model.parameters()]
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    opt.zero_grad()
    hook = model[0].weight.register_hook(lambda g: g * float("nan"))  # the last bucket
    _loss(model, 2).backward()
    hook.remove()
    with pytest.warns(mpicomp.NonFiniteWarning, match="optimizer step 2 skipped"):
        opt.step()
    assert opt.skipped and opt.steps == 3
    after = opt.state_dict()["mpicomp"]["residuals"]
    assert len(saved) == 3 and all(torch.equal(saved[k], after[k]) for k in saved)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(
        torch.equal(m, s["exp_avg"]) for m, s in zip(moments, opt.state.values(), strict=True)
    )
    _train(model, opt, 1, 3)
    assert not opt.skipped
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_bfloat16_parameters_train_on_float32_master_rows():
    model = _model(dtype=torch.bfloat16)
    opt = _zero(model, lr=0.02)
    first = _loss(model, 0, torch.bfloat16).item()
    for _ in range(8):
        opt.zero_grad()
        _loss(model, 0, torch.bfloat16).backward()
        opt.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert _loss(model, 0, torch.bfloat16).item() < 0.9 * first
    # Adam's moments and the master rows, all float32: 3 x 4 bytes per parameter.
    n = sum(p.numel() for p in model.parameters())
    assert opt.state_bytes() == 12 * n + 4 * len(opt.buckets)  # and a step per row


def test_close_drops_a_step_started_during_backward():
    model = _model()
    opt = _zero(model, "topk", ratio=0.1)
    _train(model, opt, 1)
    saved = {k: v.clone() for k, v in opt.state_dict()["mpicomp"]["residuals"].items()}
    opt.zero_grad()
    _loss(model, 1).backward()  # the bucket starts here
    opt.close()
    opt.close()
    assert opt.comm.closed
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    after = opt.comm.state_dict()["residuals"]  # the dropped step's are put back
    assert saved and all(torch.equal(saved[k], torch.from_dlpack(after[k])) for k in saved)
