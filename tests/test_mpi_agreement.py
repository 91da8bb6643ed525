"""Ranks configured differently, or failing before a call, raise on every rank; none hangs.

One rank differs in the codec, in one codec parameter or in one option of CompressedComm:
every rank raises RankError naming what differs, when the CompressedComm is made (no
MPICOMP_DEBUG, no timeout: a hang fails through pytest-timeout). The same difference
met by a call (the configuration digest in every call's agreement) raises there, and
the next call of agreeing ranks works. Last, the mechanism itself (collectives/agreement.py):
a ballot reduced or gathered over the ranks reads the same on each, and ``settle`` raises
on every rank.
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpicomp
from conftest import world
from mpicomp.collectives.agreement import RANK, RANKS, SAME, SPAN, TOP, Form, ranks_text, settle
from mpicomp.errors import RankError

# One value for the odd rank out, per codec parameter (every other rank: the default).
PARAMS = {
    "qsgd_maxnorm": {"bits": 4, "seed": 1},
    "qsgd_maxnorm_multiscale": {"bits": 6, "scales": (8, 16), "seed": 2},
    "grandk_maxnorm": {"bits": 4, "k": 100, "seed": 3},
    "grandk_maxnorm_multiscale": {"bits": 6, "scales": (10, 12), "k": 200, "seed": 4},
    "signsgd": {"tie": "positive", "seed": 5},
    "threelc": {"sparsity": 1.5, "zero_run": False},
    "fft": {"theta": 0.5, "bits": 8, "fp16": False},
    "fastsgd": {"base": 1.5, "tau": 64, "flag_bits": 3, "bucket": 4096},
    "topk": {"ratio": 0.1},
}

# One value for the odd rank out, per option: (codec, option, value).
OPTION_CASES = [
    ("qsgd_maxnorm", "min_numel", 10),
    ("qsgd_maxnorm", "bucket_numel", 4096),
    ("threelc", "error_feedback", False),
    ("threelc", "sharded", True),
    ("qsgd_maxnorm", "schedule", "direct"),
    ("qsgd_maxnorm", "schedule", "float32"),
    ("signsgd", "schedule", "direct"),
    ("qsgd_maxnorm", "nonfinite", "zero"),
    ("qsgd_maxnorm", "debug", True),
    ("qsgd_maxnorm", "timeout", 600),
    ("qsgd_maxnorm", "on_call", print),
]
DIFFERING = [(c, p, v) for c, params in PARAMS.items() for p, v in params.items()] + OPTION_CASES
CODECS = ["none", "fp16", "qsgd_maxnorm", "signsgd", "threelc", "fft", "topk", "fastsgd"]


def _odd_one(comm) -> bool:
    return comm.rank == comm.size - 1


def _named(codec, keyword) -> str:
    """What the error names: a codec parameter as ``codec.NAME``, an option as the field of
    the configuration that carries it."""
    if keyword in PARAMS.get(codec, {}):
        return rf"codec\.{keyword}: .* on rank"
    field = {"on_call": "traced"}.get(keyword, keyword)
    return rf"configured this CompressedComm differently: (.*; )?{field}: "


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("codec", "keyword", "value"), DIFFERING)
def test_a_codec_parameter_or_option_differing_on_one_rank_raises_everywhere(codec, keyword, value):
    comm = world()
    kwargs = {keyword: value} if _odd_one(comm) else {}
    with pytest.raises(RankError, match=_named(codec, keyword)):
        mpicomp.CompressedComm(comm, codec, **kwargs)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("other", ["qsgd_maxnorm", "signsgd", "threelc", "fp16"])
def test_another_codec_on_one_rank_raises_everywhere(other):
    comm = world()
    codec = other if _odd_one(comm) else "none"
    with pytest.raises(RankError, match=rf'codec\.name: "none" on .*"{other}" on rank') as e:
        mpicomp.CompressedComm(comm, codec)
    assert "codec.seed" not in str(e.value)  # another codec's parameters go unsaid


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_rank_failing_to_make_its_communicator_fails_every_rank():
    comm = world()
    bits = 99 if _odd_one(comm) else 8
    if _odd_one(comm):
        with pytest.raises(ValueError, match=r"bits must be an integer in \[2, 16\]"):
            mpicomp.CompressedComm(comm, "qsgd_maxnorm", bits=bits)
    else:
        with pytest.raises(RankError, match=rf"rank {comm.size - 1} failed making"):
            mpicomp.CompressedComm(comm, "qsgd_maxnorm", bits=bits)
    # Nothing was left half made: the next one works on every rank.
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=0) as cc:
        assert cc.allreduce(np.ones(64, np.float32), name="w").shape == (64,)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", CODECS)
def test_a_call_whose_configuration_differs_raises_everywhere_then_calls_go_on(codec):
    """The digest in every call's agreement, past the check made with the communicator
    (one rank's configuration changed behind its back)."""
    comm = world()
    x = np.full(2048, comm.rank + 1, np.float32)
    with mpicomp.CompressedComm(comm, codec, min_numel=0) as cc:
        before = cc.allreduce(x, name="w")
        planner = cc._planner  # what a call agrees on comes with its plan
        agreed = planner._config
        if _odd_one(comm):
            planner._config, planner._plans = agreed.with_fields(min_numel=7), {}
        with pytest.raises(RankError, match=r"min_numel: 0 on .*, 7 on rank"):
            cc.allreduce(x, name="w")
        planner._config, planner._plans = agreed, {}
        after = cc.allreduce(x, name="w")
        if codec in ("none", "fp16"):
            np.testing.assert_array_equal(after, before)
        assert np.isfinite(after).all()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (None, TypeError, "name must be a str"),
        (3, TypeError, "name must be a str"),
    ],
)
def test_a_bad_name_on_one_rank_raises_everywhere(bad, error, match):
    comm = world()
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=0) as cc:
        name = bad if _odd_one(comm) else "w"
        if _odd_one(comm):
            with pytest.raises(error, match=match):
                cc.allreduce(np.ones(64, np.float32), name=name)
        else:
            with pytest.raises(RankError, match=rf"rank {comm.size - 1} failed in the same call"):
                cc.allreduce(np.ones(64, np.float32), name=name)
        assert cc.allreduce(np.ones(64, np.float32), name="w").shape == (64,)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_tensors_of_other_names_are_named_with_their_ranks():
    comm = world()
    with mpicomp.CompressedComm(comm, "none") as cc:
        name = "fc.bias" if _odd_one(comm) else "fc.weight"
        match = r'disagree on the tensor \(names.*"fc.weight" on .*"fc.bias" on rank'
        with pytest.raises(RankError, match=match) as e:
            cc.allreduce(np.ones(8, np.float32), name=name)
        assert "bucket:" not in str(e.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"trace_level": 2, "trace_flush_every": 2}, "trace_level"),
        ({"trace": None, "on_call": print}, "trace_file"),
        ({"local_comm": "self"}, "local_comm"),
    ],
)
def test_how_one_rank_traces_or_finds_its_host_is_compared_too(tmp_path_factory, options, field):
    comm = world()
    path = str(comm.bcast(tmp_path_factory.mktemp("t") if comm.rank == 0 else None) / "t.h5")
    base = {"trace": path, "trace_flush_every": 2} if field != "local_comm" else {}
    if _odd_one(comm):
        base.update(options)
        if base.get("local_comm") == "self":
            base["local_comm"] = MPI.COMM_SELF
    with pytest.raises(RankError, match=rf"differently: (.*; )?{field}: "):
        mpicomp.CompressedComm(comm, "qsgd_maxnorm", **base)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", [{"on_call": "print"}, {"local_comm": 3}, {"env": "abc"}])
