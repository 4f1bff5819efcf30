"""The drivers of vector envs of NumPy arrays: gymnasium's ``step``, and ``send``/``recv`` pools.

:class:`NumpyEnvs` steps every env at once, in each of gymnasium's autoreset
modes. :class:`SendRecvEnvs` drives EnvPool in async mode and
:class:`~torch_rollout.DoubleBufferedVectorEnv`, whose ``recv()`` returns the
envs that are ready. Both keep their bookkeeping in NumPy on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from time import perf_counter
from typing import Any, NoReturn

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from torch import Tensor

from torch_rollout.envs._autoreset import FINAL_OBS_KEYS, AutoresetReading
from torch_rollout.envs._double_buffer import DoubleBufferedVectorEnv
from torch_rollout.envs._infos import InfoRecorder
from torch_rollout.envs._seam import StepRecord
from torch_rollout.envs._spaces import (
    ActionConverter,
    ObsChecker,
    check_action_space,
    check_obs_space,
    first_non_finite,
    select_obs,
    stack_final_obs,
)
from torch_rollout.util._warnings import warn

__all__ = ["check_whole_steps", "NumpyEnvs", "SendRecvEnvs", "is_async_pool"]

# check_finite's report: (what, env index, value, call) -> raises.
NonFinite = Callable[[str, int, Any, str], NoReturn]


def check_whole_steps(envs: VectorEnv) -> None:
    """Refuses a vector env that steps only some of its envs at a time and is no send/recv pool (ale-py's
    ``AtariVectorEnv`` with ``batch_size < num_envs``): its steps would not fit the collector's rows.

    Raises:
        ValueError: naming ``batch_size`` and the fix.
    """
    batch_size = getattr(envs.unwrapped, "batch_size", None)
    if isinstance(batch_size, int) and 0 < batch_size < envs.num_envs and not is_async_pool(envs):
        raise ValueError(
            f"Collector: envs ({type(envs.unwrapped).__name__}) steps batch_size={batch_size} of its "
            f"num_envs={envs.num_envs} envs at a time (an asynchronous mode); the collector steps every env at "
            f"every step: build it with batch_size={envs.num_envs} (or leave batch_size at its default), or use an "
            "EnvPool pool in async mode through torch_rollout.envpool_envs"
        )


def is_async_pool(envs: VectorEnv) -> bool:
    """Whether ``envs`` is stepped with ``send``/``recv``: an EnvPool in async mode (``batch_size < num_envs``).

    Or a :class:`DoubleBufferedVectorEnv`, which presents the same API.

    Raises:
        TypeError: ``envs`` wraps such a pool: the wrapper's ``step`` would
            ``send`` to every env and ``recv`` only ``batch_size`` of them.
    """
    base: Any = envs.unwrapped  # past the first check, a send/recv pool (EnvPool's API)
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


class _HostEnvs:
    """What both host drivers share: the spaces' checks, the action conversion and the finite checks."""

    acts_at_once = False
    on_device = False  # NumPy arrays: rows written through NumPy views on the host
    steps_into_rows = False

    def __init__(self, envs: VectorEnv, width: int, *, check_finite: bool, non_finite: NonFinite, env_offset: int):
        self.envs = envs
        self.num_envs = envs.num_envs
        self.width = width
        self.reading = AutoresetReading(envs)
        self.autoreset_mode = self.reading.mode
        self.recorder: InfoRecorder | None = None
        self.obs_space = envs.single_observation_space
        check_obs_space(self.obs_space)
        check_action_space(envs.single_action_space)
        self.to_env_action = ActionConverter(envs.single_action_space, width, env_offset=env_offset)
        self.check_obs = ObsChecker(self.obs_space, width)
        self.check_finite = check_finite
        self.non_finite = non_finite
        self.keep_final = True
        self.call = "envs.reset()"
        self.reset_infos: Any = None
        self.env_seconds = 0.0  # inside the env's own calls: the loop's account of env time

    def _check_finite(self, obs: Any, reward: np.ndarray | None, call: str, index: np.ndarray | None = None) -> None:
        """Raises (through ``non_finite``) at the first NaN or inf; ``index`` maps rows to envs."""
        found = self.check_obs.non_finite(obs)
        if found is None and reward is not None:
            at = first_non_finite(reward)
            found = None if at is None else ("reward", *at)
        if found is not None:
            name, env, value = found
            self.non_finite(name, env if index is None else int(index[env]), value, call)

    def info_recorder(self, specs: Mapping[str, Any], env_offset: int) -> InfoRecorder:
        """Records the named infos of each step into host rows."""
        self.recorder = InfoRecorder(
            specs, num_envs=self.width, autoreset_mode=self.autoreset_mode, env_offset=env_offset
        )
        return self.recorder

    def check_seed(self, seed: int | None) -> None:
        pass

    def end_batch(self) -> None:
        pass


