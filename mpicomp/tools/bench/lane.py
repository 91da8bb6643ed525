"""The GPU lane's one table: ``python -m mpicomp.tools.bench.lane OUT`` (``.ci/gpu summary``).

Reads what the lane's steps left in ``OUT`` and prints one row per codec:

- ``kernels.json`` (``mpicomp bench --no-allreduce --json``): encode and decode
  throughput over the device copy measured in the same run (FFT's over a bare cuFFT
  ``rfft`` + ``irfft`` pair of the same size, the issue's yardstick for it);
- ``ncu.csv`` and ``profile-rows.json`` (``mpicomp.tools.bench.profile`` under ``ncu``): DRAM
  bytes moved over the ideal (the input read once, the output written once), the
  achieved occupancy and what limits the slowest kernel, per phase;
- ``allreduce-staged.json`` (``mpicomp bench --no-kernels --json``, staged): each size's
  all-reduce time over a staged ``MPI_Allreduce`` of the same device buffer;
- ``allreduce-direct.json`` (the same with ``MPICOMP_CUDA_AWARE=1`` under a CUDA-aware
  MPI): the staged run's time over the direct one, per codec and size.

A file that is missing (a step that did not run or failed) leaves its columns empty.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from mpicomp.tools.bench import profile
from mpicomp.tools.bench.workload import label


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _rows(data) -> tuple[list[dict], list[dict]]:
    """Return (kernel rows, all-reduce rows) of a ``mpicomp bench --json`` list."""
    kernels, allreduce = [], []
    for row in data or []:
        if "encode_gbps" in row:
            kernels.append(row)
        if "time_s" in row:
            allreduce.append(row)
        allreduce.extend(row.get("allreduce") or [])
    return kernels, allreduce


def _key(row) -> tuple[str, str]:
    return row["codec"], label(row.get("params") or {})


def _fmt(x, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _sizes(rows: list[dict]) -> list[int]:
    return sorted({int(r["numel"]) for r in rows})


def summarize(out: Path) -> str:
    """Return the lane's table (Markdown) from the files in ``out``."""
    kernels, _ = _rows(_load(out / "kernels.json"))
    _, staged = _rows(_load(out / "allreduce-staged.json"))
    _, direct = _rows(_load(out / "allreduce-direct.json"))
    phases = {}
    ncu, rows = out / "ncu.csv", _load(out / "profile-rows.json")
    if rows is not None and ncu.exists():
        try:
            for r in profile.table(profile.kernels_of(ncu.read_text()), rows):
                phases[(*_key(r), r["phase"])] = r
        except ValueError:
            pass  # ncu wrote no CSV: the columns stay empty
    by_size = {(*_key(r), int(r["numel"])): r for r in staged}
    direct_by = {(*_key(r), int(r["numel"])): r for r in direct}
    sizes = _sizes(staged)
    keys = list(dict.fromkeys([_key(r) for r in kernels] + [_key(r) for r in staged]))

    head = ["codec", "params", "enc × ref", "dec × ref", "enc DRAM × ideal"]
    head += ["dec DRAM × ideal", "occupancy enc/dec", "limiter enc/dec"]
    head += [f"{n / 1e6:g}M × staged MPI_Allreduce" for n in sizes]
    head += [f"{n / 1e6:g}M staged / direct" for n in _sizes(direct)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    kernel_of = {_key(r): r for r in kernels}
    for key in keys:
        k = kernel_of.get(key, {})
        ref = k.get("fft_pair_gbps") if key[0] == "fft" else k.get("memcpy_gbps")
        enc = k.get("encode_gbps") / ref if k and ref else None
        dec = k.get("decode_gbps") / ref if k and ref else None
        e, d = phases.get((*key, "encode")), phases.get((*key, "decode"))

        def over_ideal(p):
            return p["dram_bytes"] / p["ideal_bytes"] if p and p["ideal_bytes"] else None

        cells = [f"`{key[0]}`", key[1] + (" (ref: rfft+irfft)" if key[0] == "fft" else "")]
        cells += [_fmt(enc), _fmt(dec), _fmt(over_ideal(e)), _fmt(over_ideal(d))]
        cells.append(f"{e['occupancy']:.0f}/{d['occupancy']:.0f} %" if e and d else "")
        cells.append(f"{e['limiter']}/{d['limiter']}" if e and d else "")
        for n in sizes:
            r = by_size.get((*key, n))
            cells.append(
                _fmt(r.get("allreduce_staged_s", r["allreduce_s"]) / r["time_s"]) if r else ""
            )
        for n in _sizes(direct):
            s, dr = by_size.get((*key, n)), direct_by.get((*key, n))
            cells.append(_fmt(s["time_s"] / dr["time_s"]) if s and dr else "")
        lines.append("| " + " | ".join(cells) + " |")
    refs = []
    for n in _sizes(direct):
        r = next((r for r in direct if int(r["numel"]) == n), None)
        if r and r.get("allreduce_direct_s"):
            refs.append(
                f"{n / 1e6:g}M: MPI_Allreduce staged {1e3 * r['allreduce_staged_s']:.2f} ms, "
                f"direct {1e3 * r['allreduce_direct_s']:.2f} ms"
            )
    return "\n".join(lines) + "\n" + "".join(f"\n{line}" for line in refs) + ("\n" if refs else "")


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        print(
            "usage: python -m mpicomp.tools.bench.lane OUT (the lane's output folder)",
            file=sys.stderr,
        )
        return 2
    sys.stdout.write(summarize(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
