"""Throughput on a real simulator framework: the env alone, a hand-written loop and the collector, side by side.

Run in one framework's venv (sims/build.sh) from the repository root, e.g.::

    PYTHONPATH=$PWD ~/.cache/torch_rollout/sims/gymnax/bin/python sims/bench_throughput.py --framework gymnax

``--framework`` is one of isaaclab, maniskill, playground (Playground's and Brax's envs), gymnax or mjlab. For each of
its cases (an env and a shape) every system below collects batches of ``T`` steps of ``N`` envs, timed as frames
per second (env steps times ``N``), interleaved (A B C ... A B C), each repeat after untimed warm-up batches:

- env alone: the framework's batched step with actions drawn beforehand, through the vector-env adapter the
  collector is given;
- policy alone: the policy's forward on a batch of observations, ``T`` times per batch;
- hand loop: what a user's own loop does with the same env and policy: act under ``torch.no_grad``, step, and
  store obs, action, reward and done into tensors of ``[T, N]`` allocated once;
- the collector on the trainer's thread (``prefetch=1``: it collects the next batch while the trainer holds this
  one, which here does nothing with it), in lockstep (``prefetch=0``), and, where the framework runs in worker
  processes, in ``Processes(k)`` that build their share of the envs from a recipe.

The hand loop, the env alone and the collectors on the thread share one env, which each system resets when it is
built (afresh every repeat); worker collectors are built once per case and their first batches of each repeat
discarded. The collector runs without GAE (``gae=None``), as the hand loop computes none. The floors are the env
alone, the policy alone and their serial sum ``1 / (1/env + 1/policy)``, what a loop that does nothing else
reaches. Each collector's ``collector.stats()`` of its last repeat is printed under the table. Torch runs with one
intra-op thread unless ``--threads`` says otherwise. Writes ``benchmarks/results/sims_<framework>.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import Tensor

sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))
from mlp_policy import MLPPolicy  # noqa: E402

from torch_rollout import Collector, Processes  # noqa: E402

from _common import fmt_rate, machine_info, markdown_table, write_json  # noqa: E402

__all__ = ["CASES", "Case", "main"]

WARMUP = 2  # untimed batches before each repeat: compiled, warm, and a worker collector's batch in hand drained


@dataclass(frozen=True, kw_only=True)
class Case:
    """One env and shape of a framework, and how each system gets it."""

    name: str  # the table's title
    make: Callable[[], Any]  # the vector env the collector is given (and the hand loop steps), in this process
    num_steps: int  # T
    batches: int  # timed batches per repeat
    recipe: Callable[[int], Any] | None = None  # make_envs(num_envs) for worker processes; None: none
    workers: tuple[int, ...] = ()  # the Processes(k) to run
    group: str | None = None  # the Dict observation's group the policy reads
    numpy: bool = False  # the env takes and returns NumPy arrays


def _obs(obs: Any, group: str | None) -> Tensor:
    return torch.as_tensor(obs if group is None else obs[group], dtype=torch.float32)


class _Batches:
    """A system as the timing loop sees it: ``step()`` collects one batch and returns its frames."""

    frames: int
    stats: Any = None

    def step(self) -> int:
        raise NotImplementedError

    def start_timing(self) -> None:
        """After the warm-up batches."""

    def close(self) -> None:
        """After the timed batches of a repeat."""


class EnvAlone(_Batches):
    """The env's step with actions drawn beforehand, ``T`` per batch."""

    def __init__(self, case: Case, envs: Any, policy: MLPPolicy) -> None:
        self.envs, self.num_steps = envs, case.num_steps
        self.frames = case.num_steps * envs.num_envs
        envs.reset(seed=0)
        generator = torch.Generator().manual_seed(0)
        space, n = envs.single_action_space, envs.num_envs
        if isinstance(space, spaces.Discrete):
            actions = torch.randint(int(space.n), (case.num_steps, n), generator=generator)
        else:
            actions = torch.rand((case.num_steps, n, *space.shape), generator=generator) * 2 - 1
        self.actions = [a.numpy() if case.numpy else a for a in actions]

    def step(self) -> int:
        for action in self.actions:
            self.envs.step(action)
        return self.frames


