"""DQN end to end: CleanRL's dqn.py on CartPole-v1, its own loop against the collector and a ReplayRing.

Both systems train the same learner with CleanRL's hyperparameters (``dqn.py``: one env, a
120x84 Q-network, Adam at 2.5e-4, gamma 0.99, a batch of 128 every 10 steps once 10,000 steps
are in a buffer of 10,000, the target network copied every 500 steps, epsilon from 1 to 0.05
over half the run), on gymnasium's CartPole-v1 in SAME_STEP mode:

- hand loop: CleanRL's, one step at a time: epsilon-greedy action, the env's step, the final
  observation patched in from ``infos["final_obs"]``, the transition into a ring of tensors, a
  gradient step every 10 steps;
- collector: ``Collector(envs, policy, num_steps=10, gae=None, keys=BatchKeys(next_obs=True),
  backend="thread", prefetch=0)`` filling a ``ReplayRing(10_000)`` with ``ring.fill``, one
  gradient step per batch of 10 steps (the train frequency), epsilon set on the policy before each
  batch (``policy.epsilon``: with ``prefetch=0`` the trainer's module itself acts).

Runs are interleaved (hand, collector, hand, collector, ...), each a whole run from fresh envs and
networks, seeds 1, 2, 3, ... per repeat; the wall time of the loop, set-up excluded; medians and
the paired ratios (hand loop's time over the collector's: above 1 the collector is faster). One
torch thread. Writes ``results/dqn_e2e.json``.

With ``--split``, each system runs its first 9,000 steps (before learning starts) with the env's step and
the Q-network's forward timed, and prints microseconds per step of each and of the rest.

Usage::

    .venv/bin/python benchmarks/dqn_e2e.py [--steps 20000] [--repeats 3] [--split]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from torch_rollout import BatchKeys, Collector, ReplayRing

from _common import load_line, machine_info, markdown_table, quiet_warnings, write_json

# CleanRL's dqn.py defaults for CartPole-v1
LEARNING_RATE, GAMMA, BUFFER, BATCH = 2.5e-4, 0.99, 10_000, 128
START_E, END_E, EXPLORATION_FRACTION = 1.0, 0.05, 0.5
LEARNING_STARTS, TRAIN_FREQUENCY, TARGET_FREQUENCY = 10_000, 10, 500


def make_envs(seed: int) -> gym.vector.VectorEnv:
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    envs.single_action_space.seed(seed)
    return envs


def epsilon(step: int, total: int) -> float:
    duration = EXPLORATION_FRACTION * total
    return max(END_E, START_E + (END_E - START_E) * step / duration)


class QNetwork(nn.Module):
    """CleanRL's Q-network; acting epsilon-greedily at ``self.epsilon`` (what the collector calls), as CleanRL's
    loop acts: one draw of Python's ``random`` for the step, and the network only on a greedy step."""

    def __init__(self) -> None:
        super().__init__()
        self.network = nn.Sequential(nn.Linear(4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 2))
        self.epsilon = 1.0

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        if random.random() < self.epsilon:  # CleanRL's draw: Python's random
            return {"action": torch.randint(0, 2, obs.shape[:1])}
        return {"action": self.network(obs).argmax(-1)}


class Learner:
    """The TD step of CleanRL's dqn.py, on a minibatch of (obs, action, reward, next_obs, terminated)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.q = QNetwork()
        self.target = QNetwork()
        self.target.load_state_dict(self.q.state_dict())
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=LEARNING_RATE)
        self.updates = 0

    def update(self, data: Any) -> None:
        with torch.no_grad():
            target_max = self.target.network(data["next_obs"]).max(dim=1).values
            td_target = data["reward"] + GAMMA * target_max * (1 - data["terminated"].float())
        old_val = self.q.network(data["obs"]).gather(1, data["action"].long().unsqueeze(1)).squeeze(1)
        loss = nn.functional.mse_loss(td_target, old_val)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.updates += 1

    def sync_target(self) -> None:
        self.target.load_state_dict(self.q.state_dict())


def hand_loop(steps: int, seed: int) -> tuple[float, int]:
    """CleanRL's loop; returns the loop's seconds and the gradient steps taken."""
    random.seed(seed)
    envs, learner = make_envs(seed), Learner(seed)
    ring = {
        "obs": torch.zeros(BUFFER, 4),
        "next_obs": torch.zeros(BUFFER, 4),
        "action": torch.zeros(BUFFER, dtype=torch.int64),
        "reward": torch.zeros(BUFFER),
        "terminated": torch.zeros(BUFFER, dtype=torch.bool),
    }
    pos = size = 0
    obs, _ = envs.reset(seed=seed)
    began = time.perf_counter()
    for step in range(steps):
        if random.random() < epsilon(step, steps):
            action = np.array([envs.single_action_space.sample()])
        else:
            with torch.no_grad():
                action = learner.q.network(torch.as_tensor(obs)).argmax(-1).numpy()
        next_obs, reward, terminated, _, infos = envs.step(action)
        real_next_obs = next_obs.copy()
        if "_final_obs" in infos:
            for idx in np.flatnonzero(infos["_final_obs"]):
                real_next_obs[idx] = infos["final_obs"][idx]
        for key, value in (("obs", obs), ("next_obs", real_next_obs), ("action", action), ("reward", reward)):
            ring[key][pos] = torch.as_tensor(value[0])
        ring["terminated"][pos] = bool(terminated[0])
        pos, size = (pos + 1) % BUFFER, min(size + 1, BUFFER)
        obs = next_obs
        if step > LEARNING_STARTS:
            if step % TRAIN_FREQUENCY == 0:
                index = torch.randint(size, (BATCH,))
                learner.update({key: value[index] for key, value in ring.items()})
            if step % TARGET_FREQUENCY == 0:
                learner.sync_target()
    took = time.perf_counter() - began
    envs.close()
    return took, learner.updates


def collector_loop(steps: int, seed: int) -> tuple[float, int]:
    """The collector's batches of TRAIN_FREQUENCY steps into a ReplayRing, one gradient step per batch."""
    random.seed(seed)  # the policy's epsilon draws, as CleanRL seeds them
    envs, learner = make_envs(seed), Learner(seed)
    collector = Collector(
        envs,
        learner.q,
        num_steps=TRAIN_FREQUENCY,
        total_timesteps=steps,
        gae=None,
        keys=BatchKeys(next_obs=True),
        backend="thread",
        prefetch=0,
        seed=seed,
    )
    ring = ReplayRing(BUFFER)
    began = time.perf_counter()
    step = 0
    learner.q.epsilon = epsilon(0, steps)
    for _ in ring.fill(collector):
        step += TRAIN_FREQUENCY
        learner.q.epsilon = epsilon(step, steps)
        if LEARNING_STARTS < step < steps:  # as many updates as CleanRL's loop, whose step counter stops short
            learner.update(ring.sample(BATCH))
            if step % TARGET_FREQUENCY == 0:
                learner.sync_target()
    took = time.perf_counter() - began
    collector.close()
    return took, learner.updates


