"""The collection loop for vector envs whose arrays are torch tensors: every step stays on the device.

GPU simulators (ManiSkill3, Isaac Lab, Genesis through adapters, Brax and MuJoCo
Playground through DLPack) and :mod:`torch_rollout.envs` present themselves as
gymnasium vector envs whose observations, rewards and flags are torch tensors
on one device. This loop keeps them there: actions go to the env as tensors on
its device, and rows, masks, episode totals and recurrent state are written into
``[T, N]`` storage preallocated on the storage device with dense tensor ops. No
step reads a value back to the host (no ``.item()``, ``nonzero``, ``bool()`` of
a tensor): what needs a look at the values (the bootstrap values of final
observations, which envs ended) waits for the batch's end, where one
``nonzero`` gathers the rows that ended.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from torch_rollout._loop import Forward, PolicyCall, RolloutLoop, Stopped, empty_rows
from torch_rollout._spaces import empty_obs
from torch_rollout._spec import LoopSpec

__all__ = ["TorchRolloutLoop", "presents_torch"]

# Where SAME_STEP envs put the observation that ended an episode: gymnasium's name, then ManiSkill3's.
_FINAL_OBS_KEYS = ("final_obs", "final_observation")


def presents_torch(envs: VectorEnv) -> bool:
    """Whether ``envs`` says its arrays are torch tensors: a ``torch.device`` attribute ``device`` on it or a wrapper.

    torch_rollout's own envs, gymnasium's ``NumpyToTorch`` wrapper and
    ManiSkill3's ``ManiSkillVectorEnv`` have one.
    """
    env: Any = envs
    while env is not None:
        target = getattr(env, "_target_xp", None)  # gymnasium's array conversions (NumpyToTorch, JaxToTorch, ...)
        if target is not None:
            return "torch" in getattr(target, "__name__", "")
        if isinstance(getattr(env, "device", None), torch.device):
            return True
        inner = getattr(env, "env", None)
        env = inner if inner is not env else None
    return False


class TorchRolloutLoop(RolloutLoop):
    """Collects ``[num_steps, num_envs]`` batches of a vector env of torch tensors, on the device, without host syncs.

    The batches hold what :class:`~torch_rollout._loop.RolloutLoop`'s do, row for
    row (the same transitions, masks, totals and bootstrap values). The env's
    tensors may live on any device: the policy gets observations on ``device``
    (a copy only when the two differ), the env gets actions on its own device.
    Bootstrap values of final observations (SAME_STEP and DISABLED modes) are
    computed at the batch's end, in calls of at most ``num_envs`` rows, with the
    weights acting then.
    """

    def __init__(self, envs: VectorEnv, forward: Forward, spec: LoopSpec, **placement: Any) -> None:
        super().__init__(envs, forward, spec, **placement)  # device, storage_device, seed, stop, env_offset
        self.on_host = False  # no NumPy views: every row is written with tensor ops
        self.infos = None if spec.info_keys is None else TensorInfos(spec.info_keys, self.num_envs, self.autoreset_mode)
        self.missing_final: Tensor | None = None

    # -- the env's side ------------------------------------------------------------------------

    def reset(self) -> None:
        N = self.num_envs
        self.call = "envs.reset()"
        obs, self.reset_infos = self.envs.reset(seed=self.seed)
        self.obs = self._check_obs(obs, "envs.reset()")
        leaf = next(iter(self.obs.values(True, True))) if isinstance(self.obs, TensorDictBase) else self.obs
        self.env_device = env = leaf.device
        if self.check_finite:
            self._check_finite_tensor(self.obs, "envs.reset()", None)
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
        if self.initial_state is not None:
            self.state = self.initial_state.clone()
            self.is_init = torch.ones(N, dtype=torch.bool, device=self.device)

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
                "tensors: it has a torch.device attribute `device`)"
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
        return value.to(dtype)

    def _env_action(self, action: Tensor) -> Tensor:
        action = action.to(self.env_device, non_blocking=True)
        if self.bounds is not None:
            action = torch.clamp(action, *self.bounds)
        return action.to(self.action_dtype)

    def _final_obs(self, next_obs: Any, info: Mapping[str, Any], done: Tensor) -> Any:
        """The observations that ended the episodes of ``done`` (SAME_STEP): from infos, dense over all envs."""
        for key in _FINAL_OBS_KEYS:
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
        # No final observation this step: right only if no env ended, which is checked at the batch's end.
        self.missing_final = done if self.missing_final is None else self.missing_final | done
        return next_obs

    # -- one batch -----------------------------------------------------------------------------

    def collect(self, out: TensorDict | None = None) -> TensorDict:
        T, N = self.num_steps, self.num_envs
        envs, mode = self.envs, self.autoreset_mode
        if self.reset_pending:
            self.reset_pending = False
            self.reset()
        store = self.storage_device
        if out is None:
            obs_store = empty_obs(self.obs_space, (T, N), device=store)
            rows = {
                "reward": torch.empty((T, N), dtype=torch.float32, device=store),
                "terminated": torch.empty((T, N), dtype=torch.bool, device=store),
                "truncated": torch.empty((T, N), dtype=torch.bool, device=store),
                "mask": torch.empty((T, N), dtype=torch.bool, device=store),
                "episode_return": torch.empty((T, N), dtype=torch.float32, device=store),
                "episode_length": torch.empty((T, N), dtype=torch.int64, device=store),
            }
            if self.initial_state is not None:
                rows["is_init"] = torch.empty((T, N), dtype=torch.bool, device=store)
            outputs: dict[str, Tensor] | None = None
            states = None
        else:
            obs_store = out[self.obs_key]
            rows = {key: out[key] for key in _ROW_KEYS + (("is_init",) if self.initial_state is not None else ())}
            outputs = {key: out[key] for key in self.output_keys}
            states = None if self.initial_state is None else out.select(*self.state_keys)
        self.batches += 1
        views = {key: value.unbind(0) for key, value in rows.items()}
        obs_rows = _unbind(obs_store)
        output_rows = None if outputs is None else {key: _unbind(value) for key, value in outputs.items()}
        if mode == AutoresetMode.NEXT_STEP:
            mask_rows = views["mask"]
        else:
            rows["mask"].fill_(True)
        # SAME_STEP and DISABLED: the observations that ended episodes, valued at the batch's end.
        info_rows = None if self.infos is None or out is None else out["info"]
        wants_final = (self.has_value is not False or self.next_obs_key is not None) and mode != AutoresetMode.NEXT_STEP
        final_store = final_mask = final_states = None
        versions: list[int] = []
        self.missing_final = None

        for t in range(T):
            if self.stop():
                raise Stopped
            _write_row(obs_rows, obs_store, t, self.obs)
            # The policy sees the stored row, in its storage dtype (float64 as float32), as on the NumPy path.
            obs_in = obs_store[t] if obs_rows is None else obs_rows[t]
            if store != self.device:
                obs_in = obs_in.to(self.device, non_blocking=True)
            if self.initial_state is None:
                raw, version = self._forward(PolicyCall(obs_in))
            else:
                if states is None:
                    states = empty_rows(self.state, T, store)
                states[t] = self.state
                views["is_init"][t].copy_(self.is_init, non_blocking=True)
                raw, version = self._forward(PolicyCall(obs_in, self.state, self.is_init))
                raw, next_state = self._split_state(raw, N)
            out_t = self._check_outputs(raw, N)
            if outputs is None:
                outputs = {key: empty_rows(value, T, store) for key, value in out_t.items()}
                output_rows = {key: _unbind(value) for key, value in outputs.items()}
            for key, value in out_t.items():
                _write_row(output_rows[key], outputs[key], t, value)
            versions.append(version)
            if self.check_finite:
                self._check_finite_tensor(out_t["action"], "the policy", t, name="action")

            self.call = "envs.step()"
            next_obs, r, term, trunc, info = envs.step(self._env_action(out_t["action"]))
            next_obs = self._check_obs(next_obs, "envs.step()")
            r = self._step_tensor(r, "reward", torch.float32)
            term = self._step_tensor(term, "terminated", torch.bool)
            trunc = self._step_tensor(trunc, "truncated", torch.bool)
            if self.check_finite:
                self._check_finite_tensor(next_obs, "envs.step()", t)
                self._check_finite_tensor(r, "envs.step()", t, name="reward")
            done = term | trunc
            views["reward"][t].copy_(r, non_blocking=True)
            views["terminated"][t].copy_(term, non_blocking=True)
            views["truncated"][t].copy_(trunc, non_blocking=True)
            if mode == AutoresetMode.NEXT_STEP:
                # This step reset the envs that ended last step: not a real transition.
                real = ~self.prev_done
                mask_rows[t].copy_(real, non_blocking=True)
                self.prev_done = done
                self.ep_length += real
                starts = ~real
            else:
                self.ep_length += 1
                starts = done
            if self.infos is not None:
                if info_rows is None:
                    info_rows = self.infos.empty_rows(info, T, store)
                self.infos.record(info_rows, t, info, done, real if mode == AutoresetMode.NEXT_STEP else None)
            self.ep_return += r
            views["episode_return"][t].copy_(self.ep_return, non_blocking=True)
            views["episode_length"][t].copy_(self.ep_length, non_blocking=True)
            self.ep_return.masked_fill_(done, 0.0)
            self.ep_length.masked_fill_(done, 0)
            if mode != AutoresetMode.NEXT_STEP:
                final = self._final_obs(next_obs, info, done) if mode == AutoresetMode.SAME_STEP else next_obs
                if self.check_finite and mode == AutoresetMode.SAME_STEP:
                    self._check_finite_tensor(final, "envs.step() in its final observations", t, where=done)
                if wants_final:
                    if final_store is None:
                        final_store = empty_obs(self.obs_space, (T, N), device=self.device)
                        final_mask = torch.zeros((T, N), dtype=torch.bool, device=self.device)
                    _write_row(None, final_store, t, final.to(self.device, non_blocking=True))
                    final_mask[t].copy_(done, non_blocking=True)
                    if self.initial_state is not None:
                        if final_states is None:
                            final_states = empty_rows(next_state, T, self.device)
                        final_states[t] = next_state  # the state after the episode's last step
                if mode == AutoresetMode.DISABLED:
                    self.call = "envs.reset(options={'reset_mask': ...})"
                    next_obs, _ = envs.reset(options={"reset_mask": done})
                    next_obs = self._check_obs(next_obs, "envs.reset(options={'reset_mask': ...})")
            self.obs = next_obs
            if self.initial_state is not None:
                starts = starts.to(self.device, non_blocking=True)
                self.state = _reset_state(self.initial_state, next_state, starts)
                self.is_init = starts

        if self.missing_final is not None and bool(self.missing_final.any()):  # once per batch
            raise KeyError(
                "Collector: the env runs in SAME_STEP autoreset mode but its step infos had no final observation "
                f"({' or '.join(map(repr, _FINAL_OBS_KEYS))}) at a step where an episode ended; a wrapper must "
                "keep them"
            )
        policy_version = torch.tensor(versions, dtype=torch.int64).unsqueeze(1).repeat(1, N)
        next_obs = None
        if self.next_obs_key is not None:
            next_obs = empty_obs(self.obs_space, (T, N), device=store) if out is None else out[self.next_obs_key]
            self._write_next_obs_on_device(next_obs, obs_store, final_store, final_mask)
        if out is None:
            batch = {self.obs_key: obs_store, **outputs, **rows, "policy_version": policy_version.to(store)}
            if next_obs is not None:
                batch[self.next_obs_key] = next_obs
            if info_rows is not None:
                batch["info"] = info_rows
            if self.has_value:
                batch["next_value"] = torch.empty_like(outputs[self.value_key])
            out = TensorDict(batch, batch_size=[T, N], device=store)
            if states is not None:
                out.update(states)
        else:
            out["policy_version"].copy_(policy_version)
        if self.has_value:
            self._write_next_value_on_device(out, final_store, final_mask, final_states)
        return out

    def _write_next_obs_on_device(self, next_obs: Any, obs: Any, final: Any, final_mask: Tensor | None) -> None:
        """Each row's true next observation: the next row's, the final observation where an episode ended."""
        next_obs[:-1] = obs[1:]
        next_obs[-1] = self.obs.to(next_obs.device, non_blocking=True)
        if final_mask is not None:  # SAME_STEP and DISABLED: the next row starts after a reset
            mask = final_mask.to(next_obs.device, non_blocking=True)
            next_obs.copy_(_where_rows(mask, final.to(next_obs.device, non_blocking=True), next_obs))

    def _write_next_value_on_device(
        self,
        out: TensorDict,
        final_store: Any,
        final_mask: Tensor | None,
        final_states: TensorDictBase | None,
    ) -> None:
        # The last row bootstraps from the observation the next batch starts with.
        last_obs = empty_obs(self.obs_space, (self.num_envs,), device=self.device)  # in the storage dtype
        last_obs.copy_(self.obs, non_blocking=True)
        if self.initial_state is None:
            call = PolicyCall(last_obs, value_only=True)
        else:  # the state the next batch starts with; it is not advanced
            call = PolicyCall(last_obs, self.state, self.is_init, value_only=True)
        value, next_value = out[self.value_key], out["next_value"]
        next_value[:-1] = value[1:]
        next_value[-1] = self._value(call, self.num_envs).to(next_value.device)
        if final_mask is None:
            return
        t_index, env_index = final_mask.nonzero(as_tuple=True)  # the one host sync of a batch
        N = self.num_envs
        not_init = torch.zeros(N, dtype=torch.bool, device=self.device)
        for start in range(0, len(t_index), N):  # bootstrap calls of at most num_envs rows
            ts, envs = t_index[start : start + N], env_index[start : start + N]
            n = len(ts)
            obs = final_store[ts, envs]
            if self.initial_state is None:
                call = PolicyCall(obs, value_only=True)
            else:
                call = PolicyCall(obs, final_states[ts, envs], not_init[:n], value_only=True)
            target = (ts.to(next_value.device), envs.to(next_value.device))
            next_value[target] = self._value(call, n).to(next_value.device)

    def _check_finite_tensor(
        self, value: Any, call: str, t: int | None, *, name: str = "observation", where: Tensor | None = None
    ) -> None:
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
                self._raise_non_finite(what, env, row.tolist() if row.dim() else row.item(), call, t)


class TensorInfos:
    """The named infos of each step as tensors ``[T, N, ...]`` with a presence mask ``_key`` per key, on the device.

    Each kept key's value must be a tensor with a leading ``num_envs`` dimension
    (or a dict of such, stored as a nested TensorDict); its structure (shapes,
    dtypes, float64 stored as float32) is fixed by the first step's infos. Which
    infos belong to a row follows the NumPy path: in SAME_STEP mode an env that
    ended takes the key from ``infos["final_info"]`` where that holds it (with
    ``infos["_final_info"]`` as the mask of the envs it covers); in NEXT_STEP mode
    the reset rows' infos are masked out. Presence is ``infos["_" + key]`` where
    the env gives one, else every env. Absent values are stored as 0 (or False).
    """

    def __init__(self, specs: Mapping[str, Any], num_envs: int, autoreset_mode: AutoresetMode) -> None:
        if any(example is not None for example in specs.values()):
            raise ValueError(
                "Collector: info_keys examples are for NumPy envs; a vector env of torch tensors gives its infos' "
                "structure at the first step: name the keys only, e.g. BatchKeys(info_keys=('success',))"
            )
        self.keys = list(specs)
        self.num_envs = num_envs
        self.same_step = autoreset_mode == AutoresetMode.SAME_STEP

    def _value(self, infos: Mapping[str, Any], key: str) -> Tensor | TensorDictBase | None:
        value = infos.get(key)
        if value is None:
            return None
        if isinstance(value, Mapping):
            value = TensorDict(dict(value), batch_size=[self.num_envs])
        if not isinstance(value, (Tensor, TensorDictBase)) or value.shape[:1] != (self.num_envs,):
            got = tuple(value.shape) if isinstance(value, (Tensor, TensorDictBase)) else type(value).__name__
            raise ValueError(
                f"Collector: info {key!r} of a vector env of torch tensors must be a tensor (or a dict of tensors) "
                f"with a leading size of num_envs={self.num_envs}, got {got}"
            )
        return value

    def empty_rows(self, infos: Mapping[str, Any], T: int, device: torch.device) -> TensorDict:
        """Zeroed ``[T, N]`` storage shaped like the first step's infos."""
        final = infos.get("final_info") or {}
        rows = {}
        for key in self.keys:
            value = self._value(infos, key)
            if value is None:
                value = self._value(final, key)
            if value is None:
                raise ValueError(
                    f"Collector: info_keys names {key!r}, but the first step's infos have no such key (they have "
                    f"{sorted(map(str, infos))}); a vector env of torch tensors gives every kept key at every step"
                )
            rows[key] = _zeros_like_rows(value, T, device)
            rows["_" + key] = torch.zeros((T, self.num_envs), dtype=torch.bool, device=device)
        return TensorDict(rows, batch_size=[T, self.num_envs], device=device)

    def record(self, rows: TensorDict, t: int, infos: Mapping[str, Any], done: Tensor, real: Tensor | None) -> None:
        """Writes row ``t``: each key's value where present, 0 elsewhere, and its presence mask."""
        final = infos.get("final_info") or {}
        final_mask = infos.get("_final_info")
        for key in self.keys:
            value = self._value(infos, key)
            present = infos.get("_" + key)
            present = torch.ones_like(done) if present is None else present.to(done.device, torch.bool)
            if value is None:
                value, present = rows[key][t], torch.zeros_like(done)
            if self.same_step:
                ended = self._value(final, key)
                if ended is not None:
                    covered = done if final_mask is None else done & final_mask.to(done.device, torch.bool)
                    value = _where(covered, ended, value)
                    present = present | covered
            if real is not None:
                present = present & real
            present = present.to(rows.device)
            rows[key][t] = _where(present, value.to(rows.device), 0)
            rows["_" + key][t] = present


