"""The driver of vector envs of torch tensors: every step stays on the env's device, without host syncs.

GPU simulators (ManiSkill3, Isaac Lab, Genesis through adapters, Brax and MuJoCo
Playground through ``FromJax``) and :mod:`torch_rollout.envs` present themselves as
gymnasium vector envs whose observations, rewards and flags are torch tensors
on one device. :class:`TorchEnvs` keeps them there: actions go to the env as
tensors on its device, and flags, masks and episode totals are computed with
dense tensor ops. No step reads a value back to the host (no ``.item()``,
``nonzero``, ``bool()`` of a tensor): a missing final observation is looked
for at the batch's end.
"""

from __future__ import annotations

from collections.abc import Mapping
from time import perf_counter
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from torch_rollout.envs._autoreset import FINAL_OBS_KEYS, AutoresetReading
from torch_rollout.envs._infos import TensorInfoRecorder
from torch_rollout.envs._numpy import NonFinite
from torch_rollout.envs._seam import StepRecord
from torch_rollout.envs._spaces import check_action_space, check_obs_space
from torch_rollout.util._devices import is_device, to_device

__all__ = ["OWN_FINAL_KEY", "TorchEnvs", "presents_torch"]

# A SAME_STEP env that keeps no final observation may mark, as a [N] bool tensor in its step infos, the envs
# whose episode the observation they acted on ends (FromRslRl's approximations): those rows bootstrap from
# their own value, reused rather than recomputed, so exactly V(s_t) on any CPU.
OWN_FINAL_KEY = "final_obs_is_obs"


def presents_torch(envs: VectorEnv) -> bool:
    """Whether ``envs`` says its arrays are torch tensors: an attribute ``device`` (a ``torch.device`` or a device
    string such as ``"cpu"``) on it or a wrapper.

    torch_rollout's own envs, gymnasium's ``NumpyToTorch`` wrapper and
    ManiSkill3's ``ManiSkillVectorEnv`` have one.
    """
    env: Any = envs
    while env is not None:
        target = getattr(env, "_target_xp", None)  # gymnasium's array conversions (NumpyToTorch, JaxToTorch, ...)
        if target is not None:
            return "torch" in getattr(target, "__name__", "")
        if is_device(getattr(env, "device", None)):
            return True
        inner = getattr(env, "env", None)
        env = inner if inner is not env else None
    return False


