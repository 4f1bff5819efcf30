"""PPO on top of torch_rollout: one file, read top to bottom.

Config, env factory, agent, data-parallel helpers (torchrun), main loop, then the plot, `--eval` and the
command line.
The collector steps the envs and runs the policy in worker processes (or a background
thread), so the next batch is being collected while this script updates the agent on the
current one. Each run writes progress.csv, learning_curve.png, checkpoint.pt and config.yaml
into its run folder; with track_tensorboard=true TensorBoard events too, and with
capture_video=true videos/*.mp4 (both need `pip install 'torch_rollout[examples]'`).

Usage::

    python examples/ppo.py --help                            # every config key, its default and meaning
    python examples/ppo.py                                   # CartPole-v1, configs/ppo_cartpole.yaml
    python examples/ppo.py seed=2 total_timesteps=100000     # key=value overrides
    python examples/ppo.py --config configs/ppo_halfcheetah.yaml
    python examples/ppo.py --config configs/ppo_cartpole_novel_lstm.yaml   # an LSTM on CartPole without velocities
    python examples/ppo.py track_tensorboard=true            # then: tensorboard --logdir runs
    python examples/ppo.py --eval runs/ppo_CartPole-v1_seed1/checkpoint.pt
    python examples/ppo.py --eval runs/ppo_CartPole-v1_seed1/checkpoint.pt capture_video=true   # into .../videos
    python examples/ppo.py --resume runs/ppo_CartPole-v1_seed1/checkpoint.pt   # carry on a stopped run
    torchrun --nproc_per_node 2 examples/ppo.py backend=thread   # data-parallel: 2 ranks, gradients averaged
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from tensordict import TensorDict
from torch.distributions import Categorical, Distribution, Independent, Normal
from tqdm import tqdm

from torch_rollout import GAE, BatchKeys, Collector, Processes, Ray

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "ppo_cartpole.yaml"


# ---------------------------------------------------------------------------- config


@dataclasses.dataclass
class Config:
    """PPO hyperparameters; the defaults are CleanRL's ppo.py, the YAML files tune them per env.

    The comment beside each field is its description in `--help`, the headings its groups there.
    """

    # the run
    exp_name: str = "ppo"  # first part of the run folder's name
    run_dir: str | None = None  # output folder; None: runs/<exp_name>_<env_id>_seed<seed>
    seed: int = 1  # seeds the agent's init, the env resets, action sampling and minibatch order
    device: str | None = None  # where the agent and the batches live; None: cuda if available
    torch_threads: int = 1  # intra-op threads for torch; set_num_threads is process-wide

    # environments
    env_id: str = "CartPole-v1"  # any gymnasium id with a flat Box observation space
    num_envs: int = 4  # parallel envs (N) in one gymnasium SyncVectorEnv
    normalize_obs: bool = False  # NormalizeObservation; its statistics go into the checkpoint
    clip_obs: float | None = None  # clip normalised observations to [-clip_obs, clip_obs]
    normalize_reward: bool = False  # NormalizeReward: divide by a running std of the discounted return
    clip_reward: float | None = None  # clip scaled rewards to [-clip_reward, clip_reward]
    clip_action: bool = False  # ClipAction on Box action spaces
    mask_velocity: bool = False  # CartPole only: drop the cart and pole velocities, so that acting needs memory

    # collection and PPO
    total_timesteps: int = 500_000  # env transitions to collect (all envs together)
    num_steps: int = 128  # steps per env per batch (T); a batch holds T * N transitions
    backend: str = "auto"  # where collection runs: "process", "thread", "ray", or "auto" (processes for a CPU agent)
    num_workers: int = 1  # worker processes or Ray actors; each steps num_envs / num_workers envs
    prefetch: int | None = None  # batches collected ahead of training; 0: lockstep; None: the collector's default
    learning_rate: float = 2.5e-4  # Adam step size at the start
    anneal_lr: bool = True  # decay the learning rate linearly to 0 over the run
    adam_eps: float = 1e-5  # Adam's epsilon
    gamma: float = 0.99  # discount factor
    gae_lambda: float = 0.95  # GAE's bias/variance trade-off
    num_minibatches: int = 4  # minibatches per epoch
    update_epochs: int = 4  # passes over each batch
    norm_adv: bool = True  # normalise advantages per minibatch
    clip_coef: float = 0.2  # PPO's ratio clip range
    clip_vloss: bool = True  # clip the value update around the stored value too
    ent_coef: float = 0.01  # entropy bonus
    vf_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 0.5  # global gradient-norm clip
    target_kl: float | None = None  # stop the epochs early once approx-KL exceeds this; None: never

    # the agent
    hidden_size: int = 64  # width of the two tanh layers of actor and critic
    lstm_size: int = 0  # > 0: an LSTM of this width beneath actor and critic (a recurrent policy); 0: MLP only
    bptt_steps: int = 8  # with an LSTM: minibatches of sequences of this many steps, replayed from the stored state
    init_log_std: float = 0.0  # initial log-std of the Gaussian policy (Box actions only)

    # logging, checkpoints and evaluation
    return_window: int = 20  # episodes in the reported mean return
    checkpoint_every: int = 10  # iterations between checkpoints that --resume carries on from; 0: only at the end
    eval_episodes: int = 10  # deterministic episodes run by --eval
    track_tensorboard: bool = False  # also write the logged scalars as TensorBoard events into the run folder
    capture_video: bool = False  # record the first --eval episode, and one after training, into <run folder>/videos


class ConfigError(ValueError):
    """A config file or override names an unknown key or gives a value of the wrong type."""


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Checks `value` against a field's type; returns it, ints widened to float."""
    expected = annotation
    if isinstance(annotation, types.UnionType):  # only `X | None` in Config
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
    path: str | Path | None = None, overrides: Sequence[str] = (), *, base: dict[str, Any] | None = None
) -> Config:
    """Builds a Config from `base` (a checkpoint's config), the YAML file at `path`, then `key=value` overrides.

    Override values are read as YAML scalars (`true`, `null`, `3e-4`, `128`); string
    fields take the text as it is.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or a malformed override.
    """
    hints = typing.get_type_hints(Config)
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
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE")
        key = key.strip()
        if hints.get(key) in (str, str | None) and text != "null":
            value = text
        else:
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                raise ConfigError(f"override {item!r}: {text!r} is not a YAML scalar") from None
        set_value(key, value, f"override {item!r}")
    return Config(**values)


