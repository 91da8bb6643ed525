"""Exceptions and warnings raised by mpicomp (all importable from ``mpicomp`` too)."""


class PayloadError(ValueError):
    """A wire payload is truncated, corrupted, or was made by another codec or version."""


class RankError(RuntimeError):
    """Another rank failed, or ranks disagree, in the same collective call.

    Raised on the ranks whose own input was fine; the rank that failed raises its own
    error (a ``ValueError`` or ``TypeError`` naming the problem)."""


class PeerClosed(RankError):
    """Another rank closed the CompressedComm while this rank called it.

    The call does not run, and the CompressedComm is closed on this rank too: a later
    call raises ``RuntimeError``."""


class NonFiniteWarning(RuntimeWarning):
    """A call was skipped on every rank because some rank's gradient held NaN or Inf."""
