"""mjlab 1.6's tasks on MuJoCo-Warp on Warp's CPU device, as the integration tests and the benchmarks build them.

Run in mjlab's venv (sims/build.sh), with the checkout on PYTHONPATH. ``make_env("cartpole", 16)`` is
``ManagerBasedRlEnv(cfg=..., device="cpu")`` of Mjlab-Cartpole-Balance with a pole-fell termination added (the
task's own has none, only a 1,000-step time limit); ``mjlab_envs`` is such an env as the collector takes it:
``FromMjlab`` (``auto_reset=False``, exact bootstraps) or mjlab's ``RslRlVecEnvWrapper`` through ``FromRslRl``
(``bootstrap="last_obs"``, approximate).
"""

from __future__ import annotations

import math

import mjlab.tasks  # noqa: F401  (registers the tasks)
import torch
from mjlab.envs import ManagerBasedRlEnv
from mjlab.managers.scene_entity_config import SceneEntityCfg
from mjlab.managers.termination_manager import TerminationTermCfg
from mjlab.rl.vecenv_wrapper import RslRlVecEnvWrapper
from mjlab.tasks.registry import load_env_cfg

from torch_rollout.envs import FromMjlab, FromRslRl

__all__ = ["TASKS", "make_env", "mjlab_envs", "pole_fell", "task_config"]

# The tasks the tests and the benchmarks run: their id, the observation sizes of the groups (actor, critic) and the
# number of actions
TASKS = {
    "cartpole": ("Mjlab-Cartpole-Balance", (5, 5), 1),
    "go1": ("Mjlab-Velocity-Flat-Unitree-Go1", (48, 72), 12),
}


def pole_fell(env: ManagerBasedRlEnv, limit: float, hinge: SceneEntityCfg) -> torch.Tensor:
    """A termination term: the cartpole's pole more than ``limit`` radians from upright (``hinge``: its joint,
    resolved by mjlab's termination manager)."""
    return env.scene[hinge.name].data.joint_pos[:, hinge.joint_ids].squeeze(-1).abs() > limit


def task_config(
    task: str,
    num_envs: int,
    *,
    episode_steps: int | None = None,
    auto_reset: bool = True,
    pole_limit: float = 0.2,
    seed: int | None = None,
):
    """The config of ``TASKS[task]`` for ``num_envs`` envs: episodes of ``episode_steps`` env steps (None: the
    task's own), for the cartpole a termination where the pole falls beyond ``pole_limit``, and ``seed`` (mjlab
    seeds the process's global RNGs with it when the env is built; None: it does not)."""
    cfg = load_env_cfg(TASKS[task][0])
    cfg.scene.num_envs = num_envs
    cfg.auto_reset = auto_reset
    cfg.seed = seed
    if episode_steps is not None:  # mjlab rounds episode_length_s / step up to whole steps
        step_s = cfg.sim.mujoco.timestep * cfg.decimation
        cfg.episode_length_s = (episode_steps - 0.5) * step_s
        assert math.ceil(cfg.episode_length_s / step_s) == episode_steps
    if task == "cartpole":  # poles that start up to 0.2 rad from upright (the task's 0.034) fall at different steps
        cfg.events["reset_hinge"].params["position_range"] = (-0.2, 0.2)
        cfg.terminations["pole_fell"] = TerminationTermCfg(
            func=pole_fell, params={"limit": pole_limit, "hinge": SceneEntityCfg("cartpole", joint_names=("hinge_1",))}
        )
    return cfg


def make_env(task: str, num_envs: int, **options) -> ManagerBasedRlEnv:
    """mjlab's own env of ``task_config(task, num_envs, **options)`` on Warp's CPU device."""
    return ManagerBasedRlEnv(cfg=task_config(task, num_envs, **options), device="cpu")


def mjlab_envs(num_envs: int, *, task: str, exact: bool = True, **options):
    """``make_env(task, num_envs, **options)`` as the collector takes it: ``FromMjlab`` of the env with
    ``auto_reset=False`` (exact), else ``FromRslRl`` of mjlab's ``RslRlVecEnvWrapper`` with
    ``bootstrap="last_obs"``. A module-level recipe, for worker processes too (bind the keywords with
    functools.partial)."""
    if exact:
        return FromMjlab(make_env(task, num_envs, auto_reset=False, **options))
    return FromRslRl(RslRlVecEnvWrapper(make_env(task, num_envs, **options)), bootstrap="last_obs")
