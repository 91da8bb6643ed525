"""docs/architecture.md's map is the tree: every module of mpicomp, collectives/ and
kernels/ has its line in the page's Layout block, and every line names a file that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
TOP = ("mpicomp", "collectives", "kernels")


def mapped(text: str) -> tuple[set[str], set[str]]:
    """Return (the files, the folders listed without their files) of the ```text block
    under '## Layout': a line's leading names are paths, nested by two spaces."""
    section = text.split("## Layout", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    files, folders, stack = set(), {}, []
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        names = []
        for word in line.split():
            if not word.endswith((".py", "/")):
                break
            names.append(word)
        if not names:
            continue  # a description's second line
        del stack[depth:]
        prefix = "".join(stack)
        for name in names:
            if name.endswith("/"):
                folders[prefix + name] = False
                stack.append(name)
            else:
                files.add(prefix + name)
                if prefix in folders:
                    folders[prefix] = True
    return files, {f for f, listed in folders.items() if not listed}


def on_disk(leaves: set[str]) -> set[str]:
    out = set()
    for top in TOP:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if not any(rel.startswith(leaf) for leaf in leaves):
                out.add(rel)
    return out


def test_the_parser_reads_nesting_and_leaf_folders():
    block = (
        "## Layout\n```text\na/\n  b.py  x\n  c/    y\n  d/\n    e.py f.py\n          more\n```\n"
    )
    assert mapped(block) == ({"a/b.py", "a/d/e.py", "a/d/f.py"}, {"a/c/"})


def test_the_layout_block_is_the_tree():
    files, leaves = mapped(PAGE.read_text())
    real = on_disk(leaves)
    assert sorted(real - files) == [], "modules missing from docs/architecture.md's Layout"
    assert sorted(files - real) == [], "Layout lines naming files that do not exist"
    assert all((ROOT / leaf).is_dir() for leaf in leaves)
