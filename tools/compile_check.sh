#!/usr/bin/env bash
# Compile-check every CUDA source for sm_80 and sm_90a without a GPU: configures CMake in
# build/cmake and builds its compile_check target, which prints registers and spills per
# kernel and fails on any spill. Needs cmake, nvcc (on PATH or in $CUDA_HOME/bin), python.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cmake --target compile_check
