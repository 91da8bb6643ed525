"""The code blocks of README.md and docs/*.md run as tests (Sybil), so a doc that drifts
from the code fails ``make test``.

Every ```` ```python ```` block runs, in order, in one namespace per document; a
``<!-- invisible-code-block: python -->`` comment supplies what a block assumes (a
gradient, a model), and ``<!-- skip: next -->`` marks the rare block that cannot run
here (it says why). The blocks are written for any number of ranks, so they run in the
multi-rank lanes (``mpi`` marker: N = 1..5), each document in a fresh directory shared by
its ranks, which the blocks write their files into.
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).parent


def _enter_shared_directory(namespace: dict) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = comm.bcast(tempfile.mkdtemp(prefix="mpicomp-docs-") if comm.rank == 0 else None)
    namespace["_docs_dirs"] = (os.getcwd(), path)
    os.chdir(path)


def _leave_shared_directory(namespace: dict) -> None:
    from mpi4py import MPI

    back, path = namespace["_docs_dirs"]
    os.chdir(back)
    MPI.COMM_WORLD.Barrier()  # every rank is done with the files
    if MPI.COMM_WORLD.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md"],
    path=str(ROOT),
    setup=_enter_shared_directory,
    teardown=_leave_shared_directory,
).pytest()


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".md":
            item.add_marker(pytest.mark.mpi)
