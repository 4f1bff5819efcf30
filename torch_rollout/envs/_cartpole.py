"""CartPole-v1 as a torch-tensor vector env: gymnasium's dynamics, limits and rewards, on any device."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from torch import Tensor

from torch_rollout.envs._base import TorchVectorEnv

__all__ = ["CartPole"]

# Gymnasium's CartPole constants (Barto, Sutton and Anderson's cart-pole).
_GRAVITY = 9.8
_MASS_CART = 1.0
_MASS_POLE = 0.1
_TOTAL_MASS = _MASS_POLE + _MASS_CART
_HALF_LENGTH = 0.5
_POLE_MASS_LENGTH = _MASS_POLE * _HALF_LENGTH
_FORCE = 10.0
_TAU = 0.02  # seconds per step
_X_THRESHOLD = 2.4
_THETA_THRESHOLD = 12 * 2 * math.pi / 360  # 12 degrees


class CartPole(TorchVectorEnv):
    """Gymnasium's CartPole-v1 for ``num_envs`` envs at once, as torch tensors on ``device``.

    The dynamics, limits, rewards and time limit are CartPole-v1's: a pole
    hinged on a cart that action ``1`` pushes right and ``0`` left with 10 N,
    integrated with explicit Euler steps of 0.02 s; an episode terminates
    when the cart leaves ``[-2.4, 2.4]`` or the pole tilts more than 12
    degrees, is truncated at step ``max_episode_steps``, and every step,
    the terminating one included, earns reward 1. An episode starts from a
    state uniform in ``[-0.05, 0.05)`` per component, drawn from the env's
    counter-based stream (see :class:`~torch_rollout.envs._base.TorchVectorEnv`
    for seeding and the autoreset modes).

    The state (:attr:`state`) and the arithmetic are float64, as in
    gymnasium, so trajectories follow gymnasium's to rounding.

    - observation: float32 ``[num_envs, 4]``: cart position, cart velocity,
      pole angle (radians), pole angular velocity; the state rounded.
    - action: an integer (or bool) tensor ``[num_envs]``; as in gymnasium's
      vector CartPole, an action of 1 or more pushes right and anything else
      left (the values are not checked: that would wait for the device).

    Args:
        num_envs: the number of envs.
        device: where the envs run, e.g. ``"cpu"`` or ``"cuda"``.
        autoreset_mode: how ended episodes are reset (``NEXT_STEP``, gymnasium's default; ``SAME_STEP``;
            ``DISABLED``), an :class:`~gymnasium.vector.AutoresetMode` or its value.
        max_episode_steps: the step at which an episode is truncated (500 for CartPole-v1).
        final_obs_key: the infos key of the final observations in ``SAME_STEP`` mode (``"final_obs"`` as
            gymnasium says it; ``"final_observation"`` as ManiSkill3 does).

    Raises:
        TypeError, ValueError: an option of the wrong type or value.

    Examples:
        >>> import torch
        >>> envs = CartPole(3)
        >>> obs, infos = envs.reset(seed=0)
        >>> obs.shape, obs.dtype, infos
        (torch.Size([3, 4]), torch.float32, {})
        >>> obs, reward, terminated, truncated, infos = envs.step(torch.tensor([0, 1, 1]))
        >>> reward, terminated
        (tensor([1., 1., 1.]), tensor([False, False, False]))
        >>> envs.close()
    """

    def __init__(
        self,
        num_envs: int,
        *,
        device: str | torch.device = "cpu",
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        max_episode_steps: int = 500,
        final_obs_key: str = "final_obs",
    ) -> None:
        high = np.array([2 * _X_THRESHOLD, np.inf, 2 * _THETA_THRESHOLD, np.inf], dtype=np.float32)
        super().__init__(
            num_envs,
            single_observation_space=spaces.Box(-high, high, dtype=np.float32),
            single_action_space=spaces.Discrete(2),
            initial_low=(-0.05,) * 4,
            initial_high=(0.05,) * 4,
            device=device,
            autoreset_mode=autoreset_mode,
            max_episode_steps=max_episode_steps,
            final_obs_key=final_obs_key,
        )

    def _as_actions(self, actions: Any) -> Tensor:
        actions = torch.as_tensor(actions, device=self.device)
        if actions.is_floating_point() or actions.is_complex():
            raise TypeError(
                f"{self!r}.step(actions): expected an integer tensor of 0 (push left) or 1 (push right) per env, "
                f"got dtype {actions.dtype}; pass e.g. actions.long()"
            )
        if actions.shape != (self.num_envs,):
            raise ValueError(
                f"{self!r}.step(actions): expected shape ({self.num_envs},), one action per env, got "
                f"{tuple(actions.shape)}"
            )
        return actions

    def _dynamics(self, state: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, x_dot, theta, theta_dot = state.unbind(1)  # each [N]
        force = torch.where(actions >= 1, _FORCE, -_FORCE)
        cos, sin = torch.cos(theta), torch.sin(theta)
        temp = (force + _POLE_MASS_LENGTH * theta_dot * theta_dot * sin) / _TOTAL_MASS
        theta_acc = (_GRAVITY * sin - cos * temp) / (_HALF_LENGTH * (4.0 / 3.0 - _MASS_POLE * cos * cos / _TOTAL_MASS))
        x_acc = temp - _POLE_MASS_LENGTH * theta_acc * cos / _TOTAL_MASS
        # Explicit Euler: positions move with the velocities from before this step.
        x = x + _TAU * x_dot
        theta = theta + _TAU * theta_dot
        next_state = torch.stack((x, x_dot + _TAU * x_acc, theta, theta_dot + _TAU * theta_acc), dim=1)
        terminated = (x.abs() > _X_THRESHOLD) | (theta.abs() > _THETA_THRESHOLD)
        return next_state, torch.ones_like(x, dtype=torch.float32), terminated

    def _observe(self, state: Tensor) -> Tensor:
        return state.to(torch.float32)
