"""Fixtures of the reliability tests: counting, faulty and misbehaving envs, test policies, resource probes."""

from __future__ import annotations

import gc
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv
from torch import nn

from torch_rollout import Collector

__all__ = [
    "AUTORESET_MODES",
    "BLOCK_RELEASE",
    "GC_ARMED",
    "GC_GO",
    "ActionEchoEnv",
    "BadObsVectorEnv",
    "BlockingPolicy",
    "ConstantPolicy",
    "EnvFault",
    "FaultyEnv",
    "GcPolicy",
    "ImageEnv",
    "PolicyFault",
    "RaisingPolicy",
    "SlowReadPolicy",
    "Snapshot",
    "child_pids",
    "close_envs",
    "collect_error",
    "collector_threads",
    "copy_reason",
    "faulty_fns",
    "faulty_vec",
    "make_vec",
    "open_fds",
    "os_threads",
    "read_pid",
    "rss_bytes",
    "take",
    "wait_until",
    "warm_up_multiprocessing",
    "write_pid",
]

AUTORESET_MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]

# The pytest process: FaultyEnv refuses to SIGKILL itself here (only inside an AsyncVectorEnv worker).
# Kept in the environment so that worker processes, which import this module anew, see it too.
_MAIN_PID = int(os.environ.setdefault("TORCH_ROLLOUT_TESTS_MAIN_PID", str(os.getpid())))
# Released by a test to let a FaultyEnv(fault="step_blocks") in this process return from step.
BLOCK_RELEASE = threading.Event()


class EnvFault(RuntimeError):
    """Raised by FaultyEnv; a type of its own so that tests can tell it from anything else."""


class PolicyFault(RuntimeError):
    """Raised by RaisingPolicy."""


def make_vec(
    cls: type[VectorEnv], fns: list[Callable[[], gym.Env]], mode: AutoresetMode = AutoresetMode.NEXT_STEP
) -> VectorEnv:
    """Builds a Sync or Async vector env of ``fns`` in autoreset ``mode``."""
    return cls(fns, autoreset_mode=mode)


# -- faulty env ------------------------------------------------------------------------------------


