"""Where a collector stands in its run: batches delivered against the budget, the seed stream's starts, checkpoints."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch_rollout.loop._seed import Seed

__all__ = ["Progress"]


class Progress:
    """A collector's count of batches and of starts over its seed stream, carried across a checkpoint.

    ``total``: batches of ``total_timesteps`` in all (None: endless). A resumed
    collector counts on from a saved :meth:`state`: the batches its earlier
    parts delivered count against the budget, and its start is the next part
    of the seed stream.
    """

    def __init__(self, total_timesteps: int | None, num_steps: int, num_envs: int) -> None:
        self.num_steps, self.num_envs = num_steps, num_envs
        self.total = None if total_timesteps is None else math.ceil(total_timesteps / (num_steps * num_envs))
        self.delivered = 0  # batches delivered, by earlier collectors (a resumed state's) included
        self.resumed = 0  # of which earlier collectors delivered
        self.starts = 1  # collectors over this seed stream, this one included

    @property
    def finished(self) -> bool:
        return self.total is not None and self.delivered >= self.total

    def wanted(self, ahead: int) -> int:
        """Batches to have asked this collector's placement for: ``ahead`` beyond those delivered, within the budget."""
        wanted = self.delivered - self.resumed + ahead
        return wanted if self.total is None else min(wanted, self.total - self.resumed)

    def left(self) -> int:
        """Batches this collector delivers in all: those of the budget left after a resumed state's."""
        if self.total is None:
            raise TypeError("Collector: len() needs total_timesteps; this collector is endless")
        return max(0, self.total - self.resumed)

    def state(self, policy_version: int, seed: Seed | None, extra_starts: int) -> dict[str, Any]:
        """The plain-int dict of ``Collector.state_dict``; ``extra_starts``: restarted workers' parts of the stream."""
        keyed = Seed(0).resolved() if seed is None else seed  # unseeded: the rank, for the record
        return {
            "batches": self.delivered,
            "env_steps": self.delivered * self.num_steps * self.num_envs,
            "policy_version": policy_version,
            "seed": None if seed is None else keyed.value,
            "rank": keyed.rank,
            "world_size": keyed.world_size,
            "starts": self.starts + extra_starts,
            "num_steps": self.num_steps,
            "num_envs": self.num_envs,
        }

    def resume(self, state: Any, seed: Seed | None) -> int | None:
        """Counts on from a checked ``state``; returns the seed of env 0's resumed reset (None: unseeded)."""
        _check_state(state, self.num_steps, self.num_envs, seed)
        self.delivered = self.resumed = state["batches"]
        self.starts = state["starts"] + 1
        return None if seed is None else seed.env_seed(0, num_envs=self.num_envs, start=state["starts"])


def _check_state(state: Any, num_steps: int, num_envs: int, seed: Seed | None) -> None:
    """Refuses what is not a :meth:`Collector.state_dict` of a collector with this batch size and seed stream."""
    keys = ("batches", "policy_version", "starts", "num_steps", "num_envs")
    optional = {"rank": 0, "world_size": 1}  # absent from the states of earlier releases: one rank
    if (
        not isinstance(state, Mapping)
        or any(not isinstance(state.get(k), int) for k in keys)
        or any(not isinstance(state.get(k, default), int) for k, default in optional.items())
    ):
        raise ValueError(
            f"Collector.load_state_dict: expected the dict of Collector.state_dict() with int entries "
            f"{list(keys)} (and {list(optional)}), got {state!r}"
        )
    saved, now = state["num_steps"] * state["num_envs"], num_steps * num_envs
    if saved != now:
        raise ValueError(
            f"Collector.load_state_dict: the state counts batches of num_steps * num_envs = "
            f"{state['num_steps']} * {state['num_envs']} = {saved} env steps, this collector's are "
            f"{num_steps} * {num_envs} = {now}; resume with the same batch size"
        )
    if seed is not None and state.get("seed") is not None:
        _check_same_stream(state["seed"], seed)
        _check_same_rank(state.get("rank", 0), state.get("world_size", 1), seed)


def _check_same_stream(value: Any, seed: Seed) -> None:
    """Refuses a state saved with another seed value: its ``starts`` count parts of another stream."""
    if value != seed.value:
        raise ValueError(
            f"Collector.load_state_dict: the state was saved by a collector with seed={value!r}, but this collector "
            f"has seed={seed.value} ({seed}); its count of starts belongs to that seed stream, so resuming on another "
            f"could reset envs with seeds the saved run or another rank already used: resume with the saved run's "
            f"seed (seed=torch_rollout.Seed({value!r}, rank={seed.rank}, world_size={seed.world_size})), or, to "
            "begin another seed stream on purpose, load the state with its 'seed' entry set to None"
        )


def _check_same_rank(rank: int, world_size: int, seed: Seed) -> None:
    """Refuses a state saved by another rank or world size: its seed stream would meet another rank's."""
    if (rank, world_size) != (seed.rank, seed.world_size):
        raise ValueError(
            f"Collector.load_state_dict: the state was saved by rank {rank} of world_size {world_size}, but this "
            f"collector is rank {seed.rank} of world_size {seed.world_size} ({seed}); the seed stream is keyed by "
            "both, so it would replay episodes of another rank: resume with the same seeding as the saved run, "
            f"the same number of ranks each loading its own rank's state (or seed=torch_rollout.Seed({seed.value}, "
            f"rank={rank}, world_size={world_size}))"
        )