def test_arguments_refused_after_the_options_still_reach_every_rank(bad, monkeypatch):
    comm = world()
    options = {}
    if _odd_one(comm):
        if "env" in bad:
            monkeypatch.setenv("MPICOMP_TIMEOUT", bad["env"])
        else:
            options = bad
    if _odd_one(comm):
        with pytest.raises((TypeError, ValueError), match="on_call|local_comm|MPICOMP_TIMEOUT"):
            mpicomp.CompressedComm(comm, "none", **options)
    else:
        with pytest.raises(RankError, match=rf"rank {comm.size - 1} failed making .*: \w+Error"):
            mpicomp.CompressedComm(comm, "none", **options)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_sizes_either_side_of_min_numel_are_named_as_sizes():
    comm = world()
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=1500) as cc:
        x = np.ones(2000 if _odd_one(comm) else 1000, np.float32)
        with pytest.raises(RankError, match=r"disagree on the tensor size .*numel: 1000 on"):
            cc.allreduce(x, name="w")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_another_codec_leaves_its_parameters_unsaid_and_equal_numbers_agree():
    comm = world()
    codec = "topk" if _odd_one(comm) else "qsgd_maxnorm"
    with pytest.raises(RankError) as e:
        mpicomp.CompressedComm(comm, codec)
    message = str(e.value)
    assert f'"topk" on rank {comm.size - 1}' in message
    assert 'codec.name: "qsgd_maxnorm" on rank' in message
    assert "codec.bits" not in message and "codec.ratio" not in message
    ratio = 1 if _odd_one(comm) else 1.0  # the same value, written two ways
    mpicomp.CompressedComm(comm, "topk", ratio=ratio).close()


