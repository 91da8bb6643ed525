"""The agreement on one rank: collectives/agreement.py's ballots (a ``Form``'s layout,
its reading after MAX over stand-in ranks, gathered rows), ``settle``, the naming of
ranks and fields; mpicomp/reduction/agreement.py's per-call agreement on a
communicator of one (several ranks: tests/test_mpi_agreement.py)."""

import numpy as np
import pytest
from mpi4py import MPI

from mpicomp.collectives.agreement import (
    RANK,
    RANKS,
    SAME,
    SPAN,
    TOP,
    Form,
    allgather_json,
    canonical,
    disagreement,
    ranks_text,
    settle,
    world_ranks,
)
from mpicomp.errors import RankError
from mpicomp.reduction.agreement import Call, agree, agree_close, fail, flagged

FORM = Form(n=SAME, codes=SPAN, norm=TOP, failed=RANK, bad=RANKS)
LEAST = int(np.iinfo(np.int64).min)


def _reduced(form: Form, entries: list[dict], dtype=np.int64):
    """Return the tally of one ballot per stand-in rank, reduced by MAX as MPI would."""
    size = len(entries)
    ballots = [form.reduced(rank, size, dtype, **e) for rank, e in enumerate(entries)]
    return form.tally(np.max(ballots, axis=0), size)


def test_a_ballot_travels_as_its_fields_in_order():
    assert FORM.size == 8
    ballot = FORM.reduced(2, 5, n=10, codes=(-3, 7), norm=4, failed=True, bad=True)
    assert ballot.tolist() == [10, -10, 7, 3, 4, 3, 3, 3]
    assert ballot.dtype == np.int64


def test_what_a_rank_leaves_out_is_the_identity_of_max():
    assert FORM.reduced(0, 4).tolist() == [LEAST, LEAST, LEAST, LEAST, LEAST, 0, 0, 0]
    floats = Form(value=TOP, n=SAME).reduced(0, 2, np.float64)
    assert floats.tolist() == [-np.inf, -np.inf, -np.inf]


def test_equal_values_agree_and_different_ones_give_their_range():
    tally = _reduced(FORM, [{"n": 10}, {"n": 10}, {"n": 10}])
    assert tally.agrees("n") and tally.span("n") == (10, 10)
    tally = _reduced(FORM, [{"n": 10}, {"n": 13}, {"n": 7}])
    assert not tally.agrees("n")
    assert tally.span("n") == (7, 13)


def test_a_span_covers_every_rank_and_top_is_the_largest():
    tally = _reduced(FORM, [{"codes": (0, 5), "norm": 2}, {"codes": (-4, 1), "norm": 9}])
    assert tally.span("codes") == (-4, 5)
    assert tally.top("norm") == 9


def test_a_rank_with_nothing_to_compare_does_not_disturb_the_others():
    tally = _reduced(FORM, [{"n": 10}, {}, {"n": 10}])
    assert tally.agrees("n") and tally.span("n") == (10, 10)
    nobody = _reduced(FORM, [{}, {}])
    assert nobody.agrees("n") and nobody.span("n") == (None, None)


def test_rank_names_the_highest_and_ranks_the_lowest_and_highest():
    raised = [{"failed": r in (1, 3), "bad": r in (1, 2, 3)} for r in range(5)]
    tally = _reduced(FORM, raised)
    assert tally.ranks("failed") == [3]
    assert tally.ranks("bad") == [1, 3]
    one = _reduced(FORM, [{"bad": r == 2} for r in range(4)])
    assert one.ranks("bad") == [2]
    assert one.ranks("failed") == []


def test_float_ballots_carry_52_bit_digests_exactly():
    form = Form(value=TOP, config=SAME, failed=RANK)
    digest = 2**52 - 1
    tally = _reduced(
        form, [{"value": 1.5, "config": digest}, {"value": 0.5, "config": digest}], np.float64
    )
    assert tally.agrees("config") and tally.span("config") == (digest, digest)
    assert tally.top("value") == 1.5
    tally = _reduced(form, [{"config": digest}, {"config": digest - 1}], np.float64)
    assert not tally.agrees("config")


def test_a_ballot_may_lead_a_longer_message():
    head = np.concatenate([FORM.reduced(0, 1, n=3), np.arange(5, dtype=np.int64)])
    assert FORM.tally(head, 1).span("n") == (3, 3)


def test_gathered_rows_name_every_rank_and_skip_absent_values():
    form = Form(failed=RANK, config=SAME)
    rows = [
        form.gathered(failed=False, config=7),
        form.gathered(failed=True),
        form.gathered(failed=True),
        form.gathered(failed=False, config=7),
    ]
    assert rows[1].tolist() == [1, LEAST]
    tally = form.tally_rows(np.concatenate(rows))
    assert tally.ranks("failed") == [1, 2]
    assert tally.agrees("config") and tally.span("config") == (7, 7)
    other = form.tally_rows(np.concatenate([rows[0], form.gathered(config=8)]))
    assert not other.agrees("config") and other.span("config") == (7, 8)


