"""Direct reduce-scatter of bounded integer codes: every code crosses the wire once.

The width-growing ring (``ring.py``) forwards partial sums, whose width grows with the
step: a partial over i ranks needs ceil(log2(2*i*bound + 1)) bits. Here each rank sends
chunk c of its own codes straight to the chunk's owner, rank c, at the width of one
code, w_1 = ceil(log2(2*bound + 1)) (1 bit for signSGD's votes); the owner sums the N
codes of its chunk in memory at full width (or counts the votes and decides the
majority), then the owners' chunks go around the ring's allgather at the width of the
full sum (1 bit for decisions). This is the compressed all-reduce of 1-bit Adam (Tang et
al. 2021) and CGX's scatter-reduce-allgather, for exact integer sums.

Per rank, with every chunk n/N elements, it sends and receives

    (N - 1) * n/N * (w_1 + w_f) / 8 bytes

against the ring's n/N * (w_1 + ... + w_{N-1} + (N - 1) * w_f) / 8: fewer from N = 3 on
(signSGD at N = 4: 1.5 bits per element against 2.0). The ring keeps what this gives up:
it talks to its two neighbours only (one slow link between two halves of a chain
carries one message per step; here (N/2)^2 messages cross it), and every message of a
step has one size.

The layout is the ring's (``bounded.Chunks``: chunks on multiples of
``bounded.CHUNK_ALIGN`` elements, chunk c owned by rank c) and so is the result, byte for
byte: the same packed stream of sums, the same decisions (``decide`` sees the same
counts and offset). Exchange, step k = 1..N-1: rank r sends its codes of chunk
(r - k) mod N to rank (r - k) mod N and receives chunk r from rank (r + k) mod N
(pairwise, one ``Sendrecv`` per step, as MPI libraries run a large ``Alltoall``); the
owner adds each arrival to an int64 accumulator. These steps are this module's; the
arguments, their agreement, the allgather and the result are ``bounded``'s, which the
ring shares.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np

from mpicomp.collectives.bounded import (
    Chunks,
    Plan,
    ReduceScatter,
    allreduce_bounded,
    bits_for,
    decided,
    reduce_scatter_bounded,
)
from mpicomp.kernels.bits import packed_size

_TAG = 0x3C4  # the direct schedule's messages, apart from the ring's

_A2A = "alltoall"


def _alltoall(x, p: Plan, be, chunks: Chunks, out, fname: str, ready) -> Iterator:
    """Yield the direct reduce-scatter's steps of the plan ``p`` over agreed codes ``x``
    (``bounded.ReduceScatter``'s ``steps``); at the end this rank's chunk of ``out``
    holds its sums (or decisions) at ``p.final_width`` bits."""
    xp, bits = be.xp, be.bits
    size, rank = chunks.size, chunks.rank
    w1 = bits_for(p.span)  # one rank's shifted code
    # This rank's codes at w_1, chunk by chunk as they are sent (in ``read_order``: the
    # codes of a chunk may still be coming down from a device), its own chunk last.
    mine = xp.empty(packed_size(chunks.n, w1), dtype=np.uint8)
    lo, hi = chunks.span(rank)
    arrived = xp.empty(packed_size(hi - lo, w1), dtype=np.uint8)
    # The owner's sums, in the unsigned domain: the arrivals, then its own shifted codes
    # (exact integers: the order of the additions cannot change them).
    counts = xp.zeros(hi - lo, dtype=np.int64)
    for k in range(1, size):
        dest, source = (rank - k) % size, (rank + k) % size
        start, stop = chunks.region(dest, w1)
        d_lo, d_hi = chunks.span(dest)
        ready(d_lo, d_hi)
        bits.pack_shifted(x[d_lo:d_hi], p.shift, w1, mine[start:stop])
        yield mine[start:stop], dest, arrived, source, _A2A, k, w1
        bits.add_unpack(arrived, w1, counts, 0, counts)
    ready(lo, hi)
    counts += x[lo:hi].astype(np.int64, copy=False)
    counts += p.shift
    start, stop = chunks.region(rank, p.final_width)
    if p.majority:
        decided(p, counts, lo, out[start:stop], fname)
    else:
        bits.pack_shifted(counts, 0, p.final_width, out[start:stop])


#: ``direct_allreduce_bounded(comm, codes, bound, majority=False, *, signed=True,
#: packed=False, recorder=None, timeout=None, checked=True, kernels=None, ready=None,
#: into=None)``
direct_allreduce_bounded = partial(
    allreduce_bounded, ReduceScatter("direct_allreduce_bounded", "direct", _TAG, _alltoall)
)
direct_allreduce_bounded.__doc__ = """Sum bounded integer codes over ranks, or take their majority, by a direct
    reduce-scatter (alltoall of codes, owners sum) and a ring allgather.

    The arguments (``checked=False`` too), result, checks and errors of
    ``ring.ring_allreduce_bounded``; the same result, bit for bit. The recorder gets
    ``record("direct.alltoall", k, sent, recv, w_1)`` for k = 1..N-1, then
    ``record("direct.allgather", j, sent, recv, w_f)`` for j = 1..N-1.
    """


#: ``direct_reduce_scatter_bounded(comm, codes, bound, majority=False, *, chunk, ...)``:
#: the direct schedule's alltoall alone, for agreed codes (``bounded.reduce_scatter_bounded``).
direct_reduce_scatter_bounded = partial(
    reduce_scatter_bounded,
    ReduceScatter("direct_reduce_scatter_bounded", "direct", _TAG, _alltoall),
)
