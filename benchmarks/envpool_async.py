"""EnvPool CartPole-v1 through the collector, in sync mode and in async mode (``batch_size < num_envs``).

Issue 12's measurement: N=64 envs, T=128 steps, the benchmarks' 64x64
actor-critic, one torch intra-op thread, ``Collector(backend="thread",
prefetch=0)`` on a live EnvPool. Beside the collector rows, the floors: EnvPool
stepping alone in sync mode with ``num_threads=1`` (pre-drawn actions), the
policy's forward alone on recorded observations, and their serial sum (env then
policy, one after the other: ``1 / (1 / env + 1 / policy)``), which a sync loop
cannot beat; async mode overlaps the two, so its ceiling is the slower one
alone. A hand-written async loop (``recv``, forward, ``send``, no
bookkeeping) shows what the overlap gives without the collector's work.
Systems run interleaved (A B C A B C ...), each built afresh per repeat; the
table gives medians, spreads and ratios to the serial floor.

Usage::

    .venv/bin/python benchmarks/envpool_async.py [--repeats R] [--batches B] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from _common import fmt_rate, make_policy, quiet_warnings, run_interleaved

ENV_ID = "CartPole-v1"
NUM_ENVS, NUM_STEPS = 64, 128
# (batch_size, num_threads) of the async rows: EnvPool's default threads (0: one per core) and one thread.
ASYNC = ((32, 0), (32, 1), (16, 0), (48, 0))


def _pool(batch_size: int = NUM_ENVS, num_threads: int = 0, seed: int = 0) -> Any:
    import envpool

    return envpool.make_gymnasium(ENV_ID, num_envs=NUM_ENVS, batch_size=batch_size, num_threads=num_threads, seed=seed)


class EnvAlone:
    """EnvPool in sync mode, stepped with pre-drawn actions: T steps of N envs."""

    def __init__(self, num_threads: int) -> None:
        self.env = _pool(num_threads=num_threads)
        self.env.reset()
        self.actions = list(np.random.default_rng(0).integers(0, 2, size=(NUM_STEPS, NUM_ENVS)).astype(np.int32))

    def step(self) -> int:
        for action in self.actions:
            self.env.step(action)
        return NUM_STEPS * NUM_ENVS

    def close(self) -> None:
        self.env.close()


class PolicyAlone:
    """The actor-critic's forward alone on T recorded observation batches [N, 4]."""

    def __init__(self) -> None:
        env = _pool()
        obs, _ = env.reset()
        rng = np.random.default_rng(0)
        self.obs = []
        for _ in range(NUM_STEPS):
            self.obs.append(torch.as_tensor(obs))
            obs, *_ = env.step(rng.integers(0, 2, size=NUM_ENVS).astype(np.int32))
        env.close()
        self.policy = make_policy(0)

    def step(self) -> int:
        with torch.no_grad():
            for obs in self.obs:
                self.policy(obs)
        return NUM_STEPS * NUM_ENVS

    def close(self) -> None:
        pass


class HandAsync:
    """A hand-written async loop: recv, forward on the ready envs, send; nothing stored."""

    def __init__(self, batch_size: int, num_threads: int) -> None:
        self.env = _pool(batch_size, num_threads)
        self.env.async_reset()
        self.policy = make_policy(0)
        self.batch_size = batch_size

    def step(self) -> int:
        with torch.no_grad():
            for _ in range(NUM_STEPS * NUM_ENVS // self.batch_size):
                obs, _, _, _, info = self.env.recv()
                action = self.policy(torch.as_tensor(obs))["action"]
                self.env.send(action.numpy(), info["env_id"])
        return NUM_STEPS * NUM_ENVS

    def close(self) -> None:
        self.env.close()


class Collecting:
    """``Collector(backend="thread")`` on a live EnvPool; one step is one batch [T, N]."""

    def __init__(self, batch_size: int, num_threads: int, prefetch: int) -> None:
        from torch_rollout import Collector

        self.env = _pool(batch_size, num_threads)
        self.collector = Collector(
            self.env, make_policy(0), num_steps=NUM_STEPS, backend="thread", device="cpu", prefetch=prefetch
        )
        self.batches = iter(self.collector)

    def step(self) -> int:
        next(self.batches)
        return NUM_STEPS * NUM_ENVS

    def close(self) -> None:
        self.collector.close()
        self.env.close()


def systems(prefetch: int) -> dict[str, Callable[[], Any]]:
    factories: dict[str, Callable[[], Any]] = {
        "env alone (sync, num_threads=1)": lambda: EnvAlone(1),
        "policy forward alone": PolicyAlone,
        f"collector, sync (num_threads=1), prefetch={prefetch}": lambda: Collecting(NUM_ENVS, 1, prefetch),
    }
    for batch_size, threads in ASYNC:
        factories[f"collector, async batch_size={batch_size} num_threads={threads}, prefetch={prefetch}"] = (
            lambda b=batch_size, n=threads: Collecting(b, n, prefetch)
        )
    factories["ref: hand-written async loop, batch_size=32 num_threads=0"] = lambda: HandAsync(32, 0)
    return factories


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8, help="timed batches of T * N steps per repeat")
    parser.add_argument("--prefetch", type=int, default=0)
    args = parser.parse_args()
    quiet_warnings()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rates = run_interleaved(systems(args.prefetch), repeats=args.repeats, warmup=1, steps=args.batches)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    env, policy = medians["env alone (sync, num_threads=1)"], medians["policy forward alone"]
    serial = 1.0 / (1.0 / env + 1.0 / policy)
    ceiling = min(env, policy)
    print(f"\nEnvPool {ENV_ID}, N={NUM_ENVS}, T={NUM_STEPS}, 64x64 actor-critic, 1 torch thread, "
          f"{args.repeats} interleaved repeats of {args.batches} batches; 1-min load {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end")  # fmt: skip
    print(f"serial floor (env + policy, one after the other): {fmt_rate(serial)} frames/s; "
          f"overlap ceiling (the slower alone): {fmt_rate(ceiling)} frames/s = {ceiling / serial:.2f}x the floor\n")  # fmt: skip
    print(f"| {'system':<66} | frames/s (median) | min - max | x serial floor |")
    print(f"|{'-' * 68}|-------------------|-----------|----------------|")
    for name, values in rates.items():
        spread = f"{fmt_rate(min(values))} - {fmt_rate(max(values))}"
        print(f"| {name:<66} | {fmt_rate(medians[name]):>17} | {spread} | {medians[name] / serial:.2f}x |")


if __name__ == "__main__":
    main()