class PolicyAlone(_Batches):
    """The policy's forward on one batch of the env's observations, ``T`` times per batch."""

    def __init__(self, case: Case, envs: Any, policy: MLPPolicy) -> None:
        obs, _ = envs.reset(seed=0)
        self.obs = {case.group: _obs(obs, case.group)} if case.group else _obs(obs, None)
        self.policy, self.num_steps = policy, case.num_steps
        self.frames = case.num_steps * envs.num_envs

    def step(self) -> int:
        with torch.no_grad():
            for _ in range(self.num_steps):
                self.policy(self.obs)
        return self.frames


class HandLoop(_Batches):
    """A user's own loop: act, step, store obs, action, reward and done into ``[T, N]`` tensors allocated once."""

    def __init__(self, case: Case, envs: Any, policy: MLPPolicy) -> None:
        self.envs, self.policy, self.case = envs, policy, case
        self.obs, _ = envs.reset(seed=0)
        T, N = case.num_steps, envs.num_envs
        self.frames = T * N
        first = _obs(self.obs, case.group)
        with torch.no_grad():
            action = policy({case.group: first} if case.group else first)["action"]
        self.buffers = {
            "obs": torch.empty((T, *first.shape)),  # [T, N, obs_dim]
            "action": torch.empty((T, *action.shape), dtype=action.dtype),  # [T, N] or [T, N, act_dim]
            "reward": torch.empty((T, N)),
            "done": torch.empty((T, N), dtype=torch.bool),
        }

    def step(self) -> int:
        b, group, numpy = self.buffers, self.case.group, self.case.numpy
        with torch.no_grad():
            for t in range(self.case.num_steps):
                obs = _obs(self.obs, group)
                action = self.policy({group: obs} if group else obs)["action"]
                self.obs, reward, terminated, truncated, _ = self.envs.step(action.numpy() if numpy else action)
                b["obs"][t] = obs
                b["action"][t] = action
                b["reward"][t] = torch.as_tensor(reward)
                b["done"][t] = torch.as_tensor(terminated) | torch.as_tensor(truncated)
        return self.frames


class CollectorBatches(_Batches):
    """The collector's batches; ``collector.stats()`` kept over the timed ones."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.batches: Iterator[Any] = iter(collector)
        self.frames = collector.num_steps * collector.num_envs

    def step(self) -> int:
        next(self.batches)
        return self.frames

    def start_timing(self) -> None:
        self.collector.stats(reset=True)

    def close(self) -> None:
        self.stats = self.collector.stats()
        self.collector.close()


class Resumed(CollectorBatches):
    """A worker collector built once per case: a repeat resumes it (its warm-up batches drain what it collected
    ahead meanwhile), and the case's end closes it."""

    def close(self) -> None:
        self.stats = self.collector.stats()

    def close_now(self) -> None:
        self.collector.close()


def _collector(envs: Any, policy: MLPPolicy, case: Case, **options: Any) -> Collector:
    return Collector(envs, policy, num_steps=case.num_steps, device="cpu", gae=None, seed=0, **options)


