"""PPO that a long run needs: ppo.py with checkpoints, Ctrl-C, `--resume` and evaluation with videos.

Every `checkpoint_every` iterations (and at the end) the run folder's checkpoint.pt gets what carrying the run on
needs: the agent and its optimizer, the random streams, the returns of recent episodes and the collector's
`state_dict()` (the batches and steps delivered, the policy version, the envs' seed stream). Ctrl-C prints the
command that carries the run on from the last checkpoint; `--resume CHECKPOINT` does it, logging again what the
stopped run logged after its checkpoint. `--eval CHECKPOINT` runs deterministic episodes of a checkpoint, and with
`capture_video=true` records the first one. Read ppo.py first: this is that script,
changed where checkpoints need it.

Usage::

    python examples/ppo_resume.py checkpoint_every=10          # Ctrl-C at any time
    python examples/ppo_resume.py --resume runs/ppo_CartPole-v1_seed1/checkpoint.pt   # carry a stopped run on
    python examples/ppo_resume.py --resume runs/ppo_CartPole-v1_seed1/checkpoint.pt total_timesteps=400000
    python examples/ppo_resume.py --eval runs/ppo_CartPole-v1_seed1/checkpoint.pt
    python examples/ppo_resume.py --eval runs/ppo_CartPole-v1_seed1/checkpoint.pt capture_video=true  # into videos/
"""

from __future__ import annotations

import dataclasses
import functools
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
import torch.nn as nn
from tensordict import TensorDict
from torch.distributions import Categorical
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when imported from elsewhere
import common  # noqa: E402
from common import ConfigError  # noqa: E402

from torch_rollout import GAE, Collector, Processes, start_workers_early  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "ppo_cartpole.yaml"


@dataclasses.dataclass
class Config:
    """PPO hyperparameters: ppo.py's, and the checkpoints'; a field's comment is its --help."""

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

    # logging, checkpoints and evaluation
    return_window: int = 20  # episodes in the reported mean return
    stop_return: float | None = None  # end the run at the first batch whose mean return reaches this; None: never
    checkpoint_every: int = 10  # iterations between checkpoints that --resume carries on from; 0: only at the end
    eval_episodes: int = 10  # deterministic episodes run by --eval
    capture_video: bool = False  # record the first --eval episode, and one after training, into <run folder>/videos


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, base: dict | None = None) -> Config:
    """A Config from `base` (a checkpoint's), the YAML file at `path`, then `key=value` overrides (common.py)."""
    cfg = common.load_config(Config, path, overrides, base=base)
    if cfg.capture_video:  # fails now if the video cannot be recorded, not after training
        check_can_record(cfg.env_id, cfg.seed)
    return cfg


# ---------------------------------------------------------------------------- environments


def make_envs(cfg: Config, num_envs: int, video: Path | None = None) -> gym.vector.VectorEnv:
    """ppo.py's envs; with `video`, the first episode of sub-env 0 is recorded to `<video>-episode-0.mp4`."""
    if cfg.env_id.startswith("torch_rollout/"):
        if video is not None:
            raise ConfigError(f"{cfg.env_id} is a vector env of torch tensors: capture_video is for gymnasium's envs")
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return gym.make_vec(cfg.env_id, num_envs=num_envs, device=device)
    if video is None:
        return gym.make_vec(cfg.env_id, num_envs, "sync")
    return gym.make_vec(cfg.env_id, num_envs, "sync", wrappers=[record_first_episode(video)], render_mode="rgb_array")


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
        dist = Categorical(logits=self.actor(obs), validate_args=False)
        action = dist.sample()
        return {"action": action, "log_prob": dist.log_prob(action), "value": self.critic(obs).squeeze(-1)}

    def evaluate(self, mb: TensorDict) -> tuple[torch.Tensor, ...]:
        """log_prob, entropy and value of the minibatch's actions under the current weights, for the loss."""
        dist = Categorical(logits=self.actor(mb["obs"]), validate_args=False)
        return dist.log_prob(mb["action"]), dist.entropy(), self.critic(mb["obs"]).squeeze(-1)


