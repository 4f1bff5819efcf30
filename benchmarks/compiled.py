"""Compiled acting policies (``Collector(compile_policy=True)``) against eager ones, on CartPole-v1 on the CPU.

For each N, interleaved (A B C ... per repeat) with one torch thread, the same
64x64 tanh actor-critic (Categorical head) and the same ``SyncVectorEnv`` as
benchmarks/collect.py:

- the Collector's real transitions/s, eager and compiled, on the thread
  (``prefetch=0``, the CPU thread's default) and in one worker process
  (``prefetch=1``, the default of ``backend="auto"`` on the CPU);
- the policy forward alone (sample, log-prob, value) on T recorded
  observation batches, eager and ``torch.compile``'d.

Compile time is reported apart: the time to the first batch of a compiled
thread collector after ``torch._dynamo.reset()`` (Inductor's on-disk cache is
warm after the first repeat, as it is for a user's second run), against an
eager one's. Graph counts: the graphs Dynamo compiled for a thread collector
over ``--check-batches`` batches in SAME_STEP mode, whose bootstraps value the
final observations of 1..N envs (padded to N by the collector), so a
recompilation per size would show. CPU time per call: the forward and
``get_value`` alone, eager and compiled, in this thread's CPU time (which other
jobs on the machine do not inflate as they do wall-clock time).

Usage::

    .venv/bin/python benchmarks/compiled.py [--quick] [--repeats R] [--num-envs 8 64]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import collect
import gymnasium as gym
import torch
from collect import _policy

from _common import (
    Session,
    fmt_rate,
    machine_info,
    main_of,
    markdown_table,
    record,
    run_interleaved,
    summarize,
)

__all__ = ["run"]

EAGER_THREAD = "eager, thread (prefetch=0)"
COMPILED_THREAD = "compiled, thread (prefetch=0)"
EAGER_PROCESS = "eager, process K=1 (prefetch=1)"
COMPILED_PROCESS = "compiled, process K=1 (prefetch=1)"
EAGER_FORWARD = "policy forward alone, eager"
COMPILED_FORWARD = "policy forward alone, compiled"


def collecting(num_envs: int, num_steps: int, seed: int, state: dict, *, backend: str, **kwargs: Any) -> Any:
    """collect.py's Collector on CartPole-v1 ``SyncVectorEnv``s, eager or compiled, on the thread or in one worker."""
    return collect.torch_rollout(num_envs, num_steps, seed, state, backend=backend, **kwargs)


def systems(num_envs: int, num_steps: int, seed: int, state: dict) -> dict[str, Callable[[], Session]]:
    args = (num_envs, num_steps, seed, state)
    return {
        EAGER_THREAD: lambda: collecting(*args, compile_policy=False, backend="thread", prefetch=0),
        COMPILED_THREAD: lambda: collecting(*args, compile_policy=True, backend="thread", prefetch=0),
        EAGER_PROCESS: lambda: collecting(*args, compile_policy=False, backend="process", prefetch=1),
        COMPILED_PROCESS: lambda: collecting(*args, compile_policy=True, backend="process", prefetch=1),
        EAGER_FORWARD: lambda: collect.policy_floor(*args),
        COMPILED_FORWARD: lambda: collect.policy_floor(*args, compiled=True),
    }


def forward_cpu_us(num_envs: int, seed: int, state: dict, *, repeats: int, calls: int = 500) -> dict[str, list[float]]:
    """CPU time (this thread's, so other jobs' load does not count) per call of the forward and of get_value,
    eager and compiled, interleaved: microseconds per call, one sample per repeat."""
    eager = _policy(state, seed).eval().requires_grad_(False)
    compiled = torch.compile(eager)
    functions = {
        "forward, eager": eager,
        "forward, compiled": compiled,
        "get_value, eager": eager.get_value,
        "get_value, compiled": torch.compile(eager.get_value),
    }
    obs = torch.randn(num_envs, 4)
    samples: dict[str, list[float]] = {name: [] for name in functions}
    with torch.no_grad():
        for function in functions.values():
            function(obs)  # compiles
        for _ in range(repeats):
            for name, function in functions.items():
                start = time.thread_time()
                for _ in range(calls):
                    function(obs)
                samples[name].append((time.thread_time() - start) / calls * 1e6)
    return samples


def first_batch_seconds(num_envs: int, num_steps: int, seed: int, state: dict, *, compile_policy: bool) -> float:
    """Seconds from building a thread collector to its first batch; compiled: after a reset of Dynamo's caches."""
    if compile_policy:
        torch._dynamo.reset()
    start = time.perf_counter()
    session = collecting(num_envs, num_steps, seed, state, compile_policy=compile_policy, backend="thread", prefetch=0)
    try:
        session.step()
    finally:
        session.close()
    return time.perf_counter() - start


