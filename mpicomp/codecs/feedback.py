"""Error feedback: residual memory per tensor, so a biased codec's error is sent later
instead of lost (the 3LC paper §3.1)."""

from __future__ import annotations

from mpicomp.codecs.arrays import KEPT, Unencodable, all_finite, as_gradient
from mpicomp.kernels import backend_of


class ErrorFeedback:
    """Wrap a gather codec with one residual buffer per tensor name.

    ``encode(x, name)`` compresses ``x + residual[name]`` and keeps what the
    payload failed to carry as the new residual. Codecs that can update the
    residual in their own encode pass (``fused_feedback = True``, e.g. 3LC) do
    so; for the others the residual is ``corrected - decode(payload)``. The
    residual lives on the device of the gradient.
    """

    def __init__(self, codec):
        if not (hasattr(codec, "encode") and hasattr(codec, "decode")):
            raise TypeError(
                f"error feedback wraps codecs of payloads (encode and decode), not {codec!r}"
            )
        self.codec = codec
        self._memory = {}
        self._spare = {}  # snapshot buffers, one per name, reused call after call
        self._loaded = set()  # names whose residual came from a checkpoint (messages)

    def encode(self, x, name: str = ""):
        """Return the payload of ``x`` plus the residual of ``name``; update the residual.

        Raises:
            ValueError: ``name`` already holds a residual of another shape (two tensors
                sharing one name would mix their errors).
        """
        x = as_gradient(x)
        xp = backend_of(x, self.codec.kernels).xp
        r = self._memory.get(name)
        if r is not None and r.shape != x.shape:
            if name in self._loaded:
                raise ValueError(
                    f"error feedback: the residual of tensor {name!r} loaded from a "
                    f"checkpoint has shape {r.shape}, this tensor {x.shape}: load the "
                    "checkpoint of this model (or forget(name) to start it from zero)"
                )
            raise ValueError(
                f"error feedback: tensor {name!r} had shape {r.shape}, now {x.shape}; "
                "give each tensor its own name"
            )
        if r is None or backend_of(r, self.codec.kernels).xp is not xp:
            r = self._memory[name] = xp.zeros(x.shape, dtype=xp.float32)
        if self.codec.fused_feedback:
            return self.codec.encode(x, residual=r)
        corrected = x + r
        try:
            payload = self.codec.encode(corrected)
        except ValueError as e:
            # Only on a refusal: a finite x that its kept error takes past float32 is
            # not x's own NaN/Inf.
            if all_finite(x, self.codec.kernels) and not all_finite(corrected, self.codec.kernels):
                message = f"error feedback: {name!r} plus its kept error overflows float32"
                raise Unencodable(message, KEPT) from e
            raise
        # A payload just made is trusted: GatherCodecBase's decode_local need not check it.
        local = getattr(self.codec, "decode_local", None)
        r[...] = corrected - (
            local(payload, corrected.shape) if local else self.codec.decode(payload)
        )
        return payload

    def decode(self, payload, numel: int | None = None):
        """Return the decoded array of ``payload`` (the wrapped codec's decode)."""
        return self.codec.decode(payload, numel=numel)

    def residual(self, name: str = ""):
        """Return the residual of ``name`` (None before its first encode)."""
        return self._memory.get(name)

    def snapshot(self, names, private: bool = False) -> Snapshot:
        """Copy the residuals of ``names`` aside, for ``Snapshot.restore`` to put back.

        The copies go to buffers kept per name and reused by the next snapshot of that
        name (no allocation per call in steady state), so a snapshot is only good until
        the next snapshot of the same name; ``private`` copies into new buffers instead,
        for a snapshot that must outlive the next one.
        """
        kept = []
        for name in names:
            r = self._memory.get(name)
            spare = None
            if r is not None and private:
                spare = r.copy()
            elif r is not None:
                spare = self._spare.get(name)
                if spare is None or spare.shape != r.shape or type(spare) is not type(r):
                    spare = self._spare[name] = backend_of(r, self.codec.kernels).xp.empty_like(r)
                spare[...] = r
            kept.append((name, spare))
        return Snapshot(self, kept)

    def forget(self, name: str) -> None:
        """Drop the residuals of ``name`` and of its shards (``name#shard<i>``)."""
        for key in [k for k in self._memory if k == name or k.startswith(f"{name}#shard")]:
            del self._memory[key]
            self._spare.pop(key, None)
            self._loaded.discard(key)

    def state_dict(self) -> dict:
        """Return copies of the residuals, keyed by tensor name, for a checkpoint."""
        return {k: v.copy() for k, v in self._memory.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore residuals saved by ``state_dict``."""
        self._memory = {k: as_gradient(v, what=f"residual {k!r}").copy() for k, v in state.items()}
        self._loaded = set(self._memory)


class Snapshot:
    """Residuals as ``ErrorFeedback.snapshot`` found them; ``restore()`` puts them back.

    A call that fails or is skipped restores its snapshot, so it changes no residual
    on any rank. A residual that did not exist yet is dropped again: a first call that
    failed (a size another rank refused) leaves nothing behind for the next one.
    """

    def __init__(self, feedback: ErrorFeedback, kept: list):
        self._feedback = feedback
        self._kept = kept  # (name, copy or None)

    def restore(self) -> None:
        """Put the residuals back as they were when the snapshot was taken."""
        memory = self._feedback._memory
        for name, copy in self._kept:
            r = memory.get(name)
            if copy is None:
                memory.pop(name, None)
            elif r is not None and r.shape == copy.shape and type(r) is type(copy):
                r[...] = copy
            else:  # the call replaced it (another size or device): the spare is reused later
                memory[name] = copy.copy()
