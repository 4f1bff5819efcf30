"""EnvPool through the collector, in sync mode and in async mode (``batch_size < num_envs``).

The measurement: CartPole-v1, N=64 envs, T=128 steps, the benchmarks'
64x64 actor-critic (a Normal head for Box actions: ``--env HalfCheetah-v5
--num-envs 16``), one torch intra-op thread, ``Collector(backend="thread",
prefetch=0)`` on a live EnvPool. Beside the collector rows, the floors: EnvPool
stepping alone in sync mode with ``num_threads=1`` (pre-drawn actions), the
policy's forward alone on recorded observations, and their serial sum (env then
policy, one after the other: ``1 / (1 / env + 1 / policy)``), which a sync loop
cannot beat; async mode overlaps the two, so its ceiling is the slower one
alone. EnvPool's default ``num_threads=0`` (a thread per core) also steps envs
on several cores at once: its rows and its env-alone row are given too. A
hand-written async loop (``recv``, forward, ``send``, no bookkeeping) shows
what the overlap gives without the collector's work.
Systems run interleaved (A B C A B C ...), each built afresh per repeat; the
table gives medians, spreads and ratios to the serial floor. Writes ``results/envpool_async.json``
(another ``--env`` or ``--num-envs``: ``results/envpool_async_ENV_nN.json``).

Usage::

    .venv/bin/python benchmarks/envpool_async.py [--env ID] [--num-envs N] [--repeats R] [--batches B]
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from _common import (
    CollectorSession,
    EnvAlone,
    HandLoop,
    PolicyAlone,
    fmt_rate,
    load_line,
    machine_info,
    make_policy,
    markdown_table,
    quiet_warnings,
    recorded_obs,
    run_interleaved,
    serial_floor,
    write_json,
)

ENV_ID = DEFAULT_ENV_ID = "CartPole-v1"
NUM_ENVS, NUM_STEPS = DEFAULT_NUM_ENVS, _ = 64, 128
# (fraction of num_envs as batch_size, num_threads) of the async rows; num_threads 0: EnvPool's default.
ASYNC = ((1 / 2, 0), (1 / 2, 1), (3 / 4, 0), (3 / 4, 1))
ENV, POLICY = "env alone (sync, num_threads=1)", "policy forward alone"


def _pool(batch_size: int | None = None, num_threads: int = 0, seed: int = 0) -> Any:
    import envpool

    return envpool.make_gymnasium(
        ENV_ID, num_envs=NUM_ENVS, batch_size=batch_size or NUM_ENVS, num_threads=num_threads, seed=seed
    )


class GaussianActorCritic(nn.Module):
    """The 64x64 tanh actor-critic with a Normal head (state-independent log std) for Box actions."""

    def __init__(self, obs_dim: int, action_dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)

        def mlp(out: int) -> nn.Sequential:
            return nn.Sequential(nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, out))

        self.actor, self.critic = mlp(action_dim), mlp(1)
        self.log_std = nn.Parameter(torch.zeros(action_dim))

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        dist = torch.distributions.Normal(self.actor(obs), self.log_std.exp(), validate_args=False)
        action = dist.sample()
        return {"action": action, "log_prob": dist.log_prob(action).sum(-1), "value": self.critic(obs).squeeze(-1)}


def _policy() -> nn.Module:
    env = _pool()
    obs_dim, space = int(np.prod(env.observation_space.shape)), env.action_space
    env.close()
    if hasattr(space, "n"):
        return make_policy(0, obs_dim, int(space.n))
    return GaussianActorCritic(obs_dim, int(np.prod(space.shape)))


def _actions(rng: np.random.Generator, space: Any, n: int) -> np.ndarray:
    if hasattr(space, "n"):
        return rng.integers(0, space.n, size=n).astype(np.int32)
    return rng.uniform(space.low, space.high, size=(n, *space.shape)).astype(np.float32)


def _actions(space: Any, steps: int) -> list[np.ndarray]:
    """``steps`` pre-drawn actions for N envs."""
    rng = np.random.default_rng(0)
    if hasattr(space, "n"):
        return [rng.integers(0, space.n, size=NUM_ENVS).astype(np.int32) for _ in range(steps)]
    return [rng.uniform(space.low, space.high, size=(NUM_ENVS, *space.shape)).astype(np.float32) for _ in range(steps)]


def env_alone(num_threads: int) -> EnvAlone:
    """EnvPool in sync mode, stepped with pre-drawn actions: T steps of N envs."""
    env = _pool(num_threads=num_threads)
    env.reset()
    return EnvAlone(env, _actions(env.action_space, NUM_STEPS), num_envs=NUM_ENVS)


def policy_alone() -> PolicyAlone:
    """The actor-critic's forward alone on T recorded observation batches [N, obs_dim]."""
    env = _pool()
    first, _ = env.reset()
    obs = recorded_obs(env, first, _actions(env.action_space, NUM_STEPS))
    env.close()
    return PolicyAlone(_policy(), obs, num_envs=NUM_ENVS)


