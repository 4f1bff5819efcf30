"""The loop talks to envs through one driver per env kind: what each driver must give, and what the loop checks.

The exactness of each kind is tested beside it (test_collector, test_async_loop,
test_torch_loop); here: the seam itself, the final observations a driver keeps
only for what needs them, and the checks of the loop that hold for every kind.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gymnasium as gym
import pytest
import torch
from gymnasium.vector import AutoresetMode, VectorWrapper
from torch import nn

from torch_rollout import Collector
from torch_rollout.envs import CartPole

from async_pool import AsyncCountingPool

PACKAGE = Path(__file__).resolve().parent.parent / "torch_rollout"
TIMEOUT = 60.0


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("module", ["loop/_rollout.py", "loop/_rows.py", "envs/_seam.py"])
def test_the_loop_imports_no_env_kind(module):
    env_kinds = {
        "gymnasium.vector",
        "torch_rollout.envs._numpy",
        "torch_rollout.envs._torch",
        "torch_rollout.envs._double_buffer",
        "torch_rollout.envs._envpool",
        "torch_rollout.loop._drivers",
        "envpool",
    }
    imports = imported_modules(PACKAGE / module)
    # the seam names gymnasium's types for its annotations only
    allowed = {"gymnasium.vector"} if module == "envs/_seam.py" else set()
    assert not (imports & env_kinds) - allowed


class DropFinalObs(VectorWrapper):
    """A SAME_STEP vector env whose step infos lose the final observations (as a careless wrapper would)."""

    def step(self, actions):
        obs, reward, terminated, truncated, infos = self.env.step(actions)
        infos = {key: value for key, value in infos.items() if "final_obs" not in key}
        return obs, reward, terminated, truncated, infos


def numpy_same_step(num_envs):
    return gym.make_vec(
        "CartPole-v1", num_envs=num_envs, vectorization_mode="sync", vector_kwargs={"autoreset_mode": "SameStep"}
    )


def torch_same_step(num_envs):
    return CartPole(num_envs, autoreset_mode=AutoresetMode.SAME_STEP, max_episode_steps=5)


class ActOnly(nn.Module):
    """Always pushes left: CartPole-v1 falls within about 10 steps, whatever the seed."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, obs):
        return {"action": torch.zeros(obs.shape[0], dtype=torch.int64)}


class ActAndValue(ActOnly):
    def forward(self, obs):
        return {**super().forward(obs), "value": obs.sum(-1)}


@pytest.mark.parametrize("make", [numpy_same_step, torch_same_step], ids=["numpy", "torch"])
def test_missing_final_observations_are_an_error_only_where_a_bootstrap_needs_them(make):
    # CartPole-v1 pushed left ends episodes within 40 steps; the torch one has a 5-step limit.
    with Collector(DropFinalObs(make(4)), ActOnly(), num_steps=40, seed=0, prefetch=0, timeout=TIMEOUT) as collector:
        batch = next(collector)
    assert batch["done"].any()  # episodes ended, and nothing needed their final observations
    with Collector(
        DropFinalObs(make(4)), ActAndValue(), num_steps=40, seed=0, prefetch=0, timeout=TIMEOUT
    ) as collector:
        with pytest.raises(KeyError, match="SAME_STEP.*final"):
            next(collector)


class KeysChangeAt(nn.Module):
    """Returns an extra output from its ``at``-th call on."""

    def __init__(self, at):
        super().__init__()
        self.calls = 0
        self.at = at

    def forward(self, obs):
        self.calls += 1
        n = obs.shape[0]
        out = {"action": torch.zeros(n, dtype=torch.long), "value": torch.zeros(n)}
        if self.calls >= self.at:
            out["extra"] = torch.zeros(n)
        return out


@pytest.mark.parametrize(
    "make",
    [lambda: gym.make_vec("CartPole-v1", num_envs=3), lambda: AsyncCountingPool(4, 2)],
    ids=["step", "send-recv"],
)
def test_policy_outputs_that_change_keys_between_steps_are_an_error(make):
    with Collector(make(), KeysChangeAt(3), num_steps=8, prefetch=0, timeout=TIMEOUT, backend="thread") as collector:
        with pytest.raises(ValueError, match=r"policy output keys changed from \['action', 'value'\] to"):
            next(collector)
