"""mypy on a trainer's code: the Collector's annotations reach it (``make lint`` checks tests/typecheck/usage.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_refuses_an_argument_of_the_wrong_type(tmp_path: Path) -> None:
    """A second with the cache that ``make lint`` leaves in .mypy_cache; about 20 s without it (2 cores)."""
    snippet = tmp_path / "trainer.py"
    snippet.write_text(
        "from torch import nn\n"
        "from torch_rollout import Collector\n"
        "\n"
        'collector = Collector("CartPole-v1", nn.Linear(4, 2), num_envs=4, num_steps="128")\n'
    )
    # MYPYPATH: this checkout's torch_rollout, whichever one the environment has installed.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", str(snippet)],
        cwd=ROOT,
        env={**os.environ, "MYPYPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    expected = 'trainer.py:4: error: Argument "num_steps" to "Collector" has incompatible type "str"; expected "int"'
    assert result.returncode == 1 and expected in result.stdout, result.stdout + result.stderr
