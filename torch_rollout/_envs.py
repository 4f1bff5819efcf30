"""Vector envs: building them from a recipe, and naming the cause of their failures."""

from __future__ import annotations

import inspect
import pickle
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any, Union

import gymnasium
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv

from torch_rollout._spaces import describe_bad_single_obs

__all__ = ["EnvRecipe", "autoreset_mode", "build_envs", "check_picklable", "explain_env_error", "split_envs"]

# What a worker builds its envs from: an env id, or make_envs(num_envs[, start_index]) -> VectorEnv.
EnvRecipe = Union[str, Callable[..., VectorEnv]]

def build_envs(
    recipe: EnvRecipe, num_envs: int, *, start_index: int = 0, env_kwargs: Mapping[str, Any] | None = None
) -> VectorEnv:
    """Builds ``num_envs`` envs whose first has the global index ``start_index``.

    ``recipe`` is an env id for :func:`gymnasium.make_vec` (with ``env_kwargs``),
    or a callable ``make_envs(num_envs)``, or ``make_envs(num_envs, start_index=...)``
    when its signature has a ``start_index`` parameter.
    """
    if isinstance(recipe, str):
        try:
            envs = gymnasium.make_vec(recipe, num_envs=num_envs, **(env_kwargs or {}))
        except gymnasium.error.Error as exc:
            raise ValueError(
                f"Collector: unknown env id envs={recipe!r}: {exc} (an id registered by a module of yours "
                "must be given as 'module:EnvName-v0', so that gymnasium imports that module in worker "
                "processes too)"
            ) from exc
    elif _takes_start_index(recipe):
        envs = recipe(num_envs, start_index=start_index)
    else:
        envs = recipe(num_envs)
    if not isinstance(envs, VectorEnv):
        raise TypeError(
            f"Collector: envs={recipe!r} returned {type(envs).__name__}, expected a gymnasium.vector.VectorEnv "
            "of num_envs envs"
        )
    if envs.num_envs != num_envs:
        num = envs.num_envs
        envs.close()
        raise ValueError(f"Collector: envs={recipe!r} was asked for {num_envs} envs but built a vector env of {num}")
    return envs


def autoreset_mode(envs: VectorEnv) -> AutoresetMode:
    """The vector env's autoreset mode (gymnasium's default, NEXT_STEP, when its metadata has none)."""
    return AutoresetMode(envs.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))


def _takes_start_index(fn: Callable[..., Any]) -> bool:
    try:
        return "start_index" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return False


def check_picklable(name: str, obj: Any, hint: str) -> None:
    """Raises TypeError naming ``name`` if ``obj`` cannot travel to a worker process."""
    try:
        pickle.dumps(obj)
    except Exception as exc:
        raise TypeError(f"Collector: {name}={obj!r} cannot be pickled for a worker process ({exc}); {hint}") from exc


def split_envs(num_envs: int, num_workers: int) -> list[tuple[int, int]]:
    """``(start_index, count)`` of each worker's share: contiguous, sizes differing by at most one."""
    base, extra = divmod(num_envs, num_workers)
    shares, start = [], 0
    for k in range(num_workers):
        count = base + (k < extra)
        shares.append((start, count))
        start += count
    return shares


def explain_env_error(envs: VectorEnv, exc: BaseException) -> BaseException:
    """Returns an error naming the cause where gymnasium's own error does not, else ``exc``.

    A killed AsyncVectorEnv worker reaches the parent as a bare ``EOFError`` or
    ``ConnectionResetError`` and leaves the vector env unable to close; a sub-env
    of a SyncVectorEnv that returns an observation of the wrong shape raises
    "Output array is the wrong shape". Runs only on the error path.
    """
    base = envs.unwrapped
    processes = getattr(base, "processes", None)
    if isinstance(exc, (EOFError, OSError)) and isinstance(processes, list) and not base.closed:
        # The pipe reports EOF a moment before the dead process can be reaped.
        deadline = time.monotonic() + 2.0
        while not (dead := [(i, p) for i, p in enumerate(processes) if p.exitcode is not None]):
            if time.monotonic() > deadline:
                return exc
            time.sleep(0.01)
        _shut_down(base)
        index, process = dead[0]
        code = process.exitcode
        cause = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        error: BaseException = RuntimeError(
            f"Collector: worker process {index} of the {type(base).__name__} (pid {process.pid}) {cause} "
            f"while the collector was stepping the envs; the vector env cannot be used any more and was shut "
            f"down (its other {len(processes) - 1} worker processes terminated)"
        )
        error.__cause__ = exc
        return error
    if isinstance(exc, ValueError) and isinstance(base, SyncVectorEnv):
        # SyncVectorEnv keeps the sub-envs' last observations; if absent, gymnasium's error stands.
        problem = describe_bad_single_obs(base.single_observation_space, list(getattr(base, "_env_obs", ())))
        if problem is not None:
            error = ValueError(f"Collector: {problem} (SyncVectorEnv could not stack the observations: {exc})")
            error.__cause__ = exc
            return error
    return exc


def _shut_down(base: VectorEnv) -> None:
    """Terminates and reaps the worker processes of a broken AsyncVectorEnv and marks it closed.

    gymnasium's own close() raises on a vector env with a dead worker, and its
    ``__del__`` then fails again at garbage collection.
    """
    for process in base.processes:
        if process.is_alive():
            process.terminate()
    for process in base.processes:
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
    for pipe in base.parent_pipes:
        if pipe is not None:
            pipe.close()
    base.closed = True
