"""The one collection loop: steps a vector env, runs the policy, and writes ``[T, n]`` rows.

Every placement (the background thread, worker processes) runs this loop; a
placement only decides where it runs, how the policy's weights reach it and how
its batches travel. GAE is not computed here: the consumer runs it on its device
from the ``value`` and ``next_value`` rows (see :func:`add_advantages`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import Tensor, nn

from torch_rollout._envs import autoreset_mode as env_autoreset_mode
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
    space_nbytes,
    stack_final_obs,
)
from torch_rollout._spec import LoopSpec
from torch_rollout.gae import GAE, compute_gae

__all__ = ["Forward", "PolicyCall", "RolloutLoop", "Stopped", "add_advantages", "call_policy", "empty_rows"]

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


@dataclass
class PolicyCall:
    """One call of the policy that the loop asks its placement to make (see :func:`call_policy`).

    ``state`` and ``is_init`` are set in recurrent mode only. ``value_only``
    marks a bootstrap: only the value is wanted, and ``policy.get_value`` is
    called instead of the forward when the policy has one.
    """

    obs: Obs
    state: TensorDictBase | None = None
    is_init: Tensor | None = None
    value_only: bool = False


# The placement's policy call: a PolicyCall on the policy's device -> (raw outputs, weights version).
Forward = Callable[[PolicyCall], "tuple[Any, int]"]


def call_policy(
    policy: nn.Module,
    call: PolicyCall,
    obs_key: str = "obs",
    functions: tuple[Callable[..., Any], Callable[..., Any] | None] | None = None,
    *,
    owned: bool = False,
) -> Any:
    """Makes ``call`` on ``policy`` in eval mode, and puts back the modes its modules had.

    The forward is ``policy(obs)``, or ``policy(obs, state, is_init)`` in
    recurrent mode; a value-only call uses ``policy.get_value`` with the same
    arguments when it exists. A TensorDictModule gets one TensorDict with
    ``obs_key`` (and in recurrent mode ``"is_init"`` of shape ``[n, 1]`` and the
    state's entries at their own keys), as TorchRL's recurrent modules read it.
    ``functions``: ``(forward, get_value or None)`` called instead of the
    policy's own (its compiled ones, see ``torch_rollout._compile``).
    ``owned`` marks the collector's own acting copy, which is in eval mode from
    its creation on: its modes are then neither read nor switched.
    """
    # Acting is inference whatever the trainer's module is doing: no dropout, no BatchNorm statistics
    # updated, in every placement (the thread with prefetch=0 acts with the trainer's module itself).
    # The flags are set as nn.Module.train sets them, but without nn.Module.__setattr__, which made the switch
    # and back 4x to 7x dearer (the example's Agent, 2-core machine: 67 us against 18 us at a load of 4).
    # Walking the modules costs ~10 us a call even when none is training, so a copy nobody else
    # touches is left as it is.
    training = [] if owned else [module for module in policy.modules() if module.training]
    for module in training:
        object.__setattr__(module, "training", False)
    try:
        if functions is None:
            method = getattr(policy, "get_value", None) if call.value_only else None
            function = policy if method is None else method
        else:
            function = functions[1] if call.value_only and functions[1] is not None else functions[0]
        if isinstance(policy, TensorDictModuleBase):
            entries: dict[str, Any] = {obs_key: call.obs}
            if call.state is not None:
                entries["is_init"] = call.is_init.unsqueeze(-1)
            td = TensorDict(entries, batch_size=call.obs.shape[:1], device=call.obs.device)
            if call.state is not None:
                td.update(call.state)
            return function(td)
        if call.state is None:
            return function(call.obs)
        return function(call.obs, call.state, call.is_init)
    finally:
        for module in training:
            object.__setattr__(module, "training", True)


class Stopped(Exception):
    """Raised inside the loop when its placement asks it to stop."""


class RolloutLoop:
    """Collects ``[num_steps, num_envs]`` batches of one vector env with one policy.

    A batch is a TensorDict on ``storage_device`` with ``obs`` (named
    ``obs_key``), every policy output, ``reward``, ``terminated``,
    ``truncated``, ``mask``, ``episode_return``, ``episode_length``,
    ``policy_version``, ``info`` with ``info_keys``, ``"next_" + obs_key``
    with ``next_obs_key`` (see :meth:`_write_next_obs`) and, when the policy
    returns ``"value"`` (or TorchRL's ``"state_value"``), ``next_value``.
    ``collect(out)`` writes into ``out`` (a batch of an earlier call, e.g. a
    shared-memory slot) or into new tensors when ``out`` is None.

    Args:
        envs: the vector env; the loop resets it with ``seed`` and then owns its stepping.
        forward: the placement's policy call (it holds the weights lock and knows the version).
        spec: the collector's settings, the same for every loop (rows per batch, obs key, finite
            checks, info keys, a recurrent policy's initial state of all the collector's envs:
            this loop takes the rows of its own envs, from ``env_offset``; the next observations' key).
        device: where the policy runs (observations are moved there).
        storage_device: where batches are written; ``device`` for the thread,
            the CPU (shared memory) for worker processes.
        seed: seed of the first reset (sub-env ``i`` gets ``seed + i``).
        stop: polled before each step; True raises :class:`Stopped`.
        env_offset: global index of env 0, for error messages and the initial state's rows.
    """

    def __init__(
        self,
        envs: VectorEnv,
        forward: Forward,
        spec: LoopSpec,
        *,
        device: torch.device,
        storage_device: torch.device | None = None,
        seed: int | None = None,
        stop: Callable[[], bool] = lambda: False,
        env_offset: int = 0,
    ) -> None:
        self.envs = envs
        self.forward = forward
        self.num_steps = spec.num_steps
        self.num_envs = envs.num_envs
        self.device = device
        self.storage_device = device if storage_device is None else storage_device
        self.seed = seed
        self.autoreset_mode = autoreset_mode = env_autoreset_mode(envs)
        self.check_finite = spec.check_finite
        self.stop = stop
        self.env_offset = env_offset
        self.obs_key = spec.obs_key
        self.next_obs_key = spec.next_obs_key
        # (t, envs, their final observations) of this batch's episode ends, with next_obs_key (SAME_STEP, DISABLED).
        self.final_obs: list[tuple[int, np.ndarray, Any]] = []
        self.infos = (
            None
            if spec.info_keys is None
            else InfoRecorder(
                spec.info_keys, num_envs=self.step_width(envs), autoreset_mode=autoreset_mode, env_offset=env_offset
            )
        )
        self.obs_space = envs.single_observation_space
        check_obs_space(self.obs_space)
        check_action_space(envs.single_action_space)
        self.to_env_action = ActionConverter(envs.single_action_space, self.step_width(envs), env_offset=env_offset)
        self.check_obs = ObsChecker(self.obs_space, self.step_width(envs))
        self.reset_pending = False
        self.batches = 0  # batches started: step numbers in error messages are batches * T + t
        self.call = "envs.reset()"  # the env or policy call the loop is in or made last, for a stuck thread
        self.has_value: bool | None = None
        self.value_key = "value"  # or TorchRL's "state_value", when the policy returns that instead
        self.output_keys: list[str] | None = None
        # Batches on the host are written from NumPy and observations go to the policy from
        # there; batches on CUDA get observations through a page-locked staging row.
        self.on_host = self.storage_device.type == "cpu"
        self.host_keys = _HOST_KEYS
        self.initial_state = None
        initial_state = spec.initial_state
        if initial_state is not None:
            self.host_keys = {**_HOST_KEYS, "is_init": np.bool_}
            rows = initial_state[env_offset : env_offset + self.num_envs]
            self.initial_state = rows.to(device).clone()
            self.state_keys = list(rows.keys(include_nested=True, leaves_only=True))

    def min_row_bytes(self) -> int:
        """Bytes that one row of a batch (one env, one step) takes at least, before the policy has run.

        The observation (float64 stored as float32) and with ``next_obs_key`` the next one, the action
        (floats as float32, as policies return them), the loop's own keys and a recurrent state; the
        policy's other outputs (``value``, ``log_prob``, ...), ``next_value`` and infos come on top.
        """
        state = 0
        if self.initial_state is not None:
            state = sum(t[0].nbytes for _, t in self.initial_state.items(include_nested=True, leaves_only=True))
        own = sum(np.dtype(dtype).itemsize for dtype in self.host_keys.values())
        obs = space_nbytes(self.obs_space) * (1 if self.next_obs_key is None else 2)
        return obs + space_nbytes(self.envs.single_action_space) + own + state

    @staticmethod
    def step_width(envs: VectorEnv) -> int:
        """Envs that one step returns: all of them."""
        return envs.num_envs

    def reseed(self, seed: int | None) -> None:
        """Resets the envs with ``seed`` before the next batch (a resumed collector's part of the seed stream)."""
        self.seed = seed
        self.reset_pending = True  # set last: a reset already running reads the seed, this one runs again

    def reset(self) -> None:
        N = self.num_envs
        self.call = "envs.reset()"
        obs, self.reset_infos = self.envs.reset(seed=self.seed)
        if isinstance(obs, Tensor) or (isinstance(obs, Mapping) and any(isinstance(v, Tensor) for v in obs.values())):
            raise TypeError(
                f"Collector: envs.reset() returned torch tensors, but {type(self.envs).__name__} does not say that "
                "it presents torch tensors: give it (or a wrapper of it) the attribute `device`, the torch.device "
                "of its tensors, as torch_rollout.envs, gymnasium's NumpyToTorch and ManiSkill3's ManiSkillVectorEnv "
                "have; the collector then keeps its tensors on that device"
            )
        self.check_obs(obs, "envs.reset()")
        if self.check_finite:
            self._check_finite(obs, None, "envs.reset()")
        self.obs = obs
        self.prev_done = np.zeros(N, dtype=bool)  # NEXT_STEP: the next step of these envs is a reset
        self.ep_return = np.zeros(N, dtype=np.float32)
        self.ep_length = np.zeros(N, dtype=np.int64)
        if self.initial_state is not None:
            self.state = self.initial_state.clone()  # the state that goes into the next step
            self.is_init = np.ones(N, dtype=bool)  # the next step starts an episode
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
            host = {key: np.empty((T, N), dtype=dtype) for key, dtype in self.host_keys.items()}
            outputs: dict[str, Tensor] | None = None
            states = None
        else:
            obs_buffer = ObsBuffer.wrap(self.obs_space, out[self.obs_key])
            host = (
                {key: out[key].numpy() for key in self.host_keys}
                if self.on_host
                else {key: np.empty((T, N), dtype=dtype) for key, dtype in self.host_keys.items()}
            )
            outputs = {key: out[key] for key in self.output_keys}
            states = None if self.initial_state is None else out.select(*self.state_keys)
        info_rows = None
        if self.infos is not None and out is not None:
            info_rows = self.infos.views(out["info"]) if self.on_host else self.infos.empty_rows(T)
        reward, terminated, truncated = host["reward"], host["terminated"], host["truncated"]
        mask, ep_return, ep_length, versions = (
            host["mask"],
            host["episode_return"],
            host["episode_length"],
            host["policy_version"],
        )
        mask.fill(True)
        final_values: list[tuple[int, np.ndarray, Tensor]] = []  # (t, envs, V(final obs))
        self.final_obs = []
        self.batches += 1
        # The rows of each [T, ...] tensor as views made once per batch: indexing a tensor costs more
        # than the copy of a row (the loop's own work per step is what limits it on fast envs).
        obs_rows = _rows(obs_buffer.tensor)
        output_rows = None if outputs is None else {key: _rows(value) for key, value in outputs.items()}

        for t in range(T):
            if self.stop():
                raise Stopped
            obs_t = self._obs_to_device(obs_buffer, obs_rows, t)
            if self.initial_state is None:
                raw, version = self._forward(PolicyCall(obs_t))
            else:
                if states is None:
                    states = empty_rows(self.state, T, self.storage_device)
                states[t] = self.state
                host["is_init"][t] = self.is_init
                raw, version = self._forward(PolicyCall(obs_t, self.state, self._is_init_tensor(self.is_init)))
                raw, next_state = self._split_state(raw, N)
            out_t = self._check_outputs(raw, N)
            if outputs is None:
                outputs = {key: empty_rows(value, T, self.storage_device) for key, value in out_t.items()}
                output_rows = {key: _rows(value) for key, value in outputs.items()}
            for key, value in out_t.items():
                rows = output_rows[key]
                if rows is None:
                    outputs[key][t] = value
                else:
                    rows[t].copy_(value)
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
                starts = ~real  # an env's step after its reset step starts its episode
            else:
                self.ep_length += 1
                starts = done
            if self.infos is not None:
                if info_rows is None:
                    if self.infos.structures is None:
                        self.infos.learn(self.reset_infos, info)
                    info_rows = self.infos.empty_rows(T)
                self.infos.record(info_rows, t, info, done, real)
            if self.initial_state is not None:
                # The final observations of envs that ended are valued with this state, before any reset.
                self.next_state = next_state
            self.ep_return += r
            ep_return[t], ep_length[t] = self.ep_return, self.ep_length
            if done.any():
                self.ep_return[done] = 0.0
                self.ep_length[done] = 0
                next_obs = self._finish_episodes(t, done, next_obs, info, final_values)
            self.obs = next_obs
            if self.initial_state is not None:
                self.state = self._reset_state(next_state, starts)
                self.is_init = starts

        next_obs = None if self.next_obs_key is None else self._write_next_obs(obs_buffer.tensor, out)
        if out is None:
            batch = {self.obs_key: obs_buffer.tensor, **outputs}
            if next_obs is not None:
                batch[self.next_obs_key] = next_obs
            for key, array in host.items():
                batch[key] = torch.from_numpy(array).to(self.storage_device, non_blocking=True)
            if info_rows is not None:
                batch["info"] = self.infos.tensordict(info_rows, [T, N], self.storage_device)
            if self.has_value:
                batch["next_value"] = torch.empty_like(outputs[self.value_key])
            out = TensorDict(batch, batch_size=[T, N], device=self.storage_device)
            if states is not None:
                out.update(states)
        elif not self.on_host:
            for key, array in host.items():
                out[key].copy_(torch.from_numpy(array), non_blocking=True)
            if info_rows is not None:
                out["info"].copy_(self.infos.tensordict(info_rows, [T, N], torch.device("cpu")), non_blocking=True)
        if self.has_value:
            self._write_next_value(out, final_values)
        return out

    def _obs_to_device(self, obs_buffer: ObsBuffer, obs_rows: list[Tensor] | None, t: int) -> Obs:
        if self.on_host:
            obs_buffer.write(t, self.obs)
            row = obs_buffer.tensor[t] if obs_rows is None else obs_rows[t]
            return row if self.device.type == "cpu" else row.to(self.device)  # a view, or an upload to CUDA
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
        keep_final = self.next_obs_key is not None
        if mode == AutoresetMode.SAME_STEP and (self.has_value or self.check_finite or keep_final):
            if "final_obs" not in info:
                raise KeyError(
                    "Collector: the env runs in SAME_STEP autoreset mode but its step infos have no "
                    "'final_obs' at an episode end; a wrapper must keep infos['final_obs']"
                )
            final = stack_final_obs(self.obs_space, info["final_obs"], index)
            if self.check_finite:
                self._check_finite(final, None, "envs.step() in infos['final_obs']", t, index)
        if final is None and (self.has_value or keep_final):  # DISABLED: what the step returned, before the reset
            final = select_obs(self.obs_space, next_obs, index)
        if keep_final:
            self.final_obs.append((t, index, final))
        if self.has_value:
            # One batched value call for every env that ended this step, with the state after their last step.
            final_t = obs_to_tensor(self.obs_space, final, self.device)
            if self.initial_state is None:
                call = PolicyCall(final_t, value_only=True)
            else:
                rows = torch.from_numpy(index).to(self.device)
                not_init = self._is_init_tensor(np.zeros(len(index), dtype=bool))
                call = PolicyCall(final_t, self.next_state[rows], not_init, value_only=True)
            final_values.append((t, index, self._value(call, len(index))))
        if mode == AutoresetMode.DISABLED:
            self.call = "envs.reset(options={'reset_mask': ...})"
            next_obs, _ = self.envs.reset(options={"reset_mask": done})
            self.check_obs(next_obs, "envs.reset(options={'reset_mask': ...})")
            if self.check_finite:
                self._check_finite(next_obs, None, "envs.reset(options={'reset_mask': ...})", t)
        return next_obs

    def _write_next_obs(self, obs: Obs, out: TensorDict | None) -> Obs:
        """Each row's true next observation, ``[T, n, ...]``: into ``out[next_obs_key]``, or new storage.

        The next row's observation, for the last row the one the next batch
        starts with: what each step returned, except for envs whose episode
        ended in SAME_STEP and DISABLED modes, whose next row starts after a
        reset; their final observations (kept by :meth:`_finish_episodes`) are
        written over those. In NEXT_STEP mode the step after an episode end is
        the reset row (``mask`` False), whose next observation is the reset one.
        """
        if out is None:
            next_obs = ObsBuffer(self.obs_space, (self.num_steps, self.num_envs), device=self.storage_device).tensor
        else:
            next_obs = out[self.next_obs_key]
        next_obs[:-1] = obs[1:]
        self._write_obs_rows(next_obs, -1, None, self.obs)
        for t, index, final in self.final_obs:
            self._write_obs_rows(next_obs, t, index, final)
        return next_obs

    def _write_obs_rows(self, storage: Obs, t: int, index: np.ndarray | None, obs: Any) -> None:
        """Writes env observations ``obs`` into row ``t`` of ``storage``, at envs ``index`` (None: all of them).

        Torch ops on any device, as it runs once per batch and episode end, not per step.
        """
        rows = obs_to_tensor(self.obs_space, obs, storage.device)
        if index is None:
            storage[t] = rows
        else:
            storage[t, torch.from_numpy(index).to(storage.device)] = rows

    def _write_next_value(self, out: TensorDict, final_values: list[tuple[int, np.ndarray, Tensor]]) -> None:
        # The last row bootstraps from the observation the next batch starts with.
        if self.on_host:
            last_obs = obs_to_tensor(self.obs_space, self.obs, self.device)
        else:
            self.staging.write(slice(None), self.obs)
            last_obs = self.staging.tensor.to(self.device, non_blocking=True)
        if self.initial_state is None:
            call = PolicyCall(last_obs, value_only=True)
        else:  # the state the next batch starts with; it is not advanced
            call = PolicyCall(last_obs, self.state, self._is_init_tensor(self.is_init), value_only=True)
        value, next_value = out[self.value_key], out["next_value"]
        next_value[:-1] = value[1:]
        next_value[-1] = self._value(call, self.num_envs)
        for t, index, final_value in final_values:
            next_value[t, torch.from_numpy(index).to(next_value.device)] = final_value.to(next_value.device)

    def _forward(self, call: PolicyCall) -> tuple[Any, int]:
        self.call = "the policy's forward()"
        return self.forward(call)

    # -- bootstrap values and recurrent state --------------------------------------------------

    def _value(self, call: PolicyCall, n: int) -> Tensor:
        """The value of a bootstrap call: from ``policy.get_value`` when the policy has one, else its forward."""
        raw, _ = self._forward(call)
        if isinstance(raw, (TensorDictBase, Mapping)):
            value = raw.get(self.value_key, None)
            if value is None:
                raise ValueError(
                    f"Collector: a bootstrap call of the policy (or its get_value) returned keys "
                    f"{sorted(map(str, raw.keys()))}, without {self.value_key!r}"
                )
        else:
            value = raw
        if not isinstance(value, Tensor):
            raise TypeError(
                f"Collector: policy.get_value must return a Tensor of shape ({n},), got {type(value).__name__}"
            )
        if value.dim() == 2 and value.shape[1] == 1:
            value = value.squeeze(1)
        if value.shape != (n,) or not value.is_floating_point() or value.device != self.device:
            raise ValueError(
                f"Collector: the bootstrap value has shape {tuple(value.shape)}, dtype {value.dtype} and device "
                f"{value.device}, expected a floating-point tensor of shape ({n},) or ({n}, 1) on {self.device}"
            )
        return value

    def _is_init_tensor(self, is_init: np.ndarray) -> Tensor:
        return torch.from_numpy(is_init).to(self.device)

    def _split_state(self, raw: Any, n: int) -> tuple[Any, TensorDictBase]:
        """Takes the next state out of a recurrent policy's outputs: ``"next_state"`` or ``("next", key)``."""
        if isinstance(raw, TensorDictBase):
            if "next" in raw.keys() and all(("next", *_as_tuple(key)) in raw.keys(True) for key in self.state_keys):
                next_state = raw.get("next").select(*self.state_keys)
                raw = raw.exclude("next", "is_init", *self.state_keys)
            else:
                next_state = raw.get("next_state", None)
                raw = raw.exclude("next_state", "is_init", *self.state_keys)
        elif isinstance(raw, Mapping):
            raw = dict(raw)
            next_state = raw.pop("next_state", None)
        else:
            return raw, None  # _check_outputs names the problem
        if next_state is None:
            raise ValueError(
                f"Collector: with initial_state the policy must return its next state, as 'next_state' (a Mapping "
                f"or TensorDict with the keys {self._state_names()}) or, from a TensorDictModule, at ('next', key); "
                f"it returned keys {sorted(map(str, raw.keys()))}"
            )
        if not isinstance(next_state, TensorDictBase):
            try:
                next_state = TensorDict(dict(next_state), batch_size=[n], device=self.device)
            except Exception as exc:
                raise ValueError(
                    f"Collector: the policy's 'next_state' must be a Mapping of tensors [{n}, ...] with the keys "
                    f"{self._state_names()}, got {type(next_state).__name__} ({exc})"
                ) from None
        keys = set(next_state.keys(include_nested=True, leaves_only=True))
        want = {str(key): (n, *self.initial_state.get(key).shape[1:]) for key in self.state_keys}
        if keys != set(self.state_keys) or any(
            tuple(next_state.get(key).shape) != want[str(key)] for key in self.state_keys
        ):
            got = {str(key): tuple(next_state.get(key).shape) for key in sorted(keys, key=str)}
            raise ValueError(
                f"Collector: the policy's next state has entries {got}, expected {want} (as initial_state)"
            )
        return raw, next_state

    def _reset_state(
        self, next_state: TensorDictBase, starts: np.ndarray, initial: TensorDictBase | None = None
    ) -> TensorDictBase:
        """The state of the next step: ``next_state``, with the initial state (rows of ``initial``, by default
        all envs') for envs that start an episode."""
        if not starts.any():
            return next_state
        rows = torch.from_numpy(starts).to(self.device)

        def reset(initial: Tensor, carried: Tensor) -> Tensor:
            return torch.where(rows.view(-1, *(1,) * (carried.dim() - 1)), initial, carried)

        return (self.initial_state if initial is None else initial).apply(reset, next_state)

    def _state_names(self) -> list[str]:
        return [str(key) for key in self.state_keys]

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
                    f"Collector: policy output {self.value_key!r} has shape {tuple(value.shape)} and dtype "
                    f"{value.dtype}, "
                    f"expected a floating-point tensor of shape ({n},) or ({n}, 1)"
                )
        if self.output_keys is None:
            if self.initial_state is not None:
                clash = sorted(str(key) for key in items if key in {_as_tuple(k)[0] for k in self.state_keys})
                if clash:
                    raise ValueError(
                        f"Collector: policy outputs {clash} have the names of initial_state's entries, which the "
                        "batch stores at those keys; rename one of them"
                    )
            if self.next_obs_key is not None and self.next_obs_key in items:
                raise ValueError(
                    f"Collector: the policy returns {self.next_obs_key!r}, the batch key of the next observations "
                    f"with BatchKeys(next_obs=True) ('next_' + obs_key); rename that output, or pass another obs_key"
                )
            self.output_keys = list(items)
            self.has_value = value is not None
        elif n == self.num_envs and items.keys() != set(self.output_keys):
            raise ValueError(
                f"Collector: policy output keys changed from {sorted(self.output_keys)} to {sorted(items)} between "
                "steps"
            )
        return items


def _as_tuple(key: str | tuple[str, ...]) -> tuple[str, ...]:
    return key if isinstance(key, tuple) else (key,)


def _rows(value: Tensor | TensorDictBase) -> list[Tensor] | None:
    """The rows ``value[t]`` of a tensor as views; None for a TensorDict, which is indexed instead."""
    return list(value.unbind(0)) if isinstance(value, Tensor) else None


def empty_rows(value: Tensor | TensorDictBase, T: int, device: torch.device) -> Tensor | TensorDictBase:
    """Uninitialised storage for ``T`` rows shaped like one step's policy output ``value``."""
    if isinstance(value, Tensor):
        return torch.empty((T, *value.shape), dtype=value.dtype, device=device)
    return value.unsqueeze(0).expand(T, *value.batch_size).clone().to(device)


def add_advantages(batch: TensorDict, gae: GAE | None) -> TensorDict:
    """Adds ``done`` and, with ``gae`` and when the batch has values, GAE ``advantage`` and ``return`` (in place)."""
    batch["done"] = batch["terminated"] | batch["truncated"]
    if gae is None or "next_value" not in batch.keys():
        return batch
    value = batch["value" if "value" in batch.keys() else "state_value"]
    advantage, return_ = compute_gae(
        batch["reward"],
        value,
        batch["next_value"],
        batch["terminated"],
        batch["truncated"],
        gamma=gae.gamma,
        gae_lambda=gae.gae_lambda,
    )
    # Reset rows of NEXT_STEP carry no transition: zero advantage, excluded by mask.
    real = batch["mask"]
    batch["advantage"] = torch.where(real, advantage, 0.0)
    batch["return"] = torch.where(real, return_, value)
    return batch
