#!/usr/bin/env bash
# Creates benchmarks/.venv with the peer libraries and torch_rollout itself.
# Usage: bash benchmarks/setup.sh   (from anywhere; PYTHON=python3.11 by default)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
venv="$here/.venv"
python="${PYTHON:-python3.11}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip

# torch first and pinned: any later requirement that says "torch>=..." is then
# already satisfied and pip never reaches for a CUDA build.
"${pip[@]}" install --quiet "torch==2.13.0"
"${pip[@]}" install --quiet -r "$here/requirements.txt"

# The project without its dependencies: it needs torch, gymnasium, tensordict and
# numpy, all installed above, and torchrl's tensordict pin must win here.
"${pip[@]}" install --quiet --no-deps -e "$root"

"$venv/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "torchrl", "tensordict", "stable-baselines3", "rlox", "envpool", "gymnasium", "numpy"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
PY
echo "benchmark environment ready: $venv/bin/python benchmarks/run.py --quick"
