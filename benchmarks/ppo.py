"""End-to-end PPO: torch_rollout's example in each collector mode, SB3's ``PPO.learn``, rlox's ``Trainer("ppo")``.

Three tables ("suites"):

- ``cleanrl``: CartPole-v1 with CleanRL's hyperparameters for all: 8 envs x
  128 steps, 4 epochs of minibatches of 256, Adam 2.5e-4 annealed to 0, gamma
  0.99, lambda 0.95, clip 0.2 (policy and value), entropy 0.01, value 0.5,
  grad-norm 0.5, 64x64 tanh actor and critic, one torch thread, the CPU.
  ``examples/ppo.py`` runs in four collector modes (thread lockstep, thread
  prefetch 1, 1 and 2 worker processes), each its own row.
- ``default``: CartPole-v1 as ``make run`` trains it: ``configs/ppo_cartpole.yaml``
  with no override but ``total_timesteps`` (and the output folder), the same
  config in the other modes, and SB3 with the hyperparameters read from that
  config (8 x 125 steps, 10 epochs, 4 minibatches, lr 1e-3, no entropy bonus,
  no value clipping, ...).
- ``halfcheetah``: HalfCheetah-v5 by mode, ``examples/ppo_continuous.py`` with ``configs/ppo_halfcheetah.yaml``
  with ``normalize_obs=false normalize_reward=false`` in every row, since the
  example keeps normalize_obs to the thread backend; only when mujoco is
  installed. Reported, without a best-mode line.

Each run is a fresh Python process, so no system inherits another's warm
caches or threads; runs are interleaved (A B C A B C ...). The throughput is
the steady state: env steps per second from the end of the first iteration
to the end of the last, which leaves out imports, env creation, worker start
and the example's final plot and checkpoint. The policy lag is the mean over
iterations of the example's ``charts/policy_lag`` (0 in lockstep).

Usage::

    benchmarks/.venv/bin/python benchmarks/ppo.py [--quick] [--repeats R] [--suites cleanrl default halfcheetah]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
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

from _common import REPO_ROOT, machine_info, markdown_table, quiet_warnings, record, summarize

__all__ = ["run", "to_markdown", "HYPERPARAMETERS", "MODES", "SUITES"]

EXAMPLE = REPO_ROOT / "examples" / "ppo.py"
CONTINUOUS = REPO_ROOT / "examples" / "ppo_continuous.py"  # Box actions with the normalising wrappers
CARTPOLE_CONFIG = REPO_ROOT / "configs" / "ppo_cartpole.yaml"
HALFCHEETAH_CONFIG = REPO_ROOT / "configs" / "ppo_halfcheetah.yaml"
HYPERPARAMETERS = {
    "num_envs": 8,
    "num_steps": 128,
    "epochs": 4,
    "minibatch": 256,
    "learning_rate": 2.5e-4,
    "anneal_lr": True,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "clip": 0.2,
    "clip_vloss": True,
    "ent_coef": 0.01,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
    "norm_adv": True,
    "target_kl": None,
    "hidden": 64,
    "adam_eps": 1e-5,
}
H = HYPERPARAMETERS
# The example's collector modes, as config overrides; the first is the lockstep reference.
MODES = {
    "thread, prefetch=0 (lockstep)": ["backend=thread", "prefetch=0"],
    "thread, prefetch=1": ["backend=thread", "prefetch=1"],
    "process K=1 (prefetch=1)": ["backend=process", "num_workers=1", "prefetch=1"],
    "process K=2 (prefetch=1)": ["backend=process", "num_workers=2", "prefetch=1"],
}
LOCKSTEP = "torch_rollout " + next(iter(MODES))
SB3 = "SB3 PPO.learn"
DEFAULT_ROW = "torch_rollout default config (make run; auto = process K=1)"
_WORKER_TIMEOUT_S = 600


def _steady_rate(ends: list[float], steps_per_iteration: int) -> float:
    """Env steps/s between the end of the first iteration and the end of the last (``ends``: perf-counter times)."""
    if len(ends) < 2:
        raise RuntimeError(f"need at least 2 iterations to measure a steady state, got {len(ends)}")
    return (len(ends) - 1) * steps_per_iteration / (ends[-1] - ends[0])


# ------------------------------------------------------------------------------ one run per process


def run_example(total_timesteps: int, config: Path, overrides: list[str], script: Path = EXAMPLE) -> dict[str, Any]:
    """Launches ``examples/ppo.py --config config`` with ``overrides`` and reads its progress.csv.

    The example logs one CSV row per iteration with ``step``, ``wall_time``
    (seconds since its start) and ``charts/policy_lag``; the steady rate comes
    from the first and last rows.
    """
    with tempfile.TemporaryDirectory(prefix="bench_ppo_") as run_dir:
        command = [sys.executable, str(script), "--config", str(config), f"total_timesteps={total_timesteps}"]
        command += [f"run_dir={run_dir}", *overrides]
        start = time.perf_counter()
        proc = subprocess.run(
            command,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=_WORKER_TIMEOUT_S,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"examples/ppo.py failed ({proc.returncode}): {command[2:]}\n{proc.stderr[-3000:]}")
        with open(Path(run_dir) / "progress.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    steps = [float(r["step"]) for r in rows]
    walls = [float(r["wall_time"]) for r in rows]
    returns = [float(r["charts/mean_return"]) for r in rows]
    lags = [float(r["charts/policy_lag"]) for r in rows if r.get("charts/policy_lag") not in (None, "")]
    # the first iteration waits for start-up (worker processes, first batch): the steady state leaves it out
    waits = [float(r["time/wait_s"]) for r in rows[1:]]
    updates = [float(r["time/update_s"]) for r in rows[1:]]
    if len(rows) < 2:
        raise RuntimeError(f"examples/ppo.py logged {len(rows)} iteration(s); a steady state needs 2")
    return {
        "steady_sps": (steps[-1] - steps[0]) / (walls[-1] - walls[0]),
        "iterations": len(rows),
        "env_steps": int(steps[-1]),
        "process_wall_s": wall,
        "final_mean_return": returns[-1],
        "policy_lag": statistics.fmean(lags) if lags else float("nan"),
        "wait_s": statistics.median(waits),
        "update_s": statistics.median(updates),
        "steps_per_iteration": steps[0],
    }


def cleanrl_overrides(seed: int) -> list[str]:
    """``examples/ppo.py`` overrides that set every hyperparameter of the ``cleanrl`` suite."""
    return [
        f"seed={seed}",
        "device=cpu",
        "torch_threads=1",
        "env_id=CartPole-v1",
        f"num_envs={H['num_envs']}",
        f"num_steps={H['num_steps']}",
        f"update_epochs={H['epochs']}",
        f"num_minibatches={H['num_envs'] * H['num_steps'] // H['minibatch']}",
        f"learning_rate={H['learning_rate']}",
        "anneal_lr=true",
        f"gamma={H['gamma']}",
        f"gae_lambda={H['gae_lambda']}",
        f"clip_coef={H['clip']}",
        "clip_vloss=true",
        f"ent_coef={H['ent_coef']}",
        f"vf_coef={H['vf_coef']}",
        f"max_grad_norm={H['max_grad_norm']}",
        f"hidden_size={H['hidden']}",
        "norm_adv=true",
        "target_kl=null",
        f"adam_eps={H['adam_eps']}",
    ]


def example_config(path: Path) -> dict[str, Any]:
    """The example's own reading of a config file (its dataclass defaults filled in), as a dict."""
    spec = importlib.util.spec_from_file_location("_bench_ppo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and get_type_hints look the module up
    try:
        spec.loader.exec_module(module)
        return dataclasses.asdict(module.load_config(path))
    finally:
        del sys.modules[spec.name]


def hyperparameters_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """The example's config in the terms of ``HYPERPARAMETERS`` (for SB3)."""
    if cfg.get("normalize_obs") or cfg.get("normalize_reward") or cfg.get("clip_action"):
        raise ValueError("hyperparameters_of: the SB3 worker does not mirror the normalising or clipping wrappers")
    return {
        "num_envs": cfg["num_envs"],
        "num_steps": cfg["num_steps"],
        "epochs": cfg["update_epochs"],
        # the example splits the batch's real transitions into num_minibatches; SB3 the whole batch
        "minibatch": cfg["num_envs"] * cfg["num_steps"] // cfg["num_minibatches"],
        "learning_rate": cfg["learning_rate"],
        "anneal_lr": cfg["anneal_lr"],
        "gamma": cfg["gamma"],
        "gae_lambda": cfg["gae_lambda"],
        "clip": cfg["clip_coef"],
        "clip_vloss": cfg["clip_vloss"],
        "ent_coef": cfg["ent_coef"],
        "vf_coef": cfg["vf_coef"],
        "max_grad_norm": cfg["max_grad_norm"],
        "norm_adv": cfg["norm_adv"],
        "target_kl": cfg["target_kl"],
        "hidden": cfg["hidden_size"],
        "adam_eps": cfg["adam_eps"],
    }


def worker_sb3(total_timesteps: int, seed: int, h: dict[str, Any]) -> dict[str, Any]:
    """SB3 ``PPO.learn`` with hyperparameters ``h`` (in this process)."""
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

    lr = h["learning_rate"]
    model = PPO(
        "MlpPolicy",
        make_vec_env("CartPole-v1", n_envs=h["num_envs"], seed=seed),
        n_steps=h["num_steps"],
        batch_size=h["minibatch"],
        n_epochs=h["epochs"],
        learning_rate=(lambda progress: lr * progress) if h["anneal_lr"] else lr,
        gamma=h["gamma"],
        gae_lambda=h["gae_lambda"],
        clip_range=h["clip"],
        clip_range_vf=h["clip"] if h["clip_vloss"] else None,
        ent_coef=h["ent_coef"],
        vf_coef=h["vf_coef"],
        max_grad_norm=h["max_grad_norm"],
        normalize_advantage=h["norm_adv"],
        target_kl=h["target_kl"],
        policy_kwargs={
            "net_arch": {"pi": [h["hidden"]] * 2, "vf": [h["hidden"]] * 2},
            "activation_fn": torch.nn.Tanh,
            "optimizer_kwargs": {"eps": h["adam_eps"]},
        },
        device="cpu",
        seed=seed,
        verbose=0,
    )
    model.learn(total_timesteps=total_timesteps, callback=RolloutClock())
    ends = starts[1:] + [time.perf_counter()]  # end of iteration k == start of rollout k+1
    episodes = [info["r"] for info in model.ep_info_buffer]
    return {
        "steady_sps": _steady_rate(ends, h["num_envs"] * h["num_steps"]),
        "iterations": len(ends),
        "env_steps": int(model.num_timesteps),
        "final_mean_return": statistics.fmean(episodes[-20:]) if episodes else float("nan"),
    }


def worker_rlox(total_timesteps: int, seed: int, h: dict[str, Any]) -> dict[str, Any]:
    """rlox ``Trainer("ppo")`` on its native CartPole with hyperparameters ``h`` (in this process)."""
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
        "n_envs": h["num_envs"],
        "n_steps": h["num_steps"],
        "n_epochs": h["epochs"],
        "batch_size": h["minibatch"],
        "learning_rate": h["learning_rate"],
        "anneal_lr": h["anneal_lr"],
        "gamma": h["gamma"],
        "gae_lambda": h["gae_lambda"],
        "clip_eps": h["clip"],
        "clip_vloss": h["clip_vloss"],
        "ent_coef": h["ent_coef"],
        "vf_coef": h["vf_coef"],
        "max_grad_norm": h["max_grad_norm"],
        "normalize_advantages": h["norm_adv"],
    }
    trainer = Trainer("ppo", env="CartPole-v1", config=config, seed=seed, callbacks=[UpdateClock()])
    trainer.train(total_timesteps=total_timesteps)
    episodes = trainer.algo.collector.episode_rewards
    return {
        "steady_sps": _steady_rate(ends, h["num_envs"] * h["num_steps"]),
        "iterations": len(ends),
        "env_steps": len(ends) * h["num_envs"] * h["num_steps"],
        "final_mean_return": statistics.fmean(episodes[-20:]) if episodes else float("nan"),
    }


