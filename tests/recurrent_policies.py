"""Test policies of recurrent mode, the acting mode and the value-only bootstrap path (picklable for workers)."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from counting_env import value_fn

__all__ = [
    "CallCountingPolicy",
    "CallCountingValuePolicy",
    "ModeProbePolicy",
    "StepCountingPolicy",
    "StepCountingValuePolicy",
    "steps_state",
]


def steps_state(num_envs: int) -> TensorDict:
    """StepCountingPolicy's initial state: zero steps seen (float, with a trailing dimension to carry)."""
    return TensorDict({"steps": torch.zeros(num_envs, 1)}, batch_size=[num_envs])


class StepCountingPolicy(nn.Module):
    """A recurrent policy whose state counts the steps it has seen since ``is_init``.

    On CountingEnv the state that goes into a step therefore equals the
    observation's step-in-episode (``obs[:, 2]``) on every row, reset rows of
    NEXT_STEP included. Values are ``value_fn(obs)`` plus ``100 * (state - obs[:, 2])``,
    so a bootstrap made with the wrong state gives a wrong ``next_value``.
    Actions are a function of obs. No value-only path: bootstraps run the forward.
    """

    def _value(self, obs: torch.Tensor, state: TensorDict) -> torch.Tensor:
        steps = state["steps"][:, 0]
        return value_fn(obs).to(obs.dtype) + 100.0 * (steps - obs[:, 2])

    def forward(self, obs: torch.Tensor, state: TensorDict, is_init: torch.Tensor) -> dict:
        steps = state["steps"]
        action = (obs[:, 0] + obs[:, 1] + obs[:, 2]).long() % 3
        return {"action": action, "value": self._value(obs, state), "next_state": {"steps": steps + 1}}


class StepCountingValuePolicy(StepCountingPolicy):
    """StepCountingPolicy with the value-only path ``get_value(obs, state, is_init)``."""

    def get_value(self, obs: torch.Tensor, state: TensorDict, is_init: torch.Tensor) -> torch.Tensor:
        return self._value(obs, state)


class CallCountingPolicy(nn.Module):
    """Random actions from torch's RNG; ``"call"`` numbers the forward calls of this copy of the policy."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, obs: torch.Tensor) -> dict:
        n = obs.shape[0]
        self.calls += 1
        value = value_fn(obs).to(obs.dtype)
        return {"action": torch.randint(0, 3, (n,)), "value": value, "call": torch.full((n,), self.calls)}


class CallCountingValuePolicy(CallCountingPolicy):
    """CallCountingPolicy with the value-only path ``get_value(obs)``."""

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return value_fn(obs).to(obs.dtype).unsqueeze(1)  # [n, 1], as CleanRL's Agent.get_value


class ModeProbePolicy(nn.Module):
    """Reports the mode it acts in (``"training"``), with a BatchNorm and a dropout that training mode would use."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.frozen = nn.Identity().eval()  # a submodule the trainer keeps in eval mode

    def forward(self, obs: torch.Tensor) -> dict:
        n = obs.shape[0]
        x = self.drop(self.norm(obs))
        return {
            "action": torch.zeros(n, dtype=torch.long),
            "value": x.sum(1),
            "training": torch.full((n,), float(self.training or self.norm.training or self.drop.training)),
        }


class _Head(nn.Module):
    """Greedy action and value from features (for the TorchRL policy)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.logits = nn.Linear(features, 3)
        self.value = nn.Linear(features, 1)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logits(features).argmax(-1), self.value(features).squeeze(-1)


def torchrl_recurrent_policy(kind: str, hidden: int = 8):
    """A TensorDictSequential around TorchRL's LSTMModule or GRUModule (``kind``), reading "obs" [n, 4] of CountingEnv.

    Its state keys: ``recurrent_state_h`` and ``recurrent_state_c`` (LSTM), ``recurrent_state`` (GRU).
    """
    from tensordict.nn import TensorDictModule, TensorDictSequential
    from torchrl.modules import GRUModule, LSTMModule

    torch.manual_seed(0)
    module = {"lstm": LSTMModule, "gru": GRUModule}[kind]
    return TensorDictSequential(
        TensorDictModule(nn.Linear(4, hidden), in_keys=["obs"], out_keys=["embed"]),
        module(input_size=hidden, hidden_size=hidden, in_key="embed", out_key="features"),
        TensorDictModule(_Head(hidden), in_keys=["features"], out_keys=["action", "value"]),
    )
