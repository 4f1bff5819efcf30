"""The one collection loop: steps a vector env, runs the policy, and writes ``[T, n]`` rows.

Every placement (the background thread, worker processes) runs this loop; a
placement only decides where it runs, how the policy's weights reach it and how
its batches travel. GAE is not computed here: the consumer runs it on its device
from the ``value`` and ``next_value`` rows (see :func:`add_advantages`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import Tensor, nn

from torch_rollout._infos import InfoRecorder
from torch_rollout._spaces import (
    ActionConverter,
    Obs,
    ObsBuffer,
    ObsChecker,
    check_action_space,
    check_obs_space,
    first_non_finite,
    obs_to_tensor,
    select_obs,
    stack_final_obs,
)
from torch_rollout.gae import compute_gae

__all__ = ["Forward", "RolloutLoop", "Stopped", "add_advantages", "call_policy"]

# The placement's policy call: observations on the policy's device -> (raw outputs, weights version).
Forward = Callable[[Obs], "tuple[Any, int]"]

# Rows the loop fills from NumPy on the host, with their dtypes.
_HOST_KEYS = {
    "reward": np.float32,
    "terminated": np.bool_,
    "truncated": np.bool_,
    "mask": np.bool_,
    "episode_return": np.float32,
    "episode_length": np.int64,
    "policy_version": np.int64,
}


def call_policy(policy: nn.Module, obs: Obs, obs_key: str = "obs") -> Any:
    """Calls ``policy`` on a batch of observations; a TensorDictModule reads them as ``obs_key``."""
    if isinstance(policy, TensorDictModuleBase):
        return policy(TensorDict({obs_key: obs}, batch_size=obs.shape[:1], device=obs.device))
    return policy(obs)


class Stopped(Exception):
    """Raised inside the loop when its placement asks it to stop."""


class RolloutLoop:
    """Collects ``[num_steps, num_envs]`` batches of one vector env with one policy.

    A batch is a TensorDict on ``storage_device`` with ``obs`` (named
    ``obs_key``), every policy output, ``reward``, ``terminated``,
    ``truncated``, ``mask``, ``episode_return``, ``episode_length``,
    ``policy_version``, ``info`` with ``info_keys`` and, when the policy
    returns ``"value"`` (or TorchRL's ``"state_value"``), ``next_value``.
    ``collect(out)`` writes into ``out`` (a batch of an earlier call, e.g. a
    shared-memory slot) or into new tensors when ``out`` is None.

    Args:
        envs: the vector env; the loop resets it with ``seed`` and then owns its stepping.
        forward: the placement's policy call (it holds the weights lock and knows the version).
        num_steps: rows per batch (``T``).
        device: where the policy runs (observations are moved there).
        storage_device: where batches are written; ``device`` for the thread,
            the CPU (shared memory) for worker processes.
        seed: seed of the first reset (sub-env ``i`` gets ``seed + i``).
        autoreset_mode: the env's autoreset mode.
        check_finite: raise on NaN or inf observations, rewards and actions.
        stop: polled before each step; True raises :class:`Stopped`.
        env_offset: global index of env 0, for error messages.
        info_keys: ``{key: example or None}`` of the env infos to keep (see :class:`InfoRecorder`).
        obs_key: the batch key of observations, and the key a TensorDictModule reads them from.
    """

    def __init__(
        self,
        envs: VectorEnv,
        forward: Forward,
        *,
        num_steps: int,
        device: torch.device,
        storage_device: torch.device | None = None,
        seed: int | None = None,
        autoreset_mode: AutoresetMode = AutoresetMode.NEXT_STEP,
        check_finite: bool = False,
        stop: Callable[[], bool] = lambda: False,
        env_offset: int = 0,
        info_keys: Mapping[str, Any] | None = None,
        obs_key: str = "obs",
    ) -> None:
        self.envs = envs
        self.forward = forward
        self.num_steps = num_steps
        self.num_envs = envs.num_envs
        self.device = device
        self.storage_device = device if storage_device is None else storage_device
        self.seed = seed
        self.autoreset_mode = autoreset_mode
        self.check_finite = check_finite
        self.stop = stop
        self.env_offset = env_offset
        self.obs_key = obs_key
        self.infos = None if info_keys is None else InfoRecorder(
            info_keys, num_envs=envs.num_envs, autoreset_mode=autoreset_mode, env_offset=env_offset
        )  # fmt: skip
        self.obs_space = envs.single_observation_space
        check_obs_space(self.obs_space)
        check_action_space(envs.single_action_space)
        self.to_env_action = ActionConverter(envs.single_action_space, envs.num_envs, env_offset=env_offset)
        self.check_obs = ObsChecker(self.obs_space, envs.num_envs)
        self.reset_pending = False
        self.batches = 0  # batches started: step numbers in error messages are batches * T + t
        self.call = "envs.reset()"  # the env or policy call the loop is in or made last, for a stuck thread
        self.has_value: bool | None = None
        self.value_key = "value"  # or TorchRL's "state_value", when the policy returns that instead
        self.output_keys: list[str] | None = None
        # Batches on the host are written from NumPy and observations go to the policy from
        # there; batches on CUDA get observations through a page-locked staging row.
        self.on_host = self.storage_device.type == "cpu"

    def reseed(self, seed: int | None) -> None:
        """Resets the envs with ``seed`` before the next batch (a resumed collector's part of the seed stream)."""
        self.seed = seed
        self.reset_pending = True  # set last: a reset already running reads the seed, this one runs again

    def reset(self) -> None:
        N = self.num_envs
        self.call = "envs.reset()"
        obs, self.reset_infos = self.envs.reset(seed=self.seed)
        self.check_obs(obs, "envs.reset()")
        if self.check_finite:
            self._check_finite(obs, None, "envs.reset()")
        self.obs = obs
        self.prev_done = np.zeros(N, dtype=bool)  # NEXT_STEP: the next step of these envs is a reset
        self.ep_return = np.zeros(N, dtype=np.float32)
        self.ep_length = np.zeros(N, dtype=np.int64)
        # Reused each step: reading the action back synchronizes with the upload.
        self.staging = None if self.on_host else ObsBuffer(self.obs_space, (N,), pin_memory=True)

    # -- one batch -----------------------------------------------------------------------------

    def collect(self, out: TensorDict | None = None) -> TensorDict:
        T, N = self.num_steps, self.num_envs
        envs = self.envs
        if self.reset_pending:
            self.reset_pending = False
            self.reset()
        if out is None:
            obs_buffer = ObsBuffer(self.obs_space, (T, N), device=self.storage_device)
            host = {key: np.empty((T, N), dtype=dtype) for key, dtype in _HOST_KEYS.items()}
            outputs: dict[str, Tensor] | None = None
        else:
            obs_buffer = ObsBuffer.wrap(self.obs_space, out[self.obs_key])
            host = {key: out[key].numpy() for key in _HOST_KEYS} if self.on_host else {
                key: np.empty((T, N), dtype=dtype) for key, dtype in _HOST_KEYS.items()
            }
            outputs = {key: out[key] for key in self.output_keys}
        info_rows = None
        if self.infos is not None and out is not None:
            info_rows = self.infos.views(out["info"]) if self.on_host else self.infos.empty_rows(T)
        reward, terminated, truncated = host["reward"], host["terminated"], host["truncated"]
        mask, ep_return, ep_length, versions = (
            host["mask"], host["episode_return"], host["episode_length"], host["policy_version"]
        )  # fmt: skip
        mask.fill(True)
        final_values: list[tuple[int, np.ndarray, Tensor]] = []  # (t, envs, V(final obs))
        self.batches += 1

        for t in range(T):
            if self.stop():
                raise Stopped
            obs_t = self._obs_to_device(obs_buffer, t)
            raw, version = self._forward(obs_t)
            out_t = self._check_outputs(raw, N)
            if outputs is None:
                outputs = {key: _empty_rows(value, T, self.storage_device) for key, value in out_t.items()}
            for key, value in out_t.items():
                outputs[key][t] = value
            versions[t] = version

            if self.check_finite:
                self._check_finite_action(out_t["action"], t)
            action = self.to_env_action(out_t["action"])
            self.call = "envs.step()"
            next_obs, r, term, trunc, info = envs.step(action)
            self.check_obs(next_obs, "envs.step()")
            if self.check_finite:
                self._check_finite(next_obs, r, "envs.step()", t)
            done = term | trunc
            reward[t], terminated[t], truncated[t] = r, term, trunc

            real = None
            if self.autoreset_mode == AutoresetMode.NEXT_STEP:
                # This step reset the envs that ended last step: not a real transition.
                mask[t] = real = ~self.prev_done
                self.prev_done = done
                self.ep_length += real
            else:
                self.ep_length += 1
            if self.infos is not None:
                if info_rows is None:
                    if self.infos.structures is None:
                        self.infos.learn(self.reset_infos, info)
                    info_rows = self.infos.empty_rows(T)
                self.infos.record(info_rows, t, info, done, real)
            self.ep_return += r
            ep_return[t], ep_length[t] = self.ep_return, self.ep_length
            if done.any():
                self.ep_return[done] = 0.0
                self.ep_length[done] = 0
                next_obs = self._finish_episodes(t, done, next_obs, info, final_values)
            self.obs = next_obs

        if out is None:
            batch = {self.obs_key: obs_buffer.tensor, **outputs}
            for key, array in host.items():
                batch[key] = torch.from_numpy(array).to(self.storage_device, non_blocking=True)
            if info_rows is not None:
                batch["info"] = self.infos.tensordict(info_rows, [T, N], self.storage_device)
            if self.has_value:
                batch["next_value"] = torch.empty_like(outputs[self.value_key])
            out = TensorDict(batch, batch_size=[T, N], device=self.storage_device)
        elif not self.on_host:
            for key, array in host.items():
                out[key].copy_(torch.from_numpy(array), non_blocking=True)
            if info_rows is not None:
                out["info"].copy_(self.infos.tensordict(info_rows, [T, N], torch.device("cpu")), non_blocking=True)
        if self.has_value:
            self._write_next_value(out, final_values)
        return out

    def _obs_to_device(self, obs_buffer: ObsBuffer, t: int) -> Obs:
        if self.on_host:
            obs_buffer.write(t, self.obs)
            return obs_buffer.tensor[t].to(self.device)  # a view on the CPU, an upload to CUDA
        self.staging.write(slice(None), self.obs)
        obs_t = self.staging.tensor.to(self.device, non_blocking=True)
        obs_buffer.tensor[t] = obs_t
        return obs_t

    def _finish_episodes(
        self, t: int, done: np.ndarray, next_obs: Any, info: dict, final_values: list[tuple[int, np.ndarray, Tensor]]
    ) -> Any:
        """Records V(final obs) of the envs that ended at step ``t`` and resets them if needed.

        In NEXT_STEP mode the final observation is what the env returns now, so
        the next step's forward pass values it and nothing is done here.
        """
        mode = self.autoreset_mode
        if mode == AutoresetMode.NEXT_STEP:
            return next_obs
        index = np.flatnonzero(done)
        final = None
        if mode == AutoresetMode.SAME_STEP and (self.has_value or self.check_finite):
            if "final_obs" not in info:
                raise KeyError(
                    "Collector: the env runs in SAME_STEP autoreset mode but its step infos have no "
                    "'final_obs' at an episode end; a wrapper must keep infos['final_obs']"
                )
            final = stack_final_obs(self.obs_space, info["final_obs"], index)
            if self.check_finite:
                self._check_finite(final, None, "envs.step() in infos['final_obs']", t, index)
        if self.has_value:
            if final is None:
                final = select_obs(self.obs_space, next_obs, index)
            # One batched forward for every env that ended this step.
            raw, _ = self._forward(obs_to_tensor(self.obs_space, final, self.device))
            final_values.append((t, index, self._check_outputs(raw, len(index))[self.value_key]))
        if mode == AutoresetMode.DISABLED:
            self.call = "envs.reset(options={'reset_mask': ...})"
            next_obs, _ = self.envs.reset(options={"reset_mask": done})
            self.check_obs(next_obs, "envs.reset(options={'reset_mask': ...})")
            if self.check_finite:
                self._check_finite(next_obs, None, "envs.reset(options={'reset_mask': ...})", t)
        return next_obs

    def _write_next_value(self, out: TensorDict, final_values: list[tuple[int, np.ndarray, Tensor]]) -> None:
        # The last row bootstraps from the observation the next batch starts with.
        if self.on_host:
            last_obs = obs_to_tensor(self.obs_space, self.obs, self.device)
        else:
            self.staging.write(slice(None), self.obs)
            last_obs = self.staging.tensor.to(self.device, non_blocking=True)
        raw, _ = self._forward(last_obs)
        value, next_value = out[self.value_key], out["next_value"]
        next_value[:-1] = value[1:]
        next_value[-1] = self._check_outputs(raw, self.num_envs)[self.value_key]
        for t, index, final_value in final_values:
            next_value[t, torch.from_numpy(index).to(next_value.device)] = final_value.to(next_value.device)

    def _forward(self, obs: Obs) -> tuple[Any, int]:
        self.call = "the policy's forward()"
        return self.forward(obs)

    def _check_finite(
        self, obs: Any, reward: np.ndarray | None, call: str, t: int | None = None, index: np.ndarray | None = None
    ) -> None:
        """Raises ValueError naming the key, env and step of the first NaN or inf (``check_finite=True``).

        ``index`` maps the rows of ``obs`` to envs when it holds only some of them (final observations).
        """
        found = self.check_obs.non_finite(obs)
        if found is None and reward is not None:
            found = first_non_finite(reward)
            found = None if found is None else ("reward", *found)
        if found is not None:
            name, env, value = found
            self._raise_non_finite(name, env if index is None else int(index[env]), value, call, t)

    def _check_finite_action(self, action: Tensor, t: int) -> None:
        # Before the env sees it: clipping to a Box's bounds would turn inf into a bound, and NaN stays NaN.
        found = first_non_finite(action.detach().cpu().numpy())
        if found is not None:
            self._raise_non_finite("action", *found, "the policy", t)

    def _raise_non_finite(self, name: str, env: int, value: Any, call: str, t: int | None) -> None:
        env += self.env_offset
        batch = self.batches - 1
        step = "" if t is None else f" at step {batch * self.num_steps + t} (row {t} of batch {batch})"
        raise ValueError(
            f"Collector(check_finite=True): {name} of env {env} is {value}{step}, returned by {call}; "
            "pass check_finite=False to let NaN and inf through"
        )

    # -- policy outputs ------------------------------------------------------------------------

    def _check_outputs(self, raw: Any, n: int) -> dict[str, Tensor]:
        if isinstance(raw, TensorDictBase):
            items = {key: raw.get(key) for key in raw.keys() if key != self.obs_key}
        elif isinstance(raw, Mapping):
            items = dict(raw)
        else:
            raise TypeError(
                f"Collector: policy must return a Mapping[str, Tensor] or a TensorDict with an 'action' key, "
                f"got {type(raw).__name__}"
            )
        if "action" not in items:
            raise ValueError(
                f"Collector: policy output has no 'action' key; it returned keys {sorted(map(str, items))}"
            )
        for key, value in items.items():
            if not isinstance(value, (Tensor, TensorDictBase)):
                raise TypeError(
                    f"Collector: policy output {key!r} must be a torch.Tensor of shape [{n}, ...], "
                    f"got {type(value).__name__}"
                )
            if value.dim() == 0 or value.shape[0] != n:
                raise ValueError(
                    f"Collector: policy output {key!r} has shape {tuple(value.shape)}, expected a leading "
                    f"size of {n} (one row per env)"
                )
            if value.device != self.device:
                raise ValueError(
                    f"Collector: policy output {key!r} is on device {value.device}, expected {self.device} "
                    "(the collector's device)"
                )
        if self.output_keys is None and "value" not in items and "state_value" in items:
            self.value_key = "state_value"  # what TorchRL's ValueOperator writes
        value = items.get(self.value_key)
        if value is not None:
            if value.dim() == 2 and value.shape[1] == 1:
                items[self.value_key] = value = value.squeeze(1)
            if value.dim() != 1 or not value.is_floating_point():
                raise ValueError(
                    f"Collector: policy output {self.value_key!r} has shape {tuple(value.shape)} and dtype {value.dtype}, "
                    f"expected a floating-point tensor of shape ({n},) or ({n}, 1)"
                )
        if self.output_keys is None:
            self.output_keys = list(items)
            self.has_value = value is not None
        elif n == self.num_envs and items.keys() != set(self.output_keys):
            raise ValueError(
                f"Collector: policy output keys changed from {sorted(self.output_keys)} to {sorted(items)} between steps"
            )
        return items


def _empty_rows(value: Tensor | TensorDictBase, T: int, device: torch.device) -> Tensor | TensorDictBase:
    """Uninitialised storage for ``T`` rows shaped like one step's policy output ``value``."""
    if isinstance(value, Tensor):
        return torch.empty((T, *value.shape), dtype=value.dtype, device=device)
    return value.unsqueeze(0).expand(T, *value.batch_size).clone().to(device)


def add_advantages(batch: TensorDict, *, gamma: float, gae_lambda: float) -> TensorDict:
    """Adds ``done`` and, when the batch has values, GAE ``advantage`` and ``return`` (in place)."""
    batch["done"] = batch["terminated"] | batch["truncated"]
    if "next_value" not in batch.keys():
        return batch
    value = batch["value" if "value" in batch.keys() else "state_value"]
    advantage, return_ = compute_gae(
        batch["reward"],
        value,
        batch["next_value"],
        batch["terminated"],
        batch["truncated"],
        gamma=gamma,
        gae_lambda=gae_lambda,
    )
    # Reset rows of NEXT_STEP carry no transition: zero advantage, excluded by mask.
    real = batch["mask"]
    batch["advantage"] = torch.where(real, advantage, 0.0)
    batch["return"] = torch.where(real, return_, value)
    return batch
