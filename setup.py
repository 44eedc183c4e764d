"""The packages, which pyproject.toml cannot state: the top-level ``cuda/`` directory (CUDA
kernels and the CPU emulator's sources) ships inside the package as ``refengine.cuda_src``,
and the benchmark corpus as ``refengine.bench.data``; both are data-only directories
(package data is declared in pyproject.toml, with everything else). ``refengine.resources``
finds the CUDA sources in a checkout and in a wheel alike.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["refengine", "refengine.*"]), "refengine.bench.data", "refengine.cuda_src"],
    package_dir={"refengine.cuda_src": "cuda"},
)
