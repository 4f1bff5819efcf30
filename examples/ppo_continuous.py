"""PPO for continuous control: ppo.py with a Gaussian policy and gymnasium's normalising wrappers on the envs.

Joint positions and velocities differ by orders of magnitude and returns grow into the thousands (HalfCheetah-v5),
so the envs normalise observations and scale rewards by running statistics (gymnasium's vector wrappers), and clip
the Gaussian actions to the actuators' bounds. The observation statistics go into the checkpoint, where `--eval`
reads them back; the log shows the env's own returns, recorded beneath the reward scaling (the batches' "episode"
info). It also runs rsl_rl's setting for GPU simulators: envs from a recipe with observation groups (Isaac Lab),
ELU layers and the adaptive learning rate (`desired_kl`). Read ppo.py first: this is that script, changed there.

Usage::

    pip install "gymnasium[mujoco]"                          # in the venv, for HalfCheetah-v5
    python examples/ppo_continuous.py                        # configs/ppo_halfcheetah.yaml
    python examples/ppo_continuous.py env_id=Pendulum-v1 total_timesteps=200000
    python examples/ppo_continuous.py --config configs/ppo_isaac_cartpole.yaml   # Isaac Lab's cartpole (its venv)
    python examples/ppo_continuous.py --eval runs/ppo_HalfCheetah-v5_seed1/checkpoint.pt   # with its statistics
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from tensordict import TensorDict
from torch.distributions import Independent, Normal
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when imported from elsewhere
import common  # noqa: E402
from common import ConfigError  # noqa: E402

from torch_rollout import GAE, BatchKeys, Collector, Processes, Ray, start_workers_early  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "ppo_halfcheetah.yaml"


@dataclasses.dataclass
class Config:
    """PPO hyperparameters: CleanRL's ppo_continuous_action.py, tuned per env by the YAML files."""

    # the run
    exp_name: str = "ppo"  # first part of the run folder's name
    run_dir: str | None = None  # output folder; None: runs/<exp_name>_<env_id>_seed<seed>
    seed: int = 1  # seeds the agent's init, the env resets, action sampling and minibatch order
    device: str | None = None  # where the agent and the batches live; None: cuda if available
    torch_threads: int = 1  # intra-op threads for torch; set_num_threads is process-wide

    # environments
    env_id: str = "HalfCheetah-v5"  # a gymnasium id with a flat Box observation and Box actions
    env_recipe: str | None = None  # "module:function" building the envs as function(num_envs, seed=seed) instead
    obs_group: str | None = None  # the group of a Dict observation that actor and critic read, e.g. "policy"
    num_envs: int = 1  # parallel envs (N) in one gymnasium SyncVectorEnv
    normalize_obs: bool = False  # NormalizeObservation; its statistics go into the checkpoint
    clip_obs: float | None = None  # clip normalised observations to [-clip_obs, clip_obs]
    normalize_reward: bool = False  # NormalizeReward: divide by a running std of the discounted return
    clip_reward: float | None = None  # clip scaled rewards to [-clip_reward, clip_reward]
    clip_action: bool = False  # ClipAction on Box action spaces

    # collection and PPO
    total_timesteps: int = 1_000_000  # env transitions to collect (all envs together)
    num_steps: int = 2048  # steps per env per batch (T); a batch holds T * N transitions
    backend: str = "auto"  # where collection runs: "process", "thread", "ray", or "auto" (processes for a CPU agent)
    num_workers: int = 1  # worker processes or Ray actors; each steps num_envs / num_workers envs
    prefetch: int | None = None  # batches collected ahead of training; 0: lockstep; None: the collector's default
    learning_rate: float = 3e-4  # Adam step size at the start
    anneal_lr: bool = True  # decay the learning rate linearly to 0 over the run
    adam_eps: float = 1e-5  # Adam's epsilon
    gamma: float = 0.99  # discount factor
    gae_lambda: float = 0.95  # GAE's bias/variance trade-off
    num_minibatches: int = 32  # minibatches per epoch
    update_epochs: int = 10  # passes over each batch
    norm_adv: bool = True  # normalise advantages per minibatch
    clip_coef: float = 0.2  # PPO's ratio clip range
    clip_vloss: bool = True  # clip the value update around the stored value too
    ent_coef: float = 0.0  # entropy bonus
    vf_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 0.5  # global gradient-norm clip
    target_kl: float | None = None  # stop the epochs early once approx-KL exceeds this; None: never
    desired_kl: float | None = None  # adapt the learning rate per minibatch to keep approx-KL near this (rsl_rl's)

    # the agent
    hidden_size: int = 64  # width of the two hidden layers of actor and critic
    activation: str = "tanh"  # of the hidden layers: "tanh" (CleanRL's) or "elu" (rsl_rl's)
    init_log_std: float = 0.0  # initial log-std of the Gaussian policy

    # logging and evaluation
    return_window: int = 20  # episodes in the reported mean return
    stop_return: float | None = None  # end the run at the first batch whose mean return reaches this; None: never
    eval_episodes: int = 10  # deterministic episodes run by --eval


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, base: dict | None = None) -> Config:
    """A Config from `base` (a checkpoint's), the YAML file at `path`, then `key=value` overrides (common.py)."""
    cfg = common.load_config(Config, path, overrides, base=base)
    if cfg.desired_kl is not None and cfg.anneal_lr:
        raise ConfigError(
            "desired_kl adapts the learning rate, which anneal_lr=true would set too: add anneal_lr=false"
        )
    # the checkpoint saves the observation statistics for --eval, read from the wrapper, which must then live in
    # this process (worker processes would each keep statistics of their own)
    if cfg.normalize_obs and cfg.backend != "thread":
        raise ConfigError(f"normalize_obs needs backend=thread, got backend={cfg.backend}")
    return cfg


