"""GPU benchmarks (run by benchmarks/gpu.sh): collection with a GPU policy, compute_gae, uploads, T=1 tiers.

Four tables:

- collection, CartPole-v1 ``SyncVectorEnv`` T=128 x N=64, with the benchmarks'
  actor-critic at 64x64 and at 512x512 on ``cuda``: the thread backend (prefetch
  0 and 1) and the process backend (K = 1 and 2 workers, prefetch 1), plus the
  thread on the CPU for comparison; transitions/s, interleaved, median;
- ``compute_gae`` at T=2048 x N=256 on ``cuda`` against the card's copy
  bandwidth: a device-to-device copy of the bytes GAE must read and write;
- uploading one observation batch to the GPU, [64, 4] float32 (CartPole) and
  [64, 84*84*4] uint8 (four stacked Atari frames): from pageable memory, from
  pinned memory, and copying into a pinned staging buffer first;
- off-policy T=1 tiers (``offpolicy.py``'s systems): torch CartPole on ``cuda`` with N=1024 and
  N=4096 envs, one step of each per batch written into a replay ring on the device, the hand
  loop (FastTD3-style) against the collector with prefetch 0 and 1, the env alone and the policy
  alone.

``--cpu-dry-run`` runs the same code on the CPU with small sizes and no
pinning, to check the logic on a machine without CUDA; its numbers mean
nothing. Results: ``results/gpu.json`` (``results/gpu_quick.json``) and a
Markdown table on stdout.

Usage::

    python benchmarks/gpu.py [--cpu-dry-run] [--repeats R]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import offpolicy
import torch
from gae import BYTES_PER_ELEMENT, GAE_LAMBDA, GAMMA, make_transitions

from _common import (
    ActorCritic,
    CollectorSession,
    advantages,
    fmt_rate,
    machine_info,
    markdown_table,
    placement,
    run_interleaved,
    write_json,
)

__all__ = ["run", "to_markdown"]

NUM_ENVS, NUM_STEPS = 64, 128
HIDDEN = (64, 512)
T1_SIZES = (1024, 4096)  # the off-policy tiers: N torch envs at T=1


def _policy(hidden: int, seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    return ActorCritic(obs_dim=4, n_actions=2, hidden=hidden)


def collecting(*, device: str, hidden: int, backend: str, prefetch: int, num_workers: int = 1) -> CollectorSession:
    """One collector on CartPole-v1 N=64 (the SyncVectorEnv recipe); ``step()`` collects one batch.

    Its count of real transitions reads the mask (``.item()`` syncs: the batch is complete on the device).
    """
    from torch_rollout import Collector

    recipe = functools.partial(gym.make_vec, "CartPole-v1", vectorization_mode="sync")
    envs = recipe(NUM_ENVS) if backend == "thread" else recipe
    collector = Collector(
        envs,
        _policy(hidden).to(device),
        num_steps=NUM_STEPS,
        num_envs=None if backend == "thread" else NUM_ENVS,
        gae=advantages(GAMMA, GAE_LAMBDA),
        device=device,
        prefetch=prefetch,
        seed=0,
        backend=placement(backend, num_workers),
    )
    return CollectorSession(collector, owned=envs if backend == "thread" else None)


def bench_collect(device: str, *, repeats: int, timed: int, log: Callable[[str], None]) -> dict[str, Any]:
    factories: dict[str, Callable[[], CollectorSession]] = {}
    for hidden in HIDDEN:
        size = f"{hidden}x{hidden}"
        for name, kwargs in (
            ("thread, prefetch=0", {"backend": "thread", "prefetch": 0}),
            ("thread, prefetch=1", {"backend": "thread", "prefetch": 1}),
            ("process K=1, prefetch=1", {"backend": "process", "prefetch": 1, "num_workers": 1}),
            ("process K=2, prefetch=1", {"backend": "process", "prefetch": 1, "num_workers": 2}),
        ):
            factories[f"{size} on {device}: {name}"] = functools.partial(
                collecting, device=device, hidden=hidden, **kwargs
            )
        # the same policy on the CPU, for what the GPU buys
        factories[f"{size} on cpu: thread, prefetch=0"] = functools.partial(
            collecting, device="cpu", hidden=hidden, backend="thread", prefetch=0
        )
    log(f"gpu collect: CartPole-v1 T={NUM_STEPS} x N={NUM_ENVS}, {repeats} repeat(s), {timed} timed batch(es)")
    rates = run_interleaved(factories, repeats=repeats, warmup=1, steps=timed, log=log)
    rows = [{"system": name, "median": statistics.median(v), "min": min(v), "max": max(v)} for name, v in rates.items()]
    return {"samples": rates, "rows": rows}


def bench_offpolicy(
    device: str, *, sizes: tuple[int, ...], repeats: int, units: int, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The T=1 tiers: offpolicy.py's systems (no TorchRL) on torch CartPole with N envs on ``device``."""
    results = []
    for num_envs in sizes:
        name = offpolicy.shape_name("torch", num_envs, 1)
        log(f"gpu off-policy tier: {name}, {repeats} repeat(s)")
        result = offpolicy.run_shape(
            "torch", num_envs, 1, device=device, repeats=repeats, units=units, log=log, torchrl=False
        )
        results.append({"shape": name, **result})
    return results


