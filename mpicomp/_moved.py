"""Module paths that moved when mpicomp's modules were grouped into folders by role:
importing an old path gives the module at its new one, with a DeprecationWarning naming
it, so code written against the flat layout keeps working while it is updated.

A finder on ``sys.meta_path`` (installed by ``mpicomp/__init__.py``) rather than a file
per old path: the old names stay out of the tree, and nothing is imported before it is
asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings

#: Old dotted path -> new one (their submodules follow: ``mpicomp.bench.lane``).
MOVED = {
    "mpicomp.trace_report": "mpicomp.trace.report",
    "mpicomp.trace_export": "mpicomp.trace.export",
    "mpicomp.options": "mpicomp.call.options",
    "mpicomp.schedules": "mpicomp.model.cost",
    "mpicomp.cli": "mpicomp.tools.cli",
    "mpicomp.advise": "mpicomp.tools.advise",
    "mpicomp.diagnostics": "mpicomp.tools.diagnostics",
    "mpicomp.bench": "mpicomp.tools.bench",
}


def new_name(name: str) -> str | None:
    """Return where module ``name`` lives now, or None if it did not move."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


_IMPORTLIB = os.path.dirname(importlib.__file__)


def _caller_level() -> int:
    """Return the stacklevel, from ``_Loader.create_module``, of the line that imported:
    past importlib's frames (its frozen bootstrap, which ``warnings`` does not count, and
    ``importlib.import_module``, which it does)."""
    level, frame = 2, sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
        elif name.startswith(_IMPORTLIB):
            frame, level = frame.f_back, level + 1
        else:
            break
    return level


class _Loader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} moved to {self.new}; import it from there",
            DeprecationWarning,
            stacklevel=_caller_level(),
        )
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        """The module at its new path has run already."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        new = new_name(name)
        return None if new is None else importlib.util.spec_from_loader(name, _Loader(new))


_FINDER = _Finder()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
