"""What CompressedComm's arguments resolve to on this rank, before any message: the
codec, the checked options, the schedule's plan, how device bytes reach MPI, whether
started calls may run on a background thread, and the configuration every rank must
share (from the options' declarations, ``mpicomp.call.options.OPTIONS``)."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass

from mpicomp.call import options
from mpicomp.call.config import Config
from mpicomp.call.options import OPTIONS, Options
from mpicomp.call.worker import overlap_blocker
from mpicomp.codecs import Codec
from mpicomp.codecs._base import available as available_codecs
from mpicomp.codecs._base import codec_parameters
from mpicomp.codecs._base import make as make_codec
from mpicomp.reduction import Auto, Plan
from mpicomp.reduction.transport import Transport, cuda_aware


@dataclass(frozen=True)
class Arguments:
    """A CompressedComm's arguments, checked: ``codec``, ``options``, ``schedule`` (what
    ``options.schedule`` asks, parsed: a ``Plan``, or ``Auto``), ``transport``,
    ``background`` (whether ``iallreduce`` runs calls on a thread), ``eager_why`` (why
    not, to warn once when the default made it so; None otherwise) and ``config``."""

    codec: Codec
    options: Options
    schedule: Plan | Auto
    transport: Transport
    background: bool
    eager_why: str | None
    config: Config


def split(keywords: dict) -> tuple[dict, dict]:
    """Return ``CompressedComm``'s keywords as (options, codec parameters)."""
    given = {k: v for k, v in keywords.items() if k in OPTIONS}
    return given, {k: v for k, v in keywords.items() if k not in OPTIONS}


def resolve(codec, codec_params: dict, given: dict) -> Arguments:
    """Return what ``CompressedComm(comm, codec, **given, **codec_params)`` asks for
    (``given``: options only, ``split``).

    Raises:
        TypeError, ValueError: as ``CompressedComm`` documents (on this rank alone).
    """
    codec = _codec(codec, codec_params)
    opts, schedule = options.resolve(codec, **given)
    why = None if opts.background is False else overlap_blocker(codec.kernels)
    if opts.background and why:
        raise ValueError(f"background=True: {why} (see docs/usage.md, Overlapping communication)")
    # How device gradients' bytes reach MPI: directly when the library is CUDA-aware.
    transport = Transport(direct=cuda_aware()[0])
    background = why is None if opts.background is None else opts.background
    eager_why = why if opts.background is None else None
    config = _config(codec, opts, transport)
    return Arguments(codec, opts, schedule, transport, background, eager_why, config)


def trace_attrs(args: Arguments) -> dict:
    """Return the run attributes a trace records about a CompressedComm: the backend,
    the transport, the codec, and the options declared ``traced``."""
    codec, opts = args.codec, args.options
    attrs = {
        "backend": codec.kernels.name,
        "cuda_aware": args.transport.direct,
        "device_transport": args.transport.path,
        "mpi_cuda_aware": _mpi_cuda_aware(),
        "codec": codec.name,
        "codec_params": json.dumps(codec.params, sort_keys=True, default=str),
    }
    attrs.update({o.name: getattr(opts, o.name) for o in OPTIONS.values() if o.traced})
    return attrs


def _codec(codec, params: dict) -> Codec:
    """Return the codec ``codec`` names (made with ``params``), or ``codec`` itself.

    A keyword neither CompressedComm nor the codec takes is blamed on both, with the
    closest names, instead of on the codec's ``__init__``.
    """
    if isinstance(codec, str):
        unknown = [k for k in params if k not in codec_parameters(codec)]
        if unknown and codec in available_codecs():
            raise TypeError(unknown_keywords(unknown, codec))
        return make_codec(codec, **params)
    if params:
        raise TypeError(
            f"codec parameters ({', '.join(params)}) go with a codec name, not a made codec"
        )
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a codec name or an mpicomp codec, got {codec!r}")
    return codec


def unknown_keywords(
    unknown: list[str], codec, who: str = "CompressedComm", also: tuple[str, list[str]] = ("", [])
) -> str:
    """The message of keywords ``unknown`` given to ``who``: neither options of
    CompressedComm nor parameters of ``codec`` (a name) nor, where ``also`` names one,
    arguments of that (``also``: its name and its arguments), with the closest names."""
    own = codec_parameters(codec) if isinstance(codec, str) else []
    known = ["comm", "codec", *OPTIONS, *own, *also[1]]
    parts = []
    for k in unknown:
        close = difflib.get_close_matches(k, known, n=1)
        parts.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    codec_said = f"a parameter of codec {codec!r} ({', '.join(own) or 'which takes none'})"
    if not isinstance(codec, str):
        codec_said = "a parameter of its codec"
    nor = f", {codec_said}, nor an argument of {also[0]}" if also[0] else f" nor {codec_said}"
    return f"{who} got unknown keyword(s) {', '.join(parts)}: not an option of CompressedComm{nor}"


def _config(codec: Codec, opts: Options, transport: Transport) -> Config:
    """Return what every rank's CompressedComm must share: the codec and its parameters,
    what each option declares ``agreed`` (what changes the messages: e.g. a tracer of a
    file or of ``on_call`` alike syncs its clock with the other ranks' at start; one of
    a file also gathers its events at every flush), and the staging chunk (it cuts a
    float32 sum into as many MPI_Allreduce on every rank)."""
    fields = {"codec": {"name": codec.name, **codec.params}}
    for o in OPTIONS.values():
        if o.agreed is not None:
            fields[o.agreed_as or o.name] = o.agreed(opts)
    fields["staging_chunk"] = transport.chunk_bytes
    return Config(fields)


def _mpi_cuda_aware() -> str:
    """Return whether the MPI library takes GPU buffers, and how that was decided."""
    try:
        aware, how = cuda_aware()
    except ValueError as e:  # a bad MPICOMP_CUDA_AWARE
        return f"unknown ({e})"
    return f"{'yes' if aware else 'no'} ({how})"
