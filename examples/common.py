"""What examples/ppo.py and examples/sac.py both use: config files and `key=value` overrides, `--help`, the run
folder, the CSV (and TensorBoard) log, the mean return of recent episodes and the collector's account of its time.

Everything of one algorithm lives in its script. They import this module as `common` (it sits beside them), also
in worker processes, which run the script again.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import inspect
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
import torch.distributed as dist
import yaml
from tqdm import tqdm

from torch_rollout import Collector, Stats, start_workers_early

__all__ = [
    "STATS_FIELDS",
    "ConfigError",
    "Intervals",
    "Logger",
    "RecentReturns",
    "import_optional",
    "load_config",
    "make_run_dir",
    "make_parser",
    "print_collector",
    "report_stats",
    "shares_text",
    "stats_row",
    "sum_over_ranks",
    "yaml_scalar",
]


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
    # bool is an int subclass: True must not pass as num_envs=1, nor 1 as a flag
    if isinstance(value, bool) != (expected is bool):
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
    """Builds a `config_cls` from `base` (a checkpoint's config), the YAML file at `path`, then `key=value` overrides.

    Override values are read as YAML scalars (`true`, `null`, `3e-4`, `128`); string
    fields take the text as it is.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or a malformed override.
    """
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
        for key, value in _read_config_file(path).items():
            set_value(str(key), value, str(path))
    for item in overrides:
        key, value = _parse_override(item, hints)
        set_value(key, value, f"override {item!r}")
    return config_cls(**values)


def _read_config_file(path: str | Path) -> dict:
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got {type(loaded).__name__}")
    return loaded


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
            "clone "
            f"(or pip install {package}), or leave {key} off"
        ) from None


def yaml_scalar(value: Any) -> str:
    """A config value as it is typed in a KEY=VALUE override or a YAML file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def config_help(config_cls: type, doc: str, default_config: Path) -> str:
    """Every config key, its default and the comment beside it, grouped by the dataclass's headings, for `--help`.

    The examples at the end are the `Usage::` part of the script's docstring `doc`.
    """
    defaults = {field.name: field.default for field in dataclasses.fields(config_cls)}
    shipped = yaml.safe_load(default_config.read_text())
    width = max(shutil.get_terminal_size().columns - 2, 60)  # as argparse wraps its own help
    lines = textwrap.wrap(
        "config keys, given as KEY=VALUE after the options, with the defaults of the Config dataclass. Without "
        f"--config, configs/{default_config.name} applies first: its values follow the descriptions in [brackets].",
        width,
    )
    # the source is the one place the descriptions are written: the comments beside the fields
    for line in inspect.getsource(config_cls).splitlines():
        if heading := re.fullmatch(r"    # (.+)", line):
            lines += ["", f"{heading[1]}:"]
        elif field := re.fullmatch(r"    (\w+): [^#]+?  # (.+)", line):
            name, text = field[1], field[2]
            if name in shipped and shipped[name] != defaults[name]:
                text += f" [{default_config.name}: {yaml_scalar(shipped[name])}]"
            key = f"  {name}={yaml_scalar(defaults[name])} ".ljust(30)
            lines += textwrap.wrap(
                text,
                width,
                initial_indent=key,
                subsequent_indent=" " * 30,
                break_long_words=False,
                break_on_hyphens=False,
            )
    usage = textwrap.dedent(doc.partition("Usage::")[2]).strip("\n")
    return "\n".join(lines) + "\n\nexamples:\n" + textwrap.indent(usage, "  ")


def make_parser(doc: str, config_cls: type, default_config: Path) -> argparse.ArgumentParser:
    """The script's command line: `--config` and KEY=VALUE overrides; `--help` lists every config key.

    A script adds its own options; `parser.error(str(error))` reports a ConfigError as argparse reports its own.
    """
    parser = argparse.ArgumentParser(
        description=doc.split("\n")[0],
        epilog=config_help(config_cls, doc, default_config),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=None, help=f"YAML config (default: {default_config.name})")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. seed=2")
    return parser


# ---------------------------------------------------------------------------- returns, run folder and log


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the ranks; `x` itself in a single process."""
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
    return x


class RecentReturns:
    """The mean return of the last `window` episodes and the count of episodes, of all ranks under torchrun.

    Under torchrun every rank calls `add` once per batch (it sums over the ranks); the mean is over each rank's
    last `window` episodes.
    """

    def __init__(self, window: int, returns: Iterable[float] = (), episodes: int = 0) -> None:
        self.returns: deque[float] = deque(returns, maxlen=window)  # this rank's
        self.episodes = episodes
        self.mean = math.nan  # until the first episode ends

    def add(self, returns: torch.Tensor) -> None:
        """Records the returns [E] of the episodes that ended in a batch."""
        self.returns.extend(returns.tolist())
        ended = len(returns)
        if dist.is_initialized() and dist.get_world_size() > 1:
            totals = torch.tensor([ended, sum(self.returns), len(self.returns)], dtype=torch.float64)
            ended, total, count = sum_over_ranks(totals.to(returns.device)).tolist()
            self.mean = total / count if count else self.mean
        elif self.returns:
            self.mean = float(np.mean(self.returns))
        self.episodes += int(ended)


def make_run_dir(cfg: Any, *, write: bool = True) -> Path:
    """The run folder, `runs/<exp_name>_<env_id>_seed<seed>` unless cfg.run_dir says; with `write`, its config.yaml."""
    run_dir = Path(cfg.run_dir or f"runs/{cfg.exp_name}_{cfg.env_id}_seed{cfg.seed}")
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    return run_dir


class Logger:
    """progress.csv, one row per call of `log`; with `tensorboard`, the same scalars and every episode's return.

    A row's missing fields are written as nan. With `resume_step`, the rows (and events) that a stopped run
    logged after its checkpoint at that step are dropped: the resumed run logs them again.
    """

    def __init__(
        self, run_dir: Path, fields: list[str], *, resume_step: int | None = None, tensorboard: bool = False
    ) -> None:
        path = run_dir / "progress.csv"
        kept = []
        if resume_step is not None and path.exists():
            with open(path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(float(row["step"])) <= resume_step]
        self.fields = fields
        self.file = open(path, "w", newline="")
        self.csv = csv.DictWriter(self.file, fieldnames=fields)
        self.csv.writeheader()
        self.csv.writerows(kept)
        self.tb = None
        if tensorboard:
            tensorboard_module = import_optional("torch.utils.tensorboard", "track_tensorboard", "tensorboard")
            purge_step = None if resume_step is None else resume_step + 1
            self.tb = tensorboard_module.SummaryWriter(str(run_dir), purge_step=purge_step)

    def log(self, row: dict[str, float]) -> None:
        row = {key: row.get(key, math.nan) for key in self.fields}
        self.csv.writerow(row)
        self.file.flush()
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and not math.isnan(value):
                    self.tb.add_scalar(key, value, int(row["step"]))

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------- the collector's account


# The collector's account of each log interval (collector.stats(), docs/bottleneck.md): the collection loops' shares
# of their time and the share of the trainer's time spent waiting for batches.
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
        stats = self.collector.stats()  # since the collector was built; the interval's is the difference
        interval = stats if self.last is None else stats - self.last
        self.last = stats
        return interval


def shares_text(stats: Stats) -> str:
    """The shares, short enough for a progress bar: `env 41% pol 33% col 9% idle 17% wait 62%`."""
    shares = stats.shares()
    wait = stats.wait / stats.seconds if stats.seconds > 0 else 0.0
    names = {"env": "env", "policy": "pol", "collector": "col", "idle": "idle"}
    return " ".join(f"{names[key]} {100 * value:.0f}%" for key, value in shares.items()) + f" wait {100 * wait:.0f}%"


def start_workers_for(backend: str) -> None:
    """With worker processes (or "auto", which picks them for a CPU agent), their fork server starts now: it
    imports torch while the agent is built, instead of at the collector."""
    if backend in ("process", "auto"):
        start_workers_early()


def print_collector(collector: Collector) -> None:
    """The run's first line: where the collector runs (what backend=auto chose), how far ahead, on which device.

    Written as the config keys that choose them (backend=thread prefetch=0 collects in lockstep in this process).
    Through tqdm.write, which keeps a progress bar below it intact.
    """
    tqdm.write(
        f"collector: backend={collector.backend} num_workers={collector.num_workers} "
        f"prefetch={collector.prefetch} device={collector.device}"
    )


def plot_shares(run_dir: Path, *, title: str) -> None:
    """time_shares.png from progress.csv: the collection loops' shares of their time and the trainer's wait, per row.

    Stacked: env steps, the policy's forward, the collector's own work and idle (waiting for the trainer) sum to
    the loops' time; the line is the share of the trainer's time spent waiting for batches in next().
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    with open(run_dir / "progress.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("time/env_share")]
    if not rows:
        return
    steps = [int(float(r["step"])) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    names = {"env": "env steps", "policy": "policy forward", "collector": "collector's work", "idle": "idle"}
    shares = [[100 * float(r[f"time/{key}_share"]) for r in rows] for key in names]
    ax.stackplot(steps, shares, labels=list(names.values()), alpha=0.8)
    wait = [100 * float(r["time/wait_share"]) for r in rows]
    ax.plot(steps, wait, color="black", label="trainer waiting in next()")
    ax.set(xlabel="env steps", ylabel="% of the time", ylim=(0, 100), title=title)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(run_dir / "time_shares.png", dpi=100)
    plt.close(fig)


def report_stats(collector: Collector, run_dir: Path, *, title: str) -> None:
    """After the run: the collector's account of the whole run (what bounded it), and time_shares.png."""
    print(f"collector over the run: {collector.stats()}")
    plot_shares(run_dir, title=f"where the time goes: {title}")
