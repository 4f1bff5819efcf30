"""Copies between devices: none of the loop's copies with the host as destination is non-blocking.

A non-blocking copy to the CPU returns before the data has landed (from CUDA, into
page-locked memory the host reads at once: an env stepping on stale actions, wrong
final observations). On the CPU nothing is stale, so these tests look at the calls
themselves: every ``Tensor.to``/``copy_`` (and TensorDict's) that torch_rollout makes
while collecting is recorded, and one with ``non_blocking=True`` and a CPU
destination fails, whatever the source.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import pytest
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict, TensorDictBase
from torch import nn

import torch_rollout
from torch_rollout import BatchKeys, Collector
from torch_rollout.envs import CartPole
from torch_rollout.util._devices import copy_into, indexed, to_device

T, N = 5, 4
PACKAGE = pathlib.Path(torch_rollout.__file__).parent


class Linear(nn.Module):
    """Actions and values from one linear layer; with ``recurrent``, a state that sums observations."""

    def __init__(self, recurrent: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 2)
        self.recurrent = recurrent

    def forward(self, obs: torch.Tensor, state: TensorDict | None = None, is_init: Any = None) -> dict:
        out = self.layer(obs)
        result = {"action": (out[:, 0] > 0).long(), "value": out[:, 1]}
        if self.recurrent:
            result["value"] = result["value"] + state["h"].sum(-1)
            result["next_state"] = {"h": 0.5 * state["h"] + obs[:, :2]}
        return result


def h_state(num_envs: int) -> TensorDict:
    return TensorDict({"h": torch.zeros(num_envs, 2)}, batch_size=[num_envs])


def _non_blocking(args: tuple, kwargs: dict, position: int | None) -> bool:
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    if position is not None:  # copy_(src, non_blocking)
        return len(args) > position and bool(args[position])
    return any(isinstance(arg, bool) and arg for arg in args)  # to(device, dtype, non_blocking, copy)


def _cpu(value: Any) -> bool:
    device = getattr(value, "device", None)
    return device is None or torch.device(device).type == "cpu"


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The non-blocking copies to the CPU that torch_rollout's own code makes, in every thread, as ``file:line``."""
    found: list[str] = []

    def record(method: Any, *, returns_destination: bool, position: int | None) -> Any:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = method(self, *args, **kwargs)
            caller = sys._getframe(1)
            if caller.f_globals.get("__name__", "").startswith("torch_rollout") and _non_blocking(
                args, kwargs, position
            ):
                if _cpu(result if returns_destination else self):
                    found.append(f"{caller.f_code.co_filename}:{caller.f_lineno} {method.__qualname__}")
            return result

        return wrapper

    for cls in (torch.Tensor, TensorDict, TensorDictBase):
        for name, returns_destination, position in (("to", True, None), ("copy_", False, 1)):
            if cls is torch.Tensor or name in vars(cls):  # Tensor's are torch._C.TensorBase's
                method = getattr(cls, name)
                monkeypatch.setattr(
                    cls, name, record(method, returns_destination=returns_destination, position=position)
                )
    yield found


def test_the_recorder_sees_a_planted_copy(copies):
    """The check itself: a non-blocking copy to the CPU made from torch_rollout's code is recorded."""
    source = torch.zeros(3)
    namespace = {"__name__": "torch_rollout._planted", "source": source}
    exec("source.to('cpu', non_blocking=True); torch.empty(3).copy_(source, True)", {**namespace, "torch": torch})
    assert len(copies) == 2
    copies.clear()
    to_device(source, torch.device("cpu"))
    copy_into(torch.empty(3), source)
    assert copies == []


def _numpy_cartpole(num_envs: int) -> gym.vector.VectorEnv:
    return gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")


SETUPS = [
    pytest.param(lambda mode=mode: CartPole(N, autoreset_mode=mode, max_episode_steps=3), id=f"torch-{mode.value}")
    for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED)
] + [pytest.param(lambda: _numpy_cartpole(N), id="numpy")]


@pytest.mark.parametrize("recurrent", [False, True], ids=["feedforward", "recurrent"])
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("make_envs", SETUPS)
def test_no_copy_to_the_host_is_non_blocking(make_envs, prefetch, recurrent, copies):
    kwargs: dict[str, Any] = dict(initial_state=h_state) if recurrent else {}
    with Collector(
        make_envs(),
        Linear(recurrent),
        num_steps=T,
        device="cpu",
        backend="thread",
        prefetch=prefetch,
        seed=3,
        timeout=60.0,
        total_timesteps=3 * T * N,
        keys=BatchKeys(next_obs=True),
        **kwargs,
    ) as collector:
        batches = list(collector)
    assert len(batches) == 3
    assert copies == [], "non-blocking copies to the CPU (the host may read them before they land):\n" + "\n".join(
        sorted(set(copies))
    )


def test_every_non_blocking_copy_goes_through_the_helpers():
    """``non_blocking=`` appears only in torch_rollout.util._devices: elsewhere copies say nothing or False."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_devices.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.keyword) and node.arg == "non_blocking":
                if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.value.lineno}")
    assert found == [], (
        f"non_blocking=... outside torch_rollout/util/_devices.py at {found}: use to_device or copy_into, which are "
        "non-blocking only when the destination is a CUDA device"
    )


def test_indexed_devices():
    assert indexed("cpu") == torch.device("cpu")
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
