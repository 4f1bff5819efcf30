"""ManiSkill3's tasks on PhysX CPU as the collector takes them: one env through ManiSkillVectorEnv (torch tensors),
several in gymnasium's SyncVectorEnv of CPUGymWrapper envs (NumPy), as the integration tests and the benchmarks
build them.

Run in ManiSkill's venv (sims/build.sh), with the checkout on PYTHONPATH.
"""

from __future__ import annotations

import gymnasium as gym
import mani_skill.envs  # noqa: F401  (registers the tasks)
from gymnasium.vector import AutoresetMode
from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper
from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

__all__ = ["cpu_envs", "maniskill_vector_env", "push_cube"]


def push_cube(*, max_episode_steps: int | None = None, **kwargs) -> gym.Env:
    """One PushCube-v1 env on PhysX CPU with state observations and no rendering (``max_episode_steps`` None: the
    task's own, 50)."""
    return gym.make(
        "PushCube-v1",
        obs_mode="state",
        num_envs=1,  # PhysX CPU steps one env per scene
        sim_backend="physx_cpu",
        render_mode=None,
        render_backend="none",
        max_episode_steps=max_episode_steps,
        **kwargs,
    )


def maniskill_vector_env(*, max_episode_steps: int | None = None) -> ManiSkillVectorEnv:
    """One PushCube-v1 env through ManiSkillVectorEnv (torch tensors, its own autoreset, final observations in
    the infos)."""
    return ManiSkillVectorEnv(
        push_cube(max_episode_steps=max_episode_steps), auto_reset=True, ignore_terminations=False
    )


def cpu_envs(num_envs: int, *, max_episode_steps: int | None = None) -> gym.vector.SyncVectorEnv:
    """``num_envs`` PushCube-v1 envs, each on PhysX CPU in a scene of its own, as ManiSkill's CPU wrapper gives
    them (NumPy arrays), in gymnasium's SyncVectorEnv resetting within the step (``infos["final_obs"]``); a
    module-level recipe, for worker processes too."""
    return gym.vector.SyncVectorEnv(
        [lambda: CPUGymWrapper(push_cube(max_episode_steps=max_episode_steps)) for _ in range(num_envs)],
        autoreset_mode=AutoresetMode.SAME_STEP,
    )
