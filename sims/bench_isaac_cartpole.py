"""Time to solve Isaac Lab's Isaac-Cartpole-Direct on the CPU: examples/ppo_continuous.py through the collector
against Isaac Lab's own training stack (rsl_rl's OnPolicyRunner over RslRlVecEnvWrapper, with the task's
CartpoleDirectPPORunnerCfg).

Run from the repository root, in Isaac Lab's venv (sims/build.sh isaaclab)::

    PYTHONPATH=$PWD ~/.cache/torch_rollout/sims/isaaclab/bin/python sims/bench_isaac_cartpole.py
    PYTHONPATH=$PWD ~/.cache/torch_rollout/sims/isaaclab/bin/python sims/bench_isaac_cartpole.py --plot  # PNG only

Both train on the same env (sims/isaaclab_setup.py: 256 envs on Newton/MuJoCo-Warp on Warp's CPU), with one torch
thread, each run in a fresh process, interleaved (rsl_rl seed 42, ours seed 42, rsl_rl seed 1, ...). A run's clock
starts once its env is built, before the first step: the wrapper, the runner or collector, the networks and every
step and update after count. The mean return is the same for both: the mean of the undiscounted returns of the last
(up to) 100 episodes that ended, rsl_rl's ``Mean reward`` (its logger's reward buffer) and examples/ppo_continuous.py's
mean_return with return_window=100, read after each iteration. A run reaches the target at the end of the first
iteration whose mean return is >= 4.67 (Isaac Lab's threshold of 280 of 300, with 3.0's rewards scaled by the step);
a run that has not within 150 iterations (rsl_rl's max_iterations for the task) or 120 s has not reached it. Writes
benchmarks/results/isaac_cartpole.json and the learning curves, docs/isaac_cartpole.png.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "ppo_isaac_cartpole.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "isaac_cartpole.json"
PLOT = ROOT / "docs" / "isaac_cartpole.png"
SEEDS = (42, 1, 2, 3)
NUM_ENVS, TARGET, CAP_S, MAX_ITERATIONS = 256, 4.67, 120.0, 150
SIDES = ("rsl_rl", "ours")

BUILT: float | None = None  # perf_counter when ours' env recipe returned


class Reached(Exception):
    """Ends a run at the target or the time cap."""


def timed_cartpole(num_envs: int, *, seed: int = 0):
    """examples/ppo_continuous.py's env recipe here: isaaclab_setup's, stamping when the env is built."""
    global BUILT
    from sims.isaaclab_setup import cartpole_direct

    envs = cartpole_direct(num_envs, seed=seed)
    BUILT = time.perf_counter()
    return envs


def run_rsl_rl(seed: int) -> dict:
    """Isaac Lab's train_rsl_rl, as it builds the runner: wrapper, runner, learn(init_at_random_ep_len)."""
    import torch
    from isaaclab_rl.rsl_rl import RslRlVecEnvWrapper, create_rsl_rl_runner, handle_deprecated_rsl_rl_cfg
    from isaaclab_rl.rsl_rl.utils import check_rsl_rl_version
    from isaaclab_tasks.core.cartpole.agents.rsl_rl_ppo_cfg import CartpoleDirectPPORunnerCfg

    from sims.isaaclab_setup import make_isaac_env

    torch.set_num_threads(1)
    agent_cfg = CartpoleDirectPPORunnerCfg()
    agent_cfg.device, agent_cfg.seed = "cpu", seed
    agent_cfg = handle_deprecated_rsl_rl_cfg(agent_cfg, check_rsl_rl_version())
    env = make_isaac_env("direct", NUM_ENVS, seed=seed)
    start = time.perf_counter()
    env = RslRlVecEnvWrapper(env, clip_actions=agent_cfg.clip_actions)
    # the logger keeps its reward buffer only with a log folder (its TensorBoard writer), as train_rsl_rl has one
    runner = create_rsl_rl_runner(env, agent_cfg, log_dir=tempfile.mkdtemp(prefix="rsl_rl-"))
    curve: list[tuple[float, float, int]] = []
    log = runner.logger.log

    def log_and_check(**kwargs):
        log(**kwargs)
        buffer = runner.logger.rewbuffer
        mean = statistics.fmean(buffer) if buffer else math.nan
        elapsed = time.perf_counter() - start
        curve.append((elapsed, mean, (kwargs["it"] + 1) * agent_cfg.num_steps_per_env * NUM_ENVS))
        if mean >= TARGET or elapsed > CAP_S:
            raise Reached

    runner.logger.log = log_and_check
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(Reached):  # its per-iteration table
        runner.learn(num_learning_iterations=MAX_ITERATIONS, init_at_random_ep_len=agent_cfg.init_at_random_ep_len)
    env.close()
    return {"curve": curve}


