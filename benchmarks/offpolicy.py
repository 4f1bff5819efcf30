"""Off-policy collection, one step of every env per update, into a replay ring: the collector beside the hand loops.

Off-policy learners take the opposite shape to PPO's: a few steps (often one) of every env per
batch, each transition written into a replay buffer with its true next observation. For each
shape (gymnasium CartPole-v1 in SAME_STEP mode with N=4 and N=16 at T=1 and N=4 at T=8, as
CleanRL's DQN steps it; torch_rollout's torch CartPole, whose SAME_STEP final observations are
dense tensors, with N=256 at T=1 and N=1024 and N=4096 at T=1 and T=4, as FastTD3 steps its
simulator), with a 64x64 Q-network acting greedily, every system writes the same transitions
(obs, action, reward, true next obs, terminated) into a preallocated ring of tensors:

- hand loop: CleanRL-style for the NumPy envs (obs to tensor, forward, step, the final
  observations patched in from ``infos["final_obs"]``), FastTD3-style for the torch envs
  (``torch.where(ended, final_obs, next_obs)`` on the device), then the ring write;
- ``Collector(envs, q, num_steps=T, gae=None, keys=BatchKeys(next_obs=True), backend="thread")``
  with ``prefetch=0`` and ``prefetch=1``, the ring's five keys of each batch (``batch[key].flatten(0, 1)``)
  written into the ring; and with ``prefetch=0`` once more through ``batch.reshape(-1)`` (every key
  of the batch reshaped, then the five written), the cost of that idiom at these shapes; and with
  ``prefetch=0`` writing its rows into a ``torch_rollout.ReplayRing`` itself (``ring.fill(collector)``);
- TorchRL's ``Collector`` (``frames_per_batch=N*T``) feeding its ``ReplayBuffer``
  (``LazyTensorStorage``) with ``extend``, on the same envs (the NumPy envs through ``GymWrapper``,
  the torch envs through the ``EnvBase`` adapter of ``torch_envs.py``), if torchrl is installed;
- env alone (pre-drawn actions), policy alone (forward on recorded observations) and their
  serial sum ``1 / (1 / env + 1 / policy)``, the floor of a loop that steps and then acts.

Systems run interleaved (A B C ... A B C), each built afresh per repeat; frames are env steps x N,
medians over the repeats; ratios are to the hand loop. Everything runs once with one torch
thread and once with torch's default thread count. The script prints Markdown tables ready for
docs/performance.md and writes ``results/offpolicy.json`` (``offpolicy_quick.json`` with ``--quick``;
``offpolicy_gym.json`` with ``--kinds gym``).

Usage::

    benchmarks/.venv/bin/python benchmarks/offpolicy.py [--quick] [--repeats R] [--units U] [--kinds gym,torch]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import torch
from torch import nn

from _common import (
    RING_KEYS,
    EnvAlone,
    PolicyAlone,
    Ring,
    RingLoop,
    fmt_rate,
    has,
    machine_info,
    markdown_table,
    quiet_warnings,
    run_interleaved,
    serial_floor,
    write_json,
)

__all__ = ["SHAPES", "QNetwork", "factories", "gym_envs", "run_shape", "shape_name", "to_markdown"]

# (env kind, N, T): "gym" is gymnasium's CartPole-v1 SyncVectorEnv, "torch" torch_rollout.envs.CartPole
SHAPES = (
    ("gym", 4, 1),
    ("gym", 16, 1),
    ("gym", 4, 8),
    ("torch", 256, 1),
    ("torch", 1024, 1),
    ("torch", 1024, 4),
    ("torch", 4096, 1),
    ("torch", 4096, 4),
)
FRAMES_PER_UNIT = 1024  # a timed unit is whole batches of at least this many frames
RING_FRAMES = 1 << 20  # transitions the ring holds (rounded down to whole batches)
OBS_DIM, N_ACTIONS = 4, 2


class QNetwork(nn.Module):
    """A 64x64 ReLU Q-network acting greedily (DQN's acting policy without its epsilon)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(OBS_DIM, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": self.net(obs).argmax(-1)}


def _q(device: torch.device) -> QNetwork:
    torch.manual_seed(0)
    return QNetwork().to(device)


def _ring(shape: _Shape) -> Ring:
    return Ring(RING_FRAMES, shape.batch_frames, OBS_DIM, shape.device)


def gym_envs(num_envs: int) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(num_envs)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )


