"""Does double-buffering pay on this machine? Hand-written loops, before any collector is built for it.

Three loops step the same env with the benchmarks' 64x64 actor-critic (a Normal
head for Box actions), one torch thread, nothing stored:

- ``SyncVectorEnv``: forward, step, in turn;
- one ``AsyncVectorEnv`` of N worker processes: the same, the envs stepping in
  their processes;
- two ``AsyncVectorEnv`` groups of N/2 double-buffered: the policy acts on one
  group's observations while the other group steps (``step_async`` /
  ``step_wait``), which is what a double-buffered collector would do.

Systems alternate over the repeats, each built afresh; frames are env steps x N.

Usage::

    benchmarks/.venv/bin/python benchmarks/double_buffer.py [--env ID] [--num-envs N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import gymnasium as gym
import numpy as np
import torch

from _common import fmt_rate, make_policy, quiet_warnings
from envpool_async import GaussianActorCritic

NUM_STEPS = 64


def _policy(envs: gym.vector.VectorEnv) -> torch.nn.Module:
    space, obs_dim = envs.single_action_space, int(np.prod(envs.single_observation_space.shape))
    if hasattr(space, "n"):
        return make_policy(0, obs_dim, int(space.n))
    return GaussianActorCritic(obs_dim, int(np.prod(space.shape)))


def _act(policy: torch.nn.Module, obs: np.ndarray) -> np.ndarray:
    return policy(torch.as_tensor(obs, dtype=torch.float32))["action"].numpy()


class Single:
    def __init__(self, env_id: str, num_envs: int, mode: str) -> None:
        self.envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode=mode)
        self.obs, _ = self.envs.reset(seed=0)
        self.policy = _policy(self.envs)

    def run(self) -> None:
        obs = self.obs
        with torch.no_grad():
            for _ in range(NUM_STEPS):
                obs, *_ = self.envs.step(_act(self.policy, obs))
        self.obs = obs

    def close(self) -> None:
        self.envs.close()


class DoubleBuffered:
    def __init__(self, env_id: str, num_envs: int) -> None:
        half = num_envs // 2
        self.groups = [gym.make_vec(env_id, num_envs=half, vectorization_mode="async") for _ in range(2)]
        self.obs = [group.reset(seed=i * half)[0] for i, group in enumerate(self.groups)]
        self.policy = _policy(self.groups[0])

    def run(self) -> None:
        with torch.no_grad():
            for group, obs in zip(self.groups, self.obs):
                group.step_async(_act(self.policy, obs))
            for t in range(NUM_STEPS):
                for i, group in enumerate(self.groups):  # act on one group while the other steps
                    obs, *_ = group.step_wait()
                    if t < NUM_STEPS - 1:
                        group.step_async(_act(self.policy, obs))
                    else:
                        self.obs[i] = obs

    def close(self) -> None:
        for group in self.groups:
            group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="HalfCheetah-v5")
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    quiet_warnings()
    torch.set_num_threads(1)
    env_id, num_envs = args.env, args.num_envs
    systems = {
        "SyncVectorEnv": lambda: Single(env_id, num_envs, "sync"),
        f"AsyncVectorEnv ({num_envs} processes)": lambda: Single(env_id, num_envs, "async"),
        f"double-buffered: 2 x AsyncVectorEnv ({num_envs // 2} processes each)": (
            lambda: DoubleBuffered(env_id, num_envs)
        ),
    }
    load = os.getloadavg()[0]
    rates: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, make in systems.items():
            system = make()
            system.run()  # warm-up
            start = time.perf_counter()
            system.run()
            system.run()
            rates[name].append(2 * NUM_STEPS * num_envs / (time.perf_counter() - start))
            system.close()
    print(f"\n{env_id}, N={num_envs}, T={NUM_STEPS}, 1 torch thread, {args.repeats} repeats; 1-min load {load:.2f} "
          f"at the start, {os.getloadavg()[0]:.2f} at the end\n")  # fmt: skip
    reference = statistics.median(rates["SyncVectorEnv"])
    print("| loop | frames/s (median) | min - max | vs SyncVectorEnv |")
    print("|:---|---:|---:|---:|")
    for name, values in rates.items():
        median = statistics.median(values)
        spread = f"{fmt_rate(min(values))} - {fmt_rate(max(values))}"
        print(f"| {name} | {fmt_rate(median)} | {spread} | {median / reference:.2f}x |")


if __name__ == "__main__":
    main()
