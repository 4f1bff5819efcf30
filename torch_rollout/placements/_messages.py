"""The messages between the trainer and its workers (worker processes, Ray actors): small, named, picklable.

The trainer sends :data:`COLLECT` (collect the next batch), :class:`Reseed` (reset
the envs from this seed before the next batch), :class:`EnvCall` (call a method
of the envs, or get or set an attribute, between batches), :data:`SLOTS_MAPPED`
(the batch slots a worker process sent are mapped: it may let go of their file
descriptors) and :data:`STOP`. A worker answers :class:`Ready` once its envs are
built, then a :class:`Batch` per request and an :class:`EnvAnswer` per env call,
or :class:`Failed` with the error that ended it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch_rollout.loop._stats import Totals

__all__ = [
    "COLLECT",
    "SLOTS_MAPPED",
    "STOP",
    "Batch",
    "Collect",
    "EnvAnswer",
    "EnvCall",
    "Failed",
    "Ready",
    "Reseed",
    "SlotsMapped",
    "Stop",
]


@dataclass(frozen=True, slots=True)
class Collect:
    """Collect the next batch."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop collecting and exit."""


@dataclass(frozen=True, slots=True)
class SlotsMapped:
    """The trainer has mapped the batch slots that came with the worker's first batch."""


@dataclass(frozen=True, slots=True)
class Reseed:
    """Reset the envs from ``seed`` (the worker's first env's) before the next batch."""

    seed: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvCall:
    """Apply gymnasium's ``VectorEnv.<method>(name, *args, **kwargs)`` to the worker's envs, between two batches.

    ``method`` is ``"call"``, ``"get_attr"`` or ``"set_attr"`` (whose ``args`` hold the worker's values).
    """

    method: str
    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The call as errors name it: ``Collector.env_calls.get_attr('obs_rms')``."""
        return f"Collector.env_calls.{self.method}({self.name!r})"


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvAnswer:
    """What an :class:`EnvCall` returned (``value``), or the error it raised, which leaves the worker serving.

    ``missing`` says the envs lack the name, ``unsupported`` that they have no such method (not a vector env of
    separate envs); ``envs`` is their repr, for the trainer's messages.
    """

    envs: str
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    missing: bool = False
    unsupported: bool = False


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker's envs are built: their autoreset mode and what the trainer checks before any batch."""

    info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Batch:
    """The worker's share of a batch: a slot's index (worker processes, with the slots the first time) or arrays,
    and the account of the worker's time so far."""

    data: Any
    slots: list[Any] | None = None
    account: Totals | None = None  # the worker loop's Account.totals()
    autoreset_mode: str | None = None  # as the worker's loop reads its envs now (an undeclared env's, once shown)


@dataclass(frozen=True, slots=True)
class Failed:
    """The error that ended the worker's collection, with its traceback as text."""

    error: BaseException
    traceback: str


COLLECT, STOP, SLOTS_MAPPED = Collect(), Stop(), SlotsMapped()
