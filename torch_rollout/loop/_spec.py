"""What a batch holds (:class:`BatchKeys`), what every collection loop of a collector is told (``LoopSpec``).

:class:`CudaGraph`, the option of ``compile_policy`` that records the acting forward, is one of its settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase

from torch_rollout.envs._infos import check_info_keys

__all__ = ["BATCH_KEYS", "BatchKeys", "CudaGraph", "LoopPlace", "LoopSpec"]

# Keys the collector writes into every batch: obs_key (and with next_obs, "next_" + obs_key) cannot take one of them.
BATCH_KEYS = frozenset(
    (
        "action",
        "reward",
        "terminated",
        "truncated",
        "done",
        "mask",
        "episode_return",
        "episode_length",
        "policy_version",
        "next_value",
        "advantage",
        "return",
        "info",
    )
)


@dataclass(frozen=True)
class BatchKeys:
    """Which keys a batch holds beyond the ones it always has: the observations' name, next observations, infos.

    Args:
        obs_key: the batch key of observations, and the key a TensorDictModule
            policy reads them from (TorchRL's modules read ``"observation"``).
        info_keys: env info keys to keep in ``batch["info"]`` (see ``docs/infos.md``):
            a sequence of names, or a mapping of names to an example value of one
            env (``None``: learn it from the first reset and step).
        next_obs: also keep each row's true next observation, at ``"next_" + obs_key``
            (the final observation at an episode end, never a reset observation), for
            off-policy learners; it doubles the observations' storage (see ``docs/off-policy.md``).

    Examples:
        >>> BatchKeys(obs_key="observation", info_keys=("is_success",))
        BatchKeys(obs_key='observation', info_keys=('is_success',), next_obs=False)
        >>> BatchKeys(next_obs=True).next_obs_key
        'next_obs'
    """

    obs_key: str = "obs"
    info_keys: Sequence[str] | Mapping[str, Any] | None = None
    next_obs: bool = False
    # The checked form of info_keys, {key: example or None}: what the loops record.
    info_specs: dict[str, Any] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.obs_key, str) or not self.obs_key or self.obs_key in BATCH_KEYS:
            raise ValueError(
                f"BatchKeys: obs_key must be a str other than the batch's own keys {sorted(BATCH_KEYS)}, got "
                f"{self.obs_key!r} (TorchRL's modules read 'observation')"
            )
        if not isinstance(self.next_obs, bool):
            raise TypeError(
                f"BatchKeys: next_obs must be True or False, got {type(self.next_obs).__name__} {self.next_obs!r}"
            )
        if self.next_obs and self.next_obs_key in BATCH_KEYS:
            raise ValueError(
                f"BatchKeys: with next_obs=True the next observations are stored at 'next_' + obs_key = "
                f"{self.next_obs_key!r}, which is one of the batch's own keys; pass another obs_key"
            )
        object.__setattr__(self, "info_specs", check_info_keys(self.info_keys))

    @property
    def next_obs_key(self) -> str | None:
        """The batch key of next observations, ``"next_" + obs_key``, with ``next_obs=True``; else None."""
        return "next_" + self.obs_key if self.next_obs else None


@dataclass(frozen=True)
class LoopSpec:
    """The settings every collection loop of one collector runs with, in every placement and worker.

    Built once by the Collector from its arguments (each already checked) and
    sent as it is to the thread, each worker process and each Ray actor. What
    differs per loop (its envs, their global offset and seed, its device) is
    passed beside it.

    Attributes:
        num_steps: rows per batch (``T``).
        obs_key: the batch key of observations, and the key a TensorDictModule reads them from.
        check_finite: raise on NaN or inf observations, rewards and actions.
        info_keys: ``{key: example or None}`` of the env infos to keep, or None.
        initial_state: a recurrent policy's initial state of all the collector's
            envs, ``[num_envs, ...]`` on the CPU (each loop takes its rows), or None.
        compile_options: ``torch.compile`` keyword arguments for acting, a ``CudaGraph``, or None: eager.
        next_obs_key: the batch key of each row's true next observation (``"next_" + obs_key``),
            or None: the batch has none.
        batch_slots: batches on the CPU whose storage the loop writes again once nothing outside it
            refers to them (see ``_recycle.RowRing``); 0: new storage for every batch.
    """

    num_steps: int
    obs_key: str
    check_finite: bool
    info_keys: dict[str, Any] | None
    initial_state: TensorDictBase | None
    compile_options: dict[str, Any] | CudaGraph | None
    next_obs_key: str | None
    batch_slots: int = 0


def _never() -> bool:
    return False


@dataclass(frozen=True, kw_only=True)
class LoopPlace:
    """Where one loop runs, beside the :class:`LoopSpec` that every loop of a collector shares: its placement's.

    Attributes:
        device: where the policy runs (observations are moved there).
        storage_device: where batches are written: ``device`` for the thread, the CPU (shared memory or
            Ray's object store) for a worker.
        seed: the seed of the first reset (the loop's env ``i`` gets ``seed + i``), or None.
        env_offset: the global index of the loop's env 0, for error messages and the initial state's rows.
        stop: polled before each step; True stops the loop (it raises ``Stopped``).
    """

    device: torch.device
    storage_device: torch.device
    seed: int | None = None
    env_offset: int = 0
    stop: Callable[[], bool] = _never


@dataclass(frozen=True)
class CudaGraph:
    """``compile_policy=CudaGraph()``: the forward recorded as a CUDA graph at its first call, then replayed.

    No ``torch.compile``: the forward is recorded as it runs eagerly, so random
    sampling inside it (``Categorical.sample``, ``Normal.rsample``) draws fresh
    numbers at every replay. Needs a policy acting on a CUDA device. See
    ``docs/compile.md``.

    Args:
        warmup: eager calls of the forward on a side stream before it is
            recorded, as PyTorch's CUDA graph recipe prescribes: they let cuBLAS
            and lazily built state set themselves up outside the capture.

    Examples:
        >>> CudaGraph()
        CudaGraph(warmup=3)
    """

    warmup: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 1:
            raise ValueError(
                "CudaGraph: warmup must be an int >= 1 (eager calls of the forward before it is recorded; default "
                f"3), got {type(self.warmup).__name__} {self.warmup!r}"
            )
