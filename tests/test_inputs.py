"""What a newcomer passes by mistake gets a TypeError/ValueError naming the argument and
what is allowed (one process; tests/test_mpi_agreement.py has the same across ranks)."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpicomp
from mpicomp.call.intake import check_numel


@pytest.fixture
def cc():
    with mpicomp.CompressedComm(MPI.COMM_SELF, "qsgd_maxnorm", min_numel=0) as c:
        yield c


@pytest.mark.parametrize("comm", [None, "world", MPI.COMM_WORLD.py2f()])
def test_comm_must_be_an_intracommunicator(comm):
    with pytest.raises(TypeError, match=r"comm must be an mpi4py.MPI.Intracomm .* got"):
        mpicomp.CompressedComm(comm)


def test_a_misspelled_option_is_named_with_the_closest_one():
    with pytest.raises(
        TypeError,
        match=r"'min_numl' \(did you mean 'min_numel'\?\).*\(bits, block, per_tensor, seed\)",
    ):
        mpicomp.CompressedComm(MPI.COMM_SELF, "qsgd_maxnorm", min_numl=10)
    with pytest.raises(TypeError, match=r"'bitz' \(did you mean 'bits'\?\)"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "qsgd_maxnorm", bitz=4)
    with pytest.raises(TypeError, match=r"codec 'topk' takes no parameter 'bits'; .*: ratio"):
        mpicomp.codec("topk", bits=4)
    with pytest.raises(ValueError, match="unknown codec 'qsdg'"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "qsdg", bits=4)


@pytest.mark.parametrize("flag", ["sharded", "error_feedback"])
@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_flags_must_be_bools(flag, value):
    with pytest.raises(TypeError, match=rf"{flag} must be a bool.*got {value!r}"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "threelc", **{flag: value})


@pytest.mark.parametrize("name", [None, 3, b"w"])
def test_a_name_must_be_a_str(cc, name):
    with pytest.raises(TypeError, match=r"name must be a str \(the tensor's name\)"):
        cc.allreduce(np.ones(8, np.float32), name=name)
    assert cc.allreduce(np.ones(8, np.float32), name="w").shape == (8,)  # still usable


def test_allreduce_many_takes_a_sequence(cc):
    with pytest.raises(TypeError, match=r"arrays must be a list .* got ndarray \(for one array"):
        cc.allreduce_many(np.ones(4, np.float32))
    with pytest.raises(TypeError, match=r"got dict \(for a dict d: list\(d.values\(\)\)"):
        cc.allreduce_many({"w": np.ones(4, np.float32)})
    with pytest.raises(TypeError, match="arrays must be a list or tuple of gradients, got int"):
        cc.allreduce_many(3)
    with pytest.raises(TypeError, match="names must be a list or tuple of str, got str"):
        cc.allreduce_many([np.ones(4, np.float32)], names="w")
    out = cc.allreduce_many((np.ones(4, np.float32), np.ones(2, np.float32)))
    assert [o.shape for o in out] == [(4,), (2,)]


def test_complex_input_is_refused_with_its_imaginary_part_kept(cc):
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    for x in (z, z.conj(), z.numpy()):
        with pytest.raises(TypeError, match="must be a real floating-point array"):
            cc.allreduce(x, name="z")


def test_the_other_byte_order_is_converted():
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "fp16", min_numel=0) as cc:
        y = cc.allreduce(x.astype(">f4"), name="w")
        np.testing.assert_array_equal(y, cc.allreduce(x, name="w"))
        assert cc.allreduce(x.astype(">f8"), name="w").dtype == np.dtype(">f8")


def test_sizes_beyond_a_call_are_refused_before_anything_is_allocated(cc):
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (1 << 41,), (0,))
    with pytest.raises(ValueError, match=r"has 2199023255552 elements; one call carries at most"):
        cc.allreduce(huge, name="w")
    with pytest.raises(ValueError, match="has 12 elements; one call carries at most 10"):
        check_numel(np.empty((3, 4)), 10)
    check_numel(np.empty((2, 5)), 10)  # at the limit: fine
