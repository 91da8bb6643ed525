"""What every command of the ``mpicomp`` CLI prints, read as a user and a script would:
numbers as numbers in every ``--json``, and every table and note within 120 columns
(one process; docs/running.md)."""

import json
import re

import numpy as np
import pytest

from mpicomp.tools import cli

# A number written as text, with or without a unit: "45.8x", "13%", "3.3 ms", "1,384".
NUMBER_AS_TEXT = re.compile(
    r"^\s*[-+]?(\d[\d,]*(\.\d*)?|\.\d+)(e[-+]?\d+)?\s*"
    r"(x|%|ms|us|s|b|kb|mb|gb|kib|mib|gib|gb/s|gbit/s|bits?|k|m|g)?\s*$",
    re.IGNORECASE,
)


def numbers_as_text(doc, where: str = "") -> list[str]:
    """Return ``where: value`` of every string in ``doc`` that is a number written as
    text; a version ("MPI standard": "5.0", "*version*") is text on purpose."""
    if isinstance(doc, dict):
        return [
            hit
            for key, value in doc.items()
            if not ("version" in str(key).lower() or key == "MPI standard")
            for hit in numbers_as_text(value, f"{where}.{key}")
        ]
    if isinstance(doc, list):
        return [hit for i, v in enumerate(doc) for hit in numbers_as_text(v, f"{where}[{i}]")]
    if isinstance(doc, str) and NUMBER_AS_TEXT.match(doc):
        return [f"{where}: {doc!r}"]
    return []


def test_the_walker_finds_numbers_written_as_text():
    doc = {"rows": [{"ratio": "45.8x", "encode": "13%", "p50": "3.3 ms", "sent": "1,384"}]}
    doc["fine"] = {"codec": "signsgd", "schedule": "float32/ring", "ratio": 45.8, "n": None}
    doc["mpicomp_version"] = "0.1"
    doc["MPI standard"] = "5.0"
    assert numbers_as_text(doc) == [
        ".rows[0].ratio: '45.8x'",
        ".rows[0].encode: '13%'",
        ".rows[0].p50: '3.3 ms'",
        ".rows[0].sent: '1,384'",
    ]


def _trace(path, calls=3):
    from mpi4py import MPI

    import mpicomp

    with mpicomp.CompressedComm(MPI.COMM_SELF, "signsgd", min_numel=64, trace=path) as cc:
        for _ in range(calls):
            cc.allreduce(np.ones(1000, np.float32), name="encoder.layers.11.attention.w" * 3)
            cc.allreduce(np.ones(10, np.float32), name="b")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every command's text and --json output, run once: {argv as text: stdout}."""
    import contextlib
    import io

    tmp = tmp_path_factory.mktemp("cli")
    _trace(tmp / "run.h5")
    _trace(tmp / "other.h5", calls=1)
    bench_json = tmp / "bench.json"
    commands = [
        ["info"],
        ["info", "--all-ranks"],
        ["bench", "--numel", "4K", "--reps", "1", "--codecs", "signsgd,qsgd_maxnorm:bits=4", "-q"],
        ["advise", "1gbit", "--bench", str(bench_json)],
        ["advise", "1gbit", "--bench", str(bench_json), "--codecs", "qsgd_maxnorm:bits=4"],
        ["advise", "1gbit", "--bench", str(bench_json), "--sizes", "4K,25.6M", "--hosts", "4"]
        + ["--ranks-per-host", "2"],
        ["trace", "summary", str(tmp / "run.h5")],
        ["trace", "summary", str(tmp)],
    ]
    out = {}
    for argv in commands:
        for json_too in (False, True):
            args = [*argv, "--json"] if json_too else argv
            text = io.StringIO()
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
                assert cli.main(args) == 0, args
            out[" ".join(args)] = text.getvalue()
            if argv[0] == "bench" and json_too:
                bench_json.write_text(text.getvalue())
    return out


def test_every_json_has_numbers_as_numbers(outputs):
    docs = {argv: json.loads(text) for argv, text in outputs.items() if argv.endswith("--json")}
    assert len(docs) == 8
    for argv, doc in docs.items():
        assert numbers_as_text(doc) == [], argv
    summary = docs[next(a for a in docs if a.startswith("trace summary") and "run.h5" in a)]
    (w, b, total) = summary["rows"]
    assert w["calls"] == 2 and w["warmup_calls"] == 1 and isinstance(w["p90_ms"], float)
    assert w["ratio"] is None and w["sent_per_call"] == 0.0  # one rank sends nothing
    assert 0 <= w["encode_share"] <= 1 and b["codec"] == "none" and total["calls"] == 4
    (one,) = [d for a, d in docs.items() if "qsgd_maxnorm:bits=4 --json" in a and "advise" in a]
    assert [(r["codec"], r["params"]) for r in one] == [("qsgd_maxnorm", {"bits": 4})]
    assert isinstance(one[0]["rel_error"], float)  # the error it adds, beside its speed
    directory = [d for a, d in docs.items() if a.startswith("trace summary") and a.count("/")]
    assert any(isinstance(d, list) and len(d) == 2 for d in directory)  # one per file


def test_every_table_and_note_fits_120_columns(outputs):
    texts = {argv: text for argv, text in outputs.items() if not argv.endswith("--json")}
    assert len(texts) == 8
    for argv, text in texts.items():
        lines = text.splitlines()
        assert lines and max(map(len, lines)) <= 120, (argv, max(lines, key=len))


def test_advise_shows_the_error_each_codec_adds_and_points_to_the_codec_guide(outputs):
    text = next(t for a, t in outputs.items() if a.startswith("advise 1gbit") and a.count(" ") == 3)
    head = next(line for line in text.splitlines() if line.startswith("codec"))
    assert head.split()[-1] == "rel.err"
    rows = [line.split() for line in text.splitlines() if line.startswith(("signsgd", "qsgd"))]
    assert [r[0] for r in rows] == ["signsgd", "qsgd_maxnorm:bits=4"]
    assert all(0 < float(r[-1]) < 2 for r in rows)
    flat = " ".join(text.split())
    assert "rel.err = ||decode(encode(g)) - g|| / ||g|| for one call" in flat
    assert "above 1 is expected of the sparse codecs" in flat and "docs/choosing.md" in flat


def test_a_listing_wraps_an_item_longer_than_a_line_within_it():
    from mpicomp.tools.table import listing

    version = "MPI version: Open MPI v5.0.11, package: Open MPI user@localhost Distribution, " * 2
    out = listing("on every rank:", ["a: 1", version.strip(), "b: 2"], width=120)
    assert max(len(line) for line in out) <= 120
    assert " ".join(" ".join(out).split()).count("Open MPI v5.0.11") == 2
    assert out[0] == "on every rank: a: 1;" and out[-1].endswith("b: 2")
