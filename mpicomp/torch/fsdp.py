"""FSDP2 (``fully_shard``) with mpicomp: its gradient reduce-scatter compressed, and
compressed HSDP.

``compress_fsdp`` gives every ``FSDPModule`` of a model a ``ReduceScatter``
(``FSDPModule.set_custom_reduce_scatter``): FSDP still packs each module's gradients
into its flat, padded buffer and keeps the sharded gradients; the reduction between is
``CompressedComm.reduce_scatter``, whose rows are FSDP's. ``compress_hsdp`` leaves
FSDP's own reduce-scatter within a host (a 1-D mesh over the host's ranks,
``host_mesh``) and averages each shard over the hosts through mpicomp's compressed
all-reduce (``AllReduceHook``, an ``FSDPModule.set_all_reduce_hook``).

torch 2.13 exports no public path to FSDP2's ``ReduceScatter`` interface: it is taken
from ``torch.distributed.fsdp._fully_shard._fsdp_api``.
"""

from __future__ import annotations

import warnings
import zlib
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _FSDPReduceScatter

from mpicomp.call.arguments import resolve as resolve_arguments
from mpicomp.call.arguments import split as split_keywords
from mpicomp.call.config import Config, check_same
from mpicomp.call.worker import user_stacklevel
from mpicomp.collectives import plain
from mpicomp.collectives._wait import split, split_type
from mpicomp.comm import CompressedComm
from mpicomp.errors import NonFiniteWarning, RankError
from mpicomp.torch.parameters import LAYOUT, describe_layout, layout_differences
from mpicomp.torch.shared import (
    agree,
    at_end_of_backward,
    check_comm,
    check_given,
    compressed,
    kind,
    max_over_ranks,
    mpi_of,
    quiet,
    timeout_of,
)

__all__ = ["AllReduceHook", "ReduceScatter", "compress_fsdp", "compress_hsdp", "host_mesh"]


def _checked(comm, name) -> tuple[CompressedComm, str]:
    """Return (comm, name) of a module's reduction, refusing what they cannot be."""
    if not isinstance(comm, CompressedComm):
        raise TypeError(f"comm must be a mpicomp.CompressedComm, got {kind(comm)}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str (it keys residuals), got {name!r}")
    return comm, name


class _Pass:
    """The calls of one backward pass (autograd's graph task ``task``): the residual
    snapshots they took, and what failed or was skipped."""

    def __init__(self, task: int):
        self.task = task
        self.snapshots: list = []
        self.errors: list = []
        self.skipped: list = []


class _Backward:
    """What the reductions of one model share over a backward pass: FSDP2 breaks when
    its post-backward hook raises (later backward passes skip every hook), so a failed
    or skipped call writes zeros and this delivers it once the backward pass is done.

    At the end of a pass in which a call failed or was skipped on every rank, every
    call's residuals and step go back (``rollback``), the model's gradients become
    ``None`` (a torch optimizer then skips the step: no momentum, no weight decay),
    and the error is raised out of ``backward()`` (a skip is warned). Outside a
    backward pass (a direct call) the error is raised at once.

    ``everyone``: the communicator of every rank where ``comm`` holds a shard's
    replicas only (HSDP): each pass ends with one small Allreduce over it, so that a
    failure or skip among one shard's replicas drops every rank's step."""

    def __init__(self, comm: CompressedComm, params: list | None = None, everyone=None):
        self.comm = comm
        self.params = params  # the model's parameters, whose gradients a failure drops
        self.everyone = everyone
        self._open: _Pass | None = None

    def run(self, start):
        """Run one call, ``start(snapshots)`` a started handle; return its result, or
        None where it failed or was skipped inside a backward pass (write zeros)."""
        task = torch._C._current_graph_task_id()  # -1 outside backward
        open_ = self._open
        # A pass whose end never came (an earlier final callback raised) is dropped.
        if open_ is None or open_.task != task:
            open_ = _Pass(task)
            self._open = (
                open_ if task >= 0 and at_end_of_backward(partial(self._finish, open_)) else None
            )
            open_ = self._open
        try:
            result, skipped = start(None if open_ is None else open_.snapshots).wait()
        except Exception as e:
            if open_ is None:
                raise
            open_.errors.append(e)
            return None
        if skipped:
            if open_ is None:
                _warn_skipped(skipped, "this call returned zeros")
            else:
                open_.skipped.extend(skipped)
            return None
        return result

    def _finish(self, open_: _Pass) -> None:
        if self._open is open_:
            self._open = None
        error, skipped = (open_.errors or [None])[0], open_.skipped
        if self.everyone is not None:
            error, skipped = self._on_every_rank(error, skipped)
        if error is None and not skipped:
            return
        self.comm.rollback(open_.snapshots)  # the step is not taken: no residual moves
        for p in self.params or ():
            p.grad = None
        if error is not None:
            raise error
        _warn_skipped(skipped, "the gradients are None on every rank: the step is skipped")

    def _on_every_rank(self, error, skipped: list) -> tuple:
        """Return (the error, the skip messages) of this pass on every rank: this rank's
        own, or a RankError or message naming the rank where a call failed or skipped."""
        mpi = self.everyone
        every = max_over_ranks(
            mpi,
            [mpi.rank + 1 if error else 0, mpi.rank + 1 if skipped else 0],
            self.comm.options.timeout,
            "compress_hsdp",
            lambda: "whether a shard's average failed in this backward pass",
        )
        failed, skipping = every[0] - 1, every[1] - 1
        if error is None and failed >= 0:
            error = RankError(
                f"compress_hsdp: the average of a shard failed on rank {failed} in this "
                "backward pass (its replicas raise its error): the step is dropped on every rank"
            )
        if not skipped and skipping >= 0:
            skipped = [f"rank {skipping}: a shard's average skipped"]
        return error, skipped


