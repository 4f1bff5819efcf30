"""The background thread that steps the vector env, runs the policy and assembles batches."""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import Tensor, nn

from torch_rollout._spaces import (
    ActionConverter,
    Obs,
    ObsBuffer,
    ObsChecker,
    describe_bad_single_obs,
    first_non_finite,
    obs_to_tensor,
    select_obs,
    stack_final_obs,
)
from torch_rollout.gae import compute_gae

__all__ = ["Worker"]


class _Stopped(Exception):
    """Raised inside the worker when the consumer closed the collector."""


class Worker:
    """Collects ``[num_steps, num_envs]`` batches on a daemon thread.

    The worker holds no reference to the ``Collector`` so that dropping the
    collector lets it be garbage collected (and closed). The consumer talks to
    it through three things: ``credits`` (one token per requested batch, on
    top of ``prefetch`` initial ones), ``results`` (``(batch, None)`` or
    ``(None, exception)`` items) and ``stop``. Both queues are C-level
    ``SimpleQueue``: a KeyboardInterrupt landing in the consumer's ``put``
    cannot leave a lock held, as it can inside ``threading.Semaphore.release``
    (and then ``close()`` would deadlock). ``lock`` guards the policy's
    weights: every forward pass and every weight refresh holds it, so no
    forward sees two weight versions. ``abandon()`` hands the closing of owned
    envs to the thread when the consumer cannot wait for it to stop.
    """

    envs: VectorEnv
    policy: nn.Module
    lock: threading.Lock
    version: int
    credits: queue.SimpleQueue
    results: queue.SimpleQueue
    stop: threading.Event
    thread: threading.Thread

    def __init__(
        self,
        envs: VectorEnv,
        policy: nn.Module,
        *,
        num_steps: int,
        gamma: float,
        gae_lambda: float,
        device: torch.device,
        num_batches: int | None,
        prefetch: int,
        seed: int | None,
        autoreset_mode: AutoresetMode,
        check_finite: bool = False,
        owns_envs: bool = False,
    ) -> None:
        self.envs = envs
        self.policy = policy
        self.num_steps = num_steps
        self.num_envs = envs.num_envs
        self.gamma = gamma
        self.gae_lambda = gae_lambda
        self.device = device
        self.num_batches = num_batches
        self.seed = seed
        self.autoreset_mode = autoreset_mode
        self.obs_space = envs.single_observation_space
        self.to_env_action = ActionConverter(envs.single_action_space, envs.num_envs)
        self.check_obs = ObsChecker(self.obs_space, envs.num_envs)
        self.check_finite = check_finite
        self.owns_envs = owns_envs
        self.batches = 0  # batches started: step numbers in error messages are batches * T + t
        self.is_td_module = isinstance(policy, TensorDictModuleBase)
        self.on_cuda = device.type == "cuda"

        self.lock = threading.Lock()
        self.version = 0
        self.credits = queue.SimpleQueue()
        for _ in range(prefetch):
            self.credits.put(None)
        self.results = queue.SimpleQueue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="torch_rollout-collector", daemon=True)
        # Whoever of the thread (on exit) and the consumer (in abandon) comes last closes owned envs.
        self._exit_lock = threading.Lock()
        self._exited = False
        self._abandoned = False

    # -- thread body -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            with torch.no_grad():
                self._reset()
                produced = 0
                while self.num_batches is None or produced < self.num_batches:
                    self.credits.get()
                    if self.stop.is_set():
                        return
                    self.results.put((self._collect(), None))
                    produced += 1
        except _Stopped:
            pass
        except BaseException as exc:  # every failure reaches the consumer, KeyboardInterrupt included
            if not self.stop.is_set():  # else nobody reads it, and the envs are their owner's again
                exc = _explain_env_error(self.envs, exc)
            self.results.put((None, exc))
        finally:
            with self._exit_lock:
                self._exited = True
                close_envs = self._abandoned and self.owns_envs
            if close_envs:
                self.envs.close()

    def abandon(self) -> bool:
        """Called by a consumer that stopped waiting for the thread; True if it has exited already.

        If not, the thread closes the envs it owns itself once the call it is stuck in returns.
        """
        with self._exit_lock:
            self._abandoned = not self._exited
            return self._exited

    def _reset(self) -> None:
        N = self.num_envs
        obs, _ = self.envs.reset(seed=self.seed)
        self.check_obs(obs, "envs.reset()")
        if self.check_finite:
            self._check_finite(obs, None, "envs.reset()")
        self.obs = obs
        self.prev_done = np.zeros(N, dtype=bool)  # NEXT_STEP: the next step of these envs is a reset
        self.ep_return = np.zeros(N, dtype=np.float32)
        self.ep_length = np.zeros(N, dtype=np.int64)
        # Host staging row for CUDA: page-locked so the upload is asynchronous; it
        # can be reused each step because reading the action back synchronizes.
        self.staging = ObsBuffer(self.obs_space, (N,), pin_memory=True) if self.on_cuda else None
        self.has_value: bool | None = None

    def _collect(self) -> TensorDict:
        T, N = self.num_steps, self.num_envs
        envs, device = self.envs, self.device
        host_obs = None if self.on_cuda else ObsBuffer(self.obs_space, (T, N))
        device_obs: list[Obs] = []
        reward = np.empty((T, N), dtype=np.float32)
        terminated = np.empty((T, N), dtype=bool)
        truncated = np.empty((T, N), dtype=bool)
        mask = np.ones((T, N), dtype=bool)
        ep_return = np.empty((T, N), dtype=np.float32)
        ep_length = np.empty((T, N), dtype=np.int64)
        versions = np.empty(T, dtype=np.int64)
        outputs: dict[str, list[Tensor]] = {}
        final_values: list[tuple[int, np.ndarray, Tensor]] = []  # (t, envs, V(final obs))
        self.batches += 1

        for t in range(T):
            if self.stop.is_set():
                raise _Stopped
            if host_obs is not None:
                host_obs.write(t, self.obs)
                obs_t = host_obs.tensor[t]
            else:
                self.staging.write(slice(None), self.obs)
                obs_t = self.staging.tensor.to(device, non_blocking=True)
                device_obs.append(obs_t)

            out, versions[t] = self.forward(obs_t)
            if not outputs:
                outputs = {key: [] for key in out}
            elif out.keys() != outputs.keys():
                raise ValueError(
                    f"Collector: policy output keys changed from {sorted(outputs)} to {sorted(out)} between steps"
                )
            for key, value in out.items():
                outputs[key].append(value)

            next_obs, r, term, trunc, info = envs.step(self.to_env_action(out["action"]))
            self.check_obs(next_obs, "envs.step()")
            if self.check_finite:
                self._check_finite(next_obs, r, "envs.step()", t)
            done = term | trunc
            reward[t], terminated[t], truncated[t] = r, term, trunc

            if self.autoreset_mode == AutoresetMode.NEXT_STEP:
                # This step reset the envs that ended last step: not a real transition.
                mask[t] = real = ~self.prev_done
                self.prev_done = done
                self.ep_length += real
            else:
                self.ep_length += 1
            self.ep_return += r
            ep_return[t], ep_length[t] = self.ep_return, self.ep_length
            if done.any():
                self.ep_return[done] = 0.0
                self.ep_length[done] = 0
                next_obs = self._finish_episodes(t, done, next_obs, info, final_values)
            self.obs = next_obs

        batch = {
            "obs": host_obs.tensor.to(device) if host_obs is not None else torch.stack(device_obs),
            **{key: torch.stack(values) for key, values in outputs.items()},
        }
        for key, array in (
            ("reward", reward),
            ("terminated", terminated),
            ("truncated", truncated),
            ("mask", mask),
            ("episode_return", ep_return),
            ("episode_length", ep_length),
        ):
            batch[key] = torch.from_numpy(array).to(device, non_blocking=True)
        batch["done"] = batch["terminated"] | batch["truncated"]
        # contiguous: an expanded (stride-0) view would refuse in-place writes by the trainer
        batch["policy_version"] = torch.from_numpy(versions).to(device).unsqueeze(1).expand(T, N).contiguous()
        if self.has_value:
            self._add_advantages(batch, final_values)
        return TensorDict(batch, batch_size=[T, N], device=device)

    def _finish_episodes(
        self,
        t: int,
        done: np.ndarray,
        next_obs: Any,
        info: dict,
        final_values: list[tuple[int, np.ndarray, Tensor]],
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
            out, _ = self.forward(obs_to_tensor(self.obs_space, final, self.device))
            final_values.append((t, index, out["value"]))
        if mode == AutoresetMode.DISABLED:
            next_obs, _ = self.envs.reset(options={"reset_mask": done})
            self.check_obs(next_obs, "envs.reset(options={'reset_mask': ...})")
            if self.check_finite:
                self._check_finite(next_obs, None, "envs.reset(options={'reset_mask': ...})", t)
        return next_obs

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
        if found is None:
            return
        name, env, value = found
        env = env if index is None else int(index[env])
        batch = self.batches - 1
        step = "" if t is None else f" at step {batch * self.num_steps + t} (row {t} of batch {batch})"
        raise ValueError(
            f"Collector(check_finite=True): {name} of env {env} is {value}{step}, returned by {call}; "
            "pass check_finite=False to let NaN and inf through"
        )

    def _add_advantages(self, batch: dict[str, Tensor], final_values: list[tuple[int, np.ndarray, Tensor]]) -> None:
        # Bootstrap the last row from the observation the next batch starts with.
        obs = self.obs
        if self.on_cuda:
            self.staging.write(slice(None), obs)
            last_obs = self.staging.tensor.to(self.device, non_blocking=True)
        else:
            last_obs = obs_to_tensor(self.obs_space, obs, self.device)
        out, _ = self.forward(last_obs)
        value = batch["value"]
        next_value = torch.cat([value[1:], out["value"].unsqueeze(0)])
        for t, index, final_value in final_values:
            next_value[t, torch.from_numpy(index).to(self.device)] = final_value
        advantage, return_ = compute_gae(
            batch["reward"],
            value,
            next_value,
            batch["terminated"],
            batch["truncated"],
            gamma=self.gamma,
            gae_lambda=self.gae_lambda,
        )
        # Reset rows of NEXT_STEP carry no transition: zero advantage, excluded by mask.
        real = batch["mask"]
        batch["next_value"] = next_value
        batch["advantage"] = torch.where(real, advantage, 0.0)
        batch["return"] = torch.where(real, return_, value)

    # -- policy --------------------------------------------------------------------------------

    def forward(self, obs: Obs) -> tuple[dict[str, Tensor], int]:
        """Runs the policy under the weights lock; returns its checked outputs and the weights version."""
        n = obs.shape[0]
        with self.lock:
            version = self.version
            if self.is_td_module:
                raw = self.policy(TensorDict({"obs": obs}, batch_size=[n], device=self.device))
            else:
                raw = self.policy(obs)
        return self._check_outputs(raw, n), version

    def _check_outputs(self, raw: Any, n: int) -> dict[str, Tensor]:
        if isinstance(raw, TensorDictBase):
            items = {key: raw.get(key) for key in raw.keys() if key != "obs"}
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
        value = items.get("value")
        if value is not None:
            if value.dim() == 2 and value.shape[1] == 1:
                items["value"] = value = value.squeeze(1)
            if value.dim() != 1 or not value.is_floating_point():
                raise ValueError(
                    f"Collector: policy output 'value' has shape {tuple(value.shape)} and dtype {value.dtype}, "
                    f"expected a floating-point tensor of shape ({n},) or ({n}, 1)"
                )
        if self.has_value is None:
            self.has_value = value is not None
        return items


def _explain_env_error(envs: VectorEnv, exc: BaseException) -> BaseException:
    """Returns an error naming the cause where gymnasium's own error does not, else ``exc``.

    A killed AsyncVectorEnv worker reaches the parent as a bare ``EOFError`` or
    ``ConnectionResetError`` and leaves the vector env unable to close; a sub-env
    of a SyncVectorEnv that returns an observation of the wrong shape raises
    "Output array is the wrong shape". Runs only on the error path.
    """
    base = envs.unwrapped
    processes = getattr(base, "processes", None)
    if isinstance(exc, (EOFError, OSError)) and isinstance(processes, list) and not base.closed:
        # The pipe reports EOF a moment before the dead process can be reaped.
        deadline = time.monotonic() + 2.0
        while not (dead := [(i, p) for i, p in enumerate(processes) if p.exitcode is not None]):
            if time.monotonic() > deadline:
                return exc
            time.sleep(0.01)
        _shut_down(base)
        index, process = dead[0]
        code = process.exitcode
        cause = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        error: BaseException = RuntimeError(
            f"Collector: worker process {index} of the {type(base).__name__} (pid {process.pid}) {cause} "
            f"while the collector was stepping the envs; the vector env cannot be used any more and was shut "
            f"down (its other {len(processes) - 1} worker processes terminated)"
        )
        error.__cause__ = exc
        return error
    if isinstance(exc, ValueError) and isinstance(base, SyncVectorEnv):
        # SyncVectorEnv keeps the sub-envs' last observations; if absent, gymnasium's error stands.
        problem = describe_bad_single_obs(base.single_observation_space, list(getattr(base, "_env_obs", ())))
        if problem is not None:
            error = ValueError(f"Collector: {problem} (SyncVectorEnv could not stack the observations: {exc})")
            error.__cause__ = exc
            return error
    return exc


def _shut_down(base: VectorEnv) -> None:
    """Terminates and reaps the worker processes of a broken AsyncVectorEnv and marks it closed.

    gymnasium's own close() raises on a vector env with a dead worker, and its
    ``__del__`` then fails again at garbage collection.
    """
    for process in base.processes:
        if process.is_alive():
            process.terminate()
    for process in base.processes:
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
    for pipe in base.parent_pipes:
        if pipe is not None:
            pipe.close()
    base.closed = True
