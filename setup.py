"""Packaging for hipress-like (distribution name ``hipress-like``).

Extras mirror the optional front ends: ``tensorflow``, ``mxnet``, ``mpi``,
``horovod``, ``dev`` (tests, lint, benchmarks) and ``docs`` (the mkdocs site:
``mkdocs build --strict``, ``mkdocs serve``).
"""
from setuptools import find_packages, setup

setup(
    name="hipress-like",
    version="0.1.0",
    description="Compression-aware data-parallel training: CaSync scheduling, "
    "CompLL compressors and a cost model (after HiPress, SOSP'21).",
    packages=find_packages(include=["hipress_like", "hipress_like.*"]),
    # the families' C kernels are built from source on first use (compressors/_build/native.py)
    package_data={"hipress_like.compressors": ["_build/*.h", "*/*.c", "*/*.compll",
                                               "compll/compll.lark", "thc/tables/*.json"]},
    python_requires=">=3.10",
    install_requires=[
        # 2.13.0 is the CPU wheel on local disk; the cap keeps pip off CUDA builds.
        "torch>=2.4,<2.15",
        "numpy",
        "msgpack>=1.0",
        "tqdm",
    ],
    extras_require={
        "tensorflow": ["tensorflow-cpu"],
        "mxnet": ["mxnet==1.9.1", "numpy==1.23.5"],
        "mpi": ["mpi4py>=3.1"],
        "horovod": ["horovod==0.28.1"],
        "dev": [
            "pytest>=7",
            "pytest-timeout",
            "ruff",
            "scikit-learn",
            "matplotlib",
            "lark",
            "pymoo",
            "rich",
        ],
        # the site (mkdocs.yml): material theme, API pages from docstrings
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26",
                 "matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "hipress-profile=hipress_like.tuning.cli:main",
        ],
    },
)
