"""The core stays one a newcomer can follow (docs/architecture.md): the aggregation kinds
are named only inside ``mpicomp.reduction``, no module outside ``mpicomp/comm.py``
reaches into CompressedComm's private names (adapters use its public seam), tests use
no private name of the library without a reason listed here, every module of the call
path has a test named after it, and only ``collectives/_wait.py`` calls MPI."""

import ast
from pathlib import Path

from mpicomp.comm import CompressedComm
from mpicomp.reduction import AUTO, HIER, KINDS, all_schedule_names

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


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _reaches_in(tree, private: set[str]) -> list[str]:
    """Return ``line: expr`` of accesses to ``private`` on anything but ``self``/``cls``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private and not _on_self(node):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_private_finder_sees_a_reach():
    private = {"_comm", "_drain"}
    tree = ast.parse("a = cc._comm\nself._comm = 1\nself.comm._drain()")
    assert _reaches_in(tree, private) == ["1: cc._comm", "3: self.comm._drain"]


def test_nothing_outside_comm_uses_compressed_comm_privates():
    private = _private_names()
    assert {"_comm", "_average", "_runner", "_check_open"} <= private
    found = {
        rel: hits
        for rel, tree in _files(skip=("mpicomp/comm.py",))
        if (hits := _reaches_in(tree, private))
    }
    assert not found, f"CompressedComm's private names used outside comm.py: {found}"


# --- tests reach the library through its public seams ------------------------------------

TESTS = ROOT / "tests"

# The private names of the library a test uses where no public seam exists, by why:
# reason -> {name: the test files (in tests/) that use it}. A test may also import the
# private module it is named after (tests/test_wire.py: mpicomp.codecs._wire).
PRIVATE_IN_TESTS = {
    "forges the payloads a decoder must refuse: the wire format has no public builder": {
        "_wire": (
            "test_baselines.py",
            "test_fastsgd.py",
            "test_fft.py",
            "test_fuzz.py",
            "test_mpi_gather_sum.py",
            "test_payloads.py",
            "test_readback.py",
            "test_signsgd.py",
            "test_threelc.py",
        ),
        "_PREFIX": ("test_fuzz.py",),  # FastSGD's body prefix
    },
    "fakes a late request or an abort in the timeout, whose hooks have no public seam": {
        "_wait": ("conftest.py", "test_logging.py", "test_mpi_torch_reliability.py"),
    },
    "logs when each step's messages go, among the staged copies the stand-ins log": {
        "_wait": ("test_mpi_staging_pipeline.py",),
    },
    "counts the frames at _wait.ready, the last one before MPI": {
        "_wait": ("test_mpi_architecture.py",),
    },
    "forces top-k's exact selection, which a sampled bracket rarely leaves to it": {
        "_bracket": ("test_baselines.py",),
    },
    "the parser sphinx-argparse reads (docs/api/cli.rst): arguments parsed, not run": {
        "_parser": ("test_cli.py",),
    },
    "the CUDA twin's constant must equal the CPU kernel's": {
        "_CHUNK": ("test_cuda_fft.py",),
        "_MIN_SIDE": ("test_cuda_fft.py",),
        "_SUM_SPECTRA_MIN": ("test_cuda_fft.py",),
    },
    "removes the test's own backend: kernels has register_backend, no unregister": {
        "_REGISTRY": ("test_kernels_seam.py", "test_mpi_kernels_seam.py", "test_threads.py"),
        "_ARRAY_TYPES": ("test_kernels_seam.py",),  # nor unregister_array_type
    },
    "lowers a size threshold so that the larger messages' path runs at test sizes": {
        "_RING_CHUNK": ("test_mpi_allgather.py",),
        "_COUNT_LIMIT": ("test_mpi_allgather.py",),
        "_INLINE": ("test_mpi_maxallreduce.py",),
    },
    "resets the process-wide kept thread cap, so no later test inherits a one-CPU cap": {
        "_decided": ("test_threads.py", "test_mpi_threads.py"),
        "_applied": ("test_threads.py", "test_mpi_threads.py"),
    },
    "the stand-in devices build the CUDA sources as Device.cuda and Device.emulated do": {
        "_build": ("_devices.py",),
        "_emulated_build": ("_device_arrays.py",),
    },
    "jobs/_*.py are the jobs' shared helpers (not jobs to run), tested as such": {
        "_compare": ("test_jobs.py",),
        "_data": ("test_jobs.py",),
        "_mlp": ("test_jobs.py",),
        "_loop": ("test_jobs.py",),
        "_report": ("test_jobs.py",),
    },
    "changes one rank's configuration behind its back (made alike, it must agree)": {
        "_planner": ("test_mpi_agreement.py",),
        "_config": ("test_mpi_agreement.py",),
        "_plans": ("test_mpi_agreement.py",),
    },
    "a job's own helper, tested without running the job (minutes, hosts, other libraries)": {
        "_parse": ("test_netem.py", "test_peers.py"),
        "_reach": ("test_peers.py",),
        "_failure": ("test_peers.py",),
    },
}
_ALLOWED = {
    (f"tests/{test}", name)
    for uses in PRIVATE_IN_TESTS.values()
    for name, tests in uses.items()
    for test in tests
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree, attribute=lambda node: True) -> set[str]:
    """The names ``tree`` defines: its functions and classes, the names it assigns, and
    the attributes it sets where ``attribute(node)`` holds."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if attribute(node):
                names.add(node.attr)
    return names