WORKERS: dict[str, Callable[[int, int, dict[str, Any]], dict[str, Any]]] = {"sb3": worker_sb3, "rlox": worker_rlox}


def _run_worker(kind: str, total_timesteps: int, seed: int, h: dict[str, Any]) -> dict[str, Any]:
    """Runs ``ppo.py --worker kind`` in a fresh interpreter; returns the JSON it prints last."""
    start = time.perf_counter()
    command = [sys.executable, __file__, "--worker", kind, "--total-timesteps", str(total_timesteps)]
    command += ["--seed", str(seed), "--hparams", json.dumps(h)]
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=_WORKER_TIMEOUT_S,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"ppo worker {kind} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    result["process_wall_s"] = time.perf_counter() - start
    result["policy_lag"] = 0.0  # both collect with the weights they then update: no lag by construction
    return result


# ------------------------------------------------------------------------------ suites


@dataclasses.dataclass
class Suite:
    """One table: its systems (name -> run(total_timesteps, seed)), and what the table says about them."""

    title: str
    steps: tuple[int, int]  # env steps per run: (quick, full)
    repeats: int  # full-run repeats
    runners: dict[str, Callable[[int, int], dict[str, Any]]]
    notes: list[str]
    hyperparameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    with_best_mode: bool = False  # print the best mode's ratios under the table
    reference: str = LOCKSTEP


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def suite_cleanrl() -> Suite:
    runners: dict[str, Callable[[int, int], dict[str, Any]]] = {}
    notes = []
    for mode, overrides in MODES.items():
        runners[f"torch_rollout {mode}"] = lambda n, s, o=overrides: run_example(
            n, CARTPOLE_CONFIG, cleanrl_overrides(s) + o
        )
    if _has("stable_baselines3"):
        runners[SB3] = lambda n, s: _run_worker("sb3", n, s, H)
    else:
        notes.append("stable-baselines3 not installed: skipped")
    if _has("rlox"):
        runners['rlox Trainer("ppo"), native CartPole'] = lambda n, s: _run_worker("rlox", n, s, H)
    else:
        notes.append("rlox not installed: skipped")
    return Suite(
        "End-to-end PPO, CartPole-v1, CleanRL's hyperparameters (8 x 128 steps, 4 epochs)",
        (2048, 32768),
        3,
        runners,
        notes,
        hyperparameters=dict(H),
        with_best_mode=True,
    )


