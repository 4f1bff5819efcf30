"""SAC on top of torch_rollout, read top to bottom: config, agent, replay buffer, then the collector and the updates.

The collector steps the envs and acts with the actor in a worker process (or a background thread) while this script
runs gradient steps; each small batch of T steps per env goes into a replay buffer on the device with its true next
observations (`BatchKeys(next_obs=True)`: the final observation at an episode end, never the reset one). Each run
writes progress.csv and config.yaml into its run folder; config files, `--help` and the log are common.py's.

Usage::

    python examples/sac.py --help                          # every config key, its default and meaning
    python examples/sac.py                                 # Pendulum-v1, configs/sac_pendulum.yaml
    python examples/sac.py seed=2 total_timesteps=50000    # key=value overrides
    python examples/sac.py backend=thread                  # collect in a thread of this process instead
    python examples/sac.py --config configs/sac_pendulum_torch.yaml   # 1,024 torch envs, T=1 (FastTD3's shape)
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from tensordict import TensorDict
from torch.distributions import Normal

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when imported from elsewhere
import common  # noqa: E402
from common import ConfigError  # noqa: E402

from torch_rollout import BatchKeys, Collector, Processes, gym_envs, start_workers_early  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "sac_pendulum.yaml"


# ---------------------------------------------------------------------------- config


@dataclasses.dataclass
class Config:
    """SAC hyperparameters; those of SAC are CleanRL's sac_continuous_action.py, the YAML file tunes them per env.

    The comment beside each field is its description in `--help`, the headings its groups there.
    """

    # the run
    exp_name: str = "sac"  # first part of the run folder's name
    run_dir: str | None = None  # output folder; None: runs/<exp_name>_<env_id>_seed<seed>
    seed: int = 1  # seeds the networks' init, the env resets, the replay samples and action sampling
    device: str = "cpu"  # where the networks, the replay buffer and the batches live
    torch_threads: int = 1  # intra-op threads for the trainer's torch ops

    # environments and collection
    env_id: str = "Pendulum-v1"  # a gymnasium id (flat Box observation, Box action); torch_rollout/...: torch envs
    num_envs: int = 4  # parallel envs (N): one gymnasium SyncVectorEnv, or one torch vector env on `device`
    num_steps: int = 2  # steps per env per batch (T): the replay buffer gets T * N transitions at a time
    backend: str = "thread"  # where collection runs: "thread" or "process" (one worker process)
    prefetch: int = 1  # batches collected ahead of training (acting lags the trainer by as many batches)
    total_timesteps: int = 1_000_000  # env transitions to collect (all envs together)

    # SAC
    buffer_size: int = 1_000_000  # transitions the replay buffer keeps; the oldest are overwritten
    learning_starts: int = 5_000  # env steps collected (with the untrained actor) before the first update
    batch_size: int = 256  # transitions per gradient step
    update_ratio: float = 1.0  # gradient steps per env step collected
    gamma: float = 0.99  # discount factor
    tau: float = 0.005  # target critics' Polyak step
    policy_lr: float = 3e-4  # Adam step size of the actor (and of the temperature)
    q_lr: float = 1e-3  # Adam step size of the critics
    policy_frequency: int = 2  # critic steps per actor step (the actor then takes this many, delayed as TD3)
    alpha: float = 0.2  # entropy temperature at the start
    autotune: bool = True  # learn the temperature towards an entropy of -action_dim
    hidden_size: int = 256  # width of the two ReLU layers of the actor and of each critic

    # logging
    return_window: int = 20  # episodes in the reported mean return
    log_every: int = 1_000  # env steps between rows of progress.csv
    target_return: float | None = None  # report the first env step where the mean return reaches this


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """A Config from the YAML file at `path`, then `key=value` overrides (common.load_config), checked for SAC.

    Raises:
        ConfigError: an unknown key, a value of the wrong type or out of range, or a malformed override.
    """
    cfg = common.load_config(Config, path, overrides)
    if cfg.backend not in ("thread", "process"):
        raise ConfigError(f"config key 'backend': expected 'thread' or 'process', got {cfg.backend!r}")
    if cfg.prefetch < 1:
        raise ConfigError(f"config key 'prefetch': expected >= 1 (collection beside training), got {cfg.prefetch}")
    return cfg


# ---------------------------------------------------------------------------- agent


def mlp(in_features: int, out_features: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, out_features)
    )


class Actor(nn.Module):
    """A tanh-squashed Gaussian policy, scaled to the action space's bounds."""

    LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0

    def __init__(self, obs_dim: int, action_space: gym.spaces.Box, hidden: int) -> None:
        super().__init__()
        act_dim = int(np.prod(action_space.shape))
        self.net = mlp(obs_dim, 2 * act_dim, hidden)  # [mean, log_std]
        # buffers: they follow .to(device), and reach the collector's acting copy with the weights
        self.register_buffer("scale", torch.as_tensor((action_space.high - action_space.low) / 2, dtype=torch.float32))
        self.register_buffer("bias", torch.as_tensor((action_space.high + action_space.low) / 2, dtype=torch.float32))

    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparametrised action [B, act_dim] within the bounds, and its log-probability [B]."""
        mean, log_std = self.net(obs).chunk(2, dim=-1)
        # squashed into [LOG_STD_MIN, LOG_STD_MAX] smoothly, as CleanRL does
        log_std = self.LOG_STD_MIN + 0.5 * (self.LOG_STD_MAX - self.LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        normal = Normal(mean, log_std.exp(), validate_args=False)
        u = normal.rsample()
        squashed = torch.tanh(u)
        # change of variables through tanh and the scaling (1e-6 keeps the log finite at the bounds)
        log_prob = normal.log_prob(u) - torch.log(self.scale * (1 - squashed.pow(2)) + 1e-6)
        return squashed * self.scale + self.bias, log_prob.sum(-1)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The collector's policy: a sampled action for obs [N, obs_dim]."""
        return {"action": self.sample(obs)[0]}


