"""PPO on top of torch_rollout, read top to bottom: config, envs, agent, then the collector, the update and the log.

The collector steps the envs and runs the policy in a worker process (or a background thread), so the next batch
is being collected while this script updates the agent on the current one. What it shares with the other
examples (config files and `--help`, the run folder and its log) is in common.py beside it. Each script beside
it is this one with one capability more, to read alone, as CleanRL's variants are:

- ppo_continuous.py: continuous control with observation and reward normalisation (HalfCheetah);
- ppo_lstm.py: a recurrent agent, whose state the collector carries (CartPole without velocities);
- ppo_resume.py: checkpoints, Ctrl-C and `--resume`, evaluation with videos;
- ppo_ranks.py: data-parallel training under torchrun, a collector per rank.

Usage::

    python examples/ppo.py --help                            # every config key, its default and meaning
    python examples/ppo.py                                   # CartPole-v1, configs/ppo_cartpole.yaml
    python examples/ppo.py seed=2 total_timesteps=100000     # key=value overrides
    python examples/ppo.py --config configs/ppo_cartpole_torch.yaml   # 1,024 CartPoles as one env of tensors
    python examples/ppo.py track_tensorboard=true            # then: tensorboard --logdir runs
    python examples/ppo.py --eval runs/ppo_CartPole-v1_seed1/checkpoint.pt   # deterministic episodes
"""

from __future__ import annotations

import dataclasses
import functools
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
from torch.distributions import Categorical
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when imported from elsewhere
import common  # noqa: E402
from common import ConfigError  # noqa: E402

from torch_rollout import GAE, Collector, Processes, Ray, start_workers_early  # noqa: E402

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
    env_id: str = "CartPole-v1"  # a gymnasium id with a flat Box observation and Discrete actions
    num_envs: int = 4  # parallel envs (N) in one gymnasium SyncVectorEnv

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
    hidden_size: int = 64  # width of the two tanh hidden layers of actor and critic

    # logging and evaluation
    return_window: int = 20  # episodes in the reported mean return
    stop_return: float | None = None  # end the run at the first batch whose mean return reaches this; None: never
    track_tensorboard: bool = False  # also write the logged scalars as TensorBoard events into the run folder
    eval_episodes: int = 10  # deterministic episodes run by --eval


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, base: dict | None = None) -> Config:
    """A Config from `base` (a checkpoint's), the YAML file at `path`, then `key=value` overrides (common.py)."""
    return common.load_config(Config, path, overrides, base=base)


# ---------------------------------------------------------------------------- environments


def make_envs(cfg: Config, num_envs: int) -> gym.vector.VectorEnv:
    """gymnasium's SyncVectorEnv of env_id, or for an id torch_rollout/..., one vector env of torch tensors on the
    agent's device."""
    if cfg.env_id.startswith("torch_rollout/"):
        return gym.make_vec(cfg.env_id, num_envs=num_envs, device=agent_device(cfg.device))
    return gym.make_vec(cfg.env_id, num_envs, "sync")


def agent_device(device: str | None) -> torch.device:
    """Where the agent, the batches (and a torch-tensor env) live: `device`, or None: cuda if available."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def placement(backend: str, num_workers: int) -> str | Processes | Ray:
    """The collector's backend: the config's name, with its worker count for processes and Ray."""
    if backend == "process":
        return Processes(num_workers)
    if backend == "ray":
        return Ray(num_workers)
    if num_workers != 1:
        raise ConfigError(f"num_workers={num_workers} needs backend=process or backend=ray, got {backend}")
    return backend


# ---------------------------------------------------------------------------- agent


def layer(in_features: int, out_features: int, std: float = math.sqrt(2)) -> nn.Linear:
    """A linear layer with CleanRL's init: orthogonal weights of gain `std`, zero bias."""
    linear = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(linear.weight, std)
    nn.init.zeros_(linear.bias)
    return linear