def _warn_skipped(skipped: list, what: str) -> None:
    warnings.warn(f"{'; '.join(skipped)}: {what}", NonFiniteWarning, stacklevel=user_stacklevel())


class ReduceScatter(_FSDPReduceScatter):
    """FSDP2's gradient reduce-scatter through ``CompressedComm.reduce_scatter``, for
    ``FSDPModule.set_custom_reduce_scatter`` (``compress_fsdp`` sets one on every
    FSDPModule of a model).

    FSDP calls it with one module's gradients in its flat layout (as many equal rows as
    ranks, padded: mpicomp's); it writes this rank's row into ``output_tensor``, by
    FSDP's op:

    - ``ReduceOp.AVG`` (FSDP's default): the average over the ranks;
    - ``ReduceOp.SUM`` (``set_force_sum_reduction_for_comms``, float16 gradients):
      the sum, which FSDP divides afterwards;
    - ``ReduceOp.PREMUL_SUM(1 / f)`` (``set_gradient_divide_factor(f)``): the sum
      divided by ``f`` (every rank must divide by the same ``f``).

    Every op is reduced in float32 and rounded once to the ``reduce_dtype``
    (``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``: bfloat16 in and out). CUDA
    tensors go through host memory.

    A call that fails, or is skipped under ``nonfinite="skip_step"``, during a
    backward pass writes zeros and leaves FSDP's pass to finish; then ``backward()``
    raises its error on every rank (or warns of the skip), every residual of the pass
    goes back and, under ``compress_fsdp``, the model's gradients are ``None``, so
    ``optimizer.step()`` moves nothing and training goes on (docs/sharded.md).

    Args:
        comm: a ``CompressedComm`` whose ranks are FSDP's process group's, in its order
            (checked once per group, on every rank, before the first reduction).
        name: names this module's calls; keys its error-feedback residuals (one per row).

    A call raises ``ValueError`` on every rank (the rank at fault its own, the others
    ``RankError``) for a process group that does not hold the CompressedComm's ranks in
    its order, an op other than the three above, ranks dividing by other factors,
    sizes that are not ``size`` times the output, or ``async_op=True`` (FSDP2 calls it
    synchronously, from its reduce-scatter stream).
    """

    def __init__(self, comm: CompressedComm, name: str, _backward: _Backward | None = None):
        self.comm, self.name = _checked(comm, name)
        self._backward = _Backward(comm) if _backward is None else _backward

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain buffer of ``size``: FSDP's input and output tensors."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ) -> None:
        # This rank's refusals ride the call's agreement: every rank raises.
        error, how, factor = None, "mean", None
        try:
            how, factor = _reduction(op)
            if async_op:
                raise ValueError(
                    "mpicomp's ReduceScatter runs synchronously (as FSDP2 calls it): async_op=True"
                )
            if input_tensor.numel() != self.comm.size * output_tensor.numel():
                raise ValueError(
                    f"reduce-scatter of {input_tensor.numel()} elements into "
                    f"{output_tensor.numel()} per rank over {self.comm.size} ranks: the "
                    "input must be size times the output"
                )
            members = _group_ranks(self.comm, group)
        except Exception as e:
            error, members = e, None
        # Reduced in float32 and rounded once to the input's dtype, whose range the call
        # checks on every rank (float16 sums); a divide factor applies to the float32 sum.
        source = input_tensor.reshape(-1)
        if factor is not None and source.dtype != torch.float32:
            source = source.float()
        source = source.cpu()
        # The group and the divide factor join the agreement: ranks with others raise.
        layout = f"group of torch ranks {list(members or ())}"
        if factor is not None:
            layout += f", the sum divided by {1 / factor!r}"
        row = self._backward.run(
            lambda snapshots: self.comm.start_scatter(
                source, self.name, op=how, snapshots=snapshots, layout=layout, refuse=error
            )
        )
        with torch.no_grad():
            if row is None:
                output_tensor.zero_()
                return
            if factor is not None:
                row = row * factor
            output_tensor.copy_(row.view(output_tensor.shape))  # to the device, as is

    def __repr__(self) -> str:
        return f"ReduceScatter({self.name!r}, codec={self.comm.codec!r})"