class FaultyEnv(gym.Env):
    """A 3-float observation, two actions, episodes of ``episode_length`` steps, and one fault.

    ``fault`` happens at the ``at``-th call (1-based) of ``step`` (or of ``reset``
    for ``"reset_raises"``), counted over the env's lifetime:

    - ``"step_raises"`` / ``"reset_raises"``: raise EnvFault.
    - ``"step_blocks"``: block until BLOCK_RELEASE is set (never, in a worker process).
    - ``"sigkill"``: the process kills itself with SIGKILL (an AsyncVectorEnv worker only).
    - ``"nan_obs"``, ``"inf_obs"``, ``"nan_reward"``, ``"inf_reward"``: that value.
    - ``"obs_shape"``: an observation of shape (4,) instead of (3,).

    ``marker``: a file that the fault writes its process's pid to, just before it happens.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        index: int = 0,
        *,
        fault: str | None = None,
        at: int = 1,
        episode_length: int = 5,
        marker: str | None = None,
    ) -> None:
        self.index = index
        self.fault = fault
        self.marker = marker
        self.at = at
        self.episode_length = episode_length
        self.observation_space = spaces.Box(-np.inf, np.inf, (3,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.steps = 0
        self.resets = 0
        self.t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.index, self.t, self.steps], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.resets += 1
        if self.fault == "reset_raises" and self.resets == self.at:
            raise EnvFault(f"reset {self.resets} of env {self.index} failed")
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.steps += 1
        self.t += 1
        obs, reward = self._obs(), 1.0
        if self.steps == self.at:
            if self.marker is not None:
                write_pid(self.marker)
            if self.fault == "step_raises":
                raise EnvFault(f"step {self.steps} of env {self.index} failed")
            if self.fault == "step_blocks":
                # "Forever" for the collector; bounded so that a broken test cannot hang the suite.
                if os.getpid() == _MAIN_PID:
                    BLOCK_RELEASE.wait(600)
                else:  # a worker process: until terminated
                    time.sleep(3600)
            elif self.fault == "sigkill":
                if os.getpid() == _MAIN_PID:
                    raise EnvFault("fault='sigkill' only runs inside a worker process")
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.fault in ("nan_obs", "inf_obs"):
                obs[1] = np.nan if self.fault == "nan_obs" else -np.inf
            elif self.fault in ("nan_reward", "inf_reward"):
                reward = np.nan if self.fault == "nan_reward" else np.inf
            elif self.fault == "obs_shape":
                obs = np.zeros(4, dtype=np.float32)
        return obs, reward, self.t == self.episode_length, False, {}


class ActionEchoEnv(gym.Env):
    """Observes the last action it received, flattened into 4 floats: what the env really got."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, action_space: spaces.Space) -> None:
        self.action_space = action_space
        self.observation_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return np.full(4, -9.0, dtype=np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs = np.full(4, -9.0, dtype=np.float32)
        flat = np.asarray(action, dtype=np.float32).ravel()
        obs[: flat.size] = flat
        return obs, 0.0, False, False, {}


class ImageEnv(gym.Env):
    """A uint8 observation of ``size`` bytes (Atari's 4x84x84 frame stack is 28,224), two actions, 10-step episodes.

    For tests of memory: a batch of ``T x N`` rows holds ``T x N x size`` bytes of observations.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, size: int = 28_224) -> None:
        self.observation_space = spaces.Box(0, 255, (size,), np.uint8)
        self.action_space = spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(self.observation_space.shape, dtype=np.uint8), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        return np.full(self.observation_space.shape, self.t, dtype=np.uint8), 1.0, self.t == 10, False, {}


def faulty_fns(num_envs: int, faulty_index: int = 0, **fault: Any) -> list[Callable[[], gym.Env]]:
    """Env factories of ``num_envs`` FaultyEnvs, ``faulty_index`` with ``fault``, the others healthy."""
    return [partial(FaultyEnv, i, **(fault if i == faulty_index else {})) for i in range(num_envs)]


def faulty_vec(
    num_envs: int,
    start_index: int = 0,
    *,
    faulty_index: int = 0,
    cls: Callable[[list[Callable[[], gym.Env]]], VectorEnv] = SyncVectorEnv,
    **fault: Any,
) -> VectorEnv:
    """FaultyEnvs ``start_index ..`` as a vector env, the one of global index ``faulty_index`` with ``fault``.

    A picklable recipe for worker processes (with partial), like counting_vec.
    """
    return cls(faulty_fns(start_index + num_envs, faulty_index, **fault)[start_index:])


class BadObsVectorEnv(VectorEnv):
    """A hand-written vector env (no Sync/Async checks in between) that misbehaves at step ``at``.

    ``fault``: ``"shape"`` (obs [N, 4] for a (3,) space), ``"dtype_float_for_uint8"``
    (float64 obs for a uint8 space), ``"float64"`` (float64 obs for a float32
    space: harmless, must work), ``"reversed"`` (a view with negative strides:
    must work) or ``"list"`` (nested lists: must work).
    """

    metadata: dict[str, Any] = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, num_envs: int = 2, *, fault: str, at: int = 3, mode: AutoresetMode = AutoresetMode.NEXT_STEP):
        self.num_envs = num_envs
        self.fault = fault
        self.at = at
        dtype = np.uint8 if fault == "dtype_float_for_uint8" else np.float32
        self.single_observation_space = spaces.Box(0, 255, (3,), dtype)
        self.single_action_space = spaces.Discrete(2)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.metadata = {"autoreset_mode": mode}
        self.steps = 0
        self.t = np.zeros(num_envs, dtype=np.int64)
        self.mode = mode

    def _obs(self) -> Any:
        base = np.stack([np.arange(self.num_envs), self.t, np.full(self.num_envs, self.steps)], axis=1)
        obs = base.astype(self.single_observation_space.dtype)
        if self.steps >= self.at:
            if self.fault == "shape":
                return np.zeros((self.num_envs, 4), dtype=np.float32)
            if self.fault == "dtype_float_for_uint8":
                return base.astype(np.float64) + 0.5
            if self.fault == "float64":
                return base.astype(np.float64)
            if self.fault == "reversed":
                return np.ascontiguousarray(obs[::-1, ::-1])[::-1, ::-1]
            if self.fault == "list":
                return obs.tolist()
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        mask = None if options is None else options.get("reset_mask")
        self.t[slice(None) if mask is None else mask] = 0
        return self._obs(), {}

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict]:
        self.steps += 1
        self.t += 1
        end = self.t >= 4
        obs = self._obs()
        if self.mode == AutoresetMode.NEXT_STEP:
            self.t[end] = 0  # simplified: the reset happens within this step
        return obs, np.ones(self.num_envs), end, np.zeros(self.num_envs, dtype=bool), {}


# -- policies --------------------------------------------------------------------------------------


def write_pid(path: str) -> bool:
    """Writes this process's pid to a new file ``path``; False (nothing written) when the file exists already."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def read_pid(path: str, timeout: float = 60.0) -> int:
    """The pid that :func:`write_pid` wrote to ``path``, waiting for it at most ``timeout`` s."""
    assert wait_until(lambda: os.path.exists(path) and os.path.getsize(path) > 0, timeout), f"{path} never written"
    with open(path) as f:
        return int(f.read())


class ConstantPolicy(nn.Module):
    """Action 0 and value 0 for every env; ``make`` overrides what the outputs look like.

    ``pause`` seconds of sleep per call make collection slower than consumption.
    """

    def __init__(self, make: Callable[[int], dict[str, torch.Tensor]] | None = None, *, pause: float = 0.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.make = make
        self.pause = pause

    def forward(self, obs: Any) -> dict[str, torch.Tensor]:
        n = obs.shape[0]
        if self.pause:
            time.sleep(self.pause)
        if self.make is not None:
            return self.make(n)
        return {"action": torch.zeros(n, dtype=torch.long), "value": torch.zeros(n) + self.w}


class RaisingPolicy(ConstantPolicy):
    """Raises PolicyFault on its ``at``-th call (1-based)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.calls = 0

    def forward(self, obs: Any) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls == self.at:
            raise PolicyFault(f"policy call {self.calls} failed")
        return super().forward(obs)


# GcPolicy: set ARMED before building the collector; its first forward waits for GO, then collects garbage.
GC_ARMED = threading.Event()
GC_GO = threading.Event()


class GcPolicy(ConstantPolicy):
    """Runs ``gc.collect()`` on the collector's own thread, once, when the test says so."""

    def forward(self, obs: Any) -> dict[str, torch.Tensor]:
        if GC_ARMED.is_set():
            GC_ARMED.clear()
            GC_GO.wait(60)
            gc.collect()
        return super().forward(obs)


class SlowReadPolicy(nn.Module):
    """Reads its ``k`` scalar weights one at a time with a pause in between and reports them all.

    Output ``"weights"`` is ``[N, k]``: a row whose entries differ was computed
    from a mix of two weight versions.
    """

    def __init__(self, k: int = 4, pause: float = 0.0005) -> None:
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.zeros(())) for _ in range(k)])
        self.pause = pause

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        n = obs.shape[0]
        seen = []
        for w in self.ws:
            seen.append(w.detach().clone())
            time.sleep(self.pause)
        weights = torch.stack(seen).expand(n, -1)
        return {"action": torch.zeros(n, dtype=torch.long), "value": weights[:, 0].clone(), "weights": weights}


