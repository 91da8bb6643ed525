"""The options of a CompressedComm, each declared once (``OPTIONS``), checked once and
frozen (``CompressedComm.options``).

An ``Option`` holds a keyword's name, default, type, check and documentation, and says
what of it every rank must share (``agreed``) and whether a trace records it
(``traced``). From ``OPTIONS`` come ``CompressedComm``'s keywords (its signature and
the Args of its docstring), the ``Options`` record, the configuration all ranks agree
on (``mpicomp.call.arguments``), a trace's attributes and the table of docs/usage.md
(``table``; tests/test_options.py keeps the page equal to it). Adding an option is one
``Option`` here plus its behaviour (docs/architecture.md, "Adding an option").
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field, make_dataclass

import numpy as np
from mpi4py import MPI

from mpicomp.codecs._base import check_number
from mpicomp.collectives._wait import resolve_timeout
from mpicomp.env import env_flag
from mpicomp.reduction import Auto, Plan, all_schedule_names, kind_of, parse, schedule_names
from mpicomp.reduction import sharded as sharded_plan
from mpicomp.reduction.agreement import POLICIES

#: On (1, true...: ``mpicomp.env.env_flag``): every CompressedComm checks that all
#: ranks make the same call.
DEBUG_ENV = "MPICOMP_DEBUG"

__all__ = ["DEBUG_ENV", "OPTIONS", "Option", "Options", "resolve", "signature", "table"]


def _itself(value, options):
    return value


@dataclass(frozen=True)
class Option:
    """One keyword of ``CompressedComm``.

    ``name``, ``default`` and ``annotation`` (its type, as written in the signature);
    ``doc``: what it does, in Markdown (a cell of docs/usage.md's table; the docstring
    gets it in reST); ``check(value, options)``: the value checked (TypeError or
    ValueError naming the option), given the whole record for checks that depend on
    another option; ``resolve(value, codec)``: the default that depends on the codec or
    the environment, filled in before the check; ``agreed(options)``: what every rank
    must share of it, the configuration's field ``agreed_as`` (default: the name; None:
    ranks may differ); ``traced``: whether a trace's root attributes record its value.
    """

    name: str
    default: object
    annotation: str
    doc: str
    check: Callable = _itself
    resolve: Callable | None = None
    agreed: Callable | None = None
    agreed_as: str = ""
    traced: bool = False
    compare: bool = True  # whether ``Options`` compare (and hash) by it: not objects


def _bool(name: str, none: bool = False) -> Callable:
    def check(value, options):
        if none and value is None:
            return None
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool{' or None' if none else ''}, got {value!r}")
        return bool(value)

    return check


def _count(name: str, lo: int) -> Callable:
    return lambda value, options: check_number(name, value, lo, None, integer=True)


def _value(name: str) -> Callable:
    """What ranks must share of option ``name``: its value."""
    return lambda options: getattr(options, name)


def _if_traced(name: str) -> Callable:
    """What ranks must share of a trace option: its value when there is a trace file."""
    return lambda options: getattr(options, name) if options.trace is not None else None


def _schedule(value, options):
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"schedule must be a str or None, got {type(value).__name__}")
    if value not in all_schedule_names():
        raise ValueError(f"schedule: no schedule named {value!r}")
    return value


def _local_comm(value, options):
    if value is not None and not isinstance(value, MPI.Intracomm):
        raise TypeError(f"local_comm must be an mpi4py.MPI.Intracomm or None, got {value!r}")
    return value


def _trace(value, options):
    if value is not None:
        from mpicomp.trace import check_options

        check_options(value, options.trace_level, options.trace_flush_every)
    return value


def _nonfinite(value, options):
    if not isinstance(value, str):
        raise TypeError(f"nonfinite must be a str, got {type(value).__name__}")
    if value not in POLICIES:
        raise ValueError(f"nonfinite must be one of {POLICIES}, got {value!r}")
    return value


def _timeout(value, options):
    if value is not None:
        resolve_timeout(value)  # raises for a bad type or value
    return value


def _on_call(value, options):
    if value is not None and not callable(value):
        raise TypeError(f"on_call must be callable or None, got {value!r}")
    return value


def _error_feedback(value, codec):
    """The codec's default (on for the biased codecs); only the kinds that keep residuals."""
    value = codec.feedback_default if value is None else _bool("error_feedback", True)(value, None)
    kind = kind_of(codec)
    if value and not kind.feedback:
        raise ValueError(
            f"error_feedback applies to gather and low-rank codecs; {codec.name!r} is {kind.name!r}"
        )
    return value


