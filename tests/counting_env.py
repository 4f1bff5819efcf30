"""Counting envs whose every step is assertable by hand, and policies to drive them.

CountingEnv records each step (its action, reward and observations) for tests that check a batch against the env's
own log; TransitionCountingEnv numbers its real transitions and checks each action, for tests that prove every
transition arrives once, in order, acted on by the policy that saw its observation.
"""

from __future__ import annotations

import os
from functools import partial

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv
from torch import nn

from reliability_envs import EnvFault


class CountingEnv(gym.Env):
    """obs = [env_id, episode, step in episode, last action] as float64 (stored as float32).

    Episode ``e`` of env ``k`` lasts ``3 + (7k + 5e) % 6`` steps and ends by
    termination unless ``(k + e) % 3 == 0``, in which case it is truncated.
    The reward of a step is ``10 * step + action``. Every real step is appended
    to ``log`` as ``(obs, action, reward, next_obs, terminated, truncated)``;
    ``next_obs`` at an episode end is the final observation.
    """

    metadata: dict = {"render_modes": []}

    def __init__(self, env_id: int = 0) -> None:
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float64)
        self.action_space = gym.spaces.Discrete(3)
        self.env_id = env_id
        self.episode = -1
        self.t = 0
        self.last_action = -1
        self.log: list[tuple] = []

    def length(self, episode: int) -> int:
        return 3 + (7 * self.env_id + 5 * episode) % 6

    def _obs(self) -> np.ndarray:
        return np.array([self.env_id, self.episode, self.t, self.last_action], dtype=np.float64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        self.last_action = -1
        return self._obs(), {}

    def step(self, action):
        obs = self._obs()
        action = int(action)
        reward = 10.0 * self.t + action
        self.t += 1
        self.last_action = action
        ended = self.t == self.length(self.episode)
        terminated = ended and (self.env_id + self.episode) % 3 != 0
        truncated = ended and not terminated
        next_obs = self._obs()
        self.log.append((obs, action, reward, next_obs, terminated, truncated))
        return next_obs, reward, terminated, truncated, {}


gym.register("TorchRolloutCounting-v0", entry_point=CountingEnv)


class SeedEnv(CountingEnv):
    """CountingEnv whose ``obs[0]`` is the seed of its last seeded reset (-1 before one): which seed reached it."""

    def __init__(self, env_id: int = 0) -> None:
        super().__init__(env_id)
        self.seed_given = -1

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.seed_given = seed
        return super().reset(seed=seed, options=options)

    def _obs(self) -> np.ndarray:
        return np.array([self.seed_given, self.episode, self.t, self.last_action], dtype=np.float64)


class SeedLogEnv(CountingEnv):
    """CountingEnv that appends the seed of each seeded reset to ``<log_dir>/env<index>``: every reset it saw."""

    def __init__(self, env_id: int = 0, *, log_dir: str) -> None:
        super().__init__(env_id)
        self.log_path = os.path.join(log_dir, f"env{env_id}")

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            with open(self.log_path, "a") as f:
                f.write(f"{seed}\n")
        return super().reset(seed=seed, options=options)


def make_seed_log_envs(num_envs: int, start_index: int = 0, *, log_dir: str) -> SyncVectorEnv:
    """SeedLogEnvs ``start_index ..`` logging to ``log_dir``; with ``functools.partial`` a recipe for any placement."""
    return SyncVectorEnv([partial(SeedLogEnv, start_index + i, log_dir=log_dir) for i in range(num_envs)])


def logged_seeds(log_dir: str, num_envs: int) -> list[list[int]]:
    """The seeds of every seeded reset that each of envs ``0 .. num_envs - 1`` saw, in order."""
    seeds = []
    for j in range(num_envs):
        path = os.path.join(log_dir, f"env{j}")
        if not os.path.exists(path):
            seeds.append([])
            continue
        with open(path) as f:
            seeds.append([int(line) for line in f.read().split()])
    return seeds


def make_seed_envs(num_envs: int, start_index: int = 0) -> SyncVectorEnv:
    """SeedEnvs ``start_index ..`` (NEXT_STEP mode); a recipe for worker processes and Ray actors."""
    return SyncVectorEnv([partial(SeedEnv, start_index + i) for i in range(num_envs)])


def make_counting_envs(
    num_envs: int, mode: AutoresetMode = AutoresetMode.NEXT_STEP, start_index: int = 0
) -> SyncVectorEnv:
    """CountingEnvs ``start_index ..``; with ``functools.partial`` (mode as keyword) a recipe for worker processes."""
    return SyncVectorEnv([partial(CountingEnv, start_index + i) for i in range(num_envs)], autoreset_mode=mode)


def make_async_counting_envs(num_envs: int, start_index: int = 0) -> AsyncVectorEnv:
    """CountingEnvs ``start_index ..``, each in its own process (NEXT_STEP mode): groups to double-buffer."""
    return AsyncVectorEnv([partial(CountingEnv, start_index + i) for i in range(num_envs)])


def value_fn(obs: torch.Tensor) -> torch.Tensor:
    """The test policies' value of observations ``[n, 4]`` of CountingEnv."""
    obs = torch.as_tensor(obs, dtype=torch.float64).reshape(-1, 4)
    return 0.01 * obs[:, 0] + 0.1 * obs[:, 1] + 0.5 * obs[:, 2] + 0.3 * obs[:, 3]


class CountingPolicy(nn.Module):
    """Values from ``value_fn``; actions drawn from torch's RNG, or a function of obs when ``deterministic``."""

    def __init__(self, *, deterministic: bool = False) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.deterministic = deterministic

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        n = obs.shape[0]
        if self.deterministic:
            action = (obs[:, 0] + obs[:, 1] + obs[:, 2]).long() % 3
        else:
            action = torch.randint(0, 3, (n,), device=obs.device)
        value = (value_fn(obs).to(obs.dtype) * self.scale).to(obs.device)
        return {"action": action, "value": value, "log_prob": torch.full((n,), -1.0986, device=obs.device)}


class TransitionCountingEnv(gym.Env):
    """An env whose every real transition can be recognized in a batch.

    The observation is ``[env index, episode, t, k]``: ``t`` counts the steps of
    the episode, ``k`` every ``step()`` call of this env since it was built (its
    real transitions). A step's reward is ``k`` of that step, so the masked rows
    of one env across consecutive batches must read ``0, 1, 2, ...``. Episode
    ``e`` of env ``i`` lasts ``episode_length(i, e)`` steps and ends terminated
    when ``e`` is even, truncated when odd. The action must be ``t % 2`` (what
    TransitionCountingPolicy picks from the observation), else step raises: a proof that
    each action reached the env whose observation chose it.
    """

    metadata: dict = {"render_modes": []}

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.episode = -1
        self.t = 0
        self.k = 0

    @staticmethod
    def episode_length(index: int, episode: int) -> int:
        return 2 + (3 * index + episode) % 5

    def _obs(self) -> np.ndarray:
        return np.array([self.index, self.episode, self.t, self.k], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return self._obs(), {}

    def step(self, action: object) -> tuple[np.ndarray, float, bool, bool, dict]:
        if int(action) != self.t % 2:
            raise EnvFault(f"TransitionCountingEnv {self.index}: action {action} at t={self.t}, expected {self.t % 2}")
        reward = float(self.k)
        self.k += 1
        self.t += 1
        end = self.t == self.episode_length(self.index, self.episode)
        terminated = end and self.episode % 2 == 0
        return self._obs(), reward, terminated, end and not terminated, {}


class TransitionCountingPolicy(nn.Module):
    """Picks ``t % 2`` and values an observation at ``k + t / 8`` (exact in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        t, k = obs[:, 2], obs[:, 3]
        return {
            "action": t.long() % 2,
            "value": self.scale * (k + t / 8),
            "log_prob": torch.zeros(obs.shape[0]),
        }


def counting_vec(
    num_envs: int,
    start_index: int = 0,
    *,
    cls: type[VectorEnv] = SyncVectorEnv,
    mode: AutoresetMode = AutoresetMode.NEXT_STEP,
) -> VectorEnv:
    """TransitionCountingEnvs ``start_index ..`` as a vector env: a picklable recipe for worker processes (with
    partial)."""
    return cls([partial(TransitionCountingEnv, start_index + i) for i in range(num_envs)], autoreset_mode=mode)
