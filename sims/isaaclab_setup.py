"""Isaac Lab 3.0, kit-less, on a machine without a GPU and without NVIDIA's asset server: its cartpole tasks on
Newton/MuJoCo-Warp on Warp's CPU device, as the integration tests and the benchmarks build them.

Run in Isaac Lab's venv (sims/build.sh), with the checkout on PYTHONPATH. ``make_isaac_env("direct", 256)`` is
``gym.make("Isaac-Cartpole-Direct", cfg=...)`` with ``cfg.compute_final_obs = True``; ``cartpole_direct`` is
that env as examples/ppo_continuous.py's env_recipe builds it (``env_recipe: sims.isaaclab_setup:cartpole_direct``).
"""

from __future__ import annotations

import pathlib
import tempfile

import gymnasium as gym
import isaaclab_tasks  # noqa: F401  (registers the tasks)
import newton
import torch
from isaaclab_tasks.utils import resolve_task_config

from torch_rollout.envs import FromIsaacLab

__all__ = [
    "STEP_S",
    "TASKS",
    "RandomEpisodeStarts",
    "cartpole_direct",
    "cartpole_usd",
    "episode_length_s",
    "isaac_lab_envs",
    "make_isaac_env",
    "task_config",
]

# Isaac Lab's two kinds of env: DirectRLEnv (flags in reset_terminated, reset_time_outs) and ManagerBasedRLEnv
# (flags in its termination manager too)
TASKS = {"direct": "Isaac-Cartpole-Direct", "manager": "Isaac-Cartpole"}
STEP_S = 2 / 120  # decimation 2 of physics steps of 1/120 s


def episode_length_s(steps: int) -> float:
    """An episode_length_s that Isaac Lab rounds up to ``steps`` env steps."""
    return (steps - 0.5) * STEP_S


def cartpole_usd(folder: str | pathlib.Path | None = None) -> str:
    """Isaac Lab's cartpole as the newton wheel ships it, with its defaultPrim fixed (it names "cartPole", the prim
    is "cartpole"), written into ``folder`` (a new temporary folder if None): the task's own USD lies on NVIDIA's
    asset server, which these machines do not reach."""
    source = pathlib.Path(newton.__file__).parent / "examples" / "assets" / "cartpole_single_pendulum.usda"
    text = source.read_text()
    assert 'defaultPrim = "cartPole"' in text, f"{source} changed: check whether the copy still needs its fix"
    path = pathlib.Path(folder if folder is not None else tempfile.mkdtemp(prefix="cartpole-usd-")) / "cartpole.usda"
    path.write_text(text.replace('defaultPrim = "cartPole"', 'defaultPrim = "cartpole"'))
    return str(path)


def task_config(kind: str, num_envs: int, usd: str | None = None, *, seed: int = 0):
    """The config of ``TASKS[kind]`` on Newton/MuJoCo-Warp on Warp's CPU, with final observations, its robot
    loaded from ``usd`` (``cartpole_usd()`` if None) and no ground plane."""
    cfg, _ = resolve_task_config(TASKS[kind], "", overrides=("physics=newton_mjwarp",))
    cfg.sim.device = "cpu"
    cfg.scene.num_envs = num_envs
    cfg.compute_final_obs = True
    cfg.seed = seed
    scene = cfg.scene.cartpole if kind == "direct" else cfg.scene.robot
    scene.spawn.usd_path = usd if usd is not None else cartpole_usd()
    cfg.scene.ground = None
    return cfg


def make_isaac_env(kind: str, num_envs: int, usd: str | None = None, *, seed: int = 0) -> gym.Env:
    """Isaac Lab's own env of ``TASKS[kind]`` (``task_config``), as ``gym.make`` returns it."""
    return gym.make(TASKS[kind], cfg=task_config(kind, num_envs, usd, seed=seed))


class RandomEpisodeStarts(FromIsaacLab):
    """Isaac Lab's env whose first episodes start at a random step of their time limit after each reset, as
    rsl_rl's ``learn(init_at_random_ep_len=True)`` starts them in Isaac Lab's train script: episodes then end spread
    over time, not all at once."""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple:
        obs, infos = super().reset(seed=seed, options=options)
        base = self.env.unwrapped
        base.episode_length_buf = torch.randint_like(base.episode_length_buf, high=int(base.max_episode_length))
        return obs, infos


def cartpole_direct(num_envs: int, *, seed: int = 0) -> FromIsaacLab:
    """``Isaac-Cartpole-Direct`` (``make_isaac_env("direct", ...)``) as a vector env with random episode starts
    (``RandomEpisodeStarts``): an env recipe of examples/ppo_continuous.py."""
    return RandomEpisodeStarts(make_isaac_env("direct", num_envs, seed=seed))


def isaac_lab_envs(num_envs: int, *, kind: str = "direct", usd: str | None = None, seed: int = 0) -> FromIsaacLab:
    """``make_isaac_env(kind, num_envs, usd)`` as the collector adapts it (a module-level recipe, for worker processes
    too; bind the keywords with functools.partial)."""
    return FromIsaacLab(make_isaac_env(kind, num_envs, usd, seed=seed))
