"""EnvPool as an env source: a picklable recipe whose pools take the collector's seeds, in every placement."""

from __future__ import annotations

import difflib
import sys
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

__all__ = ["EnvPoolRecipe", "EnvPoolVectorEnv", "check_envpool", "envpool_envs"]

# EnvPool's seeds are C++ ints: env i of a pool built with seed s is seeded s + i.
_SEED_LIMIT = 2**31
# EnvPool arguments that the collector sets itself: where each one is given instead.
_OWNED = {
    "num_envs": "Collector(num_envs=...)",
    "seed": "Collector(seed=...): env j is seeded seed + j",
    "env_seed": "Collector(seed=...): env j is seeded seed + j",
    "env_type": "nothing: the recipe always builds EnvPool's gymnasium API",
    "gym_reset_return_info": "nothing: the recipe always builds EnvPool's gymnasium API",
}


def envpool_envs(task_id: str, **kwargs: Any) -> EnvPoolRecipe:
    """A recipe for ``Collector(envs=...)`` that builds EnvPool envs of ``task_id``, seeded by the collector.

    The collector calls it as ``make_envs(num_envs)`` wherever its loop runs
    (the thread, each worker process, each Ray actor) and resets the pool
    with its seed, so env ``j`` (global index) is seeded ``seed + j`` in
    every placement, as gymnasium envs are. The recipe pickles as the task id
    and ``kwargs``; EnvPool is imported where the envs are built.

    Args:
        task_id: an EnvPool task, e.g. ``"CartPole-v1"`` or ``"Pong-v5"``
            (``envpool.list_all_envs()`` lists them).
        **kwargs: options of ``envpool.make_gymnasium`` (``max_episode_steps``,
            ``num_threads``, ``episodic_life``, ...), except ``num_envs`` and
            ``seed``, which come from the collector. ``batch_size`` (EnvPool's
            async mode) must be left out or equal ``num_envs``: an async pool
            is given as ``envs`` itself (see the README).

    Returns:
        An :class:`EnvPoolRecipe`.

    Raises:
        ImportError: EnvPool is not installed.
        ValueError: an unknown task id, or an argument the collector owns.
        TypeError: an option EnvPool does not know for this task.
    """
    return EnvPoolRecipe(task_id, **kwargs)


class EnvPoolRecipe:
    """``make_envs(num_envs)`` for the collector: an :class:`EnvPoolVectorEnv` of one EnvPool task.

    Built by :func:`envpool_envs`, which checks the task id and options once,
    in the trainer. It holds only the task id and the options, so it pickles
    to worker processes and Ray actors; each builds its own pool.
    """

    task_id: str
    kwargs: dict[str, Any]

    def __init__(self, task_id: str, **kwargs: Any) -> None:
        envpool = _import_envpool()
        if not isinstance(task_id, str):
            raise TypeError(
                f"envpool_envs: task_id must be an EnvPool task id str, got {type(task_id).__name__} {task_id!r}"
            )
        _check_owned(kwargs, "envpool_envs")
        known = envpool.list_all_envs()
        if task_id not in known:
            close = difflib.get_close_matches(task_id, known, n=3)
            hint = " (envpool.list_all_envs() lists them)"
            if close:
                hint = f"; did you mean {' or '.join(map(repr, close))}?"
            raise ValueError(f"envpool_envs: EnvPool has no task {task_id!r}{hint}")
        if "batch_size" in kwargs:
            # Async mode (batch_size < num_envs) is refused when num_envs is known, at the build.
            _check_int("batch_size", kwargs["batch_size"], "envpool_envs")
        try:
            spec = envpool.make_spec(task_id, num_envs=max(1, kwargs.get("batch_size", 1)), **kwargs)
        except (TypeError, ValueError, AssertionError) as exc:
            raise TypeError(
                f"envpool_envs({task_id!r}): EnvPool refused the options {kwargs!r}: {type(exc).__name__}: {exc}"
            ) from exc
        _refuse_players(getattr(spec.config, "max_num_players", 1), f"envpool_envs({task_id!r})")
        self.task_id = task_id
        self.kwargs = kwargs

    def __call__(self, num_envs: int, *, start_index: int = 0) -> EnvPoolVectorEnv:
        """Builds the vector env of ``num_envs`` envs; ``start_index``: the global index of its first env."""
        return EnvPoolVectorEnv(self.task_id, num_envs, env_offset=start_index, **self.kwargs)

    def __repr__(self) -> str:
        options = "".join(f", {key}={value!r}" for key, value in self.kwargs.items())
        return f"envpool_envs({self.task_id!r}{options})"


