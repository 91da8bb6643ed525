"""When does compression pay? Eq. 4 of the FFT sparsification paper with measured kernels.

The FFT sparsification paper (§3.3, docs/bibliography.md) compresses a message of M
bytes at a cost M/T per primitive and saves M/T_comm (1 - 1/k) of communication at
compression ratio k; compressing and decompressing pay off when

    k > 1 / (1 - T_comm (1/T_enc + 1/T_dec))                              (Eq. 4)

with T_enc, T_dec the measured encode/decode throughputs (the paper's 2/T_m + 1/T_f +
1/T_p + 1/T_s, measured as a whole instead of per primitive) and T_comm the link's
bytes per second. Where T_comm (1/T_enc + 1/T_dec) >= 1 no ratio is enough: the
kernels alone take longer than sending the float32 data.

Eq. 4 is a two-party model. For an all-reduce over N ranks, :func:`predict` also
counts what each rank really moves and decodes: a float32 ring moves 2(N-1)/N M per
rank; the ring codecs (QSGD, signSGD, fp16) move 2(N-1)/N M/k and decode once; the gather
codecs receive (N-1) M/k and decode N payloads. From that, the break-even bandwidth:
compression pays on any link slower than it.

:func:`schedule_table` asks the schedule chooser instead (``mpicomp.model.cost``): for
each codec and tensor size, every candidate schedule's predicted time on a topology of
hosts, with latency, and the one ``CompressedComm(schedule="auto")`` would run.
"""

from __future__ import annotations

import math

from mpicomp.codecs import codec as make_codec
from mpicomp.reduction import kind_of


def parse_rate(text: str) -> int:
    """Return bits per second of ``1gbit``, ``10Gbit/s``, ``500mbit``, ``100mbps``.

    Raises:
        ValueError: not a rate in these units, or below 1 bit/s.
    """
    s = str(text).strip().lower().removesuffix("/s")
    s = s[:-3] + "bit" if s.endswith("bps") else s
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if s.endswith(unit):
            try:
                value = float(s[: -len(unit)]) * scale
            except ValueError:
                break
            if math.isfinite(value) and value >= 1:
                return int(value)
            break
    raise ValueError(f"not a rate: {text!r} (use e.g. 1gbit, 10gbit, 500mbit)")


def min_ratio(link_bps: float, encode_gbps: float, decode_gbps: float) -> float:
    """Return Eq. 4's smallest compression ratio that pays (inf: none does).

    Args:
        link_bps: the link's bandwidth in bits per second.
        encode_gbps, decode_gbps: kernel throughput in GB/s of float32 input.
    """
    busy = (link_bps / 8) * (1 / (encode_gbps * 1e9) + 1 / (decode_gbps * 1e9))
    return math.inf if busy >= 1 else 1 / (1 - busy)


def predict(row: dict, link_bps: float, nranks: int) -> dict:
    """Return the all-reduce model of one ``mpicomp bench`` row on a link, per element.

    Args:
        row: a row of ``mpicomp bench --json`` (``codec``, ``params``, ``encode_gbps``,
            ``decode_gbps``, ``bits_per_element``).
        link_bps: each rank's link, bits per second.
        nranks: ranks of the all-reduce (>= 2).

    Returns:
        ``ratio`` (32 / bits per element), ``min_ratio`` (Eq. 4; None where no ratio
        pays), ``pays`` (Eq. 4), ``speedup`` (float32 ring time over compressed time, N
        ranks), ``break_even_gbit`` (the link rate below which compression is faster; 0:
        never) and ``rel_error`` (the row's: ``||decode(encode(g)) - g|| / ||g||`` of one
        call, None when the row has none).
    """
    codec = make_codec(row["codec"], **row["params"])
    k = 32 / row["bits_per_element"]
    enc = 4 / (row["encode_gbps"] * 1e9)  # seconds per element
    dec = 4 / (row["decode_gbps"] * 1e9)
    n = nranks
    plain_bytes = 2 * (n - 1) / n * 4  # per element, per rank
    if not codec.compresses:
        wire, compute = plain_bytes, 0.0
    elif not kind_of(codec).payload:  # reduced around a ring (fp16's float16 ring too)
        wire, compute = plain_bytes / k, enc + dec
    else:
        wire, compute = (n - 1) * 4 / k, enc + n * dec
    link = link_bps / 8
    plain_t = plain_bytes / link
    comp_t = compute + wire / link
    saved = plain_bytes - wire
    need = min_ratio(link_bps, row["encode_gbps"], row["decode_gbps"])
    return {
        "codec": row["codec"],
        "params": row["params"],
        "ratio": k,
        "min_ratio": None if math.isinf(need) else need,  # JSON has no infinity
        "pays": codec.compresses and k > need,
        "speedup": plain_t / comp_t if comp_t > 0 else 1.0,
        "break_even_gbit": (8 * saved / compute / 1e9) if compute > 0 and saved > 0 else 0.0,
        "rel_error": row.get("rel_error"),
    }