class Agent(nn.Module):
    """Actor-critic MLP with a Categorical policy for Discrete actions (ppo_continuous.py: Box actions)."""

    def __init__(self, obs_space: gym.spaces.Space, action_space: gym.spaces.Space, cfg: Config) -> None:
        super().__init__()
        if not isinstance(action_space, gym.spaces.Discrete):
            raise ConfigError(f"{cfg.env_id}: ppo.py takes Discrete actions, got {action_space}; see ppo_continuous.py")
        obs_dim, h = int(np.prod(obs_space.shape)), cfg.hidden_size
        # a small last-layer gain keeps the initial policy near uniform
        self.actor = nn.Sequential(layer(obs_dim, h), nn.Tanh(), layer(h, h), nn.Tanh(), layer(h, action_space.n, 0.01))
        self.critic = nn.Sequential(layer(obs_dim, h), nn.Tanh(), layer(h, h), nn.Tanh(), layer(h, 1, 1.0))

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The collector's policy: samples actions for obs [N, obs_dim]."""
        dist = Categorical(logits=self.actor(obs), validate_args=False)
        action = dist.sample()  # [N] int64
        return {"action": action, "log_prob": dist.log_prob(action), "value": self.critic(obs).squeeze(-1)}

    def evaluate(self, mb: TensorDict) -> tuple[torch.Tensor, ...]:
        """log_prob, entropy and value of the minibatch's actions under the current weights, for the loss."""
        dist = Categorical(logits=self.actor(mb["obs"]), validate_args=False)
        return dist.log_prob(mb["action"]), dist.entropy(), self.critic(mb["obs"]).squeeze(-1)


# ---------------------------------------------------------------------------- collector, update and log
LOG_FIELDS = ["step", "wall_time", "charts/mean_return", "charts/episodes", "charts/SPS", "charts/learning_rate"]
LOG_FIELDS += ["charts/policy_lag", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"]
LOG_FIELDS += ["losses/clip_frac", "losses/explained_variance", "time/wait_s", "time/update_s", *common.STATS_FIELDS]


def train(cfg: Config) -> float:
    """Trains PPO as configured; writes the run folder (progress.csv, plots, checkpoint.pt) and returns the final
    mean return."""
    start = time.perf_counter()
    if cfg.backend in ("process", "auto"):  # their fork server imports torch now, while the agent is built
        start_workers_early()
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    if cfg.track_tensorboard:  # fails now if tensorboard is missing, not once the envs are built
        common.import_optional("torch.utils.tensorboard", "track_tensorboard", "tensorboard")
    device = agent_device(cfg.device)
    run_dir = common.make_run_dir(cfg)
    batch_steps = cfg.num_envs * cfg.num_steps
    num_iterations = math.ceil(cfg.total_timesteps / batch_steps)

    if cfg.backend == "thread":
        envs = spaces = make_envs(cfg, cfg.num_envs)
    else:  # each worker builds its share of the envs from this picklable recipe
        envs, spaces = functools.partial(make_envs, cfg), make_envs(cfg, 1)
        spaces.close()
    agent = Agent(spaces.single_observation_space, spaces.single_action_space, cfg).to(device)
    # fused: one kernel for all parameters instead of a loop over them (an update 8% faster on the CPU here)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, fused=True)
    # the collector samples actions from torch's global generator; minibatches come from one of our own
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
        backend=placement(cfg.backend, cfg.num_workers),
    )
    recent, intervals = common.RecentReturns(cfg.return_window), common.Intervals(collector)
    progress = tqdm(total=num_iterations * batch_steps, unit="step", mininterval=1 if sys.stderr.isatty() else 30)
    with collector, common.Logger(run_dir, LOG_FIELDS, tensorboard=cfg.track_tensorboard) as logger:
        common.print_collector(collector)  # which placement backend=auto chose
        waited_from = time.perf_counter()
        for iteration, batch in enumerate(collector, start=1):  # batch: TensorDict [T, N], GAE included
            wait_s = time.perf_counter() - waited_from  # in lockstep: the whole collection
            finished = batch["done"] & batch["mask"]  # the episodes that ended in this batch
            returns, lengths = batch["episode_return"][finished], batch["episode_length"][finished]
            recent.add(returns)
            log_episodes(logger, finished, returns, lengths, step=(iteration - 1) * batch_steps)
            frac = 1 - (iteration - 1) / num_iterations if cfg.anneal_lr else 1.0
            for group in optimizer.param_groups:
                group["lr"] = cfg.learning_rate * frac

            # mask is False on NEXT_STEP reset rows: they are no transitions, the loss leaves them out
            data = batch.select("obs", "action", "log_prob", "value", "advantage", "return")[batch["mask"]]
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
                    # rows collected by weights older than the ones just trained (1 with prefetch=1)
                    "charts/policy_lag": collector.policy_version - int(batch["policy_version"].min()),
                    "time/wait_s": wait_s,
                    "time/update_s": update_s,
                    **common.stats_row(interval),
                    **losses,
                }
            )
            progress.update(batch_steps)
            progress.set_postfix_str(f"mean_return={recent.mean:.1f} {common.shares_text(interval)}", refresh=False)
            if cfg.stop_return is not None and recent.mean >= cfg.stop_return:
                break
            waited_from = time.perf_counter()
    progress.close()
    if cfg.backend == "thread":
        envs.close()
    state = {"config": dataclasses.asdict(cfg), "model": agent.state_dict(), "iteration": iteration}
    torch.save(state | {"episodes": recent.episodes}, run_dir / "checkpoint.pt")  # for ppo_resume.py --eval
    common.report_stats(collector, run_dir, title=f"PPO on {cfg.env_id}, seed {cfg.seed}", window=cfg.return_window)
    print(f"run folder: {run_dir} ({time.perf_counter() - start:.1f} s)")
    print(f"final mean return (last {len(recent.returns)} episodes): {recent.mean:.1f}")
    return recent.mean


