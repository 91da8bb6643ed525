"""Sphinx configuration: the Markdown pages of docs/ (MyST) and an API reference made from
the docstrings (autodoc, Google style) and the CLI's own parser (sphinx-argparse), so no
synopsis can go stale. ``make docs`` builds it with warnings as errors."""

import mpicomp

project = "mpicomp"
release = version = mpicomp.__version__
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 4  # the pages link to #headings as GitHub renders them
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_title = f"mpicomp {release}"