def advise(rows: list[dict], link_bps: float, nranks: int) -> list[dict]:
    """Return :func:`predict` for every row that has kernel figures."""
    if nranks < 2:
        raise ValueError(
            f"nranks must be >= 2 (an all-reduce over one rank sends nothing), got {nranks}"
        )
    return [predict(r, link_bps, nranks) for r in rows if r.get("encode_gbps")]


#: What the tables say of accuracy, which they do not measure.
ACCURACY_NOTE = (
    "rel.err = ||decode(encode(g)) - g|| / ||g|| for one call on a gradient-like tensor "
    "(mpicomp bench's): what one step loses, before error feedback carries the rest to "
    "later steps; above 1 is expected of the sparse codecs (grandk, topk, threelc), which "
    "send a few coordinates scaled up. Speed is not accuracy: which codecs train to "
    "float32's accuracy, and with which settings, is in docs/choosing.md."
)


def format_table(advice: list[dict], link_bps: float, nranks: int, out) -> None:
    """Print ``advice`` as a table of at most 120 columns, with what its columns mean and
    a note on accuracy (``ACCURACY_NOTE``)."""
    from mpicomp.tools.bench.workload import codec_label
    from mpicomp.tools.table import lines, note

    print(
        note(
            f"link {link_bps / 1e9:g} Gbit/s per rank, {nranks} ranks. k: compression ratio "
            "(32 / bits per element); Eq.4 k_min: the ratio compression must exceed with "
            "these kernels (§3.3 of the FFT sparsification paper, docs/bibliography.md; "
            "'none': no ratio is enough); speedup: the all-reduce model's float32 ring time "
            "over the compressed time; break-even: compression is faster on links slower "
            "than this."
        ),
        file=out,
    )
    head = ["codec", "k", "Eq.4 k_min", "pays", "speedup", "break-even Gbit/s", "rel.err"]
    rows = [
        [
            codec_label(a["codec"], a["params"]),
            f"{a['ratio']:.1f}",
            "none" if a["min_ratio"] is None else f"{a['min_ratio']:.2f}",
            "yes" if a["pays"] else "no",
            f"{a['speedup']:.2f}",
            f"{a['break_even_gbit']:.2f}",
            "-" if a.get("rel_error") is None else f"{a['rel_error']:.3g}",
        ]
        for a in advice
    ]
    print("\n".join(lines(head, rows, right=range(1, 7), squeeze=((0, 16),))), file=out)
    print(note(ACCURACY_NOTE), file=out)


# -- the schedule table: what schedule="auto" picks per tensor size ---------------------

#: The tensor sizes of the schedule table when a model is given without sizes: from a
#: latency-bound bias vector to ResNet-50's whole gradient.
DEFAULT_SIZES = (4_000, 64_000, 1_000_000, 25_600_000)

# Units per second: dividing by them gives 20us the same float as 20e-6.
_PER_SECOND = (("ms", 1e3), ("us", 1e6), ("µs", 1e6), ("ns", 1e9), ("s", 1.0))


def parse_seconds(text: str) -> float:
    """Return the seconds of ``50us``, ``0.05ms``, ``5e-5`` or ``0.00005s`` (µs is us).

    Raises:
        ValueError: not a time in these units, or negative, or not finite.
    """
    s = str(text).strip().lower()
    per = 1.0
    for unit, unit_per in _PER_SECOND:
        if s.endswith(unit):
            s, per = s[: -len(unit)], unit_per
            break
    try:
        value = float(s) / per
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"not a time >= 0: {text!r} (use e.g. 50us, 0.5ms, 5e-5)")
    return value


def rate_model(
    link_bps: float, intra_bps: float, alpha: float, rows: list[dict], source: str = "given"
):
    """Return the ``mpicomp.model.Model`` of a link rate: ``link_bps`` between hosts,
    ``intra_bps`` within one, ``alpha`` seconds per message on both, and the codec
    speeds of ``mpicomp bench --json`` rows that have kernel figures (from ``source``)."""
    from mpicomp.model.cost import Network
    from mpicomp.model.measured import Model, speeds_from_bench

    return Model(
        intra=Network(alpha, intra_bps / 8),
        inter=Network(alpha, link_bps / 8),
        speeds=speeds_from_bench(rows),
        source=source,
    )


