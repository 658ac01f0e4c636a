#!/usr/bin/env bash
# Fetch the pinned wheels of benchmarks/gpu_wheels.txt into build/gpu-wheels (ignored by git), on a machine with
# pip access, for a GPU machine that has none: the device run carries build/gpu-wheels (docs/gpu.md gives the
# one-call command). All three are py3-none-any (pure Python; Triton JIT-compiles their kernels on the GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf build/gpu-wheels
python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
  -d build/gpu-wheels -r benchmarks/gpu_wheels.txt
ls -l build/gpu-wheels
