"""Placements: where the collection loop runs. The user's choice of one, and how it is built.

A *placement* runs the one collection loop (``torch_rollout.loop._rollout``) somewhere
and moves batches and weights between it and the trainer: the background
thread (``_thread.py``), worker processes with shared memory (``_process.py``),
Ray actors (``_ray.py``). The Collector talks to a placement only through
the protocol :class:`~torch_rollout.placements._protocol.Placement`; the user
chooses one with ``backend=``: a name, or one of the :class:`Backend` objects
:class:`Thread`, :class:`Processes` and :class:`Ray`, which check their arguments
and build their placement. Adding a placement is
one module and one :class:`Backend` here.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from gymnasium.vector import VectorEnv
from torch import nn

from torch_rollout.envs._gym import EnvRecipe, build_envs, check_picklable
from torch_rollout.loop._arguments import check_int
from torch_rollout.loop._spec import LoopSpec
from torch_rollout.loop._stats import Setting, available_cores
from torch_rollout.loop._weights import acting_copy, check_policy_device
from torch_rollout.placements._protocol import Placement
from torch_rollout.placements._script import import_problem, main_globals, main_problem, unguarded_call
from torch_rollout.placements._settings import PlacementSettings

if TYPE_CHECKING:
    from torch_rollout.loop._spec import CudaGraph

__all__ = ["Backend", "Placement", "Processes", "Ray", "Thread", "resolve_backend"]

_NAMES = ("auto", "thread", "process", "ray")


class Backend:
    """The user's choice of placement (``backend=``): checks the arguments for it and builds it."""

    name: ClassVar[str]
    num_workers: int

    def check(self, envs: Any, policy: nn.Module, compile_options: dict[str, Any] | CudaGraph | None) -> None:
        """Refuses ``envs``, ``policy`` or ``compile_options`` that this placement cannot use, naming the fix."""

    def settings(
        self,
        spec: LoopSpec,
        *,
        num_envs: int,
        device: torch.device,
        prefetch: int | None,
        seed: int | None,
        seed_step: int,
        timeout: float | None,
    ) -> PlacementSettings:
        """The settings of its placement: the Collector's, with this placement's default ``prefetch`` where it is
        None, and the reason it would act with a copy of the policy."""
        if prefetch is not None:
            check_int("prefetch", prefetch, minimum=0)
        chosen = self._default_prefetch(device) if prefetch is None else prefetch
        why, fix = self._copy_reason(chosen)
        return PlacementSettings(
            spec=spec,
            num_envs=num_envs,
            device=device,
            prefetch=chosen,
            seed=seed,
            seed_step=seed_step,
            timeout=timeout,
            copy_why=why,
            copy_fix=fix,
        )

    def verdict_setting(self, settings: PlacementSettings, *, live_envs: bool) -> Setting:
        """What the verdict of :meth:`Collector.stats` knows of the collector."""
        spec = settings.spec
        return Setting(
            backend=self.name,
            num_workers=self.num_workers,
            num_envs=settings.num_envs,
            num_steps=spec.num_steps,
            prefetch=settings.prefetch,
            device=settings.device.type,
            live_envs=live_envs,
            check_finite=spec.check_finite,
            info_keys=len(spec.info_keys or ()),
            cores=available_cores(),
            gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            threads=torch.get_num_threads() if self.name == "thread" else 1,  # a worker acts with one
        )

    def build(self, envs: VectorEnv | EnvRecipe, policy: nn.Module, settings: PlacementSettings) -> Placement:
        """Builds and returns the running placement (a remote one has its envs built by then, not reset)."""
        raise NotImplementedError

    def _default_prefetch(self, device: torch.device) -> int:
        return 1

    def _copy_reason(self, prefetch: int) -> tuple[str, str]:
        return f"backend={self.name!r}", "backend='thread' with prefetch=0"

    def __repr__(self) -> str:
        # num_workers, then only what differs from the defaults: a new setting changes no repr that does not set it.
        given = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)  # type: ignore[arg-type]
            if f.repr and (f.name == "num_workers" or getattr(self, f.name) != f.default)
        ]
        return f"{type(self).__name__}({', '.join(given)})"


