"""What examples/ppo.py and examples/sac.py share, so that the scripts show the algorithm on the collector.

Config files and `key=value` overrides, `--help`, run folders, the CSV and TensorBoard logger, checkpoints and
`--resume`, torchrun's process group, videos and `--eval`. The scripts import it as `common` (it sits beside
them), also in worker processes, which run the script again.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import importlib
import inspect
import itertools
import math
import os
import re
import shlex
import shutil
import sys
import textwrap
import time
import types
import typing
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from tensordict import TensorDict
from tqdm import tqdm

from torch_rollout import Collector, Processes, Ray, Stats

__all__ = [
    "ConfigError",
    "EndedReturns",
    "Logger",
    "RecentReturns",
    "Run",
    "agent_device",
    "average_gradients",
    "check_rank_minibatches",
    "check_can_record",
    "check_numpy_only",
    "config_help",
    "drop_velocities",
    "evaluate",
    "gym_envs",
    "import_optional",
    "init_distributed",
    "load_config",
    "load_resume",
    "make_run_dir",
    "mask_velocity",
    "mean_over_ranks",
    "obs_rms_of",
    "parse_args",
    "placement",
    "plot_learning_curve",
    "print_collector",
    "print_resume_command",
    "progress_bar",
    "record_first_episode",
    "restore_obs_rms",
    "save_checkpoint",
    "sum_over_ranks",
    "to_sequences",
    "yaml_scalar",
]


# ---------------------------------------------------------------------------- config files and overrides


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


# ---------------------------------------------------------------------------- command line


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


def parse_args(
    doc: str, config_cls: type, default_config: Path, argv: list[str] | None, *, checkpoints: bool = False
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The script's command line: `--config`, KEY=VALUE overrides and, with `checkpoints`, `--eval` and `--resume`.

    Returns the parser too: `parser.error(str(error))` reports a ConfigError as argparse reports its own.
    """
    parser = argparse.ArgumentParser(
        description=doc.split("\n")[0],
        epilog=config_help(config_cls, doc, default_config),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=None, help=f"YAML config (default: {default_config.name})")
    if checkpoints:
        parser.add_argument("--eval", metavar="CHECKPOINT", default=None, help="evaluate a checkpoint instead")
        parser.add_argument(
            "--resume",
            metavar="CHECKPOINT",
            default=None,
            help="carry on the run of a checkpoint (its config, then the overrides, e.g. a larger total_timesteps)",
        )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. seed=2")
    return parser, parser.parse_args(argv)


# ---------------------------------------------------------------------------- environments


def placement(backend: str, num_workers: int) -> str | Processes | Ray:
    """The collector's backend: the config's name, with its worker count for processes and Ray."""
    if backend == "process":
        return Processes(num_workers)
    if backend == "ray":
        return Ray(num_workers)
    if num_workers != 1:
        raise ConfigError(f"num_workers={num_workers} needs backend=process or backend=ray, got {backend}")
    return backend


def recipe(path: str, key: str) -> Callable[..., Any]:
    """The function that the config key `key` names as "module:function", e.g. an env recipe."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(
            f"config key {key!r}: {path!r} names no function that can be imported ({error}); give it as "
            "module:function, with the module on PYTHONPATH"
        ) from error


ACTIVATIONS = {"tanh": nn.Tanh, "elu": nn.ELU}


def activation(name: str) -> type[nn.Module]:
    """The hidden layers' activation of a config's name."""
    if name not in ACTIVATIONS:
        raise ConfigError(f"activation={name!r}: choose one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def adapt_learning_rate(optimizer: torch.optim.Optimizer, kl: float, desired_kl: float) -> None:
    """rsl_rl's "adaptive" schedule, after each minibatch: the step size shrinks by 1.5 where the KL to the weights
    that acted is over twice desired_kl, and grows by 1.5 where it is under half of it, within [1e-5, 1e-2]."""
    lr = optimizer.param_groups[0]["lr"]
    if kl > 2 * desired_kl:
        lr = max(1e-5, lr / 1.5)
    elif 0 < kl < desired_kl / 2:
        lr = min(1e-2, lr * 1.5)
    for group in optimizer.param_groups:
        group["lr"] = lr


def agent_device(device: str | None) -> torch.device:
    """Where the agent, the batches (and a torch-tensor env) live: `device`, or None: cuda if available."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def check_numpy_only(cfg: Any, video: Path | None) -> None:
    """Refuses the config keys of gymnasium's NumPy wrappers for a vector env of torch tensors."""
    numpy_only = ("mask_velocity", "normalize_obs", "normalize_reward", "clip_action")
    if video is not None or any(getattr(cfg, key) for key in numpy_only):
        raise ConfigError(
            f"{cfg.env_id} is a vector env of torch tensors: {', '.join(numpy_only)} and capture_video are for "
            "gymnasium's NumPy envs"
        )


