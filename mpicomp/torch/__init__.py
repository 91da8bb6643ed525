"""PyTorch in two lines: a distributed optimizer, a DDP communication hook, broadcasts.

``DistributedOptimizer`` wraps any ``torch.optim`` optimizer: gradients are averaged
through a ``CompressedComm`` while backward still runs (buckets of parameters, each
started as soon as all its gradients are accumulated), and ``step()`` waits, writes
the averages into ``p.grad`` and steps. ``comm_hook`` with a ``HookState`` does the
same inside ``torch.nn.parallel.DistributedDataParallel``. ``broadcast_parameters``
and ``broadcast_optimizer_state`` start every rank from rank ``root``'s state.

Needs PyTorch (``pip install 'mpicomp[torch]'``). See docs/pytorch.md.

Each offer is a module of this package: ``optimizer.py`` (with ``parameters.py``, the
parameters it wraps and how ranks that wrap others differ), ``hook.py``,
``broadcast.py``; ``shared.py`` holds what they share. Import them from here.
"""

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - the test extras install torch
    raise ImportError("mpicomp.torch needs PyTorch: pip install 'mpicomp[torch]'") from e

from mpicomp.torch.broadcast import broadcast_optimizer_state, broadcast_parameters
from mpicomp.torch.hook import HookState, comm_hook
from mpicomp.torch.optimizer import DistributedOptimizer, GradientsOverwrittenWarning

__all__ = [
    "DistributedOptimizer",
    "GradientsOverwrittenWarning",
    "HookState",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "comm_hook",
]

# Where users find them, in reprs, pickles and the API docs, as before the split.
for _public in (
    DistributedOptimizer,
    GradientsOverwrittenWarning,
    HookState,
    broadcast_optimizer_state,
    broadcast_parameters,
    comm_hook,
):
    _public.__module__ = __name__
del _public