def _debug(value, codec):
    return env_flag(DEBUG_ENV) if value is None else value


def _resolved_timeout(value, codec):
    # MPICOMP_TIMEOUT is read here, once: a rank whose environment changed later
    # would otherwise mix blocking and nonblocking calls with the others and hang.
    return resolve_timeout(value) or 0


#: Every keyword option of ``CompressedComm``, in the order of its signature.
OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option(
            "min_numel",
            1024,
            "int",
            "tensors with fewer elements are averaged uncompressed (one float32 "
            "`MPI_Allreduce`): for a bias of a few hundred elements, headers and extra "
            "messages cost more than compression saves.",
            _count("min_numel", 0),
            agreed=_value("min_numel"),
            traced=True,
        ),
        Option(
            "bucket_numel",
            1 << 22,
            "int",
            "`allreduce_many` fuses consecutive tensors smaller than this into one buffer "
            "of at most this many elements, reduced by one collective call.",
            _count("bucket_numel", 1),
            agreed=_value("bucket_numel"),
            traced=True,
        ),
        Option(
            "error_feedback",
            None,
            "bool | None",
            "keep a residual per tensor name (the [3LC paper](bibliography.md#3lc) §3.1). "
            "Default: on for the biased codecs (the gather codecs `threelc`, `topk`, `fft`, "
            "`fastsgd`, and `powersgd`), off for the others; only those take it (asked of "
            "another codec: `ValueError`). With it on, every call needs a `name`.",
            _bool("error_feedback", none=True),
            _error_feedback,
            agreed=_value("error_feedback"),
            traced=True,
        ),
        Option(
            "sharded",
            False,
            "bool",
            "gather codecs: reduce through shard owners (3LC's push/pull: an alltoallv, "
            "then an allgather of the owners' re-compressed averages) instead of "
            'allgathering whole payloads; the same as `schedule="sharded"`. Receives '
            "about two compressed tensors per rank whatever N; pays from about 4 ranks "
            "([collectives.md](collectives.md)). With error feedback, workers keep a "
            "residual per shard and owners one per tensor.",
            _bool("sharded"),
            agreed=_value("sharded"),
            traced=True,
        ),
        Option(
            "schedule",
            None,
            "str | None",
            'how a compressed call moves its bytes: the codec\'s own (`"ring"`, the '
            'width-growing ring, or `"direct"`, each code sent once to its chunk\'s '
            "owner, fewer bytes from 3 ranks on and the same results bit for bit, for "
            'QSGD and signSGD; `"allgather"` or `"sharded"` for the gather codecs; '
            '`"allreduce"` for `none`, `fp16` and `powersgd`), `"float32"` (no '
            'compression), `"hier:NAME"` (reduce within each host, NAME between hosts, on '
            "several hosts of as many ranks each: "
            '[collectives.md](collectives.md#hierarchy)) or `"auto"`: per '
            "tensor size, the schedule a latency-bandwidth model of this job's network and "
            "codec predicts to be cheapest, the same on every rank "
            "([collectives.md](collectives.md#choosing-a-schedule)). Default: the codec's "
            "first. `cc.schedule_for(numel)` returns the schedule of a size and its "
            "predicted seconds.",
            _schedule,
            agreed=_value("schedule"),
            traced=True,
        ),
        Option(
            "model",
            None,
            "Model | str | os.PathLike | None",
            'what `schedule="auto"` predicts with: a `mpicomp.model.Model` or the file '
            "`mpicomp bench --save-model FILE` wrote. Default: the file `MPICOMP_MODEL` "
            "names, else measured when the `CompressedComm` is made (a fraction of a "
            "second, collective). With another schedule, a given model only fills the "
            "trace's `t_predicted`. Rank 0's is used. `cc.model` is the one in use.",
            compare=False,
        ),
        Option(
            "local_comm",
            None,
            "MPI.Intracomm | None",
            "the ranks of `comm` that share this rank's host, for the hierarchical "
            "schedules and the model (default `comm.Split_type(MPI.COMM_TYPE_SHARED)`; "
            "e.g. one per socket). `cc.topology` says how many hosts and ranks per host "
            "were found.",
            _local_comm,
            agreed=lambda options: options.local_comm is not None,
            compare=False,
        ),
        Option(
            "trace",
            None,
            "str | os.PathLike | None",
            "path of an HDF5 file recording every collective call of every rank (bytes, "
            "phase times), written by rank 0: see [trace-format.md](trace-format.md). "
            "`cc.trace` is its `mpicomp.trace.Tracer`. The path may differ between ranks.",
            _trace,
            agreed=lambda options: options.trace is not None,
            agreed_as="trace_file",
        ),
        Option(
            "trace_level",
            1,
            "int",
            "1 records one event per call per rank; 2 also every exchange step of the collectives.",
            agreed=_if_traced("trace_level"),
        ),
        Option(
            "trace_flush_every",
            100,
            "int | None",
            "rank 0 appends what all ranks recorded to the file every this many calls "
            "(`None`: only at `close`), so a job that dies keeps its events up to the "
            "last flush.",
            agreed=_if_traced("trace_flush_every"),
        ),
        Option(
            "nonfinite",
            "raise",
            "str",
            "what a NaN/Inf in some rank's gradient does, the same on every rank: "
            '`"raise"` (default: `ValueError` there, `mpicomp.RankError` on the others), '
            '`"skip_step"` (every rank returns zeros for that call, with a '
            "`mpicomp.NonFiniteWarning` naming the ranks, residuals untouched) or "
            '`"zero"` (the offending rank\'s NaN/Inf become 0). float64 values beyond '
            "float32's range count as Inf. See [reliability.md](reliability.md).",
            _nonfinite,
            agreed=_value("nonfinite"),
        ),
        Option(
            "debug",
            None,
            "bool | None",
            "check on every call that all ranks made the same call (op, name, numel, "
            "dtype, codec, policy), naming the ranks that differ; one 8-byte Allgather "
            "per call (default: `MPICOMP_DEBUG`, set and not `0`).",
            _bool("debug", none=True),
            _debug,
            agreed=_value("debug"),
        ),
        Option(
            "timeout",
            None,
            "float | None",
            "seconds any one message may wait before the rank says what it waited for and "
            "aborts the job (default: `MPICOMP_TIMEOUT`, read once when the communicator "
            "is made; unset: none; 0: off). Every rank must have one, or none. See "
            "[reliability.md](reliability.md).",
            _timeout,
            _resolved_timeout,
            agreed=lambda options: "set" if options.timeout else "off",
        ),
        Option(
            "background",
            None,
            "bool | None",
            "run `iallreduce` calls on a background thread, so they overlap the caller's "
            "work (default: when MPI provides `MPI_THREAD_MULTIPLE` and numba's threading "
            "layer is thread-safe); `False` runs them at once in the caller's thread, "
            "their handles already complete. See [Overlapping communication with "
            "computation](#overlapping-communication-with-computation).",
            _bool("background", none=True),
        ),
        Option(
            "on_call",
            None,
            "Callable | None",
            "called with every finished call's event on this rank, a dict of the trace's "
            "columns (`op`, `name`, `numel`, `bytes_sent`, `t_total`, ...; "
            "[trace-format.md](trace-format.md)), with or without `trace`: for "
            "TensorBoard, W&B or a log. It runs in the thread that ran the call (the "
            "background thread for `iallreduce`): keep it short; what it raises is logged "
            "and ignored. Ranks agree on whether calls are traced (`trace` or `on_call` "
            "given), not on the function.",
            _on_call,
            agreed=lambda options: options.trace is not None or options.on_call is not None,
            agreed_as="traced",
            compare=False,
        ),
    )
}

