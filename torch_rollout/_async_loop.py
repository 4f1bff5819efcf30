"""The collection loop for envs that step asynchronously, driven with ``send``/``recv``.

EnvPool in async mode, and :class:`DoubleBufferedVectorEnv` (groups of
AsyncVectorEnv, double-buffered), which presents EnvPool's async API.
"""

from __future__ import annotations

import warnings
from collections import deque
from typing import Any

import numpy as np
import torch
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from torch_rollout._double_buffer import DoubleBufferedVectorEnv
from torch_rollout._loop import PolicyCall, RolloutLoop, Stopped, empty_rows
from torch_rollout._spaces import Obs, ObsBuffer, first_non_finite, obs_to_tensor

__all__ = ["AsyncRolloutLoop", "is_async_pool"]


def is_async_pool(envs: VectorEnv) -> bool:
    """Whether ``envs`` is stepped with ``send``/``recv``: an EnvPool in async mode (``batch_size < num_envs``).

    Or a :class:`DoubleBufferedVectorEnv`, which presents the same API.

    Raises:
        TypeError: ``envs`` wraps such a pool: the wrapper's ``step`` would
            ``send`` to every env and ``recv`` only ``batch_size`` of them.
    """
    base = envs.unwrapped
    if not all(callable(getattr(base, name, None)) for name in ("async_reset", "send", "recv")):
        return False
    if not getattr(base, "is_async", False):
        return False
    if base is not envs:
        if isinstance(base, DoubleBufferedVectorEnv):
            raise TypeError(
                f"Collector: envs is {type(envs).__name__} around a DoubleBufferedVectorEnv of "
                f"{len(base.groups)} groups of {base.group_size} envs; the collector drives it with send/recv "
                "itself, past any wrapper (a vector wrapper would step every group at once): pass it unwrapped, "
                "or pass its envs as one vector env (not double_buffered)"
            )
        raise TypeError(
            f"Collector: envs is {type(envs).__name__} around an EnvPool in async mode (batch_size="
            f"{base.config['batch_size']} < num_envs={base.num_envs}); the collector drives such a pool with "
            "send/recv itself, past any wrapper: pass the pool unwrapped, or make it with batch_size=num_envs"
        )
    return True


