"""The rows of a reduce-scatter (mpicomp.reduction.rows): FSDP's layout, the grouping of
codes into byte-aligned chunks, the bfloat16 rounding of the allgather, and both calls
on one rank."""

import numpy as np
import pytest

import mpicomp
from conftest import gradient_like
from mpicomp.reduction.rows import Rows, from_bfloat16, grouped, to_bfloat16


@pytest.mark.parametrize("n, size", [(0, 1), (1, 3), (5, 4), (10, 5), (1003, 4), (8, 8)])
def test_rows_are_fsdps_equal_padded_rows(n, size):
    rows = [Rows(n, size, r) for r in range(size)]
    width = -(-n // size)
    assert all(r.width == width for r in rows)
    spans = rows[0].spans()
    # Row r starts at r * width; rows tile [0, n) in order; only the last ones are short.
    assert [lo for lo, _ in spans] == [min(n, r * width) for r in range(size)]
    assert spans[-1][1] == n and all(spans[i][1] == spans[i + 1][0] for i in range(size - 1))
    x = np.arange(n, dtype=np.float32) + 1
    padded = rows[0].padded(np, x)
    assert padded.size == size * width and np.all(padded[n:] == 0)
    for r in rows:
        lo, hi = r.own
        row = r.fill(np, x[lo:hi])
        np.testing.assert_array_equal(row, padded[r.rank * width : (r.rank + 1) * width])


def test_grouped_codes_start_every_chunk_on_a_multiple_of_8():
    codes = np.arange(1, 12, dtype=np.int8)  # 11 codes in groups of 3, 0, 8
    laid, chunk = grouped(np, codes, [0, 3, 3, 11])
    assert chunk == 8 and laid.size == 24
    np.testing.assert_array_equal(laid[:8], [1, 2, 3, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(laid[8:16], 0)
    np.testing.assert_array_equal(laid[16:], codes[3:])


def test_bfloat16_rounding_is_torchs():
    torch = pytest.importorskip("torch")
    x = np.concatenate(
        [
            gradient_like(4099, seed=3),
            np.float32([0.0, -0.0, 1.0, 1 + 2**-8, 1 + 3 * 2**-8, 3.0e38, -1e-40]),
        ]
    )
    ours = to_bfloat16(np, x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(
        from_bfloat16(np, ours), torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    )


@pytest.mark.parametrize("codec", ["none", "fp16", "qsgd_maxnorm", "signsgd", "topk", "threelc"])
def test_on_one_rank_a_reduce_scatter_is_the_codecs_own_round_trip(codec):
    from mpi4py import MPI

    x = gradient_like(1003, seed=5)
    with mpicomp.CompressedComm(MPI.COMM_SELF, codec, min_numel=0) as comm:
        row = comm.reduce_scatter(x, name="w")
        assert row.shape == x.shape and row.dtype == np.float32
        if codec == "none":
            np.testing.assert_array_equal(row, x)
        gathered = comm.allgather(row, name="w", numel=1003)
        np.testing.assert_array_equal(gathered, row)


def test_a_codec_without_a_reduce_scatter_says_so():
    from mpi4py import MPI

    with mpicomp.CompressedComm(MPI.COMM_SELF, "powersgd") as comm:
        with pytest.raises(ValueError, match="powersgd.*no reduce-scatter"):
            comm.reduce_scatter(np.ones((4, 4), np.float32), name="w")
