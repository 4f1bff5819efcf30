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

    benchmarks/.venv/bin/python benchmarks/overhead.py [--repeats R] [--batches B] [--case ENV_ID:N ...]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from envpool_async import GaussianActorCritic

from _common import (
    CollectorSession,
    EnvAlone,
    HandLoop,
    PolicyAlone,
    floor_table,
    load_line,
    machine_info,
    make_policy,
    placement,
    quiet_warnings,
    recorded_obs,
    run_interleaved,
    write_json,
)

CASES = (("CartPole-v1", 8), ("CartPole-v1", 64), ("HalfCheetah-v5", 16))
NUM_STEPS = 128
ENV, POLICY = "env alone", "policy forward alone"


def _envs(env_id: str, num_envs: int, mode: str = "sync") -> gym.vector.VectorEnv:
    return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode=mode)


def _policy(envs: gym.vector.VectorEnv) -> torch.nn.Module:
    obs_dim, space = int(np.prod(envs.single_observation_space.shape)), envs.single_action_space
    if hasattr(space, "n"):
        return make_policy(0, obs_dim, int(space.n))
    return GaussianActorCritic(obs_dim, int(np.prod(space.shape)))


def env_alone(env_id: str, num_envs: int) -> EnvAlone:
    """The ``SyncVectorEnv`` stepped alone with T pre-drawn actions."""
    envs = _envs(env_id, num_envs)
    envs.reset(seed=0)
    envs.action_space.seed(0)
    return EnvAlone(envs, [envs.action_space.sample() for _ in range(NUM_STEPS)], num_envs=num_envs)


def policy_alone(env_id: str, num_envs: int) -> PolicyAlone:
    """The policy's forward alone on T observation batches recorded with random actions."""
    envs = _envs(env_id, num_envs)
    first, _ = envs.reset(seed=0)
    envs.action_space.seed(0)
    obs = recorded_obs(envs, first, [envs.action_space.sample() for _ in range(NUM_STEPS)])
    policy = _policy(envs)
    envs.close()
    return PolicyAlone(policy, obs, num_envs=num_envs)


def hand_loop(env_id: str, num_envs: int, mode: str = "sync") -> HandLoop:
    """Obs to tensor, forward, action to the env (``mode``: of make_vec)."""
    envs = _envs(env_id, num_envs, mode)
    first, _ = envs.reset(seed=0)
    return HandLoop(envs, _policy(envs), first, num_steps=NUM_STEPS, num_envs=num_envs)


def collecting(
    env_id: str,
    num_envs: int,
    double_buffer: bool = False,
    *,
    backend: str = "thread",
    num_workers: int = 1,
    prefetch: int = 0,
) -> CollectorSession:
    """``Collector(backend="thread", prefetch=0)`` (or ``placement``) given the env id: a SyncVectorEnv, or two
    AsyncVectorEnv groups."""
    from torch_rollout import Collector, double_buffered, gym_envs

    probe = _envs(env_id, 1)
    policy = _policy(probe)
    probe.close()
    envs = double_buffered(env_id) if double_buffer else gym_envs(env_id, vectorization_mode="sync")
    collector = Collector(
        envs,
        policy,
        num_envs=num_envs,
        num_steps=NUM_STEPS,
        device="cpu",
        seed=0,
        backend=placement(backend, num_workers),
        prefetch=prefetch,
    )
    return CollectorSession(collector, frames=NUM_STEPS * num_envs)


def run_case(env_id: str, num_envs: int, repeats: int, batches: int) -> dict[str, list[float]]:
    factories = {
        ENV: lambda: env_alone(env_id, num_envs),
        POLICY: lambda: policy_alone(env_id, num_envs),
        "hand-written loop": lambda: hand_loop(env_id, num_envs),
        "Collector thread, prefetch=0": lambda: collecting(env_id, num_envs),
    }
    return run_interleaved(factories, repeats=repeats, warmup=1, steps=batches, log=lambda _: None)


def measure_cases(
    doc: str, run_case: Callable[..., dict[str, list[float]]], cases: Sequence[tuple[str, int]], *, batches: int
) -> tuple[argparse.Namespace, dict[str, Any], float]:
    """The command line (``--repeats``, ``--batches``, ``--case``), then every case's rates, one torch thread;
    returns the arguments, the rates by case and the 1-min load at the start."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=batches, help="timed batches of T * N steps per repeat")
    parser.add_argument("--case", action="append", help="ENV_ID:N (repeatable); default: the cases above")
    args = parser.parse_args()
    if args.case:
        cases = [(case.split(":")[0], int(case.split(":")[1])) for case in args.case]
    quiet_warnings()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    return args, {f"{env_id} N={n}": run_case(env_id, n, args.repeats, args.batches) for env_id, n in cases}, load


def save(name: str, args: argparse.Namespace, cases: dict[str, Any], load: float) -> None:
    """Writes ``results/<name>.json``: the machine, the run's settings and every case's rates."""
    config = {"T": NUM_STEPS, "repeats": args.repeats, "batches": args.batches, "load_1m_start": load}
    write_json(name, {"machine": machine_info(), "config": config, "cases": cases})


def main() -> None:
    args, cases, load = measure_cases(__doc__, run_case, CASES, batches=4)
    print(
        f"\nSyncVectorEnv, T={NUM_STEPS}, 64x64 actor-critic, 1 torch thread, {args.repeats} interleaved "
        f"repeats of {args.batches} batches; {load_line(load)}\n"
    )
    print(floor_table(cases, env=ENV, policy=POLICY))
    save("overhead", args, cases, load)


if __name__ == "__main__":
    main()
