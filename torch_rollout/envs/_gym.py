"""Vector envs: building them from a recipe, and naming the cause of their failures."""

from __future__ import annotations

import inspect
import pickle
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import gymnasium
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState

from torch_rollout.envs._isaac_lab import FromIsaacLab, is_isaac_lab
from torch_rollout.envs._spaces import describe_bad_single_obs
from torch_rollout.util._notes import add_note

__all__ = [
    "EnvRecipe",
    "GymEnvs",
    "RemoteTraceback",
    "autoreset_mode",
    "build_envs",
    "check_picklable",
    "explain_env_error",
    "gym_envs",
    "split_envs",
]

# What a worker builds its envs from: an env id, or make_envs(num_envs[, start_index]) -> VectorEnv.
EnvRecipe = str | Callable[..., VectorEnv]


def gym_envs(env_id: str, **kwargs: Any) -> GymEnvs:
    """A picklable recipe of gymnasium vector envs: ``gymnasium.make_vec(env_id, num_envs=n, **kwargs)``.

    Pass it as the Collector's ``envs`` where keyword arguments of
    :func:`gymnasium.make_vec` are needed (a plain env id takes none); worker
    processes and Ray actors each call it for their share of the envs.

    Args:
        env_id: a registered gymnasium id (an id registered by a module of yours:
            ``"module:EnvName-v0"``, so that worker processes import that module too).
        kwargs: keyword arguments of :func:`gymnasium.make_vec` (``vectorization_mode``,
            ``vector_kwargs``, ``wrappers``) and of the env itself.

    Examples:
        >>> recipe = gym_envs("CartPole-v1", vectorization_mode="sync")
        >>> recipe
        gym_envs('CartPole-v1', vectorization_mode='sync')
        >>> recipe(3).num_envs
        3
    """
    return GymEnvs(env_id, **kwargs)


class GymEnvs:
    """The recipe that :func:`gym_envs` returns: ``make_envs(num_envs)`` for an env id and its keyword arguments."""

    def __init__(self, env_id: str, **kwargs: Any) -> None:
        if not isinstance(env_id, str):
            raise TypeError(f"gym_envs: env_id must be a gymnasium env id str, got {type(env_id).__name__} {env_id!r}")
        if "num_envs" in kwargs:
            raise TypeError(
                "gym_envs: num_envs is the Collector's argument (each worker builds its share); leave it out"
            )
        self.env_id = env_id
        self.kwargs = kwargs

    def __call__(self, num_envs: int) -> VectorEnv:
        """``gymnasium.make_vec(env_id, num_envs=num_envs, **kwargs)``.

        Raises:
            ValueError: the id is not registered ("unknown env id"); gymnasium could not build a
                registered id (its own message, with the call); the id is ManiSkill's (the recipe to use).
        """
        if _is_mani_skill(self.env_id):
            raise _mani_skill_error(self.env_id, num_envs)
        try:
            return gymnasium.make_vec(self.env_id, num_envs=num_envs, **self.kwargs)
        except gymnasium.error.Error as exc:
            name = self.env_id.split(":")[-1]  # "module:EnvName-v0": the module was imported by make_vec
            if name not in gymnasium.registry:
                raise ValueError(
                    f"Collector: unknown env id envs={self.env_id!r}: {exc} (an id registered by a module of yours "
                    "must be given as 'module:EnvName-v0', so that gymnasium imports that module in worker "
                    "processes too)"
                ) from exc
            if _is_mani_skill(name):
                raise _mani_skill_error(self.env_id, num_envs) from exc
            raise ValueError(self._failed(num_envs, exc)) from exc

    def _failed(self, num_envs: int, exc: gymnasium.error.Error) -> str:
        """The message for a registered id that gymnasium could not build: the call and gymnasium's own words."""
        kwargs = "".join(f", {key}={value!r}" for key, value in self.kwargs.items())
        message = (
            f"Collector: gymnasium.make_vec({self.env_id!r}, num_envs={num_envs}{kwargs}) failed for the "
            f"registered env id {self.env_id!r}: {type(exc).__name__}: {exc}"
        )
        spec = gymnasium.registry[self.env_id.split(":")[-1]]
        mode = self.kwargs.get("vectorization_mode")
        if str(getattr(mode, "value", mode)) == "vector_entry_point" or (
            mode is None and spec.vector_entry_point is not None
        ):
            message += (
                f"; gym_envs({self.env_id!r}, vectorization_mode='sync') builds it from its single-env entry point "
                "instead"
            )
        return message

    def __repr__(self) -> str:
        kwargs = "".join(f", {key}={value!r}" for key, value in self.kwargs.items())
        return f"gym_envs({self.env_id!r}{kwargs})"


def _is_mani_skill(env_id: str) -> bool:
    """Whether ``env_id`` is ManiSkill's: registered with an entry point in ``mani_skill``, or named by that module."""
    module, _, name = env_id.rpartition(":")
    if module:
        return _in_mani_skill(module) or _is_mani_skill(name)
    spec = gymnasium.registry.get(env_id)
    if spec is None:
        return False
    entry = spec.entry_point
    if isinstance(entry, str):
        return _in_mani_skill(entry.partition(":")[0])
    entry = getattr(entry, "func", entry)  # ManiSkill registers functools.partial(make, env_id=...)
    return _in_mani_skill(getattr(entry, "__module__", None) or "")


