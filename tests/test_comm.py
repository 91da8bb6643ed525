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