def suite_default() -> Suite:
    cfg = example_config(CARTPOLE_CONFIG)
    h = hyperparameters_of(cfg)
    # the make-run row takes no override but the step budget; the other modes add only theirs
    runners: dict[str, Callable[[int, int], dict[str, Any]]] = {
        DEFAULT_ROW: lambda n, s: run_example(n, CARTPOLE_CONFIG, []),
    }
    for mode, overrides in MODES.items():
        if mode != "process K=1 (prefetch=1)":  # what auto picks: the row above
            runners[f"torch_rollout default config, {mode}"] = lambda n, s, o=overrides: run_example(
                n, CARTPOLE_CONFIG, o
            )
    notes = []
    if _has("stable_baselines3"):
        runners[f"{SB3}, same hyperparameters"] = lambda n, s: _run_worker("sb3", n, cfg["seed"], h)
    else:
        notes.append("stable-baselines3 not installed: skipped")
    return Suite(
        title=(
            f"End-to-end PPO, CartPole-v1, the default config (configs/ppo_cartpole.yaml: {h['num_envs']} x "
            f"{h['num_steps']} steps, {h['epochs']} epochs)"
        ),
        reference=f"torch_rollout default config, {next(iter(MODES))}",
        steps=(2000, 20000),
        repeats=3,
        runners=runners,
        notes=notes,
        hyperparameters=h,
        with_best_mode=True,
    )