class _Rows:
    """The ``[T, N]`` rows of one batch while its envs fill them, each at its own pace.

    Rows are addressed flat, ``t * N + j``: one fancy-indexed write per key and recv().
    """

    obs: ObsBuffer  # on the host; uploaded when the batch is complete
    host: dict[str, np.ndarray]  # [T * N] views of the [T, N] host rows
    outputs: dict[str, Tensor | TensorDictBase] | None = None
    views: dict[str, np.ndarray | None]  # [T * N, ...] NumPy views of outputs on the host; None: written by torch
    states: TensorDictBase | None = None
    info: dict[tuple, np.ndarray] | None = None
    filled: int = 0  # rows whose step has come back

    def __init__(self, loop: AsyncRolloutLoop) -> None:
        T, N = loop.num_steps, loop.num_envs
        self.num_envs = N
        self.obs = ObsBuffer(loop.obs_space, (T, N))
        arrays = self.obs.arrays
        self.flat_obs = arrays.reshape(T * N, *arrays.shape[2:]) if isinstance(arrays, np.ndarray) else None
        self.rows = {key: np.empty((T, N), dtype=dtype) for key, dtype in loop.host_keys.items()}
        self.host = {key: array.reshape(-1) for key, array in self.rows.items()}

    def write_obs(self, flat: np.ndarray, obs: Any) -> None:
        if self.flat_obs is not None:
            self.flat_obs[flat] = obs
        else:  # a Dict space: nested arrays
            self.obs.write((flat // self.num_envs, flat % self.num_envs), obs)

    def write_outputs(self, flat: np.ndarray, outputs: dict[str, Any], sel: np.ndarray | None) -> None:
        index = None
        for key, value in outputs.items():
            view = self.views[key]
            if view is not None:
                view[flat] = value.numpy() if sel is None else value.numpy()[sel]
                continue
            storage = self.outputs[key]
            if index is None:
                rows = torch.from_numpy(flat).to(storage.device)
                index = (rows // self.num_envs, rows % self.num_envs)
            if sel is not None:
                value = value[torch.from_numpy(sel).to(value.device)]
            storage[index] = value.to(storage.device)


class AsyncRolloutLoop(RolloutLoop):
    """Collects ``[T, N]`` batches from an EnvPool in async mode: the policy acts on the envs that are ready.

    A :class:`DoubleBufferedVectorEnv` is driven the same way: its ``recv()``
    returns one group, whose next step is sent while the other groups step.

    ``recv()`` returns the ``batch_size`` envs whose step has finished
    (``info["env_id"]``), and ``send(action, env_id)`` steps them while the
    others keep stepping in EnvPool's threads, outside the GIL. Each env fills
    its own rows, in order: row ``t`` of env ``j`` holds its observation, the
    policy's outputs on it (and the ``policy_version`` that produced them), and
    the reward, ``terminated`` and ``truncated`` of the step, with the masks and
    episode totals of :class:`RolloutLoop` in NEXT_STEP mode (EnvPool's: the
    step after an episode end is the reset row, ``mask=False``). A batch is
    complete when every env has its ``T`` rows.

    Every env that comes back is acted on at once, never held: ``recv()`` waits
    for ``batch_size`` envs, so holding back envs that have their ``T`` rows
    could leave too few stepping to fill it. The forward on such an env's next
    observation is its row 0 of the next batch, carried over, and its value is
    this batch's bootstrap ``next_value`` of row ``T - 1``; an env that comes
    back again before the batch is complete fills its next rows too. So the
    carry is bounded by the spread of the envs' progress, not by a constant:
    EnvPool steps envs in the order they were sent, which keeps envs of equal
    speed within a step or two of each other, while an env much slower than
    the others lets them run batches ahead (their rows wait in later batches'
    storage). Rows acted before a weight refresh keep the version that acted.
    A row's next observation (with ``next_obs_key``) is the observation of the
    env's next row, which is what its step returned.
    In recurrent mode each env's state goes with it.

    Args:
        envs: an EnvPool in async mode or a DoubleBufferedVectorEnv (see :func:`is_async_pool`).
        **kwargs: as :class:`RolloutLoop`; ``seed`` cannot reach an EnvPool (its
            seeds are fixed when it is made) and only warns when it differs; a
            DoubleBufferedVectorEnv is reset with it.
    """

    def __init__(self, envs: VectorEnv, *args: Any, **kwargs: Any) -> None:
        super().__init__(envs, *args, **kwargs)
        config = envs.config
        self.batch_size = int(config["batch_size"])
        if self.autoreset_mode != AutoresetMode.NEXT_STEP:
            raise ValueError(
                f"Collector: an EnvPool in async mode resets an env on the step after its episode ends "
                f"(AutoresetMode.NEXT_STEP), but its metadata says {self.autoreset_mode}"
            )
        if int(config.get("max_num_players", 1)) != 1:
            raise ValueError(
                f"Collector: EnvPool max_num_players={config['max_num_players']}; the collector steps "
                "single-player envs only"
            )
        self.seeds_at_reset = isinstance(envs, DoubleBufferedVectorEnv)
        self._warn_seed(self.seed)
        self.buffers: deque[_Rows] = deque()

    @staticmethod
    def step_width(envs: VectorEnv) -> int:
        """Envs that one ``recv()`` returns (``batch_size``): the rows of the policy's outputs, actions and infos."""
        return int(envs.config["batch_size"])

    def reseed(self, seed: int | None) -> None:
        self._warn_seed(seed)
        super().reseed(seed)

    def _warn_seed(self, seed: int | None) -> None:
        if self.seeds_at_reset:
            return
        made = self.envs.config.get("seed")
        if seed is not None and seed != made:
            warnings.warn(
                f"Collector: seed={seed} cannot reach an EnvPool, whose envs were seeded when it was made "
                f"(with seed={made}); make the pool with seed={seed}, or pass seed={made} or None",
                UserWarning,
                stacklevel=5,  # the Collector's caller (through the placement and this loop)
            )

    def reset(self) -> None:
        N = self.num_envs
        self._drain()
        self.call = "envs.async_reset()"
        if self.seeds_at_reset:
            self.envs.async_reset(seed=self.seed)
        else:
            self.envs.async_reset()
        self.in_flight[:] = True
        self.buffers.clear()
        self.first_row = 0  # an env's row index of row 0 of buffers[0]
        self.acted = np.zeros(N, dtype=np.int64)  # rows each env has acted on (rows [0, acted) of its stream)
        self.pending = np.zeros(N, dtype=bool)  # its last acted row awaits its step's result
        self.prev_done = np.zeros(N, dtype=bool)
        self.ep_return = np.zeros(N, dtype=np.float32)
        self.ep_length = np.zeros(N, dtype=np.int64)
        self.reset_infos = None
        if self.initial_state is not None:
            self.state = self.initial_state.clone()
            self.is_init = np.ones(N, dtype=bool)

    def _drain(self) -> None:
        """Takes back the steps an earlier loop left in flight, so that no env gets a second request.

        Envs not in flight are stepped with sampled actions where ``recv()``
        needs them to fill a batch; these steps belong to no row, as the reset
        that follows starts every env on a new episode.
        """
        envs, B = self.envs, self.batch_size
        in_flight = getattr(envs, "_torch_rollout_in_flight", None)
        if in_flight is None:
            in_flight = np.zeros(self.num_envs, dtype=bool)
            envs._torch_rollout_in_flight = in_flight  # for the next collector of a live pool
        self.in_flight = in_flight
        while in_flight.any():
            missing = B - int(in_flight.sum())
            if missing > 0:
                idle = np.flatnonzero(~in_flight)[:missing]
                space = envs.single_action_space
                self.call = "envs.send() (draining the steps an earlier collector left in flight)"
                envs.send(np.stack([space.sample() for _ in idle]), idle.astype(np.int32))
                in_flight[idle] = True
            self.call = "envs.recv() (draining the steps an earlier collector left in flight)"
            *_, info = envs.recv()
            in_flight[np.asarray(info["env_id"], dtype=np.intp)] = False

    # -- one batch -----------------------------------------------------------------------------

    def collect(self, out: TensorDict | None = None) -> TensorDict:
        """Steps the envs until every env has its ``T`` rows of the oldest batch; returns that batch.

        ``out``: a batch of an earlier call to copy this one into (a shared-memory slot).
        """
        T, N = self.num_steps, self.num_envs
        if self.reset_pending:
            self.reset_pending = False
            self.reset()
        self.batches += 1
        while not (self.buffers and self.buffers[0].filled == T * N):
            if self.stop():
                raise Stopped
            self._step()
        rows = self.buffers.popleft()
        self.first_row += T
        batch = self._assemble(rows, self.buffers[0])
        if out is None:
            return batch
        out.copy_(batch)
        return out

    def _step(self) -> None:
        """One ``recv()``: acts on the envs that came back, sends their actions, then writes their rows."""
        envs = self.envs
        self.call = "envs.recv()"
        obs, reward, terminated, truncated, info = envs.recv()
        env_id = info["env_id"]
        ids = np.asarray(env_id, dtype=np.intp)
        self.in_flight[ids] = False
        self.check_obs(obs, "envs.recv()")
        if self.check_finite:
            self._check_finite(obs, reward, "envs.recv()", None, ids)
        if self.reset_infos is None:
            self.reset_infos = info  # the first recv() returns resets

        rows = self.acted[ids]  # [B]: the row each env acts on now
        obs_t = obs_to_tensor(self.obs_space, obs, self.device)
        if self.initial_state is None:
            state = is_init = None
            raw, version = self._forward(PolicyCall(obs_t))
            next_state = None
        else:
            index = torch.from_numpy(ids).to(self.device)
            state, is_init = self.state[index], self.is_init[ids]
            raw, version = self._forward(PolicyCall(obs_t, state, self._is_init_tensor(is_init)))
            raw, next_state = self._split_state(raw, len(ids))
        out_t = self._check_outputs(raw, len(ids))
        if out_t.keys() != set(self.output_keys):
            raise ValueError(
                f"Collector: policy output keys changed from {sorted(self.output_keys)} to {sorted(out_t)} "
                "between steps"
            )
        if self.check_finite:
            found = first_non_finite(out_t["action"].detach().cpu().numpy())
            if found is not None:
                self._raise_non_finite("action", int(ids[found[0]]), found[1], "the policy", None)
        action = self.to_env_action(out_t["action"], ids)  # errors name the env, not its place in this recv
        self.call = "envs.send()"
        envs.send(action, env_id)
        self.in_flight[ids] = True
        # The envs step from here on; the rows are written meanwhile.

        ended = self.pending[ids]  # these envs' results end the rows they acted on last
        self.pending[ids] = True
        self.acted[ids] = rows + 1
        if ended.any():
            self._finish_rows(ids, rows - 1, ended, reward, terminated, truncated, info)
        if self.storage_device.type == "cpu":
            out_t = {key: value.to(self.storage_device) for key, value in out_t.items()}
        for buffer, sel, flat in self._locate(ids, rows, allocate=True):
            buffer.write_obs(flat, _select(obs, sel))
            if buffer.outputs is None:
                self._allocate_outputs(buffer, out_t)
            buffer.write_outputs(flat, out_t, sel)
            buffer.host["policy_version"][flat] = version
            if state is not None:
                if buffer.states is None:
                    buffer.states = empty_rows(self.state, self.num_steps, self.storage_device)
                rows_t = torch.from_numpy(flat).to(self.storage_device)
                where = (rows_t // self.num_envs, rows_t % self.num_envs)
                buffer.states[where] = (state if sel is None else state[torch.from_numpy(sel)]).to(self.storage_device)
                buffer.host["is_init"][flat] = is_init if sel is None else is_init[sel]
        if next_state is not None:
            # The state of each env's next row; a row after its reset row starts from the initial state.
            starts = self.prev_done[ids]
            self.state[index] = self._reset_state(next_state, starts, initial=self.initial_state[index])
            self.is_init[ids] = starts

    def _allocate_outputs(self, buffer: _Rows, out_t: dict[str, Any]) -> None:
        T, N = self.num_steps, self.num_envs
        buffer.outputs = {key: empty_rows(_widen(value, N), T, self.storage_device) for key, value in out_t.items()}
        buffer.views = {
            key: value.numpy().reshape(T * N, *value.shape[2:])
            if isinstance(value, Tensor) and value.device.type == "cpu"
            else None
            for key, value in buffer.outputs.items()
        }

    def _finish_rows(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        ended: np.ndarray,
        reward: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        info: dict,
    ) -> None:
        """Writes the results of the steps of ``ids[ended]``, which acted on ``rows[ended]``."""
        real = ~self.prev_done[ids]  # this step reset envs that ended at their last one: not a transition
        done = terminated | truncated
        info_rows = None
        if self.infos is not None:
            if self.infos.structures is None:
                self.infos.learn(self.reset_infos, info)
            info_rows = self.infos.empty_rows(1)
            self.infos.record(info_rows, 0, info, done, real)
        if not ended.all():
            ids, rows, real, done = ids[ended], rows[ended], real[ended], done[ended]
            reward, terminated, truncated = reward[ended], terminated[ended], truncated[ended]
            if info_rows is not None:
                info_rows = {path: array[0][ended] for path, array in info_rows.items()}
        elif info_rows is not None:
            info_rows = {path: array[0] for path, array in info_rows.items()}
        self.prev_done[ids] = done
        ep_length = self.ep_length[ids] + real
        ep_return = self.ep_return[ids] + reward
        self.ep_length[ids] = np.where(done, 0, ep_length)
        self.ep_return[ids] = np.where(done, 0.0, ep_return)
        for buffer, sel, flat in self._locate(ids, rows):
            pick = (lambda array: array) if sel is None else (lambda array, sel=sel: array[sel])
            host = buffer.host
            host["reward"][flat] = pick(reward)
            host["terminated"][flat] = pick(terminated)
            host["truncated"][flat] = pick(truncated)
            host["mask"][flat] = pick(real)
            host["episode_return"][flat] = pick(ep_return)
            host["episode_length"][flat] = pick(ep_length)
            if info_rows is not None:
                if buffer.info is None:
                    buffer.info = {
                        path: np.empty((self.num_steps * self.num_envs, *shape), dtype=dtype)
                        for path, shape, dtype in self.infos.leaves
                    }
                for path, array in info_rows.items():
                    buffer.info[path][flat] = pick(array)
            buffer.filled += len(flat)

    def _locate(
        self, ids: np.ndarray, rows: np.ndarray, *, allocate: bool = False
    ) -> list[tuple[_Rows, np.ndarray | None, np.ndarray]]:
        """``(buffer, which of ids or None for all, flat index t * N + j)`` of env ``ids[i]``'s row ``rows[i]``.

        Rows are counted per env since the reset; ``buffers[0]`` starts at row ``first_row``.
        """
        T, N = self.num_steps, self.num_envs
        offset = rows - self.first_row  # >= 0: every env is past the batches delivered
        last = int(offset.max()) // T
        while allocate and len(self.buffers) <= last:
            self.buffers.append(_Rows(self))
        if int(offset.min()) // T == last:
            return [(self.buffers[last], None, (offset - last * T) * N + ids)]
        batch = offset // T
        found = []
        for b in np.unique(batch).tolist():
            sel = np.flatnonzero(batch == b)
            found.append((self.buffers[b], sel, (offset[sel] - b * T) * N + ids[sel]))
        return found

    def _assemble(self, rows: _Rows, after: _Rows) -> TensorDict:
        """The batch of the complete ``rows``; ``after`` holds the next batch's row 0, the bootstrap."""
        T, N, device = self.num_steps, self.num_envs, self.storage_device
        batch: dict[str, Any] = {self.obs_key: rows.obs.tensor.to(device), **rows.outputs}
        for key, array in rows.rows.items():
            batch[key] = torch.from_numpy(array).to(device)
        if rows.info is not None:
            info = {path: array.reshape(T, N, *array.shape[1:]) for path, array in rows.info.items()}
            batch["info"] = self.infos.tensordict(info, [T, N], device)
        if self.has_value:
            value = rows.outputs[self.value_key]
            next_value = torch.empty_like(value)
            next_value[:-1] = value[1:]
            # Row 0 of the next batch acted on the observation after row T - 1 (the final one, at an episode end).
            next_value[-1] = after.outputs[self.value_key][0]
            batch["next_value"] = next_value
        if self.next_obs_key is not None:
            batch[self.next_obs_key] = _next_obs(rows, after).to(device)
        out = TensorDict(batch, batch_size=[T, N], device=device)
        if rows.states is not None:
            out.update(rows.states)
        return out


def _next_obs(rows: _Rows, after: _Rows) -> Obs:
    """Each row's true next observation: the next row's, which is what the env's step returned (NEXT_STEP).

    At an episode end that is the final observation; a reset row's (``mask``
    False) is the reset observation. The last row's is row 0 of the next batch.
    """
    return torch.cat([rows.obs.tensor[1:], after.obs.tensor[:1]])


def _widen(value: Tensor | TensorDictBase, n: int) -> Tensor | TensorDictBase:
    """``value``'s first row expanded to ``n`` rows: the shape of one step's output for every env."""
    if isinstance(value, Tensor):
        return value[:1].expand(n, *value.shape[1:])
    return value[:1].expand(n)


def _select(obs: Any, sel: np.ndarray | None) -> Any:
    """The rows ``sel`` of a batch of env observations (array or dict of arrays); all of them where None."""
    if sel is None:
        return obs
    if isinstance(obs, dict):
        return {key: _select(value, sel) for key, value in obs.items()}
    return np.asarray(obs)[sel]