class AllReduceHook:
    """Average a shard over the hosts, in place: FSDP's reduce-scatter output on this
    rank (its host's average) through ``CompressedComm.allreduce`` over the ranks that
    hold the same shard on the other hosts. For ``FSDPModule.set_all_reduce_hook``
    (``compress_hsdp`` sets one on every FSDPModule of a model). Failures and skips
    are delivered as ``ReduceScatter``'s.

    Args:
        comm: a ``CompressedComm`` over the ranks of the same shard, one per host.
        name: names this module's calls; keys its error-feedback residual.
    """

    def __init__(self, comm: CompressedComm, name: str, _backward: _Backward | None = None):
        self.comm, self.name = _checked(comm, name)
        self._backward = _Backward(comm) if _backward is None else _backward

    def __call__(self, reduce_output: torch.Tensor) -> None:
        source = reduce_output
        if source.device.type != "cpu" or source.dtype != torch.float32:
            source = source.to("cpu", torch.float32)
        average = self._backward.run(
            lambda snapshots: self.comm.start(
                source, self.name, snapshots=snapshots, result_dtype=reduce_output.dtype
            )
        )
        with torch.no_grad():
            if average is None:
                reduce_output.zero_()
            else:
                reduce_output.copy_(average.view(reduce_output.shape))

    def __repr__(self) -> str:
        return f"AllReduceHook({self.name!r}, codec={self.comm.codec!r})"


def compress_fsdp(model, comm, codec=None, **options) -> CompressedComm:
    """Reduce-scatter the gradients of every ``FSDPModule`` of ``model`` through mpicomp.

    Call it after ``fully_shard`` (on the layers and the root), before training; every
    rank must call it alike. Each FSDPModule gets its own ``ReduceScatter``, its calls
    named ``"fsdp:<qualified name>"`` (``"fsdp:"`` for the root), so each keeps its own
    error-feedback residuals. FSDP's ops, divide factor and ``reduce_dtype`` work as
    with its own reduce-scatter (``ReduceScatter``).

    Args:
        model: a module sharded by ``torch.distributed.fsdp.fully_shard`` over a 1-D mesh
            whose ranks are ``comm``'s, in order (the default mesh with
            ``MPI.COMM_WORLD``, when torch's ranks are MPI's).
        comm: an mpi4py communicator (a ``CompressedComm`` is made over it from
            ``codec`` and ``options``) or a ``CompressedComm``.
        codec: a codec with a reduce-scatter (every one but ``powersgd``).
        **options: ``CompressedComm`` options and codec parameters (``bits=4``).

    Returns:
        The ``CompressedComm`` (``comm`` itself if it was one): its ``state_dict()``
        holds the residuals; ``close()`` it after training.

    Raises:
        TypeError, ValueError: ``model`` is not sharded (no FSDPModule), sharded over a
            mesh of another dimension or other ranks than ``comm``'s, or an argument
            is wrong (on the ranks at fault; RankError on the others).
        RankError: ranks hold other modules or parameter sizes, or configure the
            CompressedComm differently.
    """
    check_comm(comm)
    timeout = options.get("timeout", timeout_of(comm))
    error, config, modules, named = None, None, [], []
    try:
        check_given(comm, codec, options)
        modules = _fsdp_modules(model, "compress_fsdp")
        groups = [_one_dimension(mesh, "compress_fsdp").get_group() for mesh in _meshes(model)]
        ranks = [list(_group_ranks(mpi_of(comm), g)) for g in groups]
        config, named = _layout(model, modules)
        config = config.with_fields(process_groups=ranks)
    except Exception as e:  # whatever it is, the other ranks must hear of it
        error = e
    mpi = quiet(comm)
    check_same(
        mpi, config, error, "compress_fsdp", timeout,
        differences=partial(layout_differences, mpi, config, named),
    )  # fmt: skip
    cc = compressed(comm, codec, options)  # collective: raises on every rank
    backward = _Backward(cc, list(model.parameters()))
    for name, module in modules:
        module.set_custom_reduce_scatter(ReduceScatter(cc, f"fsdp:{name}", backward))
    return cc