def suite_halfcheetah() -> Suite:
    runners: dict[str, Callable[[int, int], dict[str, Any]]] = {}
    notes = []
    if not _has("mujoco"):
        notes.append('mujoco not installed (pip install "gymnasium[mujoco]"): HalfCheetah skipped')
    elif not HALFCHEETAH_CONFIG.exists():
        notes.append(f"{HALFCHEETAH_CONFIG.relative_to(REPO_ROOT)} not found: HalfCheetah skipped")
    else:
        # the example keeps normalize_obs to the thread backend: every row goes without normalisation
        common = ["normalize_obs=false", "normalize_reward=false", "device=cpu"]
        for mode, overrides in MODES.items():
            runners[f"torch_rollout {mode}"] = lambda n, s, o=overrides: run_example(
                n, HALFCHEETAH_CONFIG, [f"seed={s}", *common, *o], CONTINUOUS
            )
    return Suite(
        "End-to-end PPO, HalfCheetah-v5, configs/ppo_halfcheetah.yaml without obs/reward normalisation",
        (4096, 12288),
        2,
        runners,
        notes,
    )


SUITES: dict[str, Callable[[], Suite]] = {
    "cleanrl": suite_cleanrl,
    "default": suite_default,
    "halfcheetah": suite_halfcheetah,
}


