"""The benchmarks' harness: the policies, the floors, the hand-written loops, interleaved timing, tables and results.

Every benchmark script builds its systems from these pieces:

- floors: :class:`EnvAlone` (the env stepped with pre-drawn actions), :class:`PolicyAlone` (the
  forward on recorded observations) and, from one repeat's pair, :func:`with_floors` (their serial
  sum, which a loop that steps and then acts cannot beat, and the slower of the two, the ceiling of
  perfect overlap);
- hand-written loops: :class:`HandLoop` (act and step, nothing stored), :class:`CleanRLRollout`
  (CleanRL's on-policy [T, N] rollout with its loop GAE) and :class:`RingLoop` (CleanRL's and
  FastTD3's off-policy loop into a replay :class:`Ring`);
- sessions around the systems measured: :class:`CollectorSession`, :class:`TorchRLSession`;
- :func:`run_interleaved` (A B C A B C ..., medians and ratios by :func:`summarize`), tables
  (:func:`markdown_table`, :func:`floor_table`) and :func:`write_json` with :func:`machine_info`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

__all__ = [
    "RESULTS_DIR",
    "ActorCritic",
    "CleanRLRollout",
    "CollectorSession",
    "EnvAlone",
    "HandLoop",
    "PolicyAlone",
    "Ring",
    "RingLoop",
    "Session",
    "TorchRLSession",
    "cpu_collector",
    "floor_summary",
    "floor_table",
    "has",
    "recorded_obs",
    "serial_floor",
    "synced",
    "with_floors",
    "make_policy",
    "machine_info",
    "main_of",
    "run_interleaved",
    "summarize",
    "markdown_table",
    "write_json",
    "quiet_warnings",
    "rate_cells",
    "record",
    "fmt_rate",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent

# Every peer's release that the tables name; the ones that failed to install read "missing".
_PACKAGES = ("torch", "tensordict", "gymnasium", "numpy", "torchrl", "stable-baselines3", "rlox", "envpool")


def placement(backend: str, num_workers: int = 1) -> Any:
    """The Collector's ``backend`` for a benchmark's name and worker count: a name, or Processes/Ray of K workers."""
    from torch_rollout import Processes, Ray

    if backend == "process":
        return Processes(num_workers)
    if backend == "ray":
        return Ray(num_workers)
    return backend


def advantages(gamma: float, gae_lambda: float) -> Any:
    """The Collector's ``gae`` argument (torch_rollout.GAE; TorchRL's class of that name is imported as GAE here)."""
    from torch_rollout import GAE

    return GAE(gamma, gae_lambda)


def interleaved_run(doc: str | None, *, default_repeats: int, quick: str) -> tuple[int, bool, float, dict[str, Any]]:
    """The command line of a benchmark of interleaved repeats (``--repeats``, ``--quick``: one short repeat of
    ``quick``, a check), with the peers' warnings silenced and one torch thread: ``(repeats, quick, the 1-min load
    at the start, machine_info())``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"interleaved repeats per shape (default {default_repeats}; 1 quick)"
    )
    parser.add_argument("--quick", action="store_true", help=f"one short repeat of {quick}: a check, not a result")
    args = parser.parse_args()
    quiet_warnings()
    torch.set_num_threads(1)
    return args.repeats or (1 if args.quick else default_repeats), args.quick, os.getloadavg()[0], machine_info()


