"""ale-py's vector env (``AtariVectorEnv``, what ``gymnasium.make_vec("ALE/...")`` builds): collected whole in its
synchronous mode, refused by name in its asynchronous one (``batch_size < num_envs``)."""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from torch_rollout import Collector

ale_py = pytest.importorskip("ale_py")
gym.register_envs(ale_py)


class _Noop(nn.Module):
    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": torch.zeros(obs.shape[0], dtype=torch.long)}


def test_an_atari_env_id_collects_uint8_frame_stacks():
    envs = gym.make_vec("ALE/Pong-v5", num_envs=2)
    assert isinstance(envs, ale_py.vector_env.AtariVectorEnv)
    with Collector(envs, _Noop(), num_steps=3, device="cpu", gae=None, seed=0) as collector:
        batch = next(collector)
    envs.close()
    assert batch["obs"].shape == (3, 2, 4, 84, 84) and batch["obs"].dtype == torch.uint8
    assert batch["mask"].all()  # no episode ends in 3 steps of Pong
    frames = batch["obs"].numpy()
    assert np.array_equal(frames[1, :, :3], frames[0, :, 1:])  # each step's stack shifts in one new frame


def test_the_asynchronous_mode_is_refused_at_construction_by_name():
    envs = ale_py.vector_env.AtariVectorEnv("pong", num_envs=4, batch_size=2)
    message = (
        "Collector: envs (AtariVectorEnv) steps batch_size=2 of its num_envs=4 envs at a time (an asynchronous "
        "mode); the collector steps every env at every step: build it with batch_size=4 (or leave batch_size at "
        "its default), or use an EnvPool pool in async mode through torch_rollout.envpool_envs"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        Collector(envs, _Noop(), num_steps=3, device="cpu", gae=None)
    envs.close()
