"""JAX glue: average a pytree of gradients over ranks, inside ``jax.jit`` or outside."""

from __future__ import annotations

from functools import partial

import numpy as np

try:
    import jax
    from jax.experimental import io_callback
except ImportError as e:  # an optional dependency: say how to get it
    raise ImportError("mpicomp.jax needs JAX: pip install jax") from e

__all__ = ["allreduce_tree"]


def allreduce_tree(comm, tree, *, names=None):
    """Return the average over ranks of every leaf of ``tree``, in a pytree of its structure.

    The leaves go through one ``comm.allreduce_many`` call (small ones fused into
    buckets), on the host: under ``jax.jit`` through an ordered ``io_callback``, so
    several calls in one jitted function reach MPI in program order on every rank;
    outside jit directly. Every rank must call it with the same tree structure,
    shapes and dtypes, as with ``allreduce_many``.

    Args:
        comm: an ``mpicomp.CompressedComm``.
        tree: a pytree of floating-point arrays (jax.Arrays, or tracers under jit);
            float16, bfloat16 and float64 leaves are averaged in float32.
        names: the leaves' names in ``jax.tree_util.tree_leaves`` order; they key
            error-feedback residuals. Default: each leaf's path
            (``jax.tree_util.keystr``), stable from step to step.

    Returns:
        A pytree of ``tree``'s structure whose leaves are jax.Arrays of the leaves'
        shapes and dtypes (outside jit, each on its leaf's sharding).

    Raises:
        TypeError: a leaf is not floating point; the message names it (by its path
            unless ``names`` is given). The other ranks raise ``mpicomp.RankError``.
        ValueError: ``names`` does not match the leaves.
        mpicomp.RankError: another rank failed, or ranks disagree, in this call.

    Under jit JAX re-raises these as ``jax.errors.JaxRuntimeError`` (a RuntimeError)
    whose message holds the original error; every rank still raises.
    """
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not paths:
        return tree  # allreduce_many of nothing makes no collective call either
    leaves = [leaf for _, leaf in paths]
    if names is None:
        names = [jax.tree_util.keystr(path) for path, _ in paths]
    average = partial(_average_on_host, comm, list(names))
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        leaves = [jax.numpy.asarray(leaf) for leaf in leaves]  # Python scalars get a dtype
        shapes = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
        out = io_callback(average, shapes, *leaves, ordered=True)
    else:
        jax.effects_barrier()  # callbacks of jitted calls still running reach MPI first
        averages = average(*leaves)
        out = [jax.device_put(y, _sharding(x)) for x, y in zip(leaves, averages, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, out)


def _average_on_host(comm, names: list, *leaves) -> list:
    """Return the averages of ``leaves`` as NumPy arrays of their dtypes."""
    # NumPy views of the host buffers: DLPack cannot carry bfloat16, NumPy (ml_dtypes) can.
    return comm.allreduce_many([np.asarray(leaf) for leaf in leaves], names)


def _sharding(x):
    """Return where a leaf's average goes: ``x``'s sharding, or the default device."""
    return x.sharding if isinstance(x, jax.Array) else None
