"""SAC end to end: examples/sac.py's learner fed by the collector, against a CleanRL-style loop with the same learner.

Every system trains the same `SAC` learner of examples/sac.py (actor, twin critics, one gradient
step per env transition, fused Adam) from the same `ReplayBuffer`, on gymnasium's Pendulum-v1 with
4 envs, with the example's default config (configs/sac_pendulum.yaml) but for the run's length:

- hand loop: CleanRL's sac_continuous_action.py shape, one vector step at a time: the actor acts on
  the observations, the envs step (SAME_STEP: the final observation patched in from
  ``infos["final_obs"]``), the 4 transitions go into the buffer, then 4 gradient steps;
- the example's loop (``train`` of examples/sac.py without its logging) with the collector on the
  thread (``prefetch=1``), in one worker process (``Processes(1)``, ``prefetch=1``), and in
  lockstep (the thread with ``prefetch=0``: no overlap, the collector's own cost alone);
- floors: the learner alone (the same gradient steps on a full buffer, no env) and the env with
  the actor alone (the steps and forwards of the run, no learning). A loop that overlaps both
  perfectly takes the learner's time; the hand loop takes about their sum.

Systems run interleaved (A B C ... A B C), each a whole run from fresh envs and fresh networks of
the same seeds; medians over the repeats of the wall time of the loop (set-up excluded). The
ratio is the hand loop's time over the system's (above 1: faster). Each system's
``collector.stats()`` of its last repeat is printed beside it: where its time went. Runs with one
torch thread (the example's config) and, with ``--threads default``, with torch's default count.
Writes ``results/sac_e2e.json``.

Usage::

    .venv/bin/python benchmarks/sac_e2e.py [--steps 6000] [--repeats 3] [--threads 1|default]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import sac as example  # noqa: E402

from torch_rollout import BatchKeys, Collector, Processes, gym_envs  # noqa: E402

from _common import machine_info, markdown_table, quiet_warnings, write_json  # noqa: E402

__all__ = ["SYSTEMS", "main"]


def _config(steps: int, seed: int) -> example.Config:
    return example.load_config(example.DEFAULT_CONFIG, [f"total_timesteps={steps}", f"seed={seed}"])


def _learner(cfg: example.Config, envs: gym.vector.VectorEnv) -> example.SAC:
    torch.manual_seed(cfg.seed)
    return example.SAC(envs.single_observation_space.shape[0], envs.single_action_space, cfg, torch.device("cpu"))


def _make_envs(cfg: example.Config) -> gym.vector.VectorEnv:
    envs = gym_envs(cfg.env_id)(cfg.num_envs)
    envs.reset(seed=cfg.seed)
    return envs


def hand_loop(cfg: example.Config) -> tuple[float, Any]:
    """CleanRL's loop: act, step, patch the final observations in, store, then one gradient step per transition."""
    envs = gym.make_vec(
        cfg.env_id, num_envs=cfg.num_envs, vectorization_mode="sync", vector_kwargs={"autoreset_mode": "SameStep"}
    )
    sac = _learner(cfg, envs)
    generator = torch.Generator().manual_seed(cfg.seed)
    obs, _ = envs.reset(seed=cfg.seed)
    buffer, global_step = None, 0
    start = time.perf_counter()
    while global_step < cfg.total_timesteps:
        with torch.no_grad():
            action = sac.actor.sample(torch.as_tensor(obs, dtype=torch.float32))[0]
        next_obs, reward, terminated, truncated, infos = envs.step(action.numpy())
        real_next_obs = next_obs.copy()
        ended = terminated | truncated
        if ended.any():
            real_next_obs[ended] = np.stack(infos["final_obs"][ended])
        rows = TensorDict(
            {
                "obs": torch.as_tensor(obs, dtype=torch.float32),
                "action": action,
                "reward": torch.as_tensor(reward, dtype=torch.float32),
                "next_obs": torch.as_tensor(real_next_obs, dtype=torch.float32),
                "terminated": torch.as_tensor(terminated),
                "mask": torch.ones(cfg.num_envs, dtype=torch.bool),
            },
            batch_size=[cfg.num_envs],
        )
        buffer = buffer or example.ReplayBuffer(cfg.buffer_size, rows)
        buffer.extend(rows)
        obs = next_obs
        global_step += cfg.num_envs
        if global_step >= cfg.learning_starts:
            for _ in range(cfg.num_envs):
                sac.update(buffer.sample(cfg.batch_size, generator))
    elapsed = time.perf_counter() - start
    envs.close()
    return elapsed, None


def collector_loop(cfg: example.Config, backend: Any, prefetch: int) -> tuple[float, Any]:
    """The loop of examples/sac.py's train(), without its logging."""
    probe = gym_envs(cfg.env_id)(1)
    sac = _learner(cfg, probe)
    probe.close()
    generator = torch.Generator().manual_seed(cfg.seed)
    collector = Collector(
        gym_envs(cfg.env_id),
        sac.actor,
        num_envs=cfg.num_envs,
        num_steps=cfg.num_steps,
        backend=backend,
        device="cpu",
        gae=None,
        total_timesteps=cfg.total_timesteps,
        prefetch=prefetch,
        seed=cfg.seed,
        keys=BatchKeys(next_obs=True),
    )
    batch_steps, buffer, global_step, owed = cfg.num_envs * cfg.num_steps, None, 0, 0.0
    with collector:
        start = time.perf_counter()
        for batch in collector:
            global_step += batch_steps
            rows = batch.reshape(-1)
            buffer = buffer or example.ReplayBuffer(cfg.buffer_size, rows)
            buffer.extend(rows)
            if global_step >= cfg.learning_starts:
                owed += batch_steps * cfg.update_ratio
                while owed >= 1:
                    sac.update(buffer.sample(cfg.batch_size, generator))
                    owed -= 1
        elapsed = time.perf_counter() - start
        stats = collector.stats()
    return elapsed, stats