# ---------------------------------------------------------------------------- environments


def make_envs(cfg: Config, num_envs: int, *, training: bool = True) -> gym.vector.VectorEnv:
    """The env_recipe's envs, or gymnasium's SyncVectorEnv of env_id with the wrappers the config asks for;
    `training=False` (--eval): raw rewards, no scaling or clipping."""
    if cfg.env_recipe is not None:  # e.g. sims/isaaclab_setup.py's Isaac Lab envs, tensors on their device
        if cfg.normalize_obs or cfg.normalize_reward or cfg.clip_action:
            raise ConfigError(f"{cfg.env_id}: normalize_obs, normalize_reward and clip_action are for NumPy envs")
        return recipe(cfg.env_recipe, "env_recipe")(num_envs, seed=cfg.seed)
    envs = gym.make_vec(cfg.env_id, num_envs, "sync")
    if cfg.normalize_reward and training:
        # NormalizeReward rescales what the collector sees, so its episode_return is no longer the env's return:
        # record the raw returns beneath the scaling (the "episode" info)
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


def obs_statistics(envs: Any) -> gym.wrappers.vector.NormalizeObservation | None:
    """The NormalizeObservation wrapper in the chain, or None (also for a recipe of envs that workers build)."""
    while not isinstance(envs, gym.wrappers.vector.NormalizeObservation):
        envs = getattr(envs, "env", None)
        if envs is None:
            return None
    return envs


# ---------------------------------------------------------------------------- agent


ACTIVATIONS = {"tanh": nn.Tanh, "elu": nn.ELU}


def layer(in_features: int, out_features: int, std: float = math.sqrt(2)) -> nn.Linear:
    """A linear layer with CleanRL's init: orthogonal weights of gain `std`, zero bias."""
    linear = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(linear.weight, std)
    nn.init.zeros_(linear.bias)
    return linear


