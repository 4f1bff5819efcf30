"""Brax's and MuJoCo Playground's envs through torch_rollout.envs.FromJax, as the integration tests and the
benchmarks build them.

Run in Playground's venv (sims/build.sh, which has Brax too), with the checkout on PYTHONPATH.
"""

from __future__ import annotations

from brax import envs as brax_envs
from mujoco_playground import registry

from torch_rollout.envs import FromJax

__all__ = ["jax_envs", "load"]


def load(framework: str, name: str):
    """The JAX env ``name`` of ``framework`` ("playground": ``registry.load``, "brax": ``get_environment``)."""
    return registry.load(name) if framework == "playground" else brax_envs.get_environment(name)


def jax_envs(num_envs: int, *, framework: str, name: str, max_episode_steps: int | None = None) -> FromJax:
    """``num_envs`` of ``load(framework, name)`` through FromJax, SAME_STEP (a module-level recipe, for worker
    processes too; bind the keywords with functools.partial)."""
    return FromJax(load(framework, name), num_envs, max_episode_steps=max_episode_steps)
