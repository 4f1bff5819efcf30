"""Which driver steps which kind of vector env, chosen once when a placement builds its loop.

- :class:`~torch_rollout.envs._numpy.SendRecvEnvs`: envs stepped with ``send``/``recv`` (EnvPool in async
  mode, :class:`~torch_rollout.DoubleBufferedVectorEnv`);
- :class:`~torch_rollout.envs._torch.TorchEnvs`: vector envs of torch tensors, on their device;
- :class:`~torch_rollout.envs._numpy.NumpyEnvs`: gymnasium vector envs of NumPy arrays, in every autoreset mode.

The one loop (:class:`~torch_rollout.loop._rollout.RolloutLoop`) runs each of them, and
writes the same batches (keys, rows, masks, bootstrap values) for the same transitions.
"""

from __future__ import annotations

from typing import Any

from gymnasium.vector import VectorEnv

from torch_rollout.envs._envpool import check_envpool
from torch_rollout.envs._numpy import NumpyEnvs, SendRecvEnvs, check_whole_steps, is_async_pool
from torch_rollout.envs._seam import EnvDriver
from torch_rollout.envs._torch import TorchEnvs, presents_torch
from torch_rollout.loop._acting import Forward
from torch_rollout.loop._rollout import RolloutLoop
from torch_rollout.loop._spec import LoopPlace, LoopSpec

__all__ = ["make_loop"]


def make_loop(envs: VectorEnv, forward: Forward, spec: LoopSpec, place: LoopPlace) -> RolloutLoop:
    """The loop over ``envs``' driver, run where ``place`` says (its device, first seed, stop, env offset)."""
    check_envpool(envs, place.seed)  # a pool of the user's own given a seed (it would ignore it)
    check_whole_steps(envs)  # ale-py's AtariVectorEnv in its asynchronous mode
    if is_async_pool(envs):
        kind: type[Any] = SendRecvEnvs
    elif presents_torch(envs):
        kind = TorchEnvs
    else:
        kind = NumpyEnvs
    loop: RolloutLoop | None = None

    def non_finite(name: str, env: int, value: Any, call: str) -> None:
        assert loop is not None  # made before the driver's first env call
        loop._non_finite(name, env, value, call)

    driver: EnvDriver = kind(envs, check_finite=spec.check_finite, non_finite=non_finite, env_offset=place.env_offset)
    loop = RolloutLoop(driver, forward, spec, place)
    return loop
