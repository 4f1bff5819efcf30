"""benchmarks/gpu.sh, the one command a GPU machine runs: its dry run on the CPU, its limits, no CUDA refused."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.sh"


def _run(out: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if key != "GPU_SH_DRY_RUN"}
    environ.update(OUT=str(out), PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(SCRIPT)], env=environ, capture_output=True, text=True, timeout=300)


def test_the_dry_run_passes_and_writes_its_files_under_out(tmp_path):
    result = _run(tmp_path, GPU_SH_DRY_RUN="1")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    files = sorted(path.name for path in tmp_path.rglob("*") if path.is_file())
    assert {"setup.txt", "gpu.md", "gpu.json", "gpu_sh.log"} <= set(files)
    assert len(files) <= 8, files  # what comes back from the GPU machine
    assert "torch " in (tmp_path / "setup.txt").read_text()
    assert "gpu.sh done" in (tmp_path / "gpu_sh.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_and_without_the_dry_run_switch_it_fails(tmp_path):
    result = _run(tmp_path)
    assert result.returncode != 0
    assert "no CUDA" in result.stdout


def test_its_time_limits_leave_room_for_a_rerun():
    """The GPU path's per-step limits add up to under 8 minutes (a 15-minute loan holds the start and a rerun)."""
    gpu_lines = [line for line in SCRIPT.read_text().splitlines() if "dry-run" not in line and "dry_run" not in line]
    limits = [int(limit) for line in gpu_lines for limit in re.findall(r"\btimeout (\d+)", line)]
    assert len(limits) >= 6, limits  # set-up, CUDA tests, checks, two benchmarks
    assert sum(limits) < 8 * 60, limits


def test_the_checks_it_names_exist():
    """The three checks gpu.sh runs by node id are tests of the suite."""
    text = SCRIPT.read_text()
    for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", text):
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE), f"{path}::{name}"
