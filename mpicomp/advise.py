"""When does compression pay? Paper 002's Eq. 4 with measured kernel throughput.

Paper 002 (§3.3) compresses a message of M bytes at a cost M/T per primitive and saves
M/T_comm (1 - 1/k) of communication at compression ratio k; compressing and
decompressing pay off when

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
"""

from __future__ import annotations

import math

import mpicomp

# Aggregations moved around a ring (fp16's "sum" too: a float16 ring, see codecs.md).
_RING = ("integer_sum", "majority", "sum")


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
        ``ratio`` (32 / bits per element), ``min_ratio`` (Eq. 4), ``pays`` (Eq. 4),
        ``speedup`` (float32 ring time over compressed time, N ranks),
        ``break_even_gbit`` (the link rate below which compression is faster; 0: never).
    """
    aggregation = mpicomp.codec(row["codec"], **row["params"]).aggregation
    k = 32 / row["bits_per_element"]
    enc = 4 / (row["encode_gbps"] * 1e9)  # seconds per element
    dec = 4 / (row["decode_gbps"] * 1e9)
    n = nranks
    plain_bytes = 2 * (n - 1) / n * 4  # per element, per rank
    if row["codec"] == "none":
        wire, compute = plain_bytes, 0.0
    elif aggregation in _RING:
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
        "min_ratio": need,
        "pays": row["codec"] != "none" and k > need,
        "speedup": plain_t / comp_t if comp_t > 0 else 1.0,
        "break_even_gbit": (8 * saved / compute / 1e9) if compute > 0 and saved > 0 else 0.0,
    }


def advise(rows: list[dict], link_bps: float, nranks: int) -> list[dict]:
    """Return :func:`predict` for every row that has kernel figures."""
    if nranks < 2:
        raise ValueError(
            f"nranks must be >= 2 (an all-reduce over one rank sends nothing), got {nranks}"
        )
    return [predict(r, link_bps, nranks) for r in rows if r.get("encode_gbps")]


def format_table(advice: list[dict], link_bps: float, nranks: int, out) -> None:
    """Print ``advice`` as a table."""
    from mpicomp.bench import label

    print(
        f"link {link_bps / 1e9:g} Gbit/s per rank, {nranks} ranks. k: compression ratio "
        "(32 / bits per element); Eq. 4 k_min: the ratio compression must exceed with these "
        "kernels (paper 002 §3.3);\nspeedup: the all-reduce model's float32 ring time over "
        "the compressed time; break-even: compression is faster on links slower than this.",
        file=out,
    )
    head = f"{'codec':<28}{'params':<14}{'k':>8}{'Eq.4 k_min':>11}{'pays':>6}{'speedup':>9}"
    head += f"{'break-even Gbit/s':>19}"
    print(head, file=out)
    print("-" * len(head), file=out)
    for a in advice:
        need = "none" if math.isinf(a["min_ratio"]) else f"{a['min_ratio']:.2f}"
        print(
            f"{a['codec']:<28}{label(a['params']):<14}{a['ratio']:>8.1f}{need:>11}"
            f"{'yes' if a['pays'] else 'no':>6}{a['speedup']:>9.2f}{a['break_even_gbit']:>19.2f}",
            file=out,
        )