def _library_privates() -> set[str]:
    """The private names the library and the jobs define: their private modules, and the
    private functions, classes and attributes (set anywhere) of their modules."""
    names = set()
    for rel, tree in _files():
        names |= {Path(rel).stem, *_defined(tree)}
    return {n for n in names if _private(n)}


def _own_names(tree) -> set[str]:
    """Names a test file defines itself (its helpers, their attributes, its arguments)."""
    arguments = {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
    return _defined(tree, _on_self) | arguments


def _subject(test: str) -> str:
    """The module a test file is named after: ``test_mpi_wire.py`` -> ``wire``."""
    return Path(test).stem.removeprefix("test_").removeprefix("mpi_")


def _test_reaches(tree, privates: set[str], subject: str = "") -> list[str]:
    """Return ``line: name`` of the library's private names a test uses: a private module
    or name imported from ``SOURCES`` (the module ``subject`` names excepted), an
    attribute among ``privates`` on anything but ``self``/``cls`` that the test does not
    define itself, and such a name given to ``setattr``/``getattr``/``delattr`` (or to
    ``monkeypatch``'s, also as ``"package.module._name"``)."""
    own, found = _own_names(tree), []

    def ours(module: str | None) -> bool:
        return bool(module) and module.split(".")[0] in SOURCES

    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and ours(node.module):
            names = node.module.split(".") + [a.name for a in node.names]
            names = [n for n in names if n.lstrip("_") != subject]
        elif isinstance(node, ast.Import):
            names = [p for a in node.names if ours(a.name) for p in a.name.split(".")]
            names = [n for n in names if n.lstrip("_") != subject]
        elif isinstance(node, ast.Attribute):
            if node.attr in privates and node.attr not in own and not _on_self(node):
                names = [node.attr]
        elif isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            strings = [
                a.value
                for a in node.args[:2]
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
            if called in ("setattr", "getattr", "delattr", "hasattr"):
                for s in strings:
                    parts = s.split(".") if "." in s and ours(s) else [s]
                    names += [p for p in parts if p in privates and p not in own]
        found += [(node.lineno, n) for n in names if _private(n)]
    return [f"{line}: {name}" for line, name in sorted(found)]


def test_the_test_finder_sees_a_private_name():
    privates = {"_transport", "_wire", "_bracket", "_cost", "_helper"}  # the library's
    tree = ast.parse(
        "from mpicomp.codecs import _wire\n"
        "import mpicomp.collectives._wait as w\n"
        "x = cc._transport.path\n"
        'monkeypatch.setattr(k, "_bracket", f)\n'
        'monkeypatch.setattr("mpicomp.kernels._helper", f)\n'
        "from mpicomp.reduction._cost import Cost\n"
        "y = os._exit\n"
        "from numpy import _core\n"
        "os.getpid()\n"
        "def _helper(): pass\n"
        "_helper()\n"
        "from mpicomp.call.intake import buckets as _buckets\n"
    )
    assert _test_reaches(tree, privates) == [
        "1: _wire",
        "2: _wait",
        "3: _transport",
        "4: _bracket",
        "6: _cost",
    ]
    assert _test_reaches(tree, privates, subject="cost") == [
        "1: _wire", "2: _wait", "3: _transport", "4: _bracket"
    ]  # fmt: skip
    own = ast.parse(
        "class Fake:\n    def __init__(self):\n        self._transport = 0\nFake()._transport"
    )
    assert _test_reaches(own, privates) == []  # the test's own stand-in
    assert _subject("tests/test_mpi_wire.py") == _subject("test_wire.py") == "wire"


def test_tests_use_no_private_name_of_the_library_without_a_reason():
    privates = _library_privates()
    assert {"_transport", "_runner", "_plans", "_wire", "_REGISTRY", "_compare"} <= privates
    found, used = {}, set()
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), rel)
        for hit in _test_reaches(tree, privates, _subject(rel)):
            name = hit.split(": ", 1)[1]
            if (rel, name) in _ALLOWED:
                used.add((rel, name))
            else:
                found.setdefault(rel, []).append(hit)
    assert not found, f"tests use private names of the library (use a public seam): {found}"
    assert used == _ALLOWED, f"stale: {_ALLOWED - used}"