def gym_envs(cfg: Any, num_envs: int, *, training: bool = True, video: Path | None = None) -> gym.vector.VectorEnv:
    """gymnasium's SyncVectorEnv of cfg.env_id with the wrappers the config asks for.

    With `training=False` (for --eval) rewards stay raw: no reward scaling or clipping. With
    `video`, the first episode of sub-env 0 is recorded to `<video>-episode-0.mp4`.
    """
    wrappers = [mask_velocity(cfg.env_id)] if cfg.mask_velocity else []
    if video is not None:
        wrappers.append(record_first_episode(video))
    render_mode = None if video is None else "rgb_array"
    envs = gym.make_vec(cfg.env_id, num_envs, "sync", wrappers=wrappers, render_mode=render_mode)
    if cfg.normalize_reward and training:
        # NormalizeReward rescales what the collector sees, so its episode_return is no longer
        # the env's return: record the raw returns beneath the scaling (the "episode" info)
        envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    if cfg.clip_action:
        envs = gym.wrappers.vector.ClipAction(envs)
    if cfg.normalize_obs:
        envs = gym.wrappers.vector.NormalizeObservation(envs)
        if cfg.clip_obs is not None:
            bound = cfg.clip_obs
            envs = gym.wrappers.vector.TransformObservation(envs, lambda obs: np.clip(obs, -bound, bound))
    if cfg.normalize_reward and training:
        envs = gym.wrappers.vector.NormalizeReward(envs, gamma=cfg.gamma)
        if cfg.clip_reward is not None:
            envs = gym.wrappers.vector.ClipReward(envs, -cfg.clip_reward, cfg.clip_reward)
    return envs


# CartPole's termination thresholds of x and theta: scaled by them, what is left of the observation spans [-1, 1]
CARTPOLE_BOUNDS = np.array([2.4, 12 * 2 * math.pi / 360], dtype=np.float32)


def drop_velocities(obs: np.ndarray) -> np.ndarray:
    """CartPole's [x, x_dot, theta, theta_dot] -> [x, theta] / bounds: velocities must be inferred from the past.

    An angle of 0.01 rad would otherwise reach the LSTM as an input change of 0.01, which the
    difference of two steps (the velocity) makes smaller still.
    """
    return (obs[[0, 2]] / CARTPOLE_BOUNDS).astype(np.float32)


def mask_velocity(env_id: str) -> Callable[[gym.Env], gym.Env]:
    """The sub-env wrapper of `mask_velocity=true`: CartPole-v1 observing its position and angle only."""
    if env_id != "CartPole-v1":
        raise ConfigError(f"mask_velocity knows CartPole-v1's observation only, got env_id={env_id}")
    position_and_angle = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    return functools.partial(
        gym.wrappers.TransformObservation, func=drop_velocities, observation_space=position_and_angle
    )


