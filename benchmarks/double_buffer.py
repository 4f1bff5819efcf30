"""Does double-buffering pay on this machine? Hand-written loops and the collector, against the floors.

For each case (HalfCheetah-v5 N=16, CartPole-v1 N=8), T=128, the benchmarks'
64x64 actor-critic (a Normal head for Box actions), one torch thread:

- floors (as in ``overhead.py``): a ``SyncVectorEnv`` stepped alone with
  pre-drawn actions, the policy's forward alone; the serial floor is their
  serial sum ``1 / (1 / env + 1 / policy)``, and the slower of the two alone is
  the ceiling of perfect overlap;
- hand-written loops, nothing stored: ``SyncVectorEnv`` (forward, step, in
  turn); one ``AsyncVectorEnv`` of N worker processes; two ``AsyncVectorEnv``
  groups of N/2 double-buffered, the policy acting on one group's observations
  while the other steps (``step_async`` / ``step_wait``);
- the collector (thread, ``prefetch=0``): on a ``SyncVectorEnv``, and with
  ``double_buffer=True`` (two AsyncVectorEnv groups); and two worker processes
  (``backend="process"``, ``num_workers=2``, ``prefetch=1``) on a
  ``SyncVectorEnv`` of half the envs each: the other way to step on both cores.

Systems run interleaved (A B C ... A B C ...), each built afresh per repeat;
frames are env steps x N. Writes ``results/double_buffer.json``.

Usage::

    benchmarks/.venv/bin/python benchmarks/double_buffer.py [--repeats R] [--batches B] [--case ENV_ID:N ...]
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym
import torch
from overhead import NUM_STEPS, _policy, collecting, env_alone, hand_loop, measure_cases, policy_alone, save

from _common import floor_table, load_line, run_interleaved

CASES = (("HalfCheetah-v5", 16), ("CartPole-v1", 8))
ENV, POLICY, HAND = "env alone (SyncVectorEnv)", "policy forward alone", "hand loop, SyncVectorEnv"


def _act(policy: torch.nn.Module, obs: Any) -> Any:
    return policy(torch.as_tensor(obs, dtype=torch.float32))["action"].numpy()


class HandDoubleBuffered:
    """Two AsyncVectorEnv groups: the policy acts on one group's observations while the other steps."""

    def __init__(self, env_id: str, num_envs: int) -> None:
        half = num_envs // 2
        self.groups = [gym.make_vec(env_id, num_envs=half, vectorization_mode="async") for _ in range(2)]
        self.policy = _policy(self.groups[0])
        with torch.no_grad():
            for i, group in enumerate(self.groups):
                obs, _ = group.reset(seed=i * half)
                group.step_async(_act(self.policy, obs))
        self.frames = NUM_STEPS * num_envs

    def step(self) -> int:
        with torch.no_grad():
            for _ in range(NUM_STEPS):
                for group in self.groups:  # act on one group while the other steps
                    obs, *_ = group.step_wait()
                    group.step_async(_act(self.policy, obs))
        return self.frames

    def close(self) -> None:
        for group in self.groups:
            group.step_wait()
            group.close()


def run_case(env_id: str, num_envs: int, repeats: int, batches: int) -> dict[str, list[float]]:
    half = num_envs // 2
    factories = {
        ENV: lambda: env_alone(env_id, num_envs),
        POLICY: lambda: policy_alone(env_id, num_envs),
        HAND: lambda: hand_loop(env_id, num_envs),
        f"hand loop, AsyncVectorEnv ({num_envs} processes)": lambda: hand_loop(env_id, num_envs, "async"),
        f"hand loop, double-buffered 2 x AsyncVectorEnv ({half} processes each)": (
            lambda: HandDoubleBuffered(env_id, num_envs)
        ),
        "Collector thread prefetch=0, SyncVectorEnv": lambda: collecting(env_id, num_envs, False),
        "Collector thread prefetch=0, double_buffered": lambda: collecting(env_id, num_envs, True),
        # Both cores stepping envs the other way: two worker processes, each with its half and its policy copy.
        "Collector process K=2 prefetch=1, SyncVectorEnv": lambda: collecting(
            env_id, num_envs, backend="process", num_workers=2, prefetch=1
        ),
    }
    return run_interleaved(factories, repeats=repeats, warmup=1, steps=batches, log=lambda _: None)


def main() -> None:
    args, rates, load = measure_cases(__doc__, run_case, CASES, batches=2)
    print(
        f"\nT={NUM_STEPS}, 64x64 actor-critic, 1 torch thread, {args.repeats} interleaved repeats of {args.batches} "
        f"batches, {os.cpu_count()} cores; {load_line(load)}\n"
    )
    print(floor_table(rates, env=ENV, policy=POLICY, versus=HAND, ceiling=True))
    save("double_buffer", args, rates, load)


if __name__ == "__main__":
    main()
