"""JAX arrays through CompressedComm on one rank: jax.Arrays in and out, the same bytes as
the NumPy path, and mpicomp.jax.allreduce_tree inside and outside jax.jit."""

import subprocess
import sys

import numpy as np
import pytest

import mpicomp
from conftest import gradient_like

jax = pytest.importorskip("jax", reason="JAX is optional: pip install jax")
jnp = jax.numpy

from mpicomp.jax import allreduce_tree  # noqa: E402

CODECS = [
    ("none", {}),
    ("qsgd_maxnorm", {"bits": 4}),
    ("topk", {}),
    ("threelc", {}),
]
DTYPES = ["float32", "float16", "bfloat16"]


def _comm(name, **options):
    from mpi4py import MPI

    params = dict(CODECS)[name]
    return mpicomp.CompressedComm(MPI.COMM_SELF, name, **params, **options)


def _same_bytes(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("codec", [name for name, _ in CODECS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_gives_a_jax_array_with_the_numpy_paths_bytes(codec, dtype):
    x = jnp.asarray(gradient_like(12 * 25, seed=3).reshape(12, 25), dtype=dtype)
    host = np.asarray(x).copy()
    with _comm(codec, min_numel=0) as cj, _comm(codec, min_numel=0) as cn:
        for _ in range(2):  # the second step reads the first one's residuals
            y = cj.allreduce(x, name="w")
            expected = cn.allreduce(host, name="w")
            assert isinstance(y, jax.Array)
            assert y.sharding == x.sharding
            _same_bytes(y, expected)


def _tree(seed=0):
    return {
        "w": jnp.asarray(gradient_like(20 * 30, seed=seed).reshape(20, 30)),
        "b": [
            jnp.asarray(gradient_like(7, seed=seed + 1), dtype=jnp.bfloat16),
            jnp.asarray(gradient_like(1, seed=seed + 2)[0], dtype=jnp.float16),
        ],
    }


def _numpy_reference(comm, tree):
    """What allreduce_tree must give: allreduce_many of the NumPy leaves, named by path."""
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    names = [jax.tree_util.keystr(path) for path, _ in paths]
    return comm.allreduce_many([np.asarray(leaf).copy() for _, leaf in paths], names)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("codec", ["threelc", "qsgd_maxnorm"])
def test_allreduce_tree_matches_allreduce_many(codec, jit):
    # bucket_numel=16: the two small leaves share a bucket below min_numel, w goes alone.
    options = {"min_numel": 64, "bucket_numel": 16}
    with _comm(codec, **options) as cj, _comm(codec, **options) as cn:

        def step(t1, t2):  # two calls in one function: ordered, in program order
            return allreduce_tree(cj, t1), allreduce_tree(cj, t2)

        run = jax.jit(step) if jit else step
        for seed in (0, 10):
            t1, t2 = _tree(seed), _tree(seed + 5)
            out1, out2 = run(t1, t2)
            for tree, out in ((t1, out1), (t2, out2)):
                assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
                leaves = jax.tree_util.tree_leaves(out)
                assert all(isinstance(leaf, jax.Array) for leaf in leaves)
                for got, want in zip(leaves, _numpy_reference(cn, tree), strict=True):
                    _same_bytes(got, want)
        if codec == "threelc":  # residuals keyed by the leaves' paths
            assert any("['w']" in key for key in cj.state_dict()["residuals"])


def test_allreduce_tree_takes_names_and_empty_trees():
    with _comm("topk", min_numel=0) as cc:
        out = allreduce_tree(cc, {"a": jnp.ones(64), "b": jnp.ones(8)}, names=["a", "b"])
        assert set(out) == {"a", "b"}
        assert set(cc.state_dict()["residuals"]) == {"bucket:a|b"}
        with pytest.raises(ValueError, match="1 names for 2 arrays"):
            allreduce_tree(cc, {"a": jnp.ones(64), "b": jnp.ones(8)}, names=["a"])
        assert allreduce_tree(cc, {}) == {}


def test_a_non_float_leaf_is_refused_by_its_path_and_the_next_call_works():
    tree = {"layer": {"count": jnp.arange(4), "w": jnp.ones(4)}}
    message = r"gradient \"\['layer'\]\['count'\]\" must be a floating-point array"
    with _comm("none") as cc:
        with pytest.raises(TypeError, match=message):
            allreduce_tree(cc, tree)
        run = jax.jit(lambda t: allreduce_tree(cc, t))
        # JAX re-raises a callback's error as JaxRuntimeError, its message kept.
        with pytest.raises(jax.errors.JaxRuntimeError, match=message):
            jax.block_until_ready(run(tree))
        tree["layer"]["count"] = jnp.arange(4.0)
        out = run(tree)
        np.testing.assert_array_equal(out["layer"]["count"], np.arange(4.0))


def test_importing_mpicomp_does_not_import_jax_and_mpicomp_jax_says_how_to_get_it():
    code = (
        "import sys, mpicomp, mpicomp.comm; assert 'jax' not in sys.modules\n"
        "sys.modules['jax'] = None\n"
        "try:\n    import mpicomp.jax\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "mpicomp.jax needs JAX: pip install jax"
