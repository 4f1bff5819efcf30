"""End-to-end PPO on CartPole-v1: torch_rollout's example trainer, SB3's ``PPO.learn``, rlox's ``Trainer("ppo")``.

Identical hyperparameters for all three: 8 envs x 128 steps, 4 epochs of
minibatches of 256, Adam 2.5e-4 annealed to 0, gamma 0.99, lambda 0.95, clip
0.2 (policy and value), entropy 0.01, value 0.5, grad-norm 0.5, 64x64 tanh
actor and critic, one torch thread, the CPU.

Each run is a fresh Python process, so no system inherits another's warm
caches or threads; runs are interleaved (A B C A B C ...). The throughput is
the steady state: env steps per second from the end of the first iteration
to the end of the last, which leaves out imports, env creation and the
example's final plot and checkpoint.

Usage::

    benchmarks/.venv/bin/python benchmarks/ppo.py [--quick] [--repeats R] [--total-timesteps N]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, machine_info, markdown_table, quiet_warnings, summarize, write_json

__all__ = ["run", "REFERENCE", "HYPERPARAMETERS"]

REFERENCE = "torch_rollout examples/ppo.py"
EXAMPLE = REPO_ROOT / "examples" / "ppo.py"
EXAMPLE_CONFIG = REPO_ROOT / "configs" / "ppo_cartpole.yaml"
HYPERPARAMETERS = {
    "num_envs": 8, "num_steps": 128, "epochs": 4, "minibatch": 256, "learning_rate": 2.5e-4, "gamma": 0.99,
    "gae_lambda": 0.95, "clip": 0.2, "ent_coef": 0.01, "vf_coef": 0.5, "max_grad_norm": 0.5,
}  # fmt: skip
H = HYPERPARAMETERS
_WORKER_TIMEOUT_S = 600


def _steady_rate(ends: list[float], steps_per_iteration: int) -> float:
    """Env steps/s between the end of the first iteration and the end of the last (``ends``: perf-counter times)."""
    if len(ends) < 2:
        raise RuntimeError(f"need at least 2 iterations to measure a steady state, got {len(ends)}")
    return (len(ends) - 1) * steps_per_iteration / (ends[-1] - ends[0])


# ------------------------------------------------------------------------------ one run per process


def run_example(total_timesteps: int, seed: int) -> dict[str, Any]:
    """Launches ``examples/ppo.py`` with the shared hyperparameters and reads its progress.csv.

    The example logs one CSV row per iteration with ``step`` and ``wall_time``
    (seconds since its start); the steady rate comes from the first and last rows.
    """
    with tempfile.TemporaryDirectory(prefix="bench_ppo_") as run_dir:
        overrides = [
            f"total_timesteps={total_timesteps}", f"seed={seed}", f"run_dir={run_dir}", "device=cpu",
            "torch_threads=1", "env_id=CartPole-v1", f"num_envs={H['num_envs']}", f"num_steps={H['num_steps']}",
            f"update_epochs={H['epochs']}", f"num_minibatches={H['num_envs'] * H['num_steps'] // H['minibatch']}",
            f"learning_rate={H['learning_rate']}", "anneal_lr=true", f"gamma={H['gamma']}",
            f"gae_lambda={H['gae_lambda']}", f"clip_coef={H['clip']}", "clip_vloss=true", f"ent_coef={H['ent_coef']}",
            f"vf_coef={H['vf_coef']}", f"max_grad_norm={H['max_grad_norm']}", "hidden_size=64", "norm_adv=true",
            "normalize_obs=false", "normalize_reward=false", "target_kl=null", "prefetch=1",
        ]  # fmt: skip
        command = [sys.executable, str(EXAMPLE)]
        if EXAMPLE_CONFIG.exists():
            command += ["--config", str(EXAMPLE_CONFIG)]
        start = time.perf_counter()
        proc = subprocess.run(
            command + overrides, cwd=REPO_ROOT, capture_output=True, text=True, timeout=_WORKER_TIMEOUT_S,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"examples/ppo.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(Path(run_dir) / "progress.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    steps = [float(r["step"]) for r in rows]
    walls = [float(r["wall_time"]) for r in rows]
    returns = [float(r["charts/mean_return"]) for r in rows]
    return {
        "steady_sps": (steps[-1] - steps[0]) / (walls[-1] - walls[0]),
        "iterations": len(rows),
        "env_steps": int(steps[-1]),
        "process_wall_s": wall,
        "final_mean_return": returns[-1],
    }


def worker_sb3(total_timesteps: int, seed: int) -> dict[str, Any]:
    """SB3 ``PPO.learn`` with the shared hyperparameters (in this process)."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)
    starts: list[float] = []

    class RolloutClock(BaseCallback):
        # a rollout starts right after the previous iteration's update ended
        def _on_rollout_start(self) -> None:
            starts.append(time.perf_counter())

        def _on_step(self) -> bool:
            return True

    lr = H["learning_rate"]
    model = PPO(
        "MlpPolicy", make_vec_env("CartPole-v1", n_envs=H["num_envs"], seed=seed), n_steps=H["num_steps"],
        batch_size=H["minibatch"], n_epochs=H["epochs"], learning_rate=lambda progress: lr * progress,
        gamma=H["gamma"], gae_lambda=H["gae_lambda"], clip_range=H["clip"], clip_range_vf=H["clip"],
        ent_coef=H["ent_coef"], vf_coef=H["vf_coef"], max_grad_norm=H["max_grad_norm"], normalize_advantage=True,
        policy_kwargs={"net_arch": {"pi": [64, 64], "vf": [64, 64]}, "activation_fn": torch.nn.Tanh},
        device="cpu", seed=seed, verbose=0,
    )  # fmt: skip
    model.learn(total_timesteps=total_timesteps, callback=RolloutClock())
    ends = starts[1:] + [time.perf_counter()]  # end of iteration k == start of rollout k+1
    episodes = [info["r"] for info in model.ep_info_buffer]
    return {
        "steady_sps": _steady_rate(ends, H["num_envs"] * H["num_steps"]),
        "iterations": len(ends),
        "env_steps": int(model.num_timesteps),
        "final_mean_return": statistics.fmean(episodes[-20:]) if episodes else float("nan"),
    }


