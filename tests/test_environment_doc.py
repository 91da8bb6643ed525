"""docs/environment.md lists every environment variable mpicomp reads, and only those.

The variables are found in the sources, not in a list kept by hand: in Python (the AST)
every ``os.environ.get(X)``, ``os.getenv(X)``, ``os.environ[X]``, ``X in os.environ`` and
``env_flag(X)``, where ``X`` is a string, a module constant (imported or not), a loop
over a tuple or dict of names, or a name assigned from such a dict; in the C++/CUDA
sources every ``getenv("X")``. A read whose name cannot be worked out fails the test:
name the variable with a constant.

The page's tables say who reads each variable (a ``read by`` column; a table without one
is mpicomp's own). A row read by mpicomp must be read by the library, a row read by the
test suite by the tests, and a variable the library reads must have a row that says so.
"""

from __future__ import annotations

import ast
import re
import textwrap
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "environment.md"

# The library's source folders and the package each is installed as (setup.py).
LIBRARY = {
    "mpicomp": "mpicomp",
    "kernels": "mpicomp.kernels",
    "collectives": "mpicomp.collectives",
    "jobs": "jobs",
}
C_SOURCES = ("*.cu", "*.cuh", "*.h", "*.c", "*.cpp")
GETENV = re.compile(r"\bgetenv\s*\(\s*\"([^\"]+)\"")

# Functions that read the variable named by their first argument: their calls are the
# reads (their own body reads a parameter).
READERS = {"env_flag": "mpicomp/env.py"}

# Variables the library reads that the page leaves out, each with why.
NOT_SETTINGS = {
    # Set for CuPy's NVRTC around one compile (kernels/cuda/compile_check.py), read only
    # to put the caller's value back.
    "CUPY_CACHE_IN_MEMORY",
}

NAME = re.compile(r"[A-Z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+_?")


# ---- the sources -------------------------------------------------------------------------


