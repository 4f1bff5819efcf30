"""Conversion between gymnasium spaces, NumPy arrays from vector envs and torch tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import numpy as np
import torch
from gymnasium import spaces
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

__all__ = [
    "Obs",
    "ObsBuffer",
    "check_action_space",
    "check_obs_space",
    "empty_obs",
    "obs_to_tensor",
    "select_obs",
    "space_nbytes",
    "stack_final_obs",
    "where_rows",
    "ActionConverter",
    "ObsChecker",
]

# A batch of observations: a tensor, or a TensorDict for Dict spaces.
Obs: TypeAlias = Tensor | TensorDict

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


def space_nbytes(space: spaces.Space) -> int:
    """Bytes of one value of ``space`` as a batch stores it: float64 as float32, the leaves of a Dict space summed."""
    if isinstance(space, spaces.Dict):
        return sum(space_nbytes(sub) for sub in space.spaces.values())
    return _storage_dtype(space).itemsize * int(np.prod(_space_shape(space), dtype=np.int64))


class ObsBuffer:
    """Storage for ``[*prefix, *obs_shape]`` observations, with NumPy views for fast writes on the host.

    Args:
        space: the single-env observation space.
        prefix: leading dims, e.g. ``(T, N)`` or ``(N,)``.
        device: where the storage lives; on CUDA, rows are assigned as tensors.
        pin_memory: allocate page-locked memory for non-blocking host-to-device copies.
    """

    def __init__(
        self,
        space: spaces.Space,
        prefix: tuple[int, ...],
        *,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        self.space = space
        self.tensor: Obs = self._alloc(space, prefix, torch.device(device), pin_memory)
        self.arrays: Any = self._views(self.tensor) if self.tensor.device.type == "cpu" else None

    @classmethod
    def wrap(cls, space: spaces.Space, tensor: Obs) -> ObsBuffer:
        """An ObsBuffer over existing storage (e.g. a shared-memory batch slot)."""
        self = cls.__new__(cls)
        self.space = space
        self.tensor = tensor
        self.arrays = cls._views(tensor) if tensor.device.type == "cpu" else None
        return self

    @classmethod
    def _alloc(cls, space: spaces.Space, prefix: tuple[int, ...], device: torch.device, pin: bool) -> Obs:
        if isinstance(space, spaces.Dict):
            return TensorDict(
                {key: cls._alloc(sub, prefix, device, pin) for key, sub in space.spaces.items()},
                batch_size=prefix,
                device=device,
            )
        dtype = torch.from_numpy(np.empty(0, dtype=_storage_dtype(space))).dtype
        return torch.empty(prefix + _space_shape(space), dtype=dtype, device=device, pin_memory=pin)

    @classmethod
    def _views(cls, tensor: Obs) -> Any:
        if isinstance(tensor, TensorDict):
            return {key: cls._views(tensor[key]) for key in tensor.keys()}
        return tensor.numpy()

    def write(self, index: int | slice | tuple[np.ndarray, np.ndarray], obs: Any) -> None:
        """Copies the env's ``obs`` into ``self.tensor[index]`` (casting float64 to float32); host only."""
        _write(self.arrays, index, obs)


def empty_obs(space: spaces.Space, prefix: tuple[int, ...], *, device: torch.device | str) -> Obs:
    """Uninitialised storage for ``[*prefix, *obs_shape]`` observations of ``space`` in their storage dtypes."""
    return ObsBuffer._alloc(space, prefix, torch.device(device), False)


def _write(dst: Any, index: int | slice | tuple[np.ndarray, np.ndarray], obs: Any) -> None:
    if isinstance(dst, dict):
        for key, sub in dst.items():
            _write(sub, index, obs[key])
    else:
        dst[index] = obs


def obs_to_tensor(space: spaces.Space, obs: Any, device: torch.device, *, copy: bool = False) -> Obs:
    """Converts a batch of env observations (array or dict of arrays) to a tensor on ``device``.

    On the CPU the tensor shares the array's memory, unless ``copy``: then it is in torch's own (a policy's
    input, whose place in memory the floats of some CPUs' kernels depend on, fixed as the env's arrays are not).
    """
    if isinstance(space, spaces.Dict):
        batch = None
        items = {}
        for key, sub in space.spaces.items():
            items[key] = obs_to_tensor(sub, obs[key], device, copy=copy)
            batch = items[key].shape[:1]
        return TensorDict(items, batch_size=batch, device=device)
    # ascontiguousarray: torch cannot wrap negative strides (a reversed view); a no-op otherwise.
    array = np.ascontiguousarray(obs, dtype=_storage_dtype(space))
    return torch.tensor(array, device=device) if copy else torch.as_tensor(array, device=device)


def select_obs(space: spaces.Space, obs: Any, index: np.ndarray) -> Any:
    """Returns the rows ``index`` of a batch of env observations (array or dict of arrays)."""
    if isinstance(space, spaces.Dict):
        return {key: select_obs(sub, obs[key], index) for key, sub in space.spaces.items()}
    return np.asarray(obs)[index]