def log_episodes(
    logger: common.Logger, finished: torch.Tensor, returns: torch.Tensor, lengths: torch.Tensor, *, step: int
) -> None:
    """TensorBoard's charts/episodic_return and _length, as CleanRL's: one point at the env step each ended;
    `finished` [T, N] marks the ends in a batch whose first row follows env step `step`."""
    if logger.tb is None:
        return
    ends = step + (finished.nonzero()[:, 0] + 1) * finished.shape[1]  # [E]
    for end, episode_return, length in zip(ends.tolist(), returns.tolist(), lengths.tolist()):
        logger.tb.add_scalar("charts/episodic_return", episode_return, end)
        logger.tb.add_scalar("charts/episodic_length", length, end)


def update(
    agent: Agent, optimizer: torch.optim.Optimizer, data: TensorDict, cfg: Config, shuffle_gen: torch.Generator
) -> dict[str, float]:
    """PPO's clipped-objective epochs over one batch of transitions `data` [B]."""
    size = data.shape[0]
    minibatch_size = math.ceil(size / cfg.num_minibatches)
    clip_frac, updates = torch.zeros((), device=data.device), 0
    for _ in range(cfg.update_epochs):
        order = torch.randperm(size, device=data.device, generator=shuffle_gen)
        for begin in range(0, size, minibatch_size):
            mb = data[order[begin : begin + minibatch_size]]
            log_prob, entropy, value = agent.evaluate(mb)
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
            nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()
        if cfg.target_kl is not None and approx_kl > cfg.target_kl:
            break
    ret, val = data["return"], data["value"]
    explained_var = 1 - (ret - val).var() / ret.var() if ret.var() > 0 else torch.tensor(math.nan)
    losses = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_loss, "approx_kl": approx_kl}
    losses = {f"losses/{key}": value.item() for key, value in losses.items()}
    return {**losses, "losses/clip_frac": clip_frac.item() / updates, "losses/explained_variance": explained_var.item()}


# ---------------------------------------------------------------------------- evaluation


def evaluate(checkpoint: str | Path, overrides: Sequence[str] = ()) -> tuple[float, float]:
    """`--eval CHECKPOINT`: `eval_episodes` episodes of its agent, one per sub-env, each action the most likely
    one (later, autoreset episodes are ignored); returns the mean return and its std."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    cfg = load_config(None, overrides, base=state["config"])
    torch.set_num_threads(cfg.torch_threads)
    envs = make_envs(dataclasses.replace(cfg, device="cpu"), cfg.eval_episodes)  # on the CPU, as the agent
    agent = Agent(envs.single_observation_space, envs.single_action_space, cfg)
    agent.load_state_dict(state["model"])
    returns, finished = np.zeros(cfg.eval_episodes), np.zeros(cfg.eval_episodes, dtype=bool)
    obs, _ = envs.reset(seed=cfg.seed + 10_000)  # episodes unseen in training
    while not finished.all():
        with torch.no_grad():
            action = agent.actor(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1)
        obs, reward, terminated, truncated, _ = envs.step(action if isinstance(obs, torch.Tensor) else action.numpy())
        returns += np.where(finished, 0.0, np.asarray(reward))
        finished |= np.asarray(terminated | truncated)
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