# ---------------------------------------------------------------------------- checkpoints and --resume


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Writes `state`; a Ctrl-C or a crash in the middle of writing leaves the last good checkpoint as it was."""
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def load_resume(checkpoint: str, overrides: Sequence[str]) -> tuple[Config, dict[str, Any]]:
    """`--resume CHECKPOINT`: the config to carry the run on with (the checkpoint's, then `overrides`) and the state.

    Raises:
        ConfigError: not a checkpoint of this script, or its run is complete under the config.
    """
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if "collector" not in state:
        raise ConfigError(f"--resume {checkpoint}: not a checkpoint of examples/ppo_resume.py")
    # by default the run carries on in the checkpoint's folder
    cfg = load_config(None, overrides, base={**state["config"], "run_dir": str(Path(checkpoint).resolve().parent)})
    done = state["iteration"] * cfg.num_envs * cfg.num_steps
    if done >= cfg.total_timesteps:
        raise ConfigError(
            f"--resume {checkpoint}: the run is complete ({done} steps of total_timesteps="
            f"{cfg.total_timesteps}); pass a larger total_timesteps=... to carry on"
        )
    return cfg, state


def print_resume_command(checkpoint: Path, iteration: int) -> None:
    """After a Ctrl-C: the command that carries the run on, with absolute paths, so that it works from any folder."""
    script, path = (shlex.quote(str(Path(p).resolve())) for p in (__file__, checkpoint))
    print(
        f"\ninterrupted in iteration {iteration}; carry on from the last checkpoint with:\n"
        f"  {shlex.quote(sys.executable)} {script} --resume {path}",
        file=sys.stderr,
    )


# ---------------------------------------------------------------------------- training


def build(cfg: Config, device: torch.device, total_timesteps: int, resume: dict[str, Any] | None):
    """ppo.py's envs, agent, optimizer, minibatch shuffler and collector; with `resume`, where its checkpoint left
    them: the weights, the optimizer, the random streams and the collector's counts and seed stream."""
    if cfg.backend == "thread":
        envs = spaces = make_envs(cfg, cfg.num_envs)
    else:  # each worker builds its share of the envs from this picklable recipe
        envs, spaces = functools.partial(make_envs, cfg), make_envs(cfg, 1)
        spaces.close()
    agent = Agent(spaces.single_observation_space, spaces.single_action_space, cfg).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, fused=True)
    shuffle_gen = torch.Generator(device).manual_seed(cfg.seed)
    collector = Collector(
        envs,
        agent,
        num_steps=cfg.num_steps,
        num_envs=cfg.num_envs,
        gae=GAE(cfg.gamma, cfg.gae_lambda),
        device=device,
        total_timesteps=total_timesteps,
        prefetch=cfg.prefetch,
        seed=cfg.seed,
        backend=Processes(1) if cfg.backend == "process" else cfg.backend,
    )
    if resume is not None:
        agent.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        shuffle_gen.set_state(resume["shuffle_rng"])
        torch.set_rng_state(resume["torch_rng"])
        # the step count, the policy versions and the envs' seed stream carry on (in-flight episodes restart)
        collector.load_state_dict(resume["collector"])
    return envs, agent, optimizer, shuffle_gen, collector


