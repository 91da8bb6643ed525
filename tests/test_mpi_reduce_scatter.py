"""CompressedComm.reduce_scatter and allgather across real MPI ranks, against NumPy
references built from every rank's input: FSDP's rows (any size, any number of ranks),
every codec kind, error feedback per row, the agreement's errors on every rank."""

import warnings

import numpy as np
import pytest
from _qsgd_ref import ref_average

import mpicomp
from conftest import gather_all, gradient_like, world
from mpicomp.collectives.traffic import Traffic
from mpicomp.errors import NonFiniteWarning, RankError

SIZES = [1, 5, 1003]  # fewer elements than ranks, and sizes no rank count divides


def _rows(full, n, size):
    """Return ``full`` (n elements) as FSDP's rows: size x ceil(n/size), zero-padded."""
    width = -(-n // size)
    out = np.zeros(size * width, np.float32)
    out[:n] = full
    return out.reshape(size, width)


def _inputs(comm, n, seed=0):
    x = gradient_like(n, seed=seed + 17 * comm.rank)
    return x, gather_all(comm, x)


@pytest.mark.mpi
@pytest.mark.parametrize("codec", ["none", "fp16"])
@pytest.mark.parametrize("n", SIZES)
def test_a_float_wire_is_summed_in_float32_in_rank_order(codec, n):
    comm = world()
    x, every = _inputs(comm, n)
    wire = every.astype(np.float16 if codec == "fp16" else np.float32)
    total = wire[0].astype(np.float32)
    for w in wire[1:]:
        total += w
    with mpicomp.CompressedComm(comm, codec, min_numel=0) as c:
        row = c.reduce_scatter(x, name="w")
        summed = c.reduce_scatter(x, name="w", op="sum")
    ref = _rows(total, n, comm.size)[comm.rank]
    np.testing.assert_array_equal(summed, ref)
    np.testing.assert_array_equal(row, ref / np.float32(comm.size))


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["ring", "direct"])
@pytest.mark.parametrize("n", SIZES)
def test_qsgd_rows_are_the_numpy_reference_of_the_whole_average(schedule, n):
    comm = world()
    x, every = _inputs(comm, n, seed=3)
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", bits=4, schedule=schedule, min_numel=0) as c:
        row = c.reduce_scatter(x, name="w")
        block = c.codec.params["block"]
    whole = ref_average(every, 4, block, step=0)
    np.testing.assert_array_equal(row, _rows(whole, n, comm.size)[comm.rank])


@pytest.mark.mpi
@pytest.mark.parametrize(
    "codec, params",
    [
        ("qsgd_maxnorm_multiscale", {"bits": 4}),
        ("grandk_maxnorm", {"bits": 4, "k": 0.3}),
        ("signsgd", {}),
    ],
)
@pytest.mark.parametrize("schedule", ["ring", "direct"])
def test_a_bounded_codecs_rows_are_its_all_reduce_of_the_same_step(codec, params, schedule):
    """The first phase of the schedule, made public: the same bits as the all-reduce."""
    comm = world()
    n = 1003
    x, _ = _inputs(comm, n, seed=5)
    kw = dict(schedule=schedule, min_numel=0, **params)
    with (
        mpicomp.CompressedComm(comm, codec, **kw) as a,
        mpicomp.CompressedComm(comm, codec, **kw) as b,
    ):
        for _ in range(2):  # the second call draws at step 1
            row = a.reduce_scatter(x, name="w")
            full = b.allreduce(x, name="w")
    np.testing.assert_array_equal(row, _rows(full, n, comm.size)[comm.rank])


@pytest.mark.mpi
@pytest.mark.parametrize("n", SIZES)
def test_signsgd_rows_are_the_majority_of_every_ranks_vote(n):
    comm = world()
    x, every = _inputs(comm, n, seed=9)
    with mpicomp.CompressedComm(comm, "signsgd", min_numel=0) as c:
        row = c.reduce_scatter(x, name="w")
    counts = (every > 0).sum(axis=0)
    scale = np.mean([np.mean(np.abs(v.astype(np.float64))) for v in every])
    decided = 2 * counts != comm.size  # ties are drawn at random: not checked here
    want = np.where(2 * counts > comm.size, scale, -scale).astype(np.float32)
    got = np.zeros(n, np.float32)
    width = row.size
    lo = comm.rank * width
    hi = min(n, lo + width)
    mine = slice(lo, hi)
    got[mine] = row[: max(0, hi - lo)]
    np.testing.assert_allclose(got[mine][decided[mine]], want[mine][decided[mine]], rtol=1e-6)
    np.testing.assert_array_equal(row[max(0, hi - lo) :], 0)


