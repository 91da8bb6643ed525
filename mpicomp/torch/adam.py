"""The compressed-Adam mode of ``DistributedOptimizer`` and ``ZeroOptimizer``
(``adam_warmup=``), in the family of 1-bit Adam (Tang et al. 2021, arXiv 2102.02888).

Adam divides each step by the square root of its second moment. Fed a compressed
gradient, that moment sees the compressor's error (error feedback's bursts, a sparse
gradient's zeros), and the steps come out of nearly constant size in directions the
error chose. 1-bit Adam's remedy, kept here: the first ``adam_warmup`` steps average
float32 gradients and step Adam as it is; then the second moment is frozen, and the
update is linear in what went through the codec, so error feedback makes up over the
next steps what one step's compression left out.

What goes through the codec after the warm-up is each rank's gradient divided by
Adam's denominator ``sqrt(v / (1 - beta2**frozen_step)) + eps`` (the same on every
rank, ``BucketedOptimizer._freeze_scales``), and the average is multiplied back: the
codec then picks and rounds by the step each value will take, not by the gradient's
own scale (a sign vote's one magnitude fits every value; top-k keeps the largest
steps). Each rank updates the momentum from the average (the same bits on every rank).
1-bit Adam sends the momentum instead; on the transformer of docs/training.md that
trained top-k alike, 3LC worse, and took signSGD to NaN (its vote's one magnitude
entering the momentum undamped); the gradient also keeps ``ZeroOptimizer``'s momentum
sharded (docs/training.md, "Transformers under AdamW").

The update after the warm-up is torch's Adam/AdamW with ``exp_avg_sq`` fixed at its
value at the end of the warm-up, bias-corrected for the steps it was averaged over
(``frozen_step``, kept in each parameter's state, so a checkpoint resumes alike), as
a floor: the averages' own second moment (``exp_avg_sq_seen``, from the frozen value
on) may raise the denominator, never lower it. Without that floor's max, GRandK's
scaled coordinates and 3LC at ``sparsity=1.5`` took steps larger than Adam's and
diverged (docs/training.md); with it, v never learns the codec's error downward:

    g <- the average (Adam: + weight_decay * p)
    m <- beta1 * m + (1 - beta1) * g
    s <- beta2 * s + (1 - beta2) * g**2       (s from v / (1 - beta2**frozen_step))
    p <- p * (1 - lr * weight_decay)          (AdamW)
    p <- p - lr / (1 - beta1**step) * m / (sqrt(max(v / (1 - beta2**frozen_step), s)) + eps)
"""

from __future__ import annotations

import warnings

import torch

from mpicomp._log import log
from mpicomp.call.worker import user_stacklevel

__all__ = ["ADAPTIVE", "FrozenAdam", "UntrainedWarning", "check_adam", "warn_untrained"]

#: Optimizers that divide by a running moment of the gradient: a codec whose error
#: feedback bursts dwarf the signal gives them steps of constant size in random
#: directions (docs/choosing.md, "With AdamW").
ADAPTIVE = tuple(
    getattr(torch.optim, n)
    for n in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta")
    if hasattr(torch.optim, n)
)


