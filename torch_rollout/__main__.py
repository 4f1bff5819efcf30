"""The command line: ``python -m torch_rollout tune ENV_ID --num-envs N --num-steps T`` (see torch_rollout.tune).

Worker processes import this module again by its name: it does nothing at import but define the command line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from time import strftime
from typing import Any

import gymnasium
import torch
from gymnasium import spaces
from torch import nn

from torch_rollout.loop._stats import available_cores
from torch_rollout.tuning import _Row, _shares, _trials

__all__ = ["main"]


def _record(rows: list[_Row], best: _Row, argv: Sequence[str], load: float | None) -> dict[str, Any]:
    """The trials as the ``--json`` file holds them: the command, the machine, each placement's rounds."""
    placements = []
    for row in rows:
        entry: dict[str, Any] = {"placement": row.label, "frames_per_s": [s.fps for s in row.stats]}
        if row.stats:
            entry.update(median=row.median, shares=_shares(row.stats), account=row.median_stats().describe())
        if row.refused is not None:
            entry["refused"] = f"{type(row.refused).__name__}: {row.refused}"
        placements.append(entry)
    return {
        "command": "python -m torch_rollout " + " ".join(argv),
        "date": strftime("%Y-%m-%d %H:%M:%S"),
        "cores": available_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_1m": [load, _load()],  # at the start and at the end
        "placements": placements,
        "best": best.label,
    }


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line's arguments (``python -m torch_rollout tune --help``)."""
    parser.add_argument("env_id", help="a gymnasium env id (an id of your own module: module:EnvName-v0)")
    parser.add_argument("--num-envs", type=_positive_int, required=True, help="envs per batch, as you will collect")
    parser.add_argument(
        "--num-steps", type=_positive_int, required=True, help="steps per env per batch, as you will collect"
    )
    parser.add_argument(
        "--policy",
        metavar="MODULE:FACTORY",
        help="a function FACTORY(observation_space, action_space) -> nn.Module of an importable module, called "
        "with one env's spaces (default: a 64x64 tanh MLP actor-critic)",
    )
    parser.add_argument("--seconds", type=_seconds, default=20.0, help="timed seconds in all (default 20)")
    parser.add_argument(
        "--train-seconds",
        type=_train_seconds,
        default=0.0,
        help="seconds of a stand-in CPU update (Adam steps of a 64x64 MLP) after each batch (default 0: none)",
    )
    parser.add_argument("--device", default=None, help="the policy's device (default: cuda when available, else cpu)")
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch.set_num_threads in the trainer first (default: torch's own)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        type=Path,
        default=None,
        help="also write the command, the machine and every trial's figures to this JSON file",
    )


def _main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Runs :func:`tune` for the parsed command line (``argv``) and prints the Collector call it found fastest."""
    load = _load()
    if args.json is not None and not args.json.parent.is_dir():
        raise SystemExit(f"tune: --json {str(args.json)!r}: no folder {str(args.json.parent)!r}; create it first")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    policy = None
    if args.policy is not None:
        factory = _import_factory(args.policy)
        probe = gymnasium.make(args.env_id)
        try:
            policy = factory(probe.observation_space, probe.action_space)
        finally:
            probe.close()
    rows, best = _trials(
        args.env_id, policy, args.num_steps, args.num_envs, args.seconds, args.train_seconds, None, args.device
    )
    if args.json is not None:
        args.json.write_text(json.dumps(_record(rows, best, argv, load), indent=1) + "\n")
        print(f"wrote {args.json}")
    chosen = ", ".join(f"{key}={value!r}" for key, value in best.options.items())
    print(f"\nCollector({args.env_id!r}, policy, num_envs={args.num_envs}, num_steps={args.num_steps}, {chosen})")
    return 0


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def _train_seconds(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    return value if math.isfinite(value) else -1.0  # refused by the callers, with the text as given


def _import_factory(spec: str) -> Callable[[spaces.Space, spaces.Space], nn.Module]:
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise SystemExit(f"--policy must be MODULE:FACTORY (e.g. mypackage.agents:make_agent), got {spec!r}")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"--policy {spec}: cannot import {module_name!r} ({exc}); is it on sys.path?") from exc
    for part in name.split("."):
        if not hasattr(found, part):
            raise SystemExit(f"--policy {spec}: module {module_name!r} has no {name!r}")
        found = getattr(found, part)
    if not callable(found):
        raise SystemExit(f"--policy {spec}: {name!r} is a {type(found).__name__}, expected a function")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m torch_rollout tune ENV_ID --num-envs N --num-steps T ...`` (``argv``: ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(prog="python -m torch_rollout", description="torch_rollout's command line")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_arguments(
        commands.add_parser(
            "tune",
            help="time each placement on an env and a policy; print the table and the fastest",
            description="Times each placement (lockstep, the thread collecting ahead, 1..cores worker processes) "
            "on the env and the policy, prints frames/s with each one's account, and the fastest Collector call.",
        )
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    return _main(parser.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
