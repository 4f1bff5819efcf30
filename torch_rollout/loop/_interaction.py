"""The collector thread's policy calls sample as the policy's own ``default_interaction_type`` says.

tensordict's :class:`~tensordict.nn.set_interaction_type` applies to the whole
process by default, and TorchRL's losses (``ClipPPOLoss`` and others) enter
``set_interaction_type(DETERMINISTIC)`` while they run: read from the collector
thread, that made a ``ProbabilisticActor`` act greedily while the trainer
computed its loss, and its stored ``log_prob`` claim a stochastic policy.
Worker processes have an interaction type of their own and need nothing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["greedy_modules", "own_interaction_type"]

_install_lock = threading.Lock()


def own_interaction_type() -> contextlib.AbstractContextManager[None]:
    """A context in which the calling thread sees no interaction type set: each module uses its default.

    What other threads set or see is unchanged (the trainer's loss keeps its
    DETERMINISTIC), and what a module sets inside the context stays in this
    thread. With a tensordict whose ``set_interaction_type`` takes
    ``thread_local`` (0.15 and later) that is its own per-thread mode; older
    ones keep one process-wide mode, which is then given a per-thread override
    (see :class:`_PerThreadMode`).
    """
    return _own_mode()()


@functools.cache
def _own_mode() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """What makes :func:`own_interaction_type`'s context, worked out once per process: ``inspect.signature``
    costs more than the rest of a short batch, and an import statement at every batch a few microseconds."""
    try:
        from tensordict.nn import probabilistic
    except ImportError:  # pragma: no cover (tensordict is a requirement; its layout may change)
        return contextlib.nullcontext
    if _has_thread_local(probabilistic):
        return functools.partial(probabilistic.set_interaction_type, None, thread_local=True)
    return functools.partial(_legacy_own_mode, probabilistic)


def _has_thread_local(probabilistic: Any) -> bool:
    return "thread_local" in inspect.signature(probabilistic.set_interaction_type).parameters


class _legacy_own_mode:  # noqa: N801  (a function's name: a class only to cost less than a generator's context)
    def __init__(self, probabilistic: Any) -> None:
        self.probabilistic = probabilistic

    def __enter__(self) -> None:
        modes = self.probabilistic._interaction_type
        if not isinstance(modes, _PerThreadMode):
            with _install_lock:
                modes = self.probabilistic._interaction_type
                if not isinstance(modes, _PerThreadMode):
                    modes = self.probabilistic._interaction_type = _PerThreadMode(modes)
        self.local = local = modes.local
        self.previous = getattr(local, "own", None)
        local.own = [None]  # this thread's mode; set_interaction_type blocks inside change only it

    def __exit__(self, *exc_info: Any) -> None:
        self.local.own = self.previous


class _PerThreadMode:
    """tensordict's interaction-type holder (before 0.15) with an override for the threads that ask for one.

    It stands in for ``tensordict.nn.probabilistic._interaction_type``, through
    which ``interaction_type()`` and ``set_interaction_type`` read and write the
    mode. A thread inside :func:`own_interaction_type` reads and writes its own
    slot; every other thread reads and writes the process-wide mode of the
    holder it replaced, exactly as before.
    """

    def __init__(self, process_wide: Any) -> None:
        self.process_wide = process_wide
        self.local = threading.local()

    def get_mode(self) -> Any:
        own = getattr(self.local, "own", None)
        return self.process_wide.get_mode() if own is None else own[0]

    def set_mode(self, type: Any) -> None:
        own = getattr(self.local, "own", None)
        if own is None:
            self.process_wide.set_mode(type)
        else:
            own[0] = type


def greedy_modules(policy: Any) -> list[tuple[str, str]]:
    """``(name, interaction type)`` of the policy's probabilistic tensordict modules that do not sample by default."""
    try:
        from tensordict.nn import InteractionType, ProbabilisticTensorDictModule
    except ImportError:  # pragma: no cover
        return []
    return [
        (name or type(module).__name__, f"InteractionType.{module.default_interaction_type.name}")
        for name, module in policy.named_modules()
        if isinstance(module, ProbabilisticTensorDictModule)
        and module.default_interaction_type != InteractionType.RANDOM
    ]
