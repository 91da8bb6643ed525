"""One rank's mistake raises on every rank, in the call that made it, and changes no state.

Each case of docs/reliability.md's "Mistakes on one rank" table: one rank (the last,
so that no message passes by naming rank 0 alone) calls differently from the others.
Every rank must raise within seconds (``RankError`` where the ranks merely disagree;
the rank at fault its own ``TypeError``/``ValueError`` where it refused its input),
every rank's state (step, residuals, PowerSGD's factors) must be what it was before
the call, and the next call must equal, bit for bit, what a fresh ``CompressedComm``
loaded with that state gives. A randomized test then draws mistakes, codecs, ranks and
inputs.
"""

import os

import numpy as np
import pytest

import mpicomp
from conftest import gather_all, world
from mpicomp.errors import RankError

# Codecs of every kind of state: none (no state), QSGD (steps drive its draws), top-k
# and 3LC (residuals; 3LC sharded also owners'), PowerSGD (error and warm-start Q).
CODECS = {
    "none": ("none", {}),
    "qsgd": ("qsgd_maxnorm", {"bits": 4}),
    "topk": ("topk", {}),
    "threelc_sharded": ("threelc", {"sharded": True}),
    "powersgd": ("powersgd", {}),
}
BUCKET = 4000  # tensors below fuse into buckets of up to this many elements
# The call every case's state is made by, and compared with a fresh communicator's after.
SHAPES = {"a": (20, 50), "b": (50, 20), "c": (40, 100)}  # a, b fuse; c goes alone


def _inputs(seed: int, shapes=SHAPES) -> dict:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def _regular(cc, seed: int) -> list:
    xs = _inputs(seed + cc.rank)
    return cc.allreduce_many(list(xs.values()), names=list(xs))


def _make(spec, **more):
    codec, params = spec
    return mpicomp.CompressedComm(
        world(), codec, min_numel=0, bucket_numel=BUCKET, **params, **more
    )


# --- the mistakes: each makes one call, differently on the rank at fault --------------


def _fewer_tensors(cc, odd):
    xs = _inputs(7 + cc.rank, {"c": (40, 100), "d": (50, 90)})  # each alone in its bucket
    arrays = list(xs.values())[: 1 if odd else 2]
    return cc.allreduce_many(arrays, names=list(xs)[: len(arrays)])


def _empty_call(cc, odd):
    xs = _inputs(7 + cc.rank)
    return cc.allreduce_many([] if odd else list(xs.values()), names=[] if odd else list(xs))


def _other_order(cc, odd):
    xs = _inputs(7 + cc.rank)
    names = ["b", "a", "c"] if odd else ["a", "b", "c"]
    return cc.allreduce_many([xs[n] for n in names], names=names)


def _bucket_split_differently(cc, odd):
    # One bucket of 3000 on every rank, split 2000/1000 on some, 1000/2000 on one.
    sizes = (1000, 2000) if odd else (2000, 1000)
    xs = _inputs(7 + cc.rank, {"p": (sizes[0],), "q": (sizes[1],)})
    return cc.allreduce_many(list(xs.values()), names=list(xs))


def _many_against_concatenated(cc, odd):
    xs = _inputs(7 + cc.rank, {"p": (2000,), "q": (1000,)})
    if odd:
        return cc.allreduce(np.concatenate([xs["p"], xs["q"]]), name="p")
    return cc.allreduce_many(list(xs.values()), names=list(xs))


def _colliding_names(cc, odd):
    # zlib.crc32(b"plumless") == zlib.crc32(b"buckeroo"): a 32-bit digest let them pass.
    x = _inputs(7 + cc.rank, {"t": (3000,)})["t"]
    return cc.allreduce(x, name="buckeroo" if odd else "plumless")


def _other_size(cc, odd):
    x = _inputs(7 + cc.rank, {"t": (3000 + odd,)})["t"]
    return cc.allreduce(x, name="t")


def _first_call_of_other_size(cc, odd):
    # The first call of a name: a residual made for the wrong size must not stay behind.
    x = _inputs(7 + cc.rank, {"fresh": (2000 + 7 * odd,)})["fresh"]
    return cc.allreduce(x, name="fresh")


def _integers(cc, odd):
    x = _inputs(7 + cc.rank, {"t": (3000,)})["t"]
    return cc.allreduce(x.astype(np.int32) if odd else x, name="t")


def _duplicate_names(cc, odd):
    xs = _inputs(7 + cc.rank)
    names = ["a", "a", "c"] if odd else ["a", "b", "c"]
    return cc.allreduce_many(list(xs.values()), names=names)


