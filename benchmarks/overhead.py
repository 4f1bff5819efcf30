"""The collector's own work per step: collection on gymnasium's SyncVectorEnv against its serial floor.

The measurement of the collector's bookkeeping: for each case (CartPole-v1
N=8 and N=64, HalfCheetah-v5 N=16), T=128, the benchmarks' 64x64 actor-critic
(a Normal head for Box actions), one torch thread, ``prefetch=0`` on the thread,
so that nothing overlaps and the only question is what the collector adds:

- floor parts: the ``SyncVectorEnv`` stepped alone with pre-drawn actions, and
  the policy's forward alone on recorded observations; the serial floor is their
  serial sum ``1 / (1 / env + 1 / policy)``, which a loop that steps and then
  acts cannot beat;
- a hand-written loop (obs to tensor, forward under ``no_grad``, action to the
  env, nothing stored): what stepping and acting cost in one loop, without any
  bookkeeping;
- ``Collector(backend="thread", prefetch=0)``: rows, masks, episode totals,
  bootstrap values and GAE included.

Systems run interleaved (A B C D A B C D ...), each built afresh per repeat;
frames are env steps x N (reset rows included, as in the floors).

Usage::

    benchmarks/.venv/bin/python benchmarks/overhead.py [--repeats R] [--batches B]
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from envpool_async import GaussianActorCritic

from _common import fmt_rate, make_policy, placement, quiet_warnings, run_interleaved

CASES = (("CartPole-v1", 8), ("CartPole-v1", 64), ("HalfCheetah-v5", 16))
NUM_STEPS = 128


def _envs(env_id: str, num_envs: int, mode: str = "sync") -> gym.vector.VectorEnv:
    return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode=mode)


def _policy(envs: gym.vector.VectorEnv) -> torch.nn.Module:
    obs_dim, space = int(np.prod(envs.single_observation_space.shape)), envs.single_action_space
    if hasattr(space, "n"):
        return make_policy(0, obs_dim, int(space.n))
    return GaussianActorCritic(obs_dim, int(np.prod(space.shape)))


class EnvAlone:
    def __init__(self, env_id: str, num_envs: int) -> None:
        self.envs = _envs(env_id, num_envs)
        self.envs.reset(seed=0)
        self.envs.action_space.seed(0)
        self.actions = [self.envs.action_space.sample() for _ in range(NUM_STEPS)]
        self.frames = NUM_STEPS * num_envs

    def step(self) -> int:
        for action in self.actions:
            self.envs.step(action)
        return self.frames

    def close(self) -> None:
        self.envs.close()


class PolicyAlone:
    def __init__(self, env_id: str, num_envs: int) -> None:
        envs = _envs(env_id, num_envs)
        obs, _ = envs.reset(seed=0)
        envs.action_space.seed(0)
        self.obs = []
        for _ in range(NUM_STEPS):
            self.obs.append(torch.as_tensor(obs, dtype=torch.float32))
            obs, *_ = envs.step(envs.action_space.sample())
        self.policy = _policy(envs)
        envs.close()
        self.frames = NUM_STEPS * num_envs

    def step(self) -> int:
        with torch.no_grad():
            for obs in self.obs:
                self.policy(obs)
        return self.frames

    def close(self) -> None:
        pass


class HandLoop:
    """Obs to tensor, forward, action to the env: the least a loop that acts must do (``mode``: of make_vec)."""

    def __init__(self, env_id: str, num_envs: int, mode: str = "sync") -> None:
        self.envs = _envs(env_id, num_envs, mode)
        self.obs, _ = self.envs.reset(seed=0)
        self.policy = _policy(self.envs)
        self.frames = NUM_STEPS * num_envs

    def step(self) -> int:
        obs = self.obs
        with torch.no_grad():
            for _ in range(NUM_STEPS):
                action = self.policy(torch.as_tensor(obs, dtype=torch.float32))["action"]
                obs, *_ = self.envs.step(action.numpy())
        self.obs = obs
        return self.frames

    def close(self) -> None:
        self.envs.close()


class Collecting:
    """``Collector(backend="thread", prefetch=0)`` (or ``placement``) given the env id: a SyncVectorEnv, or two
    AsyncVectorEnv groups."""

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        double_buffer: bool = False,
        *,
        backend: str = "thread",
        num_workers: int = 1,
        prefetch: int = 0,
    ) -> None:
        from torch_rollout import Collector, double_buffered, gym_envs

        probe = _envs(env_id, 1)
        policy = _policy(probe)
        probe.close()
        envs = double_buffered(env_id) if double_buffer else gym_envs(env_id, vectorization_mode="sync")
        self.collector = Collector(
            envs,
            policy,
            num_envs=num_envs,
            num_steps=NUM_STEPS,
            device="cpu",
            seed=0,
            backend=placement(backend, num_workers),
            prefetch=prefetch,
        )
        self.batches = iter(self.collector)
        self.frames = NUM_STEPS * num_envs

    def step(self) -> int:
        next(self.batches)
        return self.frames

    def close(self) -> None:
        self.collector.close()


def run_case(env_id: str, num_envs: int, repeats: int, batches: int) -> dict[str, Any]:
    factories = {
        "env alone": lambda: EnvAlone(env_id, num_envs),
        "policy forward alone": lambda: PolicyAlone(env_id, num_envs),
        "hand-written loop": lambda: HandLoop(env_id, num_envs),
        "Collector thread, prefetch=0": lambda: Collecting(env_id, num_envs),
    }
    rates = run_interleaved(factories, repeats=repeats, warmup=1, steps=batches, log=lambda _: None)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    serial = 1.0 / (1.0 / medians["env alone"] + 1.0 / medians["policy forward alone"])
    return {"rates": rates, "medians": medians, "serial": serial}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=4, help="timed batches of T * N steps per repeat")
    args = parser.parse_args()
    quiet_warnings()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    results = {case: run_case(*case, args.repeats, args.batches) for case in CASES}
    print(
        f"\nSyncVectorEnv, T={NUM_STEPS}, 64x64 actor-critic, 1 torch thread, {args.repeats} interleaved "
        f"repeats of {args.batches} batches; 1-min load {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the "
        "end\n"
    )
    print("| case | system | frames/s (median) | min - max | x serial floor |")
    print("|:---|:---|---:|---:|---:|")
    for (env_id, num_envs), result in results.items():
        serial = result["serial"]
        for name, values in result["rates"].items():
            median = result["medians"][name]
            spread = f"{fmt_rate(min(values))} - {fmt_rate(max(values))}"
            print(f"| {env_id} N={num_envs} | {name} | {fmt_rate(median)} | {spread} | {median / serial:.2f}x |")
        print(f"| {env_id} N={num_envs} | serial floor (env + policy) | {fmt_rate(serial)} | | 1.00x |")


if __name__ == "__main__":
    main()
