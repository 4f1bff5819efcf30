"""What the collector's account of its time (``collector.stats()``) costs: its clock reads against a step's time.

The account is always on: the collection loop reads the clock around each env call and each forward
(``perf_counter()`` twice, one addition to a running total), a few times per step, and once more at each
batch's start and end. This script measures, in one process, with one torch thread:

- the cost of one timed call: the loop's pattern around a call that does nothing, less the bare call,
  median of many repeats;
- the collector's time per step in lockstep (``backend="thread", prefetch=0``, the benchmarks' 64x64
  actor-critic) on CartPole-v1, the cheapest env step there is, at the shapes where a step costs least
  (N=1 and N=8 envs, T=1 and T=128 steps per batch);
- the account's share: timed calls per step (2: the env's step, which the driver times, and the forward; per
  batch one around the whole batch and one around the bootstrap values' forward, spread over T steps) times
  the cost of one, over the time of a step.

Usage::

    .venv/bin/python benchmarks/stats_overhead.py [--repeats R]

It prints the table and writes it, with the machine and its load, to ``benchmarks/results/stats_overhead.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from time import perf_counter

import gymnasium as gym
import torch

from torch_rollout import Collector
from torch_rollout.loop._stats import Account

from _common import load_line, machine_info, make_policy, write_json

SHAPES = ((1, 1), (8, 1), (1, 128), (8, 128))  # (num_envs, num_steps)
CALLS = 200_000


def _nothing() -> None:
    return None


def timed_call_cost(repeats: int) -> float:
    """Seconds that the account adds to one call: the loop's pattern less the bare call."""
    account = Account()
    bare, timed = [], []
    for _ in range(repeats):
        start = perf_counter()
        for _ in range(CALLS):
            _nothing()
        bare.append(perf_counter() - start)
        start = perf_counter()
        for _ in range(CALLS):
            began = perf_counter()
            _nothing()
            account.env += perf_counter() - began
        timed.append(perf_counter() - start)
    return (statistics.median(timed) - statistics.median(bare)) / CALLS


def step_seconds(num_envs: int, num_steps: int, repeats: int) -> float:
    """The collector's seconds per vector step in lockstep on CartPole-v1 (batches of ``num_steps``)."""
    batches = max(4, 1024 // num_steps)
    policy = make_policy(0, 4, 2)
    times = []
    for _ in range(repeats):
        envs = gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")
        with Collector(envs, policy, num_steps=num_steps, device="cpu", backend="thread", prefetch=0, seed=0) as c:
            it = iter(c)
            next(it)  # warm-up: the first reset and forward
            start = perf_counter()
            for _ in range(batches):
                next(it)
            times.append((perf_counter() - start) / (batches * num_steps))
        envs.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    info = machine_info()
    cost = timed_call_cost(args.repeats)
    print(f"one timed call: {cost * 1e9:.0f} ns (median of {args.repeats} x {CALLS:,} calls, one torch thread)")
    print()
    print("| envs N | steps T | collector per step | account per step | account's share |")
    print("|---:|---:|---:|---:|---:|")
    rows = []
    for num_envs, num_steps in SHAPES:
        step = step_seconds(num_envs, num_steps, args.repeats)
        own = (2 + 2 / num_steps) * cost
        rows.append({"num_envs": num_envs, "num_steps": num_steps, "step_s": step, "account_s": own})
        print(f"| {num_envs} | {num_steps} | {step * 1e6:.1f} us | {own * 1e9:.0f} ns | {100 * own / step:.2f}% |")
    info["date"] = time.strftime("%Y-%m-%d")
    load = load_line(info.get("load_average_1m", float("nan")))
    path = write_json("stats_overhead", {"machine": info, "repeats": args.repeats, "call_s": cost, "rows": rows})
    bound = "the account's share is the upper bound of what it can cost"
    print(f"\n({info['date']}; medians; {load}; {bound}; {path.name})")


if __name__ == "__main__":
    main()