def graphs_compiled(num_envs: int, num_steps: int, seed: int, state: dict, *, batches: int) -> dict[str, int]:
    """Graphs Dynamo compiles for a SAME_STEP thread collector over ``batches`` batches (bootstraps of 1..N envs)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    session = collecting(
        num_envs,
        num_steps,
        seed,
        state,
        compile_policy=True,
        backend="thread",
        prefetch=0,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    try:
        transitions = sum(session.step() for _ in range(batches))
    finally:
        session.close()
    return {"batches": batches, "transitions": transitions, "graphs": int(counters["stats"]["unique_graphs"])}


def run(
    *,
    quick: bool = False,
    check_batches: int = 20,
    seed: int = 0,
    repeats: int | None = None,
    num_envs: list[int] | None = None,
    num_steps: int = 128,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs the comparison and returns its results (also written to results/compiled.json)."""
    repeats, num_envs, state, results = collect.setup(quick, repeats, num_envs, num_steps, seed)
    for n in num_envs:
        timed = 1 if quick else max(2, 8192 // (n * num_steps))
        log(f"compiled: N={n} T={num_steps}, {repeats} repeat(s), {timed} timed batch(es) after 1 warm-up")
        rates = run_interleaved(systems(n, num_steps, seed, state), repeats=repeats, warmup=1, steps=timed, log=log)
        first = {"eager": [], "compiled": []}
        for _ in range(repeats):
            for kind in first:
                first[kind].append(first_batch_seconds(n, num_steps, seed, state, compile_policy=kind == "compiled"))
        log(f"  first batch (s): {first}")
        cpu = forward_cpu_us(n, seed, state, repeats=2 if quick else 7)
        log(f"  CPU us per call: { {name: round(statistics.median(v), 1) for name, v in cpu.items()} }")
        graphs = graphs_compiled(n, num_steps, seed, state, batches=2 if quick else check_batches)
        log(f"  graphs compiled, SAME_STEP: {graphs}")
        results["tables"][str(n)] = {
            "num_envs": n,
            "timed_batches": timed,
            "samples": rates,
            "rows": summarize(rates, EAGER_THREAD),
            "first_batch_s": first,
            "graphs": graphs,
            "cpu_us_per_call": cpu,
        }
    results["machine"]["load_average_1m_end"] = machine_info().get("load_average_1m")
    return record("compiled", results, quick=quick)


def to_markdown(results: dict[str, Any]) -> str:
    """One table per N, with the compiled/eager ratio of each pair, compile time and graph counts."""
    parts = []
    for table in results["tables"].values():
        med = {r["system"]: r["median"] for r in table["rows"]}
        pairs = {EAGER_THREAD: COMPILED_THREAD, EAGER_PROCESS: COMPILED_PROCESS, EAGER_FORWARD: COMPILED_FORWARD}
        rows = []
        for eager, compiled in pairs.items():
            for name in (eager, compiled):
                r = next(r for r in table["rows"] if r["system"] == name)
                ratio = f"{med[compiled] / med[eager]:.2f}x" if name == compiled else ""
                rows.append([name, fmt_rate(r["median"]), f"{fmt_rate(r['min'])} - {fmt_rate(r['max'])}", ratio])
        first = {kind: statistics.median(values) for kind, values in table["first_batch_s"].items()}
        title = f"CartPole-v1, T={results['config']['T']} x N={table['num_envs']}, one torch thread"
        parts.append(f"**{title}** (transitions/s, median of {results['config']['repeats']})\n\n")
        parts.append(markdown_table(["system", "median", "range", "compiled / eager"], rows))
        graphs = table["graphs"]
        parts.append(
            f"\n\nFirst batch of a thread collector (median): eager {first['eager']:.2f} s, compiled "
            f"{first['compiled']:.2f} s (compile time about {first['compiled'] - first['eager']:.1f} s). "
            f"Graphs compiled over {graphs['batches']} SAME_STEP batches: {graphs['graphs']}. CPU time per call "
            f"(median): "
            + ", ".join(f"{name} {statistics.median(v):.0f} us" for name, v in table["cpu_us_per_call"].items())
            + ".\n\n"
        )
    machine = results["machine"]
    parts.append(
        f"_1-min load: {machine.get('load_average_1m')} at the start, {machine.get('load_average_1m_end')} at the end; "
        f"{machine['cores']} cores, torch {machine['torch']}._\n"
    )
    return "".join(parts)


OPTIONS = (
    ("--num-envs", {"type": int, "nargs": "+", "default": None}),
    ("--check-batches", {"type": int, "default": 20}),
    ("--seed", {"type": int, "default": 0}),
)  # the command line beyond --quick and --repeats


def main() -> None:
    main_of(__doc__, run, to_markdown, *OPTIONS)


if __name__ == "__main__":
    main()