# ------------------------------------------------------------------------------ driver


def run_suite(
    suite: Suite,
    *,
    quick: bool,
    repeats: int | None,
    total_timesteps: int | None,
    seed: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Runs every system of ``suite`` ``repeats`` times, interleaved."""
    repeats = repeats or (1 if quick else suite.repeats)
    total_timesteps = total_timesteps or suite.steps[0 if quick else 1]
    samples: dict[str, list[float]] = {name: [] for name in suite.runners}
    details: dict[str, list[dict[str, Any]]] = {name: [] for name in suite.runners}
    log(f"ppo: {suite.title}: {total_timesteps} env steps per run, {repeats} repeat(s)")
    for repeat in range(repeats):
        for name, runner in suite.runners.items():
            result = runner(total_timesteps, seed)
            samples[name].append(result["steady_sps"])
            details[name].append(result)
            log(
                f"  repeat {repeat + 1}/{repeats}  {name:<58} {result['steady_sps']:.0f} steps/s "
                f"(process {result['process_wall_s']:.1f} s, lag {result['policy_lag']:.2f}, "
                f"final mean return {result['final_mean_return']:.1f})"
            )
    rows = summarize(samples, suite.reference) if suite.reference in samples else []
    for row in rows:
        runs = details[row["system"]]
        for key in ("final_mean_return", "process_wall_s", "policy_lag", "wait_s", "update_s", "steps_per_iteration"):
            values = [r[key] for r in runs if key in r]
            row[key] = statistics.median(values) if values else None
    return {
        "title": suite.title,
        "reference": suite.reference,
        "with_best_mode": suite.with_best_mode,
        "config": {"total_timesteps": total_timesteps, "repeats": repeats, "seed": seed, **suite.hyperparameters},
        "notes": suite.notes,
        "samples": samples,
        "details": details,
        "rows": rows,
    }


def run(
    *,
    quick: bool = False,
    repeats: int | None = None,
    total_timesteps: int | None = None,
    seed: int = 1,
    suites: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs the suites one after another; writes results/ppo.json (results/ppo_quick.json when ``quick``).

    Args:
        quick: one repeat of 2 iterations per system (the fewest that give a steady-state rate).
        repeats: interleaved rounds (default 1 quick; 3 full, 2 for HalfCheetah).
        total_timesteps: env steps per run, for every suite (default: the suite's own).
        seed: the seed every trainer gets (the default-config suite keeps the config's).
        suites: which of :data:`SUITES` to run (default all).
        log: where progress lines go.
    """
    quiet_warnings()
    results: dict[str, Any] = {"machine": machine_info(), "quick": quick, "suites": {}}
    for key in suites or list(SUITES):
        suite = SUITES[key]()
        results["suites"][key] = run_suite(
            suite, quick=quick, repeats=repeats, total_timesteps=total_timesteps, seed=seed, log=log
        )
    return record("ppo", results, quick=quick)


def best_mode(table: dict[str, Any]) -> str:
    """One line, read off a CartPole table: the best torch_rollout mode vs lockstep and vs SB3."""
    med = {r["system"]: r["median"] for r in table["rows"]}
    ours = {name: value for name, value in med.items() if name.startswith("torch_rollout")}
    sb3 = next((value for name, value in med.items() if name.startswith(SB3)), None)
    if not ours or table["reference"] not in med:
        return ""
    best = max(ours, key=ours.get)
    vs_lockstep = ours[best] / med[table["reference"]]
    text = f"Best mode: {best.removeprefix('torch_rollout ')}, {vs_lockstep:.2f}x lockstep"
    if sb3:
        vs_sb3 = ours[best] / sb3
        text += f", {vs_sb3:.2f}x {SB3}"
    return text + "."


def ceilings(table: dict[str, Any]) -> str:
    """The floors of the lockstep row, measured in the same run, and the ceilings of overlap they imply.

    In lockstep the trainer waits for the whole collection of a batch (``C``,
    GAE included) and then updates (``U``): their serial sum is lockstep. One
    collector beside the trainer can at best hide the shorter of the two
    (perfect overlap: one batch per ``max(C, U)``); with every bit of both spread
    over the machine's 2 cores nothing beats ``(C + U) / 2`` per batch.
    """
    ref = next((r for r in table["rows"] if r["system"] == table["reference"]), None)
    if ref is None or not ref.get("wait_s") or not ref.get("update_s") or not ref.get("steps_per_iteration"):
        return ""
    c, u = ref["wait_s"], ref["update_s"]
    steps = ref["steps_per_iteration"]
    serial, overlap, two_cores = steps / (c + u), steps / max(c, u), steps / ((c + u) / 2)
    lockstep = ref["median"]
    return (
        f"Floors, from the lockstep row: collecting a batch C = {c * 1e3:.0f} ms (GAE included), updating on it "
        f"U = {u * 1e3:.0f} ms; their serial sum is {serial:.0f} steps/s ({serial / lockstep:.2f}x lockstep, the "
        f"rest is the trainer's logging). Ceiling of one collector beside the trainer (perfect overlap, "
        f"max(C, U)): {overlap:.0f} steps/s = {overlap / lockstep:.2f}x lockstep; of both halves spread "
        f"perfectly over 2 cores ((C + U) / 2): {two_cores:.0f} steps/s = {two_cores / lockstep:.2f}x lockstep."
    )


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.0f}"