def run_case(case: Case, *, repeats: int, batches: int) -> dict[str, Any]:
    """Times every system of ``case`` interleaved; returns frames/s per system and repeat, and the collectors'
    stats of the last repeat."""
    envs = case.make()
    obs_space = envs.single_observation_space
    obs_dim = int(np.prod((obs_space[case.group] if case.group else obs_space).shape))
    policy = MLPPolicy(obs_dim, envs.single_action_space, group=case.group)
    n = envs.num_envs
    systems: dict[str, Callable[[], _Batches]] = {
        "env alone": lambda: EnvAlone(case, envs, policy),
        "policy alone": lambda: PolicyAlone(case, envs, policy),
        "hand loop": lambda: HandLoop(case, envs, policy),
        "collector, thread, prefetch=1": lambda: CollectorBatches(
            _collector(envs, policy, case, backend="thread", prefetch=1)
        ),
        "collector, lockstep (prefetch=0)": lambda: CollectorBatches(
            _collector(envs, policy, case, backend="thread", prefetch=0)
        ),
    }
    resumed: dict[str, Resumed] = {}
    start = time.perf_counter()
    for k in case.workers if case.recipe is not None else ():
        name = f"collector, Processes({k}), prefetch=1"
        resumed[name] = Resumed(
            _collector(case.recipe, policy, case, num_envs=n, backend=Processes(k), prefetch=1, timeout=600)
        )
        systems[name] = lambda name=name: resumed[name]
    print(f"  {case.name}: {len(resumed)} worker collectors built in {time.perf_counter() - start:.1f} s", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in systems}
    stats: dict[str, str] = {}
    try:
        for repeat in range(repeats):
            for name, build in systems.items():
                system = build()
                try:
                    for _ in range(WARMUP):
                        system.step()
                    system.start_timing()
                    frames, start = 0, time.perf_counter()
                    for _ in range(batches):
                        frames += system.step()
                    elapsed = time.perf_counter() - start
                finally:
                    system.close()
                rates[name].append(frames / elapsed)
                if system.stats is not None:
                    stats[name] = str(system.stats)
                print(f"  repeat {repeat + 1}/{repeats}  {name:<36} {fmt_rate(frames / elapsed)} frames/s", flush=True)
    finally:
        for system in resumed.values():
            system.close_now()
        envs.close()
    return {"rates": rates, "stats": stats, "num_envs": n}


def summary(case: Case, result: dict[str, Any]) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The table's rows and the JSON's, with the floors and each system's ratio to the hand loop."""
    medians = {name: statistics.median(values) for name, values in result["rates"].items()}
    env, policy = medians["env alone"], medians["policy alone"]
    medians["floor: env and policy in series"] = 1 / (1 / env + 1 / policy)
    hand = medians["hand loop"]
    rows, records = [], []
    for name, median in medians.items():
        values = result["rates"].get(name, [median])
        rows.append(
            [name, fmt_rate(median), f"{fmt_rate(min(values))} - {fmt_rate(max(values))}", f"{median / hand:.2f}"]
        )
        records.append({"system": name, "median_fps": median, "fps": values, "ratio_to_hand_loop": median / hand})
    return rows, records


# Each framework's cases; the imports stay inside, as only the framework's own venv has them.


def isaaclab_cases() -> list[Case]:
    from isaaclab_setup import cartpole_usd, isaac_lab_envs

    recipe = functools.partial(isaac_lab_envs, kind="direct", usd=cartpole_usd())
    return [
        Case(
            name=f"Isaac-Cartpole-Direct, N={n}, T=16",
            make=functools.partial(recipe, n),
            num_steps=16,  # the task's rsl_rl config collects 16 steps per env per iteration
            batches=4,
            recipe=recipe,
            workers=(1,),
            group="policy",
        )
        for n in (64, 256)
    ]


def maniskill_cases() -> list[Case]:
    from maniskill_setup import cpu_envs, maniskill_vector_env

    # A step of one env costs about 1.5 ms: long batches, so that each timed stretch lasts seconds
    return [
        Case(name="PushCube-v1, ManiSkillVectorEnv, N=1, T=128", make=maniskill_vector_env, num_steps=128, batches=8),
        Case(
            name="PushCube-v1, SyncVectorEnv of 4 CPUGymWrapper, T=64",
            make=functools.partial(cpu_envs, 4),
            num_steps=64,
            batches=6,
            recipe=cpu_envs,
            workers=(1, 2),
            numpy=True,
        ),
    ]