def _time(fn: Callable[[], Any], sync: Callable[[], None], *, calls: int) -> float:
    """Median seconds per call of ``fn`` over ``calls`` calls, each synchronised; after 3 warm-up calls."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_gae(device: str, shape: tuple[int, int], *, calls: int) -> dict[str, Any]:
    from torch_rollout import compute_gae

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    data = make_transitions(*shape)
    args = [data[k].to(device) for k in ("reward", "value", "next_value")]
    args = [a.float() for a in args] + [data[k].to(device) for k in ("terminated", "truncated")]
    gae_s = _time(lambda: compute_gae(*args, gamma=GAMMA, gae_lambda=GAE_LAMBDA), sync, calls=calls)
    nbytes = shape[0] * shape[1] * BYTES_PER_ELEMENT
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src), sync, calls=calls)
    return {
        "shape": list(shape),
        "bytes": nbytes,
        "gae_s": gae_s,
        "copy_s": copy_s,
        "copy_gb_s": 2 * nbytes / copy_s / 1e9,  # read + write
        "gae_over_copy": gae_s / copy_s,
    }


def bench_upload(device: str, *, calls: int, pin: bool) -> list[dict[str, Any]]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for label, shape, dtype in (
        ("[64, 4] float32 (CartPole)", (64, 4), torch.float32),
        ("[64, 84*84*4] uint8 (4 Atari frames)", (64, 84 * 84 * 4), torch.uint8),
    ):
        host = (torch.rand(shape) * 255).to(dtype)
        pinned = host.pin_memory() if pin else host.clone()
        staging = torch.empty(shape, dtype=dtype, pin_memory=pin)  # empty_like(pinned) would be pageable
        pageable_s = _time(lambda host=host: host.to(device), sync, calls=calls)
        pinned_s = _time(lambda pinned=pinned: pinned.to(device, non_blocking=True), sync, calls=calls)

        def staged(host: torch.Tensor = host, staging: torch.Tensor = staging) -> torch.Tensor:
            staging.copy_(host)  # what a collector does with a fresh NumPy batch
            return staging.to(device, non_blocking=True)

        staged_s = _time(staged, sync, calls=calls)
        nbytes = host.numel() * host.element_size()
        rows.append(
            {
                "batch": label,
                "bytes": nbytes,
                "pageable_s": pageable_s,
                "pinned_s": pinned_s,
                "staged_s": staged_s,
                "pinned_speedup": pageable_s / pinned_s,
                "staged_speedup": pageable_s / staged_s,
            }
        )
    return rows


def run(
    *, dry_run: bool, repeats: int | None, out: Path | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """All three GPU benchmarks on ``cuda`` (on ``cpu``, small and unpinned, with ``dry_run``)."""
    torch.set_num_threads(1)
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA: skipping (torch.cuda.is_available() is False)")
    device = "cpu" if dry_run else "cuda"
    repeats = repeats or (1 if dry_run else 3)
    results: dict[str, Any] = {"machine": machine_info(), "dry_run": dry_run, "device": device}
    results["collect"] = bench_collect(device, repeats=repeats, timed=1 if dry_run else 3, log=log)
    log("gpu gae and copy bandwidth")
    results["gae"] = bench_gae(device, (256, 16) if dry_run else (2048, 256), calls=5 if dry_run else 50)
    log("gpu uploads")
    results["upload"] = bench_upload(device, calls=5 if dry_run else 200, pin=not dry_run)
    log("gpu off-policy T=1 tiers")
    t1_sizes, units = ((64,), 1) if dry_run else (T1_SIZES, 5)
    results["offpolicy"] = bench_offpolicy(device, sizes=t1_sizes, repeats=repeats, units=units, log=log)
    path = write_json("gpu_quick" if dry_run else "gpu", results)  # *_quick.* is git-ignored
    if out is not None:
        shutil.copy(path, out / "gpu.json")
    return results


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def to_markdown(results: dict[str, Any]) -> str:
    machine = results["machine"]
    head = f"GPU: {machine.get('cuda') or 'none (dry run on the CPU: numbers mean nothing)'}; torch {machine['torch']}"
    rows = [
        [r["system"], fmt_rate(r["median"]), f"{fmt_rate(r['min'])} - {fmt_rate(r['max'])}"]
        for r in results["collect"]["rows"]
    ]
    text = f"{head}\n\n**Collection with the policy on the device, CartPole-v1 T={NUM_STEPS} x N={NUM_ENVS}** "
    text += "(transitions/s, median)\n\n" + markdown_table(["policy, placement", "median", "range"], rows) + "\n"
    g = results["gae"]
    text += (
        f"\n**compute_gae, {g['shape'][0]}x{g['shape'][1]} on {results['device']}**\n\n"
        + markdown_table(
            ["compute_gae", f"copy of the same {g['bytes'] / 1e6:.1f} MB", "copy bandwidth (read+write)", "gae / copy"],
            [[_us(g["gae_s"]), _us(g["copy_s"]), f"{g['copy_gb_s']:.0f} GB/s", f"{g['gae_over_copy']:.1f}x"]],
        )
        + "\n"
    )
    rows = [
        [
            u["batch"],
            _us(u["pageable_s"]),
            _us(u["pinned_s"]),
            _us(u["staged_s"]),
            f"{u['pinned_speedup']:.2f}x",
            f"{u['staged_speedup']:.2f}x",
        ]
        for u in results["upload"]
    ]
    header = ["observation batch", "pageable", "pinned", "copy to pinned + upload", "pinned gain", "staged gain"]
    text += "\n**Host-to-device upload of one observation batch** (median per upload)\n\n"
    text += markdown_table(header, rows) + "\n"
    text += f"\n**Off-policy T=1 tiers on {results['device']}** (frames/s, median; ratio to the hand loop)\n\n"
    text += offpolicy.to_markdown(results["offpolicy"]) + "\n"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same logic on the CPU, small and fast")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="a folder to copy the JSON results into, as gpu.json")
    args = parser.parse_args()
    log = functools.partial(print, file=sys.stderr)  # stdout: the Markdown tables only
    print(to_markdown(run(dry_run=args.cpu_dry_run, repeats=args.repeats, out=args.out, log=log)))


if __name__ == "__main__":
    main()
