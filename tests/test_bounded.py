"""collectives/bounded.py on one rank: the chunk layout the bounded schedules share, how
a bounded sum or majority travels (its plan), the checks of its arguments and their
agreement (several ranks: tests/test_mpi_ring.py and tests/test_mpi_direct.py)."""

import numpy as np
import pytest
from mpi4py import MPI

from mpicomp.collectives import bounded
from mpicomp.collectives.bounded import (
    Chunks,
    PackedSums,
    agree,
    bits_for,
    bounded_claim,
    chunk_size,
    decided,
    min_claim,
    plan,
    prepared,
    unpacked,
)
from mpicomp.kernels import backend
from mpicomp.kernels.bits import MAX_WIDTH


@pytest.mark.parametrize("top, bits", [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (255, 8), (256, 9)])
def test_bits_for_holds_every_integer_up_to_the_top(top, bits):
    assert bits_for(top) == bits


def test_chunks_are_a_multiple_of_the_alignment_and_cover_n(monkeypatch):
    assert chunk_size(1000, 4) == 256  # ceil(250 / 8) * 8
    assert chunk_size(3, 4) == 8
    layout = Chunks(1000, 4, 1, 256)
    assert [layout.span(c) for c in range(4)] == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert layout.span(-1) == layout.span(3)  # taken mod N
    assert layout.region(3, 3) == (288, 375)  # 256 * 3 bits on: 232 elements at 3 bits
    tiny = Chunks(3, 4, 0, chunk_size(3, 4))
    assert [tiny.span(c) for c in range(4)] == [(0, 3), (3, 3), (3, 3), (3, 3)]  # empty chunks
    monkeypatch.setattr(bounded, "CHUNK_ALIGN", 64)  # tests move the chunk edges so
    assert chunk_size(1000, 4) == 256 and chunk_size(1000, 3) == 384
    monkeypatch.setattr(bounded, "CHUNK_ALIGN", 12)
    with pytest.raises(ValueError, match="CHUNK_ALIGN must be a positive multiple of 8"):
        chunk_size(1000, 4)


def test_the_layout_of_a_communicator():
    layout = Chunks.of(MPI.COMM_SELF, 100)
    assert layout == Chunks(100, 1, 0, 104)
    assert Chunks.of(MPI.COMM_SELF, 100, chunk=10).chunk == 10


def test_a_plan_shifts_signed_codes_and_sizes_the_sum():
    p = plan(4, 3, False, True, np)  # codes in [-3, 3] over 4 ranks
    assert (p.majority, p.shift, p.span, p.final_width) == (False, 3, 6, 5)  # 24 needs 5 bits
    p = plan(4, 3, False, False, np)  # [0, 3]
    assert (p.shift, p.span, p.final_width) == (0, 3, 4)
    votes = plan(4, 1, True, False, np)
    assert votes.majority and votes.final_width == 1
    # The paper's rule: more than half of the ranks voted +1.
    bits = votes.decide(np.array([0, 2, 3, 4, 1, 3, 3, 3]), 0)
    assert np.unpackbits(bits, bitorder="little").tolist() == [0, 0, 1, 1, 0, 1, 1, 1]


def test_a_decision_of_the_wrong_size_is_named():
    p = plan(2, 1, lambda counts, offset: np.zeros(3, np.uint8), False, np)
    with pytest.raises(ValueError, match="f: decide returned 3 bytes for 8 elements, expected 1"):
        decided(p, np.zeros(8, np.int64), 0, np.empty(1, np.uint8), "f")


def test_unpacked_gives_sums_or_what_the_caller_unpacks():
    be = backend("numba")
    p = plan(1, 3, False, True, np)  # one rank: sums in [0, 6] shifted by 3, 3 bits
    stream = np.empty(2, np.uint8)
    be.bits.pack_shifted(np.array([-3, 0, 2, 3], np.int64), 3, 3, stream)
    assert unpacked(stream, 4, p, 1, False, be).tolist() == [-3, 0, 2, 3]
    assert unpacked(stream, 4, p, 1, True, be) == PackedSums(stream, 4, 3, 3)


@pytest.mark.parametrize(
    "args, error, words",
    [
        (([1, 2], 0, False, True, False), ValueError, "bound must be >= 1, got 0"),
        (([1, 2], 1.5, False, True, False), TypeError, "bound must be an integer"),
        (([1.0, 2.0], 2, False, True, False), TypeError, "codes must have an integer dtype"),
        ((np.ones((2, 2), int), 2, False, True, False), ValueError, "codes must be 1-D"),
        (([1, 0], 1, True, True, False), ValueError, "majority needs unsigned votes"),
        (([1, 0], 1, True, False, True), ValueError, "packed=True returns sums"),
        (([1, 0], 1, "yes", False, False), TypeError, "majority must be a bool or a callable"),
        (([1], 2**40, False, True, False), ValueError, f"more than {MAX_WIDTH}"),
    ],
)
def test_bad_arguments_are_named(args, error, words):
    claim = bounded_claim(*args, 4, "f")
    assert isinstance(claim.err, error) and words in str(claim.err), claim.err
    with pytest.raises(error, match="f: "):
        agree(MPI.COMM_SELF, "f", claim)  # raised after taking part


def test_codes_outside_the_bound_are_refused_at_the_agreement():
    claim = bounded_claim(np.array([-2, 0, 5]), 3, False, True, False, 1, "f")
    assert claim.err is None and (claim.lo, claim.hi) == (-2, 5)
    with pytest.raises(ValueError, match=r"codes lie in \[-2, 5\] across ranks \(rank 0 among"):
        agree(MPI.COMM_SELF, "f", claim)
    codes, bound = agree(MPI.COMM_SELF, "f", bounded_claim([-3, 3], 3, False, True, False, 1, "f"))
    assert codes.tolist() == [-3, 3] and bound == 3


def test_a_minimums_width_is_checked():
    assert min_claim([0, 7], 3, "m").err is None
    assert "width must lie in [1, " in str(min_claim([0, 7], 0, "m").err)
    with pytest.raises(ValueError, match=r"codes lie in \[0, 9\]"):
        agree(MPI.COMM_SELF, "m", min_claim([0, 9], 3, "m"))


def test_prepared_checks_unless_told_the_ranks_agreed():
    codes, p, be = prepared(MPI.COMM_SELF, [1, -1], 1, False, True, False, None, True, None, "f")
    assert codes.dtype.kind == "i" and p.shift == 1 and be.xp is np
    with pytest.raises(ValueError, match="codes lie in"):
        prepared(MPI.COMM_SELF, np.array([5]), 1, False, True, False, None, True, None, "f")
    unchecked = np.array([5])  # checked=False: the caller vouches for them
    assert (
        prepared(MPI.COMM_SELF, unchecked, 1, False, True, False, None, False, None, "f")[0]
        is unchecked
    )
