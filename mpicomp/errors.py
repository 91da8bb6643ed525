"""Exceptions raised by mpicomp."""


class PayloadError(ValueError):
    """A wire payload is truncated, corrupted, or was made by another codec or version."""