LOG_FIELDS = ["step", "wall_time", "charts/mean_return", "charts/episodes", "charts/SPS", "charts/learning_rate"]
LOG_FIELDS += ["charts/policy_lag", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"]
LOG_FIELDS += ["time/wait_s", "time/update_s", *common.STATS_FIELDS]


def train(cfg: Config, resume: dict[str, Any] | None = None) -> float:
    """Trains PPO as configured, or carries on from a checkpoint `resume`; returns the final mean return."""
    start = time.perf_counter()
    if cfg.backend in ("process", "auto"):  # their fork server imports torch now, while the agent is built
        start_workers_early()
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run_dir = common.make_run_dir(cfg)
    checkpoint_path = run_dir / "checkpoint.pt"
    batch_steps = cfg.num_envs * cfg.num_steps
    num_iterations = math.ceil(cfg.total_timesteps / batch_steps)
    begun = resume or {"iteration": 0, "wall_time": 0.0, "episodes": 0, "recent_returns": ()}
    done_iterations = iteration = begun["iteration"]
    recent = common.RecentReturns(cfg.return_window, begun["recent_returns"], begun["episodes"])

    envs, agent, optimizer, shuffle_gen, collector = build(cfg, device, num_iterations * batch_steps, resume)

    def checkpoint() -> None:
        """checkpoint.pt: what --eval and --resume need."""
        state = {"config": dataclasses.asdict(cfg), "model": agent.state_dict(), "iteration": iteration}
        state |= {"optimizer": optimizer.state_dict(), "shuffle_rng": shuffle_gen.get_state()}
        state |= {"torch_rng": torch.get_rng_state(), "collector": collector.state_dict()}
        state |= {"episodes": recent.episodes, "recent_returns": list(recent.returns)}
        save_checkpoint(checkpoint_path, state | {"wall_time": begun["wall_time"] + time.perf_counter() - start})

    intervals = common.Intervals(collector)
    progress = tqdm(
        total=num_iterations * batch_steps,
        initial=done_iterations * batch_steps,
        unit="step",
        mininterval=1 if sys.stderr.isatty() else 30,
    )
    # a resumed run drops the rows logged after its checkpoint, and logs them again
    logger = common.Logger(run_dir, LOG_FIELDS, resume_step=done_iterations * batch_steps if resume else None)
    try:
        with collector, logger:
            common.print_collector(collector)
            waited_from = time.perf_counter()
            for iteration, batch in enumerate(collector, start=done_iterations + 1):
                wait_s = time.perf_counter() - waited_from
                recent.add(batch["episode_return"][batch["done"] & batch["mask"]])
                for group in optimizer.param_groups:  # annealed linearly to 0 over the run
                    group["lr"] = cfg.learning_rate * (1 - (iteration - 1) / num_iterations * cfg.anneal_lr)

                data = batch.select("obs", "action", "log_prob", "value", "advantage", "return")[batch["mask"]]
                update_start = time.perf_counter()
                losses = update(agent, optimizer, data, cfg, shuffle_gen)
                update_s = time.perf_counter() - update_start

                step, elapsed, interval = iteration * batch_steps, time.perf_counter() - start, intervals.take()
                logger.log(
                    {
                        "step": step,
                        "wall_time": begun["wall_time"] + elapsed,
                        "charts/mean_return": recent.mean,
                        "charts/episodes": recent.episodes,
                        "charts/SPS": (step - done_iterations * batch_steps) / elapsed,
                        "charts/learning_rate": optimizer.param_groups[0]["lr"],
                        "charts/policy_lag": collector.policy_version - int(batch["policy_version"].min()),
                        "time/wait_s": wait_s,
                        "time/update_s": update_s,
                        **common.stats_row(interval),
                        **losses,
                    }
                )
                progress.update(batch_steps)
                progress.set_postfix_str(f"mean_return={recent.mean:.1f}", refresh=False)
                if cfg.stop_return is not None and recent.mean >= cfg.stop_return:
                    break
                if cfg.checkpoint_every and iteration % cfg.checkpoint_every == 0:
                    checkpoint()
                waited_from = time.perf_counter()
    except KeyboardInterrupt:  # the command that carries the run on from its last checkpoint
        progress.close()
        print_resume_command(checkpoint_path, iteration + 1)
        raise SystemExit(130) from None
    progress.close()
    if cfg.backend == "thread":
        envs.close()
    checkpoint()
    common.report_stats(collector, run_dir, title=f"PPO on {cfg.env_id}, seed {cfg.seed}", window=cfg.return_window)
    if cfg.capture_video:  # an episode of the final weights, to watch
        evaluate(checkpoint_path, ["eval_episodes=1"])
    print(f"run folder: {run_dir} ({time.perf_counter() - start:.1f} s)")
    print(f"final mean return (last {len(recent.returns)} episodes): {recent.mean:.1f}")
    return recent.mean


def update(
    agent: Agent, optimizer: torch.optim.Optimizer, data: TensorDict, cfg: Config, shuffle_gen: torch.Generator
) -> dict[str, float]:
    """ppo.py's update: PPO's clipped-objective epochs over one batch of transitions `data` [B]."""
    size = data.shape[0]
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
            nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()
        if cfg.target_kl is not None and approx_kl > cfg.target_kl:
            break
    losses = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_loss, "approx_kl": approx_kl}
    return {f"losses/{key}": value.item() for key, value in losses.items()}


# ---------------------------------------------------------------------------- evaluation


def evaluate(checkpoint: str | Path, overrides: Sequence[str] = ()) -> tuple[float, float]:
    """Runs `eval_episodes` deterministic episodes of a checkpoint, one per sub-env; returns mean and std.

    With capture_video, the first episode is recorded to videos/eval-step<step>-episode-0.mp4 beside the
    checkpoint, where <step> is the checkpoint's env step; evaluating it again replaces that file.
    """
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    cfg = load_config(None, overrides, base=state["config"])
    torch.set_num_threads(cfg.torch_threads)
    video = None
    if cfg.capture_video:  # load_config checked that it can record
        trained = state["config"]  # the batch size of training, whatever this evaluation overrides
        step = state["iteration"] * trained["num_envs"] * trained["num_steps"]
        video = Path(checkpoint).parent / "videos" / f"eval-step{step}"
    envs = make_envs(dataclasses.replace(cfg, device="cpu"), cfg.eval_episodes, video)  # on the CPU, as the agent
    agent = Agent(envs.single_observation_space, envs.single_action_space, cfg)
    agent.load_state_dict(state["model"])
    returns, finished = np.zeros(cfg.eval_episodes), np.zeros(cfg.eval_episodes, dtype=bool)
    obs, _ = envs.reset(seed=cfg.seed + 10_000)  # episodes unseen in training
    while not finished.all():  # one episode per sub-env; later (autoreset) episodes are ignored
        with torch.no_grad():
            action = agent.actor(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1)
        obs, reward, terminated, truncated, _ = envs.step(action if isinstance(obs, torch.Tensor) else action.numpy())
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
