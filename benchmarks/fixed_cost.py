"""Where the collector's own microseconds go, part by part, at a short batch (T=1) and a long one (T=128).

The off-policy shape of ``offpolicy.py``: gymnasium's CartPole-v1 in SAME_STEP mode with N=4 envs, a
64x64 Q-network acting greedily, next observations on, ``backend="thread", prefetch=0``, one torch
thread, each batch's rows written into a ``ReplayRing`` by ``ring.fill(collector)``. Each part of the
work is timed by wrapping the function that does it with a clock; the parts nest (the env's step
inside the driver's ``recv``, the policy's forward inside the acting side's checks), so each gets its
own time: its time less that of the parts inside it. The wrappers cost time themselves (a few tenths
of a microsecond a call, and they disturb the caches), so the parts add up to more than the run without
them, which is printed too, beside a CleanRL-style hand loop writing the same rows into a ring of
tensors. Medians of the repeats, each a fresh collector.

Then the collector's own time without wrappers: the same collector and ring on a vector env whose step
returns the same arrays (an episode end every 50th step) and a policy that returns the same action, so
that nearly all the time is the collector's, at T=1, 8 and 128.

Usage::

    .venv/bin/python benchmarks/fixed_cost.py [--repeats R] [--envs N]

It prints a Markdown table and writes it to ``benchmarks/results/fixed_cost.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from offpolicy import QNetwork, gym_envs
from torch import nn

from torch_rollout import BatchKeys, Collector, ReplayRing
from torch_rollout.envs._numpy import NumpyEnvs
from torch_rollout.envs._spaces import ActionConverter
from torch_rollout.loop import _rollout
from torch_rollout.loop._acting import Acting
from torch_rollout.loop._recycle import RowRing
from torch_rollout.loop._rollout import RolloutLoop
from torch_rollout.loop._rows import HostRows
from torch_rollout.placements._thread import InlinePlacement

from _common import Ring, RingLoop, load_line, machine_info, markdown_table, write_json

# (owner, function, the part it is): the function's own time, less the parts called inside it.
PARTS = (
    (ReplayRing, "_write", "ring: a batch's rows written into the ring"),
    (ReplayRing, "_take", "ring: the loop's rows copied into the ring"),
    (_rollout, "host_batch", "batch end: the loop's rows offered to the ring"),
    (Collector, "__next__", "trainer side: next() around the placement"),
    (Collector, "update_policy", "trainer side: the weight refresh"),
    (InlinePlacement, "_collect", "placement: contexts (no_grad, Ctrl-C hold), hand-off"),
    (RolloutLoop, "collect", "loop: a batch's start and end"),
    (RolloutLoop, "_new_rows", "rows: taken back for writing (or made)"),
    (RowRing, "deliver", "batch: the TensorDict of views handed out"),
    (RolloutLoop, "_deliver", "batch end: done, next observations, bootstraps"),
    (RolloutLoop, "_interact", "loop: a step's glue"),
    (RolloutLoop, "_act_on_every_env", "loop: a step's glue"),
    (RolloutLoop, "_decide", "loop: a step's glue"),
    (_rollout, "run_steps", "loop: a step's glue"),
    (Acting, "act", "acting: the policy's outputs checked"),
    (Acting, "_call", "acting: the forward's lock, modes and input checks"),
    (NumpyEnvs, "send", "driver: the actions checked and converted"),
    (ActionConverter, "__call__", "driver: the actions checked and converted"),
    (NumpyEnvs, "recv", "driver: the step's results (checks, episode totals, final observations)"),
    (NumpyEnvs, "step_into_rows", "driver: the step's results (checks, episode totals, final observations)"),
    (HostRows, "put_obs", "rows: observations written"),
    (HostRows, "put_acted", "rows: outputs and versions written"),
    (HostRows, "put_plain", "rows: outputs and versions written"),
    (HostRows, "put_results", "rows: rewards, flags, totals written"),
    (HostRows, "put_final", "rows: final observations kept"),
)
ENV_PART, POLICY_PART = "env: envs.step", "policy: its forward"


class Clocks:
    """Own seconds per part: each wrapped call's time less the wrapped calls inside it."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self.stack: list[float] = []  # time spent in nested parts, per open call

    def wrap(self, function: Callable[..., Any], part: str) -> Callable[..., Any]:
        own, stack = self.own, self.stack

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack.append(0.0)
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                took = time.perf_counter() - began
                inner = stack.pop()
                own[part] += took - inner
                if stack:
                    stack[-1] += took

        return timed