class Agent(nn.Module):
    """Actor-critic MLP with a diagonal Gaussian policy of a state-independent log-std, as the PPO paper's MuJoCo
    runs; with obs_group, it reads that group of a Dict observation."""

    def __init__(self, obs_space: gym.spaces.Space, action_space: gym.spaces.Space, cfg: Config) -> None:
        super().__init__()
        if cfg.activation not in ACTIVATIONS:
            raise ConfigError(f"activation={cfg.activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        if not isinstance(action_space, gym.spaces.Box):
            raise ConfigError(f"{cfg.env_id}: ppo_continuous.py takes Box actions, got {action_space}; see ppo.py")
        self.group = cfg.obs_group
        obs_space = obs_space if self.group is None else obs_space[self.group]
        obs_dim, act_dim, h, act = (
            int(np.prod(obs_space.shape)),
            int(np.prod(action_space.shape)),
            cfg.hidden_size,
            ACTIVATIONS[cfg.activation],
        )
        # a small last-layer gain keeps the initial policy's mean near zero
        self.actor = nn.Sequential(layer(obs_dim, h), act(), layer(h, h), act(), layer(h, act_dim, 0.01))
        self.critic = nn.Sequential(layer(obs_dim, h), act(), layer(h, h), act(), layer(h, 1, 1.0))
        self.log_std = nn.Parameter(torch.full((act_dim,), cfg.init_log_std))

    def dist(self, obs: Any) -> Independent:
        """The action distribution for `obs` [B, obs_dim] (or its obs_group)."""
        mean = self.actor(obs if self.group is None else obs[self.group])
        return Independent(Normal(mean, self.log_std.exp(), validate_args=False), 1)

    def value(self, obs: Any) -> torch.Tensor:
        return self.critic(obs if self.group is None else obs[self.group]).squeeze(-1)

    def forward(self, obs: Any) -> dict[str, torch.Tensor]:
        """The collector's policy: samples actions for obs [N, obs_dim]; the collector clips them for the env."""
        dist = self.dist(obs)
        action = dist.sample()  # [N, act_dim]
        return {"action": action, "log_prob": dist.log_prob(action), "value": self.value(obs)}

    def evaluate(self, mb: TensorDict) -> tuple[torch.Tensor, ...]:
        """log_prob, entropy and value of the minibatch's actions under the current weights, for the loss."""
        dist = self.dist(mb["obs"])
        return dist.log_prob(mb["action"]), dist.entropy(), self.value(mb["obs"])


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
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run_dir = common.make_run_dir(cfg)
    batch_steps = cfg.num_envs * cfg.num_steps
    num_iterations = math.ceil(cfg.total_timesteps / batch_steps)

    if cfg.backend == "thread":
        envs = spaces = make_envs(cfg, cfg.num_envs)
    else:  # each worker builds its share of the envs from this picklable recipe
        envs, spaces = functools.partial(make_envs, cfg), make_envs(cfg, 1)
        spaces.close()
    agent = Agent(spaces.single_observation_space, spaces.single_action_space, cfg).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, fused=True)
    shuffle_gen = torch.Generator(device).manual_seed(cfg.seed)
    backend = {"process": Processes, "ray": Ray}.get(cfg.backend)
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
        backend=cfg.backend if backend is None else backend(cfg.num_workers),
        # the env's own returns beneath NormalizeReward (see make_envs); else episode_return is that
        keys=BatchKeys(info_keys=("episode",) if cfg.normalize_reward else None),
    )
    recent, intervals = common.RecentReturns(cfg.return_window), common.Intervals(collector)
    progress = tqdm(total=num_iterations * batch_steps, unit="step", mininterval=1 if sys.stderr.isatty() else 30)
    with collector, common.Logger(run_dir, LOG_FIELDS) as logger:
        common.print_collector(collector)  # which placement backend=auto chose
        waited_from = time.perf_counter()
        for iteration, batch in enumerate(collector, start=1):  # batch: TensorDict [T, N], GAE included
            wait_s = time.perf_counter() - waited_from
            if cfg.normalize_reward:  # the env's own returns, beneath NormalizeReward
                finished = batch["info", "_episode"]
                recent.add(batch["info", "episode", "r"][finished])
            else:
                recent.add(batch["episode_return"][batch["done"] & batch["mask"]])
            if cfg.desired_kl is None:  # with desired_kl, update() adapts the learning rate
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
                    "charts/learning_rate": optimizer.param_groups[0]["lr"],  # with desired_kl, as adapted
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
    obs_norm = obs_statistics(envs)  # --eval normalises observations as the agent saw them in training
    rms = None if obs_norm is None else obs_norm.obs_rms
    state = {"config": dataclasses.asdict(cfg), "model": agent.state_dict(), "iteration": iteration}
    state["obs_rms"] = rms and {"mean": torch.as_tensor(rms.mean), "var": torch.as_tensor(rms.var), "count": rms.count}
    torch.save(state, run_dir / "checkpoint.pt")
    if cfg.backend == "thread":
        envs.close()
    common.report_stats(collector, run_dir, title=f"PPO on {cfg.env_id}, seed {cfg.seed}", window=cfg.return_window)
    print(f"run folder: {run_dir} ({time.perf_counter() - start:.1f} s)")
    print(f"final mean return (last {len(recent.returns)} episodes): {recent.mean:.1f}")
    return recent.mean


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
            log_ratio = log_prob - mb["log_prob"]  # against the weights that acted: the lag of prefetch=1
            ratio = log_ratio.exp()
            with torch.no_grad():
                approx_kl = ((ratio - 1) - log_ratio).mean()  # k3 estimator: unbiased, >= 0
                clip_frac += ((ratio - 1).abs() > cfg.clip_coef).float().mean()
                updates += 1
            if cfg.desired_kl is not None:
                adapt_learning_rate(optimizer, approx_kl.item(), cfg.desired_kl)

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


# ---------------------------------------------------------------------------- evaluation


def evaluate(checkpoint: str | Path, overrides: Sequence[str] = ()) -> tuple[float, float]:
    """`--eval CHECKPOINT`: `eval_episodes` episodes of its agent, one per sub-env, each action the Gaussian's mean,
    with the observation statistics of training, frozen, and raw rewards; returns the mean return and its std."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    cfg = load_config(None, overrides, base=state["config"])
    torch.set_num_threads(cfg.torch_threads)
    envs = make_envs(dataclasses.replace(cfg, device="cpu"), cfg.eval_episodes, training=False)
    obs_norm, saved = obs_statistics(envs), state["obs_rms"]
    if obs_norm is not None and saved is not None:
        obs_norm.obs_rms.mean, obs_norm.obs_rms.var = saved["mean"].numpy(), saved["var"].numpy()
        obs_norm.obs_rms.count = saved["count"]
        obs_norm.update_running_mean = False
    agent = Agent(envs.single_observation_space, envs.single_action_space, cfg)
    agent.load_state_dict(state["model"])
    space = envs.single_action_space
    returns, finished = np.zeros(cfg.eval_episodes), np.zeros(cfg.eval_episodes, dtype=bool)
    obs, _ = envs.reset(seed=cfg.seed + 10_000)  # episodes unseen in training
    while not finished.all():
        with torch.no_grad():
            action = agent.dist(torch.as_tensor(obs, dtype=torch.float32)).mean.numpy()
        obs, reward, terminated, truncated, _ = envs.step(np.clip(action, space.low, space.high))
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