def learner_alone(cfg: example.Config) -> tuple[float, Any]:
    """The run's gradient steps on a buffer already full of random transitions: no env, no acting."""
    envs = gym_envs(cfg.env_id)(cfg.num_envs)
    sac = _learner(cfg, envs)
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    envs.close()
    n = cfg.learning_starts
    rows = TensorDict(
        {
            "obs": torch.randn(n, obs_dim),
            "action": torch.rand(n, act_dim) * 4 - 2,
            "reward": -torch.rand(n) * 10,
            "next_obs": torch.randn(n, obs_dim),
            "terminated": torch.zeros(n, dtype=torch.bool),
            "mask": torch.ones(n, dtype=torch.bool),
        },
        batch_size=[n],
    )
    buffer = example.ReplayBuffer(cfg.buffer_size, rows)
    buffer.extend(rows)
    generator = torch.Generator().manual_seed(cfg.seed)
    updates = int((cfg.total_timesteps - cfg.learning_starts + cfg.num_envs) * cfg.update_ratio)
    start = time.perf_counter()
    for _ in range(updates):
        sac.update(buffer.sample(cfg.batch_size, generator))
    return time.perf_counter() - start, None


def env_and_actor_alone(cfg: example.Config) -> tuple[float, Any]:
    """The run's env steps and actor forwards, one after the other, with nothing learned or stored."""
    envs = gym.make_vec(
        cfg.env_id, num_envs=cfg.num_envs, vectorization_mode="sync", vector_kwargs={"autoreset_mode": "SameStep"}
    )
    sac = _learner(cfg, envs)
    obs, _ = envs.reset(seed=cfg.seed)
    start = time.perf_counter()
    for _ in range(cfg.total_timesteps // cfg.num_envs):
        with torch.no_grad():
            action = sac.actor.sample(torch.as_tensor(obs, dtype=torch.float32))[0]
        obs, *_ = envs.step(action.numpy())
    elapsed = time.perf_counter() - start
    envs.close()
    return elapsed, None


SYSTEMS: dict[str, Callable[[example.Config], tuple[float, Any]]] = {
    "hand loop (CleanRL-style)": hand_loop,
    "collector, thread, prefetch=1": lambda cfg: collector_loop(cfg, "thread", 1),
    "collector, Processes(1), prefetch=1": lambda cfg: collector_loop(cfg, Processes(1), 1),
    "collector, lockstep (prefetch=0)": lambda cfg: collector_loop(cfg, "thread", 0),
    "floor: learner alone": learner_alone,
    "floor: env and actor alone": env_and_actor_alone,
}
REFERENCE = "hand loop (CleanRL-style)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6000, help="env transitions per run (default 6000)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every system (default 3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", default="1", help="torch intra-op threads: a number, or 'default'")
    parser.add_argument("--only", nargs="*", help="systems whose name starts with one of these")
    args = parser.parse_args()
    quiet_warnings()
    if args.threads != "default":
        torch.set_num_threads(int(args.threads))
    cfg = _config(args.steps, args.seed)
    systems = {name: run for name, run in SYSTEMS.items() if not args.only or name.startswith(tuple(args.only))}
    times: dict[str, list[float]] = {name: [] for name in systems}
    stats: dict[str, str] = {}
    for repeat in range(args.repeats):
        for name, run in systems.items():
            elapsed, account = run(cfg)
            times[name].append(elapsed)
            if account is not None:
                stats[name] = str(account)
            print(f"  repeat {repeat + 1}/{args.repeats}  {name:<38} {elapsed:7.2f} s", flush=True)
    reference = statistics.median(times[REFERENCE]) if REFERENCE in times else float("nan")
    rows, results = [], []
    for name, values in times.items():
        median = statistics.median(values)
        # paired ratios: each repeat's hand loop over this system's run of the same repeat
        pairs = [h / v for h, v in zip(times.get(REFERENCE, []), values, strict=False)]
        ratio = f"{reference / median:.3f}x" if not name.startswith("floor") or "learner" in name else ""
        spread = f"{min(pairs):.3f} - {max(pairs):.3f}" if pairs and ratio else ""
        rows.append([name, f"{median:.2f}", f"{min(values):.2f} - {max(values):.2f}", ratio, spread])
        results.append({"system": name, "median_s": median, "times_s": values, "paired_ratios": pairs})
    info = machine_info()
    print(
        f"\nSAC on {cfg.env_id}, {cfg.num_envs} envs, T={cfg.num_steps}, {args.steps} steps "
        f"(learning from {cfg.learning_starts}), torch threads {torch.get_num_threads()}, "
        f"{info['cores']} cores, load {info.get('load_average_1m')}"
    )
    header = ["system", "median s", "min - max s", "hand loop / system", "paired ratios"]
    print(markdown_table(header, rows))
    for name, line in stats.items():
        print(f"{name}: {line}")
    suffix = "" if args.threads == "1" else f"_threads_{args.threads}"
    write_json(
        f"sac_e2e{suffix}",
        {"machine": info, "steps": args.steps, "repeats": args.repeats, "results": results, "stats": stats},
    )


if __name__ == "__main__":
    main()