def stack_final_obs(space: spaces.Space, final_obs: np.ndarray | Mapping[str, Any], index: np.ndarray) -> Any:
    """Stacks the per-env ``final_obs`` entries (an object array from SAME_STEP infos) at ``index``.

    Dense final observations (an array of every env's, or a dict of them for a Dict space) are indexed instead.
    """
    if isinstance(final_obs, Mapping):
        assert isinstance(space, spaces.Dict)  # a dict of arrays: the observations of a Dict space
        return {key: np.asarray(final_obs[key])[index] for key in space.spaces}
    items = [final_obs[i] for i in index]
    if isinstance(space, spaces.Dict):
        return {key: np.stack([item[key] for item in items]) for key in space.spaces}
    return np.stack(items)


class ObsChecker:
    """Checks that a vector env's observations have the shape and dtype its space promises.

    One cached comparison per leaf and call, so it runs on every step. A dtype
    other than the space's is accepted when NumPy casts it to the stored dtype
    within its kind (float64 for float32); anything else, such as floats for a
    uint8 space, would be truncated silently and is an error.

    Args:
        space: the single-env observation space.
        num_envs: the vector env's number of envs.
    """

    def __init__(self, space: spaces.Space, num_envs: int) -> None:
        self.space = space
        # (keys into the obs dict, name for errors, [N, *shape], space dtype, storage dtype)
        self.leaves: list[tuple[tuple[str, ...], str, tuple[int, ...], np.dtype, np.dtype]] = []
        self._add_leaves(space, (), "obs", num_envs)

    def _add_leaves(self, space: spaces.Space, keys: tuple[str, ...], name: str, n: int) -> None:
        if isinstance(space, spaces.Dict):
            for key, sub in space.spaces.items():
                self._add_leaves(sub, keys + (key,), f"{name}[{key!r}]", n)
        else:
            shape = (n,) + _space_shape(space)
            self.leaves.append((keys, name, shape, np.dtype(space.dtype), _storage_dtype(space)))

    def __call__(self, obs: Any, call: str) -> None:
        """Raises ValueError naming the key, what ``call`` returned and what was expected."""
        for keys, name, shape, dtype, storage in self.leaves:
            array = obs
            for key in keys:
                try:
                    array = array[key]
                except (KeyError, IndexError, TypeError):
                    raise ValueError(
                        f"Collector: {call} returned observations without the key {key!r} of {self.space!r} "
                        f"(expected {name})"
                    ) from None
            if type(array) is not np.ndarray:
                try:
                    array = np.asarray(array)
                except Exception as exc:
                    raise ValueError(
                        f"Collector: {call} returned {name} of type {type(array).__name__}, expected a numpy "
                        f"array of shape {shape} and dtype {dtype}"
                    ) from exc
            if array.shape != shape or not (array.dtype == dtype or np.can_cast(array.dtype, storage, "same_kind")):
                raise ValueError(
                    f"Collector: {call} returned {name} of shape {array.shape} and dtype {array.dtype}, "
                    f"expected shape {shape} (num_envs, *observation_space.shape) and dtype {dtype} "
                    f"for {self.space!r}"
                )

    def non_finite(self, obs: Any) -> tuple[str, int, Any] | None:
        """Returns ``(name, env index, value)`` of the first NaN or infinite observation, or None."""
        for keys, name, _, _, _ in self.leaves:
            array = obs
            for key in keys:
                array = array[key]
            found = first_non_finite(array)
            if found is not None:
                return (name, *found)
        return None


def first_non_finite(array: Any) -> tuple[int, Any] | None:
    """Returns ``(env index, value)`` of the first NaN or infinite entry of a ``[N, ...]`` array, or None."""
    array = np.asarray(array)
    if array.dtype.kind not in "fc":
        return None
    finite = np.isfinite(array)
    if finite.all():
        return None
    index = int(np.flatnonzero(~finite.reshape(len(array), -1).all(axis=1))[0])
    return index, array[index][~finite[index]].flat[0]


def describe_bad_single_obs(space: spaces.Space, observations: list[Any], *, env_offset: int = 0) -> str | None:
    """Names the first of the sub-envs' ``observations`` whose shape does not match ``space``, or None.

    Env ``i`` of ``observations`` is named ``env_offset + i``.
    """
    for index, obs in enumerate(observations, start=env_offset):
        leaves: list[tuple[tuple[str, ...], str, spaces.Space]] = [((), "observation", space)]
        if isinstance(space, spaces.Dict):
            leaves = [((key,), f"observation[{key!r}]", sub) for key, sub in space.spaces.items()]
        for keys, name, sub in leaves:
            try:
                value = obs[keys[0]] if keys else obs
            except (KeyError, IndexError, TypeError):
                return f"env {index} returned an {name.partition('[')[0]} without the key {keys[0]!r} of {space!r}"
            shape, expected = np.shape(value), _space_shape(sub)
            if shape != expected:
                return (
                    f"env {index} returned an {name} of shape {shape} and dtype {np.asarray(value).dtype}, "
                    f"expected shape {expected} and dtype {sub.dtype} of its observation space {sub!r}"
                )
    return None


_UNSIGNED = {size: np.dtype(f"u{size}") for size in (1, 2, 4, 8)}


