"""The training comparison of jobs.train with a torch.nn.Module (PyTorch, CPU).

The same digits data, shards, initial weights, batches and learning-rate schedule;
the MLP is a ``torch.nn.Sequential`` trained by ``torch.optim.SGD`` with momentum.
After ``loss.backward()`` the gradients of ``model.parameters()`` go through
``CompressedComm.allreduce_many`` as torch tensors (taken through DLPack without a
copy; torch tensors come back) and are written back with ``p.grad.copy_(avg)``
before ``optimizer.step()``.

Run: ``NUMBA_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py -m jobs.train_torch
[--codecs none,qsgd_maxnorm_bits4,threelc] [--out runs/train_torch]``. Needs
PyTorch: ``pip install 'mpicomp[torch]'``.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict

import numpy as np

from jobs import _mlp
from jobs._loop import run_main

# A subset by default: the baseline and one codec of each aggregation kind.
DEFAULT_CODECS = "none,qsgd_maxnorm_bits4,qsgd_maxnorm_multiscale_bits2,threelc_sparsity1.0,signsgd"


class TorchMLP:
    """A ``torch.nn.Sequential`` MLP with ``torch.optim.SGD(momentum=...)``.

    It starts from ``jobs._mlp.init_mlp``'s weights (torch's ``Linear`` stores the
    transpose), so both jobs start from the same point.
    """

    def __init__(self, sizes: list[int], seed: int, momentum: float):
        import torch
        from torch import nn

        init = _mlp.init_mlp(sizes, seed)
        layers = OrderedDict()
        n = len(sizes) - 1
        for i in range(1, n + 1):
            lin = nn.Linear(sizes[i - 1], sizes[i])
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(init[f"fc{i}.weight"].T.copy()))
                lin.bias.copy_(torch.from_numpy(init[f"fc{i}.bias"]))
            layers[f"fc{i}"] = lin
            if i < n:
                layers[f"relu{i}"] = nn.ReLU()
        self.model = nn.Sequential(layers)
        named = list(self.model.named_parameters())
        self.names = [name for name, _ in named]
        self._params = [p for _, p in named]
        # lr is set before every step (cosine schedule); 0 here is a placeholder
        self.optimizer = torch.optim.SGD(self._params, lr=0.0, momentum=momentum)
        self._torch = torch

    def grads(self, x: np.ndarray, y: np.ndarray, scale: float):
        """Return (mean loss, [scale * p.grad per parameter]) on one local batch."""
        torch = self._torch
        self.optimizer.zero_grad(set_to_none=False)
        logits = self.model(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
        (loss * scale).backward()
        return float(loss.item()), [p.grad for p in self._params]

    def apply(self, averages: list, lr: float) -> None:
        """Write the averaged gradients into ``p.grad`` and take one optimizer step."""
        with self._torch.no_grad():
            for p, avg in zip(self._params, averages, strict=True):
                p.grad.copy_(avg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def params(self) -> dict[str, np.ndarray]:
        """Return a NumPy copy of the weights in ``jobs._mlp`` layout (weights (in, out))."""
        out = {}
        for name, p in zip(self.names, self._params, strict=True):
            a = p.detach().numpy()
            out[name] = (a.T if a.ndim == 2 else a).copy()
        return out


def main(argv=None) -> int:
    """Run the comparison with PyTorch on every rank; return 0, or 2 without PyTorch."""
    try:
        import torch
    except ImportError:
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            print(
                "jobs.train_torch needs PyTorch: pip install 'mpicomp[torch]' "
                "(or run jobs.train, the NumPy version)",
                file=sys.stderr,
            )
        return 2
    # One intra-op thread per rank: several ranks share the cores (as NUMBA_NUM_THREADS=1).
    torch.set_num_threads(1)
    return run_main(
        argv,
        "jobs.train_torch",
        __doc__.splitlines()[0],
        TorchMLP,
        steps=300,
        lr=0.05,
        out=os.path.join("runs", "train_torch"),
        codecs=DEFAULT_CODECS,
    )


if __name__ == "__main__":
    sys.exit(main())
