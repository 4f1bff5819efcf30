"""Start-up: from ``Collector(...)`` to the first batch, in a fresh trainer process, thread against worker processes.

Each sample is a fresh Python process that imports torch_rollout, builds a
``Collector`` on CartPole-v1 (the default PPO config's N=8, T=125 and the
benchmarks' 64x64 actor-critic) and takes its first batch. Settings alternate:

- thread, Processes(1), Processes(2): a trainer without threads of its own;
- Processes(2), threads after the import: the common trainer, which imports
  torch_rollout at its top and then starts the threads of ``wandb.init()``,
  ``SummaryWriter()`` and a ``tqdm`` bar (stand-ins for the first two, tqdm's
  own monitor thread) before it builds the collector;
- the same with ``TORCH_ROLLOUT_PREFORK=0``: no fork server forked at the
  import, so the workers start from a fresh one;
- Processes(2), threads before the import: a trainer that imports
  torch_rollout only once its threads run (inside its ``main()``), not safe
  to fork then, whose workers start from a fresh fork server too.

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

A second table gives what the fork server forked at the import costs a
trainer that never starts a worker process: in a fresh process that collects
in the thread (a CUDA policy's placement) with an update per batch, the idle
server's memory of its own (USS: pages no other process maps), its share of
the pages it shares (PSS), at the start, after 100 batches (10 with
``--quick``) and after a ``gc.collect()`` in the trainer, beside the trainer's
memory.

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

__all__ = ["run", "to_markdown", "SETTINGS", "make_envs", "idle_worker"]

SETTINGS = (
    "thread",
    "process1",
    "process2",
    "process2-threaded",
    "process2-threaded-prefork0",
    "process2-threads-first",
)
NUM_ENVS, NUM_STEPS = 8, 125  # configs/ppo_cartpole.yaml
_WORKER_TIMEOUT_S = 300
IDLE = "idle-server"  # the worker that measures the memory of a server that serves no worker
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
    if setting.endswith("-threads-first"):  # not safe to fork at the import, nor later
        threads = start_threads()
    started = time.time()
    import torch

    from torch_rollout import Collector, Processes

    from _common import make_policy

    imported = time.time()
    torch.set_num_threads(1)  # as the PPO config's torch_threads: 1
    if "-threaded" in setting:  # safe to fork at the import, not later
        threads = start_threads()
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


def idle_worker(batches: int) -> dict[str, Any]:
    """In a fresh process: a trainer whose import of torch_rollout forked the fork server, and that then only
    collects in the thread, with a policy-gradient update per batch; the memory (MiB) of the idle server at the
    start and after ``batches`` batches, and the trainer's then."""
    import gc

    import torch
    from torch.distributions import Categorical

    from torch_rollout import Collector
    from torch_rollout.placements import _forkserver

    from _common import make_policy

    if _forkserver._idle is None:
        raise RuntimeError("no fork server was forked at the import (TORCH_ROLLOUT_PREFORK=0, or a thread ran)")
    server = _forkserver._idle.pid
    at_start = _memory(server)
    torch.set_num_threads(1)
    policy = make_policy(0)
    optimizer = torch.optim.Adam(policy.parameters(), lr=2.5e-4)
    with Collector("CartPole-v1", policy, num_envs=NUM_ENVS, num_steps=NUM_STEPS, backend="thread", seed=0) as c:
        for _ in range(batches):
            batch = next(c)
            real = batch[batch["mask"]]
            log_prob = Categorical(logits=policy.actor(real["obs"])).log_prob(real["action"])
            value_loss = (policy.critic(real["obs"]).squeeze(-1) - real["return"]).pow(2).mean()
            optimizer.zero_grad()
            (value_loss - (log_prob * real["advantage"]).mean()).backward()
            optimizer.step()
    at_end = _memory(server)
    gc.collect()  # a full collection writes to every object that the collector tracks: their pages are copied
    return {
        "batches": batches,
        "server_start": at_start,
        "server_end": at_end,
        "server_after_gc": _memory(server),
        "trainer_end": _memory(),
    }


def _memory(pid: int | None = None) -> dict[str, float]:
    """A process's memory in MiB (default: this one's): uss (pages no other process maps), pss (each shared page
    split among the processes that map it), rss."""
    fields: dict[str, float] = {}
    with open(f"/proc/{pid or os.getpid()}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[name] = int(parts[0]) / 1024
    return {"uss": fields["Private_Clean"] + fields["Private_Dirty"], "pss": fields["Pss"], "rss": fields["Rss"]}


def _run_worker(setting: str) -> dict[str, Any]:
    from _common import run_worker

    with tempfile.TemporaryDirectory() as out:
        load = os.getloadavg()[0]
        env = {key: value for key, value in os.environ.items() if key != "TORCH_ROLLOUT_PREFORK"}
        env["PYTHONWARNINGS"] = "ignore"
        if setting.endswith("-prefork0"):
            env["TORCH_ROLLOUT_PREFORK"] = "0"
        args = ["--worker", setting, "--out", out]
        if setting.startswith(IDLE):
            args = ["--worker", IDLE, "--batches", setting.partition(":")[2]]
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
    batches = 10 if quick else 100
    idle = []
    for repeat in range(repeats):
        sample = _run_worker(f"{IDLE}:{batches}")
        idle.append(sample)
        log(
            f"  {repeat + 1}/{repeats}  {IDLE:26s} server USS {sample['server_start']['uss']:.1f} MiB at the start, "
            f"{sample['server_end']['uss']:.1f} after {batches} batches  (load {sample['load']:.2f})"
        )
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
        "idle_server": idle,
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
        "process2-threaded-prefork0": "Processes(2), threads after the import, TORCH_ROLLOUT_PREFORK=0",
        "process2-threads-first": "Processes(2), threads before the import",
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
    table = markdown_table(header, body)
    idle = results.get("idle_server")
    if not idle:
        return table
    median = {
        (when, what): statistics.median(s[when][what] for s in idle)
        for when in ("server_start", "server_end", "server_after_gc", "trainer_end")
        for what in ("uss", "pss", "rss")
    }
    idle_table = markdown_table(
        ["process", "USS", "PSS", "RSS"],
        [
            ["server, after the import", *(f"{median['server_start', w]:.0f}" for w in ("uss", "pss", "rss"))],
            [
                f"server, after {idle[0]['batches']} batches",
                *(f"{median['server_end', w]:.0f}" for w in ("uss", "pss", "rss")),
            ],
            [
                "server, then after a gc.collect() in the trainer",
                *(f"{median['server_after_gc', w]:.0f}" for w in ("uss", "pss", "rss")),
            ],
            [
                f"trainer, after {idle[0]['batches']} batches",
                *(f"{median['trainer_end', w]:.0f}" for w in ("uss", "pss", "rss")),
            ],
        ],
    )
    return f"{table}\n\nThe idle fork server's memory and the trainer's, MiB (medians of {len(idle)}):\n\n{idle_table}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one process per setting")
    parser.add_argument("--repeats", type=int, default=None, help="processes per setting (default 5)")
    parser.add_argument("--worker", choices=(*SETTINGS, IDLE), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == IDLE:
        print(json.dumps(idle_worker(args.batches)))
        return
    if args.worker:
        print(json.dumps(worker(args.worker, args.out)))
        return
    print(to_markdown(run(quick=args.quick, repeats=args.repeats)))


if __name__ == "__main__":
    main()