class TorchEnvs:
    """Drives a vector env of torch tensors on their device, in any autoreset mode, without host syncs.

    The records mean what :class:`~torch_rollout.envs._numpy.NumpyEnvs`' do; their
    arrays are tensors on the env's device, and ``final`` holds dense rows (of
    every env; only those of envs that ended are read). Final observations come
    from ``infos["final_obs"]`` (gymnasium) or ``infos["final_observation"]``
    (ManiSkill3), as a dense tensor with its ``_`` mask or in gymnasium's
    per-env layout.

    An env whose metadata names no mode is read as NEXT_STEP until its step infos
    carry final observations, which switch it to SAME_STEP (with a warning); an
    episode that had ended before (which would need a host sync to see at the
    step) is found at the batch's end and refuses the batch. Infos that
    contradict the mode read raise (see
    :class:`~torch_rollout.envs._autoreset.AutoresetReading`).
    """

    acts_at_once = False
    on_device = True  # torch tensors: rows written with tensor ops on the storage device
    steps_into_rows = False

    def __init__(self, envs: VectorEnv, *, check_finite: bool, non_finite: NonFinite, env_offset: int) -> None:
        self.envs = envs
        self.num_envs = self.width = envs.num_envs
        self.reading = AutoresetReading(envs)
        self.autoreset_mode = self.reading.mode
        self.recorder: TensorInfoRecorder | None = None
        # An undeclared env read as NEXT_STEP: the envs that ended so far, and those at its switch to SAME_STEP.
        self.ever_ended: Tensor | None = None
        self.ended_before_switch: Tensor | None = None
        self.obs_space = envs.single_observation_space
        check_obs_space(self.obs_space)
        check_action_space(envs.single_action_space)
        self.check_finite = check_finite
        self.non_finite = non_finite
        self.keep_final = True
        self.call = "envs.reset()"
        self.reset_infos: Any = None
        self.missing_final: Tensor | None = None
        self.env_seconds = 0.0  # inside the env's own calls: the loop's account of env time

    def reset(self, seed: int | None) -> StepRecord:
        N = self.num_envs
        self.call = "envs.reset()"
        began = perf_counter()
        obs, self.reset_infos = self.envs.reset(seed=seed)
        self.env_seconds += perf_counter() - began
        obs = self._check_obs(obs, "envs.reset()")
        leaf = next(iter(obs.values(True, True))) if isinstance(obs, TensorDictBase) else obs
        self.device = env = leaf.device
        if self.check_finite:
            self._check_finite(obs, "envs.reset()")
        self.prev_done = torch.zeros(N, dtype=torch.bool, device=env)  # NEXT_STEP: these envs reset next step
        self.ep_return = torch.zeros(N, dtype=torch.float32, device=env)
        self.ep_length = torch.zeros(N, dtype=torch.int64, device=env)
        space = self.envs.single_action_space
        self.bounds = None
        if isinstance(space, spaces.Box):  # the env receives actions clipped to its bounds, as on the host
            low = torch.tensor(np.broadcast_to(space.low, space.shape), device=env)
            high = torch.tensor(np.broadcast_to(space.high, space.shape), device=env)
            self.bounds = (low, high)
        self.action_dtype = torch.from_numpy(np.empty(0, dtype=space.dtype)).dtype
        self.missing_final = None
        return StepRecord(obs=obs)

    def send(self, action: Tensor, ids: np.ndarray | None) -> None:
        action = to_device(action, self.device)  # blocks when the env is on the CPU: it reads the actions at once
        if self.bounds is not None:
            action = torch.clamp(action, *self.bounds)
        self.action = action if action.dtype is self.action_dtype else action.to(self.action_dtype)

    def recv(self) -> StepRecord:
        self.call = "envs.step()"
        began = perf_counter()
        next_obs, reward, terminated, truncated, info = self.envs.step(self.action)
        self.env_seconds += perf_counter() - began
        next_obs = self._check_obs(next_obs, "envs.step()")
        reward = self._step_tensor(reward, "reward", torch.float32)
        terminated = self._step_tensor(terminated, "terminated", torch.bool)
        truncated = self._step_tensor(truncated, "truncated", torch.bool)
        if self.check_finite:
            self._check_finite(next_obs, "envs.step()")
            self._check_finite(reward, "envs.step()", name="reward")
        done = terminated | truncated
        self._read_autoreset(info, done)
        mode = self.autoreset_mode
        mask = None
        if mode == AutoresetMode.NEXT_STEP:
            # This step reset the envs that ended last step: not a real transition.
            mask = ~self.prev_done
            self.prev_done = done
            ep_length = self.ep_length + mask
            is_init = ~mask
        else:
            ep_length = self.ep_length + 1
            is_init = done
        ep_return = self.ep_return + reward
        self.ep_return = ep_return.masked_fill(done, 0.0)
        self.ep_length = ep_length.masked_fill(done, 0)
        next_obs, final, own = self._finals(mode, next_obs, info, done)
        return StepRecord(
            obs=next_obs,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            done=done,
            mask=mask,
            episode_return=ep_return,
            episode_length=ep_length,
            is_init=is_init,
            final=final,
            own_final=own,
            info=info,
        )

    def _finals(self, mode: AutoresetMode, next_obs: Any, info: dict, done: Tensor) -> tuple[Any, Any, Any]:
        """``(next_obs, final, own)`` of a step: the observations to act on next, the final ones of the episodes
        that ended (where they are kept) and the envs whose final observation is the one they acted on."""
        if mode == AutoresetMode.NEXT_STEP:
            return next_obs, None, None
        final = own = None
        if mode == AutoresetMode.SAME_STEP:
            own = self._own_final(info, done)
            ended = done if own is None else done & ~own
            if self.keep_final or self.check_finite:
                final = self._final_obs(next_obs, info, ended)
                if self.check_finite and final is not None:
                    self._check_finite(final, "envs.step() in its final observations", where=ended)
        else:
            final = next_obs  # DISABLED: what the step returned, before the reset
            self.call = "envs.reset(options={'reset_mask': ...})"
            began = perf_counter()
            next_obs, _ = self.envs.reset(options={"reset_mask": done})
            self.env_seconds += perf_counter() - began
            next_obs = self._check_obs(next_obs, "envs.reset(options={'reset_mask': ...})")
        if not self.keep_final:
            final = own = None
        return next_obs, final, own

    def info_recorder(self, specs: Mapping[str, Any], env_offset: int) -> TensorInfoRecorder:
        """Records the named infos of each step as tensors on the storage device."""
        self.recorder = TensorInfoRecorder(specs, num_envs=self.num_envs, autoreset_mode=self.autoreset_mode)
        return self.recorder

    def check_seed(self, seed: int | None) -> None:
        pass

    def end_batch(self) -> None:
        before, self.ended_before_switch = self.ended_before_switch, None
        if before is not None and bool(before.any()):  # once: at the batch an undeclared env switched in
            raise self.reading.ended_before()
        missing, self.missing_final = self.missing_final, None
        if missing is not None and bool(missing.any()):  # once per batch
            raise KeyError(
                "Collector: the env runs in SAME_STEP autoreset mode but its step infos had no final observation "
                f"({' or '.join(map(repr, FINAL_OBS_KEYS))}) at a step where an episode ended; a wrapper must "
                "keep them"
            )

    def _read_autoreset(self, info: Mapping[str, Any], done: Tensor) -> None:
        """Checks the step's infos against the mode read (their keys only: no host sync)."""
        if self.reading.read(info):  # an undeclared env, switched to SAME_STEP
            self.autoreset_mode = self.reading.mode
            if self.recorder is not None:
                self.recorder.same_step = True
            # Rows read as NEXT_STEP are right only if no episode ended in them: checked at the batch's end.
            self.ended_before_switch, self.ever_ended = self.ever_ended, None
        elif self.reading.undecided:
            self.ever_ended = done if self.ever_ended is None else self.ever_ended | done

    # -- what the env returns ------------------------------------------------------------------

    def _check_obs(self, obs: Any, call: str) -> Tensor | TensorDictBase:
        """The env's observations as a tensor (a TensorDict for Dict spaces), checked by type and shape (no values)."""
        space = self.obs_space
        if isinstance(space, spaces.Dict):
            if not isinstance(obs, Mapping):
                raise TypeError(
                    f"Collector: {call} returned {type(obs).__name__} observations, expected a dict of torch "
                    f"tensors for the Dict space {space!r}"
                )
            items = {key: self._check_leaf(obs[key], sub, f"{call} observation {key!r}") for key, sub in space.items()}
            return TensorDict(items, batch_size=[self.num_envs])
        return self._check_leaf(obs, space, f"{call} observation")

    def _check_leaf(self, value: Any, space: spaces.Space, what: str) -> Tensor:
        if not isinstance(value, Tensor):
            raise TypeError(
                f"Collector: {what} is a {type(value).__name__}, expected a torch.Tensor (the env presents torch "
                "tensors: it has an attribute `device` naming a torch device)"
            )
        shape = (self.num_envs, *(space.shape or ()))
        if tuple(value.shape) != shape:
            raise ValueError(f"Collector: {what} has shape {tuple(value.shape)}, expected {shape} of {space!r}")
        return value

    def _step_tensor(self, value: Any, what: str, dtype: torch.dtype) -> Tensor:
        if not isinstance(value, Tensor) or tuple(value.shape) != (self.num_envs,):
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"Collector: envs.step() returned {what} {got}, expected a torch.Tensor of shape ({self.num_envs},)"
            )
        return value if value.dtype is dtype else value.to(dtype)  # a no-op .to() costs a microsecond a step

    def _own_final(self, info: Mapping[str, Any], done: Tensor) -> Tensor | None:
        """The envs of ``done`` whose final observation is the one they acted on (``infos[OWN_FINAL_KEY]``)."""
        own = info.get(OWN_FINAL_KEY)
        if own is None:
            return None
        return self._step_tensor(own, f"infos[{OWN_FINAL_KEY!r}]", torch.bool) & done

    def _final_obs(self, next_obs: Any, info: Mapping[str, Any], done: Tensor) -> Any:
        """The observations that ended the episodes of ``done`` (SAME_STEP): from infos, dense over all envs.

        None where the infos hold none, which is right only if no env of ``done`` ended (checked at the batch's end).
        """
        for key in FINAL_OBS_KEYS:
            final = info.get(key)
            if final is None:
                continue
            if isinstance(final, (Tensor, Mapping)):  # dense: rows of envs that did not end are never read
                return self._check_obs(final, f"envs.step() infos[{key!r}]")
            # gymnasium's layout: one entry per env, None where it did not end (read on the host)
            present = np.asarray(info.get("_" + key, [entry is not None for entry in final]))
            rows = [final[i] if present[i] else _row(next_obs, i) for i in range(self.num_envs)]
            stacked = (
                torch.stack(rows)
                if isinstance(rows[0], Tensor)
                else {k: torch.stack([row[k] for row in rows]) for k in rows[0]}
            )
            return self._check_obs(stacked, f"envs.step() infos[{key!r}]")
        self.missing_final = done if self.missing_final is None else self.missing_final | done
        return None

    def _check_finite(self, value: Any, call: str, *, name: str = "observation", where: Tensor | None = None) -> None:
        """``check_finite=True``: raises naming the first NaN or inf (a host sync: the price of the check)."""
        leaves = value.items(True, True) if isinstance(value, TensorDictBase) else [(None, value)]
        for key, leaf in leaves:
            if not leaf.is_floating_point():
                continue
            bad = ~torch.isfinite(leaf.reshape(self.num_envs, -1)).all(1)
            if where is not None:
                bad &= where
            if bool(bad.any()):
                env = int(bad.nonzero()[0])
                row = leaf[env]
                what = name if key is None else f"{name} {key!r}"
                self.non_finite(what, env, row.tolist() if row.dim() else row.item(), call)


def _row(obs: Any, i: int) -> Any:
    return obs[i] if isinstance(obs, Tensor) else {key: obs[key][i] for key in obs.keys()}
