"""What the example scripts share: config files and `key=value` overrides, `--help`, the run folder, the CSV (and
TensorBoard) log, the mean return of recent episodes and the collector's account of its time. The scripts import
it as `common` (it sits beside them), also in worker processes, which run the script again."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import inspect
import json
import math
import re
import shutil
import textwrap
import types
import typing
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from tqdm import tqdm

from torch_rollout import Collector, Stats

# ---------------------------------------------------------------------------- config files and the command line


class ConfigError(ValueError):
    """A config file or override names an unknown key or gives a value of the wrong type."""


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Checks `value` against a field's type; returns it, ints widened to float."""
    expected = annotation
    if isinstance(annotation, types.UnionType):  # only `X | None` in the configs
        if value is None:
            return None
        (expected,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    name = expected.__name__ if expected is annotation else f"{expected.__name__} or None"
    error = ConfigError(f"config key {key!r}: expected {name}, got {value!r} ({type(value).__name__})")
    if isinstance(value, bool) != (expected is bool):  # bool is an int: True is no num_envs=1, nor 1 a flag
        raise error
    if expected is float and isinstance(value, (int, str)):
        try:
            return float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
        except ValueError:
            raise error from None
    if not isinstance(value, expected):
        raise error
    return value


def load_config(
    config_cls: type, path: str | Path | None = None, overrides: Sequence[str] = (), *, base: dict | None = None
) -> Any:
    """A `config_cls` from `base` (a checkpoint's config), the YAML file at `path`, then `key=value` overrides: YAML
    scalars (`true`, `null`, `3e-4`, `128`), or the text as it is for a string field. Raises ConfigError."""
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}

    def set_value(key: str, value: Any, where: str) -> None:
        if key not in hints:
            raise ConfigError(f"{where}: unknown config key {key!r}; known keys: {', '.join(hints)}")
        try:
            values[key] = _coerce(key, value, hints[key])
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None

    for key, value in (base or {}).items():
        set_value(key, value, "checkpoint")
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys, got {type(loaded).__name__}")
        for key, value in loaded.items():
            set_value(str(key), value, str(path))
    for item in overrides:
        key, value = _parse_override(item, hints)
        set_value(key, value, f"override {item!r}")
    return config_cls(**values)


def _parse_override(item: str, hints: dict[str, Any]) -> tuple[str, Any]:
    """``KEY=VALUE`` as the key and its value: the text itself for a string field, else a YAML scalar."""
    key, sep, text = item.partition("=")
    if not sep:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE")
    key = key.strip()
    if hints.get(key) in (str, str | None) and text != "null":
        return key, text
    try:
        return key, yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"override {item!r}: {text!r} is not a YAML scalar") from None


def import_optional(module: str, key: str, package: str) -> types.ModuleType:
    """Imports what the config key `key` needs, or fails before the run starts, naming the key and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{key}=true needs {package}, which is not installed: pip install -e '.[examples]' in the torch_rollout "
            f"clone (or pip install {package}), or leave {key} off"
        ) from None


def yaml_scalar(value: Any) -> str:
    """A config value as it is typed in a KEY=VALUE override or a YAML file (null, true, false, 3e-4, text)."""
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


def config_help(config_cls: type, doc: str, default_config: Path) -> str:
    """For `--help`: every config key, its default and the comment beside it, grouped by the dataclass's headings
    (of its base classes first); then the `Usage::` part of the script's docstring `doc`."""
    defaults = {field.name: field.default for field in dataclasses.fields(config_cls)}
    shipped = yaml.safe_load(default_config.read_text())
    width = max(shutil.get_terminal_size().columns - 2, 60)  # as argparse wraps its own help
    lines = textwrap.wrap(
        "config keys, given as KEY=VALUE after the options, with the defaults of the Config dataclass. Without "
        f"--config, configs/{default_config.name} applies first: its values follow the descriptions in [brackets].",
        width,
    )
    # the source is the one place the descriptions are written: the comments beside the fields
    source = [inspect.getsource(cls) for cls in reversed(config_cls.__mro__) if dataclasses.is_dataclass(cls)]
    for line in "\n".join(source).splitlines():
        if heading := re.fullmatch(r"    # (.+)", line):
            lines += ["", f"{heading[1]}:"]
        elif field := re.fullmatch(r"    (\w+): [^#]+?  # (.+)", line):
            name, text = field[1], field[2]
            if name in shipped and shipped[name] != defaults[name]:
                text += f" [{default_config.name}: {yaml_scalar(shipped[name])}]"
            key = f"  {name}={yaml_scalar(defaults[name])} ".ljust(30)
            wrap = {"break_long_words": False, "break_on_hyphens": False}
            lines += textwrap.wrap(text, width, initial_indent=key, subsequent_indent=" " * 30, **wrap)
    usage = textwrap.dedent(doc.partition("Usage::")[2]).strip("\n")
    return "\n".join(lines) + "\n\nexamples:\n" + textwrap.indent(usage, "  ")


