"""The ``[T, N]`` rows of one batch while the loop fills them, in two kinds of storage.

:class:`HostRows` takes step records of NumPy arrays (the host drivers) and writes them through NumPy views,
a whole row at a time (``index``: the row ``t``) or env by env (``index``: flat positions ``t * N + j``, for
envs that come back at their own pace). :class:`DeviceRows` takes records of torch tensors and writes whole
rows with tensor ops on the storage device, reading nothing back to the host. Both keep the final observations
of the episodes that ended (and a recurrent policy's state after their last step) until the batch's end, where
the loop values them (``_recycle.RowRing`` keeps the rows of batches delivered on the CPU, to be written again
once the trainer has let go of them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import torch
from gymnasium import spaces
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from torch_rollout.envs._spaces import Obs, ObsBuffer, empty_obs, obs_to_tensor, space_nbytes
from torch_rollout.util._devices import copy_into, to_device

if TYPE_CHECKING:
    from torch_rollout.envs._seam import StepRecord
    from torch_rollout.loop._acting import OutputLayout

__all__ = ["LOOP_KEYS", "DeviceRows", "HostRows", "RowLayout", "empty_rows", "select"]

# The rows the loop writes itself, with their dtypes (outputs, observations and infos come on top).
LOOP_KEYS = {
    "reward": np.float32,
    "terminated": np.bool_,
    "truncated": np.bool_,
    "mask": np.bool_,
    "episode_return": np.float32,
    "episode_length": np.int64,
    "policy_version": np.int64,
}


def empty_rows(value: Tensor | TensorDictBase, T: int, device: torch.device) -> Tensor | TensorDictBase:
    """Uninitialised storage for ``T`` rows shaped like one step's policy output ``value``."""
    if isinstance(value, Tensor):
        return torch.empty((T, *value.shape), dtype=value.dtype, device=device)
    return value.unsqueeze(0).expand(T, *value.batch_size).clone().to(device)


def _unbind(value: Tensor | TensorDictBase) -> tuple[Tensor, ...] | None:
    """The rows of a ``[T, ...]`` tensor as views, made once per batch; None for a TensorDict (indexed instead)."""
    return value.unbind(0) if isinstance(value, Tensor) else None


def _widen(value: Tensor | TensorDictBase, n: int) -> Tensor | TensorDictBase:
    """``value``'s first row expanded to ``n`` rows: the shape of one step's output for every env."""
    if isinstance(value, Tensor):
        return value[:1].expand(n, *value.shape[1:])
    return value[:1].expand(n)


def select(obs: Any, sel: np.ndarray | None) -> Any:
    """The rows ``sel`` of a batch of env observations or results (array or dict of arrays); all where None."""
    if sel is None:
        return obs
    if isinstance(obs, dict):
        return {key: select(value, sel) for key, value in obs.items()}
    return np.asarray(obs)[sel]


@dataclass(frozen=True, kw_only=True)
class RowLayout:
    """What every batch's rows of one loop are made of: set when the loop is built."""

    num_steps: int  # T
    num_envs: int  # N
    device: torch.device  # the policy's: where observations go to be acted on, and final observations wait
    storage_device: torch.device  # where the batch is written
    obs_key: str
    obs_space: spaces.Space
    next_obs_key: str | None
    loop_keys: Mapping[str, type]  # the rows the loop fills itself, with their NumPy dtypes
    state_keys: tuple[Any, ...] | None  # a recurrent policy's state entries, or None

    def min_row_bytes(self, action_space: spaces.Space, recurrent: Any) -> int:
        """Bytes that one row of a batch (one env, one step) takes at least, before the policy has run.

        The observation (float64 stored as float32) and with ``next_obs_key`` the next one, the action
        (floats as float32, as policies return them), the loop's own keys and a recurrent state; the
        policy's other outputs (``value``, ``log_prob``, ...), ``next_value`` and infos come on top.
        """
        state = 0 if recurrent is None else recurrent.row_bytes()
        own = sum(np.dtype(dtype).itemsize for dtype in self.loop_keys.values()) + 1  # and done
        obs = space_nbytes(self.obs_space) * (1 if self.next_obs_key is None else 2)
        return obs + space_nbytes(action_space) + own + state


