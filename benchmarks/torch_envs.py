"""Collection on a vector env of torch tensors (torch_rollout/CartPole-v1) in tiers, beside TorchRL's Collector.

For each N (T=16 steps per batch, the benchmarks' 64x64 actor-critic, on the CPU), with one torch
thread and with torch's default:

- env alone: ``envs.step`` on actions drawn beforehand on the env's device;
- policy alone: the actor-critic's forward (action, log-prob, value) on N observations;
- serial floor: ``1 / (1 / env + 1 / policy)``, what a loop that steps and then acts cannot beat;
- hand-written loop: obs -> forward -> step on the device, every row stored into preallocated
  ``[T, N]`` tensors, the last row bootstrapped and GAE computed (``compute_gae``): the
  collector's work written out for this env and NEXT_STEP autoreset;
- ``Collector(envs, policy, backend="thread", prefetch=0)``: the same batches, GAE included;
- with ``--cuda-graph`` (a CUDA ``--device``), the same collector with ``compile_policy=CudaGraph()``:
  the policy's forward replayed as a CUDA graph;
- TorchRL's ``Collector`` on the same dynamics (a small ``EnvBase`` adapter in DISABLED mode, which
  TorchRL resets itself), then its ``GAE`` module on each batch, as in ``collect.py``.

Systems run interleaved (A B C ... A B C), each built afresh per repeat. Frames are env steps
x N. A separate line times end-to-end PPO: ``examples/ppo.py`` with
``configs/ppo_cartpole_torch.yaml`` for a fixed number of steps (its own steps/s).

Usage::

    benchmarks/.venv/bin/python benchmarks/torch_envs.py [--repeats R] [--batches B] [--sizes N ...] [--quick]
        [--device cuda [--cuda-graph]]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from _common import (
    CollectorSession,
    EnvAlone,
    PolicyAlone,
    TorchRLSession,
    floor_summary,
    floor_table,
    fmt_rate,
    has,
    machine_info,
    make_policy,
    quiet_warnings,
    run_interleaved,
    synced,
    write_json,
)

T = 16
SIZES = (256, 1024, 4096, 16384)
GAMMA, GAE_LAMBDA = 0.99, 0.95
ROOT = Path(__file__).resolve().parent.parent


DEVICE = torch.device("cpu")  # --device
CUDA_GRAPH = False  # --cuda-graph


def _cartpole(num_envs: int, **kwargs: Any) -> Any:
    from torch_rollout.envs import CartPole

    return CartPole(num_envs, device=DEVICE, **kwargs)


def env_alone(num_envs: int) -> EnvAlone:
    envs = _cartpole(num_envs)
    envs.reset(seed=0)
    actions = torch.randint(0, 2, (T, num_envs), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    return EnvAlone(envs, list(actions), num_envs=num_envs, device=DEVICE)


def policy_alone(num_envs: int) -> PolicyAlone:
    obs = torch.randn(T, num_envs, 4, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    return PolicyAlone(make_policy().to(DEVICE), list(obs), num_envs=num_envs, device=DEVICE)


class HandLoop:
    """The hand-written on-device loop: rows stored in preallocated storage, the last row bootstrapped, GAE."""

    def __init__(self, num_envs: int) -> None:
        from torch_rollout import compute_gae

        self.compute_gae = compute_gae
        self.envs = _cartpole(num_envs)
        self.policy = make_policy().to(DEVICE)
        self.obs, _ = self.envs.reset(seed=0)
        N = num_envs
        self.store = {
            "obs": torch.empty(T, N, 4, device=DEVICE),
            "action": torch.empty(T, N, dtype=torch.int64, device=DEVICE),
            "log_prob": torch.empty(T, N, device=DEVICE),
            "value": torch.empty(T, N, device=DEVICE),
            "reward": torch.empty(T, N, device=DEVICE),
            "terminated": torch.empty(T, N, dtype=torch.bool, device=DEVICE),
            "truncated": torch.empty(T, N, dtype=torch.bool, device=DEVICE),
            "mask": torch.empty(T, N, dtype=torch.bool, device=DEVICE),
        }
        self.prev_done = torch.zeros(N, dtype=torch.bool, device=DEVICE)
        self.frames = T * N

    def step(self) -> int:
        s = self.store
        with torch.no_grad():
            for t in range(T):
                s["obs"][t].copy_(self.obs)
                out = self.policy(self.obs)
                s["action"][t].copy_(out["action"])
                s["log_prob"][t].copy_(out["log_prob"])
                s["value"][t].copy_(out["value"])
                self.obs, reward, terminated, truncated, _ = self.envs.step(out["action"])
                s["reward"][t].copy_(reward)
                s["terminated"][t].copy_(terminated)
                s["truncated"][t].copy_(truncated)
                s["mask"][t].copy_(~self.prev_done)
                self.prev_done = terminated | truncated
            next_value = torch.cat([s["value"][1:], self.policy.get_value(self.obs).unsqueeze(0)])
            self.compute_gae(
                s["reward"], s["value"], next_value, s["terminated"], s["truncated"], gamma=GAMMA, gae_lambda=GAE_LAMBDA
            )
        return synced(self.frames, DEVICE)

    def close(self) -> None:
        self.envs.close()


def collecting(num_envs: int, compile_policy: Any = False) -> CollectorSession:
    from torch_rollout import GAE, Collector

    collector = Collector(
        _cartpole(num_envs),
        make_policy().to(DEVICE),
        num_steps=T,
        device=DEVICE,
        seed=0,
        backend="thread",
        prefetch=0,
        gae=GAE(GAMMA, GAE_LAMBDA),
        compile_policy=compile_policy,
    )
    return CollectorSession(collector, frames=T * num_envs, device=DEVICE)


def torchrl_env(num_envs: int) -> Any:
    """torch_rollout/CartPole-v1 as a TorchRL ``EnvBase`` of batch size ``[num_envs]`` (TorchRL resets ended envs)."""
    from gymnasium.vector import AutoresetMode
    from tensordict import TensorDict
    from torchrl.data import Categorical, Composite, Unbounded
    from torchrl.envs import EnvBase

    class TorchRLCartPole(EnvBase):
        def __init__(self) -> None:
            super().__init__(device="cpu", batch_size=[num_envs])
            self.envs = _cartpole(num_envs, autoreset_mode=AutoresetMode.DISABLED)
            self.observation_spec = Composite(observation=Unbounded(shape=(num_envs, 4)), shape=(num_envs,))
            self.action_spec = Categorical(2, shape=(num_envs,))
            self.reward_spec = Unbounded(shape=(num_envs, 1))

        def _reset(self, tensordict: Any = None) -> Any:
            mask = None if tensordict is None else tensordict.get("_reset", None)
            if mask is None:
                obs, _ = self.envs.reset(seed=0)
            else:
                obs, _ = self.envs.reset(options={"reset_mask": mask.reshape(-1)})
            done = torch.zeros(num_envs, 1, dtype=torch.bool)
            return TensorDict(
                {"observation": obs, "done": done, "terminated": done.clone(), "truncated": done.clone()},
                batch_size=[num_envs],
            )

        def _step(self, tensordict: Any) -> Any:
            obs, reward, terminated, truncated, _ = self.envs.step(tensordict["action"])
            return TensorDict(
                {
                    "observation": obs,
                    "reward": reward.unsqueeze(-1),
                    "terminated": terminated.unsqueeze(-1),
                    "truncated": truncated.unsqueeze(-1),
                    "done": (terminated | truncated).unsqueeze(-1),
                },
                batch_size=[num_envs],
            )

        def _set_seed(self, seed: int | None) -> None:
            pass

    return TorchRLCartPole()


def torchrl(num_envs: int) -> TorchRLSession:
    """TorchRL's ``Collector`` over the adapter, then its ``GAE`` module on each batch."""
    from tensordict.nn import TensorDictModule

    policy = make_policy()
    actor = TensorDictModule(
        policy.get_action_and_logprob, in_keys=["observation"], out_keys=["action", "sample_log_prob"]
    )
    critic = TensorDictModule(policy.critic, in_keys=["observation"], out_keys=["state_value"])
    frames = T * num_envs
    return TorchRLSession(
        torchrl_env(num_envs), actor, critic, frames_per_batch=frames, gamma=GAMMA, gae_lambda=GAE_LAMBDA
    )