def make_parser(doc: str, config_cls: type, default_config: Path) -> argparse.ArgumentParser:
    """The script's command line: `--config` and KEY=VALUE overrides; `--help` lists every config key."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n")[0],
        epilog=config_help(config_cls, doc, default_config),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=None, help=f"YAML config (default: {default_config.name})")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. seed=2")
    return parser


# ---------------------------------------------------------------------------- returns, run folder and log


class RecentReturns:
    """The mean return of the last `window` episodes and the count of episodes (ppo_ranks.py's: of all ranks)."""

    def __init__(self, window: int, returns: Iterable[float] = (), episodes: int = 0) -> None:
        self.returns: deque[float] = deque(returns, maxlen=window)
        self.episodes = episodes
        self.mean = float(np.mean(self.returns)) if self.returns else math.nan  # nan until an episode ends

    def add(self, returns: torch.Tensor) -> None:
        """Records the returns [E] of the episodes that ended in a batch."""
        self.returns.extend(returns.tolist())
        self.episodes += len(returns)
        self.mean = float(np.mean(self.returns)) if self.returns else self.mean


def make_run_dir(cfg: Any, *, write: bool = True) -> Path:
    """The run folder, `runs/<exp_name>_<env_id>_seed<seed>` unless cfg.run_dir says; with `write`, its config.yaml."""
    run_dir = Path(cfg.run_dir or f"runs/{cfg.exp_name}_{cfg.env_id}_seed{cfg.seed}")
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    return run_dir


class Logger:
    """progress.csv, a row per `log` (missing fields as nan); with `tensorboard`, the same scalars as events. With
    `resume_step`, what a stopped run logged after its checkpoint at that step is dropped, to be logged again."""

    def __init__(self, run_dir: Path, fields: list[str], *, resume_step: int | None = None, tensorboard: bool = False):
        path, kept = run_dir / "progress.csv", []
        if resume_step is not None and path.exists():
            with open(path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(float(row["step"])) <= resume_step]
        self.fields, self.file = fields, open(path, "w", newline="")
        self.csv = csv.DictWriter(self.file, fieldnames=fields)
        self.csv.writeheader()
        self.csv.writerows(kept)
        self.tb = None
        if tensorboard:
            board = import_optional("torch.utils.tensorboard", "track_tensorboard", "tensorboard")
            self.tb = board.SummaryWriter(str(run_dir), purge_step=None if resume_step is None else resume_step + 1)

    def log(self, row: dict[str, float]) -> None:
        row = {key: row.get(key, math.nan) for key in self.fields}
        self.csv.writerow(row)
        self.file.flush()
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and not math.isnan(value):
                    self.tb.add_scalar(key, value, int(row["step"]))

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


# ---------------------------------------------------------------------------- the collector's account


# The collector's account of each log interval (docs/bottleneck.md): the loops' shares and the trainer's wait
STATS_FIELDS = ["time/env_share", "time/policy_share", "time/collector_share", "time/idle_share", "time/wait_share"]


def stats_row(stats: Stats) -> dict[str, float]:
    """The STATS_FIELDS of one interval's account."""
    shares = stats.shares()
    wait = stats.wait / stats.seconds if stats.seconds > 0 else 0.0
    return {**{f"time/{key}_share": value for key, value in shares.items()}, "time/wait_share": wait}


class Intervals:
    """The collector's account per log interval: each `take()` returns the Stats since the last one."""

    def __init__(self, collector: Collector) -> None:
        self.collector, self.last = collector, None

    def take(self) -> Stats:
        stats, last = self.collector.stats(), self.last  # since the collector was built: take the difference
        self.last = stats
        return stats if last is None else stats - last


def shares_text(stats: Stats) -> str:
    """The shares, short enough for a progress bar: `env 41% pol 33% col 9% idle 17% wait 62%`."""
    names = {"env": "env", "policy": "pol", "collector": "col", "idle": "idle", "wait": "wait"}
    return " ".join(f"{names[key[5:-6]]} {100 * value:.0f}%" for key, value in stats_row(stats).items())


def print_collector(collector: Collector) -> None:
    """The run's first line: where the collector runs (what backend=auto chose), how far ahead, on which device,
    as the config keys that choose them; through tqdm.write, which keeps a progress bar below it intact."""
    tqdm.write(
        f"collector: backend={collector.backend} num_workers={collector.num_workers} "
        f"prefetch={collector.prefetch} device={collector.device}"
    )


def report_stats(collector: Collector, run_dir: Path, *, title: str, window: int | None = None) -> None:
    """After the run: the collector's account of the whole run (what bounded it), and from progress.csv
    time_shares.png (the loops' shares of their time, stacked, and the trainer's wait) and, with `window`,
    learning_curve.png (the mean return of the last `window` episodes)."""
    print(f"collector over the run: {collector.stats()}")
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    with open(run_dir / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(float(r["step"])) for r in rows]
    names = {"env": "env steps", "policy": "policy forward", "collector": "collector's work", "idle": "idle"}
    fig, ax = plt.subplots(figsize=(6, 4))
    shares = [[100 * float(r[f"time/{key}_share"]) for r in rows] for key in names]
    ax.stackplot(steps, shares, labels=list(names.values()), alpha=0.8)
    ax.plot(steps, [100 * float(r["time/wait_share"]) for r in rows], color="black", label="trainer waiting")
    ax.set(xlabel="env steps", ylabel="% of the time", ylim=(0, 100), title=f"where the time goes: {title}")
    ax.legend(loc="upper right", fontsize="small")
    plots = [(fig, "time_shares.png")]
    if window is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, [float(r["charts/mean_return"]) for r in rows])
        ax.set(xlabel="env steps", ylabel=f"mean return of the last {window} episodes", title=title)
        ax.grid(alpha=0.3)
        plots.append((fig, "learning_curve.png"))
    for fig, name in plots:
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=100)
        plt.close(fig)
