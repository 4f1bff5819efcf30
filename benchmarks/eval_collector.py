"""Evaluation collectors: a short collector made after every update, on the thread in lockstep against the default.

The trainer collects CartPole-v1 with the default placement (one worker process
on a CPU: N=8, T=125, the benchmarks' 64x64 actor-critic) and, after each of its
batches, makes an evaluation collector: 4 envs, the actor's argmax as a greedy
policy, one batch of ``--steps`` steps, seeded alike every time. Timed: from
``Collector(...)`` to the closed collector, its one batch collected, with
``backend="thread", prefetch=0`` against the default (``backend="auto"``: one
worker process forked from the fork server that the trainer's collector
started), the two alternating. The table gives medians in seconds.

Usage::

    .venv/bin/python benchmarks/eval_collector.py [--quick] [--repeats 9] [--steps 50 200 500]
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from _common import machine_info, main_of, make_policy, markdown_table, record

__all__ = ["Greedy", "run", "to_markdown"]

NUM_ENVS = 4
SETTINGS = {"thread, prefetch=0": {"backend": "thread", "prefetch": 0}, "default": {}}


class Greedy(nn.Module):
    """The most likely action of the agent's actor: no sampling, no value."""

    def __init__(self, agent: nn.Module) -> None:
        super().__init__()
        self.agent = agent

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": self.agent.actor(obs).argmax(-1)}


def evaluation_s(agent: nn.Module, steps: int, options: dict[str, Any]) -> tuple[float, str]:
    """Seconds from ``Collector(...)`` to the closed collector with its one batch; the placement it chose."""
    from torch_rollout import Collector

    start = time.perf_counter()
    with Collector(
        "CartPole-v1",
        Greedy(agent),
        num_envs=NUM_ENVS,
        num_steps=steps,
        total_timesteps=NUM_ENVS * steps,
        device="cpu",
        seed=10_000,
        gae=None,
        **options,
    ) as collector:
        next(iter(collector))
        backend = collector.backend
    return time.perf_counter() - start, backend


def run(*, quick: bool = False, repeats: int | None = None, steps: list[int] | None = None) -> dict[str, Any]:
    from torch_rollout import Collector

    repeats = repeats or (2 if quick else 9)
    steps = steps or ([50] if quick else [50, 200, 500])
    torch.set_num_threads(1)
    agent = make_policy(0)
    results: dict[str, Any] = {"machine": machine_info(), "config": {"repeats": repeats, "num_envs": NUM_ENVS}}
    tables = []
    with Collector("CartPole-v1", agent, num_envs=8, num_steps=125, device="cpu", seed=1) as training:
        batches = iter(training)
        next(batches)
        for T in steps:
            times: dict[str, list[float]] = {name: [] for name in SETTINGS}
            chosen = {}
            for _ in range(repeats):
                for name, options in SETTINGS.items():
                    seconds, chosen[name] = evaluation_s(agent, T, options)
                    times[name].append(seconds)
                next(batches)  # the trainer's next batch between evaluations, as in training
            tables.append({"steps": T, "times": times, "chosen": chosen})
        results["training_backend"] = training.backend
    results["tables"] = tables
    results["machine"]["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    return record("eval_collector", results, quick=quick)


def to_markdown(results: dict[str, Any]) -> str:
    names = list(SETTINGS)
    rows = []
    for table in results["tables"]:
        med = {name: statistics.median(table["times"][name]) for name in names}
        rows.append(
            [
                f"{NUM_ENVS} x {table['steps']}",
                *(f"{med[name]:.3f}" for name in names),
                f"{med['default'] / med[names[0]]:.1f}x",
            ]
        )
    header = ["eval batch", *(f"{n} ({results['tables'][0]['chosen'][n]})" for n in names), "default / thread"]
    return markdown_table(header, rows) + "\n"


OPTIONS = (
    ("--steps", {"type": int, "nargs": "+", "default": None, "help": "default: 50 200 500"}),
)  # the command line beyond --quick and --repeats


def main() -> None:
    main_of(
        __doc__, run, to_markdown, *OPTIONS, quick="2 repeats of 50 steps: checks that it runs", repeats="default: 9"
    )


if __name__ == "__main__":
    main()
