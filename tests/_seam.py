"""A kernel backend that forwards every launcher of the numba backend and counts calls,
registered by the documented mechanism (``mpicomp.kernels.register_backend``)."""

from collections import Counter
from types import SimpleNamespace

import mpicomp.kernels as K


def counting_record(calls: Counter, name: str = "counting") -> SimpleNamespace:
    """Return a record whose launchers call the numba ones and count ``family.launcher``."""
    numba = K.backend("numba")

    def forward(key, fn):
        def launcher(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return launcher

    families = {
        fam: SimpleNamespace(
            **{k: forward(f"{fam}.{k}", fn) for k, fn in K.launchers(numba, fam).items()}
        )
        for fam in K.FAMILIES
    }
    return SimpleNamespace(name=name, xp=numba.xp, **families)


def poison(monkeypatch, record) -> None:
    """Make every launcher of ``record`` raise: a call that bypasses the seam fails."""

    def refuse(key):
        def launcher(*args, **kwargs):
            raise AssertionError(f"{key} of the numba record was called around the seam")

        return launcher

    for fam in K.FAMILIES:
        family = getattr(record, fam)
        for k in K.launchers(record, fam):
            monkeypatch.setattr(family, k, refuse(f"{fam}.{k}"))
