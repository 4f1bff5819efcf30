"""The Collector's arguments, checked: each refusal names the argument, the value received, what it must be and the fix.

Also the :class:`~torch_rollout.loop._spec.LoopSpec` that the checked arguments make. The tuner
(``torch_rollout.tuning``) checks its own arguments of the same names with the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium
import torch
from gymnasium.vector import VectorEnv
from tensordict import TensorDict, TensorDictBase
from torch import nn

from torch_rollout.envs._gym import split_envs
from torch_rollout.loop._interaction import greedy_modules
from torch_rollout.loop._spec import BATCH_KEYS, BatchKeys, CudaGraph, LoopSpec
from torch_rollout.util._devices import indexed
from torch_rollout.util._warnings import warn

__all__ = [
    "check_envs",
    "check_int",
    "check_options",
    "check_policy",
    "check_shares",
    "loop_spec",
    "resolve_device",
    "resolve_num_envs",
]


def loop_spec(
    keys: BatchKeys,
    *,
    num_steps: int,
    num_envs: int,
    check_finite: bool,
    initial_state: Any,
    compile_options: dict[str, Any] | CudaGraph | None,
) -> LoopSpec:
    """What every loop of the collector is told, from its checked arguments (``initial_state`` checked here)."""
    return LoopSpec(
        num_steps=num_steps,
        obs_key=keys.obs_key,
        check_finite=bool(check_finite),
        info_keys=keys.info_specs,
        initial_state=None if initial_state is None else initial_state_rows(initial_state, num_envs, keys),
        compile_options=compile_options,
        next_obs_key=keys.next_obs_key,
    )


def check_options(num_steps: Any, total_timesteps: Any, keys: Any, timeout: Any) -> None:
    """Refuses option values of the wrong type or range, naming the argument, the value and what it must be.

    ``prefetch`` is the placement's to decide and check (``Backend.settings``).
    """
    check_int("num_steps", num_steps, minimum=1)
    if total_timesteps is not None:
        check_int("total_timesteps", total_timesteps, minimum=1)
    if not isinstance(keys, BatchKeys):
        fix = f"; pass keys=torch_rollout.BatchKeys(**{dict(keys)!r})" if isinstance(keys, Mapping) else ""
        raise TypeError(
            f"Collector: keys must be a torch_rollout.BatchKeys(obs_key=..., info_keys=..., next_obs=...), got "
            f"{type(keys).__name__} {keys!r}{fix}"
        )
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"Collector: timeout must be a positive number of seconds or None, got {timeout!r}")


def check_policy(policy: Any) -> None:
    """Refuses a policy that is not a Module; warns for each probabilistic module that will not sample."""
    if not isinstance(policy, nn.Module):
        raise TypeError(f"Collector: policy must be a torch.nn.Module, got {type(policy).__name__}")
    for name, mode in greedy_modules(policy):
        warn(
            f"Collector: the policy's probabilistic module {name!r} has default_interaction_type={mode}, so the "
            "collector acts with it without sampling (TorchRL's collectors would set RANDOM around collection; "
            "this one keeps each module's default, whatever the trainer sets): build it with "
            "default_interaction_type=InteractionType.RANDOM to sample"
        )


def check_envs(envs: Any) -> None:
    if not isinstance(envs, (VectorEnv, str)) and not callable(envs):
        hint = ""
        if isinstance(envs, gymnasium.Env):
            num = getattr(envs.unwrapped, "num_envs", None)
            hint = (
                f" with num_envs={num}, a batched env: present it as a gymnasium.vector.VectorEnv of its num_envs "
                "envs (torch_rollout.envs.FromIsaacLab does so for Isaac Lab's own envs, which the collector "
                "recognises by their cfg.compute_final_obs)"
                if isinstance(num, int) and num > 1
                else " (wrap a single env with gymnasium.vector.SyncVectorEnv)"
            )
        raise TypeError(
            f"Collector: envs must be a gymnasium.vector.VectorEnv, an env id str or a function "
            f"make_envs(num_envs) -> VectorEnv, got {type(envs).__name__}{hint}"
        )


def resolve_device(device: Any, *, who: str = "Collector") -> torch.device:
    """``device`` checked, ``None`` as CUDA when available (else the CPU), a CUDA device with its index.

    ``who``: the call the errors name (``Collector``, ``ReplayRing``).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    checked = _check_device(device, who)
    _check_available(checked, device, who)
    return indexed(checked)


def check_shares(envs: Any, num_envs: int, num_workers: int) -> None:
    """Refuses more workers than envs, and a split of the envs that a recipe refuses, before any worker starts."""
    if num_workers > num_envs:
        raise ValueError(
            f"Collector: num_workers={num_workers} is more than num_envs={num_envs}; each worker needs an env"
        )
    check_shares = getattr(envs, "check_shares", None)  # a recipe that refuses some splits
    if callable(check_shares):
        check_shares(split_envs(num_envs, num_workers))