#: ``CompressedComm``'s positional arguments, documented with the options.
ARGUMENTS = {
    "comm": "an `mpi4py.MPI.Intracomm` (e.g. `MPI.COMM_WORLD`). mpicomp works on a `Dup()` "
    "of it, so its messages never match yours.",
    "codec": "a name from `mpicomp.codecs.available()` (parameters as keywords) or a codec "
    "made by `mpicomp.codec(...)`. See [codecs.md](codecs.md).",
}


def _post_init(self):
    # Frozen: the checked values (plain int and bool) go in through object.__setattr__.
    for option in OPTIONS.values():
        object.__setattr__(self, option.name, option.check(getattr(self, option.name), self))


Options = make_dataclass(
    "Options",
    [(o.name, o.annotation, field(default=o.default, compare=o.compare)) for o in OPTIONS.values()],
    namespace={"__post_init__": _post_init, "__module__": __name__},
    frozen=True,
)
Options.__doc__ = """What a CompressedComm was asked to do: one field per option of ``OPTIONS``.

Made by ``resolve`` with the defaults that depend on the codec or the environment
filled in: ``error_feedback`` and ``debug`` are bools, ``schedule`` a name,
``sharded`` whether that is the sharded schedule, ``timeout`` seconds or 0 (off;
``MPICOMP_TIMEOUT`` is read once, by ``resolve``). ``background`` stays as asked (None:
decided by the MPI thread level). Made directly, each field is checked alone.

Raises:
    TypeError, ValueError: a field of the wrong type or out of range, naming it.
"""


