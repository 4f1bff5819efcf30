"""What the adapters of batched simulators' own envs (Isaac Lab, mjlab) share: a SAME_STEP vector env's attributes."""

from __future__ import annotations

from typing import Any

import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

__all__ = ["SameStepEnv"]


class SameStepEnv(VectorEnv):
    """A batched simulator's env (``num_envs`` envs on one torch ``device``, reset inside its step) presented as a
    gymnasium vector env of torch tensors in SAME_STEP autoreset mode; subclasses call :meth:`_present` once."""

    def _present(
        self,
        *,
        num_envs: int,
        device: Any,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Sets the vector env's attributes: its size, device, mode (in ``metadata`` too) and batched spaces."""
        self.num_envs = int(num_envs)
        self.device = torch.device(device)
        self.metadata = {**(metadata or {}), "autoreset_mode": AutoresetMode.SAME_STEP}
        self.autoreset_mode = AutoresetMode.SAME_STEP
        self.single_observation_space, self.single_action_space = observation_space, action_space
        self.observation_space = batch_space(observation_space, self.num_envs)
        self.action_space = batch_space(action_space, self.num_envs)