def _in_mani_skill(module: str) -> bool:
    return module == "mani_skill" or module.startswith("mani_skill.")


def _mani_skill_error(env_id: str, num_envs: int) -> ValueError:
    name = env_id.rpartition(":")[2]
    return ValueError(
        f"Collector: envs={env_id!r} is a ManiSkill env, which ManiSkill builds with its own "
        f"gymnasium.make({name!r}, num_envs={num_envs}) and vector wrapper, not with gymnasium.make_vec; pass a "
        "function that builds it as envs:\n"
        "    def make_envs(num_envs):\n"
        "        import mani_skill.envs  # registers the ids\n"
        "        from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv\n"
        f"        return ManiSkillVectorEnv(gymnasium.make({name!r}, num_envs=num_envs), num_envs)\n"
        "(with your gymnasium.make options: obs_mode, sim_backend, ...)"
    )


def build_envs(recipe: EnvRecipe, num_envs: int, *, start_index: int = 0) -> VectorEnv:
    """Builds ``num_envs`` envs whose first has the global index ``start_index``.

    ``recipe`` is an env id for :func:`gymnasium.make_vec`, or a callable
    ``make_envs(num_envs)`` (such as :func:`gym_envs`), or
    ``make_envs(num_envs, start_index=...)`` when its signature has a
    ``start_index`` parameter. Isaac Lab's own env becomes a vector env
    (:class:`~torch_rollout.envs.FromIsaacLab`).
    """
    if isinstance(recipe, str):
        recipe = GymEnvs(recipe)
    make: Callable[..., VectorEnv] = recipe  # a GymEnvs takes no start_index: _takes_start_index says so
    if _takes_start_index(make):
        envs = make(num_envs, start_index=start_index)
    else:
        envs = make(num_envs)
    if is_isaac_lab(envs):  # a function's result: Isaac Lab's own env
        envs = FromIsaacLab(envs)
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


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in another process (set as its ``__cause__``)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def explain_env_error(envs: VectorEnv, exc: BaseException, *, env_offset: int = 0) -> BaseException:
    """Returns an error naming the cause where gymnasium's own error does not, else ``exc``.

    A killed AsyncVectorEnv worker reaches the parent as a bare ``EOFError`` or
    ``ConnectionResetError`` and leaves the vector env unable to close; an
    AsyncVectorEnv worker's exception becomes gymnasium's log line when warnings
    are errors (``python -W error``); a sub-env observation of the wrong shape
    raises "Output array is the wrong shape" (SyncVectorEnv), "could not
    broadcast" (AsyncVectorEnv's shared memory) or "all input arrays must have
    the same shape" (its pipes). Envs are named by their global index, the
    index in ``envs`` plus ``env_offset``: an exception that a sub-env of a
    SyncVectorEnv or AsyncVectorEnv raised itself gets the note
    ``(raised by env 5)``. Runs only on the error path.
    """
    base = envs.unwrapped
    if isinstance(exc, (EOFError, OSError)) and isinstance(base, AsyncVectorEnv) and not base.closed:
        return _explain_dead_worker(base, exc)
    failed = None  # the index in envs of the sub-env whose own exception exc is, where the vector env tells
    if isinstance(base, AsyncVectorEnv):
        # The frame of gymnasium's AsyncVectorEnv._raise_if_errors: which worker failed, and how.
        worker = _frame_locals(exc, "gymnasium.vector.async_vector_env", ("index", "exctype", "value", "trace"))
        if worker is not None:
            failed = worker["index"]  # an AsyncVectorEnv worker steps one sub-env: its own
        if worker is not None and isinstance(exc, Warning):
            # gymnasium logs a worker's error with warnings.warn before raising it; a warnings filter
            # "error" raised the log line instead. Do what gymnasium had left to do.
            exc = _finish_raise_if_errors(base, worker)
        if worker is not None and isinstance(exc, ValueError) and "write_to_shared_memory" in worker["trace"]:
            return _explain_unwritable_obs(base, exc, env_offset + worker["index"])
    elif isinstance(base, SyncVectorEnv):
        failed = _sync_failed_env(base, exc)
    if isinstance(exc, ValueError) and isinstance(base, (SyncVectorEnv, AsyncVectorEnv)):
        explained = _explain_unstackable_obs(base, exc, env_offset)
        if explained is not exc:
            return explained
    if failed is not None:
        _note_env(exc, env_offset + failed)
    return exc


