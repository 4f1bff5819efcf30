#!/usr/bin/env bash
# GPU checks of torch_rollout in one go (each step has its own time limit: under 10 minutes in all):
#   1. the CUDA tests:  python -m pytest -q -k cuda tests/
#   2. benchmarks/gpu.py: collection with the policy on the GPU (64x64 and 512x512 MLPs, thread and
#      process backends, CartPole-v1 N=64), compute_gae at 2048x256 against the card's copy bandwidth,
#      pinned vs pageable upload of one observation batch. JSON in benchmarks/results/gpu.json,
#      a Markdown table on stdout.
#   3. benchmarks/torch_envs.py --device cuda --cuda-graph: the torch CartPole tiers on the GPU (env
#      alone, policy alone, serial floor, hand-written loop, the collector eager and with
#      compile_policy=CudaGraph()) at N = 256 to 65,536, 2 repeats of 4 batches, no PPO line.
#
# Usage: bash benchmarks/gpu.sh                 # on a machine with CUDA; elsewhere "no CUDA: skipping", exit 0
#        bash benchmarks/gpu.sh --cpu-dry-run   # no GPU needed: syntax-checks and runs gpu.py's logic on the CPU
#
# Python: $PYTHON if set; else benchmarks/.venv-gpu, created on first use with --system-site-packages
# from python3, so a CUDA build of torch installed system-wide is used as it is. Only what is missing
# is pip-installed: torch unpinned (on PyPI the Linux x86_64 wheel of torch is a CUDA build; the
# benchmark venv's torch==2.13.0 is the CPU wheel of the project machines, so it is not reused),
# gymnasium, tensordict, numpy and pytest. On a machine without network access have them installed
# beforehand (or point PYTHON at an interpreter that has them). torch_rollout is used from this
# checkout through PYTHONPATH, not installed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
dry_run=0
case "${1:-}" in
    "") ;;
    --cpu-dry-run) dry_run=1 ;;
    *) echo "usage: bash benchmarks/gpu.sh [--cpu-dry-run]" >&2; exit 2 ;;
esac
start=$SECONDS

if [ "$dry_run" = 0 ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    echo "no CUDA: skipping (nvidia-smi finds no GPU)"
    exit 0
fi

if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
elif [ "$dry_run" = 1 ] && [ -x "$here/.venv/bin/python" ]; then
    py="$here/.venv/bin/python"  # the CPU benchmark venv is enough for a dry run
else
    venv="$here/.venv-gpu"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv --system-site-packages "$venv"
    fi
    py="$venv/bin/python"
    missing=$("$py" - <<'PY'
import importlib.util
wanted = {"torch": "torch", "gymnasium": "gymnasium", "tensordict": "tensordict", "numpy": "numpy", "pytest": "pytest"}
print(" ".join(pip for mod, pip in wanted.items() if importlib.util.find_spec(mod) is None))
PY
)
    if [ -n "$missing" ]; then
        echo "installing into $venv: $missing"
        # shellcheck disable=SC2086  # one word per package
        "$py" -m pip install --quiet --disable-pip-version-check $missing
    fi
fi
export PYTHONPATH="$root:$here${PYTHONPATH:+:$PYTHONPATH}"

"$py" -m py_compile "$here/gpu.py" "$here/_common.py" "$here/gae.py" "$here/torch_envs.py"
"$py" -c 'import torch, torch_rollout; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")'

if [ "$dry_run" = 1 ]; then
    cd "$root"
    PYTHONWARNINGS=ignore timeout 300 "$py" "$here/gpu.py" --cpu-dry-run
    echo "cpu dry run done in $((SECONDS - start)) s"
    exit 0
fi

if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA: skipping (this torch cannot use the GPU; install a CUDA build, or set PYTHON)"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

cd "$root"
status=0
echo "== CUDA tests"
timeout 150 "$py" -m pytest -q -k cuda -p no:cacheprovider tests/ || status=$?
echo "== GPU benchmarks"
PYTHONWARNINGS=ignore timeout 240 "$py" "$here/gpu.py" || status=$?
echo "== torch CartPole on the GPU, eager and CudaGraph()"
PYTHONWARNINGS=ignore timeout 180 "$py" "$here/torch_envs.py" --device cuda --cuda-graph \
    --sizes 256 1024 4096 16384 65536 --repeats 2 --batches 4 --ppo-steps 0 || status=$?
echo "gpu.sh done in $((SECONDS - start)) s (exit $status)"
exit "$status"