# --- each module of the call path has a test named after it ------------------------------

#: The call path: each module has ``tests/test_<name>.py`` (or ``test_mpi_<name>.py``, for
#: ranks; a leading ``_`` dropped from the name) that imports it.
CALL_PATH = ("mpicomp/comm.py", "mpicomp/call", "mpicomp/reduction", "collectives")


def _call_path_modules() -> list[str]:
    out = []
    for entry in CALL_PATH:
        path = ROOT / entry
        for f in [path] if path.is_file() else sorted(path.glob("*.py")):
            if f.name != "__init__.py":
                out.append(f.relative_to(ROOT).as_posix())
    return out


def _installed(rel: str) -> str:
    """Return the module a file installs as: ``collectives/ring.py`` is
    ``mpicomp.collectives.ring`` (setup.py's package_dir)."""
    parts = list(Path(rel).with_suffix("").parts)
    if parts[0] in ("kernels", "collectives"):
        parts.insert(0, "mpicomp")
    return ".".join(parts)


def _modules_imported(tree) -> set[str]:
    """The modules ``tree`` imports: ``a.b`` of ``import a.b`` and of ``from a.b import
    c``, and ``a.b.c`` (c may be a module)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_the_import_finder_sees_a_module():
    tree = ast.parse(
        "import mpicomp.comm\n"
        "from mpicomp.collectives import ring\n"
        "from mpicomp.reduction._kind import Kind\n"
        "import mpicomp\n"
    )
    found = _modules_imported(tree)
    assert {"mpicomp.comm", "mpicomp.collectives.ring", "mpicomp.reduction._kind"} <= found
    assert "mpicomp.call.intake" not in found
    assert _installed("collectives/_wait.py") == "mpicomp.collectives._wait"
    assert _installed("mpicomp/call/intake.py") == "mpicomp.call.intake"
    assert "mpicomp/call/intake.py" in _call_path_modules()


def test_every_module_of_the_call_path_has_a_test_named_after_it():
    missing = []
    for rel in _call_path_modules():
        name, module = Path(rel).stem.lstrip("_"), _installed(rel)
        named = [TESTS / f"test_{name}.py", TESTS / f"test_mpi_{name}.py"]
        if not any(
            t.exists() and module in _modules_imported(ast.parse(t.read_text(encoding="utf-8")))
            for t in named
        ):
            missing.append(f"{rel}: tests/test_{name}.py importing {module}")
    assert not missing, f"call-path modules without a test named after them: {missing}"


# A literal equal to a schedule's name outside mpicomp/reduction/ that names something
# else: (file, literal) -> what it names. Everything else reads plans, not names.
NOT_SCHEDULES = {
    ("mpicomp/comm.py", "allreduce"): "the op of a call (the trace's op column)",
    ("mpicomp/comm.py", "allgather"): "the op of a call (the trace's op column)",
    ("mpicomp/comm.py", "float32"): "the allgather's wire precision",
    ("mpicomp/call/intake.py", "float32"): "a dtype",
    ("mpicomp/codecs/arrays.py", "float32"): "a dtype",
    ("mpicomp/call/options.py", "sharded"): "the keyword sharded= (its declaration, its field)",
    ("mpicomp/trace/report.py", "sharded"): "the trace attribute of the keyword sharded=",
    ("mpicomp/tools/bench/__init__.py", "allreduce"): "a benchmark row's key",
    ("mpicomp/tools/bench/lane.py", "allreduce"): "a benchmark row's key",
    ("mpicomp/tools/bench/allreduce.py", "direct"): "a device transport (direct or staged)",
    ("mpicomp/tools/bench/reduce_scatter.py", "allgather"): "a benchmark row's collective",
    ("mpicomp/tools/bench/report.py", "direct"): "a device transport (direct or staged)",
}


def _schedule_literals(tree) -> list[tuple[int, str]]:
    """Return (line, literal) of the strings in ``tree`` that are a schedule's name or
    begin with the hierarchical prefix (``"auto"`` is a choice, not a schedule)."""
    names = set(all_schedule_names()) - {AUTO}
    return sorted(
        {
            (node.lineno, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (node.value in names or node.value.startswith(HIER))
        }
    )


def test_the_schedule_finder_sees_a_name():
    tree = ast.parse('if s == "ring": pass\nx = f"hier:{y}"\nz = "a ring"\nw = "auto"')
    assert _schedule_literals(tree) == [(1, "ring"), (2, "hier:")]


def test_schedules_are_named_only_in_the_reduction_package():
    found, allowed = {}, set()
    for rel, tree in _files(skip=("mpicomp/reduction/",)):
        if not rel.startswith("mpicomp/"):
            continue
        for line, value in _schedule_literals(tree):
            if (rel, value) in NOT_SCHEDULES:
                allowed.add((rel, value))
            else:
                found.setdefault(rel, []).append(f"{line}: {value!r}")
    assert not found, f"schedule names written outside mpicomp/reduction (read a Plan): {found}"
    assert allowed == set(NOT_SCHEDULES), f"stale: {set(NOT_SCHEDULES) - allowed}"


# --- MPI calls only in collectives/_wait.py ---------------------------------------------

#: Methods of an mpi4py communicator that send no message or wait for no other rank.
LOCAL_MPI_PREFIXES = ("Get_", "Set_", "Is_", "Call_errhandler", "Compare")
NOT_MPI_CALLS = {
    "Free": "freeing a communicator waits for no other rank (MPI marks it for deallocation)",
    "free": "the same, mpi4py's spelling",
    "py2f": "a handle conversion",
    "f2py": "a handle conversion",
    "toint": "a handle conversion",
    "fromint": "a handle conversion",
}
#: Receivers (by their last name) whose methods share a name with an MPI method.
NOT_COMMUNICATORS = {
    "cc": "a CompressedComm: its allreduce is mpicomp's own",
    "topk": "a kernel family: its scatter is array code",
    "fastsgd": "a kernel family: its scan is array code",
    "fft": "a kernel family: its scatter is array code",
    "fk": "the FFT kernel family",
    "schedule": "a reduction Schedule: its alltoall is the cost of its messages",
}
MPI_HOME = "collectives/_wait.py"


def _mpi_methods() -> set[str]:
    """The methods of ``mpi4py.MPI.Intracomm`` that message other ranks (buffer calls
    and pickle-based ones)."""
    from mpi4py import MPI

    return {
        n
        for n in dir(MPI.Intracomm)
        if not n.startswith("_")
        and callable(getattr(MPI.Intracomm, n))
        and not n.startswith(LOCAL_MPI_PREFIXES)
        and n not in NOT_MPI_CALLS
    }


def _imported(tree) -> set[str]:
    """Names an import binds in ``tree`` (modules, functions: never a communicator)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _mpi_calls(tree, methods: set[str]) -> list[str]:
    """Return ``line: call`` of the MPI calls in ``tree``: a method of ``methods`` called
    on anything but an imported name or a ``NOT_COMMUNICATORS`` receiver, and
    ``getattr(x, "<an MPI method>")``."""
    imported, found = _imported(tree), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in methods:
            receiver = ast.unparse(f.value)
            root, last = receiver.split(".")[0], receiver.rsplit(".", 1)[-1]
            if root in imported or last in NOT_COMMUNICATORS:
                continue
            found.append(f"{node.lineno}: {receiver}.{f.attr}(...)")
        elif isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) >= 2:
            # A name given, or built from a piece of one ("Iallgather" + v).
            pieces = [
                c.value
                for c in ast.walk(node.args[1])
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
            if any(p in methods or _begins_a_method(p, methods) for p in pieces):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _begins_a_method(piece: str, methods: set[str]) -> bool:
    return len(piece) >= 3 and any(m.startswith(piece) for m in methods)


def _twins(tree) -> list[str]:
    """Return ``line: a, b`` where ``MPI.Comm.A, MPI.Comm.B`` are passed side by side
    (to ``_wait.issue``) and B is not A's nonblocking twin ("I" + a)."""
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        names = [
            a.attr if isinstance(a, ast.Attribute) and ast.unparse(a.value) == "MPI.Comm" else None
            for a in node.args
        ]
        for a, b in zip(names, names[1:], strict=False):
            if a and b and b != "I" + a.lower():
                bad.append(f"{node.lineno}: {a}, {b}")
    return bad


def test_the_mpi_call_finder_sees_calls_and_their_twins():
    methods = _mpi_methods()
    assert {"Allreduce", "Iallreduce", "Sendrecv", "Split", "Dup", "bcast"} <= methods
    assert not {"Get_rank", "Free"} & methods
    tree = ast.parse(
        "from mpicomp.collectives import plain\n"
        "comm.Allreduce(a, b)\n"
        "plain.allreduce(comm, a, b)\n"
        "self._comm.bcast(x)\n"
        "cc.allreduce(g)\n"
        'getattr(comm, "Iallgather")(a, b)\n'
        "comm.Get_rank()\n"
        'getattr(comm, "Iallgather" + v)(a, b)\n'
        'getattr(record, "synchronize", None)\n'
    )
    assert _mpi_calls(tree, methods) == [
        "2: comm.Allreduce(...)",
        "4: self._comm.bcast(...)",
        "6: getattr(comm, 'Iallgather')",
        "8: getattr(comm, 'Iallgather' + v)",
    ]
    tree = ast.parse(
        "issue(comm, MPI.Comm.Allgather, MPI.Comm.Iallgatherv, a, b)\n"
        "issue(comm, MPI.Comm.Reduce_scatter, MPI.Comm.Ireduce_scatter, a, b)\n"
    )
    assert _twins(tree) == ["1: Allgather, Iallgatherv"]


def test_only_wait_calls_mpi():
    """Every message of the library goes through ``collectives/_wait.py``, where the
    timeout applies; it is handed the MPI functions themselves, in matching twins."""
    methods = _mpi_methods()
    found, twins = {}, {}
    for rel, tree in _files():
        if not rel.startswith(("mpicomp/", "collectives/", "kernels/")):
            continue  # jobs/ are programs that use the library, as a user's would
        if rel != MPI_HOME and (hits := _mpi_calls(tree, methods)):
            found[rel] = hits
        if bad := _twins(tree):
            twins[rel] = bad
    assert not found, f"MPI called outside {MPI_HOME} (use collectives.plain or _wait): {found}"
    assert not twins, f"blocking and nonblocking MPI functions that do not match: {twins}"
    home = ast.parse((ROOT / MPI_HOME).read_text(encoding="utf-8"))
    by_name = [
        n.lineno
        for n in ast.walk(home)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "getattr"
        and not isinstance(n.args[1], ast.Constant)
    ]
    assert not by_name, f"{MPI_HOME} looks functions up by a name it builds (lines {by_name})"
