"""Conversion between gymnasium spaces, NumPy arrays from vector envs and torch tensors."""

from __future__ import annotations

from typing import Any, Union

import numpy as np
import torch
from gymnasium import spaces
from tensordict import TensorDict
from torch import Tensor

__all__ = [
    "Obs",
    "ObsBuffer",
    "check_action_space",
    "check_obs_space",
    "obs_to_tensor",
    "select_obs",
    "stack_final_obs",
    "ActionConverter",
]

# A batch of observations: a tensor, or a TensorDict for Dict spaces.
Obs = Union[Tensor, TensorDict]

_LEAF_OBS_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
_ACTION_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def check_obs_space(space: spaces.Space, *, path: str = "observation_space") -> None:
    """Raises TypeError if the collector cannot store observations of ``space``."""
    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            check_obs_space(sub, path=f"{path}[{key!r}]")
    elif not isinstance(space, _LEAF_OBS_SPACES):
        raise TypeError(
            f"Collector: unsupported {path} {space!r}; expected Box, Discrete, MultiDiscrete, "
            "MultiBinary or a Dict of these (wrap the env to flatten other spaces)"
        )


def check_action_space(space: spaces.Space) -> None:
    """Raises TypeError if the collector cannot send actions of ``space`` to the env."""
    if not isinstance(space, _ACTION_SPACES):
        raise TypeError(
            f"Collector: unsupported action_space {space!r}; expected Box, Discrete, MultiDiscrete or MultiBinary"
        )


def _storage_dtype(space: spaces.Space) -> np.dtype:
    # float64 observations are stored as float32, the dtype policies train in;
    # integer dtypes (uint8 images, discrete indices) are kept.
    dtype = np.dtype(space.dtype)
    return np.dtype(np.float32) if dtype == np.float64 else dtype


def _space_shape(space: spaces.Space) -> tuple[int, ...]:
    return tuple(space.shape) if space.shape is not None else ()


class ObsBuffer:
    """Host storage for ``[*prefix, *obs_shape]`` observations with NumPy views for fast writes.

    Args:
        space: the single-env observation space.
        prefix: leading dims, e.g. ``(T, N)`` or ``(N,)``.
        pin_memory: allocate page-locked memory for non-blocking host-to-device copies.
    """

    def __init__(self, space: spaces.Space, prefix: tuple[int, ...], *, pin_memory: bool = False) -> None:
        self.space = space
        self.tensor: Obs = self._alloc(space, prefix, pin_memory)
        self.arrays: Any = self._views(self.tensor)

    @classmethod
    def _alloc(cls, space: spaces.Space, prefix: tuple[int, ...], pin: bool) -> Obs:
        if isinstance(space, spaces.Dict):
            return TensorDict(
                {key: cls._alloc(sub, prefix, pin) for key, sub in space.spaces.items()},
                batch_size=prefix,
            )
        dtype = torch.from_numpy(np.empty(0, dtype=_storage_dtype(space))).dtype
        return torch.empty(prefix + _space_shape(space), dtype=dtype, pin_memory=pin)

    @classmethod
    def _views(cls, tensor: Obs) -> Any:
        if isinstance(tensor, TensorDict):
            return {key: cls._views(tensor[key]) for key in tensor.keys()}
        return tensor.numpy()

    def write(self, index: int | slice, obs: Any) -> None:
        """Copies the env's ``obs`` into ``self.tensor[index]`` (casting float64 to float32)."""
        _write(self.arrays, index, obs)


def _write(dst: Any, index: int | slice, obs: Any) -> None:
    if isinstance(dst, dict):
        for key, sub in dst.items():
            _write(sub, index, obs[key])
    else:
        dst[index] = obs


def obs_to_tensor(space: spaces.Space, obs: Any, device: torch.device) -> Obs:
    """Converts a batch of env observations (array or dict of arrays) to a tensor on ``device``."""
    if isinstance(space, spaces.Dict):
        batch = None
        items = {}
        for key, sub in space.spaces.items():
            items[key] = obs_to_tensor(sub, obs[key], device)
            batch = items[key].shape[:1]
        return TensorDict(items, batch_size=batch, device=device)
    array = np.asarray(obs, dtype=_storage_dtype(space))
    return torch.as_tensor(array, device=device)


def select_obs(space: spaces.Space, obs: Any, index: np.ndarray) -> Any:
    """Returns the rows ``index`` of a batch of env observations (array or dict of arrays)."""
    if isinstance(space, spaces.Dict):
        return {key: select_obs(sub, obs[key], index) for key, sub in space.spaces.items()}
    return np.asarray(obs)[index]


def stack_final_obs(space: spaces.Space, final_obs: np.ndarray, index: np.ndarray) -> Any:
    """Stacks the per-env ``final_obs`` entries (an object array from SAME_STEP infos) at ``index``."""
    items = [final_obs[i] for i in index]
    if isinstance(space, spaces.Dict):
        return {key: np.stack([item[key] for item in items]) for key in space.spaces}
    return np.stack(items)


class ActionConverter:
    """Validates the policy's actions and converts them to what the vector env expects.

    Box actions are clipped to the bounds (the stored action is not). Discrete,
    MultiDiscrete and MultiBinary actions are passed as integer arrays.
    """

    def __init__(self, space: spaces.Space, num_envs: int) -> None:
        check_action_space(space)
        self.space = space
        self.shape = (num_envs,) + _space_shape(space)
        self.dtype = np.dtype(space.dtype)
        self.discrete = not isinstance(space, spaces.Box)
        if isinstance(space, spaces.Box):
            self.low, self.high = space.low, space.high

    def __call__(self, action: Tensor) -> np.ndarray:
        if tuple(action.shape) != self.shape:
            raise ValueError(
                f"Collector: policy output 'action' has shape {tuple(action.shape)}, expected {self.shape} "
                f"(num_envs, *action_space.shape) for {self.space!r}"
            )
        if self.discrete and action.is_floating_point():
            raise TypeError(
                f"Collector: policy output 'action' has dtype {action.dtype}, expected an integer dtype "
                f"for {self.space!r}"
            )
        array = action.detach().cpu().numpy()
        if self.discrete:
            return array.astype(self.dtype, copy=False)
        return np.clip(array, self.low, self.high).astype(self.dtype, copy=False)
