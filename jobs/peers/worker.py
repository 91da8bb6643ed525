"""One configuration of ``jobs.peers``, on every MPI rank of one launch.

``python -m mpi4py -m jobs.peers.worker --model M --config JSON --result PATH ...``:
trains model M (jobs/peers/models.py) for ``--steps`` steps of ``--optimizer`` (SGD with
momentum, or AdamW; a cosine learning rate after ``--lr-warmup`` steps of linear ramp)
by the configuration's ``kind``:

- ``ddp``: torch DDP over gloo (no hook, the fp16 or bf16 hook, PowerSGD);
- ``zero_ddp``: DDP with torch's ``ZeroRedundancyOptimizer``;
- ``fsdp``: torch FSDP2 over gloo, ``fully_shard`` on every top-level layer that has
  parameters, then on the model (``reduce_dtype``: its ``MixedPrecisionPolicy``);
- ``mpicomp``: ``mpicomp.torch.DistributedOptimizer`` (a codec, its parameters, a
  schedule; ``adam_warmup``: its compressed-Adam mode, given only where the
  configuration has it);
- ``mpicomp_fsdp``: FSDP2 as ``fsdp``, its reduce-scatter mpicomp's
  (``mpicomp.torch.compress_fsdp``);
- ``mpicomp_hsdp``: FSDP2 within each host (``mpicomp.torch.host_mesh``), the shards
  averaged over the hosts by mpicomp (``compress_hsdp``); a host is the ranks of one
  address of ``--iface`` (jobs.netem's emulated hosts), or, where every rank has the
  same address (a loopback), each ``--host-ranks`` consecutive ranks;
- ``mpicomp_zero``: ``mpicomp.torch.ZeroOptimizer`` (a codec, ``gather_precision``,
  ``adam_warmup`` as ``mpicomp``'s).

Every kind steps the same optimizer: ``torch.optim.SGD`` (``--momentum``) or
``torch.optim.AdamW`` (betas (0.9, 0.999), ``--weight-decay``), ZeroRedundancyOptimizer's
and ZeroOptimizer's as their ``optimizer_class``. The loss is the cross-entropy of the
logits against the labels, flattened (the lm's: every position's next token).

Rank 0 writes what it measured to PATH as JSON. The driver (jobs/peers/driver.py) starts
one launch per configuration, so that one that hangs or fails ends alone.

Measured:

- every step's time (zero_grad, forward, backward, the optimizer's step: the
  all-reduce included), the slowest rank's; ``ms_step`` is their median after
  ``--warmup`` steps;
- the model's metric (``models.METRICS``: test accuracy; the lm's held-out loss, the
  mean next-token cross-entropy over the test split in nats) of rank 0's model every
  ``--eval-every`` steps and at the end (not timed; the other ranks wait for it, or,
  sharded by FSDP, run the same forward); the result's ``accuracy`` and
  ``final_accuracy`` hold it, whichever it is, and ``metric`` names it;
- bytes per timed step: what tc's counters of ``--tc-dev`` say crossed the emulated
  network between the first timed step and the last (rank 0 reads them, as ``mpicomp
  bench --tc-dev``), and for mpicomp what its calls report (``on_call``: every rank's
  ``bytes_recv``, summed);
- the optimizer's memory on each rank: the bytes of its state tensors (SGD's momentum,
  AdamW's two moments and step counts: the whole model's under DDP and
  DistributedOptimizer, this rank's shard's under FSDP and the ZeRO optimizers, with
  ZeroOptimizer's float32 master rows where it keeps them).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import socket
import sys
import time

import numpy as np

from jobs._compare import cosine_lr
from jobs._data import ShardSampler
from jobs.peers import models

# Seconds gloo waits for a peer before it fails (the driver's timeout comes first).
GLOO_TIMEOUT_S = 600


def _address(iface: str) -> str:
    """Return the IPv4 address of network interface ``iface`` (Linux)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", iface[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


class _Bytes:
    """``on_call`` of mpicomp: sums what this rank's calls received, and their schedules."""

    def __init__(self):
        self.recv = 0
        self.schedules: set[str] = set()

    def __call__(self, event: dict) -> None:
        self.recv += event["bytes_recv"]
        if event.get("schedule"):
            self.schedules.add(event["schedule"])