def _nan_in_the_last_bucket(cc, odd):
    # Buckets a|b and c: c fails after a|b moved its residuals; a|b must roll back too.
    xs = _inputs(7 + cc.rank)
    if odd:
        xs["c"][3, 4] = np.nan
    return cc.allreduce_many(list(xs.values()), names=list(xs))


def _transposed(cc, odd):
    x = _inputs(7 + cc.rank, {"m": (100, 50)})["m"]
    return cc.allreduce(x.T.copy() if odd else x, name="m")


def _members_transposed(cc, odd):
    xs = _inputs(7 + cc.rank, {"m": (20, 50), "n": (30, 40)})
    if odd:
        xs = {n: x.T.copy() for n, x in xs.items()}
    return cc.allreduce_many(list(xs.values()), names=list(xs))


# name: (mistake, what the rank at fault raises: None where ranks merely disagree)
MISTAKES = {
    "fewer_tensors": (_fewer_tensors, None),
    "empty_call": (_empty_call, None),
    "other_order": (_other_order, None),
    "bucket_split_differently": (_bucket_split_differently, None),
    "many_against_concatenated": (_many_against_concatenated, None),
    "colliding_names": (_colliding_names, None),
    "other_size": (_other_size, None),
    "first_call_of_other_size": (_first_call_of_other_size, None),
    "integers": (_integers, TypeError),
    "duplicate_names": (_duplicate_names, ValueError),
    "nan_in_the_last_bucket": (_nan_in_the_last_bucket, ValueError),
}
# Shapes change the bytes of codecs that work on matrices only.
SHAPED = {"transposed": (_transposed, None), "members_transposed": (_members_transposed, None)}


def _cases():
    for codec in CODECS:
        for mistake in MISTAKES:
            yield codec, mistake
    for mistake in SHAPED:
        yield "powersgd", mistake


def _assert_same_state(before: dict, after: dict) -> None:
    assert after["step"] == before["step"]
    for part in ("residuals", "server_residuals"):
        assert sorted(after[part]) == sorted(before[part]), part
        for name in before[part]:
            np.testing.assert_array_equal(after[part][name], before[part][name], err_msg=name)


def check_mistake(spec, mistake, odd_rank: int, seed: int = 0, **options) -> str:
    """Make the call ``mistake`` on a communicator warmed by two regular calls, with
    rank ``odd_rank`` at fault; check what every rank raised, the state after, and the
    next call against a fresh communicator's. Return the class every rank at no fault
    raised."""
    comm = world()
    fn, at_fault = {**MISTAKES, **SHAPED}[mistake]
    odd = comm.rank == odd_rank
    with _make(spec, **options) as cc:
        _regular(cc, seed)
        _regular(cc, seed + 1)
        before = cc.state_dict()
        raised = None
        try:
            fn(cc, odd)
        except Exception as e:
            raised = e
        classes = comm.allgather(type(raised).__name__ if raised is not None else None)
        assert None not in classes, f"{mistake}: no error on ranks {classes}"
        expected = at_fault if odd and at_fault is not None else RankError
        assert isinstance(raised, expected), repr(raised)
        if at_fault is None:
            # Merely disagreeing: every rank says what differs, naming the rank at fault.
            assert f"rank {odd_rank}" in str(raised) or f"ranks {odd_rank}" in str(raised)
        _assert_same_state(before, cc.state_dict())
        after = _regular(cc, seed + 2)
    with _make(spec, **options) as fresh:
        fresh.load_state_dict(before)
        again = _regular(fresh, seed + 2)
    for x, y in zip(after, again, strict=True):
        np.testing.assert_array_equal(x, y)
    return classes[(odd_rank + 1) % comm.size]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("codec", "mistake"), list(_cases()))
def test_a_mistake_on_one_rank_raises_everywhere_and_changes_nothing(codec, mistake):
    comm = world()
    assert check_mistake(CODECS[codec], mistake, comm.size - 1) == "RankError"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_random_mistakes_on_random_ranks():
    # The same draws on every rank (one seed): a codec, a mistake, the rank at fault,
    # the inputs and the NaN/Inf policy. MPICOMP_FUZZ_SCALE=10 draws ten times as many.
    comm = world()
    draws = 12 * int(os.environ.get("MPICOMP_FUZZ_SCALE", "1"))
    rng = np.random.default_rng(34)
    cases = list(_cases())
    for _ in range(draws):
        codec, mistake = cases[rng.integers(len(cases))]
        odd_rank = int(rng.integers(comm.size))
        policy = (
            "raise"
            if mistake == "nan_in_the_last_bucket"
            else str(rng.choice(["raise", "skip_step", "zero"]))
        )
        check_mistake(CODECS[codec], mistake, odd_rank, int(rng.integers(1000)), nonfinite=policy)