def _resolve(cls, codec, **given) -> Options:
    """Return the options of a CompressedComm of ``codec`` from its keyword arguments
    (``resolve``, without the schedule's plan)."""
    return resolve(codec, **given)[0]


Options.resolve = classmethod(_resolve)


def resolve(codec, **given) -> tuple[Options, Plan | Auto]:
    """Return the options of a CompressedComm of ``codec`` from its keyword arguments, and
    what its schedule asks (``mpicomp.reduction.parse``: a ``Plan``, or ``Auto``).

    Defaults: each option's ``resolve`` (``error_feedback`` the codec's
    ``feedback_default``; ``debug`` from ``MPICOMP_DEBUG``; ``timeout=None`` left to
    ``MPICOMP_TIMEOUT``, read once here; 0 off whatever the environment says);
    ``schedule`` the codec's first, or its sharded schedule for ``sharded=True``: past
    here, only the schedule says how a call runs.

    Raises:
        ValueError: ``error_feedback`` or ``sharded`` asked of a codec that does not
            gather payloads; a schedule the codec has not; any field out of range;
            ``MPICOMP_DEBUG`` neither on nor off.
        TypeError: a field of the wrong type, or a keyword that is no option.
    """
    unknown = [k for k in given if k not in OPTIONS]
    if unknown:
        raise TypeError(f"not options of CompressedComm: {', '.join(map(repr, unknown))}")
    values = {name: given.get(name, o.default) for name, o in OPTIONS.items()}
    asked = _asked_schedule(codec, values["schedule"], _bool("sharded")(values["sharded"], None))
    values["schedule"] = asked.name
    values["sharded"] = asked == sharded_plan(codec)
    for option in OPTIONS.values():
        if option.resolve is not None:
            values[option.name] = option.resolve(values[option.name], codec)
    return Options(**values), asked


