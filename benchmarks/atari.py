"""Collection throughput on Atari Pong: EnvPool's uint8 frames and a Nature-CNN actor-critic on the CPU, with floors.

Every system collects batches of T x N transitions from EnvPool's ``Pong-v5``
(84x84 grey frames, 4 stacked, frame skip 4, CleanRL's ``episodic_life`` and
``reward_clip``) with the same Nature-CNN actor-critic (the shape of CleanRL's
``ppo_atari_envpool``: conv 32x8x8 s4, 64x4x4 s2, 64x3x3 s1, Linear 3136->512,
actor and critic heads on the 512; frames / 255), the same weights, one torch
thread, and computes GAE on each batch its own way. Each EnvPool pool steps its
envs with ``num_threads`` C++ threads (1 by default: with one torch thread, the
env and the policy each have one of two cores).

The unit is frames per second: env steps x N (one frame = one agent step of
one env, 4 emulator frames). Rows where EnvPool only resets an env (its NEXT_STEP
autoreset: the step after an episode end) are not counted; the floors count every
step.

Systems:

- floors, measured in the same run: EnvPool stepping alone with pre-drawn actions,
  the policy forward alone at N on recorded frames; from each repeat's pair, their
  serial sum (no collector that steps and acts in turn can beat it) and the slower of
  the two (env and policy perfectly overlapped on two cores);
- a CleanRL-style loop: the rollout of CleanRL's ``ppo_atari_envpool`` (obs to a
  float tensor, forward under ``no_grad``, store in preallocated float32 buffers,
  step) with its Python-loop GAE at the end;
- torch_rollout: ``backend="thread"`` with prefetch 0 and 1 and ``backend="process"``
  with one worker (prefetch 1), all on ``envpool_envs("Pong-v5", ...)``;
- TorchRL: its ``Collector`` on a ``GymWrapper`` around EnvPool's gymnasium pool,
  a ``ProbabilisticActor`` over the same CNN and its ``GAE`` module. TorchRL's own
  EnvPool wrapper (``MultiThreadedEnv``) builds the pool with ``env_type="gym"``
  and needs the legacy ``gym`` package (and ``treevalue``), and its ``GymWrapper``
  refuses EnvPool's pool as it is (its spaces are per env, not batched) and
  expects SAME_STEP autoreset; so the pool goes through :class:`SameStepEnvPool`,
  which batches the spaces and resets an ended env in the step that ended it.

Usage::

    benchmarks/.venv/bin/python benchmarks/atari.py [--quick] [--repeats R] [--num-threads 1]
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector.utils import batch_space
from torch import nn

import _common as harness
from _common import (
    SERIAL_FLOOR,
    Session,
    has,
    machine_info,
    main_of,
    markdown_table,
    quiet_warnings,
    rate_cells,
    record,
    recorded_obs,
    run_interleaved,
    summarize,
    with_floors,
)

__all__ = ["NatureCNN", "SameStepEnvPool", "run", "to_markdown", "REFERENCE", "TASK"]

TASK = "Pong-v5"
# CleanRL's ppo_atari_envpool options; the rest are EnvPool's Atari defaults (84x84 grey, 4 frames, skip 4)
ENV_OPTIONS: dict[str, Any] = {"episodic_life": True, "reward_clip": True}
GAMMA, GAE_LAMBDA = 0.99, 0.95
REFERENCE = "torch_rollout thread (prefetch=1)"
ENV_FLOOR = "floor: EnvPool stepping alone"
POLICY_FLOOR = "floor: policy forward alone"


def _make_pool(num_envs: int, seed: int, num_threads: int) -> Any:
    import envpool

    return envpool.make_gymnasium(TASK, num_envs=num_envs, seed=seed, num_threads=num_threads, **ENV_OPTIONS)


# ------------------------------------------------------------------------------ the policy


def _init(layer: nn.Conv2d | nn.Linear, gain: float) -> nn.Conv2d | nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class NatureCNN(nn.Module):
    """The Nature-DQN trunk with actor and critic heads, shaped as CleanRL's ``ppo_atari_envpool`` agent.

    It takes frames ``[N, 4, 84, 84]`` (uint8 or float, 0-255) and speaks the
    protocols of every system here: ``forward`` (torch_rollout), ``get_value``
    (torch_rollout's bootstrap values, CleanRL), ``get_action_and_value``
    (CleanRL), ``logits`` and ``state_value`` (TorchRL).
    """

    def __init__(self, n_actions: int, frames: int = 4) -> None:
        super().__init__()
        sqrt2 = math.sqrt(2.0)
        self.trunk = nn.Sequential(
            _init(nn.Conv2d(frames, 32, 8, stride=4), sqrt2),  # [N, 32, 20, 20]
            nn.ReLU(),
            _init(nn.Conv2d(32, 64, 4, stride=2), sqrt2),  # [N, 64, 9, 9]
            nn.ReLU(),
            _init(nn.Conv2d(64, 64, 3, stride=1), sqrt2),  # [N, 64, 7, 7]
            nn.ReLU(),
            nn.Flatten(),
            _init(nn.Linear(64 * 7 * 7, 512), sqrt2),
            nn.ReLU(),
        )
        self.actor = _init(nn.Linear(512, n_actions), 0.01)
        self.critic = _init(nn.Linear(512, 1), 1.0)

    def hidden(self, obs: torch.Tensor) -> torch.Tensor:
        """The 512 features of frames ``[..., 4, 84, 84]`` (TorchRL's GAE passes ``[N, T, 4, 84, 84]``)."""
        lead = obs.shape[:-3]
        hidden = self.trunk(obs.reshape(-1, *obs.shape[-3:]) / 255.0)  # uint8 / float -> float32
        return hidden.reshape(*lead, -1)

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        """Action logits [N, n_actions]."""
        return self.actor(self.hidden(obs))

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        """State values [N]."""
        return self.critic(self.hidden(obs)).squeeze(-1)

    def state_value(self, obs: torch.Tensor) -> torch.Tensor:
        """State values [..., 1], TorchRL's ``"state_value"`` shape."""
        return self.critic(self.hidden(obs))

    def get_action_and_value(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples actions; returns action [N], log_prob [N], value [N] from one pass of the trunk."""
        hidden = self.hidden(obs)
        dist = torch.distributions.Categorical(logits=self.actor(hidden), validate_args=False)
        action = dist.sample()
        return action, dist.log_prob(action), self.critic(hidden).squeeze(-1)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """torch_rollout's policy contract."""
        action, log_prob, value = self.get_action_and_value(obs)
        return {"action": action, "log_prob": log_prob, "value": value}


def make_cnn(seed: int, n_actions: int) -> NatureCNN:
    """The CNN with weights drawn from ``seed`` (identical for every system); torch's global RNG is left as it was."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    policy = NatureCNN(n_actions)
    torch.random.set_rng_state(generator_state)
    return policy


def _policy(state: dict[str, torch.Tensor], seed: int) -> NatureCNN:
    """A fresh copy of the shared weights; reseeds torch so every system samples actions from the same stream."""
    policy = NatureCNN(state["actor.weight"].shape[0])
    policy.load_state_dict(state)
    torch.manual_seed(seed)
    return policy


# ------------------------------------------------------------------------------ systems


def torch_rollout(
    num_envs: int,
    num_steps: int,
    seed: int,
    state: dict,
    *,
    num_threads: int,
    prefetch: int,
    backend: str = "thread",
    num_workers: int = 1,
    compile_policy: bool = False,
) -> harness.CollectorSession:
    """torch_rollout's Collector on ``envpool_envs(TASK, num_threads=..., **ENV_OPTIONS)``, thread or process."""
    from torch_rollout import envpool_envs

    return harness.cpu_collector(  # obs uint8 [T, N, 4, 84, 84]
        envpool_envs(TASK, num_threads=num_threads, **ENV_OPTIONS),
        _policy(state, seed),
        num_steps=num_steps,
        num_envs=num_envs,
        prefetch=prefetch,
        seed=seed,
        backend=backend,
        num_workers=num_workers,
        compile_policy=compile_policy,
    )


def cleanrl_style(num_envs: int, num_steps: int, seed: int, state: dict, *, num_threads: int) -> harness.CleanRLRollout:
    """The rollout of CleanRL's ``ppo_atari_envpool``: float32 [T, N] buffers, done = terminated | truncated, loop GAE.

    CleanRL calls ``envpool.make(..., env_type="gym")``; this steps the same pool
    through EnvPool's gymnasium API, so ``done`` is ``terminated | truncated``.
    Rows after a ``done`` are EnvPool's reset steps: CleanRL trains on them, they
    are not counted here.
    """
    envs = _make_pool(num_envs, seed, num_threads)
    first, _ = envs.reset()
    agent = _policy(state, seed)
    return harness.CleanRLRollout(
        envs, agent, first, num_steps=num_steps, num_envs=num_envs, gamma=GAMMA, gae_lambda=GAE_LAMBDA
    )


class SameStepEnvPool(gym.vector.VectorEnv):
    """EnvPool's gymnasium pool as a SAME_STEP vector env with batched spaces, the form TorchRL's ``GymWrapper`` takes.

    EnvPool resets an ended env on its next step (NEXT_STEP); here the step that
    ends an episode resets the env at once (``pool.reset(env_id=...)``), returns
    the reset observation and puts the final one in ``infos["final_obs"]``, as
    gymnasium's SAME_STEP vector envs do. The pool is seeded when built; ``reset``
    ignores ``seed``.
    """

    metadata: dict[str, Any] = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}
    autoreset_mode = gym.vector.AutoresetMode.SAME_STEP  # TorchRL reads the attribute

    def __init__(self, num_envs: int, seed: int, num_threads: int) -> None:
        self.pool = _make_pool(num_envs, seed, num_threads)
        self.num_envs = num_envs
        self.single_observation_space = self.pool.observation_space
        self.single_action_space = self.pool.action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        obs, _ = self.pool.reset()
        return obs, {}

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, reward, terminated, truncated, _ = self.pool.step(np.asarray(actions, dtype=np.int32))
        done = terminated | truncated
        info: dict[str, Any] = {}
        if done.any():
            ended = np.flatnonzero(done)
            final = np.empty(self.num_envs, dtype=object)
            final[ended] = list(obs[ended])
            obs = obs.copy()
            obs[ended], _ = self.pool.reset(env_id=ended)
            info = {"final_obs": final, "_final_obs": done.copy()}
        return obs, reward, terminated, truncated, info

    def close_extras(self, **kwargs: Any) -> None:
        self.pool.close()


def torchrl(num_envs: int, num_steps: int, seed: int, state: dict, *, num_threads: int) -> harness.TorchRLSession:
    """TorchRL's ``Collector`` on ``GymWrapper(SameStepEnvPool)``, then its ``GAE`` module on each batch.

    The actor (trunk and actor head) writes action and log-prob; the GAE module
    runs the critic (trunk and critic head).
    """
    from tensordict.nn import TensorDictModule
    from torchrl.envs import GymWrapper
    from torchrl.modules import ProbabilisticActor

    logging.getLogger("torchrl").setLevel(logging.WARNING)  # its spec-reader notes at every build
    policy = _policy(state, seed)
    env = GymWrapper(SameStepEnvPool(num_envs, seed, num_threads), categorical_action_encoding=True, device="cpu")
    obs_key = next(iter(env.observation_spec.keys()))
    actor = ProbabilisticActor(
        TensorDictModule(policy.logits, in_keys=[obs_key], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )
    critic = TensorDictModule(policy.state_value, in_keys=[obs_key], out_keys=["state_value"])
    frames = num_steps * num_envs
    return harness.TorchRLSession(env, actor, critic, frames_per_batch=frames, gamma=GAMMA, gae_lambda=GAE_LAMBDA)


def env_floor(num_envs: int, num_steps: int, seed: int, state: dict, *, num_threads: int) -> harness.EnvAlone:
    """The pool alone, stepped with pre-drawn random actions: no collector can beat this on the same pool."""
    env = _make_pool(num_envs, seed, num_threads)
    env.reset()
    actions = np.random.default_rng(seed).integers(0, int(env.action_space.n), size=(num_steps, num_envs))
    return harness.EnvAlone(env, actions.astype(np.int32), num_envs=num_envs)


# distinct recorded batches for the policy floor, cycled: enough that no cache holds them all (each is N x 28 KiB)
RECORDED = 16


def policy_floor(
    num_envs: int, num_steps: int, seed: int, state: dict, *, num_threads: int, compiled: bool = False
) -> harness.PolicyAlone:
    """The policy forward alone (trunk, sample, log-prob, value) on recorded uint8 frame batches [N, 4, 84, 84]."""
    env = _make_pool(num_envs, seed, num_threads)
    first, _ = env.reset()
    rng = np.random.default_rng(seed)
    actions = [
        rng.integers(0, env.action_space.n, size=num_envs).astype(np.int32) for _ in range(min(num_steps, RECORDED))
    ]
    recorded = recorded_obs(env, first, actions, convert=lambda obs: torch.from_numpy(obs.copy()))
    env.close()
    policy = _policy(state, seed)
    obs = [recorded[t % len(recorded)] for t in range(num_steps)]
    return harness.PolicyAlone(torch.compile(policy) if compiled else policy, obs, num_envs=num_envs)


def systems(
    num_envs: int, num_steps: int, seed: int, state: dict, num_threads: int, compiled: bool = False
) -> tuple[dict[str, Callable[[], Session]], list[str]]:
    """Factories of every system that can run here, and notes on the ones that cannot.

    ``compiled``: add the thread collector with ``compile_policy=True`` and the compiled forward alone.
    """
    args = (num_envs, num_steps, seed, state)
    kw = {"num_threads": num_threads}
    factories: dict[str, Callable[[], Session]] = {
        REFERENCE: lambda: torch_rollout(*args, **kw, prefetch=1),
        "torch_rollout thread (prefetch=0)": lambda: torch_rollout(*args, **kw, prefetch=0),
        "torch_rollout process K=1 (prefetch=1)": lambda: torch_rollout(
            *args, **kw, prefetch=1, backend="process", num_workers=1
        ),
    }
    if compiled:
        factories["torch_rollout thread (prefetch=1), compile_policy=True"] = lambda: torch_rollout(
            *args, **kw, prefetch=1, compile_policy=True
        )
        factories["torch_rollout thread (prefetch=0), compile_policy=True"] = lambda: torch_rollout(
            *args, **kw, prefetch=0, compile_policy=True
        )
    notes = []
    if has("torchrl"):
        factories["TorchRL Collector + GAE (GymWrapper, SAME_STEP adapter)"] = lambda: torchrl(*args, **kw)
    else:
        notes.append("TorchRL not installed: skipped")
    factories["CleanRL-style loop"] = lambda: cleanrl_style(*args, **kw)
    factories[ENV_FLOOR] = lambda: env_floor(*args, **kw)
    factories[POLICY_FLOOR] = lambda: policy_floor(*args, **kw)
    if compiled:
        factories["ref: policy forward alone, torch.compile'd"] = lambda: policy_floor(*args, **kw, compiled=True)
    if num_threads != 0:
        # what the pool reaches with EnvPool's own thread count (one per env, up to the cores)
        factories["ref: EnvPool stepping alone, num_threads=0 (EnvPool's default)"] = lambda: env_floor(
            *args, num_threads=0
        )
    return factories, notes


# ------------------------------------------------------------------------------ driver


def run(
    *,
    quick: bool = False,
    repeats: int | None = None,
    num_envs: int = 8,
    num_steps: int | None = None,
    num_threads: int = 1,
    seed: int = 0,
    compiled: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs the Atari collection benchmark and returns its results (also written to results/atari.json).

    Args:
        quick: one repeat of one short batch (T=32): checks that every system runs.
        repeats: interleaved rounds (default 1 quick, 5 full).
        num_envs: N.
        num_steps: T, steps per env per batch (default 32 quick, 128 full).
        num_threads: EnvPool's ``num_threads`` for every pool the systems step (0: EnvPool's default).
        seed: env and weight seed shared by all systems.
        compiled: add ``compile_policy=True`` rows (thread, prefetch 0 and 1) and the compiled forward alone.
        log: where progress lines go.

    Returns:
        A dict with ``machine``, ``config``, ``notes``, ``samples`` and ``rows`` from :func:`summarize`.
    """
    import envpool

    quiet_warnings()
    torch.set_num_threads(1)
    repeats = repeats or (1 if quick else 5)
    num_steps = num_steps or (32 if quick else 128)
    # at least ~2k timed frames per system per repeat; one warm-up batch before
    timed = 1 if quick else max(1, 2048 // (num_envs * num_steps))
    n_actions = int(envpool.make_spec(TASK).gymnasium_action_space.n)
    state = make_cnn(seed, n_actions).state_dict()
    factories, notes = systems(num_envs, num_steps, seed, state, num_threads, compiled)
    log(f"atari: {TASK} N={num_envs} T={num_steps}, {repeats} repeat(s), {timed} timed batch(es) after 1 warm-up")
    rates = run_interleaved(factories, repeats=repeats, warmup=1, steps=timed, log=log)
    rates = with_floors(rates, ENV_FLOOR, POLICY_FLOOR)
    rows = summarize(rates, REFERENCE)
    serial = statistics.median(rates[SERIAL_FLOOR])
    for row in rows:
        row["vs_serial_floor"] = row["median"] / serial
    config = dict(task=TASK, env_options=ENV_OPTIONS, num_threads=num_threads, N=num_envs, T=num_steps)
    config.update(repeats=repeats, timed_batches=timed, seed=seed, quick=quick)
    results = {"machine": machine_info(), "config": config, "notes": notes, "samples": rates, "rows": rows}
    return record("atari", results, quick=quick)


def to_markdown(results: dict[str, Any]) -> str:
    """The table, with a note on what was counted and how."""
    config = results["config"]
    rows = [[*rate_cells(r), f"{r['vs_serial_floor']:.2f}x"] for r in results["rows"]]
    threads = "EnvPool's default" if config["num_threads"] == 0 else str(config["num_threads"])
    title = (
        f"Collection, Atari {config['task']} (EnvPool, num_threads={threads}), T={config['T']} x N={config['N']}, "
        "Nature CNN, GAE included"
    )
    parts = [
        f"**{title}** (frames/s, median of {config['repeats']})\n\n",
        markdown_table(["system", "median", "range", "vs thread, prefetch=1", "vs serial floor"], rows),
        "\n\nEvery system steps EnvPool pools of the same task and seed (uint8 84x84x4 frames; CleanRL's "
        "`episodic_life` and `reward_clip`) with the same Nature-CNN actor-critic (CleanRL's `ppo_atari_envpool` "
        "shape, same weights, one torch thread). Frames = env steps x N; EnvPool's reset rows (the step after an "
        "episode end) are not counted, the floors count every step. The serial floor and the overlap ceiling are "
        "derived per repeat from that repeat's two floors. TorchRL steps the pool through `GymWrapper` over a "
        "SAME_STEP adapter (its `MultiThreadedEnv` needs the legacy `gym` package), and its GAE module runs the "
        "critic over each batch's observations and next observations.",
    ]
    parts += [f"\n\n_{note}_" for note in results["notes"]]
    return "".join(parts).rstrip() + "\n"


OPTIONS = (
    ("--num-envs", {"type": int, "default": 8}),
    ("--num-steps", {"type": int, "default": None, "help": "T (default 128; 32 with --quick)"}),
    ("--num-threads", {"type": int, "default": 1, "help": "EnvPool's num_threads (0: its default)"}),
    ("--seed", {"type": int, "default": 0}),
    ("--compiled", {"action": "store_true", "help": "add compile_policy=True rows"}),
)  # the command line beyond --quick and --repeats


def main() -> None:
    main_of(__doc__, run, to_markdown, *OPTIONS, quick="one short repeat (T=32): checks that every system runs")


if __name__ == "__main__":
    main()
