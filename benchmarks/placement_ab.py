"""Collection alone, one worker process against the thread, as paired rounds: the ratio and its uncertainty.

``collect.py`` builds every system afresh for each repeat and compares medians
of a few repeats; on a shared 2-core machine a drift in load between two
systems' turns then shows up as a gap. Here every collector is built once and
kept, and each round times every collector in turn (in a shuffled order) over
``--timed-batches`` batches. Each round gives a ratio per pair, process over
thread, measured within seconds of each other; the table reports the median of
those ratios with a bootstrap 95% interval.

Between turns no collector works: before its turn a collector hands over the
batch it prefetched (untimed), and after its turn the benchmark waits until the
batch it is prefetching is finished, so the next collector's timing has the
cores to itself. The systems are ``collect.py``'s (same envs, weights, seeds,
GAE; one torch thread).

Usage::

    benchmarks/.venv/bin/python benchmarks/placement_ab.py [--quick] [--num-envs 8 64] [--rounds 40] [--timed-batches 3]
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Any

import numpy as np
import torch
from collect import torch_rollout

from _common import fmt_rate, machine_info, main_of, make_policy, markdown_table, quiet_warnings, record

__all__ = ["run", "SYSTEMS", "PAIRS"]

SYSTEMS = {
    "thread prefetch=0": {"prefetch": 0},
    "thread prefetch=1": {"prefetch": 1},
    "process K=1 prefetch=0": {"prefetch": 0, "backend": "process", "num_workers": 1},
    "process K=1 prefetch=1": {"prefetch": 1, "backend": "process", "num_workers": 1},
}
# (numerator, denominator): one worker process against each thread mode
PAIRS = [
    ("process K=1 prefetch=1", "thread prefetch=1"),
    ("process K=1 prefetch=1", "thread prefetch=0"),
    ("process K=1 prefetch=0", "thread prefetch=0"),
]


def _settle(session: Any) -> None:
    """Waits until the batch the collector is prefetching is finished, so that it uses no core while others run."""
    placement = session.collector._placement  # a benchmark may look inside; the library does not offer this
    if session.collector.prefetch > 0:  # after next(), prefetch batches are asked for beyond those delivered
        placement.wait(None)


def _timed_turn(session: Any, batches: int) -> float:
    session.step()  # the batch prefetched before this turn (or, lockstep, one full batch): untimed
    items = 0
    start = time.perf_counter()
    for _ in range(batches):
        items += session.step()
    elapsed = time.perf_counter() - start
    _settle(session)
    return items / elapsed


def bootstrap_interval(ratios: list[float], *, resamples: int = 5000, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap 95% interval of the median of ``ratios``."""
    rng = np.random.default_rng(seed)
    values = np.asarray(ratios)
    medians = np.median(rng.choice(values, size=(resamples, len(values)), replace=True), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def run(
    *,
    quick: bool = False,
    num_envs: list[int] | None = None,
    rounds: int | None = None,
    timed_batches: int | None = None,
    num_steps: int = 128,
    seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    """Runs the paired rounds per N; returns rates per system and round, and the ratio rows.

    Args:
        quick: N=8, 3 rounds of one batch: checks that it runs (results/placement_ab_quick.json).
        num_envs: the N values (default [8, 64]).
        rounds: paired rounds per N (default 40).
        timed_batches: timed batches per collector per round (default 3).
    """
    num_envs = num_envs or ([8] if quick else [8, 64])
    rounds = rounds or (3 if quick else 40)
    timed_batches = timed_batches or (1 if quick else 3)
    quiet_warnings()
    torch.set_num_threads(1)
    state = make_policy(seed).state_dict()
    order_rng = random.Random(seed)
    results: dict[str, Any] = {
        "machine": machine_info(),
        "config": {"T": num_steps, "rounds": rounds, "timed_batches": timed_batches, "seed": seed, "quick": quick},
        "tables": {},
    }
    for n in num_envs:
        sessions = {name: torch_rollout(n, num_steps, seed, state, **kw) for name, kw in SYSTEMS.items()}
        try:
            for session in sessions.values():  # warm-up: first batches, lazy allocations
                for _ in range(2):
                    session.step()
                _settle(session)
            rates: dict[str, list[float]] = {name: [] for name in sessions}
            for r in range(rounds):
                names = list(sessions)
                order_rng.shuffle(names)
                for name in names:
                    rates[name].append(_timed_turn(sessions[name], timed_batches))
                log(f"  N={n} round {r + 1}/{rounds}  " + "  ".join(f"{k}: {fmt_rate(rates[k][-1])}" for k in rates))
        finally:
            for session in sessions.values():
                session.close()
        rows = []
        for a, b in PAIRS:
            ratios = [x / y for x, y in zip(rates[a], rates[b])]
            low, high = bootstrap_interval(ratios)
            rows.append(
                {
                    "pair": f"{a} / {b}",
                    "median_ratio": statistics.median(ratios),
                    "ci95": [low, high],
                    "rounds_above_1": sum(q > 1 for q in ratios),
                    "rounds": len(ratios),
                }
            )
        results["tables"][str(n)] = {
            "num_envs": n,
            "rates": rates,
            "medians": {k: statistics.median(v) for k, v in rates.items()},
            "rows": rows,
        }
    results["machine"]["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    return record("placement_ab", results, quick=quick)


def to_markdown(results: dict[str, Any]) -> str:
    parts = []
    for table in results["tables"].values():
        med = table["medians"]
        parts.append(
            f"**Collection alone, CartPole-v1, T={results['config']['T']} x N={table['num_envs']}**, "
            f"{results['config']['rounds']} paired rounds of {results['config']['timed_batches']} batches; "
            "medians (transitions/s): " + ", ".join(f"{k} {fmt_rate(v)}" for k, v in med.items()) + "\n\n"
        )
        rows = [
            [
                r["pair"],
                f"{r['median_ratio']:.3f}x",
                f"{r['ci95'][0]:.3f} - {r['ci95'][1]:.3f}",
                f"{r['rounds_above_1']}/{r['rounds']}",
            ]
            for r in table["rows"]
        ]
        parts.append(markdown_table(["pair", "median of round ratios", "bootstrap 95%", "rounds > 1"], rows))
        parts.append("\n\n")
    return "".join(parts).rstrip() + "\n"


OPTIONS = (
    ("--num-envs", {"type": int, "nargs": "+", "default": None, "help": "default: 8 64"}),
    ("--rounds", {"type": int, "default": None, "help": "default: 40"}),
    ("--timed-batches", {"type": int, "default": None, "help": "default: 3"}),
    ("--seed", {"type": int, "default": 0}),
)  # the command line beyond --quick and --repeats


def main() -> None:
    main_of(__doc__, run, to_markdown, *OPTIONS, quick="N=8, 3 rounds of one batch: checks that it runs", repeats=None)


if __name__ == "__main__":
    main()