def run_ours(seed: int) -> dict:
    """examples/ppo_continuous.py with configs/ppo_isaac_cartpole.yaml, stopped at the target."""
    import csv

    spec = importlib.util.spec_from_file_location("ppo_continuous", ROOT / "examples" / "ppo_continuous.py")
    ppo = importlib.util.module_from_spec(spec)
    sys.modules["ppo_continuous"] = ppo  # dataclasses resolves annotations through sys.modules
    spec.loader.exec_module(ppo)
    run_dir = tempfile.mkdtemp(prefix="ppo-isaac-")
    overrides = [f"seed={seed}", f"run_dir={run_dir}", f"stop_return={TARGET}", "env_recipe=__main__:timed_cartpole"]
    cfg = ppo.load_config(CONFIG, overrides)
    assert cfg.num_envs == NUM_ENVS and cfg.return_window == 100, cfg
    called = time.perf_counter()  # the run's wall_time counts from here (ppo.train)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ppo.train(cfg)
    offset = BUILT - called
    with open(Path(run_dir) / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    curve = [(float(r["wall_time"]) - offset, float(r["charts/mean_return"]), int(float(r["step"]))) for r in rows]
    account = [line for line in printed.getvalue().splitlines() if line.startswith("collector over the run")]
    return {"curve": curve, "account": account[0] if account else None}


def reached(curve: list) -> float | None:
    """Seconds to the first iteration at or above the target, within the cap; None if none."""
    return next((t for t, mean, _ in curve if mean >= TARGET and t <= CAP_S), None)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"rsl_rl": "tab:orange", "ours": "tab:blue"}
    labels = {"rsl_rl": "Isaac Lab's rsl_rl runner", "ours": "examples/ppo_continuous.py + Collector"}
    for side in SIDES:
        for i, run in enumerate(results["runs"][side]):
            times, means = [p[0] for p in run["curve"]], [p[1] for p in run["curve"]]
            label = f"{labels[side]} (median {results['median_s'][side]:.1f} s)" if i == 0 else None
            ax.plot(times, means, color=colors[side], alpha=0.8, lw=1.2, label=label)
    ax.axhline(TARGET, color="gray", ls="--", lw=1, label=f"target {TARGET}")
    ax.set(
        xlabel="wall time from the env built (s)",
        ylabel="mean return (last 100 episodes)",
        title=f"Isaac-Cartpole-Direct on the CPU, {NUM_ENVS} envs, seeds {', '.join(map(str, SEEDS))}",
    )
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--one", choices=SIDES, help="one run in this process (what the benchmark starts)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", action="store_true", help="only the plot, from the results file")
    args = parser.parse_args()
    if args.one:
        result = (run_rsl_rl if args.one == "rsl_rl" else run_ours)(args.seed)
        args.out.write_text(json.dumps(result))
        return
    if args.plot:
        plot(json.loads(RESULTS.read_text()))
        return

    runs: dict[str, list] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in SEEDS:
            for side in SIDES:
                out, log = Path(tmp) / f"{side}-{seed}.json", Path(tmp) / f"{side}-{seed}.log"
                command = [sys.executable, __file__, "--one", side, "--seed", str(seed), "--out", str(out)]
                with open(log, "w") as f:
                    done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=os.environ, check=False)
                if done.returncode != 0:
                    sys.exit(f"{side} seed {seed} failed ({done.returncode}):\n{log.read_text()[-3000:]}")
                run = {"seed": seed, **json.loads(out.read_text())}
                run["time_s"] = reached(run["curve"])
                runs[side].append(run)
                time_text = f"{run['time_s']:.1f} s" if run["time_s"] is not None else f"not within {CAP_S:.0f} s"
                print(f"{side:>6} seed {seed:>2}: {time_text}, {run['curve'][-1][2]} env steps", flush=True)
                if run.get("account"):
                    print(f"         {run['account']}", flush=True)

    # a run that did not reach the target counts as the cap, for the median
    median = {side: statistics.median(r["time_s"] or math.inf for r in runs[side]) for side in SIDES}
    ratio = median["rsl_rl"] / median["ours"]
    for side in SIDES:
        times = ", ".join(f"{r['time_s']:.1f}" if r["time_s"] is not None else "-" for r in runs[side])
        print(f"{side:>6}: median {median[side]:.1f} s ({times})")
    print(f"rsl_rl's median / ours: {ratio:.2f}x")
    results = {
        "env": "Isaac-Cartpole-Direct, Newton/MuJoCo-Warp on Warp's CPU, compute_final_obs",
        "num_envs": NUM_ENVS,
        "seeds": list(SEEDS),
        "target": TARGET,
        "cap_s": CAP_S,
        "max_iterations": MAX_ITERATIONS,
        "mean_return": "mean undiscounted return of the last (up to) 100 episodes that ended, after each iteration",
        "clock": "from the env built, before the first step",
        "config": str(CONFIG.relative_to(ROOT)),
        "median_s": median,
        "ratio_rsl_rl_over_ours": ratio,
        "runs": runs,
    }
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    plot(results)


if __name__ == "__main__":
    main()
