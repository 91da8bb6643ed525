"""The codec factory: names, parameters and their errors."""

import pytest

import mpicomp

ALL = {
    "none", "fp16", "topk", "signsgd", "threelc", "fft", "fastsgd", "qsgd_maxnorm",
    "qsgd_maxnorm_multiscale", "grandk_maxnorm", "grandk_maxnorm_multiscale", "powersgd",
}  # fmt: skip


def test_every_codec_of_the_design_is_available():
    assert set(mpicomp.codecs.available()) == ALL


@pytest.mark.parametrize("name", sorted(ALL))
def test_codec_has_name_aggregation_and_repr(name):
    c = mpicomp.codec(name)
    assert c.name == name
    assert c.aggregation in {"sum", "integer_sum", "majority", "gather", "low_rank"}
    assert repr(c).startswith(f"mpicomp.codec({name!r}")


def test_unknown_codec_names_the_choices():
    with pytest.raises(ValueError, match="unknown codec 'zstd'.*threelc"):
        mpicomp.codec("zstd")


@pytest.mark.parametrize("name", sorted(ALL))
def test_unknown_parameter_is_a_type_error(name):
    with pytest.raises(TypeError):
        mpicomp.codec(name, no_such_parameter=1)


@pytest.mark.parametrize(
    "name, params, param",
    [
        ("topk", {"ratio": 0}, "ratio"),
        ("topk", {"ratio": 1.5}, "ratio"),
        ("topk", {"ratio": float("nan")}, "ratio"),
        ("topk", {"ratio": "0.1"}, "ratio"),
        ("signsgd", {"tie": "zero"}, "tie"),
        ("signsgd", {"seed": -1}, "seed"),
        ("threelc", {"sparsity": 2.0}, "sparsity"),
        ("threelc", {"sparsity": 0.5}, "sparsity"),
        ("fft", {"theta": 1.0}, "theta"),
        ("fft", {"bits": 3}, "bits"),
        ("fft", {"bits": 17}, "bits"),
        ("fastsgd", {"base": 1.0}, "base"),
        ("fastsgd", {"tau": 0}, "tau"),
        ("fastsgd", {"tau": 128}, "tau"),
        ("fastsgd", {"flag_bits": 6}, "flag_bits"),
        ("qsgd_maxnorm", {"bits": 1}, "bits"),
        ("qsgd_maxnorm", {"bits": 17}, "bits"),
        ("qsgd_maxnorm", {"bits": 4.5}, "bits"),
        ("grandk_maxnorm", {"k": 0}, "k"),
    ],
)
def test_bad_parameter_value_names_the_parameter(name, params, param):
    # A number parameter given no number at all is a TypeError ('tie' takes a str).
    wrong_type = any(isinstance(v, (str, bool)) for k, v in params.items() if k != "tie")
    with pytest.raises(TypeError if wrong_type else ValueError, match=param):
        mpicomp.codec(name, **params)
