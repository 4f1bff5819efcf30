"""GAE kernels side by side: torch_rollout's ``compute_gae``, rlox's Rust kernels, TorchRL's, an SB3-style NumPy loop.

All systems get the same transitions (rewards, values, terminations and
truncations drawn from one seed), each in the layout and convention its API
expects, prepared before the clock starts: rlox and SB3 take one ``done`` flag,
so a truncated step's bootstrap ``gamma * V(final obs)`` is folded into its
reward, as SB3's collector does. With that every system computes the exact
advantages, and the table shows how far each lies from a float64 reference.

Usage::

    benchmarks/.venv/bin/python benchmarks/gae.py [--quick] [--repeats R]
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from _common import (
    fmt_rate,
    machine_info,
    main_of,
    markdown_table,
    quiet_warnings,
    record,
    run_interleaved,
    summarize,
)

__all__ = ["run", "REFERENCE", "make_transitions", "reference_gae"]

GAMMA, GAE_LAMBDA = 0.99, 0.95
REFERENCE = "torch_rollout compute_gae"
SHAPES = [(128, 8), (128, 64), (2048, 16), (2048, 256)]
# per element: reward, value, next_value (fp32) + terminated, truncated (bool) in; advantage, return (fp32) out
BYTES_PER_ELEMENT = 3 * 4 + 2 * 1 + 2 * 4
_TARGET_STEP_S = 0.02  # each timed step repeats the call until it lasts about this long


def make_transitions(num_steps: int, num_envs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Consistent [T, N] float64 transitions: ``next_value[t] == value[t+1]`` except where an episode ended.

    About 2% of steps terminate and 1% truncate, like CartPole under a fresh policy.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (num_steps, num_envs)
    value = torch.randn(shape, generator=gen, dtype=torch.float64)
    terminated = torch.rand(shape, generator=gen) < 0.02
    truncated = (torch.rand(shape, generator=gen) < 0.01) & ~terminated
    done = terminated | truncated
    # after an episode end the next row starts a new episode: next_value is the final obs' value
    final_value = torch.randn(shape, generator=gen, dtype=torch.float64)
    next_value = torch.empty(shape, dtype=torch.float64)
    next_value[:-1] = torch.where(done[:-1], final_value[:-1], value[1:])
    next_value[-1] = final_value[-1]
    reward = torch.randn(shape, generator=gen, dtype=torch.float64)
    return {
        "reward": reward,
        "value": value,
        "next_value": next_value,
        "terminated": terminated,
        "truncated": truncated,
    }


def reference_gae(tr: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float64 backward loop of the exact definition (the formula of compute_gae's docstring)."""
    reward, value, next_value = tr["reward"].double(), tr["value"].double(), tr["next_value"].double()
    not_term = (~tr["terminated"]).double()
    not_done = (~(tr["terminated"] | tr["truncated"])).double()
    advantage = torch.zeros_like(value)
    last = torch.zeros_like(value[0])
    for t in reversed(range(value.shape[0])):
        delta = reward[t] + GAMMA * not_term[t] * next_value[t] - value[t]
        advantage[t] = last = delta + GAMMA * GAE_LAMBDA * not_done[t] * last
    return advantage


def _sb3_style_folded(tr: dict[str, torch.Tensor]) -> tuple[np.ndarray, ...]:
    """The single-``done`` convention (SB3, rlox): truncation bootstrap folded into the reward.

    Returns float64 [T, N] arrays reward, value, done and last_value [N].
    """
    bootstrap = tr["truncated"].double() * tr["next_value"]
    reward = (tr["reward"] + GAMMA * bootstrap).numpy()
    done = (tr["terminated"] | tr["truncated"]).double().numpy()
    # fresh owned arrays: rlox's bindings refuse NumPy views of torch storage
    return reward, tr["value"].numpy().copy(), done, tr["next_value"][-1].numpy().copy()