def playground_cases() -> list[Case]:
    from playground_setup import jax_envs

    cases = []
    for framework, name, limit in (("playground", "CartpoleBalance", None), ("brax", "inverted_pendulum", 1000)):
        recipe = functools.partial(jax_envs, framework=framework, name=name, max_episode_steps=limit)
        cases.append(
            Case(
                name=f"{framework} {name} through FromJax, N=256, T=32",
                make=functools.partial(recipe, 256),
                num_steps=32,
                batches=4,
                recipe=recipe,
                workers=(1,),
            )
        )
    return cases


def gymnax_cases() -> list[Case]:
    from gymnax_setup import gymnax_envs

    return [
        Case(
            name="gymnax CartPole-v1, JaxToTorch, N=1024, T=32",
            make=functools.partial(gymnax_envs, 1024),
            num_steps=32,
            batches=8,
            recipe=gymnax_envs,
            workers=(1, 2),
        )
    ]


def mjlab_cases() -> list[Case]:
    from mjlab_setup import mjlab_envs

    # A step costs about 55 ms at 64 or 256 cartpoles (Warp's kernel launches, not physics) and about 280 ms at 32
    # Go1s (contacts): few, short batches, so that the framework's run stays within a few minutes
    cases = []
    for task, title, n, num_steps in (
        ("cartpole", "Mjlab-Cartpole-Balance (pole-fell termination)", 256, 32),
        ("go1", "Mjlab-Velocity-Flat-Unitree-Go1", 32, 8),
    ):
        recipe = functools.partial(mjlab_envs, task=task)
        cases.append(
            Case(
                name=f"{title} through FromMjlab, N={n}, T={num_steps}",
                make=functools.partial(recipe, n),
                num_steps=num_steps,
                batches=2,
                recipe=recipe,
                workers=(1,),
                group="actor",
            )
        )
    return cases


CASES: dict[str, Callable[[], list[Case]]] = {
    "isaaclab": isaaclab_cases,
    "maniskill": maniskill_cases,
    "playground": playground_cases,
    "gymnax": gymnax_cases,
    "mjlab": mjlab_cases,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", required=True, choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every system (default 3)")
    parser.add_argument("--batches", type=float, default=1.0, help="scale of each case's timed batches (default 1)")
    parser.add_argument("--threads", default="1", help="torch intra-op threads: a number, or 'default'")
    parser.add_argument("--no-json", action="store_true", help="print the tables only (a development run)")
    parser.add_argument("--suffix", default="", help="written as results/sims_<framework><suffix>.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # the frameworks' own deprecation warnings would drown the tables
    if args.threads != "default":
        torch.set_num_threads(int(args.threads))
    load_at_start = round(os.getloadavg()[0], 2)  # the machine may be shared: a high load explains noise
    cases = CASES[args.framework]()
    out: list[dict[str, Any]] = []
    tables = []
    for case in cases:
        batches = max(1, round(case.batches * args.batches))
        result = run_case(case, repeats=args.repeats, batches=batches)
        rows, records = summary(case, result)
        out.append(
            {
                "case": case.name,
                "num_envs": result["num_envs"],
                "num_steps": case.num_steps,
                "batches": batches,
                "warmup": WARMUP,
                "results": records,
                "stats": result["stats"],
            }
        )
        tables.append((case, rows, result["stats"]))
    info = {**machine_info(), "load_average_1m_start": load_at_start}
    print(
        f"\n{args.framework}: torch threads {torch.get_num_threads()}, {info['cores']} cores, "
        f"1-min load {load_at_start} at the start, {info.get('load_average_1m')} at the end, "
        f"{args.repeats} repeats, medians"
    )
    for case, rows, stats in tables:
        print(f"\n{case.name}\n")
        print(markdown_table(["system", "frames/s", "min - max", "/ hand loop"], rows))
        for name, line in stats.items():
            print(f"- {name}: {line}")
    if not args.no_json:
        path = write_json(
            f"sims_{args.framework}{args.suffix}",
            {"machine": info, "framework": args.framework, "repeats": args.repeats, "cases": out},
        )
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