class EnvPoolVectorEnv(VectorEnv):
    """A gymnasium vector env over one EnvPool pool in sync mode whose ``reset(seed=s)`` seeds env ``i`` ``s + i``.

    EnvPool fixes each env's random generator when the pool is built and
    ignores ``reset(seed=...)``; this vector env builds its pool at the first
    ``reset`` and builds it anew at each ``reset(seed=...)``, with EnvPool's
    ``seed=s`` (env ``i`` of a pool is seeded ``s + i``), so a seeded reset
    starts the same episodes every time, as gymnasium's vector envs do. The
    first ``reset()`` without a seed draws one. ``reset()`` without a seed
    on a built pool resets its envs and lets their generators run on.

    Everything else is EnvPool's own: ``step`` is the pool's (NEXT_STEP
    autoreset: the step after an episode end resets the env, ignores its
    action and returns reward 0), and so are the infos (``env_id``,
    ``players``, ``elapsed_step``), except that ``env_id`` and
    ``players.env_id`` count from ``env_offset``: the global index of the
    env wherever the pool runs.

    Args:
        task_id: the EnvPool task.
        num_envs: envs in the pool.
        env_offset: global index of the pool's first env (a worker's share starts there).
        **kwargs: options of ``envpool.make_gymnasium`` other than ``num_envs`` and ``seed``.

    Raises:
        ValueError: for ``batch_size < num_envs`` (EnvPool's async mode: give such a pool itself).
    """

    metadata: dict[str, Any] = {"autoreset_mode": AutoresetMode.NEXT_STEP}
    autoreset_mode = AutoresetMode.NEXT_STEP  # as gymnasium's own vector envs say it, besides metadata
    task_id: str
    pool: Any = None  # EnvPool's pool, once the first reset built it
    seed: int | None
    env_offset: int

    def __init__(self, task_id: str, num_envs: int, *, env_offset: int = 0, **kwargs: Any) -> None:
        envpool = _import_envpool()
        _check_owned(kwargs, "EnvPoolVectorEnv")
        _check_sync(kwargs.get("batch_size", num_envs), num_envs, f"envpool_envs({task_id!r})")
        spec = envpool.make_spec(task_id, num_envs=num_envs, **kwargs)
        with _box_precision_quiet():
            self.single_observation_space = spec.gymnasium_observation_space
            self.single_action_space = spec.gymnasium_action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.num_envs = num_envs
        self.task_id = task_id
        self.kwargs = kwargs
        self.env_offset = env_offset
        self.pool = None  # built by the first reset, with its seed
        self.seed = None
        self._make = envpool.make_gymnasium

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Resets every env; with ``seed``, on a pool built anew whose env ``i`` is seeded ``seed + i``."""
        if seed is not None or self.pool is None:
            self._build(seed)
        obs, info = self.pool.reset(options=options)
        return obs, self._offset(info)

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        if self.pool is None:
            raise RuntimeError(f"{self!r}: call reset() before step() (the pool is built by the first reset)")
        obs, reward, terminated, truncated, info = self.pool.step(actions)
        return obs, reward, terminated, truncated, self._offset(info)

    def _build(self, seed: int | None) -> None:
        n = self.num_envs
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1)[0]) % (_SEED_LIMIT - n + 1)
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"{self!r}: reset(seed=...) takes an int or None, got {type(seed).__name__} {seed!r}")
        elif not 0 <= seed <= _SEED_LIMIT - n:
            raise ValueError(
                f"{self!r}: reset(seed={seed}) would seed its envs {seed}..{seed + n - 1}, but EnvPool's seeds are "
                f"32-bit ints: the seed must be in [0, {_SEED_LIMIT - n}] (with a Collector, seed + its num_envs "
                "envs, times the collectors resumed from it, must stay below 2**31)"
            )
        if self.pool is not None:
            old, self.pool = self.pool, None
            old.close()
        self.pool = self._make(self.task_id, num_envs=n, seed=int(seed), **self.kwargs)
        _quiet_spaces(self.pool)
        self.seed = int(seed)

    def _offset(self, info: dict[str, Any]) -> dict[str, Any]:
        """``env_id`` and ``players.env_id`` as global indices (EnvPool counts from 0 in each pool)."""
        if self.env_offset:
            if "env_id" in info:
                info["env_id"] = info["env_id"] + self.env_offset
            players = info.get("players")
            if isinstance(players, dict) and "env_id" in players:
                players["env_id"] = players["env_id"] + self.env_offset
        return info

    def close_extras(self, **kwargs: Any) -> None:
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.close()

    def __repr__(self) -> str:
        return f"EnvPoolVectorEnv({self.task_id!r}, num_envs={self.num_envs}, seed={self.seed})"


def check_envpool(envs: VectorEnv, seed: int | None) -> None:
    """Refuses an EnvPool pool that the collector would drive wrongly, and reads its spaces without warnings.

    A pool built by the user (``envpool.make_gymnasium``, live or from a
    ``make_envs`` function) has its seeds fixed: ``reset(seed=...)`` would be
    ignored, so a collector ``seed`` is refused with the fix. A pool in async
    mode (``batch_size < num_envs``) is driven by the send/recv driver (``SendRecvEnvs``). Does
    nothing for other vector envs (and never imports EnvPool).
    """
    if "envpool" not in sys.modules:
        return  # no EnvPool pool can exist
    base: Any = envs.unwrapped  # past the check below, an EnvPool of the user's own (its config)
    if isinstance(base, EnvPoolVectorEnv) or not _is_pool(base):
        return
    config = base.config
    _refuse_players(config.get("max_num_players", 1), f"Collector: envs is an EnvPool pool ({type(base).__name__})")
    if seed is not None:
        if config["batch_size"] < config["num_envs"]:  # the recipe builds sync pools only
            fix = f"make the pool with seed={seed} and pass seed=None"
        else:
            fix = (
                "pass envs=torch_rollout.envpool_envs('<task id>', ...) with num_envs instead (the collector then "
                "builds the pool and seeds env j with seed + j, in every placement), or seed=None to keep the "
                "pool's own seeds"
            )
        raise ValueError(
            f"Collector: envs is an EnvPool pool ({type(base).__name__} of {config['num_envs']} envs, built with "
            f"seed={config['seed']}); EnvPool fixes its seeds when the pool is built and ignores reset(seed=...), so "
            f"seed={seed} would not reach the envs: {fix}"
        )
    _quiet_spaces(base)


def _refuse_players(players: int, where: str) -> None:
    """Refuses a multi-player task: its pool returns a row per player, and the batch's rows are one per env."""
    if players > 1:
        raise ValueError(
            f"{where}: a multi-player task ({players} players per env), which the collector does not support: it "
            "keeps one row per env and step, and this pool returns one per player; collect a single-player task, "
            "or make each env single-player (a gymnasium env in which the other players are part of the env, "
            "e.g. a fixed opponent) and pass its vector env or a make_envs function"
        )