def sb3_numpy_gae(
    rewards: np.ndarray, values: np.ndarray, episode_starts: np.ndarray, last_values: np.ndarray, last_dones: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The backward NumPy loop of SB3's ``RolloutBuffer.compute_returns_and_advantage`` ([T, N] float32)."""
    num_steps = rewards.shape[0]
    advantages = np.zeros_like(rewards)
    last = np.zeros_like(rewards[0])
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            non_terminal, next_values = 1.0 - last_dones, last_values
        else:
            non_terminal, next_values = 1.0 - episode_starts[t + 1], values[t + 1]
        delta = rewards[t] + GAMMA * next_values * non_terminal - values[t]
        advantages[t] = last = delta + GAMMA * GAE_LAMBDA * non_terminal * last
    return advantages, advantages + values


class KernelSession:
    """Calls one GAE function repeatedly; a step is as many calls as fit in about 20 ms."""

    def __init__(self, fn: Callable[[], Any], elements: int, sync: Callable[[], None] | None = None) -> None:
        self.fn, self.elements, self.sync = fn, elements, sync or (lambda: None)
        self.fn()  # first call outside the calibration: allocations, lazy imports
        self.sync()
        start = time.perf_counter()
        self.fn()
        self.sync()
        self.calls = max(1, int(_TARGET_STEP_S / max(time.perf_counter() - start, 1e-7)))

    def step(self) -> int:
        for _ in range(self.calls):
            self.fn()
        self.sync()
        return self.calls * self.elements

    def close(self) -> None:
        pass


def systems(
    tr: dict[str, torch.Tensor], device: str = "cpu"
) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable]]:
    """Per system: a zero-argument call on prepared inputs, and a function giving its advantages [T, N] as float64."""
    from torch_rollout import compute_gae

    num_steps, num_envs = tr["value"].shape
    calls: dict[str, Callable[[], Any]] = {}
    outputs: dict[str, Callable[[], torch.Tensor]] = {}

    f32 = {k: (v.float() if v.is_floating_point() else v) for k, v in tr.items()}

    def ours() -> tuple[torch.Tensor, torch.Tensor]:
        return compute_gae(
            f32["reward"],
            f32["value"],
            f32["next_value"],
            f32["terminated"],
            f32["truncated"],
            gamma=GAMMA,
            gae_lambda=GAE_LAMBDA,
        )

    calls[REFERENCE] = ours
    outputs[REFERENCE] = lambda: ours()[0].double()

    if device == "cpu" and importlib.util.find_spec("rlox") is not None:  # rlox takes host NumPy arrays
        import rlox

        reward, value, done, last_value = _sb3_style_folded(tr)
        # rlox lays out env-major: [env0_step0, env0_step1, ..., env1_step0, ...]
        flat64 = [np.ascontiguousarray(x.T).ravel() for x in (reward, value, done)]
        flat32 = [x.astype(np.float32) for x in flat64]
        last32 = last_value.astype(np.float32)

        def rlox64() -> tuple[np.ndarray, np.ndarray]:
            return rlox.compute_gae_batched(*flat64, last_value, num_steps, GAMMA, GAE_LAMBDA)

        def rlox32() -> tuple[np.ndarray, np.ndarray]:
            return rlox.compute_gae_batched_f32(*flat32, last32, num_steps, GAMMA, GAE_LAMBDA)

        calls["rlox compute_gae_batched (f64)"] = rlox64
        calls["rlox compute_gae_batched_f32"] = rlox32
        outputs["rlox compute_gae_batched (f64)"] = lambda: torch.from_numpy(
            rlox64()[0].reshape(num_envs, num_steps).T.copy()
        )
        outputs["rlox compute_gae_batched_f32"] = lambda: torch.from_numpy(
            rlox32()[0].reshape(num_envs, num_steps).T.astype(np.float64)
        )

    if importlib.util.find_spec("torchrl") is not None:
        from torchrl.objectives.value.functional import vec_generalized_advantage_estimate

        # TorchRL is batch-first with a trailing feature dim: [N, T, 1]
        def batch_first(x: torch.Tensor) -> torch.Tensor:
            return x.T.contiguous().unsqueeze(-1)

        trl = {k: batch_first(v) for k, v in f32.items()}
        trl_done = trl["terminated"] | trl["truncated"]

        def torchrl_gae() -> tuple[torch.Tensor, torch.Tensor]:
            return vec_generalized_advantage_estimate(
                GAMMA,
                GAE_LAMBDA,
                trl["value"],
                trl["next_value"],
                trl["reward"],
                trl_done,
                trl["terminated"],
            )

        calls["TorchRL vec_generalized_advantage_estimate"] = torchrl_gae
        outputs["TorchRL vec_generalized_advantage_estimate"] = lambda: torchrl_gae()[0].squeeze(-1).T.double()

    if device == "cpu":
        np_reward, np_value, np_done, np_last = (x.astype(np.float32) for x in _sb3_style_folded(tr))
        # SB3 stores episode_starts: row t starts an episode when row t-1 was done
        starts = np.zeros_like(np_done)
        starts[1:] = np_done[:-1]

        def numpy_loop() -> tuple[np.ndarray, np.ndarray]:
            return sb3_numpy_gae(np_reward, np_value, starts, np_last, np_done[-1])

        calls["NumPy loop (SB3 RolloutBuffer style)"] = numpy_loop
        outputs["NumPy loop (SB3 RolloutBuffer style)"] = lambda: torch.from_numpy(numpy_loop()[0].astype(np.float64))
    return calls, outputs