class _Rows:
    """What both kinds share: the policy's outputs, versions and recurrent states, stored as tensors."""

    outputs: dict[str, Tensor | TensorDictBase] | None
    states: TensorDictBase | None
    info: Any

    def __init__(self, layout: RowLayout) -> None:
        self.layout = layout
        self.T, self.N = layout.num_steps, layout.num_envs
        self.store = layout.storage_device
        self.filled = 0  # rows whose step has come back
        self.outputs = None
        self.output_rows: dict[str, tuple[Tensor, ...] | None] = {}
        self.states = None
        self.info = None
        self.assembled: TensorDict | None = None  # the batch of these rows, once made (rows written again keep it)
        self.kept: Any = None  # what a RowRing keeps of these rows
        self.direct: Any = None  # what a sink is offered of these rows (see torch_rollout.loop._direct)
        self.entries: dict[str, Any] = {}  # the batch's entries that the loop's batch end looked up

    def _allocate_outputs(self, out_t: dict[str, Any]) -> dict[str, Tensor | TensorDictBase]:
        outputs = {key: empty_rows(_widen(value, self.N), self.T, self.store) for key, value in out_t.items()}
        self.output_rows = {key: _unbind(value) for key, value in outputs.items()}
        return outputs

    def _put_outputs_row(self, t: int, out_t: dict[str, Any], but: str | None = None) -> None:
        if self.outputs is None:
            self.outputs = self._allocate_outputs(out_t)
        for key, value in out_t.items():
            if key == but:
                continue
            rows = self.output_rows[key]
            if rows is None:
                self.outputs[key][t] = value
            else:
                copy_into(rows[t], value)

    def entry(self, batch: TensorDict, key: str) -> Any:
        """``batch[key]`` of the batch these rows assembled, looked up once (a TensorDict lookup costs more
        than a short batch's tensor ops)."""
        found = self.entries.get(key)
        if found is None:
            found = self.entries[key] = batch[key]
        return found

    def _batch(self, batch: dict[str, Any], outputs: OutputLayout) -> TensorDict:
        """The batch of the entries ``batch``, with the states and storage for the bootstrap entries."""
        layout, T, N, store = self.layout, self.T, self.N, self.store
        batch["done"] = torch.empty((T, N), dtype=torch.bool, device=store)  # terminated | truncated
        if outputs.value_key is not None:
            assert self.outputs is not None  # stored from the policy's first call
            batch["next_value"] = torch.empty_like(self.outputs[outputs.value_key])
        if layout.next_obs_key is not None:
            batch[layout.next_obs_key] = empty_obs(layout.obs_space, (T, N), device=store)
        out = TensorDict(batch, batch_size=[T, N], device=store)
        if self.states is not None:
            out.update(self.states)
        self.assembled = out
        return out

    def _put_state(self, index: Any, state: TensorDictBase) -> None:
        if self.states is None:
            self.states = empty_rows(_widen(state, self.N), self.T, self.store)
        self.states[index] = state.to(self.store)