# -- resource probes -------------------------------------------------------------------------------


def collector_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torch_rollout-collector"]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def child_pids() -> set[int]:
    """Pids of this process's children, zombies included (a child nobody reaped is a leak too)."""
    me = os.getpid()
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # Fields after the ")" that closes the command name: state, ppid, ...
        if int(stat.rpartition(")")[2].split()[1]) == me:
            children.add(int(entry))
    return children


def _fd_targets() -> set[str]:
    targets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # the directory listing's own descriptor, closed by now
            pass
    return targets


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def os_threads() -> int:
    """Threads of this process as the kernel counts them (Python's and native ones)."""
    return len(os.listdir("/proc/self/task"))


def copy_reason(placement: dict[str, Any], prefetch: int) -> tuple[str, str]:
    """How errors about the collector's copy of the policy name why it exists, and how to act without one."""
    backend = placement["backend"]
    if backend != "thread":  # Processes(K) or Ray(K)
        return f"backend={backend.name!r}", "backend='thread' with prefetch=0"
    return f"prefetch={prefetch}", "prefetch=0"


def close_envs(envs: Any) -> None:
    """Closes the vector env a test gave the thread; worker processes close the envs they built themselves."""
    if isinstance(envs, VectorEnv):
        envs.close()


class BlockingPolicy(ConstantPolicy):
    """ConstantPolicy that, in its ``block_at``-th call in a process, blocks "forever" (until killed).

    Only the first process to get there blocks: it writes its pid to ``<marker_dir>/inside`` on entering
    (:func:`write_pid`). Every process writes its pid to ``<marker_dir>/pid-<pid>`` at its first call.
    """

    def __init__(self, marker_dir: str, *, block_at: int | None = None) -> None:
        super().__init__()
        self.marker_dir = marker_dir
        self.block_at = block_at
        self.calls = 0

    def forward(self, obs: Any) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls == 1:
            write_pid(os.path.join(self.marker_dir, f"pid-{os.getpid()}"))
        if self.calls == self.block_at and write_pid(os.path.join(self.marker_dir, "inside")):
            time.sleep(600)  # "forever" for the collector; bounded so that a broken test cannot hang the suite
        return super().forward(obs)