def compress_hsdp(model, comm, codec=None, **options) -> CompressedComm:
    """Average the gradients of a ``model`` sharded within each host over the hosts
    through mpicomp's compressed all-reduce: hybrid sharding (HSDP) with the
    replicas' all-reduce compressed.

    Shard ``model`` with ``fully_shard(..., mesh=host_mesh(comm))`` (FSDP's own
    reduce-scatter within a host), then call this alike on every rank: every
    FSDPModule gets an ``AllReduceHook`` (calls named ``"hsdp:<qualified name>"``) over
    the ranks holding the same shard on the other hosts, which averages FSDP's
    reduce-scatter output (its host's average) in place. The gradients are the
    average over every rank. Under ``set_gradient_divide_factor(f)`` FSDP's
    reduce-scatter sums a host's gradients divided by ``f``, and the hook averages
    those over the hosts: the sum over every rank divided by ``f`` times the number
    of hosts.

    Args:
        model: a module sharded by ``fully_shard`` over one 1-D mesh of each host's
            ranks (as ``host_mesh`` makes): every host of as many ranks.
        comm: the mpi4py communicator of every rank (``MPI.COMM_WORLD``); the
            CompressedComm between the hosts is made from it, by the mesh.
        codec: a codec name or a made codec.
        **options: ``CompressedComm`` options and codec parameters (``bits=4``).

    Returns:
        The ``CompressedComm`` between the hosts (this rank's shard's replicas): its
        ``state_dict()`` holds the residuals; ``close()`` it after training.

    Raises:
        TypeError, ValueError: ``model`` is not sharded over one 1-D mesh, hosts hold
            different numbers of ranks, the meshes do not cover ``comm``'s ranks, or an
            argument is wrong (on the ranks at fault; RankError on the others).
        RankError: ranks hold other modules or parameter sizes, or configure the
            CompressedComm differently.
    """
    from mpi4py import MPI

    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            "compress_hsdp makes the CompressedComm between the hosts itself: comm must be "
            f"the mpi4py communicator of every rank, such as MPI.COMM_WORLD, got {kind(comm)}"
        )
    timeout = options.get("timeout")
    error, config, modules, members, shard, named = None, None, [], (), 0, []
    try:
        # The codec and options are compared over every rank here: the CompressedComm
        # made below compares them only among a shard's replicas (one rank per host).
        given, codec_params = split_keywords(options)
        made = resolve_arguments("none" if codec is None else codec, codec_params, given)
        modules = _fsdp_modules(model, "compress_hsdp")
        meshes = _meshes(model)
        if len(meshes) != 1:
            raise ValueError(
                f"compress_hsdp: {type(model).__name__} is sharded over {len(meshes)} meshes; "
                "shard every layer over the same mesh, host_mesh()"
            )
        mesh = _one_dimension(meshes[0], "compress_hsdp")
        members = tuple(dist.get_process_group_ranks(mesh.get_group()))
        shard = mesh.get_local_rank()
        config, named = _layout(model, modules)
        config = config.with_fields(**made.config.fields)
    except Exception as e:
        error = e
    check_same(
        comm, config, error, "compress_hsdp", timeout,
        differences=partial(layout_differences, comm, config, named),
    )  # fmt: skip
    # Every rank's torch rank and host (its mesh's torch ranks): the replicas of a
    # shard are the ranks at the same place in their host.
    every = plain.allgather_object(comm, (dist.get_rank(), members), timeout=timeout)
    hosts = _hosts(every, "compress_hsdp")  # the same error, if any, on every rank
    between = split(comm, shard, hosts.index(members), timeout=timeout, name="compress_hsdp")
    error, cc = None, None
    try:
        cc = CompressedComm(between, "none" if codec is None else codec, **options)
    except Exception as e:
        error = e
    finally:
        between.Free()  # the CompressedComm holds its own duplicate
    try:
        agree(comm, error, "compress_hsdp", timeout)  # each host's replicas made theirs
    except BaseException:
        if cc is not None:
            cc.close()
        raise
    # Each backward pass ends with one small Allreduce over comm: every rank drops a
    # step that one shard's replicas could not take.
    backward = _Backward(cc, list(model.parameters()), everyone=comm)
    for name, module in modules:
        module.set_all_reduce_hook(AllReduceHook(cc, f"hsdp:{name}", backward))
    return cc


