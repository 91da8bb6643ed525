"""The ``"integer_sum"`` kind (QSGD-MaxNorm): a MaxAllReduce of norms, [a MinAllReduce of
scale indices], an exact sum of bounded integer codes by the width-growing ring or the
direct reduce-scatter, then dequantize."""

from __future__ import annotations

from functools import partial
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mpicomp.collectives.ring import ring_allreduce_min
from mpicomp.kernels.bits import packed_size
from mpicomp.reduction._cost import Cost, bounded, chunk, direct_alltoall
from mpicomp.reduction._kind import Kind, bounded_schedules
from mpicomp.reduction.agreement import Call, agree, device, down, encode_here, up


@runtime_checkable
class IntegerSumCodec(Protocol):
    """``aggregation = "integer_sum"``: integer codes in [-bound, bound] against a norm
    shared by MaxAllReduce, summed exactly on the width-growing ring.

    ``multiscale`` says the codec is also a ``ScaleIndexCodec``, ``sparse`` that it is a
    ``SparseCoordinatesCodec``; their methods then take the extra arguments those name.
    """

    name: str
    aggregation: str
    bound: int
    multiscale: bool
    sparse: bool

    def local_norm(self, x) -> float: ...

    def quantize(self, x, norm, step: int = 0, stream: int = 0) -> Any: ...

    def dequantize_packed(
        self, data, n: int, width: int, offset: int, norm, nranks: int = 1, shape=None
    ) -> Any: ...


@runtime_checkable
class ScaleIndexCodec(IntegerSumCodec, Protocol):
    """Refinement: ranks also share one scale index per coordinate (MinAllReduce of
    ``scale_index``, ``index_bits`` each); ``quantize`` and ``dequantize_packed`` take it."""

    index_bits: int
    index_dtype: np.dtype

    def scale_index(self, x, norm) -> Any: ...


@runtime_checkable
class SparseCoordinatesCodec(IntegerSumCodec, Protocol):
    """Refinement: only ``coordinates(numel, step)`` are quantized, the same on every rank;
    ``local_norm``, ``scale_index``, ``quantize`` and ``dequantize_packed`` take ``step``
    (and ``dequantize_packed`` the full ``shape``)."""

    def coordinates(self, numel: int, step: int = 0) -> Any: ...


def run(call: Call, codec, flat, *, collective):
    """Average QSGD-MaxNorm codes, their sum made by ``collective`` (the ring's or the
    direct schedule's ``*_allreduce_bounded``)."""
    comm, clock, step = call.comm, call.clock, call.step
    dev = device(flat)
    at = {"step": step} if codec.sparse else {}  # GlobalRandK: K coordinates drawn per step
    norm, flat, err, bad = encode_here(call, partial(codec.local_norm, **at), flat)
    clock.encoded()
    norm = agree(call, flat.size, err, norm or 0.0, nonfinite=bad)
    clock.communicated()
    # After the agreement every rank's codes (and scale indices) have one length and lie
    # within their bounds by construction: the collectives trust it (no second agreement).
    extra = ()
    if codec.multiscale:
        sidx = codec.scale_index(flat, norm, **at)
        clock.encoded()
        if codec.index_bits:
            sidx = ring_allreduce_min(
                comm,
                down(call, dev, sidx, "index"),
                codec.index_bits,
                dtype=codec.index_dtype,
                checked=False,
                kernels=call.kernels,
                **call.io,
            )
            clock.communicated()
        extra = (up(dev, sidx).astype(codec.index_dtype, copy=False),)
    codes = codec.quantize(flat, norm, *extra, step=step, stream=call.stream + comm.rank)
    clock.encoded()
    # The sums stay packed as the schedule left them; dequantize_packed unpacks as it goes.
    data, n, width, offset = collective(
        comm,
        down(call, dev, codes, "codes"),
        codec.bound,
        packed=True,
        checked=False,
        kernels=call.kernels,
        **call.io,
    )
    clock.communicated()
    at = {"shape": flat.shape, "step": step} if codec.sparse else {}
    out = codec.dequantize_packed(
        up(dev, data), n, width, offset, norm, *extra, nranks=comm.size, **at
    )
    clock.decoded()
    return out


def _coded(codec, numel: int) -> int:
    return codec.num_coordinates(numel) if codec.sparse else numel


def _cost(schedule: str, codec, numel: int, nranks: int, payload=None) -> Cost:
    coded = _coded(codec, numel)
    total = bounded(schedule, coded, nranks, 2 * codec.bound, False)
    if codec.multiscale and codec.index_bits and nranks > 1:
        # The scale index MIN runs on the constant-width ring under either schedule.
        N, C = nranks, chunk(coded, nranks)
        total += Cost(2 * (N - 1), 2 * (N - 1) * packed_size(C, codec.index_bits))
    return total


def _direct_alltoall(codec, numel: int, nranks: int, payload=None) -> int:
    return direct_alltoall(_coded(codec, numel), nranks, 2 * codec.bound)


KIND = Kind("integer_sum", IntegerSumCodec, bounded_schedules(run, _cost, _direct_alltoall))
