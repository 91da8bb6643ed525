"""mpicomp advise: Eq. 4 of the FFT sparsification paper and the all-reduce model, against
hand-computed values."""

import json
import math

import pytest

from mpicomp.tools import advise
from mpicomp.tools.cli import main


def _row(codec, bpe, enc, dec, **params):
    return {
        "codec": codec,
        "params": params,
        "encode_gbps": enc,
        "decode_gbps": dec,
        "bits_per_element": bpe,
    }


def test_parse_rate():
    assert advise.parse_rate("1gbit") == 10**9
    assert advise.parse_rate("10Gbit/s") == 10**10
    assert advise.parse_rate("100mbps") == 10**8
    for bad in ("1GB", "fast", "0gbit", "nanmbit", "infgbit"):
        with pytest.raises(ValueError, match="not a rate"):
            advise.parse_rate(bad)


def test_eq4_by_hand():
    # 10 Gbit/s = 1.25 GB/s; encode 5 GB/s and decode 5 GB/s: busy = 1.25*(0.2+0.2) = 0.5,
    # so k > 1/(1-0.5) = 2 (the paper's "k = 2 is enough on 10 Gbps Ethernet").
    assert advise.min_ratio(10e9, 5, 5) == pytest.approx(2.0)
    # Kernels slower than the link: no ratio pays.
    assert math.isinf(advise.min_ratio(100e9, 5, 5))
    # A slower link needs less: 1 Gbit/s -> busy 0.05 -> k > 1.0526.
    assert advise.min_ratio(1e9, 5, 5) == pytest.approx(1 / 0.95)


def test_ring_codec_model_by_hand():
    # signSGD-like ring codec at 1 bit, N = 4, 1 Gbit/s, enc = dec = 4 GB/s (1 ns/element).
    (a,) = advise.advise([_row("signsgd", 1.0, 4.0, 4.0)], 1e9, 4)
    plain = 1.5 * 4 / 125e6  # 2(N-1)/N * 4 bytes per element at 125 MB/s
    comp = 2e-9 + 1.5 * 4 / 32 / 125e6
    assert a["ratio"] == 32 and a["pays"]
    assert a["speedup"] == pytest.approx(plain / comp)
    # break-even: saved bytes per element / compute seconds per element
    assert a["break_even_gbit"] == pytest.approx(8 * (6 - 6 / 32) / 2e-9 / 1e9)


def test_gather_codec_decodes_every_payload():
    row = _row("threelc", 0.5, 4.0, 4.0, sparsity=1.5)
    (a2,) = advise.advise([row], 1e9, 2)
    (a8,) = advise.advise([row], 1e9, 8)
    # More ranks: more payloads to receive and decode, so a lower speedup and break-even.
    assert a8["speedup"] < a2["speedup"] and a8["break_even_gbit"] < a2["break_even_gbit"]
    comp8 = 1e-9 + 8 * 1e-9 + 7 * 4 / 64 / 125e6
    assert a8["speedup"] == pytest.approx((2 * 7 / 8 * 4 / 125e6) / comp8)


def test_rows_without_kernels_are_skipped_and_one_rank_refused():
    rows = [_row("qsgd_maxnorm", 8.0, 2.0, 2.0, bits=8), {"codec": "fft", "encode_gbps": None}]
    assert [a["codec"] for a in advise.advise(rows, 1e9, 4)] == ["qsgd_maxnorm"]
    with pytest.raises(ValueError, match="nranks"):
        advise.advise(rows, 1e9, 1)


def test_cli_reads_bench_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([_row("signsgd", 1.0, 4.0, 4.0), _row("none", 32.0, 10, 10)]))
    assert main(["advise", "1gbit", "--bench", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [a["codec"] for a in out] == ["signsgd", "none"]
    assert out[0]["pays"] and not out[1]["pays"]
    assert main(["advise", "1gbit", "--bench", str(path)]) == 0
    assert "break-even" in capsys.readouterr().out


def test_cli_bad_input(tmp_path, capsys):
    assert main(["advise", "fast"]) == 2
    assert "not a rate" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["advise", "1gbit", "--bench", str(bad)]) == 2
    assert "JSON list" in capsys.readouterr().err
    assert main(["advise", "1gbit", "--bench", str(tmp_path / "missing.json")]) == 2
    assert main(["advise", "1gbit", "--ranks", "1", "--bench", str(bad)]) == 2


def test_fp16_is_modelled_as_a_ring():
    (a,) = advise.advise([_row("fp16", 16.0, 10.0, 10.0)], 1e9, 4)
    plain = 1.5 * 4 / 125e6
    comp = 0.8e-9 + 1.5 * 2 / 125e6  # encode + decode at 10 GB/s, half the ring's bytes
    assert a["speedup"] == pytest.approx(plain / comp)


def test_codecs_take_parameters_as_the_codec_guide_writes_them(tmp_path, capsys):
    rows = [
        _row("qsgd_maxnorm", 8.25, 4.0, 4.0, bits=8),
        _row("qsgd_maxnorm", 4.25, 4.0, 4.0, bits=4),
    ]
    rows += [_row("signsgd", 1.0, 4.0, 4.0)]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    argv = ["advise", "1gbit", "--bench", str(path), "--json", "--codecs"]
    assert main([*argv, "qsgd_maxnorm:bits=4,signsgd"]) == 0
    picked = [(a["codec"], a["params"]) for a in json.loads(capsys.readouterr().out)]
    assert picked == [("qsgd_maxnorm", {"bits": 4}), ("signsgd", {})]
    assert main([*argv, "qsgd_maxnorm"]) == 0  # a bare name: every row of the codec
    assert len(json.loads(capsys.readouterr().out)) == 2
    for bad, says in (
        ("qsgd_maxnorm:bits=99", "bits must be an integer in [2, 16], got 99"),
        ("qsgd_maxnorm:4", "codec parameters are key=value, got '4'"),
        ("qsgd_maxnorm:bitz=4", "takes no parameter 'bitz'"),
    ):
        assert main([*argv, bad]) == 2, bad
        err = capsys.readouterr().err
        assert "usage: mpicomp advise" in err and says in err, err
    assert main([*argv, "qsgd_maxnorm:bits=2"]) == 2  # valid, but not measured in the file
    err = capsys.readouterr().err
    assert "no row of qsgd_maxnorm with bits=2" in err
    assert "`mpicomp bench --json --codecs qsgd_maxnorm:bits=2` measures it" in err


def test_advice_is_plain_json_with_the_error_each_codec_adds():
    fft = dict(_row("fft", 2.0, 0.1, 0.1), rel_error=0.75)
    (a,) = advise.advise([fft], 100e9, 4)  # kernels slower than the link: no ratio pays
    assert a["min_ratio"] is None and not a["pays"] and a["rel_error"] == 0.75
    json.dumps(a, allow_nan=False)  # no Infinity, which JSON does not have
    (b,) = advise.advise([_row("signsgd", 1.0, 4.0, 4.0)], 1e9, 4)
    assert b["rel_error"] is None  # a bench file without the column
