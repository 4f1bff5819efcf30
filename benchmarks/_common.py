"""Shared pieces of the benchmarks: the actor-critic every system runs, interleaved timing, machine facts, output."""

from __future__ import annotations

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
    "Session",
    "make_policy",
    "machine_info",
    "run_interleaved",
    "summarize",
    "markdown_table",
    "write_json",
    "quiet_warnings",
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


def write_json(name: str, payload: Mapping[str, Any]) -> Path:
    """Writes ``results/<name>.json`` (NaN as null) and returns its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"

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
