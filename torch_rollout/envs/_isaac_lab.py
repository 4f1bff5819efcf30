"""Isaac Lab's own envs (``DirectRLEnv``, ``ManagerBasedRLEnv``) as gymnasium vector envs of torch tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium
import torch
from gymnasium.vector import VectorEnv
from torch import Tensor

from torch_rollout.envs._batched import SameStepEnv

__all__ = ["FromIsaacLab", "adapt_isaac_lab", "is_isaac_lab"]


class FromIsaacLab(SameStepEnv):
    """Isaac Lab's own env, as ``gym.make(task, cfg=env_cfg)`` returns it, presented as a vector env for the Collector.

    Isaac Lab's ``DirectRLEnv`` and ``ManagerBasedRLEnv`` are batched
    ``gymnasium.Env`` s, not gymnasium vector envs: ``num_envs`` envs on one
    ``device``, stepped with torch tensors as ``step(actions) -> (obs, reward,
    terminated, truncated, extras)``, whose ``obs`` is a dict of observation
    groups (``{"policy": ..., "critic": ...}``) and which resets ended envs in
    the same step. This presents them as what they are: a vector env of torch
    tensors in SAME_STEP autoreset mode, whose observation is a Dict of the
    groups (its ``single_observation_space``) and whose time-outs bootstrap
    exactly from ``extras["final_obs"]``, the groups before the same-step reset,
    which Isaac Lab computes when ``compute_final_obs=True`` is set on the env
    config. A step that both terminated and timed out (an episode that fails at
    the last step of its time limit) keeps both flags, as Isaac Lab returns
    them; it does not bootstrap (a termination never does).

    The Collector applies it by itself to an Isaac Lab env (the env as
    ``gym.make`` returns it, inside gymnasium's wrappers, or its ``unwrapped``
    env), recognised by an ``unwrapped`` env with ``num_envs``, ``device`` and a
    ``cfg`` with ``compute_final_obs``; wrap the env yourself to reach the vector
    env (``collector.envs`` is it either way). ``reset(seed=...)`` reaches
    Isaac Lab's own ``reset``, which seeds its RNGs.

    Args:
        env: Isaac Lab's env, as ``gym.make(task, cfg=env_cfg)`` returns it (or its ``unwrapped`` env).

    Raises:
        ValueError: ``env`` is not an Isaac Lab env as above, or its ``cfg.compute_final_obs`` is not True.
    """

    def __init__(self, env: Any) -> None:
        base = getattr(env, "unwrapped", env)
        if not is_isaac_lab(env):
            raise ValueError(
                f"FromIsaacLab: {type(env).__name__} is not an Isaac Lab env: expected a gymnasium.Env whose unwrapped "
                "env has num_envs, device and cfg.compute_final_obs, as gym.make(task, cfg=env_cfg) returns it"
            )
        if base.cfg.compute_final_obs is not True:
            raise ValueError(
                f"FromIsaacLab: Isaac Lab's {type(base).__name__} has cfg.compute_final_obs="
                f"{base.cfg.compute_final_obs!r}, so its step does not keep the observation before its same-step reset "
                "(extras['final_obs']) and a time-out has nothing to bootstrap from; set env_cfg.compute_final_obs = "
                "True before gym.make(task, cfg=env_cfg) for exact bootstraps, or step it through Isaac Lab's "
                "RslRlVecEnvWrapper and torch_rollout.envs.FromRslRl(wrapper, bootstrap='last_obs') (or "
                "bootstrap='none'), an approximation that marks its rows"
            )
        self.env = env
        self._present(
            num_envs=base.num_envs,
            device=base.device,
            observation_space=base.single_observation_space,
            action_space=base.single_action_space,
            metadata=getattr(base, "metadata", {}),
        )

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        obs, extras = self.env.reset(seed=seed, options=options)
        return obs, dict(extras)

    def step(self, actions: Tensor) -> tuple[Any, Tensor, Tensor, Tensor, dict[str, Any]]:
        obs, reward, terminated, truncated, extras = self.env.step(actions)
        # Isaac Lab's own flag buffers, written in place at its next step: copies
        terminated = terminated.to(torch.bool).clone()
        truncated = truncated.to(torch.bool).clone()
        infos = dict(extras)
        if "final_obs" in extras:  # dense over all envs; the rows of envs that did not end are never read
            infos["_final_obs"] = terminated | truncated
        return obs, reward, terminated, truncated, infos

    def close_extras(self, **kwargs: Any) -> None:
        self.env.close()


def is_isaac_lab(env: Any) -> bool:
    """Whether ``env`` is Isaac Lab's own env: a ``gymnasium.Env`` (not a vector env) whose ``unwrapped`` env has
    ``num_envs``, ``device`` and a ``cfg`` with ``compute_final_obs``."""
    if isinstance(env, VectorEnv) or not isinstance(env, gymnasium.Env):
        return False
    base = env.unwrapped
    return (
        hasattr(getattr(base, "cfg", None), "compute_final_obs")
        and isinstance(getattr(base, "num_envs", None), int)
        and getattr(base, "device", None) is not None
    )


def adapt_isaac_lab(
    envs: VectorEnv | gymnasium.Env | str | Callable[..., Any],
) -> VectorEnv | str | Callable[..., VectorEnv]:
    """``envs`` as a vector env where it is Isaac Lab's own env (:class:`FromIsaacLab`), else ``envs`` as it is.

    A function's result is adapted where it is called (``build_envs``).
    """
    if isinstance(envs, gymnasium.Env):
        return FromIsaacLab(envs) if is_isaac_lab(envs) else envs  # type: ignore[return-value]  # refused later
    return envs