class HostRows(_Rows):
    """Rows written from NumPy: views of the batch's storage on the CPU, host arrays uploaded at the end otherwise.

    ``out``: a batch of an earlier call (a shared-memory slot) written in place; only
    with rows written a whole row at a time. ``outputs``: the policy's outputs (None before its
    first call; known when ``out`` is given). ``infos``: the loop's info recorder, or None.
    ``staging``: the loop's page-locked row of observations for batches on CUDA, or None.
    """

    def __init__(
        self,
        layout: RowLayout,
        out: TensorDict | None,
        *,
        outputs: OutputLayout | None,
        infos: Any,
        staging: ObsBuffer | None,
    ) -> None:
        super().__init__(layout)
        T, N = self.T, self.N
        self.action_rows: np.ndarray | Literal[False] | None = None  # the actions' rows as NumPy, False: not so
        self.out = out
        self.infos = infos
        self.staging = staging
        self.on_host = self.store.type == "cpu"
        keys = layout.loop_keys
        if out is not None:  # a CPU slot: every row is written into it in place
            assert outputs is not None  # known when out is given
            self.obs = ObsBuffer.wrap(layout.obs_space, out[layout.obs_key])
            self.host = {key: out[key].numpy() for key in keys}
            self.outputs = {key: out[key] for key in outputs.keys}
            self.output_rows = {key: _unbind(value) for key, value in self.outputs.items()}
            self.action_rows = _numpy_view(self.outputs["action"])
            if layout.state_keys is not None:
                self.states = out.select(*layout.state_keys)
            if infos is not None:
                self.info = infos.views(out["info"])
        else:
            self.obs = ObsBuffer(layout.obs_space, (T, N), device=self.store)
            self.host = {key: np.empty((T, N), dtype=dtype) for key, dtype in keys.items()}
        self.host["mask"].fill(True)
        self.flat = {key: array.reshape(-1) for key, array in self.host.items()}
        arrays = self.obs.arrays
        self.flat_obs = arrays.reshape(T * N, *arrays.shape[2:]) if isinstance(arrays, np.ndarray) else None
        self.obs_rows = _unbind(self.obs.tensor)
        self.finals: list[tuple[int, np.ndarray, Any, TensorDictBase | None]] = []  # (t, envs, obs, states)

    # -- acting: observations, outputs, versions, states ----------------------------------------

    def put_obs(self, t: int, obs: Any) -> Obs:
        """Stores row ``t``'s observations and returns them for the policy, on its device."""
        device = self.layout.device
        if self.on_host:
            self.obs.write(t, obs)
            row = self.obs.tensor[t] if self.obs_rows is None else self.obs_rows[t]
            return row if device.type == "cpu" else row.to(device)  # a view, or an upload to CUDA
        # Batches on CUDA get observations through a page-locked staging row, reused each step: reading the
        # action back synchronizes with the upload.
        assert self.staging is not None  # given for batches on CUDA
        self.staging.write(slice(None), obs)
        obs_t = to_device(self.staging.tensor, device)
        self.obs.tensor[t] = obs_t
        return obs_t

    def put_obs_at(self, flat: np.ndarray, obs: Any) -> None:
        """Stores observations at the flat positions ``flat`` (``t * N + j``)."""
        if self.flat_obs is not None:
            self.flat_obs[flat] = obs
        elif self.on_host:  # a Dict space: nested arrays
            self.obs.write((flat // self.N, flat % self.N), obs)
        else:
            rows = torch.from_numpy(flat).to(self.store)
            self.obs.tensor[rows // self.N, rows % self.N] = obs_to_tensor(self.layout.obs_space, obs, self.store)

    def put_acted(
        self, t: int, out_t: dict[str, Any], version: int, state: tuple[TensorDictBase, np.ndarray | Tensor] | None
    ) -> None:
        """Stores the policy's outputs on row ``t``, the weights' version and the state it acted with."""
        self._put_outputs_row(t, out_t)
        self.host["policy_version"][t] = version
        if state is not None:
            self._put_state(t, state[0])
            self.host["is_init"][t] = state[1]

    def put_plain(self, t: int, out_t: dict[str, Any], version: int) -> np.ndarray | None:
        """:meth:`put_acted` of a call without a state, but that where the action's rows are a NumPy view, their row
        ``t`` is returned for the driver to write from the values it reads for the env anyway (a tensor copy costs a
        few times more on a few envs' actions); None where the action's row was written here."""
        if self.outputs is None:
            self.outputs = self._allocate_outputs(out_t)
        self.host["policy_version"][t] = version
        if not isinstance(self.action_rows, np.ndarray):  # False: rows NumPy cannot view
            self._put_outputs_row(t, out_t)
            return None
        self._put_outputs_row(t, out_t, but="action")
        return self.action_rows[t]

    def _allocate_outputs(self, out_t: dict[str, Any]) -> dict[str, Tensor | TensorDictBase]:
        outputs = super()._allocate_outputs(out_t)
        # Made with the storage (not at a later step): a RowRing counts the references to it when first delivered.
        self.action_rows = _numpy_view(outputs["action"]) if self.on_host else False
        return outputs

    def put_acted_at(
        self,
        flat: np.ndarray,
        sel: np.ndarray | None,
        out_t: dict[str, Any],
        version: int,
        state: tuple[TensorDictBase, np.ndarray | Tensor] | None,
    ) -> None:
        """:meth:`put_acted` at flat positions; ``sel``: the rows of ``out_t`` they are (None: all)."""
        if self.outputs is None:
            self.outputs = self._allocate_outputs(out_t)
            self.views = {
                key: value.numpy().reshape(self.T * self.N, *value.shape[2:])
                if isinstance(value, Tensor) and value.device.type == "cpu"
                else None
                for key, value in self.outputs.items()
            }
        where = None
        for key, value in out_t.items():
            view = self.views[key]
            if view is not None:
                view[flat] = value.numpy() if sel is None else value.numpy()[sel]
                continue
            storage = self.outputs[key]
            if where is None:
                rows = torch.from_numpy(flat).to(storage.device)
                where = (rows // self.N, rows % self.N)
            if sel is not None:
                value = value[torch.from_numpy(sel).to(value.device)]
            storage[where] = value.to(storage.device)
        self.flat["policy_version"][flat] = version
        if state is not None:
            rows = torch.from_numpy(flat)
            states, is_init = state
            if sel is not None:
                states, is_init = states[torch.from_numpy(sel).to(states.device)], is_init[sel]
            self._put_state((rows // self.N, rows % self.N), states)
            self.flat["is_init"][flat] = is_init

    # -- results ---------------------------------------------------------------------------------

    def put_results(self, t: int, record: StepRecord) -> None:
        """Stores the results of row ``t``'s step: every env's."""
        _put_result_rows(self.host, t, record)
        self.filled += self.N
        infos = self.infos
        if infos is not None:  # its structure learnt by the loop from the first step
            if self.info is None:
                self.info = infos.empty_rows(self.T)
            infos.record(self.info, t, record.info, record.done, record.mask)

    def put_results_at(self, flat: np.ndarray, record: StepRecord, info: dict | None) -> None:
        """Stores results at flat positions; ``record`` and ``info`` (recorded rows per leaf) hold only theirs."""
        _put_result_rows(self.flat, flat, record)
        self.filled += len(flat)
        if info is None:
            return
        if self.info is None:  # the recorder's rows are a record's envs: these are [T * N, ...]
            T, N = self.T, self.N
            leaves = self.infos.leaves
            self.flat_info = {path: np.empty((T * N, *shape), dtype=dtype) for path, shape, dtype in leaves}
            self.info = {path: array.reshape(T, N, *array.shape[1:]) for path, array in self.flat_info.items()}
        for path, array in info.items():
            self.flat_info[path][flat] = array

    def put_final(self, t: int, record: StepRecord, carried: TensorDictBase | None) -> None:
        """Keeps the final observations of the envs that ended at step ``t`` and their state after it."""
        index, obs = cast("tuple[np.ndarray, Any]", record.final)  # the host drivers' (envs, their rows)
        states = None
        if carried is not None:
            states = carried[torch.from_numpy(index).to(carried.device)]
        self.finals.append((t, index, obs, states))

    def gather_finals(self, device: torch.device) -> tuple[Tensor, Tensor, Obs, TensorDictBase | None] | None:
        """``(rows t, envs, final observations on device, states)`` of this batch's episode ends, or None."""
        if not self.finals:
            return None
        ts = np.concatenate([np.full(len(index), t) for t, index, _, _ in self.finals])
        envs = np.concatenate([index for _, index, _, _ in self.finals])
        space = self.layout.obs_space
        parts = [obs_to_tensor(space, obs, device) for _, _, obs, _ in self.finals]
        obs = torch.cat(parts)
        states = None
        if self.finals[0][3] is not None:  # then every one has its states
            states = torch.cat([states for *_, states in self.finals if states is not None])
        return torch.from_numpy(ts), torch.from_numpy(envs), obs, states

    def writes_next_obs(self) -> bool:
        """Whether :meth:`write_next_obs` can write this batch's next observations: arrays stored on the CPU."""
        return self.on_host and self.flat_obs is not None

    def write_next_obs(self, rows: np.ndarray, last: Any) -> None:
        """Writes each row's next observation into ``rows`` (cast as the rows are): the next row's, ``last`` (the
        env's observations after the last row) after the last row, the final one where an episode ended."""
        obs = self.obs.arrays
        rows[:-1] = obs[1:]
        rows[-1] = last
        for t, index, final, _ in self.finals:
            rows[t, index] = final

    def own_finals(self) -> None:
        """None: host drivers' envs always return a final observation apart (see ``DeviceRows.own_finals``)."""
        return None

    # -- the batch -------------------------------------------------------------------------------

    def first_obs(self) -> Obs:
        """Row 0's observations (of a batch acted ahead): the observation after the previous batch's last row."""
        return self.obs.tensor[0]

    def recycle(self) -> None:
        """Makes these rows (of a batch delivered and let go of) ready to be written again, every row anew."""
        self.filled = 0
        self.host["mask"].fill(True)
        self.finals = []

    def assemble(self, outputs: OutputLayout) -> TensorDict:
        """The batch of these rows on the storage device (``out`` when given); its bootstrap entries are unset."""
        T, N, store = self.T, self.N, self.store
        if self.out is not None:
            return self.out  # written in place
        if self.assembled is not None:
            return self.assembled
        assert self.outputs is not None  # stored from the policy's first call
        batch: dict[str, Any] = {self.layout.obs_key: self.obs.tensor, **self.outputs}
        for key, array in self.host.items():
            batch[key] = to_device(torch.from_numpy(array), store)
        if self.info is not None:
            batch["info"] = self.infos.tensordict(self.info, [T, N], store)
        return self._batch(batch, outputs)


class DeviceRows(_Rows):
    """Rows written with tensor ops on the storage device, a whole row at a time: no value is read back.

    The policy acts on the stored row, in its storage dtype (float64 as float32),
    as on the host. Final observations are kept dense (every env's row, with a
    ``[T, N]`` mask of the envs that ended) on the policy's device.
    """

    def __init__(self, layout: RowLayout, out: TensorDict | None, *, outputs: OutputLayout | None, infos: Any) -> None:
        super().__init__(layout)
        T, N, store = self.T, self.N, self.store
        self.out = out
        self.infos = infos
        keys = list(layout.loop_keys)  # policy_version too: filled a row at a time on the device, never uploaded
        if out is None:
            self.obs = empty_obs(layout.obs_space, (T, N), device=store)
            dtypes = {key: torch.from_numpy(np.empty(0, dtype=layout.loop_keys[key])).dtype for key in keys}
            self.rows = {key: torch.empty((T, N), dtype=dtypes[key], device=store) for key in keys}
        else:
            assert outputs is not None  # known when out is given
            self.obs = out[layout.obs_key]
            self.rows = {key: out[key] for key in keys}
            self.outputs = {key: out[key] for key in outputs.keys}
            self.output_rows = {key: _unbind(value) for key, value in self.outputs.items()}
            if layout.state_keys is not None:
                self.states = out.select(*layout.state_keys)
            if infos is not None:
                self.info = out["info"]
        self.rows["mask"].fill_(True)
        self.views = {key: value.unbind(0) for key, value in self.rows.items()}
        self.obs_rows = _unbind(self.obs)
        self.final_obs: Obs | None = None
        self.final_mask: Tensor | None = None
        self.final_states: TensorDictBase | None = None
        self.ended = False  # an episode ended in this batch: final_mask holds it
        self.own_mask: Tensor | None = None  # [T, N]: episodes whose final observation is the row's own
        self.owned = False  # own_mask was written in this batch

    def put_obs(self, index: int, obs: Any) -> Obs:
        _write_row(self.obs_rows, self.obs, index, obs)
        row = self.obs[index] if self.obs_rows is None else self.obs_rows[index]
        return row if self.store == self.layout.device else to_device(row, self.layout.device)

    def put_acted(
        self, index: int, out_t: dict[str, Any], version: int, state: tuple[TensorDictBase, np.ndarray | Tensor] | None
    ) -> None:
        self._put_outputs_row(index, out_t)
        self.views["policy_version"][index].fill_(version)
        if state is not None:
            self._put_state(index, state[0])
            copy_into(self.views["is_init"][index], state[1])

    def put_results(self, index: int, record: StepRecord) -> None:
        views = self.views
        copy_into(views["reward"][index], record.reward)
        copy_into(views["terminated"][index], record.terminated)
        copy_into(views["truncated"][index], record.truncated)
        copy_into(views["episode_return"][index], record.episode_return)
        copy_into(views["episode_length"][index], record.episode_length)
        if record.mask is not None:
            copy_into(views["mask"][index], record.mask)
        self.filled += self.N
        infos = self.infos
        if infos is not None:
            if self.info is None:
                self.info = infos.empty_rows(self.T, self.store)
            infos.record(self.info, index, record.info, record.done, record.mask)

    def put_final(self, t: int, record: StepRecord, carried: TensorDictBase | None) -> None:
        own = record.own_final
        if own is not None:
            if self.own_mask is None:
                self.own_mask = torch.zeros((self.T, self.N), dtype=torch.bool, device=self.store)
            copy_into(self.own_mask[t], own)
            self.owned = True
        if record.final is None:
            return
        assert record.done is not None  # the record of a step
        device = self.layout.device
        final, done = record.final, record.done if own is None else record.done & ~own
        if self.final_obs is None:
            # Zeroed: a batch valued densely (see dense_finals) calls the policy on rows no episode ended at too.
            self.final_obs = empty_obs(self.layout.obs_space, (self.T, self.N), device=device).zero_()
            self.final_mask = torch.zeros((self.T, self.N), dtype=torch.bool, device=device)
        assert self.final_mask is not None  # allocated with final_obs
        _write_row(None, self.final_obs, t, to_device(final, device))
        copy_into(self.final_mask[t], done)
        self.ended = True
        if carried is not None:
            if self.final_states is None:
                self.final_states = empty_rows(carried, self.T, device).zero_()
            self.final_states[t] = carried  # the state after the episode's last step

    def gather_finals(self, device: torch.device) -> tuple[Tensor, Tensor, Obs, TensorDictBase | None] | None:
        if not self.ended:
            return None
        assert self.final_mask is not None and self.final_obs is not None  # an episode ended: allocated
        ts, envs = self.final_mask.nonzero(as_tuple=True)  # the one host sync of a batch
        states = None if self.final_states is None else self.final_states[ts, envs]
        return ts, envs, self.final_obs[ts, envs], states

    def dense_finals(self) -> tuple[Tensor, Obs, TensorDictBase | None] | None:
        """``(mask [T, N] of the envs that ended, final observations [T, N], states)``, or None: no host sync."""
        if not self.ended:
            return None
        assert self.final_mask is not None and self.final_obs is not None  # an episode ended: allocated
        return self.final_mask, self.final_obs, self.final_states

    def own_finals(self) -> Tensor | None:
        """The ``[T, N]`` mask of the episodes whose final observation is their row's own (on the storage
        device), whose ``next_obs`` and ``next_value`` are the row's ``obs`` and ``value``; or None."""
        return self.own_mask if self.owned else None

    def first_obs(self) -> Obs:
        return self.obs[0]

    def recycle(self) -> None:
        self.filled = 0
        self.rows["mask"].fill_(True)
        if self.ended:
            assert self.final_mask is not None  # an episode ended: allocated
            self.final_mask.zero_()
            self.ended = False
        if self.owned:
            assert self.own_mask is not None  # written: allocated
            self.own_mask.zero_()
            self.owned = False

    def assemble(self, outputs: OutputLayout) -> TensorDict:
        if self.out is not None:
            return self.out
        if self.assembled is not None:
            return self.assembled
        assert self.outputs is not None  # stored from the policy's first call
        batch = {self.layout.obs_key: self.obs, **self.outputs, **self.rows}
        if self.info is not None:
            batch["info"] = self.info
        return self._batch(batch, outputs)


def _numpy_view(rows: Tensor | TensorDictBase) -> np.ndarray | Literal[False]:
    """A NumPy view of a CPU tensor of rows, or False (a TensorDict, a dtype NumPy lacks, such as bfloat16)."""
    try:
        return rows.numpy() if type(rows) is Tensor else False
    except TypeError:
        return False


def _put_result_rows(host: dict[str, np.ndarray], index: int | np.ndarray, record: StepRecord) -> None:
    host["reward"][index] = record.reward
    host["terminated"][index] = record.terminated
    host["truncated"][index] = record.truncated
    host["episode_return"][index] = record.episode_return
    host["episode_length"][index] = record.episode_length
    if record.mask is not None:
        host["mask"][index] = record.mask


def _write_row(rows: tuple[Tensor, ...] | None, store: Any, t: int, value: Any) -> None:
    if rows is not None:
        copy_into(rows[t], value)
    else:
        store[t] = value
