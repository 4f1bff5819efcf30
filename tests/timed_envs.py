"""Envs and a policy whose steps take a known time, for the tests of the collector's account of its time."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class SlowEnv(gym.Env):
    """A 2-float observation, two actions, episodes of 1000 steps (longer than any test runs); steps sleep ``pause``."""

    def __init__(self, pause: float = 0.0) -> None:
        self.pause = pause
        self.observation_space = spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.pause:
            time.sleep(self.pause)
        self.t += 1
        return np.full(2, self.t, dtype=np.float32), 1.0, self.t == 1000, False, {}


def make_slow_envs(num_envs: int, pause: float = 0.0) -> gym.vector.VectorEnv:
    """``num_envs`` SlowEnvs in a SyncVectorEnv: a vector step takes ``num_envs * pause`` seconds at least."""
    return gym.vector.SyncVectorEnv([lambda: SlowEnv(pause) for _ in range(num_envs)])


class BusyEnv(SlowEnv):
    """A :class:`SlowEnv` whose steps spin in Python for ``busy`` seconds: they hold the GIL, as Python envs do."""

    def __init__(self, busy: float = 0.0) -> None:
        super().__init__()
        self.busy = busy

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        end = time.perf_counter() + self.busy
        while time.perf_counter() < end:
            pass
        return super().step(action)


def make_busy_envs(num_envs: int, busy: float = 0.0) -> gym.vector.VectorEnv:
    """``num_envs`` BusyEnvs in a SyncVectorEnv: a vector step holds the GIL ``num_envs * busy`` seconds."""
    return gym.vector.SyncVectorEnv([lambda: BusyEnv(busy) for _ in range(num_envs)])
