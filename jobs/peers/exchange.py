"""The float32 and fp16 exchanges alone, gloo's against MPI's and mpicomp's, in one launch.

``python -m mpi4py -m jobs.peers.exchange --model M --sizes JSON --result PATH ...``
(``python -m jobs.peers --exchange`` runs it on each network): the gradients of model M
(jobs/peers/models.py), filled with random values, are averaged over the ranks by

- ``gloo float32``: ``torch.distributed.all_reduce`` of one flat buffer (DDP with one
  bucket, without its copies into the bucket);
- ``gloo fp16``: what torch's ``fp16_compress_hook`` does to that buffer (cast to
  float16, divide, all-reduce, cast back);
- ``MPI_Allreduce float32``: mpi4py's ``Allreduce`` of the same flat buffer, in place;
- ``mpicomp <codec> flat``: ``CompressedComm.allreduce`` of the flat buffer;
- ``mpicomp <codec> optimizer``: ``DistributedOptimizer.step()`` with every parameter's
  gradient set (its buckets and copies, as in a training step; no backward, and an inner
  optimizer that updates nothing).

Each round runs every exchange once, in turn, so that load on the machine falls on all of
them alike; a time is the slowest rank's (a barrier before each). Rank 0 writes the
median over ``--repeats`` rounds after ``--warmup`` to PATH as JSON, with each
exchange's error against a float64 average (the run fails if one does not average):
what separates mpicomp's float32 and fp16 steps from DDP's when the compute is the same.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from jobs.peers import models
from jobs.peers.worker import end_gloo, init_gloo, sizes_from_json, write_result

CODECS = ("none", "fp16")


def _no_update():
    import torch

    class NoUpdate(torch.optim.Optimizer):
        """An optimizer that leaves the weights alone: the rows time the reduction only."""

        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            return None

    return NoUpdate


def exchanges(comm, model) -> tuple[dict, list, np.ndarray]:
    """Return ``name -> callable`` averaging ``model``'s gradients once each (the result
    returned), what to close after them (collectively), and this rank's gradients."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import mpicomp
    import mpicomp.torch as mt

    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    rng = np.random.default_rng(comm.rank)
    flat_np = rng.standard_normal(numel, dtype=np.float32) * np.float32(1e-3)
    flat = torch.from_numpy(flat_np.copy())
    work = torch.empty_like(flat)
    size = comm.size

    def gloo_float32():
        work.copy_(flat)
        dist.all_reduce(work)
        return work.div_(size).numpy()

    def gloo_fp16():
        half = flat.to(torch.float16).div_(size)
        dist.all_reduce(half)
        return work.copy_(half).numpy()

    mpi_work = np.empty_like(flat_np)

    def mpi_float32():
        mpi_work[:] = flat_np
        comm.Allreduce(MPI.IN_PLACE, mpi_work, op=MPI.SUM)
        return np.divide(mpi_work, np.float32(size), out=mpi_work)

    ops = {
        "gloo float32": gloo_float32,
        "gloo fp16": gloo_fp16,
        "MPI_Allreduce float32": mpi_float32,
    }
    closers = []
    no_update = _no_update()
    parts = np.split(flat_np, np.cumsum([p.numel() for p in params])[:-1])
    for codec in CODECS:
        cc = mpicomp.CompressedComm(comm, codec)
        ops[f"mpicomp {codec} flat"] = lambda cc=cc: cc.allreduce(flat_np, name="flat")
        opt = mt.DistributedOptimizer(no_update(params), comm, model.named_parameters(), codec)
        closers += [cc, opt]
        grads = [
            torch.from_numpy(x.reshape(p.shape).copy()) for p, x in zip(params, parts, strict=True)
        ]

        def step(opt=opt, grads=grads):
            # The averages land in this codec's own tensors: from the second round on,
            # every rank averages the same values, whose average they are (no copy timed).
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
            return [p.grad for p in params]  # joined after the clock stops

        ops[f"mpicomp {codec} optimizer"] = step
    return ops, closers, flat_np


def measure(comm, ops: dict, warmup: int, repeats: int) -> tuple[dict, dict]:
    """Return ``name -> [ms per round]`` (the slowest rank's, warm-up rounds left out)
    and ``name -> its last average`` (float64; an op may return it in pieces)."""
    from mpi4py import MPI

    times = {name: [] for name in ops}
    last = {}
    for round_ in range(warmup + repeats):
        for name, op in ops.items():
            comm.Barrier()
            t0 = time.perf_counter()
            out = op()
            mine = np.array([time.perf_counter() - t0])
            slowest = np.empty_like(mine)
            comm.Allreduce(mine, slowest, op=MPI.MAX)
            if round_ >= warmup:
                times[name].append(1e3 * float(slowest[0]))
            pieces = out if isinstance(out, list) else [out]
            last[name] = np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in pieces])
    return times, last


def errors(comm, flat: np.ndarray, last: dict) -> dict:
    """Return ``name -> ||average - float64 average|| / ||float64 average||``."""
    from mpi4py import MPI

    want = np.empty(flat.size)
    comm.Allreduce(flat.astype(np.float64), want, op=MPI.SUM)
    want /= comm.size
    scale = np.linalg.norm(want)
    return {name: float(np.linalg.norm(got - want) / scale) for name, got in last.items()}


def main(argv=None) -> int:
    import torch
    from mpi4py import MPI

    ap = argparse.ArgumentParser(prog="jobs.peers.exchange", description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=models.MODELS, required=True)
    ap.add_argument("--sizes", required=True, help="the models' sizes, as JSON (models.Sizes)")
    ap.add_argument("--result", required=True, help="where rank 0 writes its JSON")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--iface", default="lo", help="the interface gloo uses")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the cores
    comm = MPI.COMM_WORLD
    model = models.build(args.model, sizes_from_json(args.sizes), seed=0)
    init_gloo(comm, args.iface)
    ops, closers, flat = exchanges(comm, model)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):  # as the training worker
        times, last = measure(comm, ops, args.warmup, args.repeats)
    for closer in closers:
        closer.close()
    rel_err = errors(comm, flat, last)
    # Each exchange must compute the average it is timed for: float32 sums to rounding,
    # float16 ones to float16's precision.
    wrong = {k: e for k, e in rel_err.items() if e > (1e-2 if "fp16" in k else 1e-5)}
    if wrong:
        raise RuntimeError(f"exchanges that do not average the gradients: {wrong}")
    if comm.rank == 0:
        result = {
            "model_params": models.n_params(model),
            "ranks": comm.size,
            "repeats": args.repeats,
            "ms": {name: float(np.median(t)) for name, t in times.items()},
            "ms_all": times,
            "rel_err": rel_err,
        }
        write_result(args.result, result)
    end_gloo(comm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
