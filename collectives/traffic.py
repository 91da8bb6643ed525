"""What a collective reports: bytes sent and received per message step.

Every collective takes ``recorder=None``; when given, it calls
``recorder.record(op, step, sent, recv, bits)`` once per exchange step, where ``op``
names the phase (e.g. ``"ring.reduce_scatter"``), ``step`` counts from 1 within the
phase, ``sent``/``recv`` are the bytes this rank put on / took off the wire in that
step, and ``bits`` is the per-element width used (0 where it does not apply).
mpicomp's HDF5 `Tracer` implements this method; ``Traffic`` below is the plain counter.
"""

from __future__ import annotations


class Traffic:
    """Sum the bytes a rank sends and receives; keep each step for inspection."""

    def __init__(self):
        self.sent = 0
        self.recv = 0
        self.steps: list[tuple[str, int, int, int, int]] = []

    def record(self, op: str, step: int, sent: int, recv: int, bits: int = 0) -> None:
        """Add one exchange step."""
        self.sent += sent
        self.recv += recv
        self.steps.append((op, step, sent, recv, bits))

    def by_op(self) -> dict[str, tuple[int, int]]:
        """Return {op: (sent, recv)} summed over steps."""
        out: dict[str, tuple[int, int]] = {}
        for op, _, s, r, _ in self.steps:
            a, b = out.get(op, (0, 0))
            out[op] = (a + s, b + r)
        return out