def collect_error(envs: Any, policy: nn.Module | None = None, **kwargs: Any) -> pytest.ExceptionInfo:
    """The ValueError that iterating a collector on ``envs`` ends with; the collector is closed by then.

    A vector env given to the thread is closed afterwards with a plain
    ``close()``, which warns (an error in this suite) if the failure left a call
    pending in it; worker processes close the envs they built from a recipe.
    """
    kwargs = {"num_steps": 4, "device": "cpu", "timeout": 60.0, **kwargs}
    collector = Collector(envs, policy or ConstantPolicy(), **kwargs)
    try:
        with pytest.raises(ValueError) as info:
            for _ in take(collector):
                pass
        assert collector.closed
    finally:
        collector.close()
        if isinstance(envs, VectorEnv):
            envs.close()
    return info


def take(collector: Any, limit: int = 50) -> Any:
    """At most ``limit`` batches: a collector that fails to raise fails the test instead of looping on."""
    return itertools.islice(collector, limit)


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.02) -> bool:
    """Polls ``predicate`` every ``interval`` s until it holds or ``timeout`` s pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return predicate()
        time.sleep(interval)
    return True


class Snapshot:
    """Python threads, child processes and open file descriptors of this process at one moment."""

    def __init__(self) -> None:
        self.threads = {t.ident for t in threading.enumerate()}
        self.children = child_pids()
        self.fds = open_fds()
        self.fd_targets = _fd_targets()

    def leaks(self) -> dict[str, Any]:
        """What exists now and did not at the snapshot (empty when back to it)."""
        now = Snapshot()
        leaks: dict[str, Any] = {}
        threads = [t.name for t in threading.enumerate() if t.ident not in self.threads]
        if threads:
            leaks["threads"] = threads
        if now.children - self.children:
            leaks["children"] = sorted(now.children - self.children)
        if now.fds > self.fds:
            leaks["fds"] = f"{self.fds} -> {now.fds}: {sorted(_fd_targets() - self.fd_targets)}"
        return leaks

    def assert_no_leaks(self, timeout: float = 30.0) -> None:
        """Waits (bounded) for threads and processes being torn down, then asserts nothing leaked.

        Drop the references to envs and collectors first: a closed AsyncVectorEnv
        keeps its pipes' file descriptors until it is garbage collected.
        """
        gc.collect()
        wait_until(lambda: not self.leaks(), timeout)
        leaks = self.leaks()
        assert not leaks, f"left behind: {leaks}"


def warm_up_multiprocessing() -> None:
    """Builds one AsyncVectorEnv so that process-lifetime resources exist before any Snapshot.

    The first shared-memory allocation opens multiprocessing's heap arena (two
    file descriptors kept for the life of the process); that is not a leak.
    """
    envs = AsyncVectorEnv(faulty_fns(1))
    envs.reset(seed=0)
    envs.close()


# Env ids for collectors that build (and own) their envs: healthy, blocking in the third step, and large observations.
_IDS = {
    "torch_rollout_tests/Faulty-v0": {},
    "torch_rollout_tests/FaultyBlockingAt3-v0": {"fault": "step_blocks", "at": 3},
}
for _id, _kwargs in _IDS.items():
    if _id not in gym.registry:
        gym.register(_id, entry_point=FaultyEnv, kwargs=_kwargs, disable_env_checker=True)
if "torch_rollout_tests/Image-v0" not in gym.registry:
    gym.register("torch_rollout_tests/Image-v0", entry_point=ImageEnv, disable_env_checker=True)