def worker_rlox(total_timesteps: int, seed: int) -> dict[str, Any]:
    """rlox ``Trainer("ppo")`` on its native CartPole with the shared hyperparameters (in this process)."""
    import torch
    from rlox.callbacks import Callback
    from rlox.trainer import Trainer

    torch.set_num_threads(1)
    ends: list[float] = []

    class UpdateClock(Callback):
        # rlox calls on_step once per iteration, after the update epochs
        def on_step(self, **kwargs: Any) -> bool:
            ends.append(time.perf_counter())
            return True

    config = {
        "n_envs": H["num_envs"], "n_steps": H["num_steps"], "n_epochs": H["epochs"], "batch_size": H["minibatch"],
        "learning_rate": H["learning_rate"], "anneal_lr": True, "gamma": H["gamma"], "gae_lambda": H["gae_lambda"],
        "clip_eps": H["clip"], "clip_vloss": True, "ent_coef": H["ent_coef"], "vf_coef": H["vf_coef"],
        "max_grad_norm": H["max_grad_norm"], "normalize_advantages": True,
    }  # fmt: skip
    trainer = Trainer("ppo", env="CartPole-v1", config=config, seed=seed, callbacks=[UpdateClock()])
    trainer.train(total_timesteps=total_timesteps)
    episodes = trainer.algo.collector.episode_rewards
    return {
        "steady_sps": _steady_rate(ends, H["num_envs"] * H["num_steps"]),
        "iterations": len(ends),
        "env_steps": len(ends) * H["num_envs"] * H["num_steps"],
        "final_mean_return": statistics.fmean(episodes[-20:]) if episodes else float("nan"),
    }


WORKERS: dict[str, Callable[[int, int], dict[str, Any]]] = {"sb3": worker_sb3, "rlox": worker_rlox}


