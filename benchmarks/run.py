"""Runs every benchmark and publishes the tables: the docs' performance pages and JSON under benchmarks/results/.

Usage (after ``bash benchmarks/setup.sh``)::

    benchmarks/.venv/bin/python benchmarks/run.py           # full run: rewrites docs/performance*.md
    benchmarks/.venv/bin/python benchmarks/run.py --quick   # a smoke run: results/*_quick.*, docs untouched
    benchmarks/.venv/bin/python benchmarks/run.py --pages   # no run: the pages of single_scripts.md rewritten

A full run writes docs/performance-full-run.md from its own tables, and the other
performance pages (the index docs/performance.md and the measurements of single
scripts) from ``benchmarks/single_scripts.md`` (edit them there, not in docs/),
each with a list of its sections after its first paragraph. A partial run
(``--only``) or ``--no-docs`` writes ``results/performance.md`` instead.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
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

import _common
from _common import REPO_ROOT, RESULTS_DIR, machine_info, quiet_warnings, write_json

__all__ = ["main", "render"]

DOCS = REPO_ROOT / "docs"
# The parts whose run() takes quick and repeats (truncation takes no repeats, placement_ab rounds).
PARTS: dict[str, Any] = {"collect": collect, "atari": atari, "gae": gae, "threads": threads, "ppo": ppo}
PAGE = DOCS / "performance-full-run.md"
SINGLE_SCRIPTS = Path(__file__).with_name("single_scripts.md")
COMMAND = "bash benchmarks/setup.sh && benchmarks/.venv/bin/python benchmarks/run.py"
# The results file each part writes when it runs (its key's name unless listed)
RECORDS = {"placement": "placement_ab"}


# The run's sections in page order: the key of its part, its title, its module and the note under its table.
SECTIONS: list[tuple[str, str, Any, str]] = [
    (
        "collect",
        "Collection",
        collect,
        "",
    ),
    (
        "placement",
        "One worker process against the thread",
        placement_ab,
        "One worker process against the thread, measured as paired rounds (`benchmarks/placement_ab.py`): "
        "the four collectors of the collection tables are built once and kept; each round times each of them "
        "in a shuffled order, none working while another is timed, and the ratio of a round compares runs "
        "seconds apart. Medians of the round ratios, a bootstrap 95% interval of that median, and the rounds "
        "in which the process was faster.",
    ),
    (
        "atari",
        "Atari",
        atari,
        "",
    ),
    (
        "gae",
        "GAE",
        gae,
        "rlox and the SB3-style loop take one `done` flag: their inputs fold the truncation bootstrap into the "
        "reward and are laid out as each API wants (rlox: env-major float64/float32 arrays; TorchRL: [N, T, 1]) "
        "before the clock starts. `max abs err` is against a float64 reference of the exact formula.",
    ),
    (
        "threads",
        "Thread settings",
        threads,
        "Each setting runs in a fresh process without `OMP_NUM_THREADS`, after the main thread ran five "
        "forward and backward passes of a 64x64 MLP (so its intra-op thread team exists); processes alternate "
        "between the settings.",
    ),
    (
        "ppo",
        "End-to-end PPO",
        ppo,
        "`examples/ppo.py` runs in each collector mode: `backend=thread` with `prefetch=0` (lockstep, the "
        "reference of `vs lockstep`) or `prefetch=1`, and `backend=process` with K = 1 or 2 worker processes "
        "(prefetch 1). CleanRL's hyperparameters are the same for all in the first table (8 envs x 128 steps, 4 "
        "epochs, minibatch 256, 64x64 tanh MLPs, Adam 2.5e-4 annealed, clipped value loss); the second runs "
        "`configs/ppo_cartpole.yaml` as `make run` does (only `total_timesteps` set; `backend=auto`, which "
        "picks one worker process for this CPU agent) beside the same config in the other modes, and SB3 with "
        "that config's hyperparameters (8 x 125 steps, 10 epochs, batch size 250, Adam 1e-3 annealed, no "
        "entropy bonus, no value clipping). HalfCheetah runs `configs/ppo_halfcheetah.yaml` without observation "
        "and reward normalisation in every row (the example keeps `normalize_obs` to the thread). Each run is a "
        "fresh process; steady state = from the end of the first iteration to the end of the last; `policy lag`: "
        "the mean over iterations of the example's `charts/policy_lag` (versions between the weights that "
        "collected a batch and those it trains; 0 by construction for SB3 and rlox). rlox steps its own Rust "
        "CartPole, the others gymnasium's.",
    ),
    (
        "truncation",
        "Advantages at time-limit truncations",
        truncation,
        "A chain env that never terminates, truncated by a TimeLimit; the exact advantage of every real "
        "transition is known from the critic. `reset rows in loss`: NEXT_STEP reset rows (not transitions) "
        "that the system hands to the loss. Printed, not asserted.",
    ),
]


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
    date = f"on {info['date']} " if info.get("date") else ""
    return (
        f"Measured {date}with the command above. Machine: {info['cpu_model']}, {info['cores']} cores{gpu}{load}; "
        f"Python {info['python']}, torch {info['torch']} with 1 intra-op thread (except in the thread-settings "
        f"table); {peers}."
    )


def render(
    results: dict[str, dict[str, Any]], info: dict[str, Any], *, quick: bool, elapsed_s: float, record: str = "run"
) -> str:
    """docs/performance-full-run.md: the run's tables, prose wrapped at 100 columns; ``record`` names the
    results file of the whole run."""
    command = COMMAND + (" --quick" if quick else "")
    parts = [
        "# Performance: the full run",
        "",
        "",  # the opening, once the sections are known (below)
        "",
        "This page is generated by `benchmarks/run.py` from its run's tables (the other "
        "[performance pages](performance.md) are copied from `benchmarks/single_scripts.md`). Regenerate it with",
        "",
        "```bash",
        command,
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
    for key, title, module, note in SECTIONS:
        if key in results:
            parts += [f"## {title}", "", module.to_markdown(results[key])] + ([note, ""] if note else [""])
            own = RECORDS.get(key, key) + ("_quick" if quick else "")
            parts += [f"Recorded in `benchmarks/results/run_{own}.json`, and with the whole run in `{record}.json`."]
            parts += [""]
    parts[2] = (
        "One full run of the benchmark suite on one machine: collection, GAE and end-to-end PPO side by side with "
        "TorchRL, Stable-Baselines3, rlox and a CleanRL-style loop on the same envs, policy and seeds, beside the "
        "floors that bound any collector, and how exact each system's advantages are at time-limit truncations. "
        + _contents("\n".join(parts))
    )
    return wrap("\n".join(parts))


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _sections(page: str) -> list[str]:
    return [line[3:] for line in page.splitlines() if line.startswith("## ")]


def _contents(page: str) -> str:
    """A line of links to the page's sections."""
    return "Sections: " + ", ".join(f"[{title}](#{_anchor(title)})" for title in _sections(page)) + "."


