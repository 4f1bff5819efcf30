#!/usr/bin/env bash
# Downloads the wheels of benchmarks/gpu_wheels.txt for the GPU machine (CPython 3.12, x86_64 Linux) into
# benchmarks/wheels/, without their dependencies (each is listed), so that benchmarks/gpu.sh installs them there
# offline. Run it on a machine with network access before the working tree goes to the GPU machine.
#
# Usage: bash benchmarks/fetch_gpu_wheels.sh     # $PYTHON (default python3) runs pip
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
mkdir -p "$here/wheels"
"$py" -m pip download --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -r "$here/gpu_wheels.txt" -d "$here/wheels" --quiet --disable-pip-version-check
du -sh "$here/wheels"
