#!/usr/bin/env bash
# Everything to run on a GPU machine in one command, under 8 minutes (so that a rerun fits a 15-minute loan):
#   0. set-up: the machine's python3 (a CUDA torch, pytest, pytest-xdist), plus the wheels carried in
#      benchmarks/wheels/ (tensordict, gymnasium and their requirements; fetched beforehand by
#      benchmarks/fetch_gpu_wheels.sh), installed offline into benchmarks/.gpu-site (on PYTHONPATH);
#      torch's version and the device are printed;
#   1. the CUDA tests: pytest -k cuda on the test files that have CUDA tests;
#   2. the three checks a reading most wants confirmed: a CPU env with a slow CUDA policy (stale actions
#      detected by re-stepping a twin env), a CUDA env with a CPU policy in SAME_STEP (next_value against an
#      eager recomputation), a failed CUDA graph recording followed by torch.rand(1, device="cuda");
#   3. the benchmarks: benchmarks/gpu.py (GPU policy collection, compute_gae, uploads, off-policy T=1 tiers) and
#      benchmarks/torch_envs.py --device cuda --cuda-graph (torch CartPole tiers, eager and CudaGraph()).
# Every step has its own time limit (on a GPU they add up to 475 s). Results land in $OUT (at most 8 files):
# setup.txt, cuda_tests.txt, checks.txt, gpu.md, gpu.json, torch_envs.md, torch_envs_cuda.json, gpu_sh.log.
# No CUDA is a failure (exit 1). Steps that fail do not stop the later ones; the exit status is the first
# failure's.
#
# Usage: OUT=/some/dir bash benchmarks/gpu.sh                    # on the GPU machine
#        GPU_SH_DRY_RUN=1 OUT=/tmp/x bash benchmarks/gpu.sh      # on a CPU: the same script without GPU parts
# $PYTHON overrides python3. torch_rollout is used from this checkout through PYTHONPATH, not installed.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
dry_run="${GPU_SH_DRY_RUN:-0}"
out="${OUT:-$root/benchmarks/results/gpu_run}"
py="${PYTHON:-python3}"
mkdir -p "$out"
exec > >(tee "$out/gpu_sh.log") 2>&1
tee_pid=$!
trap 'exec 1>&- 2>&-; wait "$tee_pid" 2>/dev/null' EXIT  # the log complete before the script ends
start=$SECONDS
status=0
step() {  # step NAME: records a failed step's status (the first one wins)
    local rc=$?
    if [ "$rc" != 0 ]; then
        echo "!! $1 failed (exit $rc)"
        [ "$status" = 0 ] && status=$rc
    fi
    return 0
}

echo "== set-up ($( [ "$dry_run" = 1 ] && echo "dry run on the CPU" || echo "GPU run"))"
site="$here/.gpu-site"
wheels="$here/wheels"
need=$("$py" -c 'import importlib.util as u; print(" ".join(m for m in ("tensordict", "gymnasium", "numpy") if u.find_spec(m) is None))')
if [ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
    if [ "$dry_run" = 1 ]; then  # checks that pip would install every wheel on CPython 3.12 x86_64
        timeout 40 "$py" -m pip install --dry-run --quiet --no-index --no-deps --disable-pip-version-check \
            --target "$out/.site-dry-run" --python-version 3.12 --implementation cp --only-binary=:all: \
            --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 "$wheels"/*.whl
        step "checking the wheels"
        rm -rf "$out/.site-dry-run"
    elif [ -n "$need" ]; then
        rm -rf "$site"
        timeout 40 "$py" -m pip install --quiet --no-index --no-deps --disable-pip-version-check \
            --target "$site" "$wheels"/*.whl
        step "installing the wheels"
    fi
elif [ -n "$need" ] && [ "$dry_run" != 1 ]; then
    echo "!! $py lacks $need and benchmarks/wheels/ has no wheels: run bash benchmarks/fetch_gpu_wheels.sh first"
    exit 1
else
    echo "(benchmarks/wheels/ is empty: nothing to check or install)"
fi
export PYTHONPATH="$root:$here${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$site" ] && [ "$dry_run" != 1 ] && export PYTHONPATH="$site:$PYTHONPATH"
timeout 30 "$py" - > "$out/setup.txt" <<'PY'
import platform
import gymnasium, tensordict, torch
import torch_rollout
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"tensordict {tensordict.__version__}, gymnasium {gymnasium.__version__}")
print(f"CUDA available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
PY
step "set-up"
cat "$out/setup.txt"
if [ "$dry_run" != 1 ]; then
    if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "!! no CUDA: torch.cuda.is_available() is False (this script is for a GPU machine; GPU_SH_DRY_RUN=1 elsewhere)"
        exit 1
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi

cd "$root"
cuda_files="tests/test_cuda_graph.py tests/test_torch_loop.py tests/test_torch_envs.py tests/test_collector.py tests/test_gae.py"
checks="tests/test_torch_loop.py::test_a_cpu_env_steps_on_the_actions_of_a_policy_elsewhere
tests/test_torch_loop.py::test_a_policy_on_the_cpu_bootstraps_from_the_final_observations_of_an_env_elsewhere
tests/test_cuda_graph.py::test_a_forward_that_cannot_be_recorded_is_named_and_leaves_eager_cuda_working"
xdist=""
"$py" -c 'import xdist' 2>/dev/null && xdist="-n 4"
if [ "$dry_run" = 1 ]; then
    echo "== CUDA tests and checks: skipped in a dry run" | tee "$out/cuda_tests.txt" "$out/checks.txt"
else
    echo "== CUDA tests"
    # shellcheck disable=SC2086  # word lists
    timeout 150 "$py" -m pytest -q -k cuda -p no:cacheprovider $xdist -rfEs $cuda_files > "$out/cuda_tests.txt" 2>&1
    step "CUDA tests"
    tail -n 40 "$out/cuda_tests.txt"
    echo "== three checks"
    # shellcheck disable=SC2086
    timeout 45 "$py" -m pytest -q -k cuda -p no:cacheprovider -rfEs $checks > "$out/checks.txt" 2>&1
    step "three checks"
    tail -n 20 "$out/checks.txt"
fi

echo "== GPU benchmarks"
if [ "$dry_run" = 1 ]; then
    PYTHONWARNINGS=ignore timeout 120 "$py" "$here/gpu.py" --cpu-dry-run --out "$out" > "$out/gpu.md"
else
    PYTHONWARNINGS=ignore timeout 110 "$py" "$here/gpu.py" --out "$out" > "$out/gpu.md"
fi
step "benchmarks/gpu.py"
cat "$out/gpu.md"
if [ "$dry_run" != 1 ]; then
    echo "== torch CartPole on the GPU, eager and CudaGraph()"
    PYTHONWARNINGS=ignore timeout 100 "$py" "$here/torch_envs.py" --device cuda --cuda-graph \
        --sizes 256 4096 65536 --repeats 2 --batches 4 --ppo-steps 0 > "$out/torch_envs.md" 2>&1
    step "benchmarks/torch_envs.py"
    cp "$here/results/torch_envs_cuda.json" "$out/" 2>/dev/null || true
    cat "$out/torch_envs.md"
fi
echo "gpu.sh done in $((SECONDS - start)) s (exit $status)"
exit "$status"
