"""Pendulum-v1 as a torch-tensor vector env: gymnasium's dynamics and rewards, on any device."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from torch import Tensor

from torch_rollout.envs._base import TorchVectorEnv

__all__ = ["Pendulum"]

# Gymnasium's Pendulum-v1 constants.
_MAX_SPEED = 8.0
_MAX_TORQUE = 2.0
_DT = 0.05
_GRAVITY = 10.0
_MASS = 1.0
_LENGTH = 1.0


class Pendulum(TorchVectorEnv):
    """Gymnasium's Pendulum-v1 for ``num_envs`` envs at once, as torch tensors on ``device``.

    The dynamics and rewards are Pendulum-v1's: a pendulum of unit mass and
    length under gravity 10, swung by a torque clipped to ``[-2, 2]``, with
    its angular velocity clipped to ``[-8, 8]`` after each step of 0.05 s;
    the reward is ``-(normalized angle**2 + 0.1 * velocity**2 + 0.001 *
    torque**2)``, computed from the state before the step. It never
    terminates and is truncated at step ``max_episode_steps``. An episode
    starts from an angle uniform in ``[-pi, pi)`` and an angular velocity
    uniform in ``[-1, 1)``, drawn from the env's counter-based stream (see
    :class:`~torch_rollout.envs._base.TorchVectorEnv` for seeding and the
    autoreset modes).

    The state (:attr:`state`: angle, angular velocity) and the arithmetic
    are float64, as in gymnasium, so trajectories follow gymnasium's to
    rounding (a spinning pendulum under random torques is chaotic: float32
    would drift from them by about ``1e-2`` in 200 steps).

    - observation: float32 ``[num_envs, 3]``: ``cos(angle)``, ``sin(angle)``,
      angular velocity.
    - action: a tensor ``[num_envs, 1]`` of torques (converted to float32,
      clipped to ``[-2, 2]``, then computed with in float64 as gymnasium does).

    Args:
        num_envs: the number of envs.
        device: where the envs run, e.g. ``"cpu"`` or ``"cuda"``.
        autoreset_mode: how ended episodes are reset (``NEXT_STEP``, gymnasium's default; ``SAME_STEP``;
            ``DISABLED``), an :class:`~gymnasium.vector.AutoresetMode` or its value.
        max_episode_steps: the step at which an episode is truncated (200 for Pendulum-v1).
        final_obs_key: the infos key of the final observations in ``SAME_STEP`` mode (``"final_obs"`` as
            gymnasium says it; ``"final_observation"`` as ManiSkill3 does).

    Raises:
        TypeError, ValueError: an option of the wrong type or value.

    Examples:
        >>> import torch
        >>> envs = Pendulum(2, max_episode_steps=1)
        >>> obs, _ = envs.reset(seed=0)
        >>> obs.shape
        torch.Size([2, 3])
        >>> obs, reward, terminated, truncated, _ = envs.step(torch.zeros(2, 1))
        >>> terminated, truncated
        (tensor([False, False]), tensor([True, True]))
        >>> envs.close()
    """

    def __init__(
        self,
        num_envs: int,
        *,
        device: str | torch.device = "cpu",
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        max_episode_steps: int = 200,
        final_obs_key: str = "final_obs",
    ) -> None:
        high = np.array([1.0, 1.0, _MAX_SPEED], dtype=np.float32)
        super().__init__(
            num_envs,
            single_observation_space=spaces.Box(-high, high, dtype=np.float32),
            single_action_space=spaces.Box(-_MAX_TORQUE, _MAX_TORQUE, shape=(1,), dtype=np.float32),
            initial_low=(-math.pi, -1.0),
            initial_high=(math.pi, 1.0),
            device=device,
            autoreset_mode=autoreset_mode,
            max_episode_steps=max_episode_steps,
            final_obs_key=final_obs_key,
        )

    def _as_actions(self, actions: Any) -> Tensor:
        actions = torch.as_tensor(actions, device=self.device)
        if actions.is_complex():
            raise TypeError(f"{self!r}.step(actions): expected real torques, got dtype {actions.dtype}")
        if actions.shape != (self.num_envs, 1):
            raise ValueError(
                f"{self!r}.step(actions): expected shape ({self.num_envs}, 1), one torque per env, got "
                f"{tuple(actions.shape)} (a [num_envs] tensor takes .unsqueeze(1))"
            )
        # float32 first: gymnasium's torques are float32 values (its action space's dtype).
        return actions.to(torch.float32).to(torch.float64)

    def _dynamics(self, state: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        theta, theta_dot = state.unbind(1)  # each [N]
        torque = actions[:, 0].clamp(-_MAX_TORQUE, _MAX_TORQUE)
        angle = torch.remainder(theta + math.pi, 2 * math.pi) - math.pi  # in [-pi, pi)
        cost = angle * angle + 0.1 * theta_dot * theta_dot + 0.001 * torque * torque
        theta_acc = 3 * _GRAVITY / (2 * _LENGTH) * torch.sin(theta) + 3.0 / (_MASS * _LENGTH**2) * torque
        theta_dot = (theta_dot + theta_acc * _DT).clamp(-_MAX_SPEED, _MAX_SPEED)
        # Semi-implicit: the angle moves with the velocity after this step, as in gymnasium.
        theta = theta + theta_dot * _DT
        reward = (-cost).to(torch.float32)
        return torch.stack((theta, theta_dot), dim=1), reward, torch.zeros_like(theta, dtype=torch.bool)

    def _observe(self, state: Tensor) -> Tensor:
        theta, theta_dot = state.unbind(1)
        return torch.stack((torch.cos(theta), torch.sin(theta), theta_dot), dim=1).to(torch.float32)
