#!/usr/bin/env bash
# Fetch the pinned wheels of benchmarks/gpu_wheels.txt into build/gpu-wheels (ignored by git), on a machine with
# pip access, for a GPU machine that has none: the device run carries build/gpu-wheels (docs/gpu.md gives the
# one-call command). The kernel wheels are pure Python (Triton JIT-compiles their kernels on the GPU); the service
# part's few binary wheels are picked for CPython 3.12 on x86-64 Linux, the GPU image's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf build/gpu-wheels
python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d build/gpu-wheels -r benchmarks/gpu_wheels.txt
ls -l build/gpu-wheels