def quiet_warnings() -> None:
    """Silences the peers' deprecation and gymnasium precision warnings, which would drown the tables."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # inherited by the PPO subprocesses


def _layer(in_features: int, out_features: int, gain: float) -> nn.Linear:
    linear = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(linear.weight, gain)
    nn.init.zeros_(linear.bias)
    return linear


class ActorCritic(nn.Module):
    """The 64x64 tanh actor-critic MLP (separate actor and critic, as in CleanRL, SB3 and rlox defaults).

    It speaks every peer's policy protocol, so all systems run the very same module
    (or, for Stable-Baselines3, an exact copy of its weights):

    - torch_rollout: ``forward(obs) -> {"action", "log_prob", "value"}``;
    - rlox: ``get_action_value``, ``get_action_and_logprob``, ``get_value``;
    - CleanRL-style loops: ``get_action_and_value``.
    """

    def __init__(self, obs_dim: int = 4, n_actions: int = 2, hidden: int = 64) -> None:
        super().__init__()
        sqrt2 = math.sqrt(2.0)
        self.actor = nn.Sequential(
            _layer(obs_dim, hidden, sqrt2),
            nn.Tanh(),
            _layer(hidden, hidden, sqrt2),
            nn.Tanh(),
            _layer(hidden, n_actions, 0.01),
        )
        self.critic = nn.Sequential(
            _layer(obs_dim, hidden, sqrt2), nn.Tanh(), _layer(hidden, hidden, sqrt2), nn.Tanh(), _layer(hidden, 1, 1.0)
        )

    def get_action_value(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples actions for ``obs`` [N, obs_dim]; returns action [N], log_prob [N], value [N]."""
        dist = torch.distributions.Categorical(logits=self.actor(obs), validate_args=False)
        action = dist.sample()
        return action, dist.log_prob(action), self.critic(obs).squeeze(-1)

    # CleanRL's name for the same call
    get_action_and_value = get_action_value

    def get_action_and_logprob(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rlox's protocol: action [N] and log_prob [N]."""
        action, log_prob, _ = self.get_action_value(obs)
        return action, log_prob

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        """State values [N]."""
        return self.critic(obs).squeeze(-1)

    def get_logprob_and_entropy(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rlox's loss protocol: log_prob and entropy of ``actions`` under the current weights."""
        dist = torch.distributions.Categorical(logits=self.actor(obs), validate_args=False)
        return dist.log_prob(actions), dist.entropy()

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """torch_rollout's policy contract."""
        action, log_prob, value = self.get_action_value(obs)
        return {"action": action, "log_prob": log_prob, "value": value}


def make_policy(seed: int = 0, obs_dim: int = 4, n_actions: int = 2) -> ActorCritic:
    """The benchmark's actor-critic with weights drawn from ``seed`` (identical for every system)."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    policy = ActorCritic(obs_dim, n_actions)
    torch.random.set_rng_state(generator_state)
    return policy


class Session(Protocol):
    """One system, built and ready: ``step()`` does one unit of work and returns how many items it produced."""

    def step(self) -> int: ...

    def close(self) -> None: ...


def run_interleaved(
    factories: Mapping[str, Callable[[], Session]],
    *,
    repeats: int,
    warmup: int,
    steps: int,
    log: Callable[[str], None] = print,
) -> dict[str, list[float]]:
    """Times every system in turn, A B C A B C ..., and returns items/s per system per repeat.

    Each repeat builds the system afresh (untimed), runs ``warmup`` untimed steps, then
    times ``steps`` steps. Building afresh keeps a background collector from working
    ahead while another system is being timed.
    """
    rates: dict[str, list[float]] = {name: [] for name in factories}
    for repeat in range(repeats):
        for name, factory in factories.items():
            session = factory()
            try:
                for _ in range(warmup):
                    session.step()
                items = 0
                start = time.perf_counter()
                for _ in range(steps):
                    items += session.step()
                elapsed = time.perf_counter() - start
            finally:
                session.close()
            rates[name].append(items / elapsed)
            log(f"  repeat {repeat + 1}/{repeats}  {name:<40} {fmt_rate(items / elapsed)}/s")
    return rates


def summarize(
    samples: Mapping[str, Sequence[float]], reference: str, *, higher_is_better: bool = True
) -> list[dict[str, Any]]:
    """Median, spread and ratio to ``reference`` per system.

    ``ratio`` > 1 always means "faster than the reference": rates are divided by the
    reference's rate, times divide the reference's time.
    """
    ref = statistics.median(samples[reference]) if samples.get(reference) else math.nan
    rows = []
    for name, values in samples.items():
        med = statistics.median(values)
        ratio = med / ref if higher_is_better else ref / med
        rows.append(
            {
                "system": name,
                "median": med,
                "min": min(values),
                "max": max(values),
                "repeats": len(values),
                "ratio": ratio,
            }
        )
    return rows


def fmt_rate(value: float) -> str:
    """1234567 -> '1.23 M'; keeps the tables narrow."""
    for limit, suffix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, load, torch build and every peer's version, for the tables' header."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "missing"
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": versions,
    }
    if hasattr(os, "getloadavg"):
        # the machines these run on are often shared: a high load explains noisy medians
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    return info


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; the first column left-aligned, the rest right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# What benchmarks/run.py sets while its parts run: they then write run_<name>.json, so that a whole run leaves
# the records of the single scripts (which other docs pages cite) as they were
RECORD_PREFIX = ""


def write_json(name: str, payload: Mapping[str, Any]) -> Path:
    """Writes ``results/<RECORD_PREFIX><name>.json`` (NaN as null) and returns its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{RECORD_PREFIX}{name}.json"

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, Mapping):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        if isinstance(value, np.generic):
            return clean(value.item())
        return value

    path.write_text(json.dumps(clean(dict(payload)), indent=2) + "\n")
    return path


def run_worker(
    script: str, args: Sequence[str], *, what: str, env: Mapping[str, str], timeout: float
) -> dict[str, Any]:
    """Runs ``script`` with ``args`` in a fresh interpreter; returns the last JSON line it printed.

    ``what`` names the worker in the error raised when it fails or prints no JSON (with the end of its stderr).
    """
    proc = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, env=dict(env)
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def has(module: str) -> bool:
    """Whether ``module`` can be imported here (the peers are optional)."""
    return importlib.util.find_spec(module) is not None


def float_obs(obs: Any) -> torch.Tensor:
    """Observations as the float32 tensor a policy takes."""
    return torch.as_tensor(obs, dtype=torch.float32)


def synced(frames: int, device: Any) -> int:
    """``frames``, once the device has finished the work queued for them (CUDA runs asynchronously)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return frames


def _close(thing: Any) -> None:
    close = getattr(thing, "close", None)
    if close is not None:
        close()


# ------------------------------------------------------------------------------ floors


SERIAL_FLOOR = "floor: serial sum (env + policy)"
OVERLAP_CEILING = "ceiling: perfect overlap (slower of the two)"


class EnvAlone:
    """An env stepped alone with pre-drawn actions: no collector can beat this on the same env.

    ``step`` replaces ``env.step`` (rlox's ``step_all``); ``device``: synchronised before the clock reads.
    """

    def __init__(
        self, env: Any, actions: Sequence[Any], *, num_envs: int, step: Callable | None = None, device: Any = None
    ) -> None:
        self.env, self.actions, self.device = env, list(actions), device
        self._step = step or env.step
        self.frames = len(self.actions) * num_envs

    def step(self) -> int:
        for action in self.actions:
            self._step(action)
        return synced(self.frames, self.device)

    def close(self) -> None:
        _close(self.env)


def recorded_obs(
    env: Any, first_obs: Any, actions: Sequence[Any], convert: Callable[[Any], torch.Tensor] = float_obs
) -> list[torch.Tensor]:
    """The observations of stepping ``env`` with ``actions`` from ``first_obs``: T tensors [N, ...]."""
    obs, recorded = first_obs, []
    for action in actions:
        recorded.append(convert(obs))
        obs = env.step(action)[0]
    return recorded


class PolicyAlone:
    """The policy's forward alone (sample, log-prob, value) on recorded observation batches."""

    def __init__(self, policy: Callable, obs: Sequence[torch.Tensor], *, num_envs: int, device: Any = None) -> None:
        self.policy, self.obs, self.device = policy, list(obs), device
        self.frames = len(self.obs) * num_envs

    def step(self) -> int:
        with torch.no_grad():
            for obs in self.obs:
                self.policy(obs)
        return synced(self.frames, self.device)

    def close(self) -> None:
        pass


def serial_floor(env: float, policy: float) -> float:
    """The rate of a loop that steps and then acts, from the rates of each alone: ``1 / (1 / env + 1 / policy)``."""
    return 1.0 / (1.0 / env + 1.0 / policy)


def with_floors(rates: Mapping[str, list[float]], env: str, policy: str) -> dict[str, list[float]]:
    """``rates`` and, per repeat from that repeat's env and policy floors, their serial sum and the slower one."""
    pairs = list(zip(rates[env], rates[policy], strict=True))
    return {
        **rates,
        SERIAL_FLOOR: [serial_floor(e, p) for e, p in pairs],
        OVERLAP_CEILING: [min(e, p) for e, p in pairs],
    }


def floor_summary(rates: Mapping[str, list[float]], env: str, policy: str) -> dict[str, Any]:
    """The rates, their medians and the serial floor of the medians of ``env`` and ``policy``, for a results file."""
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {"rates": dict(rates), "medians": medians, "serial": serial_floor(medians[env], medians[policy])}


# ------------------------------------------------------------------------------ hand-written loops


class HandLoop:
    """Obs to tensor, forward under ``no_grad``, action to the env: the least a loop that acts must do."""

    def __init__(self, env: Any, policy: Callable, first_obs: Any, *, num_steps: int, num_envs: int) -> None:
        self.env, self.policy, self.obs, self.num_steps = env, policy, first_obs, num_steps
        self.frames = num_steps * num_envs

    def step(self) -> int:
        obs = self.obs
        with torch.no_grad():
            for _ in range(self.num_steps):
                action = self.policy(float_obs(obs))["action"]
                obs, *_ = self.env.step(action.numpy())
        self.obs = obs
        return self.frames

    def close(self) -> None:
        _close(self.env)


class CleanRLRollout:
    """The rollout CleanRL's ppo.py writes: preallocated float32 [T, N] buffers, done = terminated | truncated,
    Python-loop GAE at the end.

    Like CleanRL on gymnasium 1.x (and on EnvPool) it runs in NEXT_STEP mode and treats reset rows
    as transitions; ``step`` counts only the real ones. ``agent`` speaks CleanRL's
    ``get_action_and_value`` and ``get_value``.
    """

    def __init__(
        self,
        env: Any,
        agent: Any,
        first_obs: Any,
        *,
        num_steps: int,
        num_envs: int,
        gamma: float = 0.99,
        gae_lambda: float = 0.95,
    ) -> None:
        self.env, self.agent = env, agent
        self.num_steps, self.num_envs, self.gamma, self.gae_lambda = num_steps, num_envs, gamma, gae_lambda
        self.next_obs = float_obs(first_obs)
        self.obs = torch.zeros((num_steps, *self.next_obs.shape))  # [T, N, *obs_shape]
        self.actions = torch.zeros(num_steps, num_envs, dtype=torch.long)
        self.log_probs, self.rewards, self.dones, self.values, self.advantages = (
            torch.zeros(num_steps, num_envs) for _ in range(5)
        )
        self.next_done = torch.zeros(num_envs)

    def step(self) -> int:
        for t in range(self.num_steps):
            self.obs[t] = self.next_obs
            self.dones[t] = self.next_done
            with torch.no_grad():
                action, log_prob, value = self.agent.get_action_and_value(self.next_obs)
            self.actions[t], self.log_probs[t], self.values[t] = action, log_prob, value
            next_obs, reward, terminated, truncated, _ = self.env.step(action.numpy())
            self.rewards[t] = float_obs(reward)
            self.next_obs = float_obs(next_obs)
            self.next_done = float_obs(np.logical_or(terminated, truncated))
        with torch.no_grad():
            next_value = self.agent.get_value(self.next_obs)
            last = torch.zeros(self.num_envs)
            for t in reversed(range(self.num_steps)):
                if t == self.num_steps - 1:
                    not_done, bootstrap = 1.0 - self.next_done, next_value
                else:
                    not_done, bootstrap = 1.0 - self.dones[t + 1], self.values[t + 1]
                delta = self.rewards[t] + self.gamma * bootstrap * not_done - self.values[t]
                self.advantages[t] = last = delta + self.gamma * self.gae_lambda * not_done * last
            self.returns = self.advantages + self.values
        # dones[t] is the previous step's done: in NEXT_STEP mode row t only reset the env
        return int(self.num_steps * self.num_envs - self.dones.sum().item())

    def close(self) -> None:
        _close(self.env)


RING_KEYS = ("obs", "action", "reward", "next_obs", "terminated")  # in the order of Ring.write


class Ring:
    """A replay ring of preallocated tensors, whole batches copied in with ``copy_``.

    ``capacity`` is rounded down to whole batches of ``batch_frames``, so a write never wraps.
    """

    def __init__(self, capacity: int, batch_frames: int, obs_dim: int, device: Any = "cpu") -> None:
        self.capacity = max(capacity // batch_frames, 1) * batch_frames
        self.obs = torch.zeros(self.capacity, obs_dim, device=device)
        self.next_obs = torch.zeros(self.capacity, obs_dim, device=device)
        self.action = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.reward = torch.zeros(self.capacity, device=device)
        self.terminated = torch.zeros(self.capacity, dtype=torch.bool, device=device)
        self.pos = 0

    def write(self, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any) -> None:
        """Copies transitions [B] in."""
        n = obs.shape[0]
        pos, self.pos = self.pos, (self.pos + n) % self.capacity
        for key, src in zip(RING_KEYS, (obs, action, reward, next_obs, terminated), strict=True):
            getattr(self, key)[pos : pos + n].copy_(src)


class RingLoop:
    """The off-policy hand loop into a :class:`Ring`: act, step, the true next observations, the ring write.

    CleanRL's DQN shape for NumPy envs in SAME_STEP mode (the final observations patched in from
    ``infos["final_obs"]``), FastTD3's for torch envs (``torch.where(ended, final_obs, next_obs)`` on
    the device). ``steps``: vector steps per ``step()``.
    """

    def __init__(self, env: Any, policy: Callable, ring: Ring, *, steps: int, frames: int, device: Any = None) -> None:
        self.env, self.policy, self.ring, self.steps, self.frames, self.device = (
            env,
            policy,
            ring,
            steps,
            frames,
            device,
        )
        self.obs, _ = env.reset(seed=0)
        self.numpy = isinstance(self.obs, np.ndarray)

    def step(self) -> int:
        obs, ring = self.obs, self.ring
        with torch.no_grad():
            for _ in range(self.steps):
                if self.numpy:
                    obs_t = torch.as_tensor(obs)
                    action = self.policy(obs_t)["action"]
                    next_obs, reward, terminated, _, infos = self.env.step(action.numpy())
                    real_next_obs = next_obs.copy()
                    if "_final_obs" in infos:  # CleanRL's patch: the final observations of the ended envs
                        for idx in np.flatnonzero(infos["_final_obs"]):
                            real_next_obs[idx] = infos["final_obs"][idx]
                    ring.write(*(torch.as_tensor(x) for x in (obs_t, action, reward, real_next_obs, terminated)))
                else:
                    action = self.policy(obs)["action"]
                    next_obs, reward, terminated, _, infos = self.env.step(action)
                    real_next_obs = torch.where(infos["_final_obs"][:, None], infos["final_obs"], next_obs)
                    ring.write(obs, action, reward, real_next_obs, terminated)
                obs = next_obs
        self.obs = obs
        return synced(self.frames, self.device)

    def close(self) -> None:
        _close(self.env)


# ------------------------------------------------------------------------------ the systems measured


class CollectorSession:
    """A torch_rollout Collector, one batch per ``step()``.

    ``step`` returns the batch's real transitions (its ``mask``), or ``frames`` when given (every
    row, as the floors count). ``owned``: what to close after the collector (a live env).
    """

    def __init__(self, collector: Any, *, frames: int | None = None, owned: Any = None, device: Any = None) -> None:
        self.collector, self.frames, self.owned, self.device = collector, frames, owned, device
        self.batches = iter(collector)

    def step(self) -> int:
        self.last = next(self.batches)  # TensorDict [T, N]
        if self.frames is None:
            return int(self.last["mask"].sum())
        return synced(self.frames, self.device)

    def close(self) -> None:
        self.collector.close()
        _close(self.owned)


class TorchRLSession:
    """TorchRL's ``Collector`` on ``env``, then its ``GAE`` module (running ``critic``) on each batch [N, T].

    As TorchRL's PPO recipes do: the actor writes action and log-prob, the GAE module runs the
    critic over the batch's observations and next observations. Every row is a transition.
    """

    def __init__(
        self, env: Any, actor: Any, critic: Any, *, frames_per_batch: int, gamma: float, gae_lambda: float
    ) -> None:
        from torchrl.collectors import Collector
        from torchrl.objectives.value import GAE

        self.collector = Collector(env, actor, frames_per_batch=frames_per_batch, total_frames=-1, device="cpu")
        self.gae = GAE(gamma=gamma, lmbda=gae_lambda, value_network=critic, average_gae=False)
        self.batches = iter(self.collector)

    def step(self) -> int:
        self.last = batch = next(self.batches)  # TensorDict [N, T]
        with torch.no_grad():
            self.gae(batch)
        return batch.numel()

    def close(self) -> None:
        self.collector.shutdown()


# ------------------------------------------------------------------------------ tables


def floor_table(
    cases: Mapping[str, Mapping[str, list[float]]],
    *,
    env: str,
    policy: str,
    versus: str | None = None,
    ceiling: bool = False,
) -> str:
    """One Markdown table of several cases' rates: medians, ranges, the ratio to each case's serial floor
    (from its ``env`` and ``policy`` rows' medians) and, with ``versus``, to that system's median."""
    header = ["case", "system", "frames/s (median)", "min - max", "x serial floor"]
    header += [f"x {versus}"] if versus else []
    rows = []
    for case, rates in cases.items():
        medians = {name: statistics.median(values) for name, values in rates.items()}
        serial = serial_floor(medians[env], medians[policy])
        for name, values in rates.items():
            row = [case, name, fmt_rate(medians[name]), f"{fmt_rate(min(values))} - {fmt_rate(max(values))}"]
            row.append(f"{medians[name] / serial:.2f}x")
            rows.append(row + ([f"{medians[name] / medians[versus]:.2f}x"] if versus else []))
        rows.append([case, "serial floor (env + policy)", fmt_rate(serial), "", "1.00x"] + ([""] if versus else []))
        if ceiling:
            slower = min(medians[env], medians[policy])
            row = [case, "ceiling: the slower alone (perfect overlap)", fmt_rate(slower), "", f"{slower / serial:.2f}x"]
            rows.append(row + ([""] if versus else []))
    return markdown_table(header, rows)


def load_line(start: float) -> str:
    """The 1-min load average at the start (``start``) and now: how much else ran meanwhile."""
    return f"1-min load {start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"


def main_of(
    doc: str,
    run: Callable[..., dict[str, Any]],
    to_markdown: Callable[[dict[str, Any]], str],
    *options: tuple[str, dict[str, Any]],
    quick: str = "one short repeat: checks that every system runs",
    repeats: str | None = "interleaved repeats",
) -> None:
    """A script's command line: ``--quick``, ``--repeats`` (unless None) and ``options`` (flag, ``add_argument``
    keywords), each flag named as ``run``'s keyword; prints ``to_markdown(run(...))``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=None, help=repeats)
    for flag, kwargs in options:
        parser.add_argument(flag, **kwargs)
    print(to_markdown(run(**vars(parser.parse_args()))))


def record(name: str, results: dict[str, Any], *, quick: bool = False) -> dict[str, Any]:
    """Writes ``results`` to ``results/<name>.json`` (``<name>_quick.json`` for a quick run) and returns them."""
    write_json(f"{name}_quick" if quick else name, results)
    return results


def rate_cells(row: Mapping[str, Any]) -> list[str]:
    """A :func:`summarize` row's system, median, range and ratio, as table cells."""
    spread = f"{fmt_rate(row['min'])} - {fmt_rate(row['max'])}"
    return [row["system"], fmt_rate(row["median"]), spread, f"{row['ratio']:.2f}x"]


def cpu_collector(
    envs: Any, policy: Any, *, owned: Any = None, backend: str = "thread", num_workers: int = 1, **options: Any
) -> CollectorSession:
    """A :class:`CollectorSession` of torch_rollout's Collector on the CPU with GAE(0.99, 0.95), as the
    collection benchmarks run it; ``backend`` and ``num_workers`` name its placement, ``options`` go to it."""
    from torch_rollout import Collector

    gae = advantages(0.99, 0.95)
    collector = Collector(envs, policy, gae=gae, device="cpu", backend=placement(backend, num_workers), **options)
    return CollectorSession(collector, owned=owned)
