"""Whole training runs of the example trainers, as the docs' results tables report them, with their record.

Each group is the runs of one table: the example's command with a config and a seed, one run at a time in a
fresh process, its run folder under ``--runs`` (default ``/tmp/example_runs``). From each run's
``progress.csv`` it keeps the learning curve (env step, mean return of the last 20 episodes, episodes ended)
and reads the first step at which that mean reached the table's target (with 20 episodes ended), the mean at
the end and at the table's checkpoints; beside them the run's wall time, its CPU time (user + system, the
measure that a loaded machine changes least) and the 1-min load at its start and end; with ``eval``, the
result of ``--eval`` on the final checkpoint. Everything goes to ``benchmarks/results/example_runs_GROUP.json``
with the commit it ran.

Usage::

    .venv/bin/python benchmarks/example_runs.py ppo_cartpole [sac_pendulum ...]   # or: all
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, machine_info, write_json

WINDOW = 20  # the examples' return_window: "mean" is the mean return of the last 20 episodes
PPO, SAC = "examples/ppo.py", "examples/sac.py"
PPO_CONTINUOUS, PPO_LSTM = "examples/ppo_continuous.py", "examples/ppo_lstm.py"
# group: (target mean return, steps at which the mean is read, [(script, config, overrides, eval?)])
GROUPS: dict[str, tuple[float, list[int], list[tuple[str, str | None, list[str], bool]]]] = {
    "ppo_cartpole": (475.0, [], [(PPO, "configs/ppo_cartpole.yaml", [f"seed={s}"], False) for s in (1, 2, 3)]),
    "ppo_cartpole_torch": (
        475.0,
        [],
        [(PPO, None, ["seed=1"], False), (PPO, "configs/ppo_cartpole_torch.yaml", ["seed=1"], False)],
    ),
    "ppo_halfcheetah": (1500.0, [999_424], [(PPO_CONTINUOUS, "configs/ppo_halfcheetah.yaml", ["seed=1"], True)]),
    "ppo_cartpole_novel_lstm": (
        475.0,
        [300_032],
        [(PPO_LSTM, "configs/ppo_cartpole_novel_lstm.yaml", [f"seed={s}"], True) for s in (1, 2, 3)]
        + [(PPO_LSTM, "configs/ppo_cartpole_novel_lstm.yaml", ["seed=1", "lstm_size=0"], True)],
    ),
    "sac_pendulum": (
        -200.0,
        [30_000],
        [(SAC, None, [f"seed={s}", "backend=thread"], False) for s in (1, 2, 3)]
        + [(SAC, None, ["seed=1", "backend=process"], False)],
    ),
    "sac_pendulum_torch": (
        -200.0,
        [],
        [(SAC, "configs/sac_pendulum_torch.yaml", [f"seed={s}"], False) for s in (1, 2, 3)],
    ),
}


CURVE = ("step", "wall_time", "charts/mean_return", "charts/episodes", "charts/SPS")


def _curve(run_dir: Path) -> list[list[float]]:
    """The ``CURVE`` columns of each row of the run's progress.csv."""
    with open(run_dir / "progress.csv", newline="") as f:
        return [[float(row[key]) for key in CURVE] for row in csv.DictReader(f)]


def _summary(curve: list[list[float]], target: float, checkpoints: list[int]) -> dict[str, Any]:
    """The first row at which the mean reached ``target`` (step and seconds into training), the last row's
    step, seconds, mean and steps/s, and the mean at each checkpoint step."""
    reached = next((row for row in curve if row[3] >= WINDOW and row[2] >= target), None)
    at = {}
    for checkpoint in checkpoints:
        before = [row[2] for row in curve if row[0] <= checkpoint]
        at[str(checkpoint)] = before[-1] if before else None
    step, seconds, mean, _, rate = curve[-1]
    return {
        "first_reached": None if reached is None else {"step": int(reached[0]), "wall_time_s": reached[1]},
        "final": {"step": int(step), "wall_time_s": seconds, "mean": mean, "steps_per_s": rate},
        "mean_at": at,
    }


def run_one(script: str, config: str | None, overrides: list[str], evaluate: bool, runs: Path) -> dict[str, Any]:
    """One training run in a fresh process (and ``--eval`` of its checkpoint): its command, times and curve."""
    run_dir = runs / "_".join([Path(script).stem, Path(config or "default").stem, *overrides]).replace("=", "")
    command = [sys.executable, script, *(["--config", config] if config else []), *overrides, f"run_dir={run_dir}"]
    before, load, start = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0], time.perf_counter()
    subprocess.run(command, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    record: dict[str, Any] = {
        "command": " ".join(["python", *command[1:-1]]),  # the run folder left out
        "wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "load_1m": [load, os.getloadavg()[0]],
        "curve": _curve(run_dir),
    }
    if evaluate:
        done = subprocess.run(
            [sys.executable, script, "--eval", str(run_dir / "checkpoint.pt")],
            cwd=REPO_ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        found = re.search(r"eval over (\d+) episodes?: mean return (\S+) \+- (\S+)", done.stdout)
        record["eval"] = {"episodes": int(found[1]), "mean": float(found[2]), "std": float(found[3])} if found else None
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("groups", nargs="+", choices=[*GROUPS, "all"])
    parser.add_argument("--runs", type=Path, default=Path("/tmp/example_runs"), help="the run folders' parent")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout
    for group in GROUPS if "all" in args.groups else args.groups:
        target, checkpoints, runs = GROUPS[group]
        info = {**machine_info(), "date": time.strftime("%Y-%m-%d"), "commit": commit.strip()}
        results = []
        for script, config, overrides, evaluate in runs:
            record = run_one(script, config, overrides, evaluate, args.runs)
            record.update(_summary(record["curve"], target, checkpoints))
            results.append(record)
            shown = {k: record[k] for k in ("first_reached", "final", "mean_at", "wall_s", "cpu_s", "load_1m")}
            print(f"{record['command']}: {shown} eval={record.get('eval')}", flush=True)
        path = write_json(f"example_runs_{group}", {"machine": info, "target": target, "runs": results})
        print(f"wrote {path.relative_to(REPO_ROOT)}", flush=True)


if __name__ == "__main__":
    main()