def _is_pool(env: Any) -> bool:
    return any(cls.__module__.startswith("envpool.") for cls in type(env).__mro__)


def _check_sync(batch_size: Any, num_envs: int, what: str) -> None:
    """Refuses EnvPool's async mode in the recipe, whose pools the collector resets with seeds (sync mode only)."""
    if batch_size != num_envs:
        raise ValueError(
            f"Collector: {what} has batch_size={batch_size} < num_envs={num_envs}, EnvPool's async mode, which "
            "envpool_envs does not build; leave batch_size out (sync mode), or for async mode pass a pool you make "
            "(envpool.make_gymnasium(..., batch_size=..., seed=...)) as envs, or return one from your own make_envs"
        )


def _check_owned(kwargs: Mapping[str, Any], where: str) -> None:
    for key, instead in _OWNED.items():
        if key in kwargs:
            raise ValueError(f"{where}: {key}={kwargs[key]!r} is set by the collector; give {instead}")


def _check_int(name: str, value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be an int >= 1, got {type(value).__name__} {value!r}")


def _import_envpool() -> Any:
    try:
        import envpool
    except ImportError as exc:
        raise ImportError(
            "torch_rollout.envpool_envs needs EnvPool, which is not installed: pip install 'torch_rollout[envpool]' "
            f"(or pip install envpool) ({exc})"
        ) from exc
    return envpool


@contextmanager
def _box_precision_quiet() -> Iterator[None]:
    """Ignores gymnasium's "Box low's precision lowered" warnings, and only those, inside the block.

    EnvPool's spaces give float64 bounds to float32 Boxes, and gymnasium warns
    about the cast each time such a Box is built (an error under ``-W
    error``). The bounds are EnvPool's; the user can do nothing about them.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*Box (low|high)'s precision lowered", category=UserWarning, module=r"gymnasium\."
        )
        yield


def _quiet_spaces(pool: Any) -> None:
    """Builds (and so caches) a pool's gymnasium spaces without the Box precision warnings."""
    with _box_precision_quiet():
        pool.observation_space  # noqa: B018  (EnvPool builds the spaces on first access and keeps them)
        pool.action_space  # noqa: B018
