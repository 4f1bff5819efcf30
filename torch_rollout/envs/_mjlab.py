"""mjlab's ``ManagerBasedRlEnv`` with ``auto_reset=False`` as a gymnasium vector env of torch tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import Tensor

from torch_rollout.envs._batched import SameStepEnv

__all__ = ["FromMjlab"]


class FromMjlab(SameStepEnv):
    """mjlab's ``ManagerBasedRlEnv`` presented as a vector env for the Collector, with exact time-out bootstraps.

    mjlab's env is batched (``num_envs`` envs on one ``device``) and steps as
    ``step(actions) -> (obs, reward, terminated, time_outs, extras)``, whose
    ``obs`` is a dict of observation groups (``{"actor": ..., "critic": ...}``).
    By default (``cfg.auto_reset=True``) it resets ended envs inside ``step`` and
    returns the next episode's observation, so a time-out has nothing to
    bootstrap from. With ``cfg.auto_reset=False`` its step returns the true
    final observation and leaves the reset to the caller, through
    ``reset(env_ids=...)``: this adapter makes that reset inside its own step,
    for the envs that ended, and presents the env in SAME_STEP autoreset mode,
    with ``infos["final_obs"]`` the groups before the reset. A time-out then
    bootstraps exactly from V(final observation), and with
    ``BatchKeys(next_obs=True)`` its ``next_obs`` is that observation.

    The envs that did not end keep the observation that mjlab's step returned
    (mjlab's reset recomputes every env's observation, and draws observation
    noise anew); the envs that ended get the one of their reset. A step that
    both terminated and timed out keeps both flags, as mjlab gave them; it is a
    termination for the values (no bootstrap). Where ``cfg.is_finite_horizon`` is True
    the time limit ends the task: a time-out is ``terminated``, as mjlab's own
    rsl_rl wrapper reports it then. ``reset(seed=...)`` reaches mjlab's own
    ``reset``, which seeds the process's global RNGs (Python's, NumPy's, torch's
    and Warp's).

    Args:
        env: mjlab's ``ManagerBasedRlEnv`` built from a config with ``auto_reset = False`` (or a wrapper whose
            ``unwrapped`` is it, such as ``mjlab.rl.RslRlVecEnvWrapper``).

    Raises:
        ValueError: ``env`` is not an mjlab env, or its ``cfg.auto_reset`` is not False.
    """

    def __init__(self, env: Any) -> None:
        base = getattr(env, "unwrapped", env)
        cfg: Any = getattr(base, "cfg", None)
        if not (hasattr(cfg, "auto_reset") and hasattr(base, "termination_manager") and hasattr(base, "num_envs")):
            raise ValueError(
                f"FromMjlab: env={type(env).__name__} is not an mjlab env: expected mjlab.envs.ManagerBasedRlEnv (a "
                "cfg with auto_reset, a termination_manager, num_envs), as ManagerBasedRlEnv(cfg=cfg, device=...) "
                "builds it"
            )
        if cfg.auto_reset is not False:
            raise ValueError(
                f"FromMjlab: the env's cfg.auto_reset={cfg.auto_reset!r}, so its step resets ended envs itself and "
                "returns the next episode's observation: a time-out has nothing to bootstrap from. Set "
                "cfg.auto_reset = False before ManagerBasedRlEnv(cfg=cfg, device=...) for exact bootstraps, or step "
                "the env through mjlab.rl.RslRlVecEnvWrapper and torch_rollout.envs.FromRslRl(wrapper, "
                "bootstrap='last_obs') (or bootstrap='none'), an approximation that marks its rows"
            )
        self.env = base
        self._present(
            num_envs=base.num_envs,
            device=base.device,
            observation_space=_gym_space(base.single_observation_space),
            action_space=_gym_space(base.single_action_space),
        )

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        if options:
            raise ValueError(
                f"FromMjlab.reset: options={options!r}; mjlab's env takes none (it resets the envs that end inside "
                "this adapter's step)"
            )
        obs, extras = self.env.reset(seed=seed)
        return obs, dict(extras)

    def step(self, actions: Tensor) -> tuple[Any, Tensor, Tensor, Tensor, dict[str, Any]]:
        obs, reward, terminated, time_outs, extras = self.env.step(actions)
        # mjlab's reward and flag buffers are written in place at its next step: copies
        reward, terminated, time_outs = reward.clone(), terminated.to(torch.bool), time_outs.to(torch.bool)
        if self.env.cfg.is_finite_horizon:  # the time limit ends the task: no bootstrap
            terminated, truncated = terminated | time_outs, torch.zeros_like(time_outs)
        else:
            terminated, truncated = terminated.clone(), time_outs.clone()
        done = terminated | truncated
        # mjlab's reset takes env indices: a wait for the device, as mjlab's own step makes one for its auto-reset
        ended = done.nonzero().squeeze(-1)
        final = None
        if ended.numel() > 0:
            final = obs
            fresh, _ = self.env.reset(env_ids=ended)
            obs = _where(done, fresh, obs)
        infos = dict(extras)  # mjlab's "log", with its reset's episode sums where envs ended
        if final is not None:  # dense over all envs; the rows of envs that did not end are never read
            infos["final_obs"], infos["_final_obs"] = final, done
        return obs, reward, terminated, truncated, infos

    def close_extras(self, **kwargs: Any) -> None:
        self.env.close()


def _where(done: Tensor, fresh: Any, obs: Any) -> Any:
    """The observation groups (dicts of tensors, nested or not): ``fresh`` where ``done``, else ``obs``."""
    if isinstance(obs, Tensor):
        return torch.where(done.view(-1, *[1] * (obs.dim() - 1)), fresh, obs)
    return {key: _where(done, fresh[key], value) for key, value in obs.items()}


def _gym_space(space: Any) -> spaces.Space:
    """mjlab's own ``Box`` or ``Dict`` space (shape and dtype only, unbounded) as gymnasium's."""
    inner = getattr(space, "spaces", None)
    if isinstance(inner, dict):
        return spaces.Dict({key: _gym_space(value) for key, value in inner.items()})
    return spaces.Box(-np.inf, np.inf, tuple(space.shape), np.dtype(getattr(space, "dtype", "float32")))