class Critic(nn.Module):
    """Two Q-networks (clipped double Q): Q1(s, a), Q2(s, a), each [B]."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.q1, self.q2 = mlp(obs_dim + act_dim, 1, hidden), mlp(obs_dim + act_dim, 1, hidden)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([obs, action], dim=-1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


# ---------------------------------------------------------------------------- replay buffer


class ReplayBuffer:
    """A ring buffer of transitions preallocated on the device; the oldest are overwritten once it is full.

    Every row goes in with its `mask`: the critics' loss weighs masked rows (NEXT_STEP's reset rows) 0, where
    selecting the real rows (`batch[batch["mask"]]`) would wait for the device to count them at every batch."""

    KEYS = ("obs", "action", "reward", "next_obs", "terminated", "mask")

    def __init__(self, capacity: int, example: TensorDict) -> None:
        # storage shaped like one transition of a batch, [capacity, ...]
        self.data = example.select(*self.KEYS)[0].expand(capacity).clone()
        self.capacity, self.pos, self.size = capacity, 0, 0

    def extend(self, rows: TensorDict) -> None:
        """Copies rows [B] (a batch's, flattened) in at the write position: at most two slices, as it wraps."""
        rows = rows.select(*self.KEYS)[-self.capacity :]
        n = rows.shape[0]
        first = min(n, self.capacity - self.pos)
        self.data[self.pos : self.pos + first].copy_(rows[:first])
        self.data[: n - first].copy_(rows[first:])
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator) -> TensorDict:
        index = torch.randint(self.size, (batch_size,), device=self.data.device, generator=generator)
        return self.data[index]


# ---------------------------------------------------------------------------- training


class EndedReturns:
    """The returns of the episodes that end in each batch, kept on the batch's device and added to a RecentReturns
    only at `flush`: one wait for the device per log row, not one per batch (SAC's T=1 batches come by thousands).

    `reached`: the env step after the first batch at which the mean of a full window was >= `target`, else None.
    """

    def __init__(self, recent: common.RecentReturns, target: float | None = None) -> None:
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


