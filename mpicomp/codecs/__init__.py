"""Compression codecs, one module per paper (and one for the baselines); pure array code, no MPI."""

from mpicomp.codecs import (  # noqa: F401  (register)
    baselines,
    fastsgd,
    fft,
    powersgd,
    qsgd,
    signsgd,
    threelc,
)
from mpicomp.codecs._base import Codec, available
from mpicomp.codecs._base import make as codec
from mpicomp.codecs.feedback import ErrorFeedback

__all__ = ["Codec", "ErrorFeedback", "available", "codec"]