def _zeros_like_rows(value: Tensor | TensorDictBase, T: int, device: torch.device) -> Tensor | TensorDictBase:
    if isinstance(value, TensorDictBase):
        return TensorDict(
            {key: _zeros_like_rows(value[key], T, device) for key in value.keys()},
            batch_size=[T, *value.batch_size],
            device=device,
        )
    dtype = torch.float32 if value.dtype == torch.float64 else value.dtype
    return torch.zeros((T, *value.shape), dtype=dtype, device=device)


def _where_rows(mask: Tensor, value: Any, other: Any) -> Any:
    """``torch.where`` with a ``[T, N]`` mask over ``[T, N, ...]`` tensors or every leaf of TensorDicts."""
    if isinstance(value, TensorDictBase):
        return TensorDict(
            {key: _where_rows(mask, value[key], other[key]) for key in value.keys()}, batch_size=value.batch_size
        )
    return torch.where(mask.view(*mask.shape, *(1,) * (value.dim() - 2)), value, other)


def _where(mask: Tensor, value: Any, other: Any) -> Any:
    """``torch.where`` over the rows of a tensor or of every leaf of a TensorDict (``mask``: ``[N]``)."""
    if isinstance(value, TensorDictBase):
        other_leaf = (lambda key: other[key]) if isinstance(other, TensorDictBase) else (lambda key: other)
        return TensorDict(
            {key: _where(mask, value[key], other_leaf(key)) for key in value.keys()}, batch_size=value.batch_size
        )
    return torch.where(mask.view(-1, *(1,) * (value.dim() - 1)), value, other)


_ROW_KEYS = ("reward", "terminated", "truncated", "mask", "episode_return", "episode_length")


def _unbind(value: Tensor | TensorDictBase) -> tuple[Tensor, ...] | None:
    """The rows of a ``[T, ...]`` tensor as views, made once per batch; None for a TensorDict (indexed instead)."""
    return value.unbind(0) if isinstance(value, Tensor) else None


def _write_row(rows: tuple[Tensor, ...] | None, store: Any, t: int, value: Any) -> None:
    if rows is not None:
        rows[t].copy_(value, non_blocking=True)
    else:
        store[t] = value


def _row(obs: Any, i: int) -> Any:
    return obs[i] if isinstance(obs, Tensor) else {key: obs[key][i] for key in obs.keys()}


def _reset_state(initial: TensorDictBase, carried: TensorDictBase, starts: Tensor) -> TensorDictBase:
    """The state of the next step: ``carried``, with the initial state for the envs that start an episode (dense)."""

    def reset(first: Tensor, now: Tensor) -> Tensor:
        return torch.where(starts.view(-1, *(1,) * (now.dim() - 1)), first, now)

    return initial.apply(reset, carried)
