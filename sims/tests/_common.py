"""What the integration tests share: a vector wrapper that records what the framework returned, and GAE in float64."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gymnasium.vector import VectorWrapper
from tensordict import TensorDict
from torch import Tensor, nn

from torch_rollout import GAE, BatchKeys, Collector, Processes
from torch_rollout.envs._gym import split_envs

__all__ = [
    "LinearAgent",
    "Recorder",
    "RecordingRecipe",
    "Step",
    "as_same_step",
    "check_same_step_rows",
    "check_values_and_gae",
    "collect_lockstep",
    "gae_float64",
    "check_rows_in_workers",
    "load_records",
]


def _clone(x: Any) -> Any:
    """A deep copy of tensors (cloned), dicts and lists of them, NumPy arrays as tensors; other values as deep
    copies. An object array (a NumPy vector env's ``infos["final_obs"]``, None where an env did not end) becomes one
    tensor, zeros where it held None."""
    if isinstance(x, Tensor):
        return x.clone()
    if isinstance(x, np.ndarray):
        if x.dtype != object:
            return torch.as_tensor(x).clone()
        present = [torch.as_tensor(entry) for entry in x if entry is not None]
        return torch.stack([present[0].new_zeros(present[0].shape) if e is None else torch.as_tensor(e) for e in x])
    if isinstance(x, dict):
        return {key: _clone(value) for key, value in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(value) for value in x)
    return copy.deepcopy(x)


@dataclass(kw_only=True)
class Step:
    """One ``step()`` of the framework's env, as it returned it (cloned)."""

    action: Tensor
    obs: Any
    reward: Tensor
    terminated: Tensor
    truncated: Tensor
    infos: dict[str, Any]
    extra: Any = None  # what the recorder's ``extra()`` read off the env after the step


@dataclass(kw_only=True)
class Record:
    resets: list[Any] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)


class Recorder(VectorWrapper):
    """Passes every call through and keeps what the wrapped env returned, so that a test compares rows with it.

    The collector finds the env's ``device`` and autoreset mode through ``.env``, as through any wrapper.
    ``extra()``, if given, is called after each step and its result kept (cloned) in ``Step.extra``: state of the
    framework that the wrapped env does not return, such as Isaac Lab's own termination flags.
    """

    def __init__(self, env: Any, *, extra: Any = None) -> None:
        super().__init__(env)
        self.record = Record()
        self.extra = extra

    def reset(self, *, seed: Any = None, options: Any = None) -> tuple[Any, dict[str, Any]]:
        obs, infos = self.env.reset(seed=seed, options=options)
        self.record.resets.append(_clone(obs))
        return obs, infos

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, reward, terminated, truncated, infos = self.env.step(actions)
        self.record.steps.append(
            Step(
                action=_clone(torch.as_tensor(actions)),
                obs=_clone(obs),
                reward=_clone(torch.as_tensor(reward)),
                terminated=_clone(torch.as_tensor(terminated)),
                truncated=_clone(torch.as_tensor(truncated)),
                infos=_clone(infos),
                extra=None if self.extra is None else _clone(self.extra()),
            )
        )
        return obs, reward, terminated, truncated, infos


class _SavingRecorder(Recorder):
    """A Recorder that saves its record to ``path`` when the env is closed (in a worker process, at its end)."""

    def __init__(self, env: Any, *, path: str) -> None:
        super().__init__(env)
        self.path = path

    def close(self, **kwargs: Any) -> None:
        super().close(**kwargs)
        torch.save(self.record, f"{self.path}.part")
        os.replace(f"{self.path}.part", self.path)  # whole or not there: the test polls for it


@dataclass(frozen=True)
class RecordingRecipe:
    """A ``make_envs(num_envs, start_index)`` for worker processes: ``make(num_envs)``'s envs in a recorder that
    saves what they returned to ``folder/<start_index>.pt`` when the worker closes them (``load_records``)."""

    make: Callable[[int], Any]
    folder: str

    def __call__(self, num_envs: int, start_index: int = 0) -> Recorder:
        return _SavingRecorder(self.make(num_envs), path=str(Path(self.folder) / f"{start_index}.pt"))


def load_records(folder: str, starts: list[int], *, timeout: float = 30.0) -> list[Record]:
    """The records of the workers whose first envs are ``starts``, once each worker has saved its own."""
    paths = [Path(folder) / f"{start}.pt" for start in starts]
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [torch.load(path, weights_only=False) for path in paths]


