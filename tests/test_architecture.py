"""The core stays one a newcomer can follow (docs/architecture.md): the aggregation kinds
are named only inside ``mpicomp.reduction``, and no module outside ``mpicomp/comm.py``
reaches into CompressedComm's private names (adapters use its public seam)."""

import ast
from pathlib import Path

from mpicomp.comm import CompressedComm
from mpicomp.reduction import KINDS

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("mpicomp", "kernels", "collectives", "jobs")


def _files(skip=()):
    for d in SOURCES:
        for path in sorted((ROOT / d).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(skip):
                yield rel, ast.parse(path.read_text(encoding="utf-8"), rel)


def _kind_tests(tree) -> list[int]:
    """Return the lines of ``tree`` that test a value against an aggregation kind's name
    (or test a codec's ``aggregation`` at all): comparisons and lookups by those names."""
    names = set(KINDS)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for side in sides:
                if isinstance(side, ast.Constant) and side.value in names:
                    lines.append(node.lineno)
                elif isinstance(side, ast.Attribute) and side.attr == "aggregation":
                    lines.append(node.lineno)
                elif isinstance(side, ast.Tuple | ast.List | ast.Set) and any(
                    isinstance(e, ast.Constant) and e.value in names for e in side.elts
                ):
                    lines.append(node.lineno)
        elif isinstance(node, ast.Subscript):
            key = node.slice
            if (isinstance(key, ast.Constant) and key.value in names) or (
                isinstance(key, ast.Attribute) and key.attr == "aggregation"
            ):
                lines.append(node.lineno)
        elif isinstance(node, ast.Dict):
            if any(isinstance(k, ast.Constant) and k.value in names for k in node.keys):
                lines.append(node.lineno)
    return sorted(set(lines))


def test_the_finder_sees_a_kind_test():
    tree = ast.parse(
        'if codec.aggregation == "gather": pass\nx = T["majority"]\ny = a in ("sum", 1)'
    )
    assert _kind_tests(tree) == [1, 2, 3]
    assert _kind_tests(ast.parse('aggregation = "gather"\nf("majority")')) == []


def test_aggregation_kinds_are_named_only_in_the_reduction_package():
    found = {
        rel: lines
        for rel, tree in _files(skip=("mpicomp/reduction/",))
        if (lines := _kind_tests(tree))
    }
    assert not found, f"aggregation kinds tested outside mpicomp/reduction: {found}"


def _private_names() -> set[str]:
    """CompressedComm's private methods and attributes (set in its methods)."""
    names = {n for n in vars(CompressedComm) if n.startswith("_") and not n.startswith("__")}
    tree = ast.parse((ROOT / "mpicomp" / "comm.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            names.add(node.attr)
    return names


def _reaches_in(tree, private: set[str]) -> list[str]:
    """Return ``line: expr`` of accesses to ``private`` on anything but ``self``/``cls``."""
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in private
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_private_finder_sees_a_reach():
    private = {"_comm", "_drain"}
    tree = ast.parse("a = cc._comm\nself._comm = 1\nself.comm._drain()")
    assert _reaches_in(tree, private) == ["1: cc._comm", "3: self.comm._drain"]


def test_nothing_outside_comm_uses_compressed_comm_privates():
    private = _private_names()
    assert {"_comm", "_average", "_drain", "_check_open"} <= private
    found = {
        rel: hits
        for rel, tree in _files(skip=("mpicomp/comm.py",))
        if (hits := _reaches_in(tree, private))
    }
    assert not found, f"CompressedComm's private names used outside comm.py: {found}"
