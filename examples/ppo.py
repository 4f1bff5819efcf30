"""PPO on top of torch_rollout, read top to bottom: config, env factory, agent, then the collector and the update.

The collector steps the envs and runs the policy in worker processes (or a background thread), so the next
batch is being collected while this script updates the agent on the current one. Everything PPO needs is here,
in the order a reader meets it (env wrappers, videos, torchrun, checkpoints and `--resume`, `--eval`); what it
shares with examples/sac.py (config files and `--help`, the run folder and its log) is in common.py beside it.

Usage::

    python examples/ppo.py --help                            # every config key, its default and meaning
    python examples/ppo.py                                   # CartPole-v1, configs/ppo_cartpole.yaml
    python examples/ppo.py seed=2 total_timesteps=100000     # key=value overrides
    python examples/ppo.py --config configs/ppo_halfcheetah.yaml
    python examples/ppo.py --config configs/ppo_cartpole_novel_lstm.yaml   # an LSTM on CartPole without velocities
    python examples/ppo.py --config configs/ppo_isaac_cartpole.yaml   # Isaac Lab's cartpole (in Isaac Lab's venv)
    python examples/ppo.py track_tensorboard=true            # then: tensorboard --logdir runs
    python examples/ppo.py --eval runs/ppo_CartPole-v1_seed1/checkpoint.pt
    python examples/ppo.py --eval runs/ppo_CartPole-v1_seed1/checkpoint.pt capture_video=true   # into .../videos
    python examples/ppo.py --resume runs/ppo_CartPole-v1_seed1/checkpoint.pt   # carry on a stopped run
    torchrun --nproc_per_node 2 examples/ppo.py backend=thread   # data-parallel: 2 ranks, gradients averaged
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import importlib
import itertools
import math
import os
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from tensordict import TensorDict
from torch.distributions import Categorical, Distribution, Independent, Normal
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when imported from elsewhere
import common  # noqa: E402
from common import ConfigError  # noqa: E402

from torch_rollout import GAE, BatchKeys, Collector, Processes, Ray  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "ppo_cartpole.yaml"


@dataclasses.dataclass
class Config:
    """PPO hyperparameters: CleanRL's ppo.py, tuned per env by the YAML files; a field's comment is its --help."""

    # the run
    exp_name: str = "ppo"  # first part of the run folder's name
    run_dir: str | None = None  # output folder; None: runs/<exp_name>_<env_id>_seed<seed>
    seed: int = 1  # seeds the agent's init, the env resets, action sampling and minibatch order
    device: str | None = None  # where the agent and the batches live; None: cuda if available
    torch_threads: int = 1  # intra-op threads for torch; set_num_threads is process-wide

    # environments
    env_id: str = "CartPole-v1"  # any gymnasium id with a flat Box observation space
    env_recipe: str | None = None  # "module:function" building the envs as function(num_envs, seed=seed) instead
    obs_group: str | None = None  # the group of a Dict observation that actor and critic read, e.g. "policy"
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
    desired_kl: float | None = None  # adapt the learning rate per minibatch to keep approx-KL near this (rsl_rl's)

    # the agent
    hidden_size: int = 64  # width of the two hidden layers of actor and critic
    activation: str = "tanh"  # of the hidden layers: "tanh" (CleanRL's) or "elu" (rsl_rl's)
    lstm_size: int = 0  # > 0: an LSTM of this width beneath actor and critic (a recurrent policy); 0: MLP only
    bptt_steps: int = 8  # with an LSTM: minibatches of sequences of this many steps, replayed from the stored state
    init_log_std: float = 0.0  # initial log-std of the Gaussian policy (Box actions only)

    # logging, checkpoints and evaluation
    return_window: int = 20  # episodes in the reported mean return
    stop_return: float | None = None  # end the run at the first batch whose mean return reaches this; None: never
    checkpoint_every: int = 10  # iterations between checkpoints that --resume carries on from; 0: only at the end
    eval_episodes: int = 10  # deterministic episodes run by --eval
    track_tensorboard: bool = False  # also write the logged scalars as TensorBoard events into the run folder
    capture_video: bool = False  # record the first --eval episode, and one after training, into <run folder>/videos


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, base: dict | None = None) -> Config:
    """A Config from `base` (a checkpoint's), the YAML file at `path`, then `key=value` overrides (common.py)."""
    cfg = common.load_config(Config, path, overrides, base=base)
    if cfg.desired_kl is not None and cfg.anneal_lr:
        raise ConfigError(
            "desired_kl adapts the learning rate, which anneal_lr=true would set too: add anneal_lr=false"
        )
    return cfg


# ---------------------------------------------------------------------------- environments


def make_envs(cfg: Config, num_envs: int, *, training: bool = True, video: Path | None = None) -> gym.vector.VectorEnv:
    """The env_recipe's envs, a vector env of torch tensors on the agent's device (env_id torch_rollout/...), or
    gymnasium's NumPy envs with the config's wrappers (gym_envs); `training=False` (--eval): raw rewards."""
    if cfg.env_recipe is not None:  # e.g. sims/isaaclab_setup.py's Isaac Lab envs
        check_numpy_only(cfg, video)
        return recipe(cfg.env_recipe, "env_recipe")(num_envs, seed=cfg.seed)
    if cfg.env_id.startswith("torch_rollout/"):
        check_numpy_only(cfg, video)
        return gym.make_vec(cfg.env_id, num_envs=num_envs, device=agent_device(cfg.device))
    return gym_envs(cfg, num_envs, training=training, video=video)


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
    common.import_optional("moviepy", "capture_video", "moviepy")
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


# ---------------------------------------------------------------------------- agent


ACTIVATIONS = {"tanh": nn.Tanh, "elu": nn.ELU}


def activation(name: str) -> type[nn.Module]:
    """The hidden layers' activation of a config's name."""
    if name not in ACTIVATIONS:
        raise ConfigError(f"activation={name!r}: choose one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def layer(in_features: int, out_features: int, std: float = math.sqrt(2)) -> nn.Linear:
    """A linear layer with CleanRL's init: orthogonal weights of gain `std`, zero bias."""
    linear = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(linear.weight, std)
    nn.init.zeros_(linear.bias)
    return linear


class Agent(nn.Module):
    """Actor-critic MLP: Categorical for Discrete actions, diagonal Gaussian for Box; with obs_group, it reads that
    group of a Dict observation."""

    def __init__(self, obs_space: gym.spaces.Space, action_space: gym.spaces.Space, cfg: Config) -> None:
        super().__init__()
        self.group = cfg.obs_group
        obs_space = obs_space if self.group is None else obs_space[self.group]
        obs_dim, h, act = int(np.prod(obs_space.shape)), cfg.hidden_size, activation(cfg.activation)
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
        self.actor = nn.Sequential(layer(obs_dim, h), act(), layer(h, h), act(), layer(h, out_dim, 0.01))
        self.critic = nn.Sequential(layer(obs_dim, h), act(), layer(h, h), act(), layer(h, 1, 1.0))

    def inputs(self, obs: Any) -> torch.Tensor:
        """What the heads read: the observation [N, obs_dim], or its obs_group of a Dict observation."""
        return obs if self.group is None else obs[self.group]

    def dist(self, obs: torch.Tensor) -> Distribution:
        """The action distribution for the heads' input `obs` [B, obs_dim]."""
        out = self.actor(obs)
        if self.continuous:
            return Independent(Normal(out, self.log_std.exp(), validate_args=False), 1)
        return Categorical(logits=out, validate_args=False)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The collector's policy: samples actions for obs [N, obs_dim]."""
        obs = self.inputs(obs)
        dist = self.dist(obs)
        action = dist.sample()  # [N] int64 or [N, act_dim]; the collector clips Box actions for the env
        return {"action": action, "log_prob": dist.log_prob(action), "value": self.critic(obs).squeeze(-1)}

    def evaluate(self, mb: TensorDict) -> tuple[torch.Tensor, ...]:
        """log_prob, entropy and value of the minibatch's actions under the current weights, for the loss."""
        obs = self.inputs(mb["obs"])
        dist = self.dist(obs)
        return dist.log_prob(mb["action"]), dist.entropy(), self.critic(obs).squeeze(-1)

    def act_deterministic(self, obs: torch.Tensor, state: None = None) -> tuple[torch.Tensor, None]:
        """--eval's action: the mean (Box) or the most likely one (Discrete); an MLP carries no state."""
        dist = self.dist(self.inputs(obs))
        return (dist.mean if self.continuous else dist.logits.argmax(-1)), None


class RecurrentAgent(Agent):
    """Actor and critic on one LSTM: the collector carries its state per env (zeros at an episode start) and
    stores per row the state that went into the step, from which `evaluate` replays sequences (truncated BPTT)."""

    def __init__(self, obs_space: gym.spaces.Box, action_space: gym.spaces.Space, cfg: Config) -> None:
        if cfg.obs_group is not None:
            raise ConfigError(f"obs_group={cfg.obs_group!r} needs lstm_size=0: the LSTM reads a flat observation")
        super().__init__(gym.spaces.Box(-1.0, 1.0, (cfg.lstm_size,)), action_space, cfg)  # heads read the LSTM
        self.lstm = nn.LSTMCell(int(np.prod(obs_space.shape)), cfg.lstm_size)
        for name, param in self.lstm.named_parameters():
            nn.init.orthogonal_(param, 1.0) if name.startswith("weight") else nn.init.zeros_(param)

    def initial_state(self, num_envs: int) -> TensorDict:
        """The collector's initial_state: zeros, for every env and at every episode start."""
        zeros = torch.zeros(num_envs, self.lstm.hidden_size, device=self.lstm.weight_hh.device)
        return TensorDict({"h": zeros, "c": zeros.clone()}, batch_size=[num_envs])

    def step(self, obs: torch.Tensor, state: TensorDict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One LSTM step: the heads' input [N, lstm_size] and the next state."""
        h, c = self.lstm(obs, (state["h"], state["c"]))
        return h, {"h": h, "c": c}

    def forward(self, obs: torch.Tensor, state: TensorDict, is_init: torch.Tensor) -> dict[str, Any]:
        """The collector's policy: samples actions for obs [N, obs_dim] and returns the next state."""
        features, next_state = self.step(obs, state)
        return {**super().forward(features), "next_state": next_state}

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
        """--eval's action, carrying the LSTM's state from step to step."""
        features, next_state = self.step(obs, state)
        return super().act_deterministic(features)[0], TensorDict(next_state, batch_size=state.batch_size)


def make_agent(obs_space: gym.spaces.Box, action_space: gym.spaces.Space, cfg: Config) -> Agent:
    """The config's agent: recurrent with lstm_size > 0, else the MLP."""
    return (RecurrentAgent if cfg.lstm_size > 0 else Agent)(obs_space, action_space, cfg)


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


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The mean of `x` over the ranks; `x` itself in a single process."""
    return common.sum_over_ranks(x) / dist.get_world_size() if dist.is_initialized() else x


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


# ---------------------------------------------------------------------------- checkpoints and --resume


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


def load_resume(checkpoint: str, overrides: Sequence[str]) -> tuple[Config, dict[str, Any]]:
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


def print_resume_command(checkpoint: Path, iteration: int, world_size: int) -> None:
    """After a Ctrl-C: the command that carries the run on, with absolute paths, so that it works from any folder."""
    launcher = f"torchrun --nproc_per_node {world_size}" if world_size > 1 else shlex.quote(sys.executable)
    script, path = (shlex.quote(str(Path(p).resolve())) for p in (__file__, checkpoint))
    print(
        f"\ninterrupted in iteration {iteration}; carry on from the last checkpoint with:\n"
        f"  {launcher} {script} --resume {path}",
        file=sys.stderr,
    )


# ---------------------------------------------------------------------------- training
LOG_FIELDS = ["step", "wall_time", "charts/mean_return", "charts/episodes", "charts/SPS", "charts/learning_rate"]
LOG_FIELDS += ["charts/policy_lag", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"]
LOG_FIELDS += ["losses/clip_frac", "losses/explained_variance", "time/wait_s", "time/update_s", *common.STATS_FIELDS]


def check_can_run(cfg: Config, world_size: int) -> None:
    """Fails before anything is written if a package that an integration needs is missing, or if normalize_obs
    could not save its statistics.

    Raises:
        ConfigError: naming the key and the fix.
    """
    # optional integrations fail now if a package they need is missing, not once the envs and agent are built
    if cfg.track_tensorboard:
        common.import_optional("torch.utils.tensorboard", "track_tensorboard", "tensorboard")
    if cfg.capture_video:
        check_can_record(cfg.env_id, cfg.seed)
    # the checkpoint saves the observation statistics for --eval, read from the wrapper, which must then
    # live in this process (worker processes, or other ranks, would each keep statistics of their own)
    if cfg.backend != "thread" and cfg.normalize_obs:
        raise ConfigError(f"normalize_obs needs backend=thread, got backend={cfg.backend}")
    if world_size > 1 and cfg.normalize_obs:
        raise ConfigError(f"normalize_obs keeps statistics per process, which the {world_size} ranks would not share")


def ended_episodes(batch: TensorDict, cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The episodes that ended in a batch [T, N]: where ([T, N] bool), their returns [E] and lengths [E]."""
    if cfg.normalize_reward:  # the env's own returns, beneath NormalizeReward (see gym_envs)
        finished = batch["info", "_episode"]
        return finished, batch["info", "episode", "r"][finished], batch["info", "episode", "l"][finished]
    finished = batch["done"] & batch["mask"]
    return finished, batch["episode_return"][finished], batch["episode_length"][finished]


def log_episode_points(
    logger: common.Logger | None,
    finished: torch.Tensor,
    returns: torch.Tensor,
    lengths: torch.Tensor,
    step: int,
    row: int,
) -> None:
    """TensorBoard's charts/episodic_return and _length, as CleanRL's: one point at the env step each ended.

    `finished` [T, N] marks the episode ends of a batch whose first row follows env step `step`; each row
    holds `row` env steps (N envs times the ranks).
    """
    if logger is None or logger.tb is None:  # rank 0 alone logs
        return
    ends = step + (finished.nonzero()[:, 0] + 1) * row  # [E]
    for end, episode_return, length in zip(ends.tolist(), returns.tolist(), lengths.tolist()):
        logger.tb.add_scalar("charts/episodic_return", episode_return, end)
        logger.tb.add_scalar("charts/episodic_length", length, end)


def build(
    cfg: Config, device: torch.device, rank: int, world_size: int, total_timesteps: int, resume: dict | None, own: dict
) -> tuple[Any, Agent, torch.optim.Optimizer, torch.Generator, Collector]:
    """The envs (or, for worker processes, their recipe), the agent, its optimizer, the minibatch shuffler and the
    collector of `total_timesteps`; with `resume`, their state as the checkpoint saved it (`own`: this rank's)."""
    if cfg.backend == "thread":
        envs = spaces = make_envs(cfg, cfg.num_envs)
    else:  # each worker builds its share of the envs from this picklable recipe
        envs, spaces = functools.partial(make_envs, cfg), make_envs(cfg, 1)
        spaces.close()
    agent = make_agent(spaces.single_observation_space, spaces.single_action_space, cfg).to(device)
    if isinstance(agent, RecurrentAgent) and cfg.num_steps % cfg.bptt_steps:
        raise ConfigError(f"bptt_steps={cfg.bptt_steps} must divide num_steps={cfg.num_steps}")
    # fused: one kernel for all parameters instead of a loop over them (an update 8% faster on the CPU here)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, fused=True)
    # the collector thread samples actions from torch's global generator; shuffling
    # minibatches from a generator of our own keeps that stream in a fixed order
    shuffle_gen = torch.Generator(device).manual_seed(cfg.seed)
    if world_size > 1:
        torch.manual_seed(cfg.seed + rank)  # each rank samples its own actions (the thread samples from this)
    if resume is not None:
        agent.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        shuffle_gen.set_state(resume["shuffle_rng"])
        torch.set_rng_state(own["torch_rng"])
        restore_obs_rms(envs, resume["obs_rms"])
    collector = Collector(
        envs,
        agent,
        num_steps=cfg.num_steps,
        num_envs=cfg.num_envs,
        gae=GAE(cfg.gamma, cfg.gae_lambda),
        device=device,
        total_timesteps=total_timesteps,
        prefetch=cfg.prefetch,
        seed=cfg.seed,  # under torchrun keyed by the rank: the ranks' envs start different episodes
        backend=placement(cfg.backend, cfg.num_workers),
        initial_state=getattr(agent, "initial_state", None),  # an LSTM's state, carried per env
        # the env's own returns, beneath NormalizeReward (see make_envs); else episode_return is that
        keys=BatchKeys(info_keys=("episode",) if cfg.normalize_reward else None),
    )
    if resume is not None:
        # the step count, the policy versions and the envs' seeds carry on (in-flight episodes restart)
        collector.load_state_dict(own["collector"])
    return envs, agent, optimizer, shuffle_gen, collector


def anneal_learning_rate(optimizer: torch.optim.Optimizer, cfg: Config, done: float) -> None:
    """The step size once a share `done` of the iterations is done: decayed linearly to 0 with anneal_lr."""
    frac = 1 - done if cfg.anneal_lr else 1.0
    for group in optimizer.param_groups:
        group["lr"] = cfg.learning_rate * frac


def loss_rows(batch: TensorDict, cfg: Config, recurrent: bool) -> TensorDict:
    """What the loss reads of a batch [T, N]: its transitions [B], or for an LSTM sequences [S, L] of consecutive
    rows of one env with the state that went into each."""
    # mask is False on NEXT_STEP reset rows: they are not transitions, the loss leaves them out
    data = batch.select("obs", "action", "log_prob", "value", "advantage", "return", "mask")
    if recurrent:  # the LSTM steps through the reset rows too; update() masks them out of the loss
        return to_sequences(batch.select(*data.keys(), "is_init", "h", "c"), cfg.bptt_steps)
    return data[batch["mask"]]


def interrupted(logger: common.Logger | None, checkpoint: Path, iteration: int, world_size: int) -> None:
    """After a Ctrl-C: rank 0 closes the log and prints the command that carries the run on from its last
    checkpoint; every rank exits with the code of an interrupted command."""
    if logger is not None:
        logger.close()
        print_resume_command(checkpoint, iteration, world_size)
    raise SystemExit(130) from None


def finish(
    logger: common.Logger | None,
    cfg: Config,
    run_dir: Path,
    collector: Collector,
    recent: common.RecentReturns,
    world_size: int,
    *,
    started: float,
) -> None:
    """After the last checkpoint: leaves torchrun's group; rank 0 closes the log, plots, prints the collector's
    account and, with capture_video, runs an evaluation episode of the final weights, to watch."""
    if dist.is_initialized():
        dist.destroy_process_group()  # the last collective was the checkpoint's
    if logger is None:
        return
    logger.close()
    title = f"PPO on {cfg.env_id}, seed {cfg.seed}"
    plot_learning_curve(run_dir, title=title, window=cfg.return_window)
    common.report_stats(collector, run_dir, title=title)
    if cfg.capture_video:
        evaluate(run_dir / "checkpoint.pt", ["eval_episodes=1"])
    print(f"run folder: {run_dir} ({time.perf_counter() - started:.1f} s)")
    of_ranks = f" of each of {world_size} ranks" if world_size > 1 else ""
    print(f"final mean return (last {len(recent.returns)} episodes{of_ranks}): {recent.mean:.1f}")


def train(cfg: Config, resume: dict[str, Any] | None = None) -> float:
    """Trains PPO as configured, or carries on from a checkpoint `resume`; returns the final mean return.

    Under torchrun this is one rank of a data-parallel run (see the data-parallel section above); rank 0 alone
    logs, plots and writes checkpoints.

    Raises:
        ConfigError: a package that track_tensorboard or capture_video needs is missing, or `resume` is a run of
            another number of ranks; before anything is written.
    """
    start = time.perf_counter()
    common.start_workers_for(cfg.backend)
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)  # the same on every rank: the same initial weights
    rank, world_size, device = init_distributed(agent_device(cfg.device), resume)
    is_main = rank == 0
    check_can_run(cfg, world_size)
    run_dir = common.make_run_dir(cfg, write=is_main)
    checkpoint_path = run_dir / "checkpoint.pt"
    batch_steps = cfg.num_envs * cfg.num_steps * world_size  # transitions per iteration, all ranks
    num_iterations = math.ceil(cfg.total_timesteps / batch_steps)
    begun = resume or {"iteration": 0, "wall_time": 0.0, "episodes": 0, "recent_returns": ()}
    own = begun["ranks"][rank] if "ranks" in begun else begun  # this rank's streams and episodes (save_checkpoint)
    done_iterations = iteration = begun["iteration"]
    recent = common.RecentReturns(cfg.return_window, own["recent_returns"], begun["episodes"])

    total_timesteps = num_iterations * cfg.num_envs * cfg.num_steps  # as many batches on every rank
    envs, agent, optimizer, shuffle_gen, collector = build(cfg, device, rank, world_size, total_timesteps, resume, own)
    recurrent = isinstance(agent, RecurrentAgent)
    # tqdm over env steps: redrawn every second in a terminal, every 30 s into a log file
    progress = tqdm(
        total=num_iterations * batch_steps,
        initial=done_iterations * batch_steps,
        unit="step",
        mininterval=1 if sys.stderr.isatty() else 30,
        disable=not is_main,
    )

    def checkpoint() -> None:
        """checkpoint.pt: what --eval and --resume need; under torchrun every rank calls it (its own part)."""
        state = {
            "config": dataclasses.asdict(cfg),
            "model": agent.state_dict(),
            "obs_rms": obs_rms_of(envs),  # --eval normalises observations as the agent saw them in training
            # what --resume needs besides: where the run stands, the optimizer, the random streams
            "iteration": iteration,
            "optimizer": optimizer.state_dict(),
            "shuffle_rng": shuffle_gen.get_state(),
            "episodes": recent.episodes,
            "wall_time": begun["wall_time"] + time.perf_counter() - start,
        }
        # what differs per rank: its collector's seed stream, its action sampling and its episodes
        mine = {"collector": collector.state_dict(), "torch_rng": torch.get_rng_state()}
        save_checkpoint(checkpoint_path, state, {**mine, "recent_returns": list(recent.returns)})

    intervals, shares = common.Intervals(collector), ""  # shares: of the last interval, for the progress bar
    logger = None
    if is_main:  # a resumed run drops the rows logged after its checkpoint, and logs them again
        resume_step = done_iterations * batch_steps if resume else None
        logger = common.Logger(run_dir, LOG_FIELDS, resume_step=resume_step, tensorboard=cfg.track_tensorboard)
        common.print_collector(collector)  # which placement backend=auto chose
    try:
        with collector:
            waited_from = time.perf_counter()
            for iteration, batch in enumerate(collector, start=done_iterations + 1):  # batch: TensorDict [T, N]
                # time/wait_s: how long this batch kept the trainer waiting (in lockstep: the whole collection)
                wait_s = time.perf_counter() - waited_from
                finished, returns, lengths = ended_episodes(batch, cfg)
                recent.add(returns)  # of all ranks, for the mean return
                row = cfg.num_envs * world_size
                log_episode_points(logger, finished, returns, lengths, (iteration - 1) * batch_steps, row)

                if cfg.desired_kl is None:  # with desired_kl, update() adapts the learning rate
                    anneal_learning_rate(optimizer, cfg, (iteration - 1) / num_iterations)

                data = loss_rows(batch, cfg, recurrent)
                update_start = time.perf_counter()
                losses = update(agent, optimizer, data, cfg, shuffle_gen)
                update_s = time.perf_counter() - update_start

                if logger is not None:
                    interval = intervals.take()
                    shares = common.shares_text(interval)
                    step, elapsed = iteration * batch_steps, time.perf_counter() - start
                    logger.log(
                        {
                            "step": step,
                            "wall_time": begun["wall_time"] + elapsed,
                            "charts/mean_return": recent.mean,
                            "charts/episodes": recent.episodes,
                            "charts/SPS": (step - done_iterations * batch_steps) / elapsed,
                            "charts/learning_rate": optimizer.param_groups[0]["lr"],  # with desired_kl, as adapted
                            # rows collected by weights older than the ones just trained (1 with prefetch=1)
                            "charts/policy_lag": collector.policy_version - int(batch["policy_version"].min()),
                            "time/wait_s": wait_s,
                            "time/update_s": update_s,
                            **common.stats_row(interval),
                            **losses,
                        }
                    )
                if cfg.stop_return is not None and recent.mean >= cfg.stop_return:
                    break
                progress.update(batch_steps)
                progress.set_postfix_str(f"mean_return={recent.mean:.1f} {shares}", refresh=False)
                waited_from = time.perf_counter()
                if cfg.checkpoint_every and iteration % cfg.checkpoint_every == 0:
                    checkpoint()
    except KeyboardInterrupt:  # rank 0 prints the command that carries the run on from its last checkpoint
        progress.close()
        interrupted(logger, checkpoint_path, iteration + 1, world_size)
    progress.close()
    if cfg.backend == "thread":
        envs.close()
    checkpoint()
    finish(logger, cfg, run_dir, collector, recent, world_size, started=start)
    return recent.mean


def update(
    agent: Agent, optimizer: torch.optim.Optimizer, data: TensorDict, cfg: Config, shuffle_gen: torch.Generator
) -> dict[str, float]:
    """PPO's clipped-objective epochs over one batch `data`: transitions [B] or sequences [S, L], with `mask`."""
    size = data.shape[0]
    minibatch_size = math.ceil(size / cfg.num_minibatches)
    check_rank_minibatches(size, cfg.num_minibatches)  # under torchrun: as many steps on every rank
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
            if cfg.desired_kl is not None:
                adapt_learning_rate(optimizer, mean_over_ranks(approx_kl).item(), cfg.desired_kl)

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
    ret, val = data["return"][data["mask"]], data["value"][data["mask"]]
    explained_var = 1 - (ret - val).var() / ret.var() if ret.var() > 0 else torch.tensor(math.nan)
    losses = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_loss, "approx_kl": approx_kl}
    losses = {f"losses/{key}": value.item() for key, value in losses.items()}
    return {**losses, "losses/clip_frac": clip_frac.item() / updates, "losses/explained_variance": explained_var.item()}


def to_sequences(batch: TensorDict, length: int) -> TensorDict:
    """[T, N] -> [T // length * N, length]: each env's rows cut into sequences of `length` steps."""
    T, N = batch.shape
    return batch.apply(
        lambda x: x.reshape(T // length, length, N, *x.shape[2:]).transpose(1, 2).reshape(-1, length, *x.shape[2:]),
        batch_size=[T // length * N, length],
    )


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


# ---------------------------------------------------------------------------- evaluation


def evaluate(checkpoint: str | Path, overrides: Sequence[str] = ()) -> tuple[float, float]:
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


def main(argv: list[str] | None = None) -> None:
    """The command line: train, `--eval CHECKPOINT` or `--resume CHECKPOINT`, each with KEY=VALUE overrides."""
    parser = common.make_parser(__doc__, Config, DEFAULT_CONFIG)
    parser.add_argument("--eval", metavar="CHECKPOINT", default=None, help="evaluate a checkpoint instead")
    parser.add_argument(
        "--resume",
        metavar="CHECKPOINT",
        default=None,
        help="carry on the run of a checkpoint (its config, then the overrides, e.g. a larger total_timesteps)",
    )
    args = parser.parse_args(argv)
    try:
        if args.eval is not None:
            evaluate(args.eval, args.overrides)
        elif args.resume is not None:
            train(*load_resume(args.resume, args.overrides))
        else:
            train(load_config(args.config or DEFAULT_CONFIG, args.overrides))
    except ConfigError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
