"""FromJax's step against the raw jitted, vmapped step of the same env, in Playground's venv (sims/build.sh).

Run from the repository root:
    PYTHONPATH=$PWD ~/.cache/torch_rollout/sims/playground/bin/python sims/bench_fromjax.py
Prints the median time per step of: the env's own ``jax.jit(jax.vmap(env.step))`` (waiting for each result), FromJax
in SAME_STEP mode (which also resets every env inside the step, keeping the reset only where an episode ended), and
FromJax in DISABLED mode followed by the collector's ``reset(options={"reset_mask": ...})`` at every step.
"""

from __future__ import annotations

import statistics
import time

import jax
import torch
from brax import envs as brax_envs
from gymnasium.vector import AutoresetMode
from mujoco_playground import registry

from torch_rollout.envs import FromJax

STEPS, REPEATS = 200, 5


def per_step(run) -> float:
    run(20)  # compiled, warm
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run(STEPS)
        times.append((time.perf_counter() - start) / STEPS)
    return statistics.median(times)


def raw(env, n):
    reset, step = jax.jit(jax.vmap(env.reset)), jax.jit(jax.vmap(env.step))
    state = reset(jax.random.split(jax.random.PRNGKey(0), n))
    action = jax.numpy.full((n, env.action_size), 0.1)

    def run(steps):
        nonlocal state
        for _ in range(steps):
            state = step(state, action)
            state.obs.block_until_ready()

    return run


def adapter(env, n, mode):
    envs = FromJax(env, n, max_episode_steps=100, autoreset_mode=mode)
    envs.reset(seed=0)
    action = torch.full((n, env.action_size), 0.1)

    def run(steps):
        for _ in range(steps):
            obs, _, terminated, truncated, _ = envs.step(action)
            if mode is AutoresetMode.DISABLED:
                obs, _ = envs.reset(options={"reset_mask": terminated | truncated})
            obs.sum()  # the observations read in torch

    return run


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name, make in [
        ("brax inverted_pendulum", lambda: brax_envs.get_environment("inverted_pendulum")),
        ("playground CartpoleBalance", lambda: registry.load("CartpoleBalance")),
    ]:
        for n in (16, 256):
            row = [per_step(raw(make(), n))]
            row += [per_step(adapter(make(), n, mode)) for mode in (AutoresetMode.SAME_STEP, AutoresetMode.DISABLED)]
            print(
                f"{name}, N={n}: raw {row[0] * 1e6:.0f} us, FromJax SAME_STEP {row[1] * 1e6:.0f} us "
                f"({row[1] / row[0]:.2f}x), DISABLED + reset_mask {row[2] * 1e6:.0f} us ({row[2] / row[0]:.2f}x)",
                flush=True,
            )
