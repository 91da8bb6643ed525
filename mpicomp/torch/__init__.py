"""PyTorch in two lines: a distributed optimizer, a DDP communication hook, broadcasts.

``DistributedOptimizer`` wraps any ``torch.optim`` optimizer: gradients are averaged
through a ``CompressedComm`` while backward still runs (buckets of parameters, each
started as soon as all its gradients are accumulated), and ``step()`` waits, writes
the averages into ``p.grad`` and steps. ``comm_hook`` with a ``HookState`` does the
same inside ``torch.nn.parallel.DistributedDataParallel``. ``broadcast_parameters``
and ``broadcast_optimizer_state`` start every rank from rank ``root``'s state.
``compress_fsdp`` reduce-scatters the gradients of an FSDP2 (``fully_shard``) model
through mpicomp (``ReduceScatter``); ``compress_hsdp`` averages a model sharded within
each host (``host_mesh``) over the hosts through it (``AllReduceHook``).
``ZeroOptimizer`` keeps 1/N of an optimizer's state on each rank, gradients arriving by
a compressed reduce-scatter and parameters returning by an allgather.
``init_process_group`` starts torch.distributed's default group on an MPI
communicator's ranks, for DDP and FSDP2 in jobs started by ``mpirun`` or ``srun``.

Needs PyTorch (``pip install 'mpicomp[torch]'``). See docs/pytorch.md.

Each offer is a module of this package: ``optimizer.py`` (with ``parameters.py``, the
parameters it wraps and how ranks that wrap others differ), ``hook.py``,
``broadcast.py``, ``fsdp.py``, ``zero.py``, ``process_group.py``; ``shared.py`` holds what they share.
Import them from here.
"""

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - the test extras install torch
    raise ImportError("mpicomp.torch needs PyTorch: pip install 'mpicomp[torch]'") from e

from mpicomp.torch.adam import UntrainedWarning
from mpicomp.torch.broadcast import broadcast_optimizer_state, broadcast_parameters
from mpicomp.torch.hook import HookState, comm_hook
from mpicomp.torch.optimizer import DistributedOptimizer, GradientsOverwrittenWarning
from mpicomp.torch.process_group import init_process_group
from mpicomp.torch.zero import GradientsIgnoredWarning, ZeroOptimizer

__all__ = [
    "AllReduceHook",
    "DistributedOptimizer",
    "GradientsIgnoredWarning",
    "GradientsOverwrittenWarning",
    "HookState",
    "ReduceScatter",
    "UntrainedWarning",
    "ZeroOptimizer",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "comm_hook",
    "compress_fsdp",
    "compress_hsdp",
    "host_mesh",
    "init_process_group",
]

# Where users find them, in reprs, pickles and the API docs, as before the split.
for _public in (
    DistributedOptimizer,
    GradientsIgnoredWarning,
    GradientsOverwrittenWarning,
    HookState,
    UntrainedWarning,
    ZeroOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    comm_hook,
    init_process_group,
):
    _public.__module__ = __name__
del _public

# fsdp.py loads torch.distributed.fsdp (a second or so): on first use only. Its names
# keep their module, mpicomp.torch.fsdp, where the API docs find them.
_FSDP = ("AllReduceHook", "ReduceScatter", "compress_fsdp", "compress_hsdp", "host_mesh")


def __getattr__(name: str):
    if name not in _FSDP:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from mpicomp.torch import fsdp

    return getattr(fsdp, name)