@pytest.mark.mpi(min_size=2)
def test_ranks_at_other_steps_raise_naming_the_step():
    # A checkpoint of another step loaded on one rank: its draws would differ.
    comm = world()
    odd = comm.rank == comm.size - 1
    with _make(CODECS["qsgd"]) as cc:
        _regular(cc, 0)
        state = cc.state_dict()
        cc.load_state_dict({**state, "step": state["step"] + 5 * odd})
        with pytest.raises(RankError, match=rf"step: 2 on ranks? 0.*, 7 on rank {comm.size - 1}"):
            _regular(cc, 1)


@pytest.mark.mpi(min_size=2)
def test_a_sub_communicator_names_ranks_in_both_numberings():
    comm = world()
    sub = comm.Split(0, comm.size - 1 - comm.rank)  # the world's ranks in reverse order
    try:
        with mpicomp.CompressedComm(sub, "none") as cc:
            x = np.ones(10 + (sub.rank == 0), np.float32)
            with pytest.raises(RankError, match="in MPI.COMM_WORLD: 0->") as e:
                cc.allreduce(x, name="w")
            assert f"0->{comm.size - 1}" in str(e.value)
    finally:
        sub.Free()


@pytest.mark.mpi(min_size=2)
def test_the_timeout_is_read_once_when_made(monkeypatch):
    # MPICOMP_TIMEOUT set on one rank after the communicator was made changes nothing
    # there: every rank keeps making blocking calls, which nonblocking ones never match.
    comm = world()
    monkeypatch.delenv("MPICOMP_TIMEOUT", raising=False)
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm") as cc:
        if comm.rank == comm.size - 1:
            monkeypatch.setenv("MPICOMP_TIMEOUT", "30")
        y = cc.allreduce(np.full(2000, comm.rank, np.float32), name="w")
        assert cc.options.timeout == 0
    np.testing.assert_allclose(y, (comm.size - 1) / 2, atol=0.05 * comm.size)
    np.testing.assert_array_equal(gather_all(comm, y)[0], y)


# --- state after what fails on one rank alone, and rollbacks ------------------------------


@pytest.mark.mpi(min_size=2)
def test_a_local_failure_after_the_call_keeps_the_steps_in_step(monkeypatch):
    # Converting the result fails on one rank after every rank's call succeeded: only
    # that rank raises, and its step must stay counted (else every later call disagrees).
    from mpicomp.call import intake

    comm = world()
    odd = comm.rank == comm.size - 1
    result = intake.Tensor.result
    failures = []

    def fails_once(self, avg):
        if failures:
            raise failures.pop()
        return result(self, avg)

    monkeypatch.setattr(intake.Tensor, "result", fails_once)
    with _make(CODECS["topk"]) as cc:
        for many in (False, True):
            x = _inputs(cc.rank)["c"]
            failures += [MemoryError("converting the result")] if odd else []
            try:
                cc.allreduce_many([x], names=["c"]) if many else cc.allreduce(x, name="c")
            except MemoryError:
                assert odd
            steps = comm.allgather(cc.state_dict()["step"])
            assert len(set(steps)) == 1, steps
            _regular(cc, 3)  # the next call agrees


@pytest.mark.mpi(min_size=2)
def test_rollback_waits_for_started_calls():
    comm = world()
    with _make(CODECS["qsgd"], background=None) as cc:
        snapshots = []
        cc.start(_inputs(cc.rank)["c"], "c", snapshots=snapshots)
        later = cc.iallreduce(_inputs(cc.rank)["a"], name="a")  # still running, maybe
        cc.rollback(snapshots)
        later.wait()
        steps = comm.allgather(cc.state_dict()["step"])
        assert steps == [0] * comm.size
        _regular(cc, 1)


@pytest.mark.mpi(min_size=2)
def test_a_name_started_twice_in_one_step_rolls_back_to_before_the_first():
    comm = world()
    with _make(CODECS["topk"]) as cc:
        _regular(cc, 0)
        before = cc.state_dict()
        snapshots = []
        for seed in (1, 2):
            cc.start(_inputs(seed + comm.rank)["c"], "c", snapshots=snapshots).wait()
        cc.rollback(snapshots)
        _assert_same_state(before, cc.state_dict())


@pytest.mark.mpi(min_size=2)
def test_an_empty_call_meeting_a_close_closes_this_rank_too():
    comm = world()
    cc = _make(CODECS["none"])
    if comm.rank == 0:
        cc.close()
    else:
        with pytest.raises(mpicomp.PeerClosed):
            cc.allreduce_many([])
        assert cc.closed
        cc.close()
