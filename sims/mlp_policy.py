"""The small MLP policy that the sims benchmarks run (a module of its own, so that worker processes unpickle it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import Tensor, nn

__all__ = ["MLPPolicy"]


class MLPPolicy(nn.Module):
    """The small policy every system runs: a 2x64 tanh MLP; a Box action is tanh of its output plus Gaussian noise
    (in ``[-1, 1]``), a Discrete one drawn from its logits. ``group`` names a Dict observation's group it reads."""

    def __init__(self, obs_dim: int, action_space: spaces.Space, *, group: str | None = None, seed: int = 0) -> None:
        super().__init__()
        self.discrete = isinstance(action_space, spaces.Discrete)
        out = int(action_space.n) if self.discrete else int(np.prod(action_space.shape))
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, out))
        torch.random.set_rng_state(state)
        self.group = group

    def forward(self, obs: Any) -> dict[str, Tensor]:
        out = self.net(obs if self.group is None else obs[self.group])
        if self.discrete:
            return {"action": torch.multinomial(out.softmax(-1), 1).squeeze(-1)}
        return {"action": torch.tanh(out + 0.5 * torch.randn_like(out))}
