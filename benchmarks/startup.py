"""Start-up: from ``Collector(...)`` to the first batch, in a fresh trainer process, thread against worker processes.

Each sample is a fresh Python process that imports torch_rollout, builds a
``Collector`` on CartPole-v1 (the default PPO config's N=8, T=125 and the
benchmarks' 64x64 actor-critic) and takes its first batch. Settings alternate:

- thread, Processes(1), Processes(2): a trainer without threads of its own;
- Processes(2), threads after the import: the common trainer, which imports
  torch_rollout at its top and then starts the threads of ``wandb.init()``,
  ``SummaryWriter()`` and a ``tqdm`` bar (stand-ins for the first two, tqdm's
  own monitor thread) before it builds the collector;
- Processes(2), ``torch_rollout.start_workers_early()`` right after the
  import, then the same threads, and one second of the trainer's own set-up
  (a stand-in for building its model and logger) before the collector.

The worker processes' fork server is multiprocessing's, a fresh interpreter
started by the first collector with worker processes (or by
``start_workers_early()``), which imports torch before it forks a worker.

The table gives medians and the breakdown:

- import: ``import torch_rollout`` (torch, tensordict, gymnasium);
- to envs: from ``Collector(...)`` to the last worker's ``make_envs`` call (the fork server's start,
  each worker's fork, unpickling, importing the script again);
- envs: the slowest worker's ``make_envs``;
- to Ready: from then to the constructor's return (the workers' Ready, the shared-memory check);
- first batch: ``next()`` (the envs' reset and 125 steps);
- total: ``Collector(...)`` to the first batch.

The load average (``uptime``'s 1-minute figure) is recorded next to every
sample: the machine may be shared.

Usage::

    benchmarks/.venv/bin/python benchmarks/startup.py [--quick] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run", "to_markdown", "SETTINGS", "make_envs"]

SETTINGS = (
    "thread",
    "process1",
    "process2",
    "process2-threaded",
    "process2-early",
)
SETUP_S = 1.0  # the early setting's stand-in for the trainer's own set-up between its import and its collector
NUM_ENVS, NUM_STEPS = 8, 125  # configs/ppo_cartpole.yaml
_WORKER_TIMEOUT_S = 300
_PHASES = ("import", "to_envs", "envs", "to_ready", "first_batch", "total")


def make_envs(out: str, num_envs: int, start_index: int = 0) -> Any:
    """CartPole-v1 SyncVectorEnv; writes when its build began and ended (wall clock) to ``out``/envs-<start>.json."""
    began = time.time()
    import gymnasium as gym

    envs = gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")
    Path(out, f"envs-{start_index}.json").write_text(json.dumps({"began": began, "built": time.time()}))
    return envs


def start_threads() -> Any:
    """The threads that a trainer runs by its first collector: ``wandb.init()``'s, a ``SummaryWriter``'s writer,
    a ``tqdm`` bar's monitor; returns the bar."""
    import io
    import queue
    import threading

    from tqdm import tqdm

    threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="like-wandb").start()
    threading.Thread(target=queue.Queue().get, daemon=True, name="like-SummaryWriter").start()
    bar = tqdm(total=NUM_ENVS * NUM_STEPS, file=io.StringIO())  # starts tqdm's monitor thread
    assert threading.active_count() == 4, threading.enumerate()
    return bar


