"""What the collection loop needs from a vector env: the driver interface and the record of one step.

The loop (:mod:`torch_rollout.loop._rollout`) talks to envs only through a driver, one per
kind of vector env (chosen by :func:`torch_rollout.loop._drivers.make_loop`):

- :class:`~torch_rollout.envs._numpy.NumpyEnvs`: gymnasium vector envs of NumPy arrays, in every autoreset mode;
- :class:`~torch_rollout.envs._numpy.SendRecvEnvs`: envs stepped with ``send``/``recv`` (EnvPool in async
  mode, :class:`~torch_rollout.DoubleBufferedVectorEnv`), whose steps return some of the envs at a time;
- :class:`~torch_rollout.envs._torch.TorchEnvs`: vector envs of torch tensors, on their device.

A driver turns what its env returns into :class:`StepRecord` s with one meaning
whatever the autoreset mode: the observation each env acts on next, the results
of its previous step, whether that step was a transition, whether the next row
starts an episode, and the observations that ended episodes when the env
returned them apart. The driver also keeps the episode totals, checks what the
env returns, and converts the policy's actions for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDictBase
from torch import Tensor

__all__ = ["AutoresetMode", "EnvDriver", "StepRecord"]  # the loop names the mode as the seam's type


# One value per env of a record: NumPy arrays for the host drivers, tensors on the env's device for the torch one.
PerEnv = np.ndarray | Tensor
# Observations as the env returns them: an array or tensor, or a dict (TensorDict) of them for Dict spaces.
Observations: TypeAlias = np.ndarray | Tensor | Mapping[str, Any] | TensorDictBase


@dataclass(slots=True, kw_only=True)
class StepRecord:
    """One step of some (or all) envs, as the loop reads it; named as the batch keys the loop writes from it.

    Every array has one row per env of ``ids``: NumPy arrays for the host
    drivers, tensors on the env's device for
    :class:`~torch_rollout.envs._torch.TorchEnvs`.

    Attributes:
        obs: the observation each env acts on next (after any reset).
        ids: the envs of this record, None for all of them.
        reward: the rewards of the envs' previous steps; None when no env of ``ids``
            has a result (the first record after a reset).
        terminated, truncated: the flags of those steps.
        done: ``terminated | truncated``, as the driver computed it.
        stepped: which rows of ``ids`` hold a result (None: all of them, when ``reward`` is set).
        mask: whether each step was a transition (the batch's ``mask``: False on NEXT_STEP's reset
            steps); None: all were.
        episode_return, episode_length: the totals of each env's episode up to and including the step.
        is_init: whether each env's next row starts an episode (the batch's ``is_init``: its recurrent
            state is reset).
        final: the observations that ended episodes, where the env returned them apart from
            ``obs`` (SAME_STEP, DISABLED): dense rows for the device driver, ``(index, rows)`` of the
            envs that ended for the host drivers; None when no episode ended or ``obs`` holds them.
        own_final: the envs whose episode ended with the observation they acted on as its final one,
            where the env keeps no true final observation (an rsl_rl-style env's approximations):
            their rows' ``next_obs`` and ``next_value`` are the rows' own ``obs`` and ``value``, never
            recomputed. None: no such env (device driver only).
        info: the step's infos as the env returned them.
    """

    obs: Observations | None
    ids: np.ndarray | None = None
    reward: PerEnv | None = None
    terminated: PerEnv | None = None
    truncated: PerEnv | None = None
    done: PerEnv | None = None
    stepped: np.ndarray | None = None
    mask: PerEnv | None = None
    episode_return: PerEnv | None = None
    episode_length: PerEnv | None = None
    is_init: PerEnv | None = None
    final: tuple[np.ndarray, Observations] | Observations | None = None
    own_final: Tensor | None = None
    info: Mapping[str, Any] | None = None


class EnvDriver(Protocol):
    """Steps one kind of vector env for the loop; every env call goes through it."""

    envs: VectorEnv
    num_envs: int
    width: int  # envs of one step record: num_envs, or the batch_size of a send/recv pool
    autoreset_mode: AutoresetMode
    acts_at_once: bool  # acts on every env that comes back, also past the batch's end (send/recv pools)
    on_device: bool  # records of torch tensors (rows written with tensor ops), else NumPy arrays
    steps_into_rows: bool  # has step_into_rows(action, rows, t): every env's step written into host rows
    keep_final: bool  # the loop needs the final observations (set once the policy's outputs are known)
    call: str  # the env call running or made last, for a stuck loop's report
    reset_infos: Any  # the infos of the last reset, for the info keys' structures
    env_seconds: float  # seconds inside the env's own calls so far; the driver's work around them is not counted

    def reset(self, seed: int | None) -> StepRecord | None:
        """Resets every env; the record of their first observations, or None when the first ``recv`` gives them."""
        ...

    def send(self, action: Tensor, ids: np.ndarray | None) -> None:
        """Gives the policy's actions (on the policy's device) to the envs ``ids`` (None: all)."""
        ...

    def recv(self) -> StepRecord:
        """The next step record: a step of every env with the actions sent, or the envs that came back."""
        ...

    def check_seed(self, seed: int | None) -> None:
        """Warns or raises where ``seed`` cannot reach the envs (an EnvPool seeded when it was made)."""
        ...

    def info_recorder(self, specs: Mapping[str, Any], env_offset: int) -> Any:
        """The recorder of the named infos of each step, in rows of the records' kind."""
        ...

    def end_batch(self) -> None:
        """Checks that wait for the batch's end (they would read values back to the host)."""
        ...
