"""Vector envs for the tests of ``collector.env_calls``: one whose steps say when they run, and one that answers
a call for all its envs at once, as a vector env of torch tensors does."""

from __future__ import annotations

import time
from functools import partial

from gymnasium.vector import SyncVectorEnv

from counting_env import CountingEnv


class FlaggedEnv(CountingEnv):
    """CountingEnv whose ``stepping`` is True only inside ``step``, which takes ``delay`` seconds."""

    def __init__(self, env_id: int = 0, *, delay: float = 0.002) -> None:
        super().__init__(env_id)
        self.stepping = False
        self.delay = delay

    def step(self, action):
        self.stepping = True
        try:
            time.sleep(self.delay)
            return super().step(action)
        finally:
            self.stepping = False


def make_flagged_envs(num_envs: int, start_index: int = 0) -> SyncVectorEnv:
    """FlaggedEnvs ``start_index ..``; a recipe for every placement."""
    return SyncVectorEnv([partial(FlaggedEnv, start_index + i) for i in range(num_envs)])


class OneAnswerVectorEnv(SyncVectorEnv):
    """A SyncVectorEnv of CountingEnvs whose ``get_attr`` answers with one value for all its envs."""

    def get_attr(self, name: str):
        return 42


def make_one_answer_envs(num_envs: int, start_index: int = 0) -> OneAnswerVectorEnv:
    return OneAnswerVectorEnv([partial(CountingEnv, start_index + i) for i in range(num_envs)])