def init_gloo(comm, iface: str) -> None:
    """Start torch.distributed's gloo group on the ranks of ``comm``, over ``iface``."""
    from mpicomp.torch import init_process_group

    os.environ["GLOO_SOCKET_IFNAME"] = iface
    init_process_group(comm, "gloo", address=_address(iface), timeout=GLOO_TIMEOUT_S)


def end_gloo(comm) -> None:
    """End the gloo group of ``init_gloo`` once every rank is done with it (rank 0's
    store serves the others until then)."""
    import torch.distributed as dist

    comm.Barrier()
    dist.destroy_process_group()


def optimizer_of(name: str, momentum: float, weight_decay: float) -> tuple[type, dict]:
    """The optimizer every peer steps: (its ``torch.optim`` class, its keywords; the
    learning rate 0 until ``train`` sets it)."""
    import torch

    if name == "sgd":
        return torch.optim.SGD, {"lr": 0.0, "momentum": momentum}
    if name == "adamw":
        return torch.optim.AdamW, {"lr": 0.0, "betas": (0.9, 0.999), "weight_decay": weight_decay}
    raise ValueError(f"unknown optimizer {name!r}; choose from sgd, adamw")


def _adam(config: dict) -> dict:
    """The compressed-Adam keyword of mpicomp's optimizers, where the configuration asks
    for the mode."""
    return {"adam_warmup": config["adam_warmup"]} if config.get("adam_warmup") else {}


class Peer:
    """What every configuration does per step: zero_grad, forward, backward, step.

    ``sharded``: the parameters are FSDP's shards, so every rank runs the evaluation's
    forward (it gathers them) and checks its own shard for NaN/Inf."""

    sharded = False
    counter: _Bytes | None = None
    loss = None  # the last step's, this rank's

    def step(self, x, y) -> None:
        import torch

        self.optimizer.zero_grad()
        # [batch, classes] against [batch]; the lm's [batch, seq, vocab] against [batch, seq]
        logits = self.net(x)
        self.loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten())
        self.loss.backward()
        self.optimizer.step()

    def state_bytes(self) -> int:
        """This rank's optimizer memory: the bytes of its state tensors."""
        return _state_bytes(self.optimizer.state)


class DDPPeer(Peer):
    """torch DDP over gloo, with one of torch's communication hooks or none, or with
    torch's ``ZeroRedundancyOptimizer`` (``kind`` ``zero_ddp``)."""

    def __init__(self, comm, model, config: dict, iface: str, optimizer: tuple[type, dict]):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        init_gloo(comm, iface)
        self._comm = comm
        hook = config.get("hook")
        options = {}
        if hook == "powersgd":
            # One bucket for the whole model: with DDP's default 25 MB buckets (two for
            # the 8.55M-parameter MLP) PowerSGD hung on gloo inside
            # unpack_uncompressed_tensors_and_allreduce_ps; with one it runs.
            numel = sum(p.numel() for p in model.parameters())
            options["bucket_cap_mb"] = 4 * numel / 2**20 + 1
        elif config.get("bucket_mb"):
            options["bucket_cap_mb"] = config["bucket_mb"]
        # Buffers (BatchNorm's running statistics) stay each rank's own after the start,
        # as with mpicomp, which broadcasts them once and then averages gradients only.
        sync = "forward_sync_buffers"  # torch >= 2.12's name; broadcast_buffers before
        if sync not in inspect.signature(DDP.__init__).parameters:
            sync = "broadcast_buffers"
        options[sync] = False
        self.net = DDP(model, **options)
        if hook in ("fp16", "bf16"):
            fn = getattr(default_hooks, f"{hook}_compress_hook")
            self.net.register_comm_hook(None, fn)
        elif hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=config["rank"],
                start_powerSGD_iter=config["start"],
                use_error_feedback=True,
                warm_start=True,
            )
            self.net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif hook is not None:
            raise ValueError(f"unknown DDP hook {hook!r}")
        self.module = model
        if config["kind"] == "zero_ddp":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            cls, keywords = optimizer
            self.optimizer = ZeroRedundancyOptimizer(model.parameters(), cls, **keywords)
        else:
            cls, keywords = optimizer
            self.optimizer = cls(model.parameters(), **keywords)

    def state_bytes(self) -> int:
        # ZeroRedundancyOptimizer's state is its inner optimizer's, this rank's part
        inner = getattr(self.optimizer, "optim", self.optimizer)
        return _state_bytes(inner.state)

    def close(self) -> None:
        end_gloo(self._comm)