LOG_FIELDS = [
    "step",
    "wall_time",
    "charts/mean_return",
    "charts/episodes",
    "charts/SPS",
    "charts/policy_lag",
    "losses/qf_loss",
    "losses/qf_value",
    "losses/actor_loss",
    "losses/alpha",
    "time/wait_s",
    "time/update_s",
    *common.STATS_FIELDS,
]


class SAC:
    """The learner: actor, twin critics and their targets, the temperature, and one gradient step at a time."""

    def __init__(self, obs_dim: int, action_space: gym.spaces.Box, cfg: Config, device: torch.device) -> None:
        act_dim = int(np.prod(action_space.shape))
        self.cfg = cfg
        self.actor = Actor(obs_dim, action_space, cfg.hidden_size).to(device)
        self.critic = Critic(obs_dim, act_dim, cfg.hidden_size).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        # fused: one kernel for all parameters instead of a loop over them
        self.q_optimizer = torch.optim.Adam(self.critic.parameters(), lr=cfg.q_lr, fused=True)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=cfg.policy_lr, fused=True)
        self.log_alpha = torch.tensor(math.log(cfg.alpha), device=device, requires_grad=cfg.autotune)
        self.target_entropy = -float(act_dim)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=cfg.policy_lr) if cfg.autotune else None
        self.steps = 0
        self.stats: dict[str, torch.Tensor] = {}

    def update(self, data: TensorDict) -> None:
        """One critic step on transitions [B]; every policy_frequency-th also that many actor steps."""
        cfg, alpha = self.cfg, self.log_alpha.detach().exp()
        with torch.no_grad():
            next_action, next_log_prob = self.actor.sample(data["next_obs"])
            target_q = torch.min(*self.critic_target(data["next_obs"], next_action)) - alpha * next_log_prob
            # only termination stops the bootstrap: a truncated episode (Pendulum's time limit) goes on
            # beyond the last row, from the true next observation that next_obs holds
            target = data["reward"] + cfg.gamma * (~data["terminated"]) * target_q
        q1, q2 = self.critic(data["obs"], data["action"])
        qf_loss = (data["mask"] * ((q1 - target).pow(2) + (q2 - target).pow(2))).mean()
        self.q_optimizer.zero_grad(set_to_none=True)
        qf_loss.backward()
        self.q_optimizer.step()
        self.stats["losses/qf_loss"], self.stats["losses/qf_value"] = qf_loss.detach(), q1.detach().mean()

        if self.steps % cfg.policy_frequency == 0:
            for _ in range(cfg.policy_frequency):
                action, log_prob = self.actor.sample(data["obs"])
                actor_loss = (alpha * log_prob - torch.min(*self.critic(data["obs"], action))).mean()
                self.actor_optimizer.zero_grad(set_to_none=True)
                actor_loss.backward()
                self.actor_optimizer.step()
                if self.alpha_optimizer is not None:
                    alpha_loss = -(self.log_alpha.exp() * (log_prob.detach() + self.target_entropy)).mean()
                    self.alpha_optimizer.zero_grad(set_to_none=True)
                    alpha_loss.backward()
                    self.alpha_optimizer.step()
                    alpha = self.log_alpha.detach().exp()
            self.stats["losses/actor_loss"], self.stats["losses/alpha"] = actor_loss.detach(), alpha
        # Polyak averaging of the targets, one fused call over all tensors
        with torch.no_grad():
            torch._foreach_lerp_(list(self.critic_target.parameters()), list(self.critic.parameters()), cfg.tau)
        self.steps += 1