class ActionConverter:
    """Validates the policy's actions and converts them to what the vector env expects.

    Box actions are clipped to the bounds (the stored action is not). Discrete,
    MultiDiscrete and MultiBinary actions are passed as integer arrays after a
    range check: an action outside the space is an error, not something each
    env may or may not notice.
    """

    def __init__(self, space: spaces.Space, num_envs: int, *, env_offset: int = 0) -> None:
        check_action_space(space)
        self.space = space
        self.env_offset = env_offset  # global index of env 0, for error messages
        self.shape = (num_envs,) + _space_shape(space)
        self.dtype = np.dtype(space.dtype)
        self.discrete = not isinstance(space, spaces.Box)
        self.start: int | np.ndarray
        self.count: int | np.ndarray
        self.as_list = False
        if isinstance(space, spaces.Box):
            self.low, self.high = space.low, space.high
        elif isinstance(space, spaces.Discrete):
            self.start, self.count = int(space.start), int(space.n)
            # A few envs' actions: Python's min and max over a list of them take a fifth of a NumPy
            # reduction's time (which costs about a microsecond at any size below thousands).
            self.as_list = num_envs <= 32
            self.lowest, self.highest = self.start, self.start + self.count - 1
        elif isinstance(space, spaces.MultiDiscrete):
            self.start, self.count = space.start, space.nvec
        else:  # MultiBinary
            self.start, self.count = 0, 2
        # Decided once, as the range check runs every step: a start of 0 (the usual case) saves a
        # subtraction, a scalar count an elementwise comparison.
        self.has_start = self.discrete and bool(np.any(np.asarray(self.start) != 0))
        self.scalar_count = self.discrete and np.ndim(self.count) == 0

    def __call__(self, action: Tensor, env_ids: np.ndarray | None = None, row: np.ndarray | None = None) -> np.ndarray:
        """The env's actions; ``env_ids``: the envs of the rows (an async loop's), else rows are envs 0..n-1.

        ``row``: a host array that takes the actions as the policy gave them (unclipped), the batch's row: written
        from the values read here anyway, at a fraction of a tensor copy's cost on a few envs' actions.
        """
        if action.shape != self.shape:
            raise ValueError(
                f"Collector: policy output 'action' has shape {tuple(action.shape)}, expected {self.shape} "
                f"(num_envs, *action_space.shape) for {self.space!r}"
            )
        if self.discrete and action.is_floating_point():
            raise TypeError(
                f"Collector: policy output 'action' has dtype {action.dtype}, expected an integer dtype "
                f"for {self.space!r}"
            )
        cpu = action.is_cpu and not action.requires_grad
        if self.as_list and cpu:
            # A few envs' discrete actions as Python ints: checked with Python's min and max (a fifth of a NumPy
            # reduction's time), and the env's array made from them (cheaper than the tensor's NumPy view).
            values = action.tolist()
            if row is not None:
                row[...] = values
            if min(values) < self.lowest or max(values) > self.highest:
                self._check_range(action.numpy(), env_ids)  # raises, naming the env
            return np.array(values, dtype=self.dtype)
        array = action.numpy() if cpu else action.detach().cpu().numpy()
        if row is not None:
            row[...] = array
        if self.discrete:
            self._check_range(array, env_ids)
            return array.astype(self.dtype, copy=False)
        return np.clip(array, self.low, self.high).astype(self.dtype, copy=False)

    def _check_range(self, array: np.ndarray, env_ids: np.ndarray | None) -> None:
        offset = array - self.start if self.has_start else array
        # Seen as unsigned, a negative offset is huge: one reduction checks both ends.
        unsigned = offset.view(_UNSIGNED[offset.itemsize]) if offset.dtype.kind == "i" else offset
        if self.scalar_count:
            if unsigned.max() < self.count:
                return
        elif (unsigned < self.count).all():
            return
        bad = ((offset < 0) | (offset >= self.count)).reshape(len(array), -1).any(axis=1)
        index = int(np.flatnonzero(bad)[0])
        env = (index if env_ids is None else int(env_ids[index])) + self.env_offset
        high = self.start + self.count - 1
        raise ValueError(
            f"Collector: policy output 'action' for env {env} is {array[index].tolist()}, outside "
            f"{self.space!r}; expected integers from {np.asarray(self.start).tolist()} to "
            f"{np.asarray(high).tolist()}"
        )


def where_rows(mask: Tensor, value: Any, other: Any) -> Any:
    """``value`` on the rows where ``mask`` is True, else ``other``: tensors, or every leaf of a TensorDict.

    ``mask`` holds the leading dimensions (``[N]``, or ``[T, N]``); ``other`` has ``value``'s structure, or is
    a scalar.
    """
    if isinstance(value, TensorDictBase):
        pick = (lambda key: other[key]) if isinstance(other, TensorDictBase) else (lambda key: other)
        leaves = {key: where_rows(mask, value[key], pick(key)) for key in value.keys()}
        return TensorDict(leaves, batch_size=value.batch_size)
    return torch.where(mask.view(*mask.shape, *(1,) * (value.dim() - mask.dim())), value, other)