def worker(setting: str, out: str) -> dict[str, Any]:
    """In a fresh process: import, build the collector, take the first batch; the phases' seconds."""
    import functools

    threads = None
    started = time.time()
    import torch

    import torch_rollout
    from torch_rollout import Collector, Processes

    from _common import make_policy

    imported = time.time()
    if setting == "process2-early":
        torch_rollout.start_workers_early()
    torch.set_num_threads(1)  # as the PPO config's torch_threads: 1
    if setting in ("process2-threaded", "process2-early"):
        threads = start_threads()
    if setting == "process2-early":
        time.sleep(SETUP_S)
    backend = "thread" if setting == "thread" else Processes(int(setting[len("process")]))
    envs = functools.partial(make_envs, out)
    policy = make_policy(0)
    ctor = time.time()
    collector = Collector(envs, policy, num_envs=NUM_ENVS, num_steps=NUM_STEPS, backend=backend, seed=0)
    built = time.time()
    try:
        next(collector)
        first = time.time()
    finally:
        collector.close()
    del threads
    stamps = [json.loads(p.read_text()) for p in Path(out).glob("envs-*.json")]
    envs_began = max(s["began"] for s in stamps)
    envs_built = max(s["built"] for s in stamps)
    return {
        "import": imported - started,
        "to_envs": envs_began - ctor,
        "envs": max(s["built"] - s["began"] for s in stamps),
        "to_ready": built - envs_built,
        "first_batch": first - built,
        "total": first - ctor,
    }


def _run_worker(setting: str) -> dict[str, Any]:
    from _common import run_worker

    with tempfile.TemporaryDirectory() as out:
        load = os.getloadavg()[0]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        args = ["--worker", setting, "--out", out]
        sample = run_worker(__file__, args, what=f"startup worker {setting}", env=env, timeout=_WORKER_TIMEOUT_S)
    return {**sample, "load": load}


def run(*, quick: bool = False, repeats: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Alternates the settings over ``repeats`` fresh processes each; writes results/startup.json.

    Args:
        quick: one process per setting.
        repeats: processes per setting (default 1 quick, 5 full).
        log: where progress lines go.
    """
    from _common import machine_info, record

    repeats = repeats or (1 if quick else 5)
    samples: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    log(f"startup: Collector(...) to the first batch, CartPole N={NUM_ENVS} T={NUM_STEPS}, {repeats} repeat(s)")
    for repeat in range(repeats):
        for setting in SETTINGS:
            sample = _run_worker(setting)
            samples[setting].append(sample)
            phases = "  ".join(f"{p} {sample[p]:.3f}" for p in _PHASES)
            log(f"  {repeat + 1}/{repeats}  {setting:26s} {phases}  (load {sample['load']:.2f})")
    rows = [
        {
            "setting": setting,
            **{p: statistics.median(s[p] for s in samples[setting]) for p in _PHASES},
            "total_range": [min(s["total"] for s in samples[setting]), max(s["total"] for s in samples[setting])],
            "load": [min(s["load"] for s in samples[setting]), max(s["load"] for s in samples[setting])],
        }
        for setting in SETTINGS
    ]
    results = {
        "machine": machine_info(),
        "config": {"num_envs": NUM_ENVS, "num_steps": NUM_STEPS, "repeats": repeats, "quick": quick},
        "samples": samples,
        "rows": rows,
    }
    return record("startup", results, quick=quick)


def to_markdown(results: dict[str, Any]) -> str:
    """The medians as a table, seconds; the total's range and the load averages beside them."""
    from _common import markdown_table

    names = {
        "thread": "thread",
        "process1": "Processes(1)",
        "process2": "Processes(2)",
        "process2-threaded": "Processes(2), threads after the import",
        "process2-early": f"Processes(2), start_workers_early(), threads, {SETUP_S:.0f} s of set-up",
    }
    header = ["placement", *_PHASES, "total min-max", "load"]
    body = [
        [
            names[row["setting"]],
            *(f"{row[p]:.2f}" for p in _PHASES),
            "{:.2f}-{:.2f}".format(*row["total_range"]),
            "{:.2f}-{:.2f}".format(*row["load"]),
        ]
        for row in results["rows"]
    ]
    return markdown_table(header, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one process per setting")
    parser.add_argument("--repeats", type=int, default=None, help="processes per setting (default 5)")
    parser.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.out)))
        return
    print(to_markdown(run(quick=args.quick, repeats=args.repeats)))


if __name__ == "__main__":
    main()