def run_collector(q: QNetwork, num_envs: int, num_steps: int, batches: int, clocks: Clocks | None) -> float:
    """Seconds per batch of ``ring.fill(collector)``, its first batch left out; ``clocks``: the parts timed."""
    envs = gym_envs(num_envs)
    if clocks is not None:
        envs.step = clocks.wrap(envs.step, ENV_PART)
    return fill_seconds(envs, q, num_steps, batches, warmup=1, seed=1, clocks=clocks)


def fill_seconds(
    envs: Any, policy: Any, num_steps: int, batches: int, *, warmup: int, seed: int, clocks: Clocks | None = None
) -> float:
    """Seconds per batch of ``ring.fill(collector)`` (thread, ``prefetch=0``), ``warmup`` batches left out."""
    collector = Collector(
        envs, policy, num_steps=num_steps, gae=None, keys=BatchKeys(next_obs=True), backend="thread", prefetch=0,
        seed=seed,
    )  # fmt: skip
    filling = ReplayRing(100_000).fill(collector)
    for _ in range(warmup):
        next(filling)
    if clocks is not None:
        clocks.own.clear()
    began = time.perf_counter()
    for _ in range(batches):
        next(filling)
    took = (time.perf_counter() - began) / batches
    collector.close()
    return took


def timed_run(q: QNetwork, num_envs: int, num_steps: int, batches: int) -> tuple[float, dict[str, float]]:
    """A run with every part wrapped: seconds per batch, and each part's own seconds per batch."""
    clocks = Clocks()
    # The parts this version of the package has (an earlier one, for a before-and-after, lacks some).
    parts = [(owner, name, part) for owner, name, part in PARTS if hasattr(owner, name)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in parts]
    forward = QNetwork.forward
    try:
        for owner, name, part in parts:
            setattr(owner, name, clocks.wrap(getattr(owner, name), part))
        QNetwork.forward = clocks.wrap(forward, POLICY_PART)  # type: ignore[method-assign]
        took = run_collector(q, num_envs, num_steps, batches, clocks)
    finally:
        for owner, name, function in saved:
            setattr(owner, name, function)
        QNetwork.forward = forward  # type: ignore[method-assign]
    return took, {part: seconds / batches for part, seconds in clocks.own.items()}


def hand_loop(q: QNetwork, num_envs: int, steps: int) -> float:
    """Seconds per step of a CleanRL-style loop writing the same rows into a ring of tensors."""
    loop = RingLoop(gym_envs(num_envs), q, Ring(100_000, num_envs, 4), steps=steps, frames=steps * num_envs)
    loop.step()  # warm-up
    began = time.perf_counter()
    loop.step()
    took = (time.perf_counter() - began) / steps
    loop.close()
    return took


