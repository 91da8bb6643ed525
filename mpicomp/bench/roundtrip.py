"""What one rank computes per codec, as timed closures: encode, decode and wire bytes.

``mpicomp.bench.kernels`` and ``jobs/codec_tour.py`` time these; they run the same
kernels ``CompressedComm`` runs for one rank's share of an all-reduce.
"""

from __future__ import annotations

import math

import numpy as np

from mpicomp.kernels import backend_of
from mpicomp.kernels.bits import packed_size


def _ring_width(bound: int) -> int:
    # One rank's codes in [-bound, bound] as unsigned offsets: ceil(log2(2*bound + 1)) bits.
    return math.ceil(math.log2(2 * bound + 1))


def one_rank_round_trip(codec, x: np.ndarray):
    """Return (encode, decode, wire_bytes) closures for one rank of ``codec``.

    For byte-payload codecs these are encode/decode. For the summable codecs the
    wire is the codes bit-packed at the ring's first-step width (plus the shared
    scale indices for multi-scale); for signSGD, one sign bit per element.
    ``decode`` returns what this rank alone would get back; ``wire_bytes`` is valid
    after ``encode`` has run.
    """
    if hasattr(codec, "encode") and codec.aggregation != "integer_sum":
        state = {}

        def enc():
            state["p"] = codec.encode(x)

        def dec():
            return codec.decode(state["p"])

        return enc, dec, lambda: state["p"].size

    if codec.aggregation == "majority":
        state = {}

        def enc():
            # As reduce_majority: votes and scale in one pass; the ring packs them 1 bit each.
            votes, state["s"] = codec.votes_and_scale(x)
            k = backend_of(votes, codec.kernels)
            state["p"] = k.xp.empty(packed_size(votes.size, 1), np.uint8)
            k.bits.pack_shifted(votes, 0, 1, state["p"])

        def dec():
            return codec.expand(state["p"], x.size, state["s"]).reshape(x.shape)

        return enc, dec, lambda: state["p"].size + 4

    width = _ring_width(codec.bound)
    multiscale = hasattr(codec, "scale_index")
    sparse = hasattr(codec, "coordinates")
    state = {}

    def enc():
        norm = codec.local_norm(x)
        extra = (codec.scale_index(x, norm),) if multiscale else ()
        codes = codec.quantize(x, norm, *extra, step=0, stream=0)
        # The ring's first step: codes shifted into [0, 2*bound] and packed by one kernel.
        k = backend_of(codes, codec.kernels)
        packed = k.xp.empty(packed_size(codes.size, width), np.uint8)
        k.bits.pack_shifted(codes, codec.bound, width, packed)
        state.update(norm=norm, extra=extra, packed=packed, ncodes=codes.size)

    def dec():
        # As reduce_integer: the packed sums go straight to the codec, unpacked as it reads.
        packed = (state["packed"], state["ncodes"], width, codec.bound)
        at = {"step": 0} if sparse else {}
        return codec.dequantize_packed(*packed, state["norm"], *state["extra"], shape=x.shape, **at)

    def wire():
        index_bytes = state["ncodes"] * codec.index_bits / 8 if multiscale else 0
        return state["packed"].size + index_bytes + 4

    return enc, dec, wire
