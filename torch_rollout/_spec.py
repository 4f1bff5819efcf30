"""What a batch holds (:class:`BatchKeys`) and what every collection loop of a collector is told (``LoopSpec``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDictBase

from torch_rollout._infos import check_info_keys

__all__ = ["BATCH_KEYS", "BatchKeys", "LoopSpec"]

# Keys the collector writes into every batch: obs_key cannot take one of them.
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
    """Which keys a batch holds beyond the ones it always has: the observations' name and the env infos kept.

    Args:
        obs_key: the batch key of observations, and the key a TensorDictModule
            policy reads them from (TorchRL's modules read ``"observation"``).
        info_keys: env info keys to keep in ``batch["info"]`` (see ``docs/infos.md``):
            a sequence of names, or a mapping of names to an example value of one
            env (``None``: learn it from the first reset and step).

    Examples:
        >>> BatchKeys(obs_key="observation", info_keys=("is_success",))
        BatchKeys(obs_key='observation', info_keys=('is_success',))
    """

    obs_key: str = "obs"
    info_keys: Sequence[str] | Mapping[str, Any] | None = None
    # The checked form of info_keys, {key: example or None}: what the loops record.
    info_specs: dict[str, Any] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.obs_key, str) or not self.obs_key or self.obs_key in BATCH_KEYS:
            raise ValueError(
                f"BatchKeys: obs_key must be a str other than the batch's own keys {sorted(BATCH_KEYS)}, got "
                f"{self.obs_key!r} (TorchRL's modules read 'observation')"
            )
        object.__setattr__(self, "info_specs", check_info_keys(self.info_keys))


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
        compile_options: ``torch.compile`` keyword arguments for acting, or None: eager.
    """

    num_steps: int
    obs_key: str
    check_finite: bool
    info_keys: dict[str, Any] | None
    initial_state: TensorDictBase | None
    compile_options: dict[str, Any] | None
