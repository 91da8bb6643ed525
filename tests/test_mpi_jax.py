"""mpicomp.jax.allreduce_tree across ranks under jax.jit: the NumPy mean for ``none``, the
bytes of allreduce_many for a compressed codec, and a refused leaf raising on every rank."""

import numpy as np
import pytest

import mpicomp
from conftest import gradient_like, world

jax = pytest.importorskip("jax", reason="JAX is optional: pip install jax")
jnp = jax.numpy

from mpicomp.jax import allreduce_tree  # noqa: E402

# bucket_numel = min_numel: "b" (10 elements) goes alone below min_numel (a float32 sum),
# "w" (9 x 13) alone above it (compressed).
OPTIONS = {"min_numel": 64, "bucket_numel": 64}


def _tree(rank, step=0, dtype="float32"):
    seed = 100 * step + 10 * rank
    return {
        "b": jnp.asarray(gradient_like(10, seed=seed), dtype=dtype),
        "w": jnp.asarray(gradient_like(9 * 13, seed=seed + 1).reshape(9, 13), dtype=dtype),
    }


def _mean_over_ranks(comm, tree):
    """Return every leaf's plain NumPy mean over ranks (float64)."""
    return {
        k: np.mean(comm.allgather(np.asarray(v, dtype=np.float64)), axis=0) for k, v in tree.items()
    }


@pytest.mark.mpi
def test_none_under_jit_is_the_numpy_mean():
    comm = world()
    with mpicomp.CompressedComm(comm, "none", **OPTIONS) as cc:
        run = jax.jit(lambda t: allreduce_tree(cc, t))
        for step in range(2):
            tree = _tree(comm.rank, step)
            out = run(tree)
            expected = _mean_over_ranks(comm, tree)
            for k in tree:
                assert isinstance(out[k], jax.Array) and out[k].shape == tree[k].shape
                assert out[k].dtype == jnp.float32
                np.testing.assert_allclose(out[k], expected[k], rtol=1e-6, atol=1e-9)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "codec, params", [("threelc", {}), ("qsgd_maxnorm", {"bits": 4})], ids=["threelc", "qsgd4"]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_compressed_codec_under_jit_gives_the_bytes_of_allreduce_many(codec, params, dtype):
    comm = world()
    with (
        mpicomp.CompressedComm(comm, codec, **params, **OPTIONS) as cj,
        mpicomp.CompressedComm(comm, codec, **params, **OPTIONS) as cn,
    ):
        run = jax.jit(lambda t: allreduce_tree(cj, t))
        for step in range(2):  # the second step reads the first one's residuals (threelc)
            tree = _tree(comm.rank, step, dtype)
            out = run(tree)
            # Leaves in tree order (keys sorted), named by their paths.
            expected = cn.allreduce_many([np.asarray(tree[k]) for k in "bw"], ["['b']", "['w']"])
            for k, want in zip("bw", expected, strict=True):
                got = np.asarray(out[k])
                assert got.dtype == want.dtype == np.asarray(tree[k]).dtype
                assert got.shape == want.shape and got.tobytes() == want.tobytes()


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_int_leaf_on_one_rank_raises_on_every_rank_and_the_next_call_works(jit):
    comm = world()
    culprit = comm.size - 1
    tree = _tree(comm.rank)
    if comm.rank == culprit:
        tree["b"] = jnp.arange(10)
    with mpicomp.CompressedComm(comm, "threelc", **OPTIONS) as cc:
        run = jax.jit(lambda t: allreduce_tree(cc, t)) if jit else (lambda t: allreduce_tree(cc, t))
        if comm.rank == culprit:
            error, message = TypeError, r"gradient \"\['b'\]\" must be a floating-point array"
        else:
            error, message = mpicomp.RankError, f"rank {culprit} failed in the same call"
        if jit:  # JAX re-raises a callback's error as JaxRuntimeError, its message kept
            message = f"{error.__name__}: {message}"
            error = jax.errors.JaxRuntimeError
        with pytest.raises(error, match=message):
            jax.block_until_ready(run(tree))
        tree = _tree(comm.rank, step=1)
        out = run(tree)
        expected = {k: np.mean(comm.allgather(np.asarray(v)), axis=0) for k, v in tree.items()}
        np.testing.assert_allclose(out["b"], expected["b"], rtol=1e-6, atol=1e-9)
        assert out["w"].shape == (9, 13)
