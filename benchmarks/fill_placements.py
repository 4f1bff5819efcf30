"""``ReplayRing.fill`` against writing each batch into the ring, on the thread, worker processes and Ray.

``ring.fill(collector)`` takes the rows in place where it can: from the collection loop's own arrays on the
thread (``prefetch=0``), from each worker's shared-memory slot, and from each Ray actor's arrays as the
object store hands them over, with no batch made. The other way round, the trainer iterates the
collector and writes each batch with ``ring.write(batch)``: the batch is assembled first (on the thread
its TensorDict of views, with worker processes or Ray the workers' shares concatenated), then its rows
are copied in. Both on the same placement, so the difference is what taking the rows in place saves there.

Envs in SAME_STEP mode (no reset rows: every batch can be taken in place): gymnasium's CartPole-v1
with the 64x64 Q-network of ``offpolicy.py`` acting greedily, and an env of Atari-sized observations
(uint8 4x84x84, 28 KB a row) whose step costs next to nothing, with a greedy linear policy on four of
their numbers, where the copies are most of the work; ``next_obs`` on, ``gae=None``, the ring's five
keys (32 batches' rows); ``Processes(2)`` and ``Ray(2)`` with ``prefetch=1``. Systems interleaved, each
built afresh per repeat, one torch thread in the trainer; frames/s (rows written into the ring).

Usage::

    .venv/bin/python benchmarks/fill_placements.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from offpolicy import QNetwork
from ray_scale import SlowEnv
from torch import nn

from torch_rollout import BatchKeys, Collector, ReplayRing

from _common import (
    fmt_rate,
    interleaved_run,
    load_line,
    markdown_table,
    placement,
    run_interleaved,
    write_json,
)

SHAPES = (("CartPole-v1", 16, 64), ("CartPole-v1", 64, 64), ("uint8 4x84x84", 8, 32))  # (env, N, T)
PLACEMENTS = {"thread, prefetch=0": ("thread", 1, 0), "Processes(2), prefetch=1": ("process", 2, 1)}
if importlib.util.find_spec("ray") is not None:
    PLACEMENTS["Ray(2), prefetch=1"] = ("ray", 2, 1)
KEYS = ("obs", "action", "reward", "next_obs", "terminated")


def cartpole_envs(num_envs: int, start_index: int = 0) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(num_envs)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )


class PixelEnv(SlowEnv):
    """Atari-sized observations (uint8 4x84x84) that cost nothing to make: ``ray_scale.py``'s env without its sleep
    (a ``time.sleep(0)`` costs tens of microseconds here); episodes of 200 steps."""

    def __init__(self) -> None:
        super().__init__(step_ms=0.0, base=0.0, obs_shape=(4, 84, 84), dtype=np.uint8)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        return self.obs, 1.0, False, self.t == 200, {}


def pixel_envs(num_envs: int, start_index: int = 0) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv([PixelEnv] * num_envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


class GreedyOnPixels(nn.Module):
    """A greedy linear Q on four numbers of the image: the rows' trip is what is measured."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 2)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": self.q(obs[:, 0, 0, :4].float()).argmax(-1)}


class Filling:
    """One collector on ``backend`` writing its batches into a ring: with ``ring.fill`` or ``ring.write``."""

    def __init__(self, env: str, num_envs: int, num_steps: int, backend: str, workers: int, prefetch: int, fill: bool):
        torch.manual_seed(0)
        options: dict[str, Any] = {"num_steps": num_steps, "gae": None, "keys": BatchKeys(next_obs=True)}
        options.update(device="cpu", seed=0, prefetch=prefetch, backend=placement(backend, workers))
        recipe, policy = (cartpole_envs, QNetwork()) if env == "CartPole-v1" else (pixel_envs, GreedyOnPixels())
        if backend == "thread":
            self.collector = Collector(recipe(num_envs), policy, **options)
        else:
            self.collector = Collector(recipe, policy, num_envs=num_envs, **options)
        self.ring = ReplayRing(32 * num_envs * num_steps, KEYS)
        self.fill = fill
        self.batches = self.ring.fill(self.collector) if fill else iter(self.collector)

    def step(self) -> int:
        if self.fill:
            return next(self.batches)
        return self.ring.write(next(self.batches))

    def close(self) -> None:
        self.collector.close()


def run(repeats: int, quick: bool) -> list[dict[str, Any]]:
    results = []
    for env, num_envs, num_steps in SHAPES[-1:] if quick else SHAPES:
        factories = {}
        for name, (backend, workers, prefetch) in PLACEMENTS.items():
            for fill, how in ((False, "ring.write(batch)"), (True, "ring.fill(collector)")):
                factories[f"{name}, {how}"] = functools.partial(
                    Filling, env, num_envs, num_steps, backend, workers, prefetch, fill
                )
        print(f"{env}, N={num_envs}, T={num_steps}")
        steps = 3 if quick else max(10, 40_000 // (num_envs * num_steps))
        rates = run_interleaved(factories, repeats=repeats, warmup=2, steps=steps)
        results.append({"env": env, "num_envs": num_envs, "num_steps": num_steps, "rates": rates})
    return results


def to_markdown(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        rates = result["rates"]
        for name in PLACEMENTS:
            written, filled = rates[f"{name}, ring.write(batch)"], rates[f"{name}, ring.fill(collector)"]
            paired = [f / w for w, f in zip(written, filled)]
            rows.append(
                [
                    f"{result['env']}, N={result['num_envs']}, T={result['num_steps']}",
                    name,
                    fmt_rate(statistics.median(written)),
                    fmt_rate(statistics.median(filled)),
                    f"{statistics.median(filled) / statistics.median(written):.2f}x",
                    f"{min(paired):.2f} - {max(paired):.2f}",
                ]
            )
    header = ["shape", "placement", "ring.write(batch)", "ring.fill(collector)", "fill / write", "paired ratios"]
    return markdown_table(header, rows)


def main() -> None:
    repeats, quick, started, info = interleaved_run(__doc__, default_repeats=5, quick="the uint8 4x84x84 shape")
    if "Ray(2), prefetch=1" in PLACEMENTS:
        import ray

        ray.init(num_cpus=2, object_store_memory=500 * 1024**2, include_dashboard=False, log_to_driver=False)
    results = run(repeats, quick)
    table = to_markdown(results)
    print(f"\n{table}\n\n({repeats} repeats, frames/s; {load_line(started)})")
    if not quick:
        write_json("fill_placements", {"machine": info, "repeats": repeats, "results": results, "table": table})


if __name__ == "__main__":
    main()