def _sync_failed_env(base: SyncVectorEnv, exc: BaseException) -> int | None:
    """The sub-env of ``base`` whose ``step`` or ``reset`` raised ``exc``, from the frame of gymnasium's loop over them.

    None where ``exc`` came from elsewhere (the policy, or gymnasium's own code after the loop).
    """
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        frame = tb.tb_frame
        if (
            frame.f_globals.get("__name__") == "gymnasium.vector.sync_vector_env"
            and frame.f_code.co_name in ("step", "reset")
            and frame.f_locals.get("self") is base
        ):
            i = frame.f_locals.get("i")
            # The call this frame made is the sub-env's own method (its outermost wrapper's), not gymnasium's code.
            if isinstance(i, int) and 0 <= i < len(base.envs):
                if tb.tb_next.tb_frame.f_locals.get("self") is base.envs[i]:
                    return i
        tb = tb.tb_next
    return None


def _note_env(exc: BaseException, env: int) -> None:
    """Notes on ``exc`` the global index of the env that raised it, once (a vector env inside another reports too)."""
    note = f"(raised by env {env})"
    notes = getattr(exc, "__notes__", ())
    if not any(n.startswith("(raised by env ") for n in notes):
        add_note(exc, note)


def _explain_dead_worker(base: AsyncVectorEnv, exc: BaseException) -> BaseException:
    processes = base.processes
    # The pipe reports EOF a moment before the dead process can be reaped.
    deadline = time.monotonic() + 2.0
    while not (dead := [(i, p) for i, p in enumerate(processes) if p.exitcode is not None]):
        if time.monotonic() > deadline:
            return exc
        time.sleep(0.01)
    _shut_down(base)
    index, process = dead[0]
    code = process.exitcode
    assert code is not None  # it is dead
    cause = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    error = RuntimeError(
        f"Collector: worker process {index} of the {type(base).__name__} (pid {process.pid}) {cause} "
        f"while the collector was stepping the envs; the vector env cannot be used any more and was shut "
        f"down (its other {len(processes) - 1} worker processes terminated)"
    )
    error.__cause__ = exc
    return error


def _explain_unwritable_obs(base: AsyncVectorEnv, exc: ValueError, env: int) -> ValueError:
    """An observation that an AsyncVectorEnv worker could not write to shared memory: only its shape is known."""
    space = base.single_observation_space
    found = re.search(r"from shape (\(.*?\))", str(exc))
    shape = f" of shape {found.group(1)}" if found else ""
    error = ValueError(
        f"Collector: env {env} returned an observation{shape}, expected shape {tuple(space.shape or ())} and "
        f"dtype {space.dtype} of its observation space {space!r} (its AsyncVectorEnv worker could not write it "
        f"to shared memory: {exc})"
    )
    error.__cause__ = exc
    return error


def _explain_unstackable_obs(base: SyncVectorEnv | AsyncVectorEnv, exc: ValueError, env_offset: int) -> BaseException:
    """Names the sub-env whose observation could not be stacked with the others', if it can be found."""
    # SyncVectorEnv keeps the sub-envs' observations (privately); else they are the argument of the
    # gymnasium concatenate() that failed. If neither is there, gymnasium's error stands.
    observations = getattr(base, "_env_obs", None)
    if observations is None:
        stack = _frame_locals(exc, "gymnasium.vector.utils.space_utils", ("items",), outermost=True)
        observations = None if stack is None else stack["items"]
    if observations is None:
        return exc
    problem = describe_bad_single_obs(base.single_observation_space, list(observations), env_offset=env_offset)
    if problem is None:
        return exc
    if isinstance(base, AsyncVectorEnv):
        # Every worker replied to the step: nothing is pending, and close() must not wait for it.
        base._state = AsyncState.DEFAULT
    error = ValueError(f"Collector: {problem} ({type(base).__name__} could not stack the observations: {exc})")
    error.__cause__ = exc
    return error


def _frame_locals(
    exc: BaseException, module: str, names: tuple[str, ...], *, outermost: bool = False
) -> dict[str, Any] | None:
    """Locals of the innermost (or outermost) frame of ``exc``'s traceback in ``module`` that has all ``names``."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__") == module and all(name in frame.f_locals for name in names):
            found = frame.f_locals
            if outermost:
                break
        tb = tb.tb_next
    return found


def _finish_raise_if_errors(base: AsyncVectorEnv, state: dict[str, Any]) -> BaseException:
    """The rest of ``AsyncVectorEnv._raise_if_errors`` after its log line raised; returns the worker's exception.

    ``state``: the locals of its frame, in its loop over the ``num_errors`` workers that failed.
    """
    for _ in range(state["num_errors"] - state["i"] - 1):  # the other failed workers, not read yet
        index, _, _, _ = base.error_queue.get()
        base.parent_pipes[index].close()
        base.parent_pipes[index] = None  # type: ignore[call-overload]  # gymnasium: list[Connection], sets None too
    index = state["index"]
    if base.parent_pipes[index] is not None:
        base.parent_pipes[index].close()
        base.parent_pipes[index] = None  # type: ignore[call-overload]  # gymnasium: list[Connection], sets None too
    base._state = AsyncState.DEFAULT
    value = state["value"]
    error = value if isinstance(value, BaseException) else state["exctype"](value)
    error.__cause__ = RemoteTraceback(state["trace"])
    return error


def _shut_down(base: AsyncVectorEnv) -> None:
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