def run_size(num_envs: int, repeats: int, batches: int) -> dict[str, list[float]]:
    factories = {
        "env alone": lambda: env_alone(num_envs),
        "policy alone": lambda: policy_alone(num_envs),
        "hand-written loop": lambda: HandLoop(num_envs),
        "Collector thread, prefetch=0": lambda: collecting(num_envs),
    }
    if CUDA_GRAPH:
        from torch_rollout import CudaGraph

        factories["Collector thread, prefetch=0, CudaGraph()"] = lambda: collecting(num_envs, CudaGraph())
    if has("torchrl") and DEVICE.type == "cpu":
        factories["TorchRL Collector + GAE"] = lambda: torchrl(num_envs)
    return run_interleaved(factories, repeats=repeats, warmup=1, steps=batches, log=lambda _: None)


def ppo_steps_per_s(total_timesteps: int, threads: int | None) -> float | None:
    """End-to-end: the example's torch CartPole config for ``total_timesteps``; its own reported steps/s."""
    config = ROOT / "configs" / "ppo_cartpole_torch.yaml"
    args = [sys.executable, str(ROOT / "examples" / "ppo.py"), "--config", str(config)]
    args += [f"total_timesteps={total_timesteps}", "run_dir=/tmp/torch_rollout_bench_ppo"]
    if threads is not None:
        args.append(f"torch_threads={threads}")
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    found = re.search(r"\((\d+\.\d+) s\)", out.stdout)
    if out.returncode != 0 or found is None:
        return None
    return total_timesteps / float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8, help="timed batches of T * N steps per repeat")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--ppo-steps", type=int, default=500_000, help="env steps of the end-to-end PPO run; 0: skip")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 2 batches, N=256 and 1024, no PPO")
    parser.add_argument("--device", default="cpu", help="where envs, policy and batches live (cuda: no TorchRL)")
    parser.add_argument(
        "--cuda-graph", action="store_true", help="also the collector with compile_policy=CudaGraph() (CUDA only)"
    )
    args = parser.parse_args()
    global DEVICE, CUDA_GRAPH
    DEVICE = torch.device(args.device)
    CUDA_GRAPH = args.cuda_graph
    if CUDA_GRAPH and DEVICE.type != "cuda":
        parser.error(f"--cuda-graph needs a CUDA --device (CUDA graphs run on a GPU), got --device {args.device}")
    if args.quick:
        args.repeats, args.batches, args.sizes, args.ppo_steps = 1, 2, [256, 1024], 0
    quiet_warnings()
    default_threads = torch.get_num_threads()
    results: dict[str, Any] = {"machine": machine_info(), "device": str(DEVICE), "T": T}
    results.update(repeats=args.repeats, batches=args.batches)
    for threads in (1, default_threads):
        torch.set_num_threads(threads)
        load = os.getloadavg()[0]
        per_size = {str(n): run_size(n, args.repeats, args.batches) for n in args.sizes}
        summaries = {n: floor_summary(rates, "env alone", "policy alone") for n, rates in per_size.items()}
        ppo = ppo_steps_per_s(args.ppo_steps, threads) if args.ppo_steps else None
        results[f"threads={threads}"] = {"sizes": summaries, "ppo_steps_per_s": ppo, "load_1m_start": load}
        print(
            f"\n{threads} torch thread(s); 1-min load {load:.2f} at the start; T={T}, {args.repeats} interleaved "
            f"repeats of {args.batches} batches; frames/s"
        )
        cases = {f"N={n}": rates for n, rates in per_size.items()}
        print(floor_table(cases, env="env alone", policy="policy alone", versus="hand-written loop"))
        if ppo is not None:
            print(f"end-to-end PPO (configs/ppo_cartpole_torch.yaml, {args.ppo_steps} steps): {fmt_rate(ppo)} steps/s")
    torch.set_num_threads(default_threads)
    name = "torch_envs" + ("" if DEVICE.type == "cpu" else f"_{DEVICE.type}") + ("_quick" if args.quick else "")
    path = write_json(name, results)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