def resolve_num_envs(envs: Any, num_envs: Any, *, who: str = "Collector") -> int:
    """The number of envs: a live vector env's own (``num_envs`` must agree), else ``num_envs``, required.

    ``who``: the call the errors name (``Collector``, ``tune``).
    """
    if isinstance(envs, VectorEnv):
        if num_envs is not None and num_envs != envs.num_envs:
            raise ValueError(
                f"{who}: num_envs={num_envs} but the given vector env has num_envs={envs.num_envs}; "
                "pass num_envs only with an env id or a make_envs function"
            )
        num_envs = envs.num_envs
    elif num_envs is None:
        raise ValueError(f"{who}: num_envs is required with an env id or a function (envs={envs!r}), e.g. num_envs=8")
    check_int("num_envs", num_envs, minimum=1, who=who)
    return num_envs


def _check_device(device: Any, who: str) -> torch.device:
    """``device`` as a torch.device; a TypeError or ValueError naming the argument for anything torch cannot parse."""
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise TypeError(
            f"{who}: device must be a torch.device, a device string such as 'cpu', 'cuda' or 'cuda:1', or None, "
            f"got {type(device).__name__} {device!r}"
        )
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"{who}: device={device!r} is not a torch device; expected 'cpu', 'cuda', 'cuda:1', 'mps', a "
            "torch.device, or None (CUDA when available, else the CPU)"
        ) from None


def _check_available(device: torch.device, given: Any, who: str) -> None:
    """Refuses a CUDA or MPS ``device`` that this machine does not have, naming the fix (before any env is built)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            cuda = torch.version.cuda
            build = f"built with CUDA {cuda}, but sees no GPU or driver" if cuda else "built without CUDA"
            raise ValueError(
                f"{who}: device={given!r} needs a CUDA GPU, but torch.cuda.is_available() is False (this torch, "
                f"{torch.__version__}, is {build}); pass device='cpu' (or device=None: CUDA when available, else the "
                "CPU), or install a CUDA build of torch on a machine with an NVIDIA GPU and its driver"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"{who}: device={given!r}, but torch.cuda.device_count() is {count}; pass a CUDA device from "
                f"'cuda:0' to 'cuda:{count - 1}', or device='cuda' (the current one)"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            f"{who}: device={given!r} needs Apple's MPS, but torch.backends.mps.is_available() is False; pass "
            "device='cpu' (MPS needs a Mac with macOS 12.3 or later)"
        )


def check_int(name: str, x: Any, *, minimum: int, who: str = "Collector") -> None:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{who}: {name} must be an int >= {minimum}, got {type(x).__name__} {x!r}")
    if x < minimum:
        raise ValueError(f"{who}: {name} must be an int >= {minimum}, got {x}")


# Keys of the batch and of a recurrent policy's call: initial_state's entries cannot use them (nor obs_key).
_STATE_RESERVED_KEYS = BATCH_KEYS | {"value", "state_value", "log_prob", "is_init", "next", "next_state"}


def initial_state_rows(initial_state: Any, num_envs: int, keys: BatchKeys) -> TensorDictBase:
    """``initial_state`` as a TensorDict ``[num_envs, ...]`` on the CPU (workers take their rows of it)."""
    given = initial_state
    if callable(initial_state) and not isinstance(initial_state, (TensorDictBase, Mapping)):
        initial_state = initial_state(num_envs)
    if isinstance(initial_state, Mapping):
        initial_state = TensorDict(dict(initial_state), batch_size=[])
    if not isinstance(initial_state, TensorDictBase):
        raise TypeError(
            "Collector: initial_state must be a TensorDict of [num_envs, ...] tensors or a function "
            f"initial_state(num_envs) returning one, got {type(given).__name__}"
            + ("" if initial_state is given else f" returning {type(initial_state).__name__}")
        )
    leaves = list(initial_state.items(include_nested=True, leaves_only=True))
    if not leaves:
        raise ValueError("Collector: initial_state has no entries; pass initial_state=None for a policy without state")
    for key, tensor in leaves:
        if tensor.dim() == 0 or tensor.shape[0] != num_envs:
            raise ValueError(
                f"Collector: initial_state entry {key!r} has shape {tuple(tensor.shape)}, expected a leading size of "
                f"num_envs={num_envs} (one row per env)"
            )
    observations = {keys.obs_key} if keys.next_obs_key is None else {keys.obs_key, keys.next_obs_key}
    clash = sorted(key for key in initial_state.keys() if key in _STATE_RESERVED_KEYS | observations)
    if clash:
        raise ValueError(
            f"Collector: initial_state entries {clash} would overwrite keys of the batch; the batch stores the state "
            f"at initial_state's own keys, so name them otherwise (e.g. 'h', 'c', or 'recurrent_state_h')"
        )
    state = initial_state.detach().to("cpu").clone()
    state.batch_size = [num_envs]
    return state
