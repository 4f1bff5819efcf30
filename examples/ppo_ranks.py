"""Data-parallel PPO: ppo.py on K processes (ranks) under torchrun, a collector each, gradients averaged.

Under `torchrun --nproc_per_node K examples/ppo_ranks.py ...` each rank runs this script with a collector of its
own. Its envs are seeded from its rank's own part of the seed stream (an int seed is keyed by the rank of the
process group: docs/data-parallel.md), every rank starts from the same weights (the same torch seed), and each
optimizer step averages the gradients of all ranks, so the weights stay equal. A batch is then K * T * N
transitions. Rank 0 alone logs and writes the checkpoints, with every rank's own part (its collector's seed stream,
its action sampling, its episodes), which `--resume` under as many ranks carries on. Read ppo.py first: this is
that script, changed where ranks need it. Plain `python examples/ppo_ranks.py` runs one rank.

Usage::

    torchrun --standalone --nproc_per_node 2 examples/ppo_ranks.py backend=thread   # 2 ranks on this machine
    torchrun --standalone --nproc_per_node 2 examples/ppo_ranks.py --resume runs/ppo_CartPole-v1_seed1/checkpoint.pt
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from tensordict import TensorDict
from torch.distributions import Categorical

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when imported from elsewhere
import common  # noqa: E402
from common import ConfigError  # noqa: E402

from torch_rollout import GAE, Collector, Processes, start_workers_early  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "ppo_cartpole.yaml"


@dataclasses.dataclass
class Config:
    """PPO hyperparameters: ppo.py's, per rank, and the checkpoints'; a field's comment is its --help."""

    # the run
    exp_name: str = "ppo"  # first part of the run folder's name
    run_dir: str | None = None  # output folder; None: runs/<exp_name>_<env_id>_seed<seed>
    seed: int = 1  # seeds the agent's init, the env resets, action sampling and minibatch order
    device: str | None = None  # where the agent and the batches live; None: cuda if available
    torch_threads: int = 1  # intra-op threads for torch; set_num_threads is process-wide

    # environments
    env_id: str = "CartPole-v1"  # a gymnasium id with a flat Box observation and Discrete actions
    num_envs: int = 4  # parallel envs (N) of each rank, in one gymnasium SyncVectorEnv

    # collection and PPO
    total_timesteps: int = 500_000  # env transitions to collect (all envs of all ranks together)
    num_steps: int = 128  # steps per env per batch (T); a batch holds T * N transitions
    backend: str = "auto"  # where collection runs: "process", "thread", or "auto" (processes for a CPU agent)
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

    # logging and checkpoints
    return_window: int = 20  # episodes of each rank in the reported mean return
    checkpoint_every: int = 10  # iterations between checkpoints that --resume carries on from; 0: only at the end


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, base: dict | None = None) -> Config:
    """A Config from `base` (a checkpoint's), the YAML file at `path`, then `key=value` overrides (common.py)."""
    return common.load_config(Config, path, overrides, base=base)


def make_envs(cfg: Config, num_envs: int) -> gym.vector.VectorEnv:
    """gymnasium's SyncVectorEnv of env_id."""
    return gym.make_vec(cfg.env_id, num_envs, "sync")


# ---------------------------------------------------------------------------- agent


def layer(in_features: int, out_features: int, std: float = math.sqrt(2)) -> nn.Linear:
    """A linear layer with CleanRL's init: orthogonal weights of gain `std`, zero bias."""
    linear = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(linear.weight, std)
    nn.init.zeros_(linear.bias)
    return linear