@dataclass(frozen=True, repr=False)
class Thread(Backend):
    """The collection loop in the trainer's process: right for a CUDA policy and live envs.

    With ``prefetch=0`` (lockstep) and no ``timeout``, ``next()`` collects the
    batch in the calling thread; otherwise a daemon thread collects, ahead of
    the trainer by ``prefetch`` batches (or watching the time a batch takes).

    Examples:
        >>> Thread()
        Thread()
    """

    name: ClassVar[str] = "thread"
    num_workers: int = field(default=1, init=False, repr=False)

    def _default_prefetch(self, device: torch.device) -> int:
        # Measured (docs/performance.md): on a CPU the thread shares the GIL with the trainer and collecting
        # ahead made training slower; in lockstep it is never slower.
        return 0 if device.type == "cpu" else 1

    def _copy_reason(self, prefetch: int) -> tuple[str, str]:
        return f"prefetch={prefetch}", "prefetch=0"

    def build(self, envs: VectorEnv | EnvRecipe, policy: nn.Module, settings: PlacementSettings) -> Placement:
        from torch_rollout.placements._thread import InlinePlacement, ThreadPlacement

        # In lockstep the batch is collected in the caller's thread, unless a thread must watch for a timeout.
        prefetch, device = settings.prefetch, settings.device
        placement = InlinePlacement if prefetch == 0 and settings.timeout is None else ThreadPlacement
        owns_envs = not isinstance(envs, VectorEnv)
        built = envs if isinstance(envs, VectorEnv) else build_envs(envs, settings.num_envs)
        try:
            if prefetch == 0:
                check_policy_device(policy, device)
                acting_policy = policy
            else:
                acting_policy = acting_copy(policy, device, why=settings.copy_why, fix=settings.copy_fix)
            return placement(
                built,
                acting_policy,
                # The trainer's batch, those waiting in ready and the one being filled: storage written again.
                replace(settings.spec, batch_slots=prefetch + 2),
                owns_envs=owns_envs,
                owned=acting_policy is not policy,
                device=device,
                seed=settings.seed,
            )
        except BaseException:
            if owns_envs:
                built.close()
            raise


@dataclass(frozen=True, repr=False)
class Processes(Backend):
    """The collection loop in ``num_workers`` worker processes, each stepping a contiguous share of the envs.

    Each worker builds its envs from ``envs`` (an env id or a picklable
    ``make_envs`` function); batches and weights travel in shared memory.

    Examples:
        >>> Processes(num_workers=2)
        Processes(num_workers=2)
    """

    name: ClassVar[str] = "process"
    num_workers: int = 1

    def __post_init__(self) -> None:
        _check_workers(self)

    def check(self, envs: Any, policy: nn.Module, compile_options: dict[str, Any] | CudaGraph | None) -> None:
        instead = "a picklable function make_envs(num_envs) -> VectorEnv (e.g. torch_rollout.gym_envs('CartPole-v1'))"
        _refuse_live_envs(self, envs, "worker process", instead)
        hints = {
            "envs": "define it at module level (not a lambda or a local function) or use backend='thread'",
            "policy": "make it picklable or use backend='thread'",
        }
        problem = main_problem()
        for name, obj in (("envs", envs), ("policy", policy)):
            try:
                found = main_globals(obj)
            except Exception as exc:
                raise TypeError(
                    f"Collector: {name}={obj!r} cannot be pickled for a worker process ({exc}); {hints[name]}"
                ) from exc
            problem = problem or import_problem(name, found)
        if problem is not None:
            raise TypeError(f"Collector(backend='process'): {problem}")
        if compile_options:  # e.g. a backend function, sent to the workers
            check_picklable(
                "compile_policy", compile_options, "pass the backend by its name or as a module-level function"
            )
        # Last: a script that worker processes cannot import at all is named above, not its missing guard.
        unguarded = unguarded_call()
        if unguarded is not None:
            raise RuntimeError(unguarded)

    def build(self, envs: VectorEnv | EnvRecipe, policy: nn.Module, settings: PlacementSettings) -> Placement:
        from torch_rollout.placements._process import ProcessPlacement, check_shared_memory

        assert not isinstance(envs, VectorEnv)  # refused by check()
        # The workers share the acting copy's memory: a refresh writes it in place.
        acting_policy = acting_copy(policy, torch.device("cpu"), why=settings.copy_why, fix=settings.copy_fix)
        weights = sum(t.nbytes for t in itertools.chain(acting_policy.parameters(), acting_policy.buffers()))
        check_shared_memory(weights, "the policy's weights (the copy of them that the worker processes share)")
        acting_policy.share_memory()
        return ProcessPlacement(envs, acting_policy, settings, num_workers=self.num_workers)


