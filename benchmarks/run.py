"""Runs every benchmark and publishes the tables: the README's Performance section and JSON under benchmarks/results/.

Usage (after ``bash benchmarks/setup.sh``)::

    benchmarks/.venv/bin/python benchmarks/run.py           # full run: rewrites README.md's Performance section
    benchmarks/.venv/bin/python benchmarks/run.py --quick   # a smoke run (< 1 min): results/*_quick.*, README untouched

The README is only touched between the ``<!-- perf:start -->`` and
``<!-- perf:end -->`` markers; without them the section goes to
``results/performance.md`` instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import atari
import collect
import gae
import placement_ab
import ppo
import threads
import truncation
from _common import REPO_ROOT, RESULTS_DIR, machine_info, quiet_warnings, write_json

__all__ = ["main", "render", "update_readme"]

START, END = "<!-- perf:start -->", "<!-- perf:end -->"
README = REPO_ROOT / "README.md"
COMMAND = "bash benchmarks/setup.sh && benchmarks/.venv/bin/python benchmarks/run.py"


def _machine_line(info: dict[str, Any]) -> str:
    v = info["versions"]
    peers = ", ".join(
        f"{name} {v[name]}" for name in ("torchrl", "tensordict", "stable-baselines3", "rlox", "envpool", "gymnasium")
    )
    load = ""
    if "load_average_1m" in info:
        # the machine may be shared: the load says how much else ran meanwhile
        load = f", 1-min load average {info['load_average_1m']} at the start"
        if info.get("load_average_1m_end") is not None:
            load += f" and {info['load_average_1m_end']} at the end"
    gpu = f", GPU: {info['cuda']}" if info.get("cuda") else ", no GPU"
    return (
        f"Machine: {info['cpu_model']}, {info['cores']} cores{gpu}{load}; Python {info['python']}, "
        f"torch {info['torch']} with 1 intra-op thread (except in the thread-settings table); {peers}."
    )


def render(results: dict[str, dict[str, Any]], info: dict[str, Any], *, quick: bool, elapsed_s: float) -> str:
    """The Performance section's body (between the markers)."""
    parts = [
        "## Performance",
        "",
        "Measured side by side in one run on one machine; regenerate with",
        "",
        "```bash",
        COMMAND + (" --quick" if quick else ""),
        "```",
        "",
        _machine_line(info) + f" The whole run took {elapsed_s / 60:.1f} min.",
        "",
        "How: every system runs the same 64x64 tanh actor-critic (same weights in the collection benchmark) "
        "with the same env seeds on the CPU; systems are interleaved (A B C A B C ...) over the repeats, each "
        "repeat builds the system afresh and warms it up before the clock starts, and the tables give medians, "
        "the range over repeats and the ratio to a reference row (> 1: faster than it; in the collection "
        "tables torch_rollout's thread backend with prefetch 1). "
        "Collection counts real transitions: rows that only reset an env (gymnasium's NEXT_STEP autoreset) "
        "are not counted. Each collector computes GAE its own way as part of the work. The gymnasium-based "
        "systems step the same CartPole-v1 `SyncVectorEnv` (SB3 its equivalent `DummyVecEnv`); rlox native "
        "steps its own Rust CartPole; torch_rollout's `process` rows are K worker processes, each building its "
        'share of the same `SyncVectorEnv` from `functools.partial(gymnasium.make_vec, "CartPole-v1", '
        'vectorization_mode="sync")`; the `env id` row is torch_rollout\'s thread given the env id, for which '
        "`gymnasium.make_vec` builds the NumPy-vectorised `CartPoleVectorEnv`. "
        "The floors bound any collector on the SyncVectorEnv and this policy: the env stepped alone with "
        "pre-drawn actions, and the policy forward alone; the `ref:` rows step other CartPole implementations.",
        "",
    ]
    if quick:
        parts += ["_Quick mode: one short repeat per system; these numbers only show that everything runs._", ""]
    if "collect" in results:
        parts += [collect.to_markdown(results["collect"]), ""]
    if "placement" in results:
        parts += [
            placement_ab.to_markdown(results["placement"]),
            "Issue 8's bar, one worker process at least as fast as the thread, measured as paired rounds "
            "(`benchmarks/placement_ab.py`): the four collectors of the table are built once and kept; each "
            "round times each of them in a shuffled order, none working while another is timed, and the ratio "
            "of a round compares runs seconds apart. Medians of the round ratios, a bootstrap 95% interval of "
            "that median, and the rounds in which the process was faster.",
            "",
        ]
    if "atari" in results:
        parts += [atari.to_markdown(results["atari"]), ""]
    if "gae" in results:
        parts += [
            gae.to_markdown(results["gae"]),
            "rlox and the SB3-style loop take one `done` flag: their inputs fold the truncation bootstrap into the "
            "reward and are laid out as each API wants (rlox: env-major float64/float32 arrays; TorchRL: [N, T, 1]) "
            "before the clock starts. `max abs err` is against a float64 reference of the exact formula.",
            "",
        ]
    if "threads" in results:
        parts += [
            threads.to_markdown(results["threads"]),
            "Each setting runs in a fresh process without `OMP_NUM_THREADS`, after the main thread ran five "
            "forward and backward passes of a 64x64 MLP (so its intra-op thread team exists); processes alternate "
            "between the settings. The bar (issue 8): leaving torch's default costs at most 5% (>= 0.95x).",
            "",
        ]
    if "ppo" in results:
        parts += [
            ppo.to_markdown(results["ppo"]),
            "`examples/ppo.py` runs in each collector mode: `backend=thread` with `prefetch=0` (lockstep, the "
            "reference of `vs lockstep`) or `prefetch=1`, and `backend=process` with `num_workers` K = 1 or 2 "
            "(prefetch 1). CleanRL's hyperparameters are the same for all in the first table (8 envs x 128 steps, 4 "
            "epochs, minibatch 256, 64x64 tanh MLPs, Adam 2.5e-4 annealed, clipped value loss); the second runs "
            "`configs/ppo_cartpole.yaml` as `make run` does (only `total_timesteps` set; `backend=auto`, which "
            "picks one worker process for this CPU agent) beside the same config in the other modes, and SB3 with "
            "that config's hyperparameters (8 x 125 steps, 10 epochs, batch size 250, Adam 1e-3 annealed, no "
            "entropy bonus, no value clipping). HalfCheetah runs `configs/ppo_halfcheetah.yaml` without observation "
            "and reward normalisation in every row (the example keeps `normalize_obs` to the thread). Each run is a fresh "
            "process; steady state = from the end of the first iteration to the end of the last; `policy lag`: the "
            "mean over iterations of the example's `charts/policy_lag` (versions between the weights that collected "
            "a batch and those it trains; 0 by construction for SB3 and rlox). rlox steps its own Rust CartPole, "
            "the others gymnasium's. The bars (issue 8): the best mode >= 1.5x lockstep and >= 2.5x SB3 with the "
            "same hyperparameters.",
            "",
        ]
    if "truncation" in results:
        parts += [
            truncation.to_markdown(results["truncation"]),
            "A chain env that never terminates, truncated by a TimeLimit; the exact advantage of every real "
            "transition is known from the critic. `reset rows in loss`: NEXT_STEP reset rows (not transitions) "
            "that the system hands to the loss. Printed, not asserted.",
            "",
        ]
    parts.append("Raw numbers: `benchmarks/results/*.json`.")
    return "\n".join(parts).rstrip() + "\n"