def host_mesh(comm=None, host=None, *, device_type: str | None = None):
    """Return a 1-D ``DeviceMesh`` over this rank's host's ranks, for
    ``fully_shard(module, mesh=...)`` under ``compress_hsdp``.

    Collective over ``comm``. torch.distributed's default process group must hold the
    same processes as ``comm`` (its ranks in any order); the mesh's process groups are
    made in it, one per host.

    Args:
        comm: the mpi4py communicator of every rank (default ``MPI.COMM_WORLD``).
        host: an mpi4py communicator of this rank's host's ranks (default: ``comm``
            split by shared memory, ``MPI.COMM_TYPE_SHARED``); any split of ``comm``
            into groups of as many ranks works, given on every rank or on none. A
            rank's shard is its place among its host's torch ranks, in order.
        device_type: the mesh's device type (default ``"cuda"`` where torch sees a
            GPU, else ``"cpu"``).

    Raises:
        ValueError: hosts hold different numbers of ranks, or torch's default group is
            not ``comm``'s ranks (on every rank).
        RuntimeError: torch.distributed is not initialized (on every rank).
    """
    from mpi4py import MPI
    from torch.distributed.device_mesh import DeviceMesh

    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py communicator, got {kind(comm)}")
    error = None
    if not dist.is_initialized():
        error = RuntimeError(
            "host_mesh: torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first"
        )
    elif dist.get_world_size() != comm.size:
        error = ValueError(
            f"host_mesh: torch.distributed's default group holds {dist.get_world_size()} "
            f"ranks, comm {comm.size}: they must be the same processes"
        )
    elif host is not None and not isinstance(host, MPI.Intracomm):
        error = TypeError(f"host must be an mpi4py communicator, got {kind(host)}")
    elif device_type is not None and not isinstance(device_type, str):
        error = TypeError(f"device_type must be a str such as 'cuda', got {kind(device_type)}")
    # Given on some ranks only, the others would split comm while these gather on host.
    given = None
    if error is None:
        given = Config(
            {
                "host": "split by shared memory" if host is None else "given",
                "device_type": device_type,
            }
        )
    check_same(comm, given, error, "host_mesh", None)
    made = host is None
    if made:
        host = split_type(comm, MPI.COMM_TYPE_SHARED, comm.rank, timeout=None, name="host_mesh")
    try:
        members = tuple(plain.allgather_object(host, dist.get_rank()))
    finally:
        if made:
            host.Free()
    every = plain.allgather_object(comm, (dist.get_rank(), members))
    hosts = _hosts(every, "host_mesh")
    mine, _ = dist.new_subgroups_by_enumeration([list(h) for h in hosts])
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return DeviceMesh.from_group(mine, device_type)


# -- what they share ------------------------------------------------------------------


