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


# Per codec, per parameter: values it refuses (ranges, NaN, a str for a number).
BAD_VALUES = {
    "topk": {"ratio": [0, 1.5, float("nan"), "0.1"]},
    "signsgd": {"tie": ["zero"], "seed": [-1]},
    "threelc": {"sparsity": [2.0, 0.5]},
    "fft": {"theta": [1.0], "bits": [3, 17]},
    "fastsgd": {"base": [1.0], "tau": [0, 128], "flag_bits": [6]},
    "qsgd_maxnorm": {"bits": [1, 17, 4.5]},
    "grandk_maxnorm": {"k": [0]},
}


@pytest.mark.parametrize(
    "name, param, value",
    [(n, p, v) for n, params in BAD_VALUES.items() for p, values in params.items() for v in values],
)
def test_bad_parameter_value_names_the_parameter(name, param, value):
    # A number parameter given no number at all is a TypeError ('tie' takes a str).
    wrong_type = isinstance(value, (str, bool)) and param != "tie"
    with pytest.raises(TypeError if wrong_type else ValueError, match=param):
        mpicomp.codec(name, **{param: value})