def record_first_episode(video: Path) -> Callable[[gym.Env], gym.Env]:
    """A sub-env wrapper that records the first episode of sub-env 0 to `<video>-episode-0.mp4`.

    One sub-env records, one episode: RecordVideo holds every frame in memory until the episode ends
    (0.7 MB a CartPole frame, 500 of them in a good episode), and --eval counts first episodes only.
    """
    sub_env = itertools.count()

    def wrap(env: gym.Env) -> gym.Env:
        if next(sub_env) != 0:
            return env
        with warnings.catch_warnings():
            # it warns whenever the folder exists; our file names say which checkpoint they show
            warnings.filterwarnings("ignore", message=".*Overwriting existing videos")
            return gym.wrappers.RecordVideo(
                env, str(video.parent), episode_trigger=lambda episode: episode == 0, name_prefix=video.name
            )

    return wrap


def check_can_record(env_id: str, seed: int) -> None:
    """Fails now, naming the fix, if capture_video could not record: moviepy missing, or the env cannot render."""
    import_optional("moviepy", "capture_video", "moviepy")
    # frames for a file need no display; without one, pygame's SDL would print "error: XDG_RUNTIME_DIR is invalid"
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    env = gym.make(env_id, render_mode="rgb_array")
    try:
        env.reset(seed=seed)
        env.render()
    except (gym.error.DependencyNotInstalled, ImportError) as error:
        raise ConfigError(f"capture_video=true: {env_id} cannot render the frames to record: {error}") from None
    finally:
        env.close()


def _find_wrapper(envs: Any, cls: type) -> Any | None:
    """The first wrapper of type `cls` in the chain, or None (also for a recipe of envs that workers build)."""
    while not isinstance(envs, cls):
        envs = getattr(envs, "env", None)
        if envs is None:
            return None
    return envs


def obs_rms_of(envs: Any) -> dict[str, Any] | None:
    """The running statistics of the NormalizeObservation wrapper in `envs`, as tensors (weights_only checkpoints)."""
    obs_norm = _find_wrapper(envs, gym.wrappers.vector.NormalizeObservation)
    if obs_norm is None:
        return None
    rms = obs_norm.obs_rms
    return {"mean": torch.as_tensor(rms.mean), "var": torch.as_tensor(rms.var), "count": float(rms.count)}


def restore_obs_rms(envs: Any, saved: dict[str, Any] | None, *, frozen: bool = False) -> None:
    """Puts `saved` statistics (of obs_rms_of) back into the NormalizeObservation wrapper of `envs`."""
    obs_norm = _find_wrapper(envs, gym.wrappers.vector.NormalizeObservation)
    if saved is None or obs_norm is None:
        return
    obs_norm.obs_rms.mean = saved["mean"].numpy()
    obs_norm.obs_rms.var = saved["var"].numpy()
    obs_norm.obs_rms.count = saved["count"]
    if frozen:
        obs_norm.update_running_mean = False


# ---------------------------------------------------------------------------- data-parallel (torchrun)
# Under `torchrun --nproc_per_node K examples/ppo.py ...` each of the K processes (ranks) runs the script with a
# collector of its own. Its envs are seeded from its rank's own part of the seed stream (an int seed is keyed by the
# rank of the process group: docs/data-parallel.md), every rank starts from the same weights (the same torch seed),
# and each optimizer step averages the gradients of all ranks, so the weights stay equal. A batch is then K * T * N
# transitions. Rank 0 alone logs, plots and writes checkpoints; the mean return it logs is over every rank's episodes.


def init_distributed(device: torch.device, resume: dict[str, Any] | None = None) -> tuple[int, int, torch.device]:
    """Joins torchrun's process group when torchrun started this process: returns rank, world size and device.

    Raises:
        ConfigError: the checkpoint `resume` carries on a run of another number of ranks.
    """
    rank, world_size = 0, 1
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        if device.type == "cuda":  # one GPU per rank
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    if resume is not None and resume.get("world_size", 1) != world_size:
        raise ConfigError(
            f"--resume: the checkpoint's run had {resume.get('world_size', 1)} ranks, this one has {world_size}; "
            f"resume it with as many (torchrun --nproc_per_node {resume.get('world_size', 1)}, or plain python for 1)"
        )
    return rank, world_size, device


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the ranks; `x` itself in a single process."""
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
    return x


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The mean of `x` over the ranks; `x` itself in a single process."""
    return sum_over_ranks(x) / dist.get_world_size() if dist.is_initialized() else x