class NumpyEnvs(_HostEnvs):
    """Drives a gymnasium vector env of NumPy arrays, in any autoreset mode; every env steps at once.

    - NEXT_STEP: the step after an episode's end resets the env; it is no
      transition (``mask`` False), and the row after it starts the episode.
    - SAME_STEP: the env resets within the step that ends an episode; the final
      observations come from ``infos["final_obs"]``.
    - DISABLED: the driver resets the envs that ended with ``reset_mask``; the
      final observations are what the step returned.

    An env whose metadata names no mode is read as NEXT_STEP until its step infos
    carry final observations, which switch it to SAME_STEP (with a warning) if no
    episode has ended before; infos that contradict the mode read raise (see
    :class:`~torch_rollout.envs._autoreset.AutoresetReading`).
    """

    steps_into_rows = True  # step_into_rows: send() and recv() without a record, for the loop's plain steps

    def __init__(self, envs: VectorEnv, **kwargs: Any) -> None:
        super().__init__(envs, envs.num_envs, **kwargs)
        self.action: np.ndarray | None = None

    def reset(self, seed: int | None) -> StepRecord:
        N = self.num_envs
        self.call = "envs.reset()"
        began = perf_counter()
        obs, self.reset_infos = self.envs.reset(seed=seed)
        self.env_seconds += perf_counter() - began
        if isinstance(obs, Tensor) or (isinstance(obs, Mapping) and any(isinstance(v, Tensor) for v in obs.values())):
            raise TypeError(
                f"Collector: envs.reset() returned torch tensors, but {type(self.envs).__name__} does not say that "
                "it presents torch tensors: give it (or a wrapper of it) the attribute `device`, the torch.device "
                "(or device string) of its tensors, as torch_rollout.envs, gymnasium's NumpyToTorch and ManiSkill3's "
                "ManiSkillVectorEnv have; the collector then keeps its tensors on that device"
            )
        self.check_obs(obs, "envs.reset()")
        if self.check_finite:
            self._check_finite(obs, None, "envs.reset()")
        self.prev_done = np.zeros(N, dtype=bool)  # NEXT_STEP: the next step of these envs is a reset
        self.ep_return = np.zeros(N, dtype=np.float32)
        self.ep_length = np.zeros(N, dtype=np.int64)
        self.ones = np.ones(N, dtype=np.int64)  # a step's lengths (an array: cheaper to add than the scalar 1)
        return StepRecord(obs=obs)

    def send(self, action: Tensor, ids: np.ndarray | None) -> None:
        self.action = self.to_env_action(action)

    def recv(self) -> StepRecord:
        assert self.action is not None  # sent before
        next_obs, reward, terminated, truncated, info = self._step(self.action)
        done, mask, is_init = self._count(reward, terminated, truncated, info)
        ep_return, ep_length = self.ep_return, self.ep_length  # new arrays each step, never written again
        final = None
        if np.count_nonzero(done):  # a fifth of the time of done.any()
            next_obs, final = self._end(done, next_obs, info)
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
            info=info,
        )

    def step_into_rows(
        self, action: Tensor, rows: Mapping[str, np.ndarray], t: int, action_row: np.ndarray | None = None
    ) -> tuple[Any, Any]:
        """``send(action, None)`` and ``recv()`` in one call, the step's results written into row ``t`` of the
        host arrays ``rows`` (the batch keys ``reward``, ``terminated``, ``truncated``, ``mask``,
        ``episode_return`` and ``episode_length``) rather than returned as a record. ``action_row``: the
        batch's row of actions where it is a host array, written here; None where the caller wrote it.

        Returns the observations to act on next and the final observations ``(envs, rows)`` of the
        episodes that ended (None where none did or nothing needs them). The running episode totals are
        then views of row ``t`` until the next step or :meth:`own_totals`.
        """
        next_obs, reward, terminated, truncated, info = self._step(self.to_env_action(action, None, action_row))
        totals = (rows["episode_return"][t], rows["episode_length"][t])
        done, mask, _ = self._count(reward, terminated, truncated, info, totals)
        rows["reward"][t] = reward
        rows["terminated"][t] = terminated
        rows["truncated"][t] = truncated
        if mask is not None:
            rows["mask"][t] = mask
        if np.count_nonzero(done):
            return self._end(done, next_obs, info)
        return next_obs, None

    def _step(self, action: np.ndarray) -> tuple[Any, Any, Any, Any, Any]:
        """Every env's step with ``action``, its observations checked."""
        self.call = "envs.step()"
        began = perf_counter()
        next_obs, reward, terminated, truncated, info = self.envs.step(action)
        self.env_seconds += perf_counter() - began
        self.check_obs(next_obs, "envs.step()")
        if self.check_finite:
            self._check_finite(next_obs, reward, "envs.step()")
        return next_obs, reward, terminated, truncated, info

    def _count(
        self,
        reward: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        info: Mapping[str, Any],
        totals: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """The step's ``done``, ``mask`` (None: every env's step was a transition) and ``is_init``; the episode
        totals with its rewards and lengths added, written into ``totals`` (arrays of returns and lengths: a
        row's) or else new arrays, never into the last step's (the records and rows hold those)."""
        done = terminated | truncated
        if self.autoreset_mode is not AutoresetMode.SAME_STEP:  # in SAME_STEP mode the infos are not read
            self._read_autoreset(info, done)
        mask = None
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            # This step reset the envs that ended last step: not a real transition.
            mask = ~self.prev_done
            self.prev_done = done
            counted = mask
            is_init = ~mask  # an env's step after its reset step starts its episode
        else:
            counted = self.ones
            is_init = done
        if totals is None:
            totals = (np.empty_like(self.ep_return), np.empty_like(self.ep_length))
        # The sums that `+=` makes (the same ufuncs), at half the cost of NumPy's in-place ones on a few envs.
        self.ep_return = np.add(self.ep_return, reward, out=totals[0])
        self.ep_length = np.add(self.ep_length, counted, out=totals[1])
        return done, mask, is_init

    def own_totals(self) -> None:
        """The running episode totals copied out of the row :meth:`step_into_rows` wrote them into, at the end of
        its steps: the trainer may change the batch's rows once it has them."""
        self.ep_return, self.ep_length = self.ep_return.copy(), self.ep_length.copy()

    def _end(self, done: np.ndarray, next_obs: Any, info: dict) -> tuple[Any, Any]:
        """The totals of the episodes that ended set back to 0 (in new arrays); what :meth:`_end_episodes` returns."""
        self.ep_return, self.ep_length = self.ep_return.copy(), self.ep_length.copy()
        self.ep_return[done] = 0.0
        self.ep_length[done] = 0
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            return next_obs, None
        return self._end_episodes(done, next_obs, info)

    def _read_autoreset(self, info: Mapping[str, Any], done: np.ndarray) -> None:
        """Checks the step's infos against the mode read; an undeclared env's first evidence decides it."""
        reading = self.reading
        if reading.read(info):  # an undeclared env, switched to SAME_STEP: no episode has ended before
            self.autoreset_mode = reading.mode
            if self.recorder is not None:
                self.recorder.autoreset_mode = reading.mode
        elif reading.undecided and done.any():
            reading.ended_without_final()  # NEXT_STEP from here on; final observations later contradict it

    def _end_episodes(self, done: np.ndarray, next_obs: Any, info: dict) -> tuple[Any, Any]:
        """SAME_STEP and DISABLED: the final observations of the envs that ended; DISABLED resets them.

        Returns the observations to act on next and ``(index, final observations)`` (None when nobody needs them).
        """
        index = np.flatnonzero(done)
        final = None
        if self.autoreset_mode == AutoresetMode.SAME_STEP:
            if self.keep_final or self.check_finite:
                key = next((key for key in FINAL_OBS_KEYS if key in info), None)
                if key is None:
                    raise KeyError(
                        "Collector: the env runs in SAME_STEP autoreset mode but its step infos have no "
                        "'final_obs' at an episode end; a wrapper must keep infos['final_obs']"
                    )
                final = stack_final_obs(self.obs_space, info[key], index)
                if self.check_finite:
                    self._check_finite(final, None, f"envs.step() in infos[{key!r}]", index)
            return next_obs, (index, final) if self.keep_final else None
        # DISABLED: what the step returned, before the reset
        if self.keep_final:
            final = (index, select_obs(self.obs_space, next_obs, index))
        self.call = "envs.reset(options={'reset_mask': ...})"
        began = perf_counter()
        next_obs, _ = self.envs.reset(options={"reset_mask": done})
        self.env_seconds += perf_counter() - began
        self.check_obs(next_obs, "envs.reset(options={'reset_mask': ...})")
        if self.check_finite:
            self._check_finite(next_obs, None, "envs.reset(options={'reset_mask': ...})")
        return next_obs, final


class SendRecvEnvs(_HostEnvs):
    """Drives an EnvPool in async mode or a DoubleBufferedVectorEnv: the policy acts on the envs that are ready.

    ``recv()`` returns the ``batch_size`` envs whose step has finished
    (``info["env_id"]``), and ``send(action, env_id)`` steps them while the
    others keep stepping in EnvPool's threads, outside the GIL. Its envs reset
    on the step after an episode's end (NEXT_STEP): that step is no
    transition. Every env that comes back is acted on at once
    (``acts_at_once``): ``recv()`` waits for ``batch_size`` envs, so holding
    back envs whose rows are complete could leave too few stepping to fill it.

    ``seed`` cannot reach an EnvPool (its seeds are fixed when it is made) and
    only warns when it differs; a DoubleBufferedVectorEnv is reset with it.
    """

    acts_at_once = True
    envs: Any  # an EnvPool in async mode or a DoubleBufferedVectorEnv: send, recv, async_reset and config

    def __init__(self, envs: Any, **kwargs: Any) -> None:
        config = envs.config
        super().__init__(envs, int(config["batch_size"]), **kwargs)
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

    def check_seed(self, seed: int | None) -> None:
        """Warns that ``seed`` cannot reach an EnvPool whose envs were seeded with another one."""
        if self.seeds_at_reset:
            return
        made = self.envs.config.get("seed")
        if seed is not None and seed != made:
            warn(
                f"Collector: seed={seed} cannot reach an EnvPool, whose envs were seeded when it was made "
                f"(with seed={made}); make the pool with seed={seed}, or pass seed={made} or None"
            )

    def reset(self, seed: int | None) -> None:
        N = self.num_envs
        began = perf_counter()
        self._drain()
        self.call = "envs.async_reset()"
        if self.seeds_at_reset:
            self.envs.async_reset(seed=seed)
        else:
            self.envs.async_reset()
        self.env_seconds += perf_counter() - began
        self.in_flight[:] = True
        self.pending = np.zeros(N, dtype=bool)  # the env's last action awaits its step's result
        self.prev_done = np.zeros(N, dtype=bool)
        self.ep_return = np.zeros(N, dtype=np.float32)
        self.ep_length = np.zeros(N, dtype=np.int64)
        self.reset_infos = None
        return None  # the first recv() returns the reset observations

    def _drain(self) -> None:
        """Takes back the steps an earlier loop left in flight, so that no env gets a second request.

        Envs not in flight are stepped with sampled actions where ``recv()``
        needs them to fill a batch; these steps belong to no row, as the reset
        that follows starts every env on a new episode.
        """
        envs, B = self.envs, self.width
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

    def send(self, action: Tensor, ids: np.ndarray | None) -> None:
        env_action = self.to_env_action(action, ids)  # errors name the env, not its place in this recv
        self.call = "envs.send()"
        began = perf_counter()
        self.envs.send(env_action, self.env_id)
        self.env_seconds += perf_counter() - began
        self.in_flight[ids] = True
        self.pending[ids] = True

    def recv(self) -> StepRecord:
        self.call = "envs.recv()"
        began = perf_counter()
        obs, reward, terminated, truncated, info = self.envs.recv()
        self.env_seconds += perf_counter() - began
        self.env_id = info["env_id"]
        ids = np.asarray(self.env_id, dtype=np.intp)
        self.in_flight[ids] = False
        self.check_obs(obs, "envs.recv()")
        if self.check_finite:
            self._check_finite(obs, reward, "envs.recv()", ids)
        if self.reset_infos is None:
            self.reset_infos = info  # the first recv() returns resets
        stepped: np.ndarray | None  # None below: all of them
        stepped = self.pending[ids]  # these envs' results end the rows they acted on last
        self.pending[ids] = False
        stepping = np.count_nonzero(stepped)  # a fifth of the time of stepped.any() and stepped.all()
        if not stepping:
            return StepRecord(obs=obs, ids=ids, info=info)
        mask = ~self.prev_done[ids]  # this step reset envs that ended at their last one: not a transition
        done = terminated | truncated
        ep_length = self.ep_length[ids] + mask
        ep_return = self.ep_return[ids] + reward
        if stepping == len(ids):  # the usual case: every env that came back had been sent an action
            stepped = None
            self.prev_done[ids] = done
            self.ep_length[ids] = np.where(done, 0, ep_length)
            self.ep_return[ids] = np.where(done, 0.0, ep_return)
        else:
            results = ids[stepped]
            self.prev_done[results] = done[stepped]
            self.ep_length[results] = np.where(done, 0, ep_length)[stepped]
            self.ep_return[results] = np.where(done, 0.0, ep_return)[stepped]
        return StepRecord(
            obs=obs,
            ids=ids,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            done=done,
            stepped=stepped,
            mask=mask,
            episode_return=ep_return,
            episode_length=ep_length,
            is_init=~mask,
            info=info,
        )
