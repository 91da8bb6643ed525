"""CompressedComm pieces that need no peers: options, bucketing."""

import pytest

import mpicomp
from mpicomp.comm import _buckets


@pytest.mark.parametrize(
    "sizes, limit, expected",
    [
        ([], 10, []),
        ([3, 3, 3], 10, [[0, 1, 2]]),
        ([3, 3, 5], 10, [[0, 1], [2]]),
        ([3, 20, 3, 3], 10, [[0], [1], [2, 3]]),
        ([10, 9, 1], 10, [[0], [1, 2]]),
        ([0, 0, 4], 4, [[0, 1], [2]]),
    ],
)
def test_buckets_group_consecutive_small_tensors(sizes, limit, expected):
    assert _buckets(sizes, limit) == expected


def test_options_are_checked():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="min_numel"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=-1)
    with pytest.raises(ValueError, match="error_feedback"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "qsgd_maxnorm", error_feedback=True)
    with pytest.raises(TypeError, match="codec parameters"):
        mpicomp.CompressedComm(MPI.COMM_SELF, mpicomp.codec("topk"), ratio=0.1)
    with pytest.raises(ValueError, match="unknown codec"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "zip")
    with pytest.raises(ValueError, match="sparsity"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "threelc", sparsity=3)


def test_reliability_options_are_checked(monkeypatch):
    from mpi4py import MPI

    with pytest.raises(ValueError, match="'skip'"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", nonfinite="skip")
    with pytest.raises(TypeError, match="nonfinite must be a str"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", nonfinite=None)
    with pytest.raises(TypeError, match="debug must be a bool"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", debug="yes")
    monkeypatch.setenv("MPICOMP_DEBUG", "0")
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none") as cc:
        assert not cc.debug
    monkeypatch.setenv("MPICOMP_DEBUG", "1")
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none") as cc:
        assert cc.debug
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", debug=False) as cc:
        assert not cc.debug


def test_float64_beyond_float32_is_refused_not_made_inf():
    import numpy as np

    from mpicomp._backend import as_gradient, to_float32

    x = np.array([1.0, -1e39, 2.0])
    with pytest.raises(ValueError, match="gradient 'w' holds float64 values beyond float32"):
        as_gradient(x, what="gradient 'w'")
    y, over = to_float32(x)
    assert over and np.isneginf(y[1]) and y[0] == 1.0
    y, over = to_float32(np.array([np.inf, np.nan, 3e38]))  # Inf stays Inf: not an overflow
    assert not over and np.isinf(y[0])
    strided = np.arange(10.0)[::3]
    y, over = to_float32(strided)
    assert y.flags.c_contiguous and y.dtype == np.float32 and not over
    np.testing.assert_array_equal(y, [0, 3, 6, 9])


@pytest.mark.parametrize("policy", ["raise", "skip_step", "zero"])
def test_one_rank_policies(policy):
    import numpy as np
    from mpi4py import MPI

    from mpicomp.comm import NonFiniteWarning

    x = np.array([1.0, np.nan, 3.0], np.float32)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "topk", ratio=1.0, nonfinite=policy) as cc:
        if policy == "raise":
            with pytest.raises(ValueError, match="gradient 'w' holds NaN or Inf"):
                cc.allreduce(x, name="w")
        elif policy == "skip_step":
            with pytest.warns(NonFiniteWarning, match=r"rank\(s\) 0: gradient 'w'"):
                np.testing.assert_array_equal(cc.allreduce(x, name="w"), [0, 0, 0])
        else:
            np.testing.assert_array_equal(cc.allreduce(x, name="w"), [1, 0, 3])
        assert cc.state_dict()["step"] == 1
