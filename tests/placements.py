"""Where a test's collection runs: the same test body for every placement of the collection loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from gymnasium.vector import VectorEnv

__all__ = ["PLACEMENTS", "envs_for"]

# Collector keyword arguments of each placement: the thread, one worker process, two of them.
PLACEMENTS = [
    pytest.param({"backend": "thread"}, id="thread"),
    pytest.param({"backend": "process", "num_workers": 1}, id="process1"),
    pytest.param({"backend": "process", "num_workers": 2}, id="process2"),
]


def envs_for(placement: dict[str, Any], make_envs: Callable[..., VectorEnv], num_envs: int) -> tuple[Any, dict]:
    """The ``envs`` argument and extra keyword arguments for a placement.

    The thread gets a live vector env built here (the test may close it); worker
    processes get the picklable ``make_envs(num_envs, start_index=...)`` itself.
    """
    if placement["backend"] == "thread":
        return make_envs(num_envs), {}
    return make_envs, {"num_envs": num_envs}
