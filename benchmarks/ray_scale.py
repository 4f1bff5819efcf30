"""Scaling out: the Ray backend against worker processes with K = 1, 2, 4, 8 workers, and what a batch's trip costs.

The env is slow on purpose: its ``step`` sleeps ``--step-ms`` (1 ms) per env, so
collection is bound by env time rather than by the 2 cores, and more workers
help even here, as they would on a cluster. Two measurements:

1. Throughput: frames/s of ``backend="ray"`` and ``backend="process"`` with the
   same K, N = 16 envs split across the K workers, T = 32, prefetch 1, the
   64x64 actor-critic; systems interleaved, every repeat built afresh, medians.
2. Transport: per batch, the time from the end of a worker's last env step
   (stamped into that step's reward, ``time.monotonic()`` is system-wide) to
   ``next()`` returning it in the trainer, in lockstep (``prefetch=0``, so that
   the batch never waits in a queue). It holds the worker's bootstrap forward,
   the batch's trip, the concatenation and GAE; the thread's row, where the
   batch makes no trip, is the floor. Measured for CartPole-sized rows and for
   Atari-sized uint8 84x84x4 observations.

Usage (the project's own venv; Ray from ``pip install -e '.[ray]'``)::

    .venv/bin/python benchmarks/ray_scale.py [--quick] [--repeats 3] [--step-ms 1.0]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from torch_rollout import Collector

from _common import fmt_rate, machine_info, make_policy, markdown_table, placement, run_interleaved, write_json

T, N = 32, 16


class SlowEnv(gym.Env):
    """Sleeps ``step_ms`` per step; the reward is the time the step ended (seconds since ``base``, float32)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, *, step_ms: float, base: float, obs_shape: tuple[int, ...] = (4,), dtype: Any = np.float32):
        self.observation_space = gym.spaces.Box(0, 255, obs_shape, dtype)
        self.action_space = gym.spaces.Discrete(2)
        self.obs = np.zeros(obs_shape, dtype)
        self.step_s = step_ms / 1000.0
        self.base = base
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return self.obs, {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        time.sleep(self.step_s)
        self.t += 1
        return self.obs, time.monotonic() - self.base, False, self.t == 200, {}


def slow_envs(num_envs: int, **kwargs: Any) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv([functools.partial(SlowEnv, **kwargs) for _ in range(num_envs)])


class PixelPolicy(torch.nn.Module):
    """The actor-critic on 4 numbers of an image observation: the trip of the pixels is what is measured."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_policy()

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.body(obs[:, 0, 0, :4].float())


class CollectorSession:
    """One collector; ``step()`` is one ``next()`` and returns its frames."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def step(self) -> int:
        batch = next(self.collector)
        return batch.batch_size.numel()

    def close(self) -> None:
        self.collector.close()


def collector(
    backend: str, k: int, *, num_envs: int, prefetch: int | None, step_ms: float, base: float, pixels: bool = False
) -> Collector:
    options: dict[str, Any] = {"step_ms": step_ms, "base": base}
    if pixels:
        options.update(obs_shape=(4, 84, 84), dtype=np.uint8)
    recipe = functools.partial(slow_envs, **options)
    policy: torch.nn.Module = PixelPolicy() if pixels else make_policy()
    if backend == "thread":
        return Collector(
            recipe(num_envs), policy, num_steps=T, device="cpu", seed=0, prefetch=prefetch, backend="thread"
        )
    return Collector(
        recipe,
        policy,
        num_envs=num_envs,
        num_steps=T,
        device="cpu",
        seed=0,
        prefetch=prefetch,
        backend=placement(backend, k),
    )


def throughput(args: argparse.Namespace) -> dict[str, list[float]]:
    factories = {}
    for k in args.workers:
        for backend in ("ray", "process"):
            factories[f"{backend} K={k}"] = functools.partial(
                lambda b, k: CollectorSession(
                    collector(b, k, num_envs=N, prefetch=1, step_ms=args.step_ms, base=time.monotonic())
                ),
                backend,
                k,
            )
    return run_interleaved(factories, repeats=args.repeats, warmup=2, steps=args.batches)


def transport(args: argparse.Namespace) -> dict[str, list[float]]:
    """Latency samples (ms) per system: from a worker's last env step of a batch to ``next()`` returning it."""
    systems = {
        "thread (no trip: the floor)": ("thread", 1),
        "process K=2": ("process", 2),
        "ray K=2": ("ray", 2),
    }
    samples: dict[str, list[float]] = {}
    for pixels, num_envs in ((False, N), (True, 8)):
        for repeat in range(args.repeats):
            for label, (backend, k) in systems.items():
                name = f"{label}, {'uint8 4x84x84' if pixels else 'float32 4'} obs, {T}x{num_envs}"
                base = time.monotonic()
                with collector(
                    backend, k, num_envs=num_envs, prefetch=0, step_ms=args.step_ms, base=base, pixels=pixels
                ) as c:
                    for i in range(2 + args.batches):
                        batch = next(c)
                        received = time.monotonic() - base
                        if i >= 2:  # after a warm-up
                            last_step = float(batch["reward"][-1].max())
                            samples.setdefault(name, []).append((received - last_step) * 1000.0)
                print(
                    f"  repeat {repeat + 1}/{args.repeats}  {name:<60} "
                    f"{statistics.median(samples[name][-args.batches :]):.2f} ms"
                )
    return samples


def batch_bytes(pixels: bool, num_envs: int) -> int:
    obs = 4 * 84 * 84 if pixels else 4 * 4
    # obs, action (int64), log_prob, value, reward, next_value (float32), 4 bools, 2 stats, policy_version
    return T * num_envs * (obs + 8 + 4 * 4 + 4 + 4 + 8 + 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, K = 1 and 2, a few batches")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=6, help="timed batches per repeat")
    parser.add_argument("--step-ms", type=float, default=1.0, help="sleep per env step")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.batches, args.workers = 1, 3, [1, 2]
    torch.set_num_threads(1)

    import ray

    # Ray's workers import this script's helper module (_common), as worker processes do.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    start = time.monotonic()
    ray.init(num_cpus=2, object_store_memory=500 * 1024**2, include_dashboard=False, log_to_driver=False)
    print(f"ray.init: {time.monotonic() - start:.1f} s")
    info = machine_info()
    info["ray"] = ray.__version__

    print(f"Throughput, T={T} x N={N}, env step {args.step_ms} ms, prefetch 1 (frames/s)")
    rates = throughput(args)
    rows = []
    for k in args.workers:
        r, p = statistics.median(rates[f"ray K={k}"]), statistics.median(rates[f"process K={k}"])
        floor = 1000.0 * k / args.step_ms
        rows.append([k, fmt_rate(r), fmt_rate(p), f"{r / p:.2f}x", fmt_rate(floor)])
    throughput_table = markdown_table(
        ["K", "ray frames/s", "process frames/s", "ray / process", "sleep-bound ceiling K x 1000/step_ms"], rows
    )
    print(throughput_table)

    print("Transport: end of a worker's last env step -> next() returns (ms), prefetch 0")
    latencies = transport(args)
    rows = []
    for name, values in latencies.items():
        pixels = "uint8" in name
        rows.append(
            [
                name,
                f"{statistics.median(values):.2f}",
                f"{min(values):.2f} - {max(values):.2f}",
                f"{batch_bytes(pixels, 8 if pixels else N) / 1e6:.2f}",
            ]
        )
    transport_table = markdown_table(["system, batch", "median ms", "range ms", "batch MB"], rows)
    print(transport_table)
    ray.shutdown()
    info["wall_s"] = round(time.monotonic() - start, 1)
    path = write_json(
        "ray_scale",
        {
            "machine": info,
            "args": vars(args),
            "throughput": rates,
            "transport_ms": latencies,
            "tables": {"throughput": throughput_table, "transport": transport_table},
        },
    )
    print(f"wrote {path} in {info['wall_s']} s")


if __name__ == "__main__":
    main()
