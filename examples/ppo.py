"""PPO on top of torch_rollout, read top to bottom: config, env factory, agent, then the collector and the update.

The collector steps the envs and runs the policy in worker processes (or a background thread), so the next
batch is being collected while this script updates the agent on the current one. The plumbing (config files,
`--help`, the run folder, TensorBoard, videos, `--eval`, `--resume`, torchrun) is in common.py beside it.

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
from torch.distributions import Categorical, Distribution, Independent, Normal

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when imported from elsewhere
import common  # noqa: E402
from common import ConfigError, to_sequences  # noqa: E402

from torch_rollout import GAE, BatchKeys, Collector  # noqa: E402

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


def make_envs(cfg: Config, num_envs: int, *, training: bool = True, video: Path | None = None) -> gym.vector.VectorEnv:
    """The env_recipe's envs, a vector env of torch tensors on the agent's device (env_id torch_rollout/...), or
    gymnasium's NumPy envs with the config's wrappers (common.gym_envs); `training=False` (--eval): raw rewards."""
    if cfg.env_recipe is not None:  # e.g. sims/isaaclab_setup.py's Isaac Lab envs
        common.check_numpy_only(cfg, video)
        return common.recipe(cfg.env_recipe, "env_recipe")(num_envs, seed=cfg.seed)
    if cfg.env_id.startswith("torch_rollout/"):
        common.check_numpy_only(cfg, video)
        return gym.make_vec(cfg.env_id, num_envs=num_envs, device=common.agent_device(cfg.device))
    return common.gym_envs(cfg, num_envs, training=training, video=video)


# ---------------------------------------------------------------------------- agent
def layer(in_features: int, out_features: int, std: float = math.sqrt(2)) -> nn.Linear:
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
        obs_dim, h, act = int(np.prod(obs_space.shape)), cfg.hidden_size, common.activation(cfg.activation)
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
        features, next_state = self.step(obs, state)
        return super().act_deterministic(features)[0], TensorDict(next_state, batch_size=state.batch_size)


def make_agent(obs_space: gym.spaces.Box, action_space: gym.spaces.Space, cfg: Config) -> Agent:
    return (RecurrentAgent if cfg.lstm_size > 0 else Agent)(obs_space, action_space, cfg)


# ---------------------------------------------------------------------------- training
LOG_FIELDS = ["step", "wall_time", "charts/mean_return", "charts/episodes", "charts/SPS", "charts/learning_rate"]
LOG_FIELDS += ["charts/policy_lag", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"]
LOG_FIELDS += ["losses/clip_frac", "losses/explained_variance", "time/wait_s", "time/update_s", *common.STATS_FIELDS]


def train(cfg: Config, resume: dict[str, Any] | None = None) -> float:
    """Trains PPO as configured, or carries on from a checkpoint `resume`; returns the final mean return.

    Under torchrun this is one rank of a data-parallel run (common.py's torchrun section says how).
    """
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)  # the same on every rank: the same initial weights
    # torchrun's process group, the run folder, the log, checkpoints and --resume: common.Run
    run = common.Run(cfg, common.agent_device(cfg.device), LOG_FIELDS, script=__file__, resume=resume)
    if cfg.backend == "thread":
        envs = spaces = make_envs(cfg, cfg.num_envs)
    else:  # each worker builds its share of the envs from this picklable recipe
        envs, spaces = functools.partial(make_envs, cfg), make_envs(cfg, 1)
        spaces.close()
    agent = make_agent(spaces.single_observation_space, spaces.single_action_space, cfg).to(run.device)
    recurrent = isinstance(agent, RecurrentAgent)
    if recurrent and cfg.num_steps % cfg.bptt_steps:
        raise ConfigError(f"bptt_steps={cfg.bptt_steps} must divide num_steps={cfg.num_steps}")
    # fused: one kernel for all parameters instead of a loop over them (an update 8% faster on the CPU here)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, fused=True)
    # the collector thread samples actions from torch's global generator; shuffling
    # minibatches from a generator of our own keeps that stream in a fixed order
    shuffle_gen = torch.Generator(run.device).manual_seed(cfg.seed)
    if run.world_size > 1:
        torch.manual_seed(cfg.seed + run.rank)  # each rank samples its own actions (the thread samples from this)
    run.track(agent, optimizer, shuffle_gen, envs)  # what the checkpoints hold; with --resume, restored here
    collector = Collector(
        envs,
        agent,
        num_steps=cfg.num_steps,
        num_envs=cfg.num_envs,
        gae=GAE(cfg.gamma, cfg.gae_lambda),
        device=run.device,
        total_timesteps=run.num_iterations * cfg.num_envs * cfg.num_steps,  # as many batches on every rank
        prefetch=cfg.prefetch,
        seed=cfg.seed,  # under torchrun keyed by the rank: the ranks' envs start different episodes
        backend=common.placement(cfg.backend, cfg.num_workers),
        initial_state=agent.initial_state if recurrent else None,
        # the env's own returns, beneath NormalizeReward (see make_envs); else episode_return is that
        keys=BatchKeys(info_keys=("episode",) if cfg.normalize_reward else None),
    )
    with run, collector:  # Ctrl-C: the command that carries the run on from its last checkpoint
        for iteration, batch in run.iterate(collector):  # batch: TensorDict [T, N]
            run.log_episodes(batch)  # the returns of the episodes that ended in it, for the mean return

            lr = cfg.learning_rate * (1 - (iteration - 1) / run.num_iterations) if cfg.anneal_lr else cfg.learning_rate
            for group in optimizer.param_groups if cfg.desired_kl is None else ():  # desired_kl: update() adapts it
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
            # rows collected by weights older than the ones just trained (1 with prefetch=1)
            lag = collector.policy_version - int(batch["policy_version"].min())
            lr = optimizer.param_groups[0]["lr"]  # with desired_kl, as update() left it
            run.log({"charts/learning_rate": lr, "charts/policy_lag": lag, "time/update_s": update_s, **stats})
            if cfg.stop_return is not None and run.recent.mean >= cfg.stop_return:
                break
    if cfg.backend == "thread":
        envs.close()
    # the last checkpoint and the plot; with capture_video, an evaluation episode of the final weights, to watch
    return run.finish(f"PPO on {cfg.env_id}, seed {cfg.seed}", evaluate=evaluate if cfg.capture_video else None)


def update(
    agent: Agent, optimizer: torch.optim.Optimizer, data: TensorDict, cfg: Config, shuffle_gen: torch.Generator
) -> dict[str, float]:
    """PPO's clipped-objective epochs over one batch `data`: transitions [B] or sequences [S, L], with `mask`."""
    size = data.shape[0]
    minibatch_size = math.ceil(size / cfg.num_minibatches)
    common.check_rank_minibatches(size, cfg.num_minibatches)  # under torchrun: as many steps on every rank
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
                common.adapt_learning_rate(optimizer, common.mean_over_ranks(approx_kl).item(), cfg.desired_kl)

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
            common.average_gradients(agent)  # under torchrun: every rank steps with the mean gradient
            nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()
        if cfg.target_kl is not None and common.mean_over_ranks(approx_kl) > cfg.target_kl:  # all ranks stop together
            break
    ret, val = data["return"][data["mask"]], data["value"][data["mask"]]
    explained_var = 1 - (ret - val).var() / ret.var() if ret.var() > 0 else torch.tensor(math.nan)
    losses = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_loss, "approx_kl": approx_kl}
    losses = {f"losses/{key}": value.item() for key, value in losses.items()}
    return {**losses, "losses/clip_frac": clip_frac.item() / updates, "losses/explained_variance": explained_var.item()}


def evaluate(checkpoint: str | Path, overrides: Sequence[str] = ()) -> tuple[float, float]:
    """Runs `eval_episodes` deterministic episodes of a checkpoint (capture_video: the first one recorded)."""
    return common.evaluate(checkpoint, overrides, load_config, make_envs, make_agent)


def main(argv: list[str] | None = None) -> None:
    parser, args = common.parse_args(__doc__, Config, DEFAULT_CONFIG, argv, checkpoints=True)
    try:
        if args.eval is not None:
            evaluate(args.eval, args.overrides)
        elif args.resume is not None:
            train(*common.load_resume(args.resume, args.overrides, load_config))
        else:
            train(load_config(args.config or DEFAULT_CONFIG, args.overrides))
    except ConfigError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
