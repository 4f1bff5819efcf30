"""The one collection loop: acts on the envs' observations, steps them through their driver, writes ``[T, n]`` rows.

Every placement (the background thread, worker processes, Ray actors) runs this
loop; a placement only decides where it runs, how the policy's weights reach it
and how its batches travel. The loop knows no kind of env: it talks to one
through a driver (:mod:`torch_rollout.envs._seam`), which turns what the env
returns into step records, and it writes them into rows of the records' kind
(:mod:`torch_rollout.loop._rows`). GAE is not computed here: the consumer runs it on
its device from the ``value`` and ``next_value`` rows (see :func:`torch_rollout.gae.add_advantages`). How
the policy is called and what it must return is :mod:`torch_rollout.loop._acting`'s.

Each env fills its own rows, in order: row ``t`` of env ``j`` holds its
observation, the policy's outputs on it (and the ``policy_version`` that
produced them), and the results of the step those outputs took. Drivers
that step every env at once fill a row at a time; a send/recv pool's
``recv()`` returns the envs that are ready, which fill their rows at their
own pace, and every env that comes back is acted on at once: the forward
on an env's observation after its row ``T - 1`` is its row 0 of the next
batch, carried over (envs much faster than others can run batches ahead;
their rows wait in later batches' storage). The batch is complete when
every env has its ``T`` rows.

Bootstrap values: ``next_value`` of a row is the value of the observation
its step returned. That is the next row's ``value``; for the last row, the
value of the observation the next batch starts with (a row acted ahead, or
a value call); for an episode that ended with a final observation apart
from the next one (SAME_STEP, DISABLED), a value call on it, made at the
batch's end with the weights acting then, in calls of at most ``num_envs``
rows, with a recurrent policy's state after the episode's last step.
"""

from __future__ import annotations

from collections import deque
from time import perf_counter
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from torch_rollout.envs._seam import AutoresetMode, EnvDriver, StepRecord
from torch_rollout.envs._spaces import Obs, ObsBuffer, empty_obs, first_non_finite, obs_to_tensor
from torch_rollout.loop._acting import Acting, Forward, OutputLayout, PolicyCall
from torch_rollout.loop._bootstrap import batch_finals, write_next, write_next_values
from torch_rollout.loop._direct import Sink, host_batch
from torch_rollout.loop._fused import run_steps
from torch_rollout.loop._recurrent import RecurrentState
from torch_rollout.loop._recycle import RowRing
from torch_rollout.loop._rows import LOOP_KEYS, DeviceRows, HostRows, RowLayout, select
from torch_rollout.loop._spec import LoopPlace, LoopSpec
from torch_rollout.loop._stats import Account
from torch_rollout.util._devices import copy_into

__all__ = ["RolloutLoop", "Stopped"]


class Stopped(Exception):
    """Raised inside the loop when its placement asks it to stop."""