def _return(value: float | None) -> str:
    # nan: no episode ended within the run (HalfCheetah's last 1000 steps in a short run)
    return "n/a" if value is None or value != value else f"{value:.1f}"


def to_markdown(results: dict[str, Any]) -> str:
    """The end-to-end tables, one per suite."""
    parts = []
    for table in results["suites"].values():
        cfg = table["config"]
        rows = [
            [
                r["system"],
                f"{r['median']:.0f}",
                f"{r['min']:.0f} - {r['max']:.0f}",
                f"{r['ratio']:.2f}x",
                f"{r['policy_lag']:.2f}",
                _ms(r.get("wait_s")),
                _ms(r.get("update_s")),
                f"{r['process_wall_s']:.1f}",
                _return(r["final_mean_return"]),
            ]
            for r in table["rows"]
        ]
        title = (
            f"**{table['title']}, {cfg['total_timesteps']} env steps per run** "
            f"(steady-state env steps/s, median of {cfg['repeats']})"
        )
        text = title + "\n\n"
        if rows:
            header = [
                "trainer",
                "median",
                "range",
                "vs lockstep",
                "policy lag",
                "wait ms/iter",
                "update ms/iter",
                "process wall s",
                "final mean return",
            ]
            text += markdown_table(header, rows) + "\n"
            floors = ceilings(table)
            if floors:
                text += f"\n{floors}\n"
        if table.get("with_best_mode", table.get("with_bars")) and rows:  # with_bars: results of older runs
            text += f"\n{best_mode(table)}\n"
        for note in table["notes"]:
            text += f"\n_{note}_\n"
        parts.append(text)
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--total-timesteps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--suites", nargs="+", choices=sorted(SUITES), default=None)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--hparams", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        quiet_warnings()
        print(json.dumps(WORKERS[args.worker](args.total_timesteps, args.seed, json.loads(args.hparams))))
        return
    results = run(
        quick=args.quick,
        repeats=args.repeats,
        total_timesteps=args.total_timesteps,
        seed=args.seed,
        suites=args.suites,
    )
    print(to_markdown(results))


if __name__ == "__main__":
    main()
