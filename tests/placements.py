"""Where a test's collection runs: the same test body for every placement of the collection loop."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gymnasium.vector import VectorEnv

from torch_rollout import Processes, Ray

__all__ = ["LOCAL_PLACEMENTS", "PLACEMENTS", "envs_for", "local_ray", "num_loops", "on_ray"]

_NO_RAY = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed (pip install 'torch_rollout[ray]')"
)


def on_ray(placement: dict[str, Any]) -> bool:
    """Whether a placement's collection runs on Ray."""
    return isinstance(placement.get("backend"), Ray)


def num_loops(placement: dict[str, Any]) -> int:
    """Collection loops (vector envs) of a placement: the thread's one, or one per worker."""
    backend = placement.get("backend")
    return backend.num_workers if isinstance(backend, (Processes, Ray)) else 1


# Collector keyword arguments of each placement: the thread, one worker process, two of them, two Ray actors.
PLACEMENTS = [
    pytest.param({"backend": "thread"}, id="thread"),
    pytest.param({"backend": Processes(1)}, id="process1"),
    pytest.param({"backend": Processes(2)}, id="process2"),
    pytest.param({"backend": Ray(2)}, id="ray2", marks=_NO_RAY),
]
# Placements whose envs run on this machine and see its shared memory (torch's share_memory_() tensors):
# for tests that talk to the envs through it. Ray sends its workers copies.
LOCAL_PLACEMENTS = [param for param in PLACEMENTS if not on_ray(param.values[0])]

_started_ray = False


def local_ray() -> Any:
    """The test session's local Ray (2 CPUs, a 200 MB object store), started on first use; tests/conftest.py stops it.

    Its workers import the tests' modules (envs, policies) as worker processes do:
    this directory goes on their ``PYTHONPATH``.
    """
    global _started_ray
    import ray

    if not ray.is_initialized():
        tests = str(Path(__file__).resolve().parent)
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = tests if not path else f"{tests}{os.pathsep}{path}"
        # Under `make coverage` (coverage.py's patch=subprocess puts its settings in the environment) each Ray
        # worker measures itself too, and saves its data when the collector closes its actor.
        measured = {"worker_process_setup_hook": _save_coverage_at_actor_close} if _MEASURED in os.environ else None
        ray.init(
            num_cpus=2,
            object_store_memory=200 * 1024**2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=measured,
        )
        _started_ray = True
    return ray


_MEASURED = "COVERAGE_PROCESS_CONFIG"  # set by coverage.py's [run] patch = ["subprocess"] for every subprocess


def _save_coverage_at_actor_close() -> None:
    """A Ray worker's set-up under `make coverage`: the actor's coverage data is saved once its close() returns.

    The collector calls close() on each actor and then ``ray.kill``, which ends its process at once: no atexit
    handler runs there, so coverage.py would save nothing of what the actor ran (``_RayWorker``).
    """
    import coverage

    from torch_rollout.placements import _ray

    cov = coverage.Coverage.current()
    if cov is None:  # a Ray worker started before coverage's settings were in the environment
        return
    close = _ray._RayWorker.close

    def close_and_save(self: _ray._RayWorker) -> None:
        try:
            close(self)
        finally:
            cov.save()

    _ray._RayWorker.close = close_and_save


def stop_local_ray() -> None:
    """Shuts down the Ray that :func:`local_ray` started, if any."""
    global _started_ray
    if _started_ray:
        import ray

        ray.shutdown()
        _started_ray = False


def envs_for(placement: dict[str, Any], make_envs: Callable[..., VectorEnv], num_envs: int) -> tuple[Any, dict]:
    """The ``envs`` argument and extra keyword arguments for a placement.

    The thread gets a live vector env built here (the test may close it); worker
    processes and Ray actors get the picklable ``make_envs(num_envs, start_index=...)``
    itself (and Ray is started for the session).
    """
    if placement["backend"] == "thread":
        return make_envs(num_envs), {}
    if on_ray(placement):
        local_ray()
    return make_envs, {"num_envs": num_envs}
