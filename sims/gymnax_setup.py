"""gymnax's envs as the collector takes them: its GymnaxToVectorGymWrapper (JAX arrays) in gymnasium's JaxToTorch,
with the autoreset mode it has declared, as the integration tests and the benchmarks build them.

Run in gymnax's venv (sims/build.sh), with the checkout on PYTHONPATH.
"""

from __future__ import annotations

import gymnax
from gymnasium.vector import AutoresetMode, VectorWrapper
from gymnasium.wrappers.vector import JaxToTorch
from gymnax.wrappers.gym import GymnaxToVectorGymWrapper

__all__ = ["SameStep", "gymnax_envs"]


class SameStep(VectorWrapper):
    """Declares the autoreset mode gymnax's wrapper has but does not say (its metadata is ``{}``)."""

    def __init__(self, env):
        super().__init__(env)
        self.metadata = {**env.metadata, "autoreset_mode": AutoresetMode.SAME_STEP}


def gymnax_envs(num_envs: int, *, env_id: str = "CartPole-v1", seed: int = 3, declare: bool = True):
    """``num_envs`` of gymnax's ``env_id`` as torch tensors on the CPU, SAME_STEP declared unless ``declare`` is
    False (a module-level recipe, for worker processes too)."""
    env, params = gymnax.make(env_id)
    envs = JaxToTorch(GymnaxToVectorGymWrapper(env, num_envs=num_envs, params=params, seed=seed), device="cpu")
    return SameStep(envs) if declare else envs