def hand_sync(num_threads: int) -> HandLoop:
    """A hand-written sync loop: forward, step, nothing stored (the least a loop that acts must do)."""
    env = _pool(num_threads=num_threads)
    first, _ = env.reset()
    return HandLoop(env, _policy(), first, num_steps=NUM_STEPS, num_envs=NUM_ENVS)


class HandAsync:
    """A hand-written async loop: recv, forward on the ready envs, send; nothing stored."""

    def __init__(self, batch_size: int, num_threads: int) -> None:
        self.env = _pool(batch_size, num_threads)
        self.env.async_reset()
        self.policy = _policy()
        self.batch_size = batch_size

    def step(self) -> int:
        with torch.no_grad():
            calls = NUM_STEPS * NUM_ENVS // self.batch_size
            for _ in range(calls):
                obs, _, _, _, info = self.env.recv()
                action = self.policy(torch.as_tensor(obs, dtype=torch.float32))["action"]
                self.env.send(action.numpy(), info["env_id"])
        return calls * self.batch_size

    def close(self) -> None:
        self.env.close()


def collecting(batch_size: int, num_threads: int, prefetch: int) -> CollectorSession:
    """``Collector(backend="thread")`` on a live EnvPool; one step is one batch [T, N]."""
    from torch_rollout import Collector

    env = _pool(batch_size, num_threads)
    collector = Collector(env, _policy(), num_steps=NUM_STEPS, backend="thread", device="cpu", prefetch=prefetch)
    return CollectorSession(collector, frames=NUM_STEPS * NUM_ENVS, owned=env)


def systems(prefetch: int) -> dict[str, Callable[[], Any]]:
    factories: dict[str, Callable[[], Any]] = {
        ENV: lambda: env_alone(1),
        "ref: env alone (sync, num_threads=0)": lambda: env_alone(0),
        POLICY: policy_alone,
        "ref: hand-written sync loop (num_threads=1)": lambda: hand_sync(1),
        f"collector, sync (num_threads=1), prefetch={prefetch}": lambda: collecting(NUM_ENVS, 1, prefetch),
        f"collector, sync (num_threads=0), prefetch={prefetch}": lambda: collecting(NUM_ENVS, 0, prefetch),
    }
    for fraction, threads in ASYNC:
        batch_size = round(NUM_ENVS * fraction)
        factories[f"collector, async batch_size={batch_size} num_threads={threads}, prefetch={prefetch}"] = (
            lambda b=batch_size, n=threads: collecting(b, n, prefetch)
        )
    half = NUM_ENVS // 2
    factories[f"ref: hand-written async loop, batch_size={half} num_threads=0"] = lambda: HandAsync(half, 0)
    return factories


def main() -> None:
    global ENV_ID, NUM_ENVS, NUM_STEPS  # the systems read them
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default=ENV_ID, help="an EnvPool task id")
    parser.add_argument("--num-envs", type=int, default=NUM_ENVS)
    parser.add_argument("--num-steps", type=int, default=NUM_STEPS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8, help="timed batches of T * N steps per repeat")
    parser.add_argument("--prefetch", type=int, default=0)
    args = parser.parse_args()
    ENV_ID, NUM_ENVS, NUM_STEPS = args.env, args.num_envs, args.num_steps
    quiet_warnings()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rates = run_interleaved(systems(args.prefetch), repeats=args.repeats, warmup=1, steps=args.batches)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    serial, ceiling = serial_floor(medians[ENV], medians[POLICY]), min(medians[ENV], medians[POLICY])
    print(
        f"\nEnvPool {ENV_ID}, N={NUM_ENVS}, T={NUM_STEPS}, 64x64 actor-critic, 1 torch thread, "
        f"{args.repeats} interleaved repeats of {args.batches} batches; {load_line(load)}"
    )
    print(
        f"serial floor (env + policy, one after the other): {fmt_rate(serial)} frames/s; overlap ceiling "
        f"(the slower alone): {fmt_rate(ceiling)} frames/s = {ceiling / serial:.2f}x the floor\n"
    )
    rows = [
        [name, fmt_rate(medians[name]), f"{fmt_rate(min(v))} - {fmt_rate(max(v))}", f"{medians[name] / serial:.2f}x"]
        for name, v in rates.items()
    ]
    print(markdown_table(["system", "frames/s (median)", "min - max", "x serial floor"], rows))
    config = {"env": ENV_ID, "N": NUM_ENVS, "T": NUM_STEPS, "repeats": args.repeats, "batches": args.batches}
    config.update(prefetch=args.prefetch, load_1m_start=load)
    # One record per case: the defaults' in envpool_async.json, another case's beside it, named by its env and N.
    case = "" if (ENV_ID, NUM_ENVS) == (DEFAULT_ENV_ID, DEFAULT_NUM_ENVS) else f"_{ENV_ID.lower()}_n{NUM_ENVS}"
    write_json(
        f"envpool_async{case}", {"machine": machine_info(), "config": config, "samples": rates, "medians": medians}
    )


if __name__ == "__main__":
    main()