def _torch_envs(num_envs: int, device: torch.device) -> gym.vector.VectorEnv:
    from torch_rollout.envs import CartPole

    return CartPole(num_envs, device=device, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


class _Shape:
    """What every system of one shape shares: the env kind, N, T, the device and the batches per timed unit."""

    def __init__(self, kind: str, num_envs: int, num_steps: int, device: torch.device) -> None:
        self.kind, self.num_envs, self.num_steps, self.device = kind, num_envs, num_steps, device
        self.batch_frames = num_envs * num_steps
        self.batches = max(1, FRAMES_PER_UNIT // self.batch_frames)
        self.frames = self.batches * self.batch_frames

    def envs(self) -> gym.vector.VectorEnv:
        return gym_envs(self.num_envs) if self.kind == "gym" else _torch_envs(self.num_envs, self.device)

    def done(self) -> int:
        """The unit's frames, once the device has finished the work queued for them (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.frames


def hand_loop(shape: _Shape) -> RingLoop:
    """CleanRL's loop for NumPy envs, FastTD3's for torch envs: act, step, true next obs, ring write."""
    steps = shape.batches * shape.num_steps
    return RingLoop(shape.envs(), _q(shape.device), _ring(shape), steps=steps, frames=shape.frames, device=shape.device)


class Collecting:
    """The collector on the same envs, ``prefetch`` batches ahead, each batch's rows written into the ring.

    ``whole``: the rows taken as ``batch.reshape(-1)`` (a TensorDict of every key), not key by key.
    """

    def __init__(self, shape: _Shape, prefetch: int, whole: bool = False) -> None:
        from torch_rollout import BatchKeys, Collector

        self.shape, self.envs, self.whole = shape, shape.envs(), whole
        self.ring = _ring(shape)
        self.collector = Collector(
            self.envs,
            _q(shape.device),
            num_steps=shape.num_steps,
            gae=None,
            keys=BatchKeys(next_obs=True),
            device=shape.device,
            prefetch=prefetch,
            seed=0,
            backend="thread",
        )
        self.batches = iter(self.collector)

    def step(self) -> int:
        for _ in range(self.shape.batches):
            batch = next(self.batches)
            if self.whole:
                batch = batch.reshape(-1)  # [T * N], every key
                self.ring.write(*(batch[key] for key in RING_KEYS))
            else:
                self.ring.write(*(batch[key].flatten(0, 1) for key in RING_KEYS))  # [T * N] of each
        return self.shape.done()

    def close(self) -> None:
        self.collector.close()
        self.envs.close()


class Filling(Collecting):
    """The collector writing its rows into a ``torch_rollout.ReplayRing`` itself (``ring.fill(collector)``)."""

    def __init__(self, shape: _Shape) -> None:
        from torch_rollout import ReplayRing

        super().__init__(shape, 0)
        self.replay = ReplayRing(self.ring.capacity, RING_KEYS, device=shape.device)
        self.written = self.replay.fill(self.collector)

    def step(self) -> int:
        for _ in range(self.shape.batches):
            next(self.written)
        return self.shape.done()


class TorchRL:
    """TorchRL's ``Collector`` feeding its ``ReplayBuffer`` (``LazyTensorStorage``) with ``extend``."""

    def __init__(self, shape: _Shape) -> None:
        from tensordict.nn import TensorDictModule
        from torchrl.collectors import Collector
        from torchrl.data import LazyTensorStorage, ReplayBuffer
        from torchrl.envs import GymWrapper

        if shape.kind == "gym":
            env = GymWrapper(gym_envs(shape.num_envs), categorical_action_encoding=True, device="cpu")
            env.set_seed(0)
        else:
            from torch_envs import torchrl_env  # torch CartPole behind TorchRL's EnvBase, on the CPU

            env = torchrl_env(shape.num_envs)
        q = _q(shape.device)
        actor = TensorDictModule(lambda obs: q(obs)["action"], in_keys=["observation"], out_keys=["action"])
        self.collector = Collector(env, actor, frames_per_batch=shape.batch_frames, total_frames=-1, device="cpu")
        self.buffer = ReplayBuffer(storage=LazyTensorStorage(_ring(shape).capacity))
        self.shape, self.batches = shape, iter(self.collector)

    def step(self) -> int:
        for _ in range(self.shape.batches):
            self.buffer.extend(next(self.batches).reshape(-1))
        return self.shape.done()

    def close(self) -> None:
        self.collector.shutdown()


def env_alone(shape: _Shape) -> EnvAlone:
    envs = shape.envs()
    envs.reset(seed=0)
    steps = shape.batches * shape.num_steps
    actions = torch.randint(N_ACTIONS, (steps, shape.num_envs), generator=torch.Generator().manual_seed(0))
    actions = list(actions.numpy()) if shape.kind == "gym" else list(actions.to(shape.device))
    return EnvAlone(envs, actions, num_envs=shape.num_envs, device=shape.device)


def policy_alone(shape: _Shape) -> PolicyAlone:
    q, envs = _q(shape.device), shape.envs()
    obs, _ = envs.reset(seed=0)
    recorded = []
    for _ in range(shape.batches * shape.num_steps):
        recorded.append(torch.as_tensor(obs, device=shape.device))
        obs, *_ = envs.step(envs.action_space.sample() if shape.kind == "gym" else q(recorded[-1])["action"])
    envs.close()
    return PolicyAlone(q, recorded, num_envs=shape.num_envs, device=shape.device)


def factories(
    kind: str, num_envs: int, num_steps: int, device: str = "cpu", *, torchrl: bool = True
) -> dict[str, Callable[[], Any]]:
    """The systems of one shape, by name, for ``run_interleaved`` (TorchRL's on the CPU, if it is installed)."""
    shape = _Shape(kind, num_envs, num_steps, torch.device(device))
    systems: dict[str, Callable[[], Any]] = {
        "hand loop": functools.partial(hand_loop, shape),
        "collector, prefetch=0": functools.partial(Collecting, shape, 0),
        "collector, prefetch=1": functools.partial(Collecting, shape, 1),
        "collector, prefetch=0, batch.reshape(-1)": functools.partial(Collecting, shape, 0, True),
        "ReplayRing.fill(collector), prefetch=0": functools.partial(Filling, shape),
    }
    if torchrl and has("torchrl") and shape.device.type == "cpu":
        systems["TorchRL Collector + ReplayBuffer"] = functools.partial(TorchRL, shape)
    systems["env alone"] = functools.partial(env_alone, shape)
    systems["policy alone"] = functools.partial(policy_alone, shape)
    return systems


def run_shape(
    kind: str,
    num_envs: int,
    num_steps: int,
    *,
    device: str,
    repeats: int,
    units: int,
    log: Callable[[str], None],
    torchrl: bool = True,
) -> dict[str, Any]:
    """Medians (frames/s) of every system on one shape, the serial floor and the ratios to the hand loop."""
    rates = run_interleaved(
        factories(kind, num_envs, num_steps, device, torchrl=torchrl), repeats=repeats, warmup=1, steps=units, log=log
    )
    medians = {name: statistics.median(values) for name, values in rates.items()}
    medians["serial floor"] = serial_floor(medians["env alone"], medians["policy alone"])
    hand = medians["hand loop"]
    return {"rates": rates, "medians": medians, "ratios": {name: value / hand for name, value in medians.items()}}


def shape_name(kind: str, num_envs: int, num_steps: int) -> str:
    env = "gymnasium CartPole-v1 SAME_STEP" if kind == "gym" else "torch CartPole"
    return f"{env}, N={num_envs}, T={num_steps}"


def to_markdown(results: list[dict[str, Any]]) -> str:
    """One table: a row per shape, frames/s medians with the ratio to the hand loop in brackets."""
    columns = [
        "hand loop",
        "collector, prefetch=0",
        "collector, prefetch=1",
        "collector, prefetch=0, batch.reshape(-1)",
        "ReplayRing.fill(collector), prefetch=0",
        "TorchRL Collector + ReplayBuffer",
        "env alone",
        "policy alone",
        "serial floor",
    ]
    rows = []
    for result in results:
        medians, ratios = result["medians"], result["ratios"]
        best = max(ratios[c] for c in columns[1:5] if c in ratios and "reshape" not in c)
        cells = [
            "-"
            if c not in medians
            else fmt_rate(medians[c])
            if c == "hand loop"
            else f"{fmt_rate(medians[c])} ({ratios[c]:.2f}x)"
            for c in columns
        ]
        rows.append([result["shape"], *cells[:3], f"{best:.2f}x", *cells[3:]])
    header = ["env, shape", *columns[:3], "collector / hand loop (best)", *columns[3:]]
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat, one torch thread only: a check, not a result")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats per shape (default 3; 1 quick)")
    parser.add_argument(
        "--units", type=int, default=None, help=f"timed units of >= {FRAMES_PER_UNIT} frames (default 4; 2 quick)"
    )
    parser.add_argument("--kinds", default="gym,torch", help="the env kinds whose shapes run (gym, torch or both)")
    parser.add_argument("--device", default="cpu", help="where the torch envs, policy and ring live (cuda: torch only)")
    args = parser.parse_args()
    quiet_warnings()
    # Its INFO lines would land among the tables: torchrl sets its logger's level from this when imported.
    os.environ.setdefault("RL_LOGGING_LEVEL", "WARNING")
    repeats = args.repeats or (1 if args.quick else 3)
    units = args.units or (2 if args.quick else 4)
    kinds = args.kinds.split(",")
    shapes = [s for s in SHAPES if s[0] in kinds and (args.device == "cpu" or s[0] == "torch")]
    default_threads = torch.get_num_threads()
    thread_settings = [1] if args.quick or default_threads == 1 else [1, default_threads]
    log = functools.partial(print, file=sys.stderr)  # stdout: the Markdown tables only
    payload: dict[str, Any] = {"machine": machine_info(), "device": args.device, "runs": {}}
    load_start = os.getloadavg()[0]
    for threads in thread_settings:
        torch.set_num_threads(threads)
        results = []
        for kind, num_envs, num_steps in shapes:
            log(f"{shape_name(kind, num_envs, num_steps)}, {threads} torch thread(s)")
            result = run_shape(kind, num_envs, num_steps, device=args.device, repeats=repeats, units=units, log=log)
            results.append({"shape": shape_name(kind, num_envs, num_steps), **result})
        payload["runs"][str(threads)] = results
        print(
            f"\n**{threads} torch thread(s)**, on {args.device}: frames/s, median of {repeats} interleaved repeats of "
            f"{units} units of >= {FRAMES_PER_UNIT} frames; (ratio to the hand loop)\n"
        )
        print(to_markdown(results), flush=True)
        payload["load_average_1m"] = [load_start, os.getloadavg()[0]]
        name = "offpolicy" + ("" if kinds == ["gym", "torch"] else "_" + "_".join(kinds))
        path = write_json(name + ("_quick" if args.quick else ""), payload)  # kept after each setting
    load_end = payload["load_average_1m"][1]
    machine = payload["machine"]
    print(
        f"\n{machine['cpu_model']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"torchrl {machine['versions']['torchrl']}, gymnasium {machine['versions']['gymnasium']}; "
        f"1-min load {load_start:.2f} at the start, {load_end:.2f} at the end"
    )
    log(f"results: {path}")


if __name__ == "__main__":
    main()