def check_adam(optimizer_class: type, warmup) -> int | None:
    """Check the compressed-Adam mode's arguments on this rank: ``warmup`` is None (the
    mode is off) or a count of steps >= 1, and the optimizer is Adam or AdamW; return
    the warm-up."""
    if warmup is None:
        return None
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(
            f"adam_warmup must be a number of steps >= 1 (Adam's second moment is "
            f"measured uncompressed for that long, then frozen), got {warmup!r}"
        )
    if not issubclass(optimizer_class, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(
            f"adam_warmup is the compressed-Adam mode: it steps Adam or AdamW, not "
            f"{optimizer_class.__name__} (leave adam_warmup out for another optimizer)"
        )
    return warmup


class FrozenAdam:
    """The step of ``optimizer`` (a torch Adam or AdamW) after the warm-up: its momentum
    from the averaged gradient, its second moment frozen as a floor (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int):
        for group in optimizer.param_groups:
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(
                        f"adam_warmup: {type(optimizer).__name__}({flag}=True) is not "
                        "supported by the compressed-Adam mode"
                    )
        self.optimizer = optimizer
        self.warmup = warmup
        self._unstepped_told = False

    def frozen(self, steps: int) -> bool:
        """Whether step ``steps`` (from 0) is past the warm-up."""
        return steps >= self.warmup

    def denominators(self, params) -> list:
        """Per parameter of ``params``: ``sqrt(v / (1 - beta2**frozen_step)) + eps``
        (float32, flat, the same on every rank), or None before its first step."""
        groups = {p: g for g in self.optimizer.param_groups for p in g["params"]}
        out = []
        for p in params:
            state = self.optimizer.state.get(p)
            if not state or "exp_avg_sq" not in state:
                out.append(None)
                continue
            group = groups[p]
            frozen = state.get("frozen_step", int(state["step"]))
            v = state["exp_avg_sq"].float().reshape(-1) / (1 - group["betas"][1] ** frozen)
            out.append(v.sqrt_().add_(group["eps"]))
        return out

    def step(self) -> None:
        """Step every parameter that has a gradient (``p.grad``: the average over the
        ranks), its second moment at least what it was at the end of the warm-up. A
        parameter no warm-up step reached (no second moment) stays as it is, told once."""
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._step(group, p, p.grad)

    def _step(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.optimizer.state.get(p)
        if not state or "exp_avg_sq" not in state:
            if not self._unstepped_told:
                self._unstepped_told = True
                log.warning(
                    "adam_warmup: a parameter of shape %s had no gradient during the "
                    "warm-up: without its second moment the compressed-Adam mode leaves "
                    "it as it is",
                    tuple(p.shape),
                )
            return
        beta1, beta2 = group["betas"]
        lr, eps, decay = float(group["lr"]), group["eps"], group["weight_decay"]
        # AdamW's decay, or Adam's with decoupled_weight_decay=True (torch >= 2.6)
        decoupled = group.get(
            "decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW)
        )
        if "frozen_step" not in state:
            state["frozen_step"] = int(state["step"])
        state["step"] = step = state["step"] + 1
        g = grad.to(p.dtype)
        if decay and not decoupled:
            g = g.add(p, alpha=decay)
        m = state["exp_avg"]
        m.lerp_(g.to(m.dtype), 1 - beta1)
        if decay and decoupled:
            p.mul_(1 - lr * decay)
        correction1 = 1 - beta1 ** float(step)
        correction2 = 1 - beta2 ** state["frozen_step"]
        v = state["exp_avg_sq"] / correction2
        # The frozen moment is a floor: the averages' own may still raise it (a
        # quantizer's variance, a sparsifier's burst), never lower it (an AMSGrad max).
        seen = state.setdefault("exp_avg_sq_seen", v.clone())
        seen.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = torch.maximum(v, seen).sqrt_().add_(eps)
        p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-lr / correction1)


class UntrainedWarning(UserWarning):
    """The codec was measured to barely train under the adaptive optimizer it is
    wrapped around; the compressed-Adam mode (``adam_warmup``) trains it."""


def warn_untrained(codec, optimizer, adam) -> None:
    """Warn (on every rank: codec and optimizer class are agreed) when ``codec`` is one
    that falls far behind float32 under an adaptive ``optimizer`` and the
    compressed-Adam mode (``adam``) is off."""
    if adam is not None or codec.trains_adaptive or not isinstance(optimizer, ADAPTIVE):
        return
    name = type(optimizer).__name__
    instead = (
        "pass adam_warmup=<steps> (the compressed-Adam mode: docs/training.md)"
        if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
        else "use Adam or AdamW with adam_warmup=<steps>, or SGD"
    )
    warnings.warn(
        f"codec {codec.name!r} barely trains under {name}: it fell far behind float32 "
        "on transformers under AdamW, whose second moment the codec's error feeds "
        f"(docs/choosing.md, 'With AdamW'); {instead}, or a codec that trains under it "
        "(qsgd_maxnorm, fastsgd, topk with ratio >= 0.1)",
        UntrainedWarning,
        stacklevel=user_stacklevel(),
    )