def _reduction(op) -> tuple[str, float | None]:
    """Return how ``CompressedComm.reduce_scatter`` makes FSDP's ``op``: its op
    (``"mean"`` or ``"sum"``) and the factor the row is multiplied by (or None)."""
    # A bare RedOpType (ReduceOp.AVG), or a ReduceOp made of one (PREMUL_SUM's, with
    # its factor); isinstance(x, ReduceOp) holds for both.
    bare = isinstance(op, dist.ReduceOp.RedOpType)
    which = op if bare else getattr(op, "op", None)
    if which == dist.ReduceOp.AVG:
        return "mean", None
    if which == dist.ReduceOp.SUM:
        return "sum", None
    if which == dist.ReduceOp.PREMUL_SUM and not bare:
        return "sum", float(op.factor)  # a tensor factor too
    raise ValueError(
        "mpicomp's ReduceScatter reduces by ReduceOp.AVG, ReduceOp.SUM or "
        f"ReduceOp.PREMUL_SUM(factor) (those FSDP2 uses), got {op!r}"
    )


def _group_ranks(comm, group) -> tuple[int, ...]:
    """Return the torch ranks of ``group``, refusing (on this rank) a group that does
    not hold ``comm``'s ranks in its order. Every rank that finds its own rank where it
    should be, with the same ranks as the others (which the caller's agreement
    compares), makes the group ``comm``'s ranks in order."""
    try:
        members = tuple(dist.get_process_group_ranks(group))
    except Exception as e:
        raise ValueError(f"FSDP's process group is not one of torch.distributed's: {e}") from e
    if len(members) != comm.size or members[comm.rank] != dist.get_rank():
        raise ValueError(
            f"FSDP's process group is not the CompressedComm's ranks in its order: it "
            f"holds torch ranks {list(members)}, the CompressedComm {comm.size} ranks, of "
            f"which rank {comm.rank} is torch rank {dist.get_rank()}; shard over a mesh "
            "of the communicator's ranks (the "
            "default mesh with MPI.COMM_WORLD when torch's ranks are MPI's)"
        )
    return members


def _fsdp_modules(model, what: str) -> list[tuple[str, FSDPModule]]:
    """Return the (qualified name, module) of every FSDPModule of ``model``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{what}: model must be a torch.nn.Module, got {kind(model)}")
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            f"{what}: {type(model).__name__} has no FSDPModule: shard it first, "
            "torch.distributed.fsdp.fully_shard on its layers and on it"
        )
    return modules


def _meshes(model) -> list:
    """Return the distinct device meshes of ``model``'s sharded (DTensor) parameters."""
    meshes = []
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and mesh not in meshes:
            meshes.append(mesh)
    return meshes


def _one_dimension(mesh, what: str):
    """Return ``mesh`` if it is 1-D; refuse another (HSDP's 2-D mesh, say)."""
    if mesh.ndim != 1:
        raise ValueError(
            f"{what}: the model is sharded over a {mesh.ndim}-D mesh ({mesh}); it takes a 1-D "
            "mesh (FSDP over its ranks; for hybrid sharding, host_mesh() and compress_hsdp)"
        )
    return mesh


def _layout(model, modules) -> tuple[Config, list]:
    """Return what every rank must share (the FSDPModules' names, their parameters'
    names and shapes) and each parameter as (qualified name, tensor), for
    ``layout_differences`` to name what differs."""
    named = list(model.named_parameters())
    text = ";".join(n for n, _ in modules) + "|" + describe_layout(named)
    config = Config(
        {
            "fsdp_modules": len(modules),
            "parameters": len(named),
            LAYOUT: f"{zlib.crc32(text.encode()):08x}",
        }
    )
    return config, named


def _hosts(every: list, what: str) -> list[tuple[int, ...]]:
    """Return the hosts (each a tuple of torch ranks, in shard order) of ``every`` rank's
    (torch rank, host's torch ranks), checked to split the ranks into hosts of as many
    ranks each; the same ValueError on every rank otherwise."""
    hosts: list[tuple[int, ...]] = []
    for _, members in every:
        if members not in hosts:
            hosts.append(members)
    ranks = sorted(r for r, _ in every)
    placed = sorted(r for h in hosts for r in h)
    error = None
    if any(r not in m for r, m in every) or placed != ranks:
        error = f"the hosts {[list(h) for h in hosts]} do not split torch ranks {ranks} in groups"
    elif len({len(h) for h in hosts}) != 1:
        sizes = [len(h) for h in hosts]
        error = f"hosts hold different numbers of ranks ({sizes}): a shard needs a replica on every host"
    if error is not None:
        raise ValueError(f"{what}: {error}")
    return hosts
