"""mpicomp's version, in a module of its own: the package's modules read it from here, so
that none imports the package ``mpicomp`` itself (setup.py reads this file too)."""

__version__ = "0.1.0"