class Module:
    """One parsed Python file: its tree, parents, globals and imports."""

    def __init__(self, rel: str, dotted: str, text: str):
        self.rel, self.dotted = rel, dotted
        self.tree = ast.parse(text, rel)
        self.parent = {c: p for p in ast.walk(self.tree) for c in ast.iter_child_nodes(p)}
        self.globals = {}
        self.imports = {}  # alias: (module, attribute or None)
        for node in self.tree.body:
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        self.globals[t.id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.globals[node.target.id] = node.value
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.imports[a.asname or a.name.split(".")[0]] = (
                        (a.name, None) if a.asname else (a.name.split(".")[0], None)
                    )
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    self.imports[a.asname or a.name] = (node.module, a.name)


class Unresolved(Exception):
    """A read whose variable name the scan cannot work out."""


class Scan:
    """The variables a set of Python files read, by file and line."""

    def __init__(self, modules: list[Module], context: list[Module] = ()):
        # ``context``: more modules whose constants a read may import
        self.by_dotted = {m.dotted: m for m in [*context, *modules]}
        self.reads: dict[str, set[str]] = {}  # variable: {"file:line"}
        self.unresolved: list[str] = []
        for m in modules:
            for node, key in self._sites(m):
                try:
                    names = self._strings(m, key)
                except Unresolved as e:
                    self.unresolved.append(f"{m.rel}:{node.lineno}: {ast.unparse(key)} ({e})")
                    continue
                for name in names:
                    self.reads.setdefault(name, set()).add(f"{m.rel}:{node.lineno}")

    @staticmethod
    def _is_environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ"
        )

    def _sites(self, m: Module):
        """Yield (node, key expression) of every environment read in ``m``."""
        skip = {fn for fn, rel in READERS.items() if rel == m.rel}
        for node in ast.walk(m.tree):
            if self._inside(m, node, skip):
                continue
            if isinstance(node, ast.Call) and node.args:
                f = node.func
                if isinstance(f, ast.Attribute) and f.attr in ("get", "setdefault"):
                    if self._is_environ(f.value):
                        yield node, node.args[0]
                elif isinstance(f, ast.Attribute) and f.attr in ("getenv", *READERS):
                    yield node, node.args[0]
                elif isinstance(f, ast.Name) and f.id in ("getenv", *READERS):
                    yield node, node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                if self._is_environ(node.value):
                    yield node, node.slice
            elif isinstance(node, ast.Compare):
                for op, right in zip(node.ops, node.comparators, strict=True):
                    if isinstance(op, ast.In | ast.NotIn) and self._is_environ(right):
                        yield node, node.left

    @staticmethod
    def _inside(m: Module, node, functions: set[str]) -> bool:
        while node in m.parent:
            node = m.parent[node]
            if isinstance(node, ast.FunctionDef) and node.name in functions:
                return True
        return False

    def _strings(self, m: Module, expr, want="keys") -> set[str]:
        """Return the strings ``expr`` can be (a dict's keys, or its values if ``want``)."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return {expr.value}
        if isinstance(expr, ast.Tuple | ast.List | ast.Set):
            return set().union(*(self._strings(m, e) for e in expr.elts))
        if isinstance(expr, ast.Dict):
            parts = expr.keys if want == "keys" else expr.values
            return set().union(*(self._strings(m, e) for e in parts))
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            method, of = expr.func.attr, expr.func.value
            if method == "get":  # {...}.get(k): one of the dict's values
                return self._strings(m, of, "values")
            if method in ("keys", "values"):
                return self._strings(m, of, method)
        if isinstance(expr, ast.Name):
            return self._name(m, expr, want)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            target = m.imports.get(expr.value.id)
            if target:
                module = self._module(*target)
                if module and expr.attr in module.globals:
                    return self._strings(module, module.globals[expr.attr], want)
        raise Unresolved("not a string, a constant or a loop over constants")

    def _module(self, module: str, attr: str | None) -> Module | None:
        full = f"{module}.{attr}" if attr else module
        return self.by_dotted.get(full) or self.by_dotted.get(module)

    def _name(self, m: Module, name: ast.Name, want: str) -> set[str]:
        scope, ancestors = name, []
        while scope in m.parent:  # the innermost binding first
            scope = m.parent[scope]
            ancestors.append(scope)
            if isinstance(scope, ast.FunctionDef | ast.Lambda):
                found = self._bound_in(m, scope, name, ancestors, want)
                if found is not None:
                    return found
        if name.id in m.globals:
            return self._strings(m, m.globals[name.id], want)
        if name.id in m.imports:
            module, attr = m.imports[name.id]
            source = self.by_dotted.get(module)
            if source and attr in source.globals:
                return self._strings(source, source.globals[attr], want)
        raise Unresolved(f"{name.id} is not bound to constants")

    def _bound_in(self, m: Module, fn, use: ast.Name, ancestors, want: str) -> set[str] | None:
        """Return what ``use`` is bound to in ``fn``: by the loop it is in, else by the
        last assignment above it; None when ``fn`` does not bind it."""
        name, args = use.id, fn.args
        if name in {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}:
            raise Unresolved(f"{name} is a parameter")
        loops = [a for a in ancestors if isinstance(a, ast.For)]
        loops += [g for a in ancestors if hasattr(a, "generators") for g in a.generators]
        for loop in loops:
            target = loop.target
            if isinstance(target, ast.Name) and target.id == name:
                return self._strings(m, loop.iter)
            if isinstance(target, ast.Tuple):
                names = [e.id if isinstance(e, ast.Name) else None for e in target.elts]
                if name not in names:
                    continue
                f = loop.iter.func if isinstance(loop.iter, ast.Call) else None
                if isinstance(f, ast.Attribute) and f.attr == "items":
                    part = "keys" if names.index(name) == 0 else "values"
                    return self._strings(m, f.value, part)
                raise Unresolved(f"{name} unpacked from {ast.unparse(loop.iter)}")
        above = [
            node
            for node in ast.walk(fn)
            if isinstance(node, ast.Assign)
            and node.lineno <= use.lineno
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        ]
        if above:
            return self._strings(m, max(above, key=lambda n: n.lineno).value, want)
        return None


def _modules(folders: dict[str, str]) -> list[Module]:
    out = []
    for folder, package in folders.items():
        base = ROOT / folder
        paths = [base] if base.is_file() else sorted(base.rglob("*.py"))
        for path in paths:
            rel = path.relative_to(ROOT).as_posix()
            parts = list(path.relative_to(base).with_suffix("").parts) if base.is_dir() else []
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            dotted = ".".join([package, *parts])
            out.append(Module(rel, dotted, path.read_text(encoding="utf-8")))
    return out


def c_reads(root: Path = ROOT) -> dict[str, set[str]]:
    """Return the variables the C++/CUDA sources read with ``getenv``, by file and line."""
    reads: dict[str, set[str]] = {}
    for folder in LIBRARY:
        for pattern in C_SOURCES:
            for path in sorted((root / folder).rglob(pattern)):
                for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    for name in GETENV.findall(line):
                        where = f"{path.relative_to(root).as_posix()}:{i}"
                        reads.setdefault(name, set()).add(where)
    return reads


@cache
def library_scan() -> Scan:
    return Scan(_modules(LIBRARY))


@cache
def suite_scan() -> Scan:
    return Scan(_modules({"tests": "tests", "conftest.py": "conftest"}), _modules(LIBRARY))


# ---- the page ------------------------------------------------------------------------------


def page_rows(text: str) -> list[tuple[str, str]]:
    """Return (variable, read by) of every row of the page's tables ("mpicomp" where a
    table has no ``read by`` column)."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set(line) <= set("|-: "):
            continue
        who = cells[header.index("read by")] if "read by" in header else "mpicomp"
        for name in re.findall(r"`([^`=]+)(?:=[^`]*)?`", cells[0]):
            if NAME.fullmatch(name):
                rows.append((name, who))
    return rows


# ---- the tests -----------------------------------------------------------------------------