def codecs_of(speeds: dict) -> list:
    """Return the codecs ``speeds`` (``codec_key`` to ``Speed``) has figures for, made.

    Raises:
        ValueError: a key that does not name a codec and its parameters.
    """
    import json

    out = []
    for key in speeds:
        name, _, params = key.partition(":")
        try:
            out.append(make_codec(name, **json.loads(params or "{}")))
        except (ValueError, TypeError) as e:
            raise ValueError(f"speed {key!r} names no codec ({e})") from None
    return out


def schedule_table(model, topology, codecs, sizes) -> list[dict]:
    """Return what ``schedule="auto"`` predicts and picks for each codec and size.

    Args:
        model: a ``mpicomp.model.Model`` with a speed for each codec.
        topology: a ``mpicomp.model.cost.Topology`` of at least two ranks.
        codecs: made codecs (``mpicomp.codec(...)``).
        sizes: tensor sizes in elements.

    Returns:
        One dict per codec and size, codecs first: ``codec``, ``params`` (all of the
        codec's), ``numel``, ``seconds`` (every candidate of ``schedules_of``, in its
        order, to its predicted seconds), ``choice`` (the cheapest) and ``speedup``
        (the float32 MPI_Allreduce's predicted seconds over the choice's).

    Raises:
        ValueError: a topology of one rank (nothing to choose), or a codec the model
            has no speed for.
    """
    from mpicomp.model.cost import FLOAT32, choose, predict

    if topology.nranks < 2:
        raise ValueError(f"the schedule table needs >= 2 ranks, got a topology of {topology}")
    rows = []
    for codec in codecs:
        for n in sizes:
            choice, seconds = choose(codec, n, topology, model)
            # none's only candidate is its own allreduce: float32 is predicted for reference.
            if FLOAT32 in seconds:
                plain = seconds[FLOAT32]
            else:
                plain = predict(FLOAT32, codec, n, topology, model)
            rows.append(
                {
                    "codec": codec.name,
                    "params": dict(codec.params),
                    "numel": n,
                    "seconds": seconds,
                    "choice": choice,
                    "speedup": plain / seconds[choice] if seconds[choice] > 0 else 1.0,
                }
            )
    return rows


def _columns(rows: list[dict]) -> list[str]:
    """The schedules of ``rows`` in ``schedules_of`` order: flat, hierarchical, float32."""
    from mpicomp.reduction import all_schedule_names

    seen = {s for r in rows for s in r["seconds"]}
    return [s for s in all_schedule_names() if s in seen]


def _given_params(name: str, params: dict) -> dict:
    """The parameters of ``params`` that differ from codec ``name``'s defaults."""
    defaults = make_codec(name).params
    return {k: v for k, v in params.items() if defaults.get(k, object()) != v}


def format_schedule_table(rows: list[dict], model, topology, out) -> None:
    """Print ``schedule_table`` rows as tables of at most 120 columns, under a header
    naming ``model``'s networks and ``topology``: one table per set of candidate
    schedules (the ring codecs', the gather codecs', ...), so no column is empty."""
    from mpicomp.tools.bench.workload import codec_label, format_count
    from mpicomp.tools.table import lines, note, plural

    def net(n) -> str:
        return f"alpha {n.alpha * 1e6:.4g} us, {n.beta * 8 / 1e9:.4g} Gbit/s"

    print(
        note(
            f"{plural(topology.hosts, 'host')} x {plural(topology.per_host, 'rank')}; "
            f"within a host: {net(model.intra)}; between hosts: {net(model.inter)}; "
            f"speeds: {model.source}.\nPredicted ms per call of each candidate schedule; "
            "choice: what schedule='auto' runs; speedup: float32's time over the choice's."
        ),
        file=out,
    )
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(_columns([r])), []).append(r)
    for columns, members in groups.items():
        head = ["codec", "size", *columns, "choice", "speedup"]
        body = [
            [
                codec_label(r["codec"], _given_params(r["codec"], r["params"])),
                format_count(r["numel"]),
                *(f"{1e3 * r['seconds'][s]:.3f}" for s in columns),
                r["choice"],
                f"{r['speedup']:.2f}",
            ]
            for r in members
        ]
        right = [i for i in range(len(head)) if head[i] not in ("codec", "choice")]
        print(file=out)
        print("\n".join(lines(head, body, right=right, squeeze=((0, 16),))), file=out)