def train(cfg: Config) -> float:
    """Trains SAC as configured; writes the run folder (progress.csv, config.yaml); returns the final mean return."""
    start = time.perf_counter()
    if cfg.backend in ("process", "auto"):  # their fork server imports torch now, while the agent is built
        start_workers_early()
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    run_dir = common.make_run_dir(cfg)

    # a torch vector env (torch_rollout/...) steps on the agent's device and, as GPU simulators do, resets an ended
    # env within the step (every row a transition); gymnasium's steps on the CPU
    torch_envs = {"device": device, "autoreset_mode": "SameStep"} if cfg.env_id.startswith("torch_rollout/") else {}
    envs = gym_envs(cfg.env_id, **torch_envs)
    spaces = envs(1)
    obs_space, action_space = spaces.single_observation_space, spaces.single_action_space
    spaces.close()
    if not isinstance(action_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        raise ConfigError(f"env_id={cfg.env_id}: SAC here needs a flat Box observation and a Box action space")
    sac = SAC(obs_space.shape[0], action_space, cfg, device)
    sample_gen = torch.Generator(device).manual_seed(cfg.seed)

    batch_steps = cfg.num_envs * cfg.num_steps
    recent = common.RecentReturns(cfg.return_window)
    ended = EndedReturns(recent, cfg.target_return)
    global_step, next_log, owed_updates = 0, cfg.log_every, 0.0
    wait_s, update_s, buffer = 0.0, 0.0, None
    collector = Collector(
        envs,  # a recipe: the collector builds the envs (in the worker process with backend=process)
        sac.actor,
        num_envs=cfg.num_envs,
        num_steps=cfg.num_steps,
        backend="thread" if cfg.backend == "thread" else Processes(1),
        device=device,
        gae=None,  # no advantages: the critics learn from the replay buffer
        total_timesteps=cfg.total_timesteps,
        prefetch=cfg.prefetch,
        seed=cfg.seed,
        keys=BatchKeys(next_obs=True),
    )
    common.print_collector(collector)
    intervals = common.Intervals(collector)
    waited_from = time.perf_counter()
    with collector, common.Logger(run_dir, LOG_FIELDS) as logger:
        for batch in collector:  # [T, N], collected while the previous batch trained
            wait_s += time.perf_counter() - waited_from
            global_step += batch_steps
            rows = batch.reshape(-1)  # [T * N]: the buffer copies them in and keeps no reference to the batch
            buffer = buffer or ReplayBuffer(cfg.buffer_size, rows)  # shaped like the first batch's rows
            buffer.extend(rows)
            ended.add(global_step, batch)  # counted at the next log: no wait for the device per batch

            if global_step >= cfg.learning_starts:
                update_start = time.perf_counter()
                owed_updates += batch_steps * cfg.update_ratio
                while owed_updates >= 1:
                    sac.update(buffer.sample(cfg.batch_size, sample_gen))
                    owed_updates -= 1
                update_s += time.perf_counter() - update_start

            if global_step >= next_log or global_step >= cfg.total_timesteps:
                next_log += cfg.log_every
                ended.flush()
                interval = intervals.take()  # the collector's account of the interval (docs/bottleneck.md)
                row = {
                    "step": global_step,
                    "wall_time": time.perf_counter() - start,
                    "charts/mean_return": recent.mean,
                    "charts/episodes": recent.episodes,
                    "charts/SPS": global_step / (time.perf_counter() - start),
                    # batches collected by weights older than the ones just trained (1 with prefetch=1)
                    "charts/policy_lag": collector.policy_version - int(batch["policy_version"].min()),
                    "time/wait_s": wait_s,
                    "time/update_s": update_s,
                    **{key: float(value) for key, value in sac.stats.items()},
                    **common.stats_row(interval),
                }
                logger.log(row)
                shares = common.shares_text(interval)
                print(f"step {global_step:>8}  mean return {recent.mean:8.1f}  SPS {row['charts/SPS']:6.0f}  {shares}")
            waited_from = time.perf_counter()
    common.report_stats(collector, run_dir, title=f"SAC on {cfg.env_id}, seed {cfg.seed}")  # its line and plot
    print(f"run folder: {run_dir} ({time.perf_counter() - start:.1f} s)")
    print(f"final mean return (last {len(recent.returns)} episodes): {recent.mean:.1f}")
    if cfg.target_return is not None:
        print(f"mean return >= {cfg.target_return} first at step: {ended.reached or 'never'}")
    return recent.mean


# ---------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__, Config, DEFAULT_CONFIG)
    args = parser.parse_args(argv)
    try:
        train(load_config(args.config or DEFAULT_CONFIG, args.overrides))
    except ConfigError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