class RolloutLoop:
    """Collects ``[num_steps, num_envs]`` batches of one vector env with one policy, through the env's driver.

    A batch is a TensorDict on ``storage_device`` with ``obs`` (named
    ``obs_key``), every policy output, ``reward``, ``terminated``,
    ``truncated``, ``mask``, ``episode_return``, ``episode_length``,
    ``policy_version``, ``info`` with ``info_keys``, ``"next_" + obs_key``
    with ``next_obs_key`` and, when the policy returns ``"value"`` (or
    TorchRL's ``"state_value"``), ``next_value``. ``collect(out)`` writes into
    ``out`` (a batch of an earlier call, e.g. a shared-memory slot) or into new
    tensors when ``out`` is None.

    Args:
        driver: the envs' driver; the loop resets the envs with ``seed`` and then owns their stepping.
        forward: the placement's policy call (it holds the weights lock and knows the version).
        spec: the collector's settings, the same for every loop (rows per batch, obs key, finite
            checks, info keys, a recurrent policy's initial state of all the collector's envs:
            this loop takes the rows of its own envs, from ``place.env_offset``; the next observations' key).
        place: where this loop runs: its device and storage device, its first seed, its envs' global
            offset and the stop its placement polls (:class:`Stopped` when it says so).
    """

    waiting: StepRecord | None  # observations to act on
    buffers: deque[HostRows | DeviceRows]  # this batch's rows, then rows acted ahead

    def __init__(
        self,
        driver: EnvDriver,
        forward: Forward,
        spec: LoopSpec,
        place: LoopPlace,
    ) -> None:
        self.driver = driver
        self.envs = driver.envs
        self.num_steps = spec.num_steps
        self.num_envs = driver.num_envs
        self.device = device = place.device
        self.storage_device = place.storage_device
        self.seed = seed = place.seed
        self.check_finite = spec.check_finite
        self.stop = place.stop
        self.env_offset = env_offset = place.env_offset
        self.obs_key = spec.obs_key
        self.next_obs_key = spec.next_obs_key
        self.obs_space = self.envs.single_observation_space
        self.infos = None if spec.info_keys is None else driver.info_recorder(spec.info_keys, env_offset)
        self.on_device = driver.on_device  # records of torch tensors: rows written with tensor ops
        self.reset_pending = True  # the first collect() resets the envs: no env call before the iteration
        self.batches = 0  # batches started: step numbers in error messages are batches * T + t
        self.row: int | None = None  # the row of the step in flight (every env at once), for error messages
        self.outputs: OutputLayout | None = None  # the policy's outputs, once its first call told them
        self.account = Account()  # where its time goes (see torch_rollout.loop._stats)
        loop_keys = LOOP_KEYS
        initial_state = self.recurrent = None
        if spec.initial_state is not None:
            loop_keys = {**LOOP_KEYS, "is_init": np.bool_}
            initial_state = spec.initial_state[env_offset : env_offset + self.num_envs].to(device).clone()
        self.acting = Acting(
            forward, device=device, obs_key=self.obs_key, next_obs_key=self.next_obs_key, initial_state=initial_state
        )
        if initial_state is not None:
            self.recurrent = RecurrentState(initial_state, device=device, on_device=self.on_device)
        self.layout = RowLayout(
            num_steps=self.num_steps,
            num_envs=self.num_envs,
            device=device,
            storage_device=self.storage_device,
            obs_key=self.obs_key,
            obs_space=self.obs_space,
            next_obs_key=self.next_obs_key,
            loop_keys=loop_keys,
            state_keys=None if initial_state is None else tuple(self.acting.state_keys),
        )
        # Rows written a row at a time (not acted ahead) on the CPU: written again once the trainer lets go of them.
        reusable = spec.batch_slots and self.storage_device.type == "cpu" and not driver.acts_at_once
        self.ring = RowRing(spec.batch_slots) if reusable else None
        self.spare: HostRows | None = None  # rows a sink took, written again by the next batch
        driver.check_seed(seed)

    @property
    def autoreset_mode(self) -> AutoresetMode:
        """The envs' autoreset mode as the driver reads it now: an undeclared env's once its steps have shown it."""
        return self._released_mode if self.driver is None else self.driver.autoreset_mode

    @property
    def call(self) -> str:
        """The env or policy call the loop is in or made last, for a stuck thread's report."""
        return "the policy's forward()" if self.acting.in_policy else self.driver.call

    def min_row_bytes(self) -> int:
        """Bytes that one row of a batch takes at least, before the policy has run (see RowLayout.min_row_bytes)."""
        return self.layout.min_row_bytes(self.envs.single_action_space, self.recurrent)

    def reseed(self, seed: int | None) -> None:
        """Resets the envs with ``seed`` before the next batch (a resumed collector's part of the seed stream)."""
        self.driver.check_seed(seed)
        self.seed = seed
        self.reset_pending = True  # set last: a reset already running reads the seed, this one runs again

    def release(self) -> None:
        """Drops the driver, the envs and the rows acted ahead, once the loop has stopped for good.

        The driver reports NaNs through the loop: without this, the envs would wait in that cycle for the garbage
        collector, which may run in a child process forked meanwhile, where freeing an EnvPool crashes it.
        """
        self._released_mode = self.driver.autoreset_mode
        # None, typed as in use: nothing calls a released loop.
        self.driver = self.envs = self.infos = self.acting = self.ring = cast(Any, None)
        self.buffers = deque()
        self.waiting = None

    def reset(self) -> None:
        N = self.num_envs
        self.row = None
        self.waiting = self.driver.reset(self.seed)
        self.buffers = deque()
        self.first_row = 0  # an env's row index of row 0 of buffers[0]
        self.step = 0  # rows acted on since the reset, when every env steps at once
        self.acted = np.zeros(N, dtype=np.int64)  # rows each env has acted on since the reset, otherwise
        if self.recurrent is not None:
            self.recurrent.reset()
        # Reused each step by host rows stored on CUDA: reading the action back synchronizes with the upload.
        cuda_host = not self.on_device and self.storage_device.type != "cpu"
        self.staging = ObsBuffer(self.obs_space, (N,), pin_memory=True) if cuda_host else None

    # -- one batch -----------------------------------------------------------------------------

    def collect(self, out: TensorDict | None = None, sink: Sink | None = None) -> TensorDict | int:
        """Steps the envs until every env has its ``T`` rows of the oldest batch; returns that batch.

        ``out``: a batch of an earlier call to write this one into (a shared-memory slot). ``sink``: offered the
        batch's rows as host arrays first (see :mod:`torch_rollout.loop._direct`); where it takes them, returns
        the rows it wrote, and the rows are written again by the next batch.
        """
        T, N = self.num_steps, self.num_envs
        began = perf_counter()
        self.account.begin(began)
        if self.reset_pending:
            self.reset_pending = False
            self.reset()
        self.batches += 1
        if not self.buffers:
            # Rows filled a row at a time are written into out itself; rows acted ahead need their own.
            self.buffers.append(self._new_rows(None if self.driver.acts_at_once else out))
        head = self.buffers[0]
        if self.outputs is not None:
            run_steps(self, head)  # the plain steps of the common case, in one function (or none)
        while head.filled < T * N:
            if self.stop():
                raise Stopped
            self._interact()
        self.driver.end_batch()
        self.buffers.popleft()
        self.first_row += T
        written = None if sink is None or (rows := host_batch(self, head)) is None else sink(rows)
        if written is not None:
            self.spare = cast(HostRows, head)  # taken by the sink: nothing outside holds these rows
            batch: TensorDict | int = written
        else:
            batch = self._deliver(head)
            if out is None:
                if self.ring is not None:
                    batch = self.ring.deliver(head, batch)
            elif batch is not out:
                out.copy_(batch)
                batch = out
        # The env's own calls and the policy's, as the driver and the acting side timed them: their work around
        # those calls (checks, records, conversions) is the collector's.
        self.account.end(began, perf_counter(), self.driver.env_seconds, self.acting.seconds, T * N)
        return batch

    def _new_rows(self, out: TensorDict | None) -> HostRows | DeviceRows:
        if out is None and self.spare is not None:
            spare, self.spare = self.spare, None
            spare.recycle()
            return spare
        if out is None and self.ring is not None:
            rows = self.ring.take()
            if rows is not None:
                return rows
        if self.on_device:
            return DeviceRows(self.layout, out, outputs=self.outputs, infos=self.infos)
        return HostRows(self.layout, out, outputs=self.outputs, infos=self.infos, staging=self.staging)

    def _interact(self) -> None:
        """Acts on the observations waiting, then takes the driver's next step record and writes its results.

        A send/recv pool's envs are acted on as soon as they come back, before
        their results are written, so that they step meanwhile.
        """
        if self.waiting is not None:
            record, self.waiting = self.waiting, None
            self._act(record)
        record = self.driver.recv()
        if record.reward is None:  # the first observations of envs just reset
            if self.driver.acts_at_once:
                self._act(record)
            else:
                self.waiting = record
            return
        if record.ids is None:  # every env: the row acted on last
            if self.recurrent is not None:
                self.recurrent.advance(record)
            self.waiting = record
            t = self.step - 1 - self.first_row
            head = self.buffers[0]
            self._learn_infos(record)
            head.put_results(t, record)
            if record.final is not None or record.own_final is not None:
                head.put_final(t, record, None if self.recurrent is None else self.recurrent.carried)
            return
        # The rows these results end: the ones acted on last, read before acting on the next.
        rows = self.acted[record.ids] - 1
        if self.recurrent is not None:
            self.recurrent.advance(record)
        if self.driver.acts_at_once:
            self._act(record)
        else:
            self.waiting = record
        self._write_results(record, rows)

    def _act(self, record: StepRecord) -> None:
        """The policy's forward on ``record.obs``; stores it on each env's next row and sends its actions."""
        if record.ids is None:
            self._act_on_every_env(record)
        else:
            self._act_on_envs(record)

    def _act_on_every_env(self, record: StepRecord) -> None:
        t = self.step - self.first_row
        self.step += 1
        self.row = t
        head = self.buffers[0]
        obs_in = head.put_obs(t, record.obs)
        state = None if self.recurrent is None else self.recurrent.of(None)
        out_t, version, next_state = self._decide(obs_in, state, None, self.num_envs)
        head.put_acted(t, out_t, version, state)
        if self.recurrent is not None:
            self.recurrent.carry(next_state, None)

    def _act_on_envs(self, record: StepRecord) -> None:
        """The envs of a send/recv pool that came back: acted on at once, their rows written while they step."""
        ids = record.ids
        assert ids is not None  # a send/recv pool's record names its envs
        rows = self.acted[ids]
        self.acted[ids] = rows + 1
        places = self._locate(ids, rows, allocate=True)
        obs_in = obs_to_tensor(self.obs_space, record.obs, self.device, copy=True)  # not at the pool's address
        state = index = None
        if self.recurrent is not None:
            index = torch.from_numpy(ids).to(self.device)  # once for the state read and the state carried
            state = self.recurrent.of(ids, index)
        out_t, version, next_state = self._decide(obs_in, state, ids, len(ids))
        if self.storage_device.type == "cpu":
            out_t = {key: value.to(self.storage_device) for key, value in out_t.items()}
        for buffer, sel, flat in places:
            buffer.put_obs_at(flat, select(record.obs, sel))
            buffer.put_acted_at(flat, sel, out_t, version, state)
        if self.recurrent is not None:
            self.recurrent.carry(next_state, index)

    def _decide(
        self, obs: Obs, state: tuple[TensorDictBase, Any] | None, ids: np.ndarray | None, n: int
    ) -> tuple[dict[str, Tensor], int, TensorDictBase | None]:
        """The policy's checked outputs on ``n`` rows of ``obs``, whose actions it sends to the envs ``ids``.

        Returns the outputs, the weights' version and a recurrent policy's next state. The envs of a
        send/recv pool step from here on, while their rows are written.
        """
        if state is None:
            call = PolicyCall(obs)
        else:
            assert self.recurrent is not None  # whose state it is
            call = PolicyCall(obs, state[0], self.recurrent.is_init_tensor(state[1]))
        out_t, version, next_state = self.acting.act(call, n)
        if self.outputs is None:
            self.outputs = self.acting.layout
            assert self.outputs is not None  # set by the policy's first call
            # The drivers keep the final observations of episodes only for what needs them.
            self.driver.keep_final = self.outputs.has_value or self.next_obs_key is not None
        if self.check_finite:
            self._check_finite_action(out_t["action"], ids)
        self.driver.send(out_t["action"], ids)
        return out_t, version, next_state

    def _write_results(self, record: StepRecord, rows: np.ndarray) -> None:
        """Writes the results of the envs of ``record`` that stepped into the rows ``rows`` they acted on."""
        info = None
        if self.infos is not None:  # recorded over the record's envs, then taken env by env
            self._learn_infos(record)
            info = self.infos.empty_rows(1)
            self.infos.record(info, 0, record.info, record.done, record.mask)
            info = {path: array[0] for path, array in info.items()}
        ids, stepped = record.ids, record.stepped
        assert ids is not None  # a send/recv pool's record names its envs
        if stepped is not None:
            ids, rows = ids[stepped], rows[stepped]
            record = _pick(record, stepped)
            if info is not None:
                info = {path: array[stepped] for path, array in info.items()}
        for buffer, sel, flat in self._locate(ids, rows):
            part = record if sel is None else _pick(record, sel)
            part_info = info if sel is None or info is None else {path: array[sel] for path, array in info.items()}
            buffer.put_results_at(flat, part, part_info)

    def _learn_infos(self, record: StepRecord) -> None:
        """The infos' structure, from the first step's infos and the reset's, before any row records one."""
        if self.infos is not None and self.infos.structures is None:
            self.infos.learn(self.driver.reset_infos, record.info)

    def _locate(
        self, ids: np.ndarray, rows: np.ndarray, *, allocate: bool = False
    ) -> list[tuple[HostRows, np.ndarray | None, np.ndarray]]:
        """``(buffer, which of ids or None for all, flat index t * N + j)`` of env ``ids[i]``'s row ``rows[i]``.

        Rows are counted per env since the reset; ``buffers[0]`` starts at row ``first_row``.
        """
        offset = rows - self.first_row  # >= 0: every env is past the batches delivered
        while allocate and len(self.buffers) <= int(offset.max()) // self.num_steps:
            self.buffers.append(self._new_rows(None))
        # A send/recv pool's driver is a host one: its rows are HostRows.
        places = _places(ids, offset, self.num_steps, self.num_envs)
        return [(cast(HostRows, self.buffers[b]), sel, flat) for b, sel, flat in places]

    # -- the batch's end: bootstrap values and next observations ---------------------------------

    def _deliver(self, head: HostRows | DeviceRows) -> TensorDict:
        """The complete batch of ``head``, with ``done``, ``next_value`` and the next observations."""
        assert self.outputs is not None  # set by the policy's first call
        batch = head.assemble(self.outputs)
        torch.logical_or(head.entry(batch, "terminated"), head.entry(batch, "truncated"), out=head.entry(batch, "done"))
        ahead = self.buffers[0] if self.buffers else None  # the next batch's row 0, when acted already
        # Arrays on the host: the next observations written through NumPy, from the final observations as kept.
        on_host = (
            self.next_obs_key is not None and ahead is None and isinstance(head, HostRows) and head.writes_next_obs()
        )
        finals = dense = None
        if self.outputs.has_value or (self.next_obs_key is not None and not on_host):
            finals, dense = batch_finals(head, self.on_device, self.device)
        own = head.own_finals()  # episodes that end on the row's own observation: its obs and value, reused
        if on_host:
            assert self.next_obs_key is not None and self.waiting is not None  # a step's observations wait
            cast(HostRows, head).write_next_obs(head.entry(batch, self.next_obs_key).numpy(), self.waiting.obs)
        elif self.next_obs_key is not None:
            next_obs, obs = head.entry(batch, self.next_obs_key), head.entry(batch, self.obs_key)
            last = ahead.first_obs() if ahead is not None else self._waiting_obs(next_obs.device, copy=False)
            write_next(next_obs, obs, last, finals, dense, own)
        key = self.outputs.value_key
        if key is not None:  # the policy returns values
            assert ahead is None or ahead.outputs is not None  # rows acted on: their outputs stored
            last = self._last_value() if ahead is None else ahead.outputs[key][0]  # type: ignore[index]
            next_value, value = head.entry(batch, "next_value"), head.entry(batch, key)
            write_next_values(self.acting, next_value, value, last, finals, dense, own, self.num_envs)
        return batch

    def _waiting_obs(self, device: torch.device, *, copy: bool = True) -> Obs:
        """The observations the next batch starts with, as stored (float64 as float32), on ``device``."""
        assert self.waiting is not None  # reset: observations to act on
        return _stored_obs(self.waiting.obs, self.obs_space, self.num_envs, self.on_device, device, copy=copy)

    def _last_value(self) -> Tensor:
        """The value of the observations the next batch starts with, with the state it starts with (not advanced)."""
        # Not through the staging row: nothing reads an action back before the next step writes it again.
        last_obs = self._waiting_obs(self.device)
        if self.recurrent is None:
            call = PolicyCall(last_obs, value_only=True)
        else:
            state, is_init = self.recurrent.of(None)
            call = PolicyCall(last_obs, state, self.recurrent.is_init_tensor(is_init), value_only=True)
        return self.acting.value(call, self.num_envs)

    def _non_finite(self, name: str, env: int, value: Any, call: str) -> None:
        """The drivers' report of a NaN or inf (``check_finite=True``), at the step in flight."""
        self._raise_non_finite(name, env, value, call, self.row)

    def _check_finite_action(self, action: Tensor, ids: np.ndarray | None) -> None:
        # Before the env sees it: clipping to a Box's bounds would turn inf into a bound, and NaN stays NaN.
        found = first_non_finite(action.detach().cpu().numpy())
        if found is not None:
            env, value = found
            row = self.row if ids is None else None
            self._raise_non_finite("action", env if ids is None else int(ids[env]), value, "the policy", row)

    def _raise_non_finite(self, name: str, env: int, value: Any, call: str, t: int | None) -> None:
        where = None if t is None else ((self.batches - 1) * self.num_steps + t, t, self.batches - 1)
        raise _non_finite_error(name, env + self.env_offset, value, call, where)