@dataclass(frozen=True, repr=False)
class Ray(Backend):
    """The collection loop in ``num_workers`` Ray actors, on the Ray this process is connected to (or a local one).

    Args:
        num_workers: Ray actors, each stepping a contiguous share of the envs.
        options: Ray actor options for every worker (``num_cpus``, ``num_gpus``,
            ``resources``, ``runtime_env``, ``scheduling_strategy``, ...; a worker
            given GPUs runs the policy on its GPU), and ``max_restarts``: how many
            times a worker whose actor died is recreated with new envs (default 0:
            the death is an error).

    Examples:
        >>> Ray(num_workers=4, options={"num_cpus": 1, "max_restarts": 2})
        Ray(num_workers=4, options={'num_cpus': 1, 'max_restarts': 2})
        >>> Ray(num_workers=2)  # its repr leaves out the settings at their defaults
        Ray(num_workers=2)
    """

    name: ClassVar[str] = "ray"
    num_workers: int = 1
    options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_workers(self)
        if self.options is not None and not isinstance(self.options, Mapping):
            raise ValueError(
                f"Ray: options must be a dict of Ray actor options, got {type(self.options).__name__} {self.options!r}"
            )
        restarts = (self.options or {}).get("max_restarts", 0)
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ValueError(
                f"Ray: options['max_restarts'] must be an int >= 0 (restarts per worker), got {restarts!r}"
            )

    def check(self, envs: Any, policy: nn.Module, compile_options: dict[str, Any] | CudaGraph | None) -> None:
        from torch_rollout.placements._ray import check_ray_picklable

        _refuse_live_envs(self, envs, "Ray worker", "a function make_envs(num_envs) -> VectorEnv")
        check_ray_picklable("envs", envs)
        check_ray_picklable("policy", policy)
        if compile_options:
            check_ray_picklable("compile_policy", compile_options)

    def build(self, envs: VectorEnv | EnvRecipe, policy: nn.Module, settings: PlacementSettings) -> Placement:
        from torch_rollout.placements._ray import RayPlacement

        assert not isinstance(envs, VectorEnv)  # refused by check()
        # The acting copy stays in the trainer; Ray's object store carries it to the actors.
        acting_policy = acting_copy(policy, torch.device("cpu"), why=settings.copy_why, fix=settings.copy_fix)
        return RayPlacement(envs, acting_policy, settings, num_workers=self.num_workers, options=self.options)


def resolve_backend(backend: Any, envs: Any, policy: nn.Module, device: torch.device) -> Backend:
    """The :class:`Backend` for the Collector's ``backend`` argument; ``"auto"`` decides here.

    ``"auto"`` takes one worker process for a CPU policy when ``envs`` is an env id
    or a function and both it and the policy can be sent to a worker process (they
    pickle, and what they use of ``__main__`` the worker can import), else the thread.
    """
    if isinstance(backend, Backend):
        chosen = backend
    elif backend == "auto":
        travels = device.type == "cpu" and not isinstance(envs, VectorEnv) and _can_travel(envs, policy)
        chosen = Processes() if travels else Thread()
    elif backend == "thread":
        chosen = Thread()
    elif backend == "process":
        chosen = Processes()
    elif backend == "ray":
        chosen = Ray()
    elif isinstance(backend, str):
        raise ValueError(
            f"Collector: backend must be one of {list(_NAMES)}, got {backend!r} (or Thread(), "
            "Processes(num_workers=...), Ray(num_workers=..., options=...))"
        )
    else:
        raise TypeError(
            f"Collector: backend must be a name {list(_NAMES)} or one of torch_rollout.Thread(), "
            f"Processes(num_workers=...), Ray(num_workers=..., options=...), got {type(backend).__name__} {backend!r}"
        )
    return chosen


def _check_workers(backend: Backend) -> None:
    n = backend.num_workers
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{type(backend).__name__}: num_workers must be an int >= 1, got {n!r}")


def _refuse_live_envs(backend: Backend, envs: Any, who: str, instead: str) -> None:
    if isinstance(envs, VectorEnv):
        raise TypeError(
            f"Collector(backend={backend.name!r}): envs is a live {type(envs).__name__}, but each {who} builds its "
            f"own envs; pass an env id with num_envs, or {instead}"
        )


def _can_travel(envs: Any, policy: nn.Module) -> bool:
    """Whether ``envs`` and ``policy`` can be sent to a worker process (``backend="auto"``).

    Not when they cannot be pickled, nor when worker processes could not import
    what they use of ``__main__``, or not start from it at all (see ``_script``).
    """
    if main_problem() is not None:
        return False
    for name, obj in (("envs", envs), ("policy", policy)):
        try:
            found = main_globals(obj)
        except Exception:
            return False
        if import_problem(name, found) is not None:
            return False
    return True