def import_optional(module: str, key: str, package: str) -> types.ModuleType:
    """Imports what the config key `key` needs, or fails before the run starts, naming the key and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{key}=true needs {package}, which is not installed: pip install 'torch_rollout[examples]' "
            f"(or pip install {package}), or leave {key} off"
        ) from None


# ---------------------------------------------------------------------------- environments


def agent_device(cfg: Config) -> torch.device:
    """Where the agent, the batches (and a torch-tensor env) live."""
    return torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def placement(cfg: Config) -> str | Processes | Ray:
    """The collector's backend: the config's name, with its worker count for processes and Ray."""
    if cfg.backend == "process":
        return Processes(cfg.num_workers)
    if cfg.backend == "ray":
        return Ray(cfg.num_workers)
    if cfg.num_workers != 1:
        raise ConfigError(f"num_workers={cfg.num_workers} needs backend=process or backend=ray, got {cfg.backend}")
    return cfg.backend


def make_envs(cfg: Config, num_envs: int, *, training: bool = True, video: Path | None = None) -> gym.vector.VectorEnv:
    """Builds the vector env with the wrappers the config asks for.

    With `training=False` (for --eval) rewards stay raw: no reward scaling or clipping. With
    `video`, the first episode of sub-env 0 is recorded to `<video>-episode-0.mp4`.
    """
    if cfg.env_id.startswith("torch_rollout/"):
        # a vector env of torch tensors, such as torch_rollout/CartPole-v1, on the agent's device;
        # the wrappers below are gymnasium's NumPy ones
        numpy_only = ("mask_velocity", "normalize_obs", "normalize_reward", "clip_action")
        if video is not None or any(getattr(cfg, key) for key in numpy_only):
            raise ConfigError(
                f"{cfg.env_id} is a vector env of torch tensors: {', '.join(numpy_only)} and capture_video are for "
                "gymnasium's NumPy envs"
            )
        return gym.make_vec(cfg.env_id, num_envs=num_envs, device=agent_device(cfg))
    wrappers = []
    if cfg.mask_velocity:
        if cfg.env_id != "CartPole-v1":
            raise ConfigError(f"mask_velocity knows CartPole-v1's observation only, got env_id={cfg.env_id}")
        position_and_angle = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        wrappers.append(
            functools.partial(
                gym.wrappers.TransformObservation, func=drop_velocities, observation_space=position_and_angle
            )
        )
    if video is not None:
        # one sub-env records, one episode: RecordVideo holds every frame in memory until the episode ends
        # (0.7 MB a CartPole frame, 500 of them in a good episode), and --eval counts first episodes only
        sub_env = itertools.count()
        wrappers.append(lambda env: record_first_episode(env, video) if next(sub_env) == 0 else env)
    envs = gym.make_vec(
        cfg.env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        wrappers=wrappers,
        render_mode=None if video is None else "rgb_array",
    )
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


def record_first_episode(env: gym.Env, video: Path) -> gym.Env:
    """gymnasium's RecordVideo, writing the env's first episode to `<video>-episode-0.mp4`."""
    with warnings.catch_warnings():
        # it warns whenever the folder exists; our file names say which checkpoint they show
        warnings.filterwarnings("ignore", message=".*Overwriting existing videos")
        return gym.wrappers.RecordVideo(
            env, str(video.parent), episode_trigger=lambda episode: episode == 0, name_prefix=video.name
        )


def check_can_record(cfg: Config) -> None:
    """Fails now, naming the fix, if capture_video could not record: moviepy missing, or the env cannot render."""
    import_optional("moviepy", "capture_video", "moviepy")
    # frames for a file need no display; without one, pygame's SDL would print "error: XDG_RUNTIME_DIR is invalid"
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    env = gym.make(cfg.env_id, render_mode="rgb_array")
    try:
        env.reset(seed=cfg.seed)
        env.render()
    except (gym.error.DependencyNotInstalled, ImportError) as error:
        raise ConfigError(f"capture_video=true: {cfg.env_id} cannot render the frames to record: {error}") from None
    finally:
        env.close()


def find_wrapper(envs: gym.vector.VectorEnv, cls: type) -> Any | None:
    """The first wrapper of type `cls` in the chain, or None."""
    while not isinstance(envs, cls):
        envs = getattr(envs, "env", None)
        if envs is None:
            return None
    return envs


# ---------------------------------------------------------------------------- agent


def layer(in_features: int, out_features: int, std: float = math.sqrt(2)) -> nn.Linear:
    linear = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(linear.weight, std)
    nn.init.zeros_(linear.bias)
    return linear


class Agent(nn.Module):
    """Actor-critic MLP: Categorical for Discrete actions, diagonal Gaussian for Box."""

    def __init__(self, obs_space: gym.spaces.Box, action_space: gym.spaces.Space, cfg: Config) -> None:
        super().__init__()
        obs_dim, h = int(np.prod(obs_space.shape)), cfg.hidden_size
        self.continuous = isinstance(action_space, gym.spaces.Box)
        if self.continuous:
            out_dim = int(np.prod(action_space.shape))
            # state-independent log-std, as in the original PPO paper's MuJoCo runs
            self.log_std = nn.Parameter(torch.full((out_dim,), cfg.init_log_std))
        elif isinstance(action_space, gym.spaces.Discrete):
            out_dim = int(action_space.n)
        else:
            raise TypeError(f"Agent supports Discrete and Box action spaces, got {action_space}")
        # a small last-layer gain keeps the initial policy near uniform / zero-mean
        self.actor = nn.Sequential(layer(obs_dim, h), nn.Tanh(), layer(h, h), nn.Tanh(), layer(h, out_dim, 0.01))
        self.critic = nn.Sequential(layer(obs_dim, h), nn.Tanh(), layer(h, h), nn.Tanh(), layer(h, 1, 1.0))

    def dist(self, obs: torch.Tensor) -> Distribution:
        out = self.actor(obs)
        if self.continuous:
            return Independent(Normal(out, self.log_std.exp(), validate_args=False), 1)
        return Categorical(logits=out, validate_args=False)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The collector's policy: samples actions for obs [N, obs_dim]."""
        dist = self.dist(obs)
        action = dist.sample()  # [N] int64 or [N, act_dim]; the collector clips Box actions for the env
        return {"action": action, "log_prob": dist.log_prob(action), "value": self.critic(obs).squeeze(-1)}

    def evaluate(self, mb: TensorDict) -> tuple[torch.Tensor, ...]:
        """log_prob, entropy and value of the minibatch's actions under the current weights, for the loss."""
        dist = self.dist(mb["obs"])
        return dist.log_prob(mb["action"]), dist.entropy(), self.critic(mb["obs"]).squeeze(-1)

    def act_deterministic(self, obs: torch.Tensor, state: None = None) -> tuple[torch.Tensor, None]:
        dist = self.dist(obs)
        return (dist.mean if self.continuous else dist.logits.argmax(-1)), None