@pytest.mark.mpi
@pytest.mark.parametrize("codec", ["topk", "threelc", "fft", "fastsgd"])
def test_a_gather_codecs_row_is_the_mean_of_every_ranks_decoded_row(codec):
    comm = world()
    n = 1003
    x, every = _inputs(comm, n, seed=11)
    with mpicomp.CompressedComm(comm, codec, min_numel=0) as c:
        row = c.reduce_scatter(x, name="w")
        plain = mpicomp.codec(codec)
    width = row.size
    lo, hi = min(n, comm.rank * width), min(n, (comm.rank + 1) * width)
    decoded = [plain.decode(plain.encode(v[lo:hi])).reshape(-1) for v in every]
    ref = np.zeros(width, np.float32)
    ref[: hi - lo] = np.sum(decoded, axis=0, dtype=np.float64) / comm.size
    np.testing.assert_allclose(row, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.mpi
def test_error_feedback_is_kept_per_row_and_through_a_checkpoint():
    comm = world()
    n = 1003
    x0, _ = _inputs(comm, n, seed=1)
    x1, _ = _inputs(comm, n, seed=2)
    with mpicomp.CompressedComm(comm, "threelc", min_numel=0) as a:
        a.reduce_scatter(x0, name="w")
        state = a.state_dict()
        second = a.reduce_scatter(x1, name="w")
    keys = sorted(state["residuals"])
    assert keys == sorted(f"w#shards#shard{s}" for s in range(comm.size))
    assert any(np.any(r != 0) for r in state["residuals"].values())
    with mpicomp.CompressedComm(comm, "threelc", min_numel=0) as b:
        b.load_state_dict(state)
        np.testing.assert_array_equal(b.reduce_scatter(x1, name="w"), second)
    with mpicomp.CompressedComm(comm, "threelc", min_numel=0) as fresh:
        # the same step, without the residuals
        fresh.load_state_dict({"step": state["step"], "residuals": {}, "server_residuals": {}})
        without = fresh.reduce_scatter(x1, name="w")
    # The residual moved the second call's row (on some rank, where it kept an error).
    differs = gather_all(comm, np.array([not np.array_equal(without, second)]))
    assert differs.any()


@pytest.mark.mpi
def test_the_direct_reduce_scatter_sends_one_bit_per_vote():
    """signSGD's direct schedule: each vote crosses once, 1 bit (rows padded to 8)."""
    comm = world()
    n = 1003
    x, _ = _inputs(comm, n)
    with mpicomp.CompressedComm(comm, "signsgd", schedule="direct", min_numel=0) as c:
        c.recorder = t = Traffic()
        c.reduce_scatter(x, name="w")
    width = -(-n // comm.size)
    chunk = 8 * -(-width // 8)
    sent, received = t.by_op().get("direct.alltoall", (0, 0))
    assert sent == received == (comm.size - 1) * chunk // 8
    assert "direct.allgather" not in t.by_op()


@pytest.mark.mpi
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_allgather_puts_every_rows_back_in_rank_order(precision):
    torch = pytest.importorskip("torch")
    comm = world()
    shard = gradient_like(7, seed=comm.rank)
    every = gather_all(comm, shard).reshape(-1)
    if precision == "bfloat16":
        every = torch.from_numpy(every).to(torch.bfloat16).float().numpy()
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm") as c:
        np.testing.assert_array_equal(c.allgather(shard, precision=precision), every)
        np.testing.assert_array_equal(
            c.allgather(torch.from_numpy(shard), numel=7 * comm.size - 3).numpy(),
            gather_all(comm, shard).reshape(-1)[:-3],
        )
        handle = c.iallgather(shard)
        np.testing.assert_array_equal(handle.wait(), gather_all(comm, shard).reshape(-1))


@pytest.mark.mpi
def test_started_reduce_scatters_give_the_blocking_rows():
    comm = world()
    xs = [_inputs(comm, n, seed=n)[0] for n in SIZES]
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=0) as a:
        handles = [a.ireduce_scatter(x, name=f"w{i}") for i, x in enumerate(xs)]
        started = [h.wait() for h in handles]
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=0) as b:
        blocking = [b.reduce_scatter(x, name=f"w{i}") for i, x in enumerate(xs)]
    for s, r in zip(started, blocking, strict=True):
        np.testing.assert_array_equal(s, r)


@pytest.mark.mpi
def test_a_torch_bfloat16_gradient_gives_a_bfloat16_row():
    torch = pytest.importorskip("torch")
    comm = world()
    x, every = _inputs(comm, 64)
    g = torch.from_numpy(x).to(torch.bfloat16)
    with mpicomp.CompressedComm(comm, "none") as c:
        row = c.reduce_scatter(g, name="w")
    assert row.dtype == torch.bfloat16 and row.shape == (-(-64 // comm.size),)
    exact = every.astype(np.float64)
    exact = torch.tensor(exact).to(torch.bfloat16).double().numpy().mean(axis=0)
    np.testing.assert_allclose(
        row.float().numpy(), _rows(exact, 64, comm.size)[comm.rank], rtol=1e-2, atol=1e-6
    )


# --- what every rank hears ---------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", ["none", "qsgd_maxnorm", "signsgd", "threelc"])
def test_ranks_with_other_sizes_raise_on_every_rank(codec):
    comm = world()
    n = 40 + (comm.rank == 1)
    with mpicomp.CompressedComm(comm, codec, min_numel=0) as c:
        with pytest.raises(RankError, match="size"):
            c.reduce_scatter(np.ones(n, np.float32), name="w")
        # and the next call still runs
        assert c.reduce_scatter(np.ones(40, np.float32), name="v").size == -(-40 // comm.size)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", ["none", "fp16", "qsgd_maxnorm", "topk"])
def test_nan_on_one_rank_raises_there_and_rankerror_elsewhere(codec):
    comm = world()
    x = np.ones(33, np.float32)
    if comm.rank == 1:
        x[7] = np.nan
    with mpicomp.CompressedComm(comm, codec, min_numel=0) as c:
        error = (ValueError,) if comm.rank == 1 else (RankError,)
        with pytest.raises(error, match="NaN"):
            c.reduce_scatter(x, name="w")


@pytest.mark.mpi(min_size=2)
def test_skip_step_returns_zero_rows_and_warns_on_every_rank():
    comm = world()
    x = np.ones(33, np.float32)
    if comm.rank == 0:
        x[0] = np.inf
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", nonfinite="skip_step", min_numel=0) as c:
        with pytest.warns(NonFiniteWarning, match="rank"):
            row = c.reduce_scatter(x, name="w")
    np.testing.assert_array_equal(row, np.zeros(-(-33 // comm.size), np.float32))


@pytest.mark.mpi(min_size=2)
def test_an_unknown_op_on_one_rank_raises_on_every_rank():
    comm = world()
    op = "max" if comm.rank == 0 else "mean"
    with mpicomp.CompressedComm(comm, "none") as c:
        error = ValueError if comm.rank == 0 else RankError
        with pytest.raises(error, match="op must be|failed"):
            c.reduce_scatter(np.ones(8, np.float32), name="w", op=op)


@pytest.mark.mpi(min_size=2)
def test_allgather_refuses_other_sizes_and_nan_on_every_rank():
    comm = world()
    with mpicomp.CompressedComm(comm, "none") as c:
        with pytest.raises(RankError, match="size"):
            c.allgather(np.ones(4 + (comm.rank == 0), np.float32))
        shard = np.ones(4, np.float32)
        if comm.rank == 1:
            shard[2] = np.nan
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            error = ValueError if comm.rank == 1 else RankError
            with pytest.raises(error, match="NaN"):
                c.allgather(shard, name="p")
        with pytest.raises(ValueError, match="numel"):
            c.allgather(shard * 0, numel=4 * comm.size + 1)


@pytest.mark.mpi
def test_calls_are_traced_with_their_op_and_bytes():
    comm = world()
    events = []
    x, _ = _inputs(comm, 1003)
    with mpicomp.CompressedComm(comm, "signsgd", on_call=events.append, min_numel=0) as c:
        row = c.reduce_scatter(x, name="w")
        for precision in ("float32", "bfloat16"):
            c.allgather(row, name="p", precision=precision)
    assert [(e["op"], e["name"]) for e in events] == [
        ("reduce_scatter", "w"),
        ("allgather", "p"),
        ("allgather", "p"),
    ]
    if comm.size > 1:
        assert events[0]["bytes_sent"] > 0
        # bfloat16 sends this rank's row in two bytes an element instead of four
        assert events[1]["bytes_sent"] - events[2]["bytes_sent"] == 2 * row.size


@pytest.mark.mpi(min_size=2)
def test_a_row_beyond_float32_raises_on_every_rank_not_only_on_its_owner():
    """QSGD's dequantization overflows in the last row's owner alone: every rank raises,
    as the all-reduce does."""
    comm = world()
    x = np.zeros(64, np.float32)
    x[-1] = 3e38
    with mpicomp.CompressedComm(comm, "qsgd_maxnorm", min_numel=0) as c:
        with pytest.raises(RankError, match="overflows float32"):
            c.allreduce(x, name="w")
        with pytest.raises(RankError, match="overflows float32"):
            c.reduce_scatter(x, name="w")
        assert np.all(np.isfinite(c.reduce_scatter(x / 1e6, name="w")))  # still in step


@pytest.mark.mpi(min_size=2)
def test_a_signsgd_sum_beyond_float32_raises_on_every_rank():
    comm = world()
    x = np.full(64, 3e38, np.float32)
    with mpicomp.CompressedComm(comm, "signsgd", min_numel=0) as c:
        assert np.all(np.isfinite(c.reduce_scatter(x, name="w")))  # the mean fits
        with pytest.raises(RankError, match="overflows float32"):
            c.reduce_scatter(x, name="w", op="sum")
