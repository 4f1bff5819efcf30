"""The collector beside hand-written loops doing the same job, at the shapes where its fixed cost shows.

Cheap envs, cheap policies and short batches, the shapes where a hand-written loop has been faster. Each
shape runs its systems interleaved (A B C D A B C D ...), each built afresh per repeat, one torch thread:

- off-policy, into a replay ring (the systems of ``offpolicy.py``: a 64x64 Q-network acting greedily, the
  transitions' five keys written into a preallocated ring of tensors): gymnasium's CartPole-v1 in SAME_STEP
  mode at N=4 T=1, N=16 T=1 and N=4 T=8, and torch_rollout's torch CartPole at N=4096 T=1. The hand loop
  is CleanRL's (FastTD3's for the torch envs); the collector fills a ``ReplayRing`` with
  ``ring.fill(collector)``, ``prefetch=0``;
- on-policy with GAE (the benchmarks' 64x64 actor-critic, NEXT_STEP envs): a near-free NumPy vector env
  (a step costs a few microseconds) at N=16, gymnasium's CartPole-v1 ``SyncVectorEnv`` at N=16 and EnvPool's
  CartPole-v1 (sync, ``num_threads=1``) at N=64, all at T=128. The hand loop is CleanRL's ``ppo.py`` rollout
  (preallocated tensors, its GAE loop at the end); the collector runs with ``gae=GAE(0.99, 0.95)``,
  ``prefetch=0``.

Beside them, the floors of the same shape: the env alone on pre-drawn actions, the policy alone on recorded
observations, and their serial sum ``1 / (1 / env + 1 / policy)``. The table gives medians (frames/s: env
steps x N; the on-policy loops count real transitions, the floors every row), the collector's rate over the
hand loop's, of the medians and per repeat (the paired ratios' range), and each loop's rate over the serial
floor. Writes ``results/hand_loops.json``.

Usage::

    .venv/bin/python benchmarks/hand_loops.py [--repeats R] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import offpolicy
import torch

from _common import (
    CleanRLRollout,
    EnvAlone,
    PolicyAlone,
    cpu_collector,
    fmt_rate,
    has,
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

HAND, COLLECTOR, ENV, POLICY = "hand loop", "collector", "env alone", "policy alone"
ON_POLICY_STEPS = 128


class NearFreeEnvs(gym.vector.VectorEnv):
    """A NumPy vector env whose step costs a few microseconds: counters for observations, a reward of 1 a step,
    episodes of 20 to 84 steps (staggered over the envs), NEXT_STEP autoreset as gymnasium's default."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.length = 20 + 4 * (np.arange(num_envs) % 17)
        self.t = np.zeros(num_envs, dtype=np.int64)
        self.ended = np.zeros(num_envs, dtype=bool)
        self.obs = np.zeros((num_envs, 4), dtype=np.float32)
        self.not_truncated = np.zeros(num_envs, dtype=bool)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        self.t[:] = 0
        self.ended[:] = False
        self.obs[:] = 0.0
        return self.obs.copy(), {}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        reset = self.ended  # NEXT_STEP: an env whose episode ended last step resets in this one
        self.t += 1
        self.t[reset] = 0
        self.obs[:, 0] = self.t
        self.obs[:, 1] = actions
        self.ended = self.t >= self.length
        return self.obs.copy(), (~reset).astype(np.float32), self.ended.copy(), self.not_truncated, {}


def _on_policy_envs(kind: str, num_envs: int) -> Any:
    if kind == "free":
        return NearFreeEnvs(num_envs)
    if kind == "gym":
        return gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")
    import envpool

    return envpool.make_gymnasium("CartPole-v1", num_envs=num_envs, num_threads=1, seed=0)


def _on_policy_collector(kind: str, num_envs: int) -> Any:
    options: dict[str, Any] = {"num_steps": ON_POLICY_STEPS, "prefetch": 0, "seed": 0}
    if kind == "envpool":
        from torch_rollout import envpool_envs

        return cpu_collector(envpool_envs("CartPole-v1", num_threads=1), make_policy(), num_envs=num_envs, **options)
    envs = _on_policy_envs(kind, num_envs)
    return cpu_collector(envs, make_policy(), owned=envs, **options)


def _reset(envs: Any, kind: str) -> Any:
    """The first observations (EnvPool's pools are seeded when made)."""
    return (envs.reset() if kind == "envpool" else envs.reset(seed=0))[0]


def _on_policy_hand(kind: str, num_envs: int) -> CleanRLRollout:
    envs = _on_policy_envs(kind, num_envs)
    first = _reset(envs, kind)
    return CleanRLRollout(envs, make_policy(), first, num_steps=ON_POLICY_STEPS, num_envs=num_envs)


