"""Which loop drives which kind of vector env: one driver per env kind, chosen once when a placement builds its loop.

- :class:`~torch_rollout._loop.RolloutLoop`: gymnasium vector envs of NumPy arrays, in every autoreset mode;
- :class:`~torch_rollout._async_loop.AsyncRolloutLoop`: envs stepped with ``send``/``recv`` (EnvPool in async
  mode, :class:`~torch_rollout.DoubleBufferedVectorEnv`);
- :class:`~torch_rollout._torch_loop.TorchRolloutLoop`: vector envs of torch tensors, on their device.

Each writes the same batches (keys, rows, masks, bootstrap values) for the same transitions.
"""

from __future__ import annotations

from typing import Any

from gymnasium.vector import VectorEnv

from torch_rollout._async_loop import AsyncRolloutLoop, is_async_pool
from torch_rollout._envpool import check_envpool
from torch_rollout._loop import Forward, RolloutLoop
from torch_rollout._spec import LoopSpec
from torch_rollout._torch_loop import TorchRolloutLoop, presents_torch

__all__ = ["make_loop"]


def make_loop(envs: VectorEnv, forward: Forward, spec: LoopSpec, **placement: Any) -> RolloutLoop:
    """The loop for ``envs``' kind, built with the placement's arguments (``device``, ``seed``, ``stop``, ...)."""
    check_envpool(envs, placement.get("seed"))  # a pool of the user's own given a seed (it would ignore it)
    if is_async_pool(envs):
        driver: type[RolloutLoop] = AsyncRolloutLoop
    elif presents_torch(envs):
        driver = TorchRolloutLoop
    else:
        driver = RolloutLoop
    return driver(envs, forward, spec, **placement)
