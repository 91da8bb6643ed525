"""Progress lines of a benchmark: each item as it starts, its place, and the time left,
estimated from the items done so far (nothing is said before one is done)."""

from __future__ import annotations

import time


class Countdown:
    """Print ``bench: WHAT (i/total, about T left)`` on ``stream`` as each item starts."""

    def __init__(self, total: int, stream, clock=time.monotonic):
        self.total, self.stream, self.clock = total, stream, clock
        self.done = 0
        self.start = clock()

    def next(self, what: str) -> None:
        if self.stream is None:
            return
        left = ""
        if self.done:
            seconds = (self.clock() - self.start) / self.done * (self.total - self.done)
            left = f", about {_duration(seconds)} left"
        self.done += 1
        print(f"bench: {what} ({self.done}/{self.total}{left})", file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    return f"{seconds / 60:.0f} min"