class MpicompPeer(Peer):
    """``mpicomp.torch.DistributedOptimizer`` with one codec (and schedule)."""

    def __init__(self, comm, model, config: dict, optimizer: tuple[type, dict]):
        import mpicomp.torch as mt

        mt.broadcast_parameters(model, comm)
        self.counter = _Bytes()
        options = dict(config.get("params", {}))
        if config.get("schedule"):
            options["schedule"] = config["schedule"]
        options.update(_adam(config))
        cls, keywords = optimizer
        self.inner = cls(model.parameters(), **keywords)
        self.optimizer = mt.DistributedOptimizer(
            self.inner,
            comm,
            model.named_parameters(),
            config["codec"],
            on_call=self.counter,
            **options,
        )
        self.net = self.module = model

    def state_bytes(self) -> int:
        return _state_bytes(self.inner.state)

    def close(self) -> None:
        self.optimizer.close()


class FSDPPeer(Peer):
    """torch FSDP2 over gloo (``kind`` ``fsdp``), its reduce-scatter mpicomp's
    (``mpicomp_fsdp``), or sharded within each host and compressed between them
    (``mpicomp_hsdp``)."""

    sharded = True

    def __init__(
        self, comm, model, config: dict, iface: str, optimizer: tuple[type, dict], host_ranks: int
    ):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        import mpicomp.torch as mt

        init_gloo(comm, iface)
        self._comm = comm
        kind = config["kind"]
        mesh = host_mesh(comm, iface, host_ranks) if kind == "mpicomp_hsdp" else None
        options = {"mesh": mesh}
        if config.get("reduce_dtype"):
            reduce = getattr(torch, config["reduce_dtype"])
            options["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce)
        # FSDP's usual wrapping: each top-level layer its own unit, then the root; layers
        # that share a parameter (the lm's tied embedding and head) are left to the root's
        layers = [m for m in model.children() if any(True for _ in m.parameters())]
        owners = collections.Counter(id(p) for m in layers for p in m.parameters())
        for layer in layers:
            if all(owners[id(p)] == 1 for p in layer.parameters()):
                fully_shard(layer, **options)
        fully_shard(model, **options)
        self.cc = None
        if kind != "fsdp":
            self.counter = _Bytes()
            install = mt.compress_hsdp if kind == "mpicomp_hsdp" else mt.compress_fsdp
            params = config.get("params", {})
            self.cc = install(model, comm, config["codec"], on_call=self.counter, **params)
        self.net = self.module = model
        cls, keywords = optimizer
        self.optimizer = cls(model.parameters(), **keywords)

    def close(self) -> None:
        if self.cc is not None:
            self.cc.close()
        end_gloo(self._comm)


class ZeroPeer(Peer):
    """``mpicomp.torch.ZeroOptimizer`` with one codec and ``gather_precision``."""

    def __init__(self, comm, model, config: dict, optimizer: tuple[type, dict]):
        import mpicomp.torch as mt

        mt.broadcast_parameters(model, comm)
        self.counter = _Bytes()
        options = dict(config.get("params", {}))
        options["gather_precision"] = config.get("gather_precision", "float32")
        options.update(_adam(config))
        cls, keywords = optimizer
        self.optimizer = mt.ZeroOptimizer(
            model.named_parameters(),
            cls,
            comm,
            config["codec"],
            on_call=self.counter,
            **keywords,
            **options,
        )
        self.net = self.module = model

    def state_bytes(self) -> int:
        return self.optimizer.state_bytes()

    def close(self) -> None:
        self.optimizer.close()


def host_mesh(comm, iface: str, host_ranks: int):
    """FSDP's mesh over this rank's host's ranks: the ranks whose ``iface`` has this
    rank's address (jobs.netem's emulated hosts), or, where every rank has the same
    address, ``host_ranks`` consecutive ranks."""
    import mpicomp.torch as mt

    addresses = comm.allgather(_address(iface))
    distinct = sorted(set(addresses))
    if len(distinct) > 1:
        color = distinct.index(addresses[comm.rank])
    else:
        color = comm.rank // host_ranks
    host = comm.Split(color, comm.rank)
    try:
        return mt.host_mesh(comm, host)
    finally:
        host.Free()


def _local(t):
    """A tensor's local part: this rank's shard of an FSDP parameter (a DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(state) -> int:
    """The bytes of the tensors of an optimizer's ``state`` (a shard's, for DTensors)."""
    import torch

    return sum(_local(t).nbytes for s in state.values() for t in s.values() if torch.is_tensor(t))


def score(model, data: models.Data, metric: models.Metric) -> float:
    """``model``'s ``metric`` on the test split: accuracy, or the mean cross-entropy over
    every label (the lm's held-out loss, nats)."""
    import torch

    model.eval()
    with torch.no_grad():
        total = 0.0
        for lo in range(0, len(data.y_test), 256):
            logits = model(torch.from_numpy(data.x_test[lo : lo + 256]))
            y = torch.from_numpy(data.y_test[lo : lo + 256]).flatten()
            logits = logits.flatten(0, -2)
            if metric.higher:  # accuracy
                total += int((logits.argmax(dim=1) == y).sum())
            else:
                total += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
    model.train()
    return total / data.y_test.size


def _finite(tensors) -> bool:
    """Whether every tensor (this rank's shard of a DTensor) is free of NaN/Inf."""
    import torch

    return all(bool(torch.isfinite(_local(t)).all()) for t in tensors if t is not None)


def _evaluate(comm, peer, data: models.Data, metric: models.Metric) -> tuple[float, bool]:
    """Rank 0's ``metric`` and whether every rank's parameters are finite (the same on
    every rank). A sharded model's forward is collective: every rank runs it."""
    from mpi4py import MPI

    params = list(peer.module.parameters())
    if peer.sharded:
        acc = score(peer.module, data, metric)
        finite = comm.allreduce(_finite(params), op=MPI.LAND)
        return comm.bcast(acc, root=0), finite
    mine = (score(peer.module, data, metric), _finite(params)) if comm.rank == 0 else None
    return comm.bcast(mine, root=0)


def _tc(devs: list[str]) -> int | None:
    from mpicomp.tools.bench.allreduce import tc_sent_bytes

    return sum(tc_sent_bytes(d) for d in devs) if devs else None


def learning_rate(args, step: int) -> float:
    """The learning rate of ``step`` (0-based): a cosine from ``--lr`` to 0 over the
    steps, ramped up linearly over the first ``--lr-warmup``."""
    lr = cosine_lr(args.lr, step, args.steps)
    return lr * min(1.0, (step + 1) / args.lr_warmup) if args.lr_warmup else lr


def train(comm, peer, data: models.Data, args) -> dict:
    """Run the steps; return what rank 0 reports (the same dict on every rank)."""
    import torch
    from mpi4py import MPI

    sampler = ShardSampler(
        len(data.y_train), args.batch * comm.size, comm.rank, comm.size, args.seed
    )
    evals = set(range(args.eval_every, args.steps + 1, args.eval_every)) | {args.steps}
    times: list[float] = []
    metric = models.METRICS[args.model]
    accuracy: list[tuple[int, float]] = [(0, _evaluate(comm, peer, data, metric)[0])]
    diverged = 0
    window = {}
    for step in range(args.steps):
        if step == args.warmup:  # the timed steps begin: read the byte counters
            comm.Barrier()
            window["tc"] = _tc(args.tc_dev) if comm.rank == 0 else None
            window["traced"] = peer.counter.recv if peer.counter else None
        idx = sampler.next()
        x, y = torch.from_numpy(data.x_train[idx]), torch.from_numpy(data.y_train[idx])
        for group in peer.optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        t0 = time.perf_counter()
        try:
            peer.step(x, y)
        except (ValueError, RuntimeError):
            # mpicomp raises on every rank in the same step (nonfinite="raise"): divergence
            # when some rank's loss, gradient or parameters hold NaN/Inf (FSDP's unsharded
            # gradients are gone by now: the loss tells), a failure else
            params = list(peer.module.parameters())
            bad = not _finite([peer.loss, *params, *(p.grad for p in params)])
            if not comm.allreduce(bad, op=MPI.LOR):
                raise
            diverged = step + 1
            break
        times.append(time.perf_counter() - t0)
        done = step + 1
        if done in evals:
            acc, finite = _evaluate(comm, peer, data, metric)
            accuracy.append((done, acc))
            if not finite:  # the same weights on every rank: the same answer
                diverged = done
                break
    comm.Barrier()
    timed = len(times) - args.warmup
    tc_bytes = traced = None
    if timed > 0 and not diverged:
        if args.tc_dev and comm.rank == 0:
            tc_bytes = (_tc(args.tc_dev) - window["tc"]) / timed
        if peer.counter is not None:
            traced = comm.allreduce(peer.counter.recv - window["traced"]) / timed
    local = np.asarray(times, dtype=np.float64)
    slowest = np.empty_like(local)
    comm.Allreduce(local, slowest, op=MPI.MAX)
    step_ms = (1e3 * slowest).tolist()
    state = comm.allgather(peer.state_bytes())  # after the steps: SGD's momentum is lazy
    return {
        "model_params": models.n_params(peer.module),
        "ranks": comm.size,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_per_rank": args.batch,
        "step_ms": step_ms,
        "ms_step": float(np.median(step_ms[args.warmup :])) if timed > 0 else None,
        "metric": metric.name,
        "optimizer": args.optimizer,
        "accuracy": accuracy,
        "final_accuracy": accuracy[-1][1] if accuracy and not diverged else None,
        "diverged": diverged,
        "bytes_per_step_tc": tc_bytes,
        "bytes_per_step_traced": traced,
        "schedules": sorted(peer.counter.schedules) if peer.counter else None,
        "optimizer_bytes": state,
    }


def sizes_from_json(text: str) -> models.Sizes:
    """The driver's ``--sizes`` JSON as ``models.Sizes``."""
    sizes = json.loads(text)
    sizes["mlp_hidden"] = tuple(sizes["mlp_hidden"])
    return models.Sizes(**sizes)


def write_result(path: str, result: dict) -> None:
    """Write ``result`` to ``path`` as JSON, whole or not at all (the driver reads it)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def _parse(argv):
    ap = argparse.ArgumentParser(prog="jobs.peers.worker", description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=models.MODELS, required=True)
    ap.add_argument("--config", required=True, help="the configuration, as JSON")
    ap.add_argument("--sizes", required=True, help="the models' sizes, as JSON (models.Sizes)")
    ap.add_argument("--result", required=True, help="where rank 0 writes its JSON")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--eval-every", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True, help="samples per rank")
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--lr-warmup", type=int, default=0, help="steps of linear ramp (0)")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD's (0.9)")
    ap.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's (0.01)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iface", default="lo", help="the interface gloo uses")
    ap.add_argument("--tc-dev", default="", help="qdiscs to count (NETNS/DEV, comma list)")
    ap.add_argument(
        "--host-ranks",
        type=int,
        default=2,
        help="mpicomp_hsdp: ranks per host where every rank has the same --iface address",
    )
    args = ap.parse_args(argv)
    args.tc_dev = [d for d in args.tc_dev.split(",") if d]
    args.config = json.loads(args.config)
    args.sizes = sizes_from_json(args.sizes)
    return args


def main(argv=None) -> int:
    """Train one configuration on MPI.COMM_WORLD; rank 0 writes ``--result``."""
    import torch
    from mpi4py import MPI

    args = _parse(argv)
    torch.set_num_threads(1)  # the ranks share the cores
    comm = MPI.COMM_WORLD
    data = models.load(args.model, args.sizes)
    model = models.build(args.model, args.sizes, args.seed)
    config = args.config
    kind = config["kind"]
    opt = optimizer_of(args.optimizer, args.momentum, args.weight_decay)
    if kind in ("ddp", "zero_ddp"):
        peer = DDPPeer(comm, model, config, args.iface, opt)
    elif kind in ("fsdp", "mpicomp_fsdp", "mpicomp_hsdp"):
        peer = FSDPPeer(comm, model, config, args.iface, opt, args.host_ranks)
    elif kind == "mpicomp_zero":
        peer = ZeroPeer(comm, model, config, opt)
    elif kind == "mpicomp":
        peer = MpicompPeer(comm, model, config, opt)
    else:
        raise ValueError(f"unknown configuration kind {kind!r}")
    # One BLAS thread per rank, as torch's and numba's: the ranks share the cores, and
    # OpenBLAS threads spinning beside them slowed powersgd's matrix products (jobs._loop).
    from threadpoolctl import threadpool_limits

    # An exception here ends every rank (python -m mpi4py): no close, which is collective.
    with threadpool_limits(limits=1, user_api="blas"):
        result = train(comm, peer, data, args)
    peer.close()
    if comm.rank == 0:
        result.update(torch=torch.__version__, mpi=MPI.Get_library_version().splitlines()[0])
        write_result(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