SYSTEMS = {"hand loop (CleanRL's dqn.py)": hand_loop, "collector + ReplayRing, prefetch=0": collector_loop}


def split(repeats: int) -> None:
    """Each system's first 9,000 steps (no learning yet), with the env's step and the Q-network's forward timed.

    Prints microseconds per env step: the whole loop, the env's step, the forward, and the rest.
    """
    global make_envs, Learner
    spent: dict[str, float] = {}

    def timed(function: Any, part: str) -> Any:
        def call(*args: Any) -> Any:
            began = time.perf_counter()
            try:
                return function(*args)
            finally:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - began

        return call

    plain_envs, plain_learner = make_envs, Learner

    def envs_timed(seed: int) -> gym.vector.VectorEnv:
        envs = plain_envs(seed)
        envs.step = timed(envs.step, "env")
        return envs

    class LearnerTimed(plain_learner):  # type: ignore[misc, valid-type]
        def __init__(self, seed: int) -> None:
            super().__init__(seed)
            self.q.network.forward = timed(self.q.network.forward, "forward")

    make_envs, Learner = envs_timed, LearnerTimed
    steps = LEARNING_STARTS - 1000
    try:
        for repeat in range(repeats):
            for name, run in SYSTEMS.items():
                spent.clear()
                took, _ = run(steps, seed=repeat + 1)
                env, forward = spent["env"], spent.get("forward", 0.0)
                print(
                    f"{name:40s} us per step: {took / steps * 1e6:6.1f}  env {env / steps * 1e6:5.1f}  forward "
                    f"{forward / steps * 1e6:5.1f}  rest {(took - env - forward) / steps * 1e6:5.1f}"
                )
    finally:
        make_envs, Learner = plain_envs, plain_learner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--split", action="store_true", help="time the env's step and the forward (no learning)")
    args = parser.parse_args()
    quiet_warnings()
    torch.set_num_threads(1)
    if args.split:
        split(args.repeats)
        return
    started = os.getloadavg()[0]
    info = machine_info()
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    updates: dict[str, int] = {}
    for repeat in range(args.repeats):
        for name, run in SYSTEMS.items():
            took, updates[name] = run(args.steps, seed=repeat + 1)
            times[name].append(took)
            print(f"  repeat {repeat + 1}/{args.repeats}  {name:40s} {took:.2f} s ({updates[name]} gradient steps)")
    hand = times[next(iter(SYSTEMS))]
    rows = []
    for name, seconds in times.items():
        ratios = [h / s for h, s in zip(hand, seconds)]
        rows.append(
            [
                name,
                f"{statistics.median(seconds):.2f}",
                f"{min(seconds):.2f} - {max(seconds):.2f}",
                f"{statistics.median(hand) / statistics.median(seconds):.3f}x",
                f"{min(ratios):.3f} - {max(ratios):.3f}",
                updates[name],
            ]
        )
    header = ["system", "median s", "min - max s", "hand loop / system", "paired ratios", "gradient steps"]
    print()
    print(markdown_table(header, rows))
    print(f"\n({args.steps} steps, {args.repeats} repeats, one torch thread; {load_line(started)})")
    write_json("dqn_e2e", {"machine": info, "steps": args.steps, "repeats": args.repeats, "seconds": times})


if __name__ == "__main__":
    main()