# -- a rank that closes while the others call ---------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("codec", ["qsgd_maxnorm", "topk", "none"])
def test_a_rank_closing_while_the_others_call_closes_it_on_every_rank(codec, debug):
    """close() takes part in the agreement every call begins with: the ranks still
    calling raise PeerClosed (a RankError) naming the rank, and are closed too; none hangs."""
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    closer = comm.size - 1
    x = np.full(3000, comm.rank + 1.0, np.float32)
    cc = mpicomp.CompressedComm(comm, codec, min_numel=1, debug=debug)
    assert cc.allreduce(x, name="w").shape == x.shape  # a call that works first
    if comm.rank == closer:
        cc.close()
        with pytest.raises(RuntimeError, match="is closed"):
            cc.allreduce(x, name="w")
    else:
        with pytest.raises(mpicomp.PeerClosed, match=f"rank {closer} closed this CompressedComm"):
            cc.allreduce(x, name="w")
        with pytest.raises(RuntimeError, match=f"is closed: rank {closer} closed"):
            cc.allreduce(x, name="w")
        cc.close()  # safe: nothing left to agree on
    with mpicomp.CompressedComm(comm, codec, min_numel=1) as again:  # every rank in step
        assert again.allreduce(x, name="w").shape == x.shape


@pytest.mark.mpi
def test_started_calls_meeting_a_close_raise_peer_closed():
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    x = np.ones(2000, np.float32)
    cc = mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=1)
    if comm.rank == 0:
        cc.close()
    else:
        handles = [cc.iallreduce(x, name=f"w{i}") for i in range(3)]
        for h in handles:  # the first met the close; the later ones send nothing
            with pytest.raises(mpicomp.PeerClosed, match="rank 0 closed"):
                h.wait()
        cc.close()


@pytest.mark.mpi
def test_a_refused_input_meeting_a_close_raises_peer_closed_from_it():
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    cc = mpicomp.CompressedComm(comm, "topk", min_numel=1)
    if comm.rank == 0:
        cc.close()
    else:
        with pytest.raises(mpicomp.PeerClosed) as e:
            cc.allreduce(np.ones(100, np.float32), name=None)
        assert isinstance(e.value.__cause__, TypeError)
        cc.close()


# -- the mechanism itself (mpicomp.collectives.agreement) across ranks --------------------

BALLOT = Form(n=SAME, codes=SPAN, norm=TOP, failed=RANK, bad=RANKS)


@pytest.mark.mpi
def test_a_ballot_reduced_by_max_reads_the_same_on_every_rank():
    comm = world()
    last = comm.size - 1
    n = 13 if comm.rank == last and last > 0 else 10
    vec = BALLOT.reduced(
        comm.rank,
        comm.size,
        n=n,
        codes=(-comm.rank, comm.rank),
        norm=comm.rank,
        failed=comm.rank % 2 == 0,
        bad=comm.rank >= comm.size // 2,
    )
    comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.MAX)
    tally = BALLOT.tally(vec, comm.size)
    assert tally.agrees("n") == (comm.size == 1)
    assert tally.span("n") == ((10, 10) if comm.size == 1 else (10, 13))
    assert tally.span("codes") == (-last, last)
    assert tally.top("norm") == last
    assert tally.ranks("failed") == [last - last % 2]  # the highest even rank
    low = comm.size // 2
    assert tally.ranks("bad") == ([low] if low == last else [low, last])
    every = comm.allgather((tally.span("n"), tally.ranks("bad")))
    assert all(seen == every[0] for seen in every)


@pytest.mark.mpi
def test_gathered_rows_name_every_rank_at_fault():
    comm = world()
    form = Form(failed=RANK, config=SAME)
    failing = comm.rank % 2 == 1
    row = form.gathered(failed=failing, config=None if failing else 42)
    table = np.empty((comm.size, row.size), np.int64)
    comm.Allgather(row, table)
    tally = form.tally_rows(table)
    assert tally.ranks("failed") == list(range(1, comm.size, 2))
    assert tally.agrees("config") and tally.span("config") == (42, 42)


@pytest.mark.mpi
def test_settle_raises_on_every_rank_and_leaves_nothing_in_flight():
    comm = world()
    last = comm.size - 1
    mine = TypeError("bits must be an int") if comm.rank == last else None
    vec = BALLOT.reduced(comm.rank, comm.size, failed=mine is not None)
    comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.MAX)
    failed = BALLOT.tally(vec, comm.size).ranks("failed")
    with pytest.raises((TypeError, RankError)) as info:
        settle(failed, mine, lambda r: RankError(f"{ranks_text(r)} failed"))
    if comm.rank == last:
        assert info.value is mine
    else:
        assert str(info.value) == f"rank {last} failed"
    assert comm.allreduce(1) == comm.size  # every rank is in step after it