def _run_worker(kind: str, total_timesteps: int, seed: int) -> dict[str, Any]:
    """Runs ``ppo.py --worker kind`` in a fresh interpreter; returns the JSON it prints last."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", kind, "--total-timesteps", str(total_timesteps), "--seed", str(seed)],
        capture_output=True, text=True, timeout=_WORKER_TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"ppo worker {kind} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    result["process_wall_s"] = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------ driver


def systems() -> tuple[dict[str, Callable[[int, int], dict[str, Any]]], list[str]]:
    """name -> run(total_timesteps, seed), and notes on systems that cannot run here."""
    out: dict[str, Callable[[int, int], dict[str, Any]]] = {}
    notes = []
    if EXAMPLE.exists():
        out[REFERENCE] = run_example
    else:
        notes.append("examples/ppo.py not found: the torch_rollout trainer was skipped")
    if importlib.util.find_spec("stable_baselines3") is not None:
        out["SB3 PPO.learn"] = lambda n, s: _run_worker("sb3", n, s)
    else:
        notes.append("stable-baselines3 not installed: skipped")
    if importlib.util.find_spec("rlox") is not None:
        out['rlox Trainer("ppo"), native CartPole'] = lambda n, s: _run_worker("rlox", n, s)
    else:
        notes.append("rlox not installed: skipped")
    return out, notes


def run(
    *, quick: bool = False, repeats: int | None = None, total_timesteps: int | None = None, seed: int = 1,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    """Runs every trainer ``repeats`` times, interleaved; writes results/ppo.json.

    Args:
        quick: one repeat of 2 iterations (the fewest that give a steady-state rate).
        repeats: interleaved rounds (default 1 quick, 3 full).
        total_timesteps: env steps per run (default 2048 quick, 32768 full).
        seed: the seed every trainer gets.
        log: where progress lines go.
    """
    quiet_warnings()
    repeats = repeats or (1 if quick else 3)
    total_timesteps = total_timesteps or (2048 if quick else 32768)
    runners, notes = systems()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    details: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    log(f"ppo: {total_timesteps} env steps per run, {repeats} repeat(s)")
    for repeat in range(repeats):
        for name, runner in runners.items():
            result = runner(total_timesteps, seed)
            samples[name].append(result["steady_sps"])
            details[name].append(result)
            log(
                f"  repeat {repeat + 1}/{repeats}  {name:<40} {result['steady_sps']:.0f} steps/s "
                f"(process {result['process_wall_s']:.1f} s, final mean return {result['final_mean_return']:.1f})"
            )
    rows = summarize(samples, REFERENCE) if REFERENCE in samples else summarize(samples, next(iter(samples)))
    for row in rows:
        runs = details[row["system"]]
        row["final_mean_return"] = statistics.median(r["final_mean_return"] for r in runs)
        row["process_wall_s"] = statistics.median(r["process_wall_s"] for r in runs)
    results = {
        "machine": machine_info(),
        "config": {
            "total_timesteps": total_timesteps, "repeats": repeats, "seed": seed, "quick": quick, **HYPERPARAMETERS
        },
        "notes": notes, "samples": samples, "details": details, "rows": rows,
    }  # fmt: skip
    write_json("ppo_quick" if quick else "ppo", results)
    return results


def to_markdown(results: dict[str, Any]) -> str:
    """The end-to-end table."""
    cfg = results["config"]
    rows = [
        [r["system"], f"{r['median']:.0f}", f"{r['min']:.0f} - {r['max']:.0f}", f"{r['ratio']:.2f}x",
         f"{r['process_wall_s']:.1f}", f"{r['final_mean_return']:.1f}"]
        for r in results["rows"]
    ]  # fmt: skip
    title = (
        f"**End-to-end PPO, CartPole-v1, {cfg['total_timesteps']} env steps per run** "
        f"(steady-state env steps/s, median of {cfg['repeats']})"
    )
    header = ["trainer", "median", "range", "vs torch_rollout", "process wall s", "final mean return"]
    text = f"{title}\n\n{markdown_table(header, rows)}\n"
    for note in results["notes"]:
        text += f"\n_{note}_\n"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--total-timesteps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        quiet_warnings()
        print(json.dumps(WORKERS[args.worker](args.total_timesteps, args.seed)))
        return
    print(
        to_markdown(run(quick=args.quick, repeats=args.repeats, total_timesteps=args.total_timesteps, seed=args.seed))
    )


if __name__ == "__main__":
    main()