class FreeEnvs(gym.vector.VectorEnv):
    """A vector env that costs nothing: each step returns the same arrays (an episode end every 50th step).

    What the collector does around its steps (checks, episode totals, rows, final observations) is the
    same as for CartPole; the time of a run with it is the collector's own.
    """

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.single_observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.obs = np.zeros((num_envs, 4), np.float32)
        self.reward = np.ones(num_envs, np.float32)
        self.no = np.zeros(num_envs, bool)
        self.yes = np.ones(num_envs, bool)
        self.final = {"final_obs": np.array(list(self.obs), dtype=object), "_final_obs": self.yes}
        self.steps = 0

    def reset(self, *, seed: Any = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        return self.obs, {}

    def step(self, actions: Any) -> tuple[Any, ...]:
        self.steps += 1
        if self.steps % 50:
            return self.obs, self.reward, self.no, self.no, {}
        return self.obs, self.reward, self.yes, self.no, self.final


class FreePolicy(nn.Module):
    """A policy that costs nothing: the same action tensor every call."""

    def __init__(self, num_envs: int) -> None:
        super().__init__()
        self.action = torch.zeros(num_envs, dtype=torch.int64)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": self.action}


def own_cost(num_envs: int, num_steps: int, frames: int) -> float:
    """Seconds per batch of ``ring.fill(collector)`` on :class:`FreeEnvs` with :class:`FreePolicy`."""
    batches = max(frames // (num_envs * num_steps), 8)
    return fill_seconds(FreeEnvs(num_envs), FreePolicy(num_envs), num_steps, batches, warmup=2, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--envs", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = os.getloadavg()[0]
    info = machine_info()
    torch.manual_seed(0)
    q = QNetwork()
    N = args.envs
    results: dict[str, Any] = {}
    for T in (1, 128):
        batches = max(8, 3072 // T)
        parts: dict[str, list[float]] = defaultdict(list)
        wrapped, bare, hand = [], [], []
        for _ in range(args.repeats):
            hand.append(hand_loop(q, N, batches * T) * T)
            bare.append(run_collector(q, N, T, batches, None))
            took, own = timed_run(q, N, T, batches)
            wrapped.append(took)
            for part, seconds in own.items():
                parts[part].append(seconds)
        results[f"T={T}"] = {
            "batch_s": statistics.median(bare),
            "wrapped_batch_s": statistics.median(wrapped),
            "hand_batch_s": statistics.median(hand),
            "parts_batch_s": {part: statistics.median(values) for part, values in parts.items()},
        }
    print(to_markdown(results, N))
    own = {}
    for T in (1, 8, 128):
        own[f"T={T}"] = statistics.median(own_cost(N, T, 48_000 if T > 1 else 16_000) for _ in range(args.repeats))
    print("\nThe collector's own time, a free env and a free policy (us per batch, per step):\n")
    print(
        markdown_table(
            ["T", "us per batch", "us per step"],
            [[k, f"{v * 1e6:.1f}", f"{v * 1e6 / int(k[2:]):.1f}"] for k, v in own.items()],
        )
    )
    info["date"] = time.strftime("%Y-%m-%d")
    payload = {"machine": info, "repeats": args.repeats, "num_envs": N, "results": results, "own_batch_s": own}
    path = write_json("fixed_cost", payload)
    print(f"\n({info['date']}; medians of {args.repeats}; {load_line(started)}; {path.name})")


def to_markdown(results: dict[str, Any], num_envs: int) -> str:
    """Each part's microseconds per batch and per step, at each T; the totals below."""
    order = [ENV_PART, POLICY_PART, *dict.fromkeys(part for _, _, part in PARTS)]
    header = ["part"]
    for key in results:
        header += [f"{key}: us per batch", f"{key}: us per step"]
    steps = {key: int(key.partition("=")[2]) for key in results}
    rows = []
    for part in order:
        row: list[Any] = [part]
        for key, result in results.items():
            seconds = result["parts_batch_s"].get(part, 0.0)
            row += [f"{seconds * 1e6:.1f}", f"{seconds * 1e6 / steps[key]:.1f}"]
        rows.append(row)
    for label, field in (
        ("the run with the wrappers", "wrapped_batch_s"),
        ("the run without wrappers", "batch_s"),
        ("hand loop, the same rows", "hand_batch_s"),
    ):
        row = [f"**{label}**"]
        for key, result in results.items():
            row += [f"{result[field] * 1e6:.1f}", f"{result[field] * 1e6 / steps[key]:.1f}"]
        rows.append(row)
    return f"N={num_envs}\n\n" + markdown_table(header, rows)


if __name__ == "__main__":
    main()