def test_the_scan_finds_every_kind_of_read():
    m = Module(
        "example.py",
        "example",
        textwrap.dedent(
            """
            import os
            from mpicomp.env import env_flag
            ENV = "A_ONE"
            NAMES = ("B_ONE", "B_TWO")
            HINTS = {"C_ONE": "lib", "C_TWO": "lib"}
            def f(vendor):
                os.environ.get(ENV)
                os.getenv("D_ONE")
                x = os.environ["E_ONE"]
                if "F_ONE" in os.environ:
                    pass
                env_flag("G_ONE")
                for var in NAMES:
                    os.environ.get(var)
                for var, lib in HINTS.items():
                    os.environ.get(var)
                off = {"x": "H_ONE", "y": "H_TWO"}.get(vendor)
                os.environ.get(off)
                os.environ["NOT_READ"] = "1"
            """
        ),
    )
    scan = Scan([m])
    want = {"A_ONE", "B_ONE", "B_TWO", "C_ONE", "C_TWO", "D_ONE", "E_ONE", "F_ONE", "G_ONE"}
    assert set(scan.reads) == want | {"H_ONE", "H_TWO"}
    assert scan.unresolved == []


def test_a_read_the_scan_cannot_name_fails():
    m = Module("example.py", "example", "import os\ndef f(name):\n    os.environ.get(name)\n")
    assert Scan([m]).unresolved == ["example.py:3: name (name is a parameter)"]


def test_the_scan_sees_the_library_read_what_it_is_known_to_read():
    reads = library_scan().reads
    # One of each way: a constant of the same module, an imported constant, a loop over a
    # tuple, a dict's keys, the boolean helper, a string in place.
    for name in (
        "MPICOMP_TIMEOUT",
        "MPICOMP_MODEL",
        "SLURM_LOCALID",
        "I_MPI_OFFLOAD",
        "MPICOMP_DEBUG",
        "XDG_CACHE_HOME",
    ):
        assert name in reads, name


def test_every_read_of_the_library_names_its_variable():
    assert library_scan().unresolved == []
    assert suite_scan().unresolved == []


def test_every_variable_the_library_reads_has_a_row_that_says_so():
    reads = {**library_scan().reads}
    for name, where in c_reads().items():
        reads.setdefault(name, set()).update(where)
    assert NOT_SETTINGS <= set(reads), "an exclusion no source reads any more"
    rows = page_rows(PAGE.read_text(encoding="utf-8"))
    ours = {name for name, who in rows if "mpicomp" in who}
    missing = {n: sorted(w) for n, w in reads.items() if n not in ours | NOT_SETTINGS}
    assert not missing, f"read by mpicomp, not in docs/environment.md as read by it: {missing}"


def test_every_row_read_by_mpicomp_is_read_by_it():
    reads = set(library_scan().reads) | set(c_reads())
    rows = page_rows(PAGE.read_text(encoding="utf-8"))
    assert len(rows) >= 20, rows
    stale = sorted(name for name, who in rows if "mpicomp" in who and name not in reads)
    assert not stale, f"docs/environment.md says mpicomp reads these; nothing does: {stale}"
    others = sorted(name for name, who in rows if "mpicomp" not in who and name in reads)
    assert not others, f"rows that leave mpicomp out of 'read by', though it reads them: {others}"


def test_the_test_suite_variables_are_the_ones_the_tests_read():
    reads = suite_scan().reads
    rows = page_rows(PAGE.read_text(encoding="utf-8"))
    documented = {name for name, who in rows if "test" in who}
    assert documented, "the page has no rows read by the test suite"
    stale = sorted(documented - set(reads))
    assert not stale, f"no test reads these: {stale}"
    # The tests also look at others' variables (NUMBA_CACHE_DIR, SLURM_*); mpicomp's own
    # names are what a developer sets.
    ours = {n for n in reads if n.startswith("MPICOMP_")}
    library = set(library_scan().reads)
    undocumented = sorted(ours - documented - library)
    assert not undocumented, (
        f"tests read these; docs/environment.md does not list them: {undocumented}"
    )


def test_the_c_scan_finds_getenv(tmp_path):
    (tmp_path / "kernels" / "cuda").mkdir(parents=True)
    (tmp_path / "kernels" / "cuda" / "x.cuh").write_text(
        'const char* a = std::getenv("MPICOMP_A");\nint b = getenv( "MPICOMP_B" ) != 0;\n'
    )
    assert c_reads(tmp_path) == {
        "MPICOMP_A": {"kernels/cuda/x.cuh:1"},
        "MPICOMP_B": {"kernels/cuda/x.cuh:2"},
    }


@pytest.mark.parametrize(
    "line, names",
    [
        ("| `MPICOMP_X` | does |", ["MPICOMP_X"]),
        ("| `A_B`, `C_D=1` | does |", ["A_B", "C_D"]),
        ("| `K` | a unit, not a variable |", []),
    ],
)
def test_page_rows_reads_the_variable_cells(line, names):
    text = f"| variable | what |\n| --- | --- |\n{line}\n"
    assert [n for n, _ in page_rows(text)] == names
