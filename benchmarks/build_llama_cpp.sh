#!/usr/bin/env bash
# Build llama-cpp-python from its source distribution into a Python environment, for
# `refengine bench peers` (about 15 minutes on two cores).
#
# GGML_NATIVE=OFF with the instruction sets switched on explicitly from /proc/cpuinfo:
# -march=native died with an illegal instruction on a Xeon VM whose reported flags and
# usable ones differed.
#
#   benchmarks/build_llama_cpp.sh [PYTHON]    (default: .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
args="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)"
args="$args -DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
echo "building llama-cpp-python==$VERSION with: $args"
CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  "$PY" -m pip install --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
