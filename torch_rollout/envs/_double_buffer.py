"""Double-buffered collection: groups of envs that step while the policy acts on another group's observations."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from torch_rollout.envs._gym import EnvRecipe, GymEnvs, autoreset_mode, build_envs, explain_env_error
from torch_rollout.util._notes import add_note

__all__ = ["DoubleBufferedRecipe", "DoubleBufferedVectorEnv", "double_buffered"]

_ASYNC_METHODS = ("reset_async", "reset_wait", "step_async", "step_wait")


class DoubleBufferedVectorEnv(VectorEnv):
    """Groups of vector envs that step asynchronously, presented as one vector env the collector double-buffers.

    The collector drives it as it drives an EnvPool in async mode
    (its send/recv driver, ``SendRecvEnvs``): ``recv()`` waits for the group that was sent
    first, the policy acts on that group's observations, and ``send()`` starts
    the group's next step, so that each group steps in its worker processes
    while the policy works on the other group. Env ``g * B + i`` is env ``i``
    of group ``g`` (``B`` envs per group); every env contributes its own rows
    in order, exactly as without double-buffering. ``reset``/``step`` also work,
    stepping all groups at once.

    Args:
        groups: two or more vector envs with ``reset_async``/``reset_wait`` and
            ``step_async``/``step_wait`` (gymnasium's ``AsyncVectorEnv``; a
            wrapper does not forward these), of equal ``num_envs``, the same
            single spaces, in NEXT_STEP autoreset mode (gymnasium's default).
            They are closed with this env.
        env_offset: global index of env 0, to name envs in errors (a worker's share).

    Raises:
        TypeError: a group that cannot step asynchronously.
        ValueError: fewer than two groups, or groups that differ in size,
            spaces or autoreset mode.
    """

    is_async = True  # stepped with send/recv by the collector (see torch_rollout.envs._numpy.is_async_pool)
    autoreset_mode = AutoresetMode.NEXT_STEP  # as gymnasium's own vector envs say it, besides metadata

    def __init__(self, groups: Sequence[VectorEnv], *, env_offset: int = 0) -> None:
        groups = list(groups)
        _check_groups(groups)
        first = groups[0]
        self.groups: list[Any] = groups  # vector envs with the async methods (checked): no one class of gymnasium's
        self.group_size = B = first.num_envs
        self.num_envs = B * len(groups)
        self.env_offset = env_offset
        self.single_observation_space = first.single_observation_space
        self.single_action_space = first.single_action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = {**first.metadata, "autoreset_mode": AutoresetMode.NEXT_STEP}
        self.render_mode = first.render_mode
        # What the collector's async loop reads from an EnvPool: recv() returns one group.
        self.config = {"num_envs": self.num_envs, "batch_size": B, "max_num_players": 1}
        self._sent: deque[tuple[int, str]] = deque()  # (group, "reset" | "step") in the order they were started

    # -- the async API (EnvPool's) -------------------------------------------------------------

    def async_reset(self, seed: int | None = None) -> None:
        """Starts a reset of every group; env ``j`` is seeded ``seed + j``. ``recv()`` returns each group."""
        if self._sent:
            raise RuntimeError(
                f"DoubleBufferedVectorEnv: async_reset() while {len(self._sent)} groups are still stepping; "
                "recv() them first"
            )
        for g, group in enumerate(self.groups):
            group.reset_async(seed=None if seed is None else seed + g * self.group_size)
            self._sent.append((g, "reset"))

    def send(self, actions: Any, env_id: Any) -> None:
        """Starts the step of the group whose envs ``env_id`` are (all of them, in order)."""
        ids = np.asarray(env_id)
        B = self.group_size
        g = int(ids[0]) // B if ids.size else -1
        if ids.shape != (B,) or not 0 <= g < len(self.groups) or not np.array_equal(ids, np.arange(g * B, g * B + B)):
            raise ValueError(
                f"DoubleBufferedVectorEnv: send() steps one whole group of {B} envs, given as its env ids in order "
                f"(g * {B} ... g * {B} + {B - 1}), got env_id={ids.tolist()}"
            )
        if any(sent == g for sent, _ in self._sent):
            raise RuntimeError(
                f"DoubleBufferedVectorEnv: send() to group {g}, which is still stepping; recv() it first"
            )
        self.groups[g].step_async(actions)
        self._sent.append((g, "step"))

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Waits for the group sent first; its ``(obs, reward, terminated, truncated, info)``, ``info["env_id"]`` set.

        A reset's reward is 0 and its ``terminated``/``truncated`` False.
        """
        if not self._sent:
            raise RuntimeError("DoubleBufferedVectorEnv: recv() with no group stepping; send() or async_reset() first")
        g, kind = self._sent.popleft()
        group, B = self.groups[g], self.group_size
        try:
            if kind == "reset":
                obs, info = group.reset_wait()
                reward, terminated, truncated = np.zeros(B), np.zeros(B, dtype=bool), np.zeros(B, dtype=bool)
            else:
                obs, reward, terminated, truncated, info = group.step_wait()
        except Exception as exc:
            explained = explain_env_error(group, exc, env_offset=self.env_offset + g * B)
            first = self.env_offset + g * B
            add_note(explained, f"(in group {g} of the DoubleBufferedVectorEnv: envs {first}..{first + B - 1})")
            if explained is exc:
                raise
            raise explained from explained.__cause__  # gymnasium's error, or the worker's traceback
        if getattr(group, "copy", True) is False:
            # The group's shared memory is written by its next step, which the collector starts before
            # it has stored these observations.
            obs = _copy(obs)
        info = dict(info)
        info["env_id"] = np.arange(g * B, g * B + B, dtype=np.int32)
        return obs, reward, terminated, truncated, info

    # -- VectorEnv ------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        if options is not None:
            raise ValueError(f"DoubleBufferedVectorEnv: reset(options=...) is not supported, got options={options!r}")
        self._drain()
        self.async_reset(seed)
        results = [self.recv() for _ in self.groups]
        return _concatenate([r[0] for r in results]), _merge_infos([r[4] for r in results])

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        B = self.group_size
        for g in range(len(self.groups)):
            self.send(_rows(actions, slice(g * B, g * B + B)), np.arange(g * B, g * B + B))
        results = [self.recv() for _ in self.groups]
        obs = _concatenate([r[0] for r in results])
        reward, terminated, truncated = (np.concatenate([r[i] for r in results]) for i in (1, 2, 3))
        return obs, reward, terminated, truncated, _merge_infos([r[4] for r in results])

    def _drain(self) -> None:
        while self._sent:
            self.recv()

    def close_extras(self, **kwargs: Any) -> None:
        # The collector leaves the groups' next steps in flight. Take them back here: gymnasium's close would
        # wait for them too, but with a warning (an error under -W error). A step that fails now belongs to no row.
        while self._sent:
            g, kind = self._sent.popleft()
            group = self.groups[g]
            try:
                group.reset_wait() if kind == "reset" else group.step_wait()
            except Exception:
                pass
        for group in self.groups:
            if not group.closed:
                group.close(**kwargs)

    def __repr__(self) -> str:
        return f"DoubleBufferedVectorEnv({len(self.groups)} x {self.groups[0]!r})"


def double_buffered(envs: EnvRecipe) -> DoubleBufferedRecipe:
    """A recipe that builds each loop's envs as two groups stepping asynchronously (double-buffered collection).

    Pass it as the Collector's ``envs``. Each loop's envs (each worker's share)
    are built as two equal groups of ``envs`` and presented as a
    :class:`DoubleBufferedVectorEnv`: the collector acts on one group's
    observations while the other group steps. An env id (or a :func:`gym_envs`
    recipe without ``vectorization_mode``) is made with
    ``vectorization_mode="async"``, one process per env. The batches are those of
    the envs stepped as one vector env (with a deterministic policy, identical).
    NEXT_STEP autoreset only; each share of envs must be even. On 2 cores it lost
    to one SyncVectorEnv (``docs/performance.md``): it pays where env steps are
    slow and cores are spare.

    Args:
        envs: an env id, or a function ``make_envs(num_envs[, start_index])``
            returning an AsyncVectorEnv-like vector env (``step_async``/``step_wait``).

    Examples:
        >>> double_buffered("CartPole-v1")
        double_buffered(gym_envs('CartPole-v1', vectorization_mode='async'))
    """
    return DoubleBufferedRecipe(envs)


class DoubleBufferedRecipe:
    """The recipe that :func:`double_buffered` returns: a :class:`DoubleBufferedVectorEnv` of ``num_groups`` groups.

    Group ``g`` of a share starting at ``start_index`` is built with
    ``start_index + g * B``. Picklable, for worker processes and Ray actors.
    """

    def __init__(self, recipe: EnvRecipe, *, num_groups: int = 2) -> None:
        if isinstance(recipe, VectorEnv):
            raise ValueError(
                f"double_buffered: builds two groups of envs from an env id or a make_envs function, but got a live "
                f"{type(recipe).__name__}; pass the id or function, or pass "
                "torch_rollout.DoubleBufferedVectorEnv([group_0, group_1]) of two AsyncVectorEnv as envs"
            )
        if isinstance(recipe, str):
            recipe = GymEnvs(recipe)
        if isinstance(recipe, GymEnvs) and "vectorization_mode" not in recipe.kwargs:
            recipe = GymEnvs(recipe.env_id, vectorization_mode="async", **recipe.kwargs)
        if not callable(recipe):
            raise TypeError(
                f"double_buffered: envs must be an env id or a function make_envs(num_envs) -> VectorEnv, got "
                f"{type(recipe).__name__} {recipe!r}"
            )
        self.recipe = recipe
        self.num_groups = num_groups

    def check_shares(self, shares: list[tuple[int, int]]) -> None:
        """Refuses worker shares of envs that do not split into equal groups (before any worker starts)."""
        counts = [count for _, count in shares]
        if any(count % self.num_groups for count in counts):
            workers = f"over {len(counts)} workers gives shares of {counts} envs" if len(counts) > 1 else "is odd"
            raise ValueError(
                f"Collector: double_buffered envs split each worker's envs into two equal groups, but num_envs="
                f"{sum(counts)} {workers}; pass a num_envs that is a multiple of {self.num_groups * len(counts)}"
            )

    def __call__(self, num_envs: int, *, start_index: int = 0) -> DoubleBufferedVectorEnv:
        size = num_envs // self.num_groups
        self.check_shares([(start_index, num_envs)])
        groups: list[VectorEnv] = []
        try:
            for g in range(self.num_groups):
                groups.append(build_envs(self.recipe, size, start_index=start_index + g * size))
            return DoubleBufferedVectorEnv(groups, env_offset=start_index)
        except BaseException:
            for group in groups:
                group.close()
            raise

    def __repr__(self) -> str:
        return f"double_buffered({self.recipe!r})"


def _check_groups(groups: list[VectorEnv]) -> None:
    if len(groups) < 2:
        raise ValueError(f"DoubleBufferedVectorEnv: groups must hold at least two vector envs, got {len(groups)}")
    for g, group in enumerate(groups):
        if not isinstance(group, VectorEnv):
            raise TypeError(f"DoubleBufferedVectorEnv: groups[{g}] is {type(group).__name__}, expected a VectorEnv")
        missing = [name for name in _ASYNC_METHODS if not callable(getattr(group, name, None))]
        if missing:
            raise TypeError(
                f"DoubleBufferedVectorEnv: groups[{g}] is {group!r}, which has no {', '.join(missing)}: each group "
                "must step asynchronously, as gymnasium's AsyncVectorEnv does (vectorization_mode='async'; a wrapper "
                "around one does not forward these methods)"
            )
        mode = autoreset_mode(group)
        if mode != AutoresetMode.NEXT_STEP:
            raise ValueError(
                f"DoubleBufferedVectorEnv: groups[{g}] runs in autoreset mode {mode}; double-buffered groups must run "
                "in AutoresetMode.NEXT_STEP (gymnasium's default)"
            )
    first = groups[0]
    for g, group in enumerate(groups[1:], start=1):
        for name in ("num_envs", "single_observation_space", "single_action_space"):
            if getattr(group, name) != getattr(first, name):
                raise ValueError(
                    f"DoubleBufferedVectorEnv: groups[{g}].{name} is {getattr(group, name)!r} but groups[0].{name} is "
                    f"{getattr(first, name)!r}; the groups must be alike"
                )


def _copy(obs: Any) -> Any:
    if isinstance(obs, dict):
        return {key: _copy(value) for key, value in obs.items()}
    if isinstance(obs, tuple):
        return tuple(_copy(value) for value in obs)
    return np.array(obs, copy=True)


def _rows(batch: Any, rows: slice) -> Any:
    if isinstance(batch, dict):
        return {key: _rows(value, rows) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_rows(value, rows) for value in batch)
    return batch[rows]


def _concatenate(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, dict):
        return {key: _concatenate([part[key] for part in parts]) for key in first}
    if isinstance(first, tuple):
        return tuple(_concatenate([part[i] for part in parts]) for i in range(len(first)))
    return np.concatenate(parts)


def _merge_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One info dict of the groups' (gymnasium's layout: per-env arrays with ``_key`` masks), env_id included."""
    sizes = [len(info["env_id"]) for info in infos]
    merged: dict[str, Any] = {}
    for key in {key for info in infos for key in info}:
        merged[key] = _merge_key([info.get(key) for info in infos], sizes, key)
    return merged


def _merge_key(values: list[Any], sizes: list[int], key: str) -> Any:
    present = [value for value in values if value is not None]
    if all(isinstance(value, dict) for value in present):
        sub = {k for value in present for k in value}
        return {k: _merge_key([None if v is None else v.get(k) for v in values], sizes, k) for k in sub}
    parts = []
    for value, size in zip(values, sizes):
        if value is None:
            # a group without this key: a False mask, and empty values beneath it
            like = np.asarray(present[0])
            value = np.zeros((size, *like.shape[1:]), dtype=like.dtype)
        parts.append(np.asarray(value))
    return np.concatenate(parts)