def _asked_schedule(codec, asked: str | None, sharded: bool) -> Plan | Auto:
    """Return the schedule of ``codec`` asked for (None: its default), ``sharded=True``
    turned into the schedule it stands for: the one place that reads ``sharded``."""
    alias = sharded_plan(codec) if sharded else None
    if sharded and alias is None:
        kind = kind_of(codec)
        raise ValueError(f"sharded applies to gather codecs; {codec.name!r} is {kind.name!r}")
    names = schedule_names(codec)
    if asked is None:
        return alias or parse(codec, names[0])
    if not isinstance(asked, str):
        raise TypeError(f"schedule must be a str or None, got {type(asked).__name__}")
    if asked not in names:
        raise ValueError(
            f"schedule={asked!r}: codec {codec.name!r} ({kind_of(codec).name}) runs "
            f"{' or '.join(map(repr, names))}"
        )
    chosen = parse(codec, asked)
    if alias is not None and chosen != alias:
        raise ValueError(f"sharded=True contradicts schedule={asked!r}")
    return chosen


# -- what the declarations make: the signature, the docstring's Args, the docs' table --


def signature() -> inspect.Signature:
    """Return ``CompressedComm.__init__``'s signature: ``self``, the positional
    arguments, every option with its default, ``**codec_params``."""
    P = inspect.Parameter
    params = [
        P("self", P.POSITIONAL_OR_KEYWORD),
        P("comm", P.POSITIONAL_OR_KEYWORD),
        P("codec", P.POSITIONAL_OR_KEYWORD, default="none", annotation="str | Codec"),
    ]
    params += [
        P(o.name, P.KEYWORD_ONLY, default=o.default, annotation=o.annotation)
        for o in OPTIONS.values()
    ]
    params.append(P("codec_params", P.VAR_KEYWORD))
    return inspect.Signature(params)


def _markdown_to_rest(text: str) -> str:
    """Return a Markdown cell as docstring text: code as ````x````, links as the page."""

    def link(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if label.endswith(".md"):
            return f"docs/{label}"
        page = "usage.md" if target.startswith("#") else target.split("#")[0]
        return f"{label} (docs/{page})"

    text = re.sub(r"\[([^\]]+)\]\(([^)]+)\)", link, text)
    return re.sub(r"`([^`]+)`", r"``\1``", text)


def docstring_args(indent: str = "    ", width: int = 88) -> str:
    """Return the Args section of ``CompressedComm``'s docstring, every line but the first
    indented by ``indent`` (the docstring's own)."""
    import textwrap

    lines = ["Args:"]
    docs = {**ARGUMENTS, **{o.name: o.doc for o in OPTIONS.values()}}
    docs["**codec_params"] = "parameters of the codec when `codec` is a name."
    for name, doc in docs.items():
        text = f"{name}: {_markdown_to_rest(doc)}"
        lines += textwrap.wrap(
            text,
            width,
            initial_indent=indent + "    ",
            subsequent_indent=indent + "        ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def table() -> str:
    """Return docs/usage.md's table of ``CompressedComm``'s arguments (Markdown): its
    call with every default, then one row per argument."""

    def default(value) -> str:
        return f'"{value}"' if isinstance(value, str) else repr(value)

    call = ", ".join(f"{o.name}={default(o.default)}" for o in OPTIONS.values())
    rows = [
        f'`CompressedComm(comm, codec="none", *, {call}, **codec_params)`',
        "",
        "| argument | meaning |",
        "| --- | --- |",
    ]
    docs = {**ARGUMENTS, **{o.name: o.doc for o in OPTIONS.values()}}
    rows += [f"| `{name}` | {doc} |" for name, doc in docs.items()]
    return "\n".join(rows) + "\n"