class Agent(nn.Module):
    """ppo.py's actor-critic MLP with a Categorical policy."""

    def __init__(self, obs_space: gym.spaces.Space, action_space: gym.spaces.Space, cfg: Config) -> None:
        super().__init__()
        obs_dim, h, n = int(np.prod(obs_space.shape)), cfg.hidden_size, int(action_space.n)
        self.actor = nn.Sequential(layer(obs_dim, h), nn.Tanh(), layer(h, h), nn.Tanh(), layer(h, n, 0.01))
        self.critic = nn.Sequential(layer(obs_dim, h), nn.Tanh(), layer(h, h), nn.Tanh(), layer(h, 1, 1.0))

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The collector's policy: samples actions for obs [N, obs_dim]."""
        pi = Categorical(logits=self.actor(obs), validate_args=False)
        action = pi.sample()
        return {"action": action, "log_prob": pi.log_prob(action), "value": self.critic(obs).squeeze(-1)}

    def evaluate(self, mb: TensorDict) -> tuple[torch.Tensor, ...]:
        """log_prob, entropy and value of the minibatch's actions under the current weights, for the loss."""
        pi = Categorical(logits=self.actor(mb["obs"]), validate_args=False)
        return pi.log_prob(mb["action"]), pi.entropy(), self.critic(mb["obs"]).squeeze(-1)


# ---------------------------------------------------------------------------- the ranks


def init_distributed(device: torch.device, resume: dict[str, Any] | None) -> tuple[int, int, torch.device]:
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
    if resume is not None and resume["world_size"] != world_size:
        raise ConfigError(
            f"--resume: the checkpoint's run had {resume['world_size']} ranks, this one has {world_size}; "
            f"resume it with as many (torchrun --nproc_per_node {resume['world_size']}, or plain python for 1)"
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


class RankReturns(common.RecentReturns):
    """The mean return of each rank's last `window` episodes, and the count of episodes, of all ranks: every rank
    calls `add` once per batch."""

    def add(self, returns: torch.Tensor) -> None:
        self.returns.extend(returns.tolist())
        totals = torch.tensor([len(returns), sum(self.returns), len(self.returns)], dtype=torch.float64)
        ended, total, count = sum_over_ranks(totals).tolist()
        self.mean = total / count if count else self.mean
        self.episodes += int(ended)


def average_gradients(module: nn.Module) -> None:
    """Replaces each gradient by its mean over the ranks, all of them in one all_reduce; nothing in a single process."""
    if not dist.is_initialized():
        return
    grads = [p.grad for p in module.parameters()]
    mean = mean_over_ranks(torch.cat([g.reshape(-1) for g in grads]))
    for grad, part in zip(grads, mean.split([g.numel() for g in grads])):
        grad.copy_(part.view_as(grad))


def save_checkpoint(path: Path, state: dict[str, Any], own: dict[str, Any]) -> None:
    """Writes `state` and this rank's `own` part; every rank calls it and rank 0 writes all parts. A Ctrl-C or a crash
    in the middle of writing leaves the last good checkpoint as it was."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    ranks = [None] * world_size if is_main else None
    if dist.is_initialized():
        dist.gather_object(own, ranks, dst=0)
    if is_main:
        torch.save({**state, "world_size": world_size, "ranks": ranks}, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)


def load_resume(checkpoint: str, overrides: Sequence[str]) -> tuple[Config, dict[str, Any]]:
    """`--resume CHECKPOINT`: the config to carry the run on with (the checkpoint's, then `overrides`) and the state."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if "ranks" not in state:
        raise ConfigError(f"--resume {checkpoint}: not a checkpoint of examples/ppo_ranks.py")
    cfg = load_config(None, overrides, base={**state["config"], "run_dir": str(Path(checkpoint).resolve().parent)})
    done = state["iteration"] * cfg.num_envs * cfg.num_steps * state["world_size"]
    if done >= cfg.total_timesteps:
        raise ConfigError(
            f"--resume {checkpoint}: the run is complete ({done} steps of total_timesteps="
            f"{cfg.total_timesteps}); pass a larger total_timesteps=... to carry on"
        )
    return cfg, state


# ---------------------------------------------------------------------------- training
LOG_FIELDS = ["step", "wall_time", "charts/mean_return", "charts/episodes", "charts/SPS", "charts/learning_rate"]
LOG_FIELDS += ["losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl", *common.STATS_FIELDS]


def build(cfg: Config, device: torch.device, rank: int, total_timesteps: int, resume: dict[str, Any] | None):
    """This rank's envs, agent, optimizer, minibatch shuffler and collector; with `resume`, where the checkpoint left
    them (the rank's own part: its collector's seed stream and its action sampling)."""
    if cfg.backend == "thread":
        envs = spaces = make_envs(cfg, cfg.num_envs)
    else:  # each worker builds its share of the envs from this picklable recipe
        envs, spaces = functools.partial(make_envs, cfg), make_envs(cfg, 1)
        spaces.close()
    agent = Agent(spaces.single_observation_space, spaces.single_action_space, cfg).to(device)  # every rank alike
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, fused=True)
    shuffle_gen = torch.Generator(device).manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed + rank)  # each rank samples its own actions (the thread samples from this)
    collector = Collector(
        envs,
        agent,
        num_steps=cfg.num_steps,
        num_envs=cfg.num_envs,
        gae=GAE(cfg.gamma, cfg.gae_lambda),
        device=device,
        total_timesteps=total_timesteps,
        prefetch=cfg.prefetch,
        seed=cfg.seed,  # keyed by the rank: the ranks' envs start different episodes
        backend=Processes(1) if cfg.backend == "process" else cfg.backend,
    )
    if resume is not None:
        own = resume["ranks"][rank]
        agent.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        shuffle_gen.set_state(resume["shuffle_rng"])
        torch.set_rng_state(own["torch_rng"])
        collector.load_state_dict(own["collector"])
    return envs, agent, optimizer, shuffle_gen, collector


