"""The protocol every placement speaks: what the Collector asks of a running placement of the collection loop."""

from __future__ import annotations

import collections
from typing import Any, Protocol

from gymnasium import Space
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict
from torch import Tensor

from torch_rollout.loop._direct import Sink
from torch_rollout.loop._stats import Totals
from torch_rollout.placements._messages import EnvAnswer, EnvCall

__all__ = ["Placement"]


class Placement(Protocol):
    """A running placement of the collection loop, as the Collector uses it."""

    requested: int
    """Batches requested so far: :meth:`request` counts them together with the request."""
    ready: collections.deque[tuple[TensorDict | int | None, BaseException | None]]
    """Results that :meth:`wait` received, oldest first: ``(batch, None)`` or ``(None, error)``; the consumer
    takes them without a call. ``(rows, None)``: a batch's rows that :attr:`sink` took."""
    sink: Sink | None
    """Offered each batch's rows before a batch is made of them, where the loop runs in the calling thread
    (see :mod:`torch_rollout.loop._direct`); the other placements deliver batches and leave it alone."""

    @property
    def autoreset_mode(self) -> AutoresetMode:
        """The envs' autoreset mode (the workers' envs' where they build them), as read now."""

    @property
    def envs(self) -> VectorEnv | None:
        """The live vector env when it steps in this process, else None."""

    @property
    def spaces(self) -> tuple[Space[Any], Space[Any]]:
        """One env's observation and action spaces (``single_observation_space``, ``single_action_space``)."""

    @property
    def weights(self) -> dict[str, Tensor] | None:
        """The acting copy's tensors by name, which :meth:`refresh` writes; None when acting with the trainer's
        module itself, or once closed."""

    @property
    def extra_starts(self) -> int:
        """Later parts of the seed stream that it reset envs from by itself (a restarted Ray worker's new envs, from
        ``seed + r * seed_step`` at its ``r``-th restart): the Collector's ``state_dict`` counts them as starts."""

    @property
    def version(self) -> int:
        """Weight refreshes so far (the version of the weights that act now)."""

    def start(self) -> None:
        """Begins serving requests; called last in the Collector's construction (after this, only reseeds)."""

    def accounts(self) -> list[Totals]:
        """Each loop's :meth:`torch_rollout.loop._stats.Account.totals`, in worker order (one for the thread)."""

    def request(self) -> None:
        """Asks for one more batch; never blocks."""

    def wait(self, deadline: float | None) -> bool:
        """Waits until :attr:`ready` holds a result; False when ``deadline`` (``time.monotonic()``) passes first."""

    def refresh(self, dst: list[Tensor], src: list[Tensor]) -> None:
        """Copies ``src`` into the acting copy's ``dst`` and counts a new version, with no forward pass running."""

    def set_version(self, version: int) -> None:
        """Counts versions on from ``version`` (a resumed collector's), before the first request."""

    def reseed(self, seed: int | None) -> None:
        """Resets the envs from ``seed`` (env ``j``: ``seed + j``) before the next batch; before the first request."""

    def env_call(self, calls: list[EnvCall], deadline: float | None) -> list[EnvAnswer]:
        """Applies ``calls[k]`` to loop ``k``'s vector env between batches: after every batch requested so far (they
        wait in :attr:`ready`), before any later one; the answers in loop order. Raises RuntimeError once closed or
        failed, TimeoutError when ``deadline`` (monotonic) passes first."""

    def close(self, join_timeout: float) -> str | None:
        """Stops collecting and closes the envs it built; None, or where a thread that did not stop is stuck."""