class RecurrentAgent(Agent):
    """Actor and critic on the output of one LSTM: a recurrent policy whose state the collector carries.

    The collector calls `forward(obs, state, is_init)` with the state of each env (zeros at
    an episode start) and stores per row the state that went into the step, from which
    `evaluate` replays sequences (truncated backpropagation through time).
    """

    def __init__(self, obs_space: gym.spaces.Box, action_space: gym.spaces.Space, cfg: Config) -> None:
        super().__init__(gym.spaces.Box(-1.0, 1.0, (cfg.lstm_size,)), action_space, cfg)  # heads read the LSTM
        self.lstm = nn.LSTMCell(int(np.prod(obs_space.shape)), cfg.lstm_size)
        for name, param in self.lstm.named_parameters():
            nn.init.orthogonal_(param, 1.0) if name.startswith("weight") else nn.init.zeros_(param)

    def initial_state(self, num_envs: int) -> TensorDict:
        """The collector's initial_state: zeros, for every env and at every episode start."""
        zeros = torch.zeros(num_envs, self.lstm.hidden_size, device=self.lstm.weight_hh.device)
        return TensorDict({"h": zeros, "c": zeros.clone()}, batch_size=[num_envs])

    def step(self, obs: torch.Tensor, state: TensorDict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h, c = self.lstm(obs, (state["h"], state["c"]))
        return h, {"h": h, "c": c}

    def forward(self, obs: torch.Tensor, state: TensorDict, is_init: torch.Tensor) -> dict[str, Any]:
        """The collector's policy: samples actions for obs [N, obs_dim] and returns the next state."""
        features, next_state = self.step(obs, state)
        out = super().forward(features)
        return {**out, "next_state": next_state}

    def get_value(self, obs: torch.Tensor, state: TensorDict, is_init: torch.Tensor) -> torch.Tensor:
        """The value alone, for the collector's bootstraps: no action sampled."""
        return self.critic(self.step(obs, state)[0]).squeeze(-1)

    def evaluate(self, mb: TensorDict) -> tuple[torch.Tensor, ...]:
        """Replays sequences mb [M, L] from the state stored at their first row, resetting where is_init."""
        h, c = mb["h"][:, 0], mb["c"][:, 0]
        features = []
        for t in range(mb.shape[1]):
            keep = (~mb["is_init"][:, t]).unsqueeze(-1).to(h.dtype)  # an episode starts: zero state
            h, c = self.lstm(mb["obs"][:, t], (h * keep, c * keep))
            features.append(h)
        features = torch.stack(features, 1)  # [M, L, lstm_size]
        dist = self.dist(features)
        return dist.log_prob(mb["action"]), dist.entropy(), self.critic(features).squeeze(-1)

    def act_deterministic(self, obs: torch.Tensor, state: TensorDict) -> tuple[torch.Tensor, TensorDict]:
        features, next_state = self.step(obs, state)
        return super().act_deterministic(features)[0], TensorDict(next_state, batch_size=state.batch_size)


def make_agent(obs_space: gym.spaces.Box, action_space: gym.spaces.Space, cfg: Config) -> Agent:
    return (RecurrentAgent if cfg.lstm_size > 0 else Agent)(obs_space, action_space, cfg)


# ---------------------------------------------------------------------------- data-parallel (torchrun)
# Under `torchrun --nproc_per_node K examples/ppo.py ...` each of the K processes (ranks) runs this script with a
# collector of its own. Its envs are seeded from its rank's own part of the seed stream (an int seed is keyed by the
# rank of the process group: docs/data-parallel.md), every rank starts from the same weights (the same torch seed),
# and each optimizer step averages the gradients of all ranks, so the weights stay equal. A batch is then K * T * N
# transitions. Rank 0 alone logs, plots and writes checkpoints; the mean return it logs is over every rank's episodes.


def init_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    """Joins torchrun's process group when torchrun started this process: returns rank, world size and device."""
    device = agent_device(cfg)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:  # not under torchrun
        return 0, 1, device
    if device.type == "cuda":  # one GPU per rank
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the ranks; `x` itself in a single process."""
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
    return x


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The mean of `x` over the ranks; `x` itself in a single process."""
    return sum_over_ranks(x) / dist.get_world_size() if dist.is_initialized() else x


def average_gradients(agent: nn.Module) -> None:
    """Replaces each gradient by its mean over the ranks, all of them in one all_reduce; nothing in a single process."""
    if not dist.is_initialized():
        return
    grads = [p.grad for p in agent.parameters()]
    mean = mean_over_ranks(torch.cat([g.reshape(-1) for g in grads]))
    for grad, part in zip(grads, mean.split([g.numel() for g in grads])):
        grad.copy_(part.view_as(grad))


# ---------------------------------------------------------------------------- training


class Logger:
    """One CSV row per iteration; with `tensorboard`, the same scalars and every episode's return as events."""

    def __init__(
        self, run_dir: Path, fields: list[str], *, resume_step: int | None = None, tensorboard: bool = False
    ) -> None:
        path = run_dir / "progress.csv"
        kept = []
        if resume_step is not None and path.exists():
            # rows logged after the checkpoint are logged again by the resumed run: keep the curve continuous
            with open(path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(float(row["step"])) <= resume_step]
        self.file = open(path, "w", newline="")
        self.csv = csv.DictWriter(self.file, fieldnames=fields)
        self.csv.writeheader()
        self.csv.writerows(kept)
        self.tb = None
        if tensorboard:
            tensorboard_module = import_optional("torch.utils.tensorboard", "track_tensorboard", "tensorboard")
            # purge_step hides the events a stopped run logged after its checkpoint, as the CSV drops those rows
            purge_step = None if resume_step is None else resume_step + 1
            self.tb = tensorboard_module.SummaryWriter(str(run_dir), purge_step=purge_step)

    def log(self, row: dict[str, float]) -> None:
        self.csv.writerow(row)
        self.file.flush()
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and not math.isnan(value):
                    self.tb.add_scalar(key, value, int(row["step"]))

    def log_episodes(self, steps: list[int], returns: list[float], lengths: list[int]) -> None:
        """Each episode's return and length at the env step it ended, as CleanRL's charts/episodic_return."""
        if self.tb is not None:
            for step, episode_return, length in zip(steps, returns, lengths):
                self.tb.add_scalar("charts/episodic_return", episode_return, step)
                self.tb.add_scalar("charts/episodic_length", length, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


LOG_FIELDS = [
    "step",
    "wall_time",
    "charts/mean_return",
    "charts/episodes",
    "charts/SPS",
    "charts/learning_rate",
    "charts/policy_lag",
    "losses/policy_loss",
    "losses/value_loss",
    "losses/entropy",
    "losses/approx_kl",
    "losses/clip_frac",
    "losses/explained_variance",
    "time/wait_s",
    "time/update_s",
]


def train(cfg: Config, resume: dict[str, Any] | None = None) -> float:
    """Trains PPO as configured, or carries on from a checkpoint `resume`; writes CSV, plot and checkpoints.

    Under torchrun this is one rank of a data-parallel run (see the data-parallel section above).

    Returns the final mean return.
    """
    start = time.perf_counter()
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)  # the same on every rank: the same initial weights
    rank, world_size, device = init_distributed(cfg)
    is_main = rank == 0  # logs, plots and writes checkpoints
    if resume is not None and resume.get("world_size", 1) != world_size:
        raise ConfigError(
            f"--resume: the checkpoint's run had {resume.get('world_size', 1)} ranks, this one has {world_size}; "
            f"resume it with as many (torchrun --nproc_per_node {resume.get('world_size', 1)}, or plain python for 1)"
        )
    # optional integrations fail now if a package they need is missing, not once the envs and the agent are built
    if cfg.track_tensorboard:
        import_optional("torch.utils.tensorboard", "track_tensorboard", "tensorboard")
    if cfg.capture_video:
        check_can_record(cfg)
    run_dir = Path(cfg.run_dir or f"runs/{cfg.exp_name}_{cfg.env_id}_seed{cfg.seed}")
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    checkpoint_path = run_dir / "checkpoint.pt"

    if cfg.backend != "thread" and cfg.normalize_obs:
        # the checkpoint saves the observation statistics for --eval, read from the wrapper, which must then
        # live in this process (worker processes would each keep statistics of their own)
        raise ConfigError(f"normalize_obs needs backend=thread, got backend={cfg.backend}")
    if world_size > 1 and cfg.normalize_obs:
        raise ConfigError(f"normalize_obs keeps statistics per process, which the {world_size} ranks would not share")
    if cfg.backend == "thread":
        envs = make_envs(cfg, cfg.num_envs)
        spaces = envs
    else:  # each worker builds its share of the envs from this picklable recipe
        envs = functools.partial(make_envs, cfg)
        spaces = make_envs(cfg, 1)
        spaces.close()
    agent = make_agent(spaces.single_observation_space, spaces.single_action_space, cfg).to(device)
    recurrent = isinstance(agent, RecurrentAgent)
    if recurrent and cfg.num_steps % cfg.bptt_steps:
        raise ConfigError(f"bptt_steps={cfg.bptt_steps} must divide num_steps={cfg.num_steps}")
    # fused: one kernel for all parameters instead of a loop over them (an update 8% faster on the CPU here)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, fused=True)
    # the collector thread samples actions from torch's global generator; shuffling
    # minibatches from a generator of our own keeps that stream in a fixed order
    shuffle_gen = torch.Generator(device).manual_seed(cfg.seed)
    if world_size > 1:
        torch.manual_seed(cfg.seed + rank)  # each rank samples its own actions (the thread samples from this stream)

    batch_steps = cfg.num_envs * cfg.num_steps * world_size  # transitions per iteration, all ranks together
    num_iterations = math.ceil(cfg.total_timesteps / batch_steps)
    recent = deque(maxlen=cfg.return_window)
    mean_return, episodes, done_iterations, wall_offset = math.nan, 0, 0, 0.0
    if resume is not None:
        own = resume["ranks"][rank] if world_size > 1 else resume  # this rank's streams (see save_checkpoint)
        agent.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        shuffle_gen.set_state(resume["shuffle_rng"])
        torch.set_rng_state(own["torch_rng"])
        done_iterations, episodes, wall_offset = resume["iteration"], resume["episodes"], resume["wall_time"]
        recent.extend(own["recent_returns"])
        if resume["obs_rms"] is not None and cfg.backend == "thread":
            set_obs_rms(find_wrapper(envs, gym.wrappers.vector.NormalizeObservation), resume["obs_rms"])
    logger = None
    if is_main:
        logger = Logger(
            run_dir,
            LOG_FIELDS,
            resume_step=None if resume is None else done_iterations * batch_steps,
            tensorboard=cfg.track_tensorboard,
        )
    progress = tqdm(
        total=num_iterations * batch_steps,
        initial=done_iterations * batch_steps,
        unit="step",
        mininterval=1 if sys.stderr.isatty() else 30,
        disable=not is_main,
    )
    collector = Collector(
        envs,
        agent,
        num_steps=cfg.num_steps,
        num_envs=cfg.num_envs,
        gae=GAE(cfg.gamma, cfg.gae_lambda),
        device=device,
        total_timesteps=num_iterations * cfg.num_envs * cfg.num_steps,  # as many batches on every rank
        prefetch=cfg.prefetch,
        seed=cfg.seed,  # under torchrun keyed by the rank: the ranks' envs start different episodes
        backend=placement(cfg),
        initial_state=agent.initial_state if recurrent else None,
        # the env's own returns, beneath NormalizeReward (see make_envs); else episode_return is that
        keys=BatchKeys(info_keys=("episode",) if cfg.normalize_reward else None),
    )
    if resume is not None:
        # the step count, the policy versions and the envs' seeds carry on (in-flight episodes restart)
        collector.load_state_dict(own["collector"])

    def save_checkpoint(iteration: int) -> None:
        # what differs per rank: its collector's seed stream, its action sampling and its episodes
        own = {"collector": collector.state_dict(), "torch_rng": torch.get_rng_state(), "recent_returns": list(recent)}
        ranks = [None] * world_size if is_main else None
        if dist.is_initialized():
            dist.gather_object(own, ranks, dst=0)
        if not is_main:
            return
        obs_norm = find_wrapper(envs, gym.wrappers.vector.NormalizeObservation) if cfg.backend == "thread" else None
        state = {
            "config": dataclasses.asdict(cfg),
            "model": agent.state_dict(),
            # --eval must normalise observations exactly as the agent saw them in training
            "obs_rms": None if obs_norm is None else get_obs_rms(obs_norm),
            # what --resume needs besides: where the run stands, the optimizer, the random streams
            "iteration": iteration,
            "optimizer": optimizer.state_dict(),
            "shuffle_rng": shuffle_gen.get_state(),
            **own,  # rank 0's
            "episodes": episodes,
            "wall_time": wall_offset + time.perf_counter() - start,
            "world_size": world_size,
            **({"ranks": ranks} if world_size > 1 else {}),  # every rank's own, for --resume under torchrun
        }
        # a Ctrl-C or a crash in the middle of writing must not destroy the last good checkpoint
        torch.save(state, checkpoint_path.with_suffix(".tmp"))
        os.replace(checkpoint_path.with_suffix(".tmp"), checkpoint_path)

    iteration = done_iterations
    try:
        with collector:
            waited_from = time.perf_counter()
            for iteration, batch in enumerate(collector, start=done_iterations + 1):  # batch: TensorDict [T, N]
                # time/wait_s: how long this batch kept the trainer waiting (in lockstep: the whole collection)
                wait_s = time.perf_counter() - waited_from
                global_step = iteration * batch_steps
                if cfg.normalize_reward:
                    finished = batch["info", "_episode"]  # [T, N]: RecordEpisodeStatistics' episode ends
                    returns, lengths = batch["info", "episode", "r"][finished], batch["info", "episode", "l"][finished]
                else:
                    finished = batch["done"] & batch["mask"]
                    returns, lengths = batch["episode_return"][finished], batch["episode_length"][finished]
                recent.extend(returns.tolist())
                ended = int(finished.sum())
                if is_main:
                    # [E]: the env step at which each episode ended; row t holds steps t*N*K+1 .. (t+1)*N*K (K ranks)
                    ends = global_step - batch_steps + (finished.nonzero()[:, 0] + 1) * cfg.num_envs * world_size
                    logger.log_episodes(ends.tolist(), returns.tolist(), lengths.tolist())
                if world_size > 1:  # all ranks' episodes: how many ended, and the mean of each one's last return_window
                    totals = torch.tensor([ended, sum(recent), len(recent)], dtype=torch.float64, device=device)
                    ended, total, count = sum_over_ranks(totals).tolist()
                    mean_return = total / count if count else mean_return
                elif recent:
                    mean_return = float(np.mean(recent))
                episodes += int(ended)

                lr = cfg.learning_rate * (1 - (iteration - 1) / num_iterations) if cfg.anneal_lr else cfg.learning_rate
                for group in optimizer.param_groups:
                    group["lr"] = lr

                # mask is False on NEXT_STEP reset rows: they are not transitions, the loss leaves them out
                data = batch.select("obs", "action", "log_prob", "value", "advantage", "return", "mask")
                if recurrent:  # sequences [S, L] of consecutive rows of one env, with the state that went into each
                    data = to_sequences(batch.select(*data.keys(), "is_init", "h", "c"), cfg.bptt_steps)
                else:
                    data = data[batch["mask"]]  # [B]
                update_start = time.perf_counter()
                stats = update(agent, optimizer, data, cfg, shuffle_gen)
                update_s = time.perf_counter() - update_start

                real = batch["mask"]
                ret, val = batch["return"][real], batch["value"][real]
                explained_var = float(1 - (ret - val).var() / ret.var()) if ret.var() > 0 else math.nan
                sps = (global_step - done_iterations * batch_steps) / (time.perf_counter() - start)
                if is_main:  # its own batch's statistics and losses; mean return and episodes of all ranks
                    logger.log(
                        {
                            "step": global_step,
                            "wall_time": wall_offset + time.perf_counter() - start,
                            "charts/mean_return": mean_return,
                            "charts/episodes": episodes,
                            "charts/SPS": sps,
                            "charts/learning_rate": lr,
                            # rows collected by weights older than the ones just trained (1 with prefetch=1)
                            "charts/policy_lag": collector.policy_version - int(batch["policy_version"].min()),
                            "losses/explained_variance": explained_var,
                            "time/wait_s": wait_s,
                            "time/update_s": update_s,
                            **stats,
                        }
                    )
                progress.update(batch_steps)
                progress.set_postfix(mean_return=f"{mean_return:.1f}", refresh=False)
                waited_from = time.perf_counter()
                if cfg.checkpoint_every and iteration % cfg.checkpoint_every == 0:
                    save_checkpoint(iteration)
    except KeyboardInterrupt:
        progress.close()
        if is_main:
            logger.close()
            # Absolute paths: the command works from any folder, not only the one the run started in.
            launcher = f"torchrun --nproc_per_node {world_size}" if world_size > 1 else shlex.quote(sys.executable)
            script, checkpoint = (shlex.quote(str(path.resolve())) for path in (Path(__file__), checkpoint_path))
            print(
                f"\ninterrupted in iteration {iteration + 1}; carry on from the last checkpoint with:\n"
                f"  {launcher} {script} --resume {checkpoint}",
                file=sys.stderr,
            )
        raise SystemExit(130) from None
    progress.close()
    save_checkpoint(iteration)
    if dist.is_initialized():
        dist.destroy_process_group()  # the last collective was the checkpoint's
    if cfg.backend == "thread":
        envs.close()
    if not is_main:
        return mean_return
    logger.close()
    plot_learning_curve(
        run_dir / "progress.csv",
        run_dir / "learning_curve.png",
        title=f"PPO on {cfg.env_id}, seed {cfg.seed}",
        window=cfg.return_window,
    )
    if cfg.capture_video:  # what the final weights do, to watch
        evaluate(checkpoint_path, ["eval_episodes=1"])
    print(f"run folder: {run_dir} ({time.perf_counter() - start:.1f} s)")
    of_ranks = f" of each of {world_size} ranks" if world_size > 1 else ""
    print(f"final mean return (last {len(recent)} episodes{of_ranks}): {mean_return:.1f}")
    return mean_return


def to_sequences(batch: TensorDict, length: int) -> TensorDict:
    """[T, N] -> [T // length * N, length]: each env's rows cut into sequences of `length` steps."""
    T, N = batch.shape
    return batch.apply(
        lambda x: x.reshape(T // length, length, N, *x.shape[2:]).transpose(1, 2).reshape(-1, length, *x.shape[2:]),
        batch_size=[T // length * N, length],
    )


def update(
    agent: Agent, optimizer: torch.optim.Optimizer, data: TensorDict, cfg: Config, shuffle_gen: torch.Generator
) -> dict[str, float]:
    """PPO's clipped-objective epochs over one batch `data`: transitions [B] or sequences [S, L], with `mask`."""
    size = data.shape[0]
    minibatch_size = math.ceil(size / cfg.num_minibatches)
    if dist.is_initialized() and size < cfg.num_minibatches * (cfg.num_minibatches - 1):
        # from M * (M - 1) transitions on there are exactly M minibatches: every rank takes as many optimizer
        # steps, whatever its mask left of its batch (fewer steps on one rank would leave the others waiting)
        raise RuntimeError(
            f"a rank's batch has {size} transitions, too few for num_minibatches={cfg.num_minibatches} under "
            "torchrun: collect more per rank (num_envs * num_steps) or use fewer minibatches"
        )
    clip_frac, updates = torch.zeros((), device=data.device), 0
    for _ in range(cfg.update_epochs):
        order = torch.randperm(size, device=data.device, generator=shuffle_gen)
        for begin in range(0, size, minibatch_size):
            mb = data[order[begin : begin + minibatch_size]]
            log_prob, entropy, value = agent.evaluate(mb)
            if data.ndim == 2:  # sequences keep the rows that are no transition: the LSTM steps through them
                real = mb["mask"]
                mb, log_prob, entropy, value = mb[real], log_prob[real], entropy[real], value[real]
            # the stored log_prob is from the weights that acted, which lag the current
            # ones by a batch with prefetch=1: the ratio corrects for exactly that
            log_ratio = log_prob - mb["log_prob"]
            ratio = log_ratio.exp()
            with torch.no_grad():
                approx_kl = ((ratio - 1) - log_ratio).mean()  # k3 estimator: unbiased, >= 0
                clip_frac += ((ratio - 1).abs() > cfg.clip_coef).float().mean()
                updates += 1

            adv = mb["advantage"]
            if cfg.norm_adv and adv.numel() > 1:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()

            if cfg.clip_vloss:
                clipped = mb["value"] + (value - mb["value"]).clamp(-cfg.clip_coef, cfg.clip_coef)
                value_loss = 0.5 * torch.max((value - mb["return"]) ** 2, (clipped - mb["return"]) ** 2).mean()
            else:
                value_loss = 0.5 * ((value - mb["return"]) ** 2).mean()
            entropy_loss = entropy.mean()
            loss = policy_loss - cfg.ent_coef * entropy_loss + cfg.vf_coef * value_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(agent)  # under torchrun: every rank steps with the mean gradient
            nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()
        if cfg.target_kl is not None and mean_over_ranks(approx_kl) > cfg.target_kl:  # all ranks stop together
            break
    return {
        "losses/policy_loss": policy_loss.item(),
        "losses/value_loss": value_loss.item(),
        "losses/entropy": entropy_loss.item(),
        "losses/approx_kl": approx_kl.item(),
        "losses/clip_frac": clip_frac.item() / updates,
    }


# ---------------------------------------------------------------------------- plot and eval


def plot_learning_curve(csv_path: Path, png_path: Path, *, title: str, window: int) -> None:
    """Mean return of the last `window` episodes against env steps."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(float(r["step"])) for r in rows]
    returns = [float(r["charts/mean_return"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, returns)
    ax.set(xlabel="env steps", ylabel=f"mean return of the last {window} episodes", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def get_obs_rms(obs_norm: Any) -> dict[str, Any]:
    """The running statistics of a NormalizeObservation wrapper, as tensors (weights_only checkpoints)."""
    rms = obs_norm.obs_rms
    return {"mean": torch.as_tensor(rms.mean), "var": torch.as_tensor(rms.var), "count": float(rms.count)}


def set_obs_rms(obs_norm: Any, saved: dict[str, Any]) -> None:
    obs_norm.obs_rms.mean = saved["mean"].numpy()
    obs_norm.obs_rms.var = saved["var"].numpy()
    obs_norm.obs_rms.count = saved["count"]


def evaluate(checkpoint: str | Path, overrides: Sequence[str] = ()) -> tuple[float, float]:
    """Runs `eval_episodes` deterministic episodes of a checkpoint; returns mean and std.

    With capture_video, the first episode is recorded to videos/eval-step<step>-episode-0.mp4 beside the
    checkpoint, where <step> is the checkpoint's env step; evaluating it again replaces that file.
    """
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    cfg = load_config(None, overrides, base=state["config"])
    torch.set_num_threads(cfg.torch_threads)
    video = None
    if cfg.capture_video:
        check_can_record(cfg)
        trained = state["config"]  # the batch size of training, whatever this evaluation overrides
        step = state["iteration"] * trained["num_envs"] * trained["num_steps"] * state.get("world_size", 1)
        video = Path(checkpoint).parent / "videos" / f"eval-step{step}"
    # the agent evaluates on the CPU, and so does a vector env of torch tensors
    envs = make_envs(dataclasses.replace(cfg, device="cpu"), cfg.eval_episodes, training=False, video=video)
    if state["obs_rms"] is not None:
        obs_norm = find_wrapper(envs, gym.wrappers.vector.NormalizeObservation)
        set_obs_rms(obs_norm, state["obs_rms"])
        obs_norm.update_running_mean = False
    agent = make_agent(envs.single_observation_space, envs.single_action_space, cfg)
    agent.load_state_dict(state["model"])
    memory = agent.initial_state(cfg.eval_episodes) if isinstance(agent, RecurrentAgent) else None

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
            if agent.continuous:
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


# ---------------------------------------------------------------------------- command line


def yaml_scalar(value: Any) -> str:
    """A config value as it is typed in a KEY=VALUE override or a YAML file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def config_help() -> str:
    """Every Config key, its default and the comment beside it, grouped by Config's headings, for `--help`."""
    defaults = {field.name: field.default for field in dataclasses.fields(Config)}
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    width = max(shutil.get_terminal_size().columns - 2, 60)  # as argparse wraps its own help
    lines = textwrap.wrap(
        "config keys, given as KEY=VALUE after the options, with the defaults of the Config dataclass. Without "
        f"--config, configs/{DEFAULT_CONFIG.name} applies first: its values follow the descriptions in [brackets].",
        width,
    )
    # the source is the one place the descriptions are written: the comments beside the fields
    for line in inspect.getsource(Config).splitlines():
        if heading := re.fullmatch(r"    # (.+)", line):
            lines += ["", f"{heading[1]}:"]
        elif field := re.fullmatch(r"    (\w+): [^#]+?  # (.+)", line):
            name, text = field[1], field[2]
            if name in shipped and shipped[name] != defaults[name]:
                text += f" [{DEFAULT_CONFIG.name}: {yaml_scalar(shipped[name])}]"
            key = f"  {name}={yaml_scalar(defaults[name])} ".ljust(30)
            lines += textwrap.wrap(
                text,
                width,
                initial_indent=key,
                subsequent_indent=" " * 30,
                break_long_words=False,
                break_on_hyphens=False,
            )
    usage = textwrap.dedent(__doc__.partition("Usage::")[2]).strip("\n")
    return "\n".join(lines) + "\n\nexamples:\n" + textwrap.indent(usage, "  ")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=config_help(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=None, help=f"YAML config (default: {DEFAULT_CONFIG.name})")
    parser.add_argument("--eval", metavar="CHECKPOINT", default=None, help="evaluate a checkpoint instead")
    parser.add_argument(
        "--resume",
        metavar="CHECKPOINT",
        default=None,
        help="carry on the run of a checkpoint (its config, then the overrides, e.g. a larger total_timesteps)",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. seed=2")
    args = parser.parse_args(argv)
    try:
        if args.eval is not None:
            evaluate(args.eval, args.overrides)
        elif args.resume is not None:
            state = torch.load(args.resume, map_location="cpu", weights_only=True)
            if "collector" not in state:
                raise ConfigError(f"--resume {args.resume}: not a checkpoint of this version of the example")
            # by default the run carries on in the checkpoint's folder
            base = {**state["config"], "run_dir": str(Path(args.resume).resolve().parent)}
            cfg = load_config(None, args.overrides, base=base)
            done = state["iteration"] * cfg.num_envs * cfg.num_steps * state.get("world_size", 1)
            if done >= cfg.total_timesteps:
                raise ConfigError(
                    f"--resume {args.resume}: the run is complete ({done} steps of total_timesteps="
                    f"{cfg.total_timesteps}); pass a larger total_timesteps=... to carry on"
                )
            train(cfg, resume=state)
        else:
            train(load_config(args.config or DEFAULT_CONFIG, args.overrides))
    except ConfigError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