def update_readme(section: str, readme: Path = README) -> Path:
    """Replaces the text between the perf markers of ``readme``; without markers writes results/performance.md.

    Returns the path written.
    """
    text = readme.read_text() if readme.exists() else ""
    start, end = text.find(START), text.find(END)
    if start == -1 or end == -1 or end < start:
        path = RESULTS_DIR / "performance.md"
        path.write_text(section)
        return path
    readme.write_text(text[: start + len(START)] + "\n" + section + text[end:])
    return readme


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (~4 min); leaves README.md alone")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["collect", "placement", "atari", "gae", "truncation", "threads", "ppo"],
        default=None,
        help="run only these parts",
    )
    parser.add_argument("--repeats", type=int, default=None, help="override the repeats of every part")
    parser.add_argument("--no-readme", action="store_true", help="write results/performance.md, not README.md")
    args = parser.parse_args(argv)
    quiet_warnings()
    parts = args.only or ["collect", "placement", "atari", "gae", "truncation", "threads", "ppo"]
    info = machine_info()
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for part in parts:
        part_start = time.perf_counter()
        if part == "collect":
            results[part] = collect.run(quick=args.quick, repeats=args.repeats)
        elif part == "placement":
            results[part] = placement_ab.run(quick=args.quick, rounds=args.repeats)
        elif part == "atari":
            results[part] = atari.run(quick=args.quick, repeats=args.repeats)
        elif part == "gae":
            results[part] = gae.run(quick=args.quick, repeats=args.repeats)
        elif part == "truncation":
            results[part] = truncation.run(quick=args.quick)
        elif part == "threads":
            results[part] = threads.run(quick=args.quick, repeats=args.repeats)
        elif part == "ppo":
            results[part] = ppo.run(quick=args.quick, repeats=args.repeats)
        print(f"[{part} took {time.perf_counter() - part_start:.1f} s]", flush=True)
    elapsed = time.perf_counter() - start
    info["load_average_1m_end"] = machine_info().get("load_average_1m")
    section = render(results, info, quick=args.quick, elapsed_s=elapsed)
    suffix = "_quick" if args.quick else ""
    write_json(f"run{suffix}", {"machine": info, "elapsed_s": elapsed, "parts": parts, "quick": args.quick})
    if args.quick or args.no_readme or args.only:
        target = RESULTS_DIR / f"performance{suffix}.md"
        target.write_text(section)
    else:
        target = update_readme(section)
    print(section)
    print(f"wrote {target.relative_to(REPO_ROOT)} ({elapsed:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