def _actions(kind: str, num_envs: int) -> np.ndarray:
    actions = np.random.default_rng(0).integers(0, 2, size=(ON_POLICY_STEPS, num_envs))
    return actions.astype(np.int32) if kind == "envpool" else actions


def _on_policy_env_alone(kind: str, num_envs: int) -> EnvAlone:
    envs = _on_policy_envs(kind, num_envs)
    _reset(envs, kind)
    return EnvAlone(envs, _actions(kind, num_envs), num_envs=num_envs)


def _on_policy_policy_alone(kind: str, num_envs: int) -> PolicyAlone:
    envs = _on_policy_envs(kind, num_envs)
    first = _reset(envs, kind)
    obs = recorded_obs(envs, first, _actions(kind, num_envs))
    envs.close()
    return PolicyAlone(make_policy(), obs, num_envs=num_envs)


ON_POLICY = {"free": "a near-free NumPy env", "gym": "gymnasium CartPole-v1", "envpool": "EnvPool CartPole-v1 (sync)"}


def shapes(quick: bool) -> list[tuple[str, dict[str, Callable[[], Any]]]]:
    """``(shape, systems by name)`` of every shape that can run here (EnvPool's if it is installed)."""
    found = []
    for kind, num_envs, num_steps in (("gym", 4, 1), ("gym", 16, 1), ("gym", 4, 8), ("torch", 4096, 1)):
        if quick and num_envs == 4096:
            continue
        systems = offpolicy.factories(kind, num_envs, num_steps, torchrl=False)
        chosen = {
            HAND: systems["hand loop"],
            COLLECTOR: systems["ReplayRing.fill(collector), prefetch=0"],
            ENV: systems["env alone"],
            POLICY: systems["policy alone"],
        }
        found.append((f"{offpolicy.shape_name(kind, num_envs, num_steps)}, into a replay ring", chosen))
    for kind, num_envs in (("free", 16), ("gym", 16), ("envpool", 64)):
        if kind == "envpool" and not has("envpool"):
            continue
        chosen = {
            HAND: functools.partial(_on_policy_hand, kind, num_envs),
            COLLECTOR: functools.partial(_on_policy_collector, kind, num_envs),
            ENV: functools.partial(_on_policy_env_alone, kind, num_envs),
            POLICY: functools.partial(_on_policy_policy_alone, kind, num_envs),
        }
        found.append((f"{ON_POLICY[kind]}, N={num_envs}, T={ON_POLICY_STEPS}, GAE", chosen))
    return found


def run(repeats: int, quick: bool) -> list[dict[str, Any]]:
    results = []
    for shape, systems in shapes(quick):
        print(shape, flush=True)
        rates = run_interleaved(systems, repeats=repeats, warmup=1, steps=2 if quick else 8, log=lambda _: None)
        medians = {name: statistics.median(values) for name, values in rates.items()}
        paired = [c / h for c, h in zip(rates[COLLECTOR], rates[HAND], strict=True)]
        results.append(
            {
                "shape": shape,
                "rates": rates,
                "medians": medians,
                "serial": serial_floor(medians[ENV], medians[POLICY]),
                "ratio": medians[COLLECTOR] / medians[HAND],
                "paired": [min(paired), max(paired)],
            }
        )
        print(f"  collector / hand loop {results[-1]['ratio']:.2f}x", flush=True)
    return results


def to_markdown(results: list[dict[str, Any]]) -> str:
    header = ["shape", HAND, COLLECTOR, "collector / hand loop", "paired ratios", ENV, POLICY]
    header += ["serial floor", "hand loop / floor", "collector / floor"]
    rows = []
    for result in results:
        medians, serial = result["medians"], result["serial"]
        low, high = result["paired"]
        rows.append(
            [
                result["shape"],
                fmt_rate(medians[HAND]),
                fmt_rate(medians[COLLECTOR]),
                f"{result['ratio']:.2f}x",
                f"{low:.2f} - {high:.2f}",
                fmt_rate(medians[ENV]),
                fmt_rate(medians[POLICY]),
                fmt_rate(serial),
                f"{medians[HAND] / serial:.2f}x",
                f"{medians[COLLECTOR] / serial:.2f}x",
            ]
        )
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats per shape (default 7; 1 quick)")
    parser.add_argument("--quick", action="store_true", help="one short repeat, no N=4096: a check, not a result")
    args = parser.parse_args()
    quiet_warnings()
    torch.set_num_threads(1)
    started = os.getloadavg()[0]
    info = machine_info()
    repeats = args.repeats or (1 if args.quick else 7)
    results = run(repeats, args.quick)
    table = to_markdown(results)
    print(f"\n{table}\n\n({repeats} repeats, one torch thread; {load_line(started)})")
    if not args.quick:
        write_json("hand_loops", {"machine": info, "repeats": repeats, "results": results, "table": table})


if __name__ == "__main__":
    main()