def _copy_bandwidth(device: str) -> float:
    """Bytes/s of a 256 MiB device-to-device copy (read + write): the ceiling a memory-bound kernel can reach."""
    src = torch.empty(64 * 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * src.element_size() * 20 / (time.perf_counter() - start)


def run(
    *, quick: bool = False, repeats: int | None = None, seed: int = 0, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Times every GAE kernel at each shape (and on CUDA when present); writes results/gae.json.

    Args:
        quick: one repeat at the two small shapes.
        repeats: interleaved rounds (default 1 quick, 5 full).
        seed: seed of the synthetic transitions.
        log: where progress lines go.

    Returns:
        A dict with ``machine`` and one table per (device, shape) with rows from :func:`summarize`
        plus ``us_per_call`` and ``max_abs_err`` (against the float64 reference).
    """
    quiet_warnings()
    torch.set_num_threads(1)
    repeats = repeats or (1 if quick else 5)
    shapes = SHAPES[:2] if quick else SHAPES
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results: dict[str, Any] = {"machine": machine_info(), "config": {"repeats": repeats, "quick": quick}, "tables": []}
    for device in devices:
        bandwidth = _copy_bandwidth(device) if device == "cuda" else None
        for num_steps, num_envs in shapes:
            tr = make_transitions(num_steps, num_envs, seed)
            exact = reference_gae(tr)
            if device != "cpu":
                tr = {k: v.to(device) for k, v in tr.items()}
            # on CUDA only the torch kernels run: rlox and the NumPy loop are host-only
            calls, outputs = systems(tr, device)
            errors = {name: float((outputs[name]().cpu() - exact).abs().max()) for name in calls}
            sync = torch.cuda.synchronize if device == "cuda" else None
            elements = num_steps * num_envs
            factories = {
                name: (lambda fn=fn, n=elements, sync=sync: KernelSession(fn, n, sync)) for name, fn in calls.items()
            }
            log(f"gae: {device} T={num_steps} N={num_envs}, {repeats} repeat(s)")
            rates = run_interleaved(factories, repeats=repeats, warmup=1, steps=3, log=log)
            rows = summarize(rates, REFERENCE)
            for row in rows:
                row["us_per_call"] = elements / row["median"] * 1e6
                row["max_abs_err"] = errors[row["system"]]
                if bandwidth is not None:
                    row["bytes_per_s"] = row["median"] * BYTES_PER_ELEMENT
                    row["fraction_of_copy_bandwidth"] = row["bytes_per_s"] / bandwidth
            results["tables"].append(
                {
                    "device": device,
                    "T": num_steps,
                    "N": num_envs,
                    "copy_bandwidth": bandwidth,
                    "samples": rates,
                    "rows": rows,
                }
            )
    return record("gae", results, quick=quick)


def _fmt_time(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.3g} s"
    if us >= 1e3:
        return f"{us / 1e3:.3g} ms"
    return f"{us:.3g} us"


def to_markdown(results: dict[str, Any]) -> str:
    """One table: a row per system, a column per shape (microseconds per call and ratio)."""
    parts = []
    for device in dict.fromkeys(t["device"] for t in results["tables"]):
        tables = [t for t in results["tables"] if t["device"] == device]
        names = [r["system"] for r in tables[0]["rows"]]
        header = ["system"] + [f"{t['T']}x{t['N']}" for t in tables] + ["max abs err"]
        rows = []
        for name in names:
            cells = [name]
            err = 0.0
            for t in tables:
                row = next((r for r in t["rows"] if r["system"] == name), None)
                if row is None:
                    cells.append("-")
                    continue
                cell = f"{_fmt_time(row['us_per_call'])} ({row['ratio']:.2f}x)"
                if "fraction_of_copy_bandwidth" in row:
                    cell += f", {fmt_rate(row['bytes_per_s'])}B/s = {row['fraction_of_copy_bandwidth']:.0%} of copy"
                cells.append(cell)
                err = max(err, row["max_abs_err"])
            cells.append(f"{err:.1e}")
            rows.append(cells)
        parts.append(
            f"**GAE, {device}, [T x N]** (time per call, median of {results['config']['repeats']}; "
            "ratio > 1: faster than torch_rollout)\n\n" + markdown_table(header, rows) + "\n"
        )
    return "\n".join(parts)


def main() -> None:
    main_of(__doc__, run, to_markdown, ("--seed", {"type": int, "default": 0}), quick="one short repeat")


if __name__ == "__main__":
    main()