def average_gradients(module: nn.Module) -> None:
    """Replaces each gradient by its mean over the ranks, all of them in one all_reduce; nothing in a single process."""
    if not dist.is_initialized():
        return
    grads = [p.grad for p in module.parameters()]
    mean = mean_over_ranks(torch.cat([g.reshape(-1) for g in grads]))
    for grad, part in zip(grads, mean.split([g.numel() for g in grads])):
        grad.copy_(part.view_as(grad))


def check_rank_minibatches(size: int, num_minibatches: int) -> None:
    """Under torchrun, fails unless a rank's `size` transitions make exactly `num_minibatches` minibatches.

    From M * (M - 1) transitions on there are exactly M minibatches: every rank takes as many optimizer steps,
    whatever its mask left of its batch (fewer steps on one rank would leave the others waiting).
    """
    if dist.is_initialized() and size < num_minibatches * (num_minibatches - 1):
        raise RuntimeError(
            f"a rank's batch has {size} transitions, too few for num_minibatches={num_minibatches} under "
            "torchrun: collect more per rank (num_envs * num_steps) or use fewer minibatches"
        )


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


class EndedReturns:
    """The returns of the episodes that end in each batch, kept on the batch's device and added to a RecentReturns
    only at `flush`: one wait for the device per log row, not one per batch (SAC's T=1 batches come by thousands).

    `reached`: the env step after the first batch at which the mean of a full window was >= `target`, else None.
    """

    def __init__(self, recent: RecentReturns, target: float | None = None) -> None:
        self.recent, self.target, self.reached = recent, target, None
        self.pending: list[tuple[int, torch.Tensor]] = []  # (env step after the batch, returns [T, N], NaN elsewhere)

    def add(self, step: int, batch: TensorDict) -> None:
        """Keeps the returns of a batch's ended episodes (`done` on a real row): a new tensor, not the batch's."""
        self.pending.append((step, batch["episode_return"].where(batch["done"] & batch["mask"], torch.nan)))

    def flush(self) -> None:
        """Adds the pending returns to the RecentReturns, batch by batch, in the order they came (one host sync)."""
        if not self.pending:
            return
        steps, returns = zip(*self.pending)
        for step, row in zip(steps, torch.stack(returns).cpu()):
            self.recent.add(row[~row.isnan()])
            full = len(self.recent.returns) == self.recent.returns.maxlen
            if self.reached is None and self.target is not None and full and self.recent.mean >= self.target:
                self.reached = step
        self.pending.clear()


# ---------------------------------------------------------------------------- run folder, logging, checkpoints


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

    def log_episodes(
        self, finished: torch.Tensor, returns: torch.Tensor, lengths: torch.Tensor, *, step: int, row_steps: int
    ) -> None:
        """TensorBoard's charts/episodic_return and _length, as CleanRL's: one point at the env step each ended.

        `finished` [T, N] marks the episode ends of a batch whose first row follows env step `step`; each row
        holds `row_steps` env steps (N envs times the ranks).
        """
        if self.tb is not None:
            ends = step + (finished.nonzero()[:, 0] + 1) * row_steps  # [E]
            for end, episode_return, length in zip(ends.tolist(), returns.tolist(), lengths.tolist()):
                self.tb.add_scalar("charts/episodic_return", episode_return, end)
                self.tb.add_scalar("charts/episodic_length", length, end)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def progress_bar(total: int, initial: int, *, enabled: bool) -> tqdm:
    """tqdm over env steps: redrawn every second in a terminal, every 30 s into a log file."""
    return tqdm(
        total=total, initial=initial, unit="step", mininterval=1 if sys.stderr.isatty() else 30, disable=not enabled
    )


