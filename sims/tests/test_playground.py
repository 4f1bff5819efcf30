"""Brax and MuJoCo Playground on XLA's CPU: their own jitted reset/step run, and their arrays reach torch by DLPack.

Neither ships a gymnasium vector env of torch tensors (Brax's wrappers speak the old gym 4-tuple API; Playground's
RSLRLBraxWrapper drops final observations), so no collector rows are checked here yet.
"""

from __future__ import annotations

import jax
import pytest
import torch
from brax import envs as brax_envs
from mujoco_playground import registry

NUM_ENVS, STEPS = 16, 5


def load(framework: str, name: str):
    return registry.load(name) if framework == "playground" else brax_envs.get_environment(name)


@pytest.mark.parametrize(
    ("framework", "name"),
    [("playground", "CartpoleBalance"), ("brax", "inverted_pendulum")],
    ids=["playground-CartpoleBalance", "brax-inverted_pendulum"],
)
def test_jitted_steps_reach_torch_without_a_copy(framework, name):
    env = load(framework, name)
    reset, step = jax.jit(jax.vmap(env.reset)), jax.jit(jax.vmap(env.step))
    state = reset(jax.random.split(jax.random.PRNGKey(0), NUM_ENVS))
    action = jax.numpy.zeros((NUM_ENVS, env.action_size))
    for _ in range(STEPS):
        state = step(state, action)
    obs = torch.from_dlpack(state.obs)
    assert obs.shape == (NUM_ENVS, env.observation_size) and obs.dtype == torch.float32
    assert torch.isfinite(obs).all()
    assert obs.data_ptr() == state.obs.unsafe_buffer_pointer(), "DLPack copied the observations"
    reward, done = torch.from_dlpack(state.reward), torch.from_dlpack(state.done)
    assert reward.shape == done.shape == (NUM_ENVS,)
