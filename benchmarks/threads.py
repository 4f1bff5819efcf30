"""The thread backend under torch's default intra-op threads versus ``torch.set_num_threads(1)``.

The other benchmarks pin torch to one intra-op thread. A user who does not gets
torch's default (one per core), and once the main thread has run backward
passes its OpenMP team exists and may spin while the collector thread runs the
policy. This measures what that costs: ``Collector(backend="thread")`` with
prefetch 0 and 1 on a CartPole-v1 ``SyncVectorEnv``, N=64, T=128, the
benchmarks' 64x64 actor-critic, each setting in a fresh process where
``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` are unset, after the main thread
ran a few forward and backward passes of a 64x64 MLP. Processes alternate
(default, 1, default, 1, ...); the table gives medians and the ratio
default / 1 thread (> 1: the default is faster).

Usage::

    benchmarks/.venv/bin/python benchmarks/threads.py [--quick] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import fmt_rate, machine_info, markdown_table, quiet_warnings, record, run_worker

__all__ = ["run", "to_markdown", "SETTINGS"]

SETTINGS = ("default", "1")  # torch intra-op threads: torch's own choice, or set_num_threads(1)
PREFETCHES = (0, 1)
NUM_ENVS, NUM_STEPS = 64, 128
_WORKER_TIMEOUT_S = 300


def worker(setting: str, timed: int, seed: int = 0) -> dict[str, Any]:
    """In a fresh process: warm the main thread's autograd, then time the thread backend at both prefetches."""
    import functools

    import gymnasium as gym
    import torch

    from torch_rollout import Collector

    from _common import make_policy

    if setting == "1":
        torch.set_num_threads(1)
    # what a trainer has done before it asks for the next batch: backward passes on the main thread
    torch.manual_seed(seed)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    x = torch.randn(256, 64)
    for _ in range(5):
        mlp(x).square().mean().backward()
    rates = {}
    for prefetch in PREFETCHES:
        envs = functools.partial(gym.make_vec, "CartPole-v1", vectorization_mode="sync")(NUM_ENVS)
        collector = Collector(
            envs, make_policy(seed), num_steps=NUM_STEPS, backend="thread", prefetch=prefetch, device="cpu", seed=seed
        )
        try:
            batches = iter(collector)
            next(batches)  # warm-up
            items = 0
            start = time.perf_counter()
            for _ in range(timed):
                items += int(next(batches)["mask"].sum())
            rates[str(prefetch)] = items / (time.perf_counter() - start)
        finally:
            collector.close()
            envs.close()
    return {"rates": rates, "torch_threads": torch.get_num_threads()}


def _run_worker(setting: str, timed: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONWARNINGS"] = "ignore"
    args = ["--worker", setting, "--timed", str(timed)]
    return run_worker(__file__, args, what=f"threads worker {setting}", env=env, timeout=_WORKER_TIMEOUT_S)


def run(*, quick: bool = False, repeats: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Alternates the two settings over ``repeats`` fresh processes each; writes results/threads.json.

    Args:
        quick: one repeat of one timed batch per prefetch.
        repeats: processes per setting (default 1 quick, 3 full).
        log: where progress lines go.
    """
    quiet_warnings()
    repeats = repeats or (1 if quick else 3)
    timed = 1 if quick else 3
    samples: dict[str, dict[str, list[float]]] = {s: {str(p): [] for p in PREFETCHES} for s in SETTINGS}
    threads: dict[str, int] = {}
    log(f"threads: thread backend, CartPole N={NUM_ENVS} T={NUM_STEPS}, {repeats} repeat(s), {timed} timed batch(es)")
    for repeat in range(repeats):
        for setting in SETTINGS:
            result = _run_worker(setting, timed)
            threads[setting] = result["torch_threads"]
            for prefetch, rate in result["rates"].items():
                samples[setting][prefetch].append(rate)
            rates = ", ".join(f"prefetch={p}: {fmt_rate(r)}/s" for p, r in result["rates"].items())
            log(f"  repeat {repeat + 1}/{repeats}  {setting} ({result['torch_threads']} threads)  {rates}")
    rows = []
    for prefetch in map(str, PREFETCHES):
        default, one = (statistics.median(samples[s][prefetch]) for s in SETTINGS)
        rows.append(
            {
                "prefetch": int(prefetch),
                "default_threads": threads["default"],
                "default": default,
                "one": one,
                "default_range": [min(samples["default"][prefetch]), max(samples["default"][prefetch])],
                "one_range": [min(samples["1"][prefetch]), max(samples["1"][prefetch])],
                "ratio": default / one,
            }
        )
    results = {
        "machine": machine_info(),
        "config": {"num_envs": NUM_ENVS, "num_steps": NUM_STEPS, "repeats": repeats, "timed": timed, "quick": quick},
        "samples": samples,
        "rows": rows,
    }
    return record("threads", results, quick=quick)


def to_markdown(results: dict[str, Any]) -> str:
    """The thread-settings table."""
    cfg = results["config"]
    rows = [
        [
            f"thread, prefetch={r['prefetch']}",
            f"{fmt_rate(r['default'])} ({r['default_threads']} threads)",
            f"{fmt_rate(r['one'])}",
            f"{r['ratio']:.2f}x",
        ]
        for r in results["rows"]
    ]
    title = (
        f"**Thread backend: torch's default intra-op threads vs set_num_threads(1), CartPole-v1 "
        f"T={cfg['num_steps']} x N={cfg['num_envs']}** (transitions/s, median of {cfg['repeats']})"
    )
    header = ["collector", "default threads", "1 thread", "default / 1 thread"]
    return f"{title}\n\n{markdown_table(header, rows)}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--timed", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        quiet_warnings()
        print(json.dumps(worker(args.worker, args.timed)))
        return
    print(to_markdown(run(quick=args.quick, repeats=args.repeats)))


if __name__ == "__main__":
    main()