def wrap(page: str, width: int = 100) -> str:
    """The page with its long prose lines wrapped at ``width`` columns; tables, code, headings kept as they are."""
    out: list[str] = []
    fenced = False
    for line in page.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or len(line) <= width or line.startswith(("|", "#", "<!--", "!", "**")):
            out.append(line)
        else:
            indent = " " * len(re.match(r"\s*(?:- )?", line).group(0))  # type: ignore[union-attr]
            out += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)
    return "\n".join(out).rstrip() + "\n"


def _split_head(text: str) -> tuple[str, str, str]:
    """A page's title, its first paragraph and the rest."""
    head, _, rest = text.partition("\n\n")
    first, _, rest = rest.partition("\n\n")
    return head, first, rest


def single_script_pages(full_run: str) -> dict[str, str]:
    """The pages of ``single_scripts.md`` by file name, each with its sections listed after its first
    paragraph; the index, ``performance.md``, with a table of every performance page and its sections."""
    chunks = re.split(r"^<!-- page: (\S+) -->\n", SINGLE_SCRIPTS.read_text(), flags=re.MULTILINE)
    pages = {name: text.strip() + "\n" for name, text in zip(chunks[1::2], chunks[2::2], strict=True)}
    table = ["| page | sections |", "|:---|:---|"]
    for name, text in [(PAGE.name, full_run), *pages.items()]:
        if name != "performance.md":
            links = ", ".join(f"[{t}]({name}#{_anchor(t)})" for t in _sections(text))
            table.append(f"| [{text.splitlines()[0].removeprefix('# Performance: ')}]({name}) | {links} |")
    for name, text in pages.items():
        head, first, rest = _split_head(text)
        contents = "\n".join(table) if name == "performance.md" else _contents(text)
        pages[name] = wrap(f"{head}\n\n{first}\n\n{contents}\n\n{rest}")
    return pages


def _write_docs(section: str) -> None:
    PAGE.write_text(section)
    for name, text in single_script_pages(section).items():
        (DOCS / name).write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (~4 min); leaves the docs alone")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["collect", "placement", "atari", "gae", "truncation", "threads", "ppo"],
        default=None,
        help="run only these parts",
    )
    parser.add_argument("--repeats", type=int, default=None, help="override the repeats of every part")
    parser.add_argument("--no-docs", action="store_true", help="write results/performance.md, not the docs' pages")
    parser.add_argument(
        "--pages", action="store_true", help="run nothing: rewrite the pages of single_scripts.md in docs/ and stop"
    )
    args = parser.parse_args(argv)
    if args.pages:
        _write_docs(PAGE.read_text())
        return
    quiet_warnings()
    parts = args.only or ["collect", "placement", "atari", "gae", "truncation", "threads", "ppo"]
    info = machine_info()
    info["date"] = time.strftime("%Y-%m-%d")
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    _common.RECORD_PREFIX = "run_"
    for part in parts:
        part_start = time.perf_counter()
        if part == "truncation":
            results[part] = truncation.run(quick=args.quick)
        elif part == "placement":
            results[part] = placement_ab.run(quick=args.quick, rounds=args.repeats)
        else:
            results[part] = PARTS[part].run(quick=args.quick, repeats=args.repeats)
        print(f"[{part} took {time.perf_counter() - part_start:.1f} s]", flush=True)
    _common.RECORD_PREFIX = ""
    elapsed = time.perf_counter() - start
    info["load_average_1m_end"] = machine_info().get("load_average_1m")
    # every part's results beside the machine: the page's one record, whatever single scripts write later
    record = "run_quick" if args.quick else "run_only" if args.only else "run"
    section = render(results, info, quick=args.quick, elapsed_s=elapsed, record=record)
    suffix = "_quick" if args.quick else ""
    write_json(record, {"machine": info, "elapsed_s": elapsed, "quick": args.quick, "results": results})
    target = RESULTS_DIR / f"performance{suffix}.md" if args.quick or args.no_docs or args.only else PAGE
    if target == PAGE:
        _write_docs(section)
    else:
        target.write_text(section)
    print(section)
    print(f"wrote {target.relative_to(REPO_ROOT)} ({elapsed:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