def save_checkpoint(path: Path, state: dict[str, Any], own: dict[str, Any]) -> None:
    """Writes `state` and this rank's `own` part; under torchrun every rank calls it and rank 0 writes all parts.

    A Ctrl-C or a crash in the middle of writing leaves the last good checkpoint as it was.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    ranks = [None] * world_size if is_main else None
    if dist.is_initialized():
        dist.gather_object(own, ranks, dst=0)
    if not is_main:
        return
    # every rank's own part, for --resume under torchrun
    state = {**state, **own, "world_size": world_size, **({"ranks": ranks} if world_size > 1 else {})}
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def load_resume(
    checkpoint: str, overrides: Sequence[str], load_config: Callable[..., Any]
) -> tuple[Any, dict[str, Any]]:
    """`--resume CHECKPOINT`: the config to carry the run on with (the checkpoint's, then `overrides`) and the state.

    Raises:
        ConfigError: not a checkpoint of this example, or its run is complete under the config.
    """
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if "collector" not in state:
        raise ConfigError(f"--resume {checkpoint}: not a checkpoint of this version of the example")
    # by default the run carries on in the checkpoint's folder
    cfg = load_config(None, overrides, base={**state["config"], "run_dir": str(Path(checkpoint).resolve().parent)})
    done = state["iteration"] * cfg.num_envs * cfg.num_steps * state.get("world_size", 1)
    if done >= cfg.total_timesteps:
        raise ConfigError(
            f"--resume {checkpoint}: the run is complete ({done} steps of total_timesteps="
            f"{cfg.total_timesteps}); pass a larger total_timesteps=... to carry on"
        )
    return cfg, state


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


def print_collector(collector: Collector) -> None:
    """The run's first line: where the collector runs (what backend=auto chose), how far ahead, on which device.

    Written as the config keys that choose them (backend=thread prefetch=0 collects in lockstep in this process).
    Through tqdm.write, which keeps a progress bar below it intact.
    """
    tqdm.write(
        f"collector: backend={collector.backend} num_workers={collector.num_workers} "
        f"prefetch={collector.prefetch} device={collector.device}"
    )


def print_resume_command(script: str, checkpoint: Path, iteration: int, world_size: int) -> None:
    """After a Ctrl-C: the command that carries the run on, with absolute paths, so that it works from any folder."""
    launcher = f"torchrun --nproc_per_node {world_size}" if world_size > 1 else shlex.quote(sys.executable)
    script, checkpoint = (shlex.quote(str(Path(path).resolve())) for path in (script, checkpoint))
    print(
        f"\ninterrupted in iteration {iteration}; carry on from the last checkpoint with:\n"
        f"  {launcher} {script} --resume {checkpoint}",
        file=sys.stderr,
    )


def plot_learning_curve(run_dir: Path, *, title: str, window: int) -> None:
    """learning_curve.png from progress.csv: the mean return of the last `window` episodes against env steps."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    with open(run_dir / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(float(r["step"])) for r in rows]
    returns = [float(r["charts/mean_return"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, returns)
    ax.set(xlabel="env steps", ylabel=f"mean return of the last {window} episodes", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "learning_curve.png", dpi=100)
    plt.close(fig)


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


def to_sequences(batch: TensorDict, length: int) -> TensorDict:
    """[T, N] -> [T // length * N, length]: each env's rows cut into sequences of `length` steps."""
    T, N = batch.shape
    return batch.apply(
        lambda x: x.reshape(T // length, length, N, *x.shape[2:]).transpose(1, 2).reshape(-1, length, *x.shape[2:]),
        batch_size=[T // length * N, length],
    )


# ---------------------------------------------------------------------------- a PPO run around its loop


class Run:
    """The plumbing around examples/ppo.py's loop: torchrun, the run folder, logging, checkpoints, Ctrl-C.

    Used as `with run, collector: for iteration, batch in run.iterate(collector): ...`, then `run.finish(...)`.
    Under torchrun every rank makes one; rank 0 alone logs, plots and writes checkpoints.

    Raises:
        ConfigError: a package that track_tensorboard or capture_video needs is missing, or `resume` is a run of
            another number of ranks; before anything is written.
    """

    def __init__(
        self, cfg: Any, device: torch.device, fields: list[str], *, script: str, resume: dict[str, Any] | None = None
    ) -> None:
        self.cfg, self.fields, self.script, self.resume = cfg, fields, script, resume
        self.start = time.perf_counter()
        self.rank, self.world_size, self.device = init_distributed(device, resume)
        self.is_main = self.rank == 0
        # optional integrations fail now if a package they need is missing, not once the envs and agent are built
        if cfg.track_tensorboard:
            import_optional("torch.utils.tensorboard", "track_tensorboard", "tensorboard")
        if cfg.capture_video:
            check_can_record(cfg.env_id, cfg.seed)
        self.dir = make_run_dir(cfg, write=self.is_main)
        # the checkpoint saves the observation statistics for --eval, read from the wrapper, which must then
        # live in this process (worker processes, or other ranks, would each keep statistics of their own)
        if cfg.backend != "thread" and cfg.normalize_obs:
            raise ConfigError(f"normalize_obs needs backend=thread, got backend={cfg.backend}")
        if self.world_size > 1 and cfg.normalize_obs:
            raise ConfigError(
                f"normalize_obs keeps statistics per process, which the {self.world_size} ranks would not share"
            )
        self.checkpoint_path = self.dir / "checkpoint.pt"
        self.batch_steps = cfg.num_envs * cfg.num_steps * self.world_size  # transitions per iteration, all ranks
        self.num_iterations = math.ceil(cfg.total_timesteps / self.batch_steps)
        self.done_iterations = self.iteration = 0 if resume is None else resume["iteration"]
        self.wall_offset = 0.0 if resume is None else resume["wall_time"]
        # this rank's streams and episodes in the checkpoint (see save_checkpoint)
        self.own = resume if resume is None or self.world_size == 1 else resume["ranks"][self.rank]
        episodes = 0 if resume is None else resume["episodes"]
        self.recent = RecentReturns(cfg.return_window, () if resume is None else self.own["recent_returns"], episodes)
        self.wait_s = 0.0
        self.logger: Logger | None = None
        self.shares = ""  # its shares over the last interval, for the progress bar

    def track(
        self, agent: nn.Module, optimizer: torch.optim.Optimizer, shuffle_gen: torch.Generator, envs: Any
    ) -> None:
        """What checkpoint.pt saves besides the collector; with --resume, their state is restored now."""
        self.agent, self.optimizer, self.shuffle_gen, self.envs = agent, optimizer, shuffle_gen, envs
        if self.resume is not None:
            agent.load_state_dict(self.resume["model"])
            optimizer.load_state_dict(self.resume["optimizer"])
            shuffle_gen.set_state(self.resume["shuffle_rng"])
            torch.set_rng_state(self.own["torch_rng"])
            restore_obs_rms(envs, self.resume["obs_rms"])
        resume_step = None if self.resume is None else self.done_iterations * self.batch_steps
        if self.is_main:
            self.logger = Logger(self.dir, self.fields, resume_step=resume_step, tensorboard=self.cfg.track_tensorboard)
        total, done = self.num_iterations * self.batch_steps, self.done_iterations * self.batch_steps
        self.progress = progress_bar(total, done, enabled=self.is_main)

    def iterate(self, collector: Collector) -> Iterator[tuple[int, TensorDict]]:
        """`(iteration, batch)` per batch; times the waits, moves the progress bar, checkpoints (checkpoint_every).

        Rank 0 first prints where the collector runs (`print_collector`).
        """
        self.collector, self.intervals = collector, Intervals(collector)
        if self.is_main:
            print_collector(collector)  # which placement backend=auto chose
        if self.resume is not None:
            # the step count, the policy versions and the envs' seeds carry on (in-flight episodes restart)
            collector.load_state_dict(self.own["collector"])
        waited_from = time.perf_counter()
        for iteration, batch in enumerate(collector, start=self.done_iterations + 1):
            self.iteration = iteration
            # time/wait_s: how long this batch kept the trainer waiting (in lockstep: the whole collection)
            self.wait_s = time.perf_counter() - waited_from
            yield self.iteration, batch
            self.progress.update(self.batch_steps)
            self.progress.set_postfix_str(f"mean_return={self.recent.mean:.1f} {self.shares}", refresh=False)
            waited_from = time.perf_counter()
            if self.cfg.checkpoint_every and self.iteration % self.cfg.checkpoint_every == 0:
                self.save_checkpoint()

    def log_episodes(self, batch: TensorDict) -> None:
        """The episodes that ended in this iteration's batch [T, N]: their returns and lengths, of all ranks."""
        if self.cfg.normalize_reward:
            # the env's own returns, beneath NormalizeReward (see gym_envs): RecordEpisodeStatistics' "episode" info
            finished = batch["info", "_episode"]  # [T, N]
            returns, lengths = batch["info", "episode", "r"][finished], batch["info", "episode", "l"][finished]
        else:
            finished = batch["done"] & batch["mask"]
            returns, lengths = batch["episode_return"][finished], batch["episode_length"][finished]
        self.recent.add(returns)
        if self.logger is not None:
            first = (self.iteration - 1) * self.batch_steps
            self.logger.log_episodes(
                finished, returns, lengths, step=first, row_steps=self.cfg.num_envs * self.world_size
            )

    def log(self, row: dict[str, float]) -> None:
        """Rank 0 logs `row` with this iteration's step, wall time, mean return, episodes, SPS and wait."""
        if self.logger is None:
            return
        interval = self.intervals.take()
        self.shares = shares_text(interval)
        step, elapsed = self.iteration * self.batch_steps, time.perf_counter() - self.start
        row = {
            "step": step,
            "wall_time": self.wall_offset + elapsed,
            "charts/mean_return": self.recent.mean,
            "charts/episodes": self.recent.episodes,
            "charts/SPS": (step - self.done_iterations * self.batch_steps) / elapsed,
            "time/wait_s": self.wait_s,
            **stats_row(interval),
            **row,
        }
        self.logger.log(row)

    def save_checkpoint(self) -> None:
        state = {
            "config": dataclasses.asdict(self.cfg),
            "model": self.agent.state_dict(),
            "obs_rms": obs_rms_of(self.envs),  # --eval normalises observations as the agent saw them in training
            # what --resume needs besides: where the run stands, the optimizer, the random streams
            "iteration": self.iteration,
            "optimizer": self.optimizer.state_dict(),
            "shuffle_rng": self.shuffle_gen.get_state(),
            "episodes": self.recent.episodes,
            "wall_time": self.wall_offset + time.perf_counter() - self.start,
        }
        # what differs per rank: its collector's seed stream, its action sampling and its episodes
        own = {"collector": self.collector.state_dict(), "torch_rng": torch.get_rng_state()}
        save_checkpoint(self.checkpoint_path, state, {**own, "recent_returns": list(self.recent.returns)})

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: Any) -> None:
        if exc_type is not KeyboardInterrupt:
            return
        self.progress.close()
        if self.logger is not None:
            self.logger.close()
            print_resume_command(self.script, self.checkpoint_path, self.iteration + 1, self.world_size)
        raise SystemExit(130) from None

    def finish(self, title: str, *, evaluate: Callable[[Path, list[str]], Any] | None = None) -> float:
        """After the last batch: the final checkpoint; leaves torchrun's group; rank 0 closes the log, plots,
        runs `evaluate(checkpoint, ["eval_episodes=1"])` if given and prints the result. Returns the mean return."""
        self.progress.close()
        self.save_checkpoint()
        if dist.is_initialized():
            dist.destroy_process_group()  # the last collective was the checkpoint's
        if self.logger is None:
            return self.recent.mean
        self.logger.close()
        plot_learning_curve(self.dir, title=title, window=self.cfg.return_window)
        report_stats(self.collector, self.dir, title=title)
        if evaluate is not None:
            evaluate(self.checkpoint_path, ["eval_episodes=1"])
        print(f"run folder: {self.dir} ({time.perf_counter() - self.start:.1f} s)")
        of_ranks = f" of each of {self.world_size} ranks" if self.world_size > 1 else ""
        print(f"final mean return (last {len(self.recent.returns)} episodes{of_ranks}): {self.recent.mean:.1f}")
        return self.recent.mean


# ---------------------------------------------------------------------------- evaluation


def evaluate(
    checkpoint: str | Path,
    overrides: Sequence[str],
    load_config: Callable[..., Any],
    make_envs: Callable[..., gym.vector.VectorEnv],
    make_agent: Callable[..., nn.Module],
) -> tuple[float, float]:
    """Runs `eval_episodes` deterministic episodes of a checkpoint, one per sub-env; returns mean and std.

    The agent acts with `act_deterministic(obs, memory)`; a recurrent one (with `initial_state`) carries its
    memory. With capture_video, the first episode is recorded to videos/eval-step<step>-episode-0.mp4 beside the
    checkpoint, where <step> is the checkpoint's env step; evaluating it again replaces that file.
    """
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    cfg = load_config(None, overrides, base=state["config"])
    torch.set_num_threads(cfg.torch_threads)
    video = None
    if cfg.capture_video:
        check_can_record(cfg.env_id, cfg.seed)
        trained = state["config"]  # the batch size of training, whatever this evaluation overrides
        step = state["iteration"] * trained["num_envs"] * trained["num_steps"] * state.get("world_size", 1)
        video = Path(checkpoint).parent / "videos" / f"eval-step{step}"
    # the agent evaluates on the CPU, and so does a vector env of torch tensors
    envs = make_envs(dataclasses.replace(cfg, device="cpu"), cfg.eval_episodes, training=False, video=video)
    restore_obs_rms(envs, state["obs_rms"], frozen=True)
    agent = make_agent(envs.single_observation_space, envs.single_action_space, cfg)
    agent.load_state_dict(state["model"])
    memory = agent.initial_state(cfg.eval_episodes) if hasattr(agent, "initial_state") else None

    # one episode per sub-env; later (autoreset) episodes are ignored
    returns = np.zeros(cfg.eval_episodes)
    finished = np.zeros(cfg.eval_episodes, dtype=bool)
    obs, _ = envs.reset(seed=cfg.seed + 10_000)  # episodes unseen in training
    torch_env = isinstance(obs, torch.Tensor)  # a vector env of torch tensors takes and returns tensors
    while not finished.all():
        with torch.no_grad():
            action, memory = agent.act_deterministic(torch.as_tensor(obs, dtype=torch.float32), memory)
        if not torch_env:
            action = action.numpy()
            if isinstance(envs.single_action_space, gym.spaces.Box):
                action = np.clip(action, envs.single_action_space.low, envs.single_action_space.high)
        obs, reward, terminated, truncated, _ = envs.step(action)
        returns += np.where(finished, 0.0, np.asarray(reward))
        finished |= np.asarray(terminated | truncated)
    envs.close()  # RecordVideo writes the file here at the latest
    mean, std = float(returns.mean()), float(returns.std())
    episodes = "1 episode" if cfg.eval_episodes == 1 else f"{cfg.eval_episodes} episodes"
    print(f"eval over {episodes}: mean return {mean:.1f} +- {std:.1f}")
    if video is not None:
        print(f"video of the first episode: {video}-episode-0.mp4")
    return mean, std
