"""The compressed-Adam mode of ``DistributedOptimizer`` and ``ZeroOptimizer``
(``adam_warmup=``), in the family of 1-bit Adam (Tang et al. 2021, arXiv 2102.02888).

Adam divides each step by the square root of its second moment. Fed a compressed
gradient, that moment sees the compressor's error (error feedback's bursts, a sparse
gradient's zeros), and the steps come out of nearly constant size in directions the
error chose. 1-bit Adam's remedy, kept here: the first ``adam_warmup`` steps average
float32 gradients and step Adam as it is; then the second moment is frozen, and the
update is linear in what went through the codec, so error feedback makes up over the
next steps what one step's compression left out.

What goes through the codec after the warm-up is the gradient, as before it; each
rank updates the momentum from the average (the same bits on every rank). 1-bit Adam
sends the momentum instead; on the transformer of docs/training.md that trained
top-k alike, 3LC worse, and made the unbiased quantizers' noise (GRandK, signSGD's
vote) enter the momentum undamped, to NaN; the gradient also keeps ``ZeroOptimizer``'s
momentum sharded (docs/training.md, "The compressed-Adam mode").

The update after the warm-up is torch's Adam/AdamW with ``exp_avg_sq`` fixed at its
value at the end of the warm-up, bias-corrected for the steps it was averaged over
(``frozen_step``, kept in each parameter's state, so a checkpoint resumes alike):

    m <- beta1 * m + (1 - beta1) * g          (Adam: g + weight_decay * p)
    p <- p * (1 - lr * weight_decay)          (AdamW)
    p <- p - lr / (1 - beta1**step) * m / (sqrt(v / (1 - beta2**frozen_step)) + eps)
"""

from __future__ import annotations

import warnings

import torch

from mpicomp._log import log
from mpicomp.call.worker import user_stacklevel

__all__ = ["ADAPTIVE", "FrozenAdam", "UntrainedWarning", "check_adam", "warn_untrained"]

#: Optimizers that divide by a running moment of the gradient: a codec whose error
#: feedback bursts dwarf the signal gives them steps of constant size in random
#: directions (choosing.md's "with AdamW" column).
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
    from the averaged gradient, its second moment frozen."""

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

    def step(self) -> None:
        """Step every parameter that has a gradient (``p.grad``: the average over the
        ranks) with the second moment it had at the end of the warm-up. A parameter no
        warm-up step reached (no second moment) stays as it is, told once."""
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
        denom = (state["exp_avg_sq"] / correction2).sqrt_().add_(eps)
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
        f"codec {codec.name!r} barely trains under {name}: an adaptive optimizer divides "
        "by a second moment that the codec's error feeds, and its steps lose their "
        f"direction (docs/choosing.md, 'with AdamW'); {instead}, or a codec that trains "
        "under it (qsgd_maxnorm, fastsgd, topk with ratio >= 0.1)",
        UntrainedWarning,
        stacklevel=user_stacklevel(),
    )
