"""PPO with a recurrent agent: ppo.py with an LSTM beneath actor and critic, whose state the collector carries.

The collector keeps the LSTM's state per env (zeros at an episode start), passes it to the policy with each
observation and stores in each row the state that went into that step (`initial_state=agent.initial_state`); the
update cuts the batch into sequences of `bptt_steps` rows of one env and replays them from their first row's stored
state (truncated backpropagation through time). The task that needs memory: CartPole-v1 observing its position and
angle only (`mask_velocity`), as sb3-contrib's RecurrentPPO benchmark (CartPoleNoVel). Read ppo.py first: this is
that script, changed where the LSTM needs it.

Usage::

    python examples/ppo_lstm.py                              # configs/ppo_cartpole_novel_lstm.yaml
    python examples/ppo_lstm.py lstm_size=0                  # an MLP on the same task, for comparison
    python examples/ppo_lstm.py --eval runs/ppo_lstm_CartPole-v1_seed1/checkpoint.pt   # carries the LSTM's state
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from tensordict import TensorDict
from torch.distributions import Categorical
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when imported from elsewhere
import common  # noqa: E402
from common import ConfigError  # noqa: E402

from torch_rollout import GAE, Collector, Processes, start_workers_early  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "ppo_cartpole_novel_lstm.yaml"


@dataclasses.dataclass
class Config:
    """PPO hyperparameters: CleanRL's ppo.py with an LSTM, tuned by the YAML file; a field's comment is its --help."""

    # the run
    exp_name: str = "ppo_lstm"  # first part of the run folder's name
    run_dir: str | None = None  # output folder; None: runs/<exp_name>_<env_id>_seed<seed>
    seed: int = 1  # seeds the agent's init, the env resets, action sampling and minibatch order
    device: str | None = None  # where the agent and the batches live; None: cuda if available
    torch_threads: int = 1  # intra-op threads for torch; set_num_threads is process-wide

    # environments
    env_id: str = "CartPole-v1"  # a gymnasium id with a flat Box observation and Discrete actions
    num_envs: int = 8  # parallel envs (N) in one gymnasium SyncVectorEnv
    mask_velocity: bool = True  # CartPole only: drop the cart and pole velocities, so that acting needs memory

    # collection and PPO
    total_timesteps: int = 300_000  # env transitions to collect (all envs together)
    num_steps: int = 128  # steps per env per batch (T); a batch holds T * N transitions
    backend: str = "thread"  # where collection runs: "process", "thread", or "auto" (processes for a CPU agent)
    prefetch: int | None = None  # batches collected ahead of training; 0: lockstep; None: the collector's default
    learning_rate: float = 2.5e-4  # Adam step size at the start
    anneal_lr: bool = True  # decay the learning rate linearly to 0 over the run
    gamma: float = 0.99  # discount factor
    gae_lambda: float = 0.95  # GAE's bias/variance trade-off
    num_minibatches: int = 4  # minibatches (of sequences) per epoch
    update_epochs: int = 4  # passes over each batch
    clip_coef: float = 0.2  # PPO's ratio clip range
    clip_vloss: bool = True  # clip the value update around the stored value too
    ent_coef: float = 0.01  # entropy bonus
    vf_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 0.5  # global gradient-norm clip

    # the agent
    hidden_size: int = 64  # width of the two tanh hidden layers of actor and critic
    lstm_size: int = 64  # > 0: an LSTM of this width beneath actor and critic; 0: an MLP alone
    bptt_steps: int = 8  # minibatches of sequences of this many steps, replayed from the stored state

    # logging and evaluation
    return_window: int = 20  # episodes in the reported mean return
    eval_episodes: int = 10  # deterministic episodes run by --eval


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, base: dict | None = None) -> Config:
    """A Config from `base` (a checkpoint's), the YAML file at `path`, then `key=value` overrides (common.py)."""
    cfg = common.load_config(Config, path, overrides, base=base)
    if cfg.num_steps % cfg.bptt_steps:
        raise ConfigError(f"bptt_steps={cfg.bptt_steps} must divide num_steps={cfg.num_steps}")
    return cfg


# ---------------------------------------------------------------------------- environments


# CartPole's termination thresholds of x and theta: scaled by them, what is left of the observation spans [-1, 1]
CARTPOLE_BOUNDS = np.array([2.4, 12 * 2 * math.pi / 360], dtype=np.float32)


def drop_velocities(obs: np.ndarray) -> np.ndarray:
    """CartPole's [x, x_dot, theta, theta_dot] -> [x, theta] / bounds: velocities must be inferred from the past.

    An angle of 0.01 rad would otherwise reach the LSTM as an input change of 0.01, which the
    difference of two steps (the velocity) makes smaller still.
    """
    return (obs[[0, 2]] / CARTPOLE_BOUNDS).astype(np.float32)


def make_envs(cfg: Config, num_envs: int) -> gym.vector.VectorEnv:
    """gymnasium's SyncVectorEnv of env_id; with mask_velocity, CartPole-v1 observing its position and angle only."""
    if not cfg.mask_velocity:
        return gym.make_vec(cfg.env_id, num_envs, "sync")
    if cfg.env_id != "CartPole-v1":
        raise ConfigError(f"mask_velocity knows CartPole-v1's observation only, got env_id={cfg.env_id}")
    position_and_angle = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    masked = functools.partial(
        gym.wrappers.TransformObservation, func=drop_velocities, observation_space=position_and_angle
    )
    return gym.make_vec(cfg.env_id, num_envs, "sync", wrappers=[masked])


# ---------------------------------------------------------------------------- agent


def layer(in_features: int, out_features: int, std: float = math.sqrt(2)) -> nn.Linear:
    """A linear layer with CleanRL's init: orthogonal weights of gain `std`, zero bias."""
    linear = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(linear.weight, std)
    nn.init.zeros_(linear.bias)
    return linear


def mlp(in_features: int, hidden: int, out_features: int, std: float) -> nn.Sequential:
    return nn.Sequential(
        layer(in_features, hidden), nn.Tanh(), layer(hidden, hidden), nn.Tanh(), layer(hidden, out_features, std)
    )


class MLPAgent(nn.Module):
    """ppo.py's actor-critic, for `lstm_size=0`: the same task without memory."""

    def __init__(self, obs_dim: int, num_actions: int, cfg: Config) -> None:
        super().__init__()
        self.actor = mlp(obs_dim, cfg.hidden_size, num_actions, 0.01)
        self.critic = mlp(obs_dim, cfg.hidden_size, 1, 1.0)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        dist = Categorical(logits=self.actor(obs), validate_args=False)
        action = dist.sample()
        return {"action": action, "log_prob": dist.log_prob(action), "value": self.critic(obs).squeeze(-1)}

    def evaluate(self, mb: TensorDict) -> tuple[torch.Tensor, ...]:
        dist = Categorical(logits=self.actor(mb["obs"]), validate_args=False)
        return dist.log_prob(mb["action"]), dist.entropy(), self.critic(mb["obs"]).squeeze(-1)


class RecurrentAgent(MLPAgent):
    """Actor and critic on one LSTM: the collector carries its state per env (zeros at an episode start) and
    stores per row the state that went into the step, from which `evaluate` replays sequences (truncated BPTT)."""

    def __init__(self, obs_dim: int, num_actions: int, cfg: Config) -> None:
        super().__init__(cfg.lstm_size, num_actions, cfg)  # the heads read the LSTM's output
        self.lstm = nn.LSTMCell(obs_dim, cfg.lstm_size)
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
        dist = Categorical(logits=self.actor(features), validate_args=False)
        return dist.log_prob(mb["action"]), dist.entropy(), self.critic(features).squeeze(-1)


def make_agent(obs_space: gym.spaces.Box, action_space: gym.spaces.Discrete, cfg: Config) -> MLPAgent:
    """The config's agent: recurrent with lstm_size > 0, else the MLP."""
    obs_dim, num_actions = int(np.prod(obs_space.shape)), int(action_space.n)
    return (RecurrentAgent if cfg.lstm_size > 0 else MLPAgent)(obs_dim, num_actions, cfg)


def to_sequences(batch: TensorDict, length: int) -> TensorDict:
    """[T, N] -> [T // length * N, length]: each env's rows cut into sequences of `length` steps."""
    T, N = batch.shape
    return batch.apply(
        lambda x: x.reshape(T // length, length, N, *x.shape[2:]).transpose(1, 2).reshape(-1, length, *x.shape[2:]),
        batch_size=[T // length * N, length],
    )


# ---------------------------------------------------------------------------- collector, update and log
LOG_FIELDS = ["step", "wall_time", "charts/mean_return", "charts/episodes", "charts/SPS", "charts/learning_rate"]
LOG_FIELDS += ["charts/policy_lag", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"]
LOG_FIELDS += ["time/wait_s", "time/update_s", *common.STATS_FIELDS]


def train(cfg: Config) -> float:
    """Trains PPO as configured; writes the run folder (progress.csv, plots, checkpoint.pt) and returns the final
    mean return."""
    start = time.perf_counter()
    if cfg.backend in ("process", "auto"):  # their fork server imports torch now, while the agent is built
        start_workers_early()
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run_dir = common.make_run_dir(cfg)
    batch_steps = cfg.num_envs * cfg.num_steps
    num_iterations = math.ceil(cfg.total_timesteps / batch_steps)

    if cfg.backend == "thread":
        envs = spaces = make_envs(cfg, cfg.num_envs)
    else:  # each worker builds its share of the envs from this picklable recipe
        envs, spaces = functools.partial(make_envs, cfg), make_envs(cfg, 1)
        spaces.close()
    agent = make_agent(spaces.single_observation_space, spaces.single_action_space, cfg).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=1e-5, fused=True)
    shuffle_gen = torch.Generator(device).manual_seed(cfg.seed)
    collector = Collector(
        envs,
        agent,
        num_steps=cfg.num_steps,
        num_envs=cfg.num_envs,
        gae=GAE(cfg.gamma, cfg.gae_lambda),
        device=device,
        total_timesteps=cfg.total_timesteps,
        prefetch=cfg.prefetch,
        seed=cfg.seed,
        backend=Processes(1) if cfg.backend == "process" else cfg.backend,
        # the LSTM's state, carried per env: zeros at each episode start, stored in each row as "h" and "c"
        initial_state=getattr(agent, "initial_state", None),
    )
    recent, intervals = common.RecentReturns(cfg.return_window), common.Intervals(collector)
    progress = tqdm(total=num_iterations * batch_steps, unit="step", mininterval=1 if sys.stderr.isatty() else 30)
    with collector, common.Logger(run_dir, LOG_FIELDS) as logger:
        common.print_collector(collector)  # which placement backend=auto chose
        waited_from = time.perf_counter()
        for iteration, batch in enumerate(collector, start=1):  # batch: TensorDict [T, N], GAE included
            wait_s = time.perf_counter() - waited_from
            recent.add(batch["episode_return"][batch["done"] & batch["mask"]])
            frac = 1 - (iteration - 1) / num_iterations if cfg.anneal_lr else 1.0
            for group in optimizer.param_groups:
                group["lr"] = cfg.learning_rate * frac

            data = batch.select("obs", "action", "log_prob", "value", "advantage", "return", "mask")
            if cfg.lstm_size > 0:  # sequences of consecutive rows of one env, with the state that went into each
                data = to_sequences(data.update(batch.select("is_init", "h", "c")), cfg.bptt_steps)
            else:  # the transitions: mask is False on NEXT_STEP reset rows
                data = data[batch["mask"]]
            update_start = time.perf_counter()
            losses = update(agent, optimizer, data, cfg, shuffle_gen)
            update_s = time.perf_counter() - update_start

            step, elapsed, interval = iteration * batch_steps, time.perf_counter() - start, intervals.take()
            logger.log(
                {
                    "step": step,
                    "wall_time": elapsed,
                    "charts/mean_return": recent.mean,
                    "charts/episodes": recent.episodes,
                    "charts/SPS": step / elapsed,
                    "charts/learning_rate": optimizer.param_groups[0]["lr"],
                    "charts/policy_lag": collector.policy_version - int(batch["policy_version"].min()),
                    "time/wait_s": wait_s,
                    "time/update_s": update_s,
                    **common.stats_row(interval),
                    **losses,
                }
            )
            progress.update(batch_steps)
            progress.set_postfix_str(f"mean_return={recent.mean:.1f} {common.shares_text(interval)}", refresh=False)
            waited_from = time.perf_counter()
    progress.close()
    if cfg.backend == "thread":
        envs.close()
    state = {"config": dataclasses.asdict(cfg), "model": agent.state_dict(), "iteration": iteration}
    torch.save(state, run_dir / "checkpoint.pt")
    common.report_stats(
        collector, run_dir, title=f"PPO-LSTM on {cfg.env_id}, seed {cfg.seed}", window=cfg.return_window
    )
    print(f"run folder: {run_dir} ({time.perf_counter() - start:.1f} s)")
    print(f"final mean return (last {len(recent.returns)} episodes): {recent.mean:.1f}")
    return recent.mean


def update(
    agent: MLPAgent, optimizer: torch.optim.Optimizer, data: TensorDict, cfg: Config, shuffle_gen: torch.Generator
) -> dict[str, float]:
    """PPO's clipped-objective epochs over one batch: transitions [B] (the MLP) or sequences [S, L] (the LSTM), whose
    rows with `mask` False (NEXT_STEP reset rows, no transitions) the loss leaves out; the LSTM steps through them."""
    size = data.shape[0]
    minibatch_size = math.ceil(size / cfg.num_minibatches)
    for _ in range(cfg.update_epochs):
        order = torch.randperm(size, device=data.device, generator=shuffle_gen)
        for begin in range(0, size, minibatch_size):
            mb = data[order[begin : begin + minibatch_size]]
            log_prob, entropy, value = agent.evaluate(mb)
            if data.ndim == 2:  # sequences keep the rows that are no transition: the LSTM steps through them
                real = mb["mask"]
                mb, log_prob, entropy, value = mb[real], log_prob[real], entropy[real], value[real]
            log_ratio = log_prob - mb["log_prob"]  # against the weights that acted: the lag of prefetch=1
            ratio = log_ratio.exp()
            with torch.no_grad():
                approx_kl = ((ratio - 1) - log_ratio).mean()  # k3 estimator: unbiased, >= 0
            adv = mb["advantage"]
            if adv.numel() > 1:
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
            nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()
    losses = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_loss, "approx_kl": approx_kl}
    return {f"losses/{key}": value.item() for key, value in losses.items()}


# ---------------------------------------------------------------------------- evaluation


def evaluate(checkpoint: str | Path, overrides: Sequence[str] = ()) -> tuple[float, float]:
    """`--eval CHECKPOINT`: `eval_episodes` episodes of its agent, one per sub-env, each action the most likely one,
    the LSTM's state carried from step to step; returns the mean return and its std."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    cfg = load_config(None, overrides, base=state["config"])
    torch.set_num_threads(cfg.torch_threads)
    envs = make_envs(cfg, cfg.eval_episodes)
    agent = make_agent(envs.single_observation_space, envs.single_action_space, cfg)
    agent.load_state_dict(state["model"])
    memory = agent.initial_state(cfg.eval_episodes) if isinstance(agent, RecurrentAgent) else None
    returns, finished = np.zeros(cfg.eval_episodes), np.zeros(cfg.eval_episodes, dtype=bool)
    obs, _ = envs.reset(seed=cfg.seed + 10_000)  # episodes unseen in training
    while not finished.all():
        with torch.no_grad():
            features = torch.as_tensor(obs, dtype=torch.float32)
            if memory is not None:
                features, memory = agent.step(features, memory)
            action = agent.actor(features).argmax(-1)
        obs, reward, terminated, truncated, _ = envs.step(action.numpy())
        returns += np.where(finished, 0.0, reward)
        finished |= terminated | truncated
    envs.close()
    mean, std = float(returns.mean()), float(returns.std())
    print(f"eval over {cfg.eval_episodes} episodes: mean return {mean:.1f} +- {std:.1f}")
    return mean, std


def main(argv: list[str] | None = None) -> None:
    """The command line: train, or `--eval CHECKPOINT`, with KEY=VALUE overrides."""
    parser = common.make_parser(__doc__, Config, DEFAULT_CONFIG)
    parser.add_argument("--eval", metavar="CHECKPOINT", default=None, help="evaluate a checkpoint instead")
    args = parser.parse_args(argv)
    try:
        if args.eval is not None:
            evaluate(args.eval, args.overrides)
        else:
            train(load_config(args.config or DEFAULT_CONFIG, args.overrides))
    except ConfigError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
