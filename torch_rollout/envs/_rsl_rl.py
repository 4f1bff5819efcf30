"""rsl_rl-style vector envs (Isaac Lab, Genesis, mjlab) as gymnasium vector envs of torch tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from tensordict import TensorDictBase
from torch import Tensor

__all__ = ["BOOTSTRAPS", "FromRslRl"]

# What a time-out bootstraps from when the env gives no final observation.
BOOTSTRAPS = ("last_obs", "none")


class FromRslRl(VectorEnv):
    """An rsl_rl-style vector env presented as a gymnasium vector env of torch tensors, for the Collector.

    rsl_rl's ``VecEnv`` (Isaac Lab's ``RslRlVecEnvWrapper``, Genesis and mjlab
    examples) steps as ``step(actions) -> (obs, rewards, dones, extras)`` with
    ``extras["time_outs"]`` and resets ended envs inside ``step``: the observation
    it returns at an episode end is already the next episode's, and the final
    observation is gone. A terminated step needs none (it does not bootstrap); a
    time-out does, and no exact value can be had, so ``bootstrap`` says what to
    do, and there is no default:

    - ``"last_obs"``: bootstrap from V(s_t), the observation the action was
      chosen from, instead of V(s_t+1) (what rsl_rl's PPO does). Time-outs are
      ``truncated`` rows whose ``next_value`` is this approximation.
    - ``"none"``: a time-out ends the episode like a termination (``terminated``
      True, no bootstrap), biasing returns near the time limit down.

    Either way each row says what it got: ``infos["bootstrap"]`` is ``1`` where the
    row's bootstrap is V(s_t), ``2`` where a time-out was not bootstrapped, ``0``
    elsewhere (exact); keep it with ``BatchKeys(info_keys=("bootstrap",))``.
    Observation groups (a TensorDict or dict such as ``{"policy": ..., "critic":
    ...}``) become a Dict observation. The env steps in SAME_STEP autoreset mode.
    Seed the wrapped env when you create it: ``reset(seed=...)`` is refused.

    Args:
        env: an object with ``num_envs``, ``device``, ``num_actions``,
            ``get_observations()`` and ``step(actions)`` as above (``reset()`` is
            called too where it exists).
        bootstrap: ``"last_obs"`` or ``"none"`` (see above).

    Raises:
        ValueError: ``bootstrap`` not given or not one of :data:`BOOTSTRAPS`.
    """

    def __init__(self, env: Any, *, bootstrap: str | None = None) -> None:
        if bootstrap not in BOOTSTRAPS:
            raise ValueError(
                f"FromRslRl: bootstrap={bootstrap!r}; this env returns the next episode's observation at a time-out, "
                "so a time-out cannot bootstrap from its true next state: pass bootstrap='last_obs' to bootstrap "
                "from V(s_t) of the step's own observation (what rsl_rl does: an approximation), or "
                "bootstrap='none' to end time-outs like terminations (no bootstrap); infos['bootstrap'] marks the "
                "rows either way"
            )
        self.env = env
        self.bootstrap = bootstrap
        self.num_envs = int(env.num_envs)
        self.device = torch.device(env.device)
        self.metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}
        self.autoreset_mode = AutoresetMode.SAME_STEP
        obs = self._read(env.get_observations())
        if isinstance(obs, dict):
            single = spaces.Dict({key: _box(value) for key, value in obs.items()})
        else:
            single = _box(obs)
        self.single_observation_space = single
        self.observation_space = batch_space(single, self.num_envs)
        self.single_action_space = spaces.Box(-np.inf, np.inf, (int(env.num_actions),), np.float32)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.obs = obs

    def _read(self, obs: Any) -> Tensor | dict[str, Tensor]:
        if isinstance(obs, tuple):  # older rsl_rl: (obs, extras)
            obs = obs[0]
        if isinstance(obs, (TensorDictBase, Mapping)):
            return {key: obs[key] for key in obs.keys()}
        return obs

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        if seed is not None:
            raise ValueError(
                f"FromRslRl.reset: seed={seed}, but an rsl_rl-style env is seeded when it is created; create it "
                "with its seed and give the Collector seed=None"
            )
        if options:
            raise ValueError(f"FromRslRl.reset: options={options!r}; rsl_rl-style envs reset themselves")
        reset = getattr(self.env, "reset", None)
        if callable(reset):
            reset()
        self.obs = self._read(self.env.get_observations())
        return self.obs, {}

    def step(self, actions: Tensor) -> tuple[Any, Tensor, Tensor, Tensor, dict[str, Any]]:
        last = self.obs
        obs, rewards, dones, extras = self.env.step(actions)
        obs = self._read(obs)
        dones = dones.to(torch.bool)
        time_outs = extras.get("time_outs")
        time_outs = torch.zeros_like(dones) if time_outs is None else time_outs.to(torch.bool) & dones
        if self.bootstrap == "last_obs":
            terminated, truncated = dones & ~time_outs, time_outs
            marks = time_outs.to(torch.int8)
        else:
            terminated, truncated = dones, torch.zeros_like(dones)
            marks = time_outs.to(torch.int8) * 2
        # The observation a time-out bootstraps from (rows of other envs are never read).
        infos = {"final_obs": last, "_final_obs": dones, "bootstrap": marks, "_bootstrap": torch.ones_like(dones)}
        self.obs = obs
        return obs, rewards.to(torch.float32), terminated, truncated, infos

    def close_extras(self, **kwargs: Any) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def _box(value: Tensor) -> spaces.Box:
    dtype = np.float32 if value.is_floating_point() else np.int64
    return spaces.Box(-np.inf, np.inf, tuple(value.shape[1:]), dtype)