def train(cfg: Config, resume: dict[str, Any] | None = None) -> float:
    """Trains this rank as configured, or carries it on from a checkpoint `resume`; returns the final mean return."""
    start = time.perf_counter()
    if cfg.backend in ("process", "auto"):  # their fork server imports torch now, while the agent is built
        start_workers_early()
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)  # the same on every rank: the same initial weights
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank, world_size, device = init_distributed(device, resume)
    run_dir = common.make_run_dir(cfg, write=rank == 0)
    batch_steps = cfg.num_envs * cfg.num_steps * world_size  # transitions per iteration, all ranks
    num_iterations = math.ceil(cfg.total_timesteps / batch_steps)
    done_iterations = iteration = 0 if resume is None else resume["iteration"]
    own = {"recent_returns": ()} if resume is None else resume["ranks"][rank]
    recent = RankReturns(cfg.return_window, own["recent_returns"], 0 if resume is None else resume["episodes"])
    # as many batches on every rank
    total = num_iterations * cfg.num_envs * cfg.num_steps
    envs, agent, optimizer, shuffle_gen, collector = build(cfg, device, rank, total, resume)

    def checkpoint() -> None:
        """checkpoint.pt: every rank calls it with its own part; rank 0 writes it."""
        state = {"config": dataclasses.asdict(cfg), "model": agent.state_dict(), "iteration": iteration}
        state |= {
            "optimizer": optimizer.state_dict(),
            "shuffle_rng": shuffle_gen.get_state(),
            "episodes": recent.episodes,
        }
        mine = {"collector": collector.state_dict(), "torch_rng": torch.get_rng_state()}
        save_checkpoint(run_dir / "checkpoint.pt", state, mine | {"recent_returns": list(recent.returns)})

    intervals = common.Intervals(collector)
    resume_step = done_iterations * batch_steps if resume else None
    logger = common.Logger(run_dir, LOG_FIELDS, resume_step=resume_step) if rank == 0 else None
    with collector:
        for iteration, batch in enumerate(collector, start=done_iterations + 1):
            recent.add(batch["episode_return"][batch["done"] & batch["mask"]])  # of all ranks
            for group in optimizer.param_groups:  # annealed linearly to 0 over the run
                group["lr"] = cfg.learning_rate * (1 - (iteration - 1) / num_iterations * cfg.anneal_lr)
            data = batch.select("obs", "action", "log_prob", "value", "advantage", "return")[batch["mask"]]
            losses = update(agent, optimizer, data, cfg, shuffle_gen)
            if logger is not None:  # rank 0 logs the steps of all ranks
                step, elapsed = iteration * batch_steps, time.perf_counter() - start
                logger.log(
                    {
                        "step": step,
                        "wall_time": elapsed,
                        "charts/mean_return": recent.mean,
                        "charts/episodes": recent.episodes,
                        "charts/SPS": (step - done_iterations * batch_steps) / elapsed,
                        "charts/learning_rate": optimizer.param_groups[0]["lr"],
                        **common.stats_row(intervals.take()),
                        **losses,
                    }
                )
            if cfg.checkpoint_every and iteration % cfg.checkpoint_every == 0:
                checkpoint()
    if cfg.backend == "thread":
        envs.close()
    checkpoint()
    if dist.is_initialized():
        dist.destroy_process_group()  # the last collective was the checkpoint's
    if logger is not None:
        logger.close()
        common.report_stats(
            collector, run_dir, title=f"PPO on {cfg.env_id}, {world_size} ranks", window=cfg.return_window
        )
        print(f"run folder: {run_dir} ({time.perf_counter() - start:.1f} s)")
        of_ranks = f" of each of {world_size} ranks" if world_size > 1 else ""
        print(f"final mean return (last {len(recent.returns)} episodes{of_ranks}): {recent.mean:.1f}")
    return recent.mean