def test_unsigned_rows_leave_a_rank_out_with_0():
    form = Form(call=SAME)
    rows = np.concatenate([form.gathered(np.uint64, call=2**63 + 1), form.gathered(np.uint64)])
    assert rows.tolist() == [2**63 + 1, 0]
    assert form.tally_rows(rows).agrees("call")


def test_a_form_refuses_unknown_fields_and_kinds():
    with pytest.raises(TypeError, match="no field size in this form"):
        FORM.reduced(0, 1, size=3)
    with pytest.raises(TypeError, match="no field size"):
        FORM.gathered(size=3)
    with pytest.raises(ValueError, match="unknown field kinds {'n': 'equal'}"):
        Form(n="equal")
    with pytest.raises(TypeError, match="codes: a SPAN travels only in a reduced ballot"):
        FORM.gathered(n=1)


def test_settle_raises_nothing_when_no_rank_failed():
    settle([], ValueError("unused"), lambda ranks: RankError(f"{ranks}"))


def test_settle_raises_the_own_error_at_fault_and_the_callers_elsewhere():
    mine = TypeError("bits must be an int")
    with pytest.raises(TypeError) as at_fault:
        settle([1], mine, lambda ranks: RankError(f"{ranks_text(ranks)} failed"))
    assert at_fault.value is mine
    with pytest.raises(RankError, match="^rank 1 failed$"):
        settle([1], None, lambda ranks: RankError(f"{ranks_text(ranks)} failed"))


def test_settle_without_own_raises_the_same_type_everywhere_from_the_cause():
    mine = TypeError("not a 1-D uint8 array")
    with pytest.raises(ValueError, match="ranks 0, 2 passed") as info:
        settle([0, 2], mine, lambda r: ValueError(f"ranks {r[0]}, {r[1]} passed"), own=False)
    assert info.value.__cause__ is mine
    with pytest.raises(ValueError) as info:
        settle([0, 2], None, lambda r: ValueError("passed"), own=False)
    assert info.value.__cause__ is None


@pytest.mark.parametrize(
    "ranks, text",
    [
        ([3], "rank 3"),
        ([0, 1, 2], "ranks 0-2"),
        ([0, 1, 2, 5], "ranks 0-2, 5"),
        ([1, 3], "ranks 1, 3"),
    ],
)
def test_ranks_are_named_in_runs(ranks, text):
    assert ranks_text(ranks) == text


def test_the_world_and_its_duplicates_need_no_translation():
    assert world_ranks(MPI.COMM_WORLD) == ""
    dup = MPI.COMM_WORLD.Dup()
    try:
        assert world_ranks(dup) == ""
    finally:
        dup.Free()
    assert world_ranks(object()) == ""  # a stand-in communicator: nothing to translate


def test_values_that_mean_the_same_are_written_the_same():
    a = canonical({"codec": {"name": "topk", "ratio": 1}, "scales": (2, 8)})
    b = canonical({"scales": [2, 8], "codec": {"ratio": np.float64(1.0), "name": "topk"}})
    assert a == b == b'{"codec": {"name": "topk", "ratio": 1}, "scales": [2, 8]}'
    assert canonical({"ratio": 0.5}) != canonical({"ratio": 1})


def test_one_rank_gathers_its_own_json_and_finds_no_field_that_differs():
    assert allgather_json(MPI.COMM_SELF, {"a": [1, 2]}, None) == [{"a": [1, 2]}]
    assert allgather_json(MPI.COMM_SELF, None, None) == [None]
    assert disagreement(MPI.COMM_SELF, {"codec": {"bits": 4}}, None) == "the configurations differ"


# --- the per-call agreement (mpicomp.reduction.agreement) on one rank -------------------


def test_a_call_agrees_with_itself_and_returns_the_largest_value():
    call = Call(MPI.COMM_SELF, description={"names": ["w"]})
    assert agree(call, 100, None, value=2.5) == 2.5


def test_a_call_that_failed_here_raises_its_own_error():
    mine = ValueError("x must be 1-D")
    with pytest.raises(ValueError) as info:
        fail(Call(MPI.COMM_SELF), mine)
    assert info.value is mine


def test_a_rank_closing_alone_closes_together():
    assert agree_close(Call(MPI.COMM_SELF)) is True


def test_the_flag_of_one_rank_names_it():
    assert flagged(Call(MPI.COMM_SELF), True) == [0]
    assert flagged(Call(MPI.COMM_SELF), False) == []