def collect_lockstep(
    envs: Recorder,
    agent: nn.Module,
    *,
    num_steps: int,
    batches: int,
    gamma: float,
    gae_lambda: float,
    seed: int | None = None,
    info_keys: tuple[str, ...] = (),
    prefetch: int = 0,
) -> list[TensorDict]:
    """``batches`` batches of ``envs`` on the thread, in lockstep (``prefetch=0``) unless ``prefetch`` is given: the
    recorder's steps are the batches' rows, in order (and, collected ahead, those of the batches after them)."""
    with Collector(
        envs,
        agent,
        num_steps=num_steps,
        total_timesteps=envs.num_envs * num_steps * batches,
        device="cpu",
        backend="thread",
        prefetch=prefetch,
        seed=seed,
        gae=GAE(gamma=gamma, gae_lambda=gae_lambda),
        keys=BatchKeys(next_obs=True, info_keys=info_keys),
    ) as collector:
        return list(collector)


class LinearAgent(nn.Module):
    """A deterministic actor-critic: the action is a linear function of the observation (squashed for a Box in
    [-1, 1], argmax for Discrete), the value another; seeded, so a test recomputes both eagerly."""

    def __init__(
        self, obs_dim: int, act_dim: int, *, discrete: bool = False, group: str | None = None, seed: int = 0
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.actor, self.critic = nn.Linear(obs_dim, act_dim), nn.Linear(obs_dim, 1)
        for parameter in self.parameters():
            parameter.data = torch.randn(parameter.shape, generator=generator) * 0.5
        self.discrete = discrete
        self.group = group  # a Dict observation's group the agent reads, e.g. rsl_rl's "policy"

    def _input(self, obs: Any) -> Tensor:
        return obs if self.group is None else obs[self.group]

    def act(self, obs: Any) -> Tensor:
        logits = self.actor(self._input(obs))
        return logits.argmax(-1) if self.discrete else torch.tanh(logits)

    def get_value(self, obs: Any) -> Tensor:
        return self.critic(self._input(obs)).squeeze(-1)

    def forward(self, obs: Any) -> dict[str, Tensor]:
        return {"action": self.act(obs), "value": self.get_value(obs)}


def gae_float64(
    reward: Tensor,
    value: Tensor,
    next_value: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    *,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """GAE by the textbook backward loop in float64, independent of ``torch_rollout.gae``'s scan: ``[T, N]`` in,
    ``(advantage, return)`` out."""
    reward, value, next_value = (x.double() for x in (reward, value, next_value))
    not_terminated, not_done = (~terminated).double(), (~(terminated | truncated)).double()
    advantage = torch.zeros_like(value)
    carry = torch.zeros_like(value[0])
    for t in reversed(range(value.shape[0])):
        delta = reward[t] + gamma * not_terminated[t] * next_value[t] - value[t]
        carry = delta + gamma * gae_lambda * not_done[t] * carry
        advantage[t] = carry
    return advantage, advantage + value


def check_values_and_gae(batch: Any, agent: LinearAgent, *, gamma: float, gae_lambda: float, where: str) -> None:
    """A batch's ``value`` against the agent's, recomputed eagerly, and its ``advantage`` and ``return`` against the
    float64 GAE of its own ``next_value`` and flags (for envs whose ``next_value`` the test checks row by row)."""
    with torch.no_grad():
        value = agent.get_value(batch["obs"])
    torch.testing.assert_close(batch["value"], value, msg=lambda m: f"{where} value: {m}")
    advantage, return_ = gae_float64(
        batch["reward"],
        value,
        batch["next_value"],
        batch["terminated"],
        batch["truncated"],
        gamma=gamma,
        gae_lambda=gae_lambda,
    )
    torch.testing.assert_close(batch["advantage"].double(), advantage, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch["return"].double(), return_, rtol=1e-5, atol=1e-5)


def as_same_step(record: Record, *, final_key: str) -> Record:
    """What a DISABLED env returned, as a SAME_STEP env would have: each step's observation is that of the
    ``reset(options={"reset_mask": ...})`` after it (the collector makes one after every step), and the step's own
    observation, the one before the reset, is ``infos[final_key]``."""
    assert len(record.resets) == len(record.steps) + 1, "a masked reset after every step"
    steps = [
        Step(
            action=step.action,
            obs=reset,
            reward=step.reward,
            terminated=step.terminated,
            truncated=step.truncated,
            infos={final_key: step.obs},
            extra=step.extra,
        )
        for step, reset in zip(record.steps, record.resets[1:], strict=True)
    ]
    return Record(resets=record.resets[:1], steps=steps)


def _where(done: Tensor, final: Any, obs: Any) -> Any:
    if isinstance(obs, Tensor):
        return torch.where(done.view(-1, *[1] * (obs.dim() - 1)), final, obs)
    return {key: _where(done, final[key], obs[key]) for key in obs}


def _equal(got: Any, expected: Any, what: str) -> None:
    if isinstance(expected, Tensor):
        torch.testing.assert_close(got, expected.to(got.dtype), rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
    else:
        for key in expected:
            _equal(got[key], expected[key], f"{what}[{key!r}]")


def check_same_step_rows(
    batches: list[Any],
    record: Record,
    agent: LinearAgent,
    *,
    final_key: str,
    flags_of: Any = None,
    gamma: float,
    gae_lambda: float,
) -> None:
    """Checks every row of ``batches`` (collected in lockstep from the start) against what a SAME_STEP env returned.

    Row ``t`` of step ``s`` must hold the observation the env returned before step ``s``, the action it received,
    its reward and flags, ``next_obs`` the returned observation or, where the episode ended, ``infos[final_key]``;
    ``value`` and ``next_value`` the agent's value of those, recomputed here eagerly; ``advantage`` and ``return``
    the float64 GAE of them. ``flags_of(step)`` gives the true ``(terminated, truncated)`` where the flags the env
    returned are not them.
    """
    steps = iter(record.steps)
    obs = record.resets[0]
    for k, batch in enumerate(batches):
        rows = []
        for _ in range(batch.batch_size[0]):
            step = next(steps)
            terminated, truncated = (step.terminated, step.truncated) if flags_of is None else flags_of(step)
            done = terminated | truncated
            final = step.infos.get(final_key)
            next_obs = step.obs if final is None else _where(done, final, step.obs)
            rows.append((obs, step, terminated, truncated, next_obs))
            obs = step.obs
        where = f"batch {k}"
        _equal(batch["obs"], _stack([row[0] for row in rows]), f"{where} obs")
        _equal(batch["next_obs"], _stack([row[4] for row in rows]), f"{where} next_obs")
        _equal(batch["action"], torch.stack([row[1].action for row in rows]), f"{where} action")
        _equal(batch["reward"], torch.stack([row[1].reward for row in rows]).float(), f"{where} reward")
        terminated = torch.stack([row[2] for row in rows]).bool()
        truncated = torch.stack([row[3] for row in rows]).bool()
        _equal(batch["terminated"], terminated, f"{where} terminated")
        _equal(batch["truncated"], truncated, f"{where} truncated")  # both where the env gave both
        _equal(batch["done"], terminated | truncated, f"{where} done")
        assert bool(batch["mask"].all()), f"{where}: SAME_STEP rows are all real, mask={batch['mask']}"
        with torch.no_grad():
            value = agent.get_value(batch["obs"])
            next_value = agent.get_value(batch["next_obs"])
        torch.testing.assert_close(batch["value"], value, msg=lambda m, w=where: f"{w} value: {m}")
        live = ~terminated  # a terminated row's next_value is never read
        torch.testing.assert_close(
            batch["next_value"][live], next_value[live], msg=lambda m, w=where: f"{w} next_value: {m}"
        )
        advantage, return_ = gae_float64(
            batch["reward"], value, next_value, terminated, truncated, gamma=gamma, gae_lambda=gae_lambda
        )
        torch.testing.assert_close(
            batch["advantage"].double(), advantage, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w} GAE: {m}"
        )
        torch.testing.assert_close(
            batch["return"].double(), return_, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w} return: {m}"
        )


def _stack(values: list[Any]) -> Any:
    if isinstance(values[0], Tensor):
        return torch.stack(values)
    return {key: torch.stack([value[key] for value in values]) for key in values[0]}


def check_rows_in_workers(
    make: Callable[[int], Any],
    agent: LinearAgent,
    *,
    folder: str,
    num_envs: int,
    num_steps: int,
    batches: int,
    workers: int,
    final_key: str,
    gamma: float,
    gae_lambda: float,
) -> list[TensorDict]:
    """Collects ``batches`` in ``workers`` worker processes that build their shares with ``make(num_envs)`` and record
    what the envs returned (``RecordingRecipe``), then checks every row of each worker's share against its record
    (``check_same_step_rows``); returns the batches for the caller's own checks."""
    with Collector(
        RecordingRecipe(make, folder),
        agent,
        num_envs=num_envs,
        num_steps=num_steps,
        total_timesteps=num_envs * num_steps * batches,
        device="cpu",
        backend=Processes(workers),
        seed=0,
        gae=GAE(gamma=gamma, gae_lambda=gae_lambda),
        keys=BatchKeys(next_obs=True),
    ) as collector:
        got = list(collector)
    shares = split_envs(num_envs, workers)
    records = load_records(folder, [start for start, _ in shares])
    for (start, count), record in zip(shares, records, strict=True):
        own = [batch[:, start : start + count] for batch in got]
        check_same_step_rows(own, record, agent, final_key=final_key, gamma=gamma, gae_lambda=gae_lambda)
    return got