def update(
    agent: Agent, optimizer: torch.optim.Optimizer, data: TensorDict, cfg: Config, shuffle_gen: torch.Generator
) -> dict[str, float]:
    """ppo.py's update, every rank stepping with the mean gradient of all ranks."""
    size = data.shape[0]
    # From M * (M - 1) transitions on there are exactly M minibatches: every rank takes as many optimizer steps,
    # whatever its mask left of its batch (fewer steps on one rank would leave the others waiting).
    if dist.is_initialized() and size < cfg.num_minibatches * (cfg.num_minibatches - 1):
        raise RuntimeError(
            f"a rank's batch has {size} transitions, too few for num_minibatches={cfg.num_minibatches} under "
            "torchrun: collect more per rank (num_envs * num_steps) or use fewer minibatches"
        )
    minibatch_size = math.ceil(size / cfg.num_minibatches)
    for _ in range(cfg.update_epochs):
        order = torch.randperm(size, device=data.device, generator=shuffle_gen)
        for begin in range(0, size, minibatch_size):
            mb = data[order[begin : begin + minibatch_size]]
            log_prob, entropy, value = agent.evaluate(mb)
            log_ratio = log_prob - mb["log_prob"]  # against the weights that acted: the lag of prefetch=1
            ratio = log_ratio.exp()
            with torch.no_grad():
                approx_kl = ((ratio - 1) - log_ratio).mean()  # k3 estimator: unbiased, >= 0
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
            average_gradients(agent)  # every rank steps with the mean gradient: the weights stay equal
            nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()
        if cfg.target_kl is not None and mean_over_ranks(approx_kl) > cfg.target_kl:  # all ranks stop together
            break
    losses = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_loss, "approx_kl": approx_kl}
    return {f"losses/{key}": value.item() for key, value in losses.items()}


def main(argv: list[str] | None = None) -> None:
    """The command line: train, or `--resume CHECKPOINT`, with KEY=VALUE overrides."""
    parser = common.make_parser(__doc__, Config, DEFAULT_CONFIG)
    parser.add_argument("--resume", metavar="CHECKPOINT", default=None, help="carry on the run of a checkpoint")
    args = parser.parse_args(argv)
    try:
        if args.resume is not None:
            train(*load_resume(args.resume, args.overrides))
        else:
            train(load_config(args.config or DEFAULT_CONFIG, args.overrides))
    except ConfigError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