def _stored_obs(obs: Any, space: Any, n: int, on_device: bool, device: torch.device, *, copy: bool) -> Obs:
    """Observations ``obs`` of ``n`` envs of ``space`` (torch tensors where ``on_device``) as stored, on ``device``.

    A copy in torch's memory, as every row the policy is called on: a CPU kernel's last bits can depend on
    where its input starts (MKL's AVX-512 ones), and the env's array lies wherever its allocator put it, so
    a bootstrap on it would make two runs with the same seeds differ. ``copy=False``: on the host, a view
    of the env's array where it can be one (for a copy into the batch's next observations).
    """
    if not on_device:
        return obs_to_tensor(space, obs, device, copy=copy)
    stored = empty_obs(space, (n,), device=device)
    copy_into(stored, obs)
    return stored


def _places(ids: np.ndarray, offset: np.ndarray, T: int, N: int) -> list[tuple[int, np.ndarray | None, np.ndarray]]:
    """``(batch, which of ids or None for all, flat index t * N + j)`` of env ``ids[i]``'s row ``offset[i]``."""
    last = int(offset.max()) // T
    if int(offset.min()) // T == last:
        return [(last, None, (offset - last * T) * N + ids)]
    batch = offset // T
    found: list[tuple[int, np.ndarray | None, np.ndarray]] = []
    for b in np.unique(batch).tolist():
        sel = np.flatnonzero(batch == b)
        found.append((b, sel, (offset[sel] - b * T) * N + ids[sel]))
    return found


def _non_finite_error(name: str, env: int, value: Any, call: str, where: tuple[int, int, int] | None) -> ValueError:
    """The error for a NaN or inf; ``where``: (step, row, batch) of the step in flight, or None."""
    step = "" if where is None else f" at step {where[0]} (row {where[1]} of batch {where[2]})"
    return ValueError(
        f"Collector(check_finite=True): {name} of env {env} is {value}{step}, returned by {call}; "
        "pass check_finite=False to let NaN and inf through"
    )


def _pick(record: StepRecord, sel: np.ndarray) -> StepRecord:
    """The results of the rows ``sel`` of a record."""
    assert record.reward is not None and record.terminated is not None and record.truncated is not None
    assert record.episode_return is not None and record.episode_length is not None  # set with reward
    return StepRecord(
        obs=None,
        reward=record.reward[sel],
        terminated=record.terminated[sel],
        truncated=record.truncated[sel],
        mask=None if record.mask is None else record.mask[sel],
        episode_return=record.episode_return[sel],
        episode_length=record.episode_length[sel],
    )
