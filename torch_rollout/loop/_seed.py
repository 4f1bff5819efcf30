"""The envs' seed stream: which seed each env of each rank resets with, on a fresh start and after resumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed

__all__ = ["Seed", "resolve_seed", "seed_step"]


@dataclass(frozen=True)
class Seed:
    """The seed of a collector's envs, keyed by its rank among ``world_size`` data-parallel collectors.

    Env ``j`` of rank ``r`` in the collector's ``k``-th start on the stream
    (``k = 0`` fresh, ``1`` after one resume, ...; see ``docs/checkpoints.md``)
    is reset with ``value + (k * world_size + r) * num_envs + j``. Every rank's
    envs of every start get seeds of their own, so no two ranks replay the
    same episodes, on a fresh start or after any number of resumes. With one
    rank this is ``value + k * num_envs + j``: ``seed=value`` (an int) is the
    same as ``Seed(value)``.

    A restarted Ray worker takes the next part of its rank's stream, as a
    resume would, and the collector's ``state_dict`` counts it, so a later
    resume goes past it.

    Args:
        value: the stream's first seed, an int >= 0.
        rank: this collector's rank, in ``[0, world_size)``; ``None``: the global
            rank of the initialised ``torch.distributed`` process group, else 0.
        world_size: how many collectors (ranks) share the stream; ``None``: the
            process group's world size, else 1.

    Raises:
        TypeError: for a field that is not an int (or ``None``).
        ValueError: for a negative ``value`` or ``rank``, a ``world_size`` < 1, or
            a ``rank`` outside ``[0, world_size)`` (checked when the collector is
            built for fields taken from ``torch.distributed``).

    Examples:
        >>> seed = Seed(1, rank=1, world_size=2)
        >>> [seed.env_seed(j, num_envs=4) for j in range(4)]  # rank 1, fresh start
        [5, 6, 7, 8]
        >>> seed.env_seed(0, num_envs=4, start=1)  # its first resume: past rank 0's and rank 1's fresh seeds
        13
    """

    value: int
    rank: int | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        for name, minimum, optional in (("value", 0, False), ("rank", 0, True), ("world_size", 1, True)):
            x = getattr(self, name)
            if x is None and optional:
                continue
            if isinstance(x, bool) or not isinstance(x, int):
                none = " or None" if optional else ""
                raise TypeError(f"Seed: {name} must be an int >= {minimum}{none}, got {type(x).__name__} {x!r}")
            if x < minimum:
                raise ValueError(f"Seed: {name} must be an int >= {minimum}, got {x}")
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(
                f"Seed: rank must be in [0, world_size), got rank={self.rank} with world_size={self.world_size}; "
                f"ranks of {self.world_size} collectors are 0..{self.world_size - 1}"
            )

    def resolved(self) -> Seed:
        """This seed with ``rank`` and ``world_size`` filled in: from ``torch.distributed`` when initialised."""
        group = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = self.rank if self.rank is not None else torch.distributed.get_rank() if group else 0
        world_size = (
            self.world_size if self.world_size is not None else torch.distributed.get_world_size() if group else 1
        )
        if rank >= world_size:
            rank_from = "given" if self.rank is not None else "torch.distributed's"
            size_from = (
                "given" if self.world_size is not None else "torch.distributed's" if group else "no process group"
            )
            raise ValueError(
                f"Seed: rank must be in [0, world_size), got rank={rank} ({rank_from}) with world_size={world_size} "
                f"({size_from}); give both, e.g. Seed({self.value}, rank={rank}, world_size={rank + 1})"
            )
        return Seed(self.value, rank=rank, world_size=world_size)

    def env_seed(self, j: int, *, num_envs: int, start: int = 0) -> int:
        """The seed env ``j`` of ``num_envs`` is reset with in the collector's ``start``-th start on the stream."""
        seed = self.resolved()
        assert seed.rank is not None and seed.world_size is not None  # resolved() sets both
        return seed.value + (start * seed.world_size + seed.rank) * num_envs + j


def seed_step(seed: Seed | None, num_envs: int) -> int:
    """How far apart on the stream a rank's successive starts of ``num_envs`` envs are (1 without a seed)."""
    if seed is None:
        return 1
    assert seed.world_size is not None  # a resolved seed (see resolve_seed)
    return seed.world_size * num_envs


def resolve_seed(seed: Any) -> Seed | None:
    """The Collector's ``seed`` argument as a resolved :class:`Seed` (``rank`` and ``world_size`` set), or None."""
    if seed is None:
        return None
    if isinstance(seed, Seed):
        return seed.resolved()
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"Collector: seed must be an int >= 0, a torch_rollout.Seed(value, rank=..., world_size=...) or None, "
            f"got {type(seed).__name__} {seed!r}"
        )
    if seed < 0:
        raise ValueError(f"Collector: seed must be an int >= 0, got {seed}")
    return Seed(seed).resolved()
