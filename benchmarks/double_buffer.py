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
frames are env steps x N.

Usage::

    benchmarks/.venv/bin/python benchmarks/double_buffer.py [--repeats R] [--batches B] [--case ENV_ID:N ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import gymnasium as gym
import torch
from overhead import NUM_STEPS, Collecting, EnvAlone, HandLoop, PolicyAlone, _policy

from _common import fmt_rate, quiet_warnings, run_interleaved

CASES = (("HalfCheetah-v5", 16), ("CartPole-v1", 8))


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


def run_case(env_id: str, num_envs: int, repeats: int, batches: int) -> dict[str, Any]:
    half = num_envs // 2
    factories = {
        "env alone (SyncVectorEnv)": lambda: EnvAlone(env_id, num_envs),
        "policy forward alone": lambda: PolicyAlone(env_id, num_envs),
        "hand loop, SyncVectorEnv": lambda: HandLoop(env_id, num_envs),
        f"hand loop, AsyncVectorEnv ({num_envs} processes)": lambda: HandLoop(env_id, num_envs, "async"),
        f"hand loop, double-buffered 2 x AsyncVectorEnv ({half} processes each)": (
            lambda: HandDoubleBuffered(env_id, num_envs)
        ),
        "Collector thread prefetch=0, SyncVectorEnv": lambda: Collecting(env_id, num_envs, False),
        "Collector thread prefetch=0, double_buffered": lambda: Collecting(env_id, num_envs, True),
        # Both cores stepping envs the other way: two worker processes, each with its half and its policy copy.
        "Collector process K=2 prefetch=1, SyncVectorEnv": lambda: Collecting(
            env_id, num_envs, backend="process", num_workers=2, prefetch=1
        ),
    }
    rates = run_interleaved(factories, repeats=repeats, warmup=1, steps=batches, log=lambda _: None)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    env, policy = medians["env alone (SyncVectorEnv)"], medians["policy forward alone"]
    return {"rates": rates, "medians": medians, "serial": 1.0 / (1.0 / env + 1.0 / policy), "ceiling": min(env, policy)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=2, help="timed batches of T * N steps per repeat")
    parser.add_argument("--case", action="append", help="ENV_ID:N (repeatable); default: the cases above")
    args = parser.parse_args()
    cases = [(case.split(":")[0], int(case.split(":")[1])) for case in args.case] if args.case else CASES
    quiet_warnings()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    results = {case: run_case(*case, args.repeats, args.batches) for case in cases}
    print(
        f"\nT={NUM_STEPS}, 64x64 actor-critic, 1 torch thread, {args.repeats} interleaved repeats of {args.batches} "
        f"batches, {os.cpu_count()} cores; 1-min load {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the "
        "end\n"
    )
    print("| case | system | frames/s (median) | min - max | x serial floor | x SyncVectorEnv hand loop |")
    print("|:---|:---|---:|---:|---:|---:|")
    for (env_id, num_envs), result in results.items():
        serial, medians = result["serial"], result["medians"]
        hand = medians["hand loop, SyncVectorEnv"]
        for name, values in result["rates"].items():
            median = medians[name]
            spread = f"{fmt_rate(min(values))} - {fmt_rate(max(values))}"
            print(
                f"| {env_id} N={num_envs} | {name} | {fmt_rate(median)} | {spread} | {median / serial:.2f}x "
                f"| {median / hand:.2f}x |"
            )
        print(f"| {env_id} N={num_envs} | serial floor (env + policy) | {fmt_rate(serial)} | | 1.00x | |")
        ceiling = result["ceiling"]
        print(
            f"| {env_id} N={num_envs} | ceiling: the slower alone (perfect overlap) | {fmt_rate(ceiling)} | "
            f"| {ceiling / serial:.2f}x | |"
        )


if __name__ == "__main__":
    main()
