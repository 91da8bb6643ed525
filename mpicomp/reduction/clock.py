"""The phase marks every schedule makes on its call's clock: ``encoded()`` after the
local encode, ``communicated()`` after the collective, ``decoded()`` after the decode.

A traced call's clock is ``mpicomp.trace``'s (it times the phases); an untraced one's is
``NO_CLOCK``, whose marks do nothing. Declared here, below the trace, so a schedule
depends on the protocol and not on the tracer.
"""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    def encoded(self) -> None: ...

    def communicated(self) -> None: ...

    def decoded(self) -> None: ...


class _NoClock:
    """The phase clock of an untraced call: every mark does nothing."""

    __slots__ = ()

    def encoded(self) -> None:
        pass

    def communicated(self) -> None:
        pass

    def decoded(self) -> None:
        pass


# Shared by every untraced call: three empty method calls, no clock reads.
NO_CLOCK: Clock = _NoClock()
