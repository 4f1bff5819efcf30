"""What a placement is built with: one frozen record, decided by the Collector and its Backend, passed whole."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_rollout.loop._spec import LoopSpec

__all__ = ["PlacementSettings"]


@dataclass(frozen=True, kw_only=True)
class PlacementSettings:
    """What a placement is built with, decided once by the Collector and its :class:`Backend` and passed whole.

    Attributes:
        spec: what every loop of the collector is told (rows per batch, keys, checks).
        num_envs: envs in all (``N``), split among the workers in contiguous shares.
        device: where batches are delivered and (but in Ray actors given GPUs) where the policy acts.
        prefetch: batches collected ahead of the consumer (the Backend's default where the user gave none).
        seed: env ``j``'s first reset seed is ``seed + j``; None: unseeded.
        seed_step: how far apart the parts of the rank's seed stream are (``world_size * num_envs``): envs
            built anew later (a restarted Ray worker's) take the next part.
        timeout: the collector's ``timeout`` (also how long workers may take to build their envs), or None.
        copy_why: the argument that makes the collector act with a copy of the policy (for its messages).
        copy_fix: the arguments that would let it act with the trainer's module itself.
    """

    spec: LoopSpec
    num_envs: int
    device: torch.device
    prefetch: int
    seed: int | None
    seed_step: int
    timeout: float | None
    copy_why: str
    copy_fix: str
