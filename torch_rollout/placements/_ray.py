"""The Ray placement: the collection loop in Ray actors, batches and weights through Ray's object store.

Each of ``K`` actors builds its share of the envs from a picklable recipe and
runs the same :class:`~torch_rollout.loop._rollout.RolloutLoop` as the thread and the
worker processes, on whichever node Ray places it. A request for the next batch
is one actor call per worker; the result, the worker's ``[T, n]`` rows as NumPy
arrays, travels through Ray's object store (read without a copy on the
trainer's node) and the consumer concatenates the shares in global env order.
The acting copy of the policy stays in the trainer: its tensors are views of one
flat byte buffer, which each refresh publishes with one ``ray.put``; the
reference rides with the next request of every worker that has not seen that
version, and the worker loads it before the batch starts, never inside one.
Ray itself is imported only here, and only when this placement is used.
"""

from __future__ import annotations

import collections
import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

import numpy as np
import torch
from gymnasium.vector import VectorEnv
from tensordict import TensorDict
from torch import Tensor, nn

from torch_rollout.envs._gym import EnvRecipe, explain_env_error
from torch_rollout.loop._acting import PolicyCall
from torch_rollout.loop._compile import acting_call
from torch_rollout.loop._direct import blocks_batch
from torch_rollout.loop._rollout import Stopped
from torch_rollout.loop._weights import named_weights
from torch_rollout.placements._env_calls import run_env_call
from torch_rollout.placements._messages import STOP, Batch, EnvAnswer, EnvCall, Failed, Ready, Stop
from torch_rollout.placements._remote import (
    RemotePlacement,
    WorkerSetup,
    error_message,
    sigint_deferred,
    start_worker,
    worker_loop,
    worker_setup,
)
from torch_rollout.placements._settings import PlacementSettings

__all__ = ["RayPlacement", "check_ray_picklable", "import_ray"]

logger = logging.getLogger("torch_rollout")

# How long close() lets the actors close their envs before they are killed.
_EXIT_WAIT = 5.0
# Byte alignment of each tensor in the flat weights buffer (any dtype can be viewed at such an offset).
_ALIGN = 64


def import_ray() -> Any:
    """Imports Ray, or says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "Collector(backend='ray') needs Ray, which is not installed: pip install 'torch_rollout[ray]'"
        ) from exc
    return ray


def check_ray_picklable(name: str, obj: Any) -> None:
    """Raises TypeError naming ``name`` if Ray (cloudpickle) cannot send ``obj`` to its workers."""
    ray = import_ray()
    try:
        ray.cloudpickle.dumps(obj)
    except Exception as exc:
        raise TypeError(
            f"Collector(backend='ray'): {name}={obj!r} cannot be pickled for Ray's workers ({exc}); make it "
            "picklable (cloudpickle) or use backend='thread'"
        ) from exc


def flatten_weights_(module: nn.Module, device: torch.device) -> Tensor:
    """Moves ``module``'s parameters and buffers into one flat byte buffer on ``device`` and returns it.

    Afterwards every parameter and buffer is a view of the buffer (the same
    ``nn.Parameter`` objects, in the order of ``parameters()`` then
    ``buffers()``), so copying the buffer copies all weights in one call.
    """
    tensors = [*module.parameters(), *module.buffers()]
    offsets, size = [], 0
    for tensor in tensors:
        offsets.append(size)
        size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    flat = torch.zeros(size, dtype=torch.uint8, device=device)
    for tensor, offset in zip(tensors, offsets):
        view = flat[offset : offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.detach())
        tensor.data = view
    return flat


class RayPlacement(RemotePlacement):
    """Runs the collection loop in ``num_workers`` Ray actors; envs in global order in every batch.

    Args:
        recipe: env id or ``make_envs(num_envs[, start_index])``, sent to each actor (cloudpickle).
        acting_policy: the acting copy of the policy on the CPU; it stays in the trainer (its tensors
            become views of one flat buffer, published at each refresh).
        settings: the placement's settings: its loops' spec is sent to each actor; batches are
            delivered on its ``device`` (actors run the policy on the CPU, or on their CUDA device when
            ``options`` gives them GPUs); a worker collects up to ``prefetch`` batches ahead (requests
            queued at its actor); env ``j`` is seeded ``seed + j``, and a restarted worker's envs take the
            next part of the seed stream, ``seed_step`` on; ``timeout`` bounds the wait for the actors to be
            placed and to build their envs.
        num_workers: actors (``K``).
        options: Ray actor options for every worker (``num_cpus``, ``num_gpus``, ``resources``,
            ``runtime_env``, ``scheduling_strategy``, ...), and ``max_restarts``: how many times
            torch_rollout recreates a worker whose actor died (default 0: the death is an error).

    Ray is used as the trainer found it: an initialised Ray (the
    user's ``ray.init(address=...)``) is used and left running; otherwise a
    local Ray is started, and it too is left running when the collector closes
    (later collectors reuse it; Ray shuts it down at interpreter exit, or
    ``ray.shutdown()`` does now). A restarted worker gets new envs seeded
    ``seed + j + r * seed_step`` (its ``r``-th restart): the part of the rank's
    seed stream that the ``r``-th resume would take, which :attr:`extra_starts`
    reports so that the collector's state counts it and a resume goes past it;
    it does not replay the episodes it delivered, nor another rank's. What its
    old actor had not delivered is collected again from those fresh envs.
    """

    def __init__(
        self,
        recipe: EnvRecipe,
        acting_policy: nn.Module,
        settings: PlacementSettings,
        *,
        num_workers: int,
        options: Mapping[str, Any] | None,
    ) -> None:
        super().__init__(num_envs=settings.num_envs, num_workers=num_workers, device=settings.device)
        ray = self.ray = import_ray()
        startup_timeout = settings.timeout
        self.settings, self._recipe = settings, recipe
        options = dict(options or {})
        self._threads = max(1, int(options.get("num_cpus", 1)))
        self.max_restarts = options.pop("max_restarts", 0)  # checked by torch_rollout.Ray
        self.restarts = [0] * num_workers
        self._pending: collections.deque[list[Any]] = collections.deque()  # per requested batch: K result refs
        self._call_refs: list[Any] = [None] * num_workers  # of the env call's answers, once sent
        self.actors: list[Any] = [None] * num_workers
        self.where: list[dict[str, Any]] = [{} for _ in range(num_workers)]  # node, pid, actor of each worker
        # Weights: version 0 travels inside the set-up payload; later ones as one object per refresh.
        self._version = 0
        self._flat = flatten_weights_(acting_policy, torch.device("cpu"))
        self.weights = dict(named_weights(acting_policy))  # views of the flat buffer
        self._weights: Any = None
        self._sent = [0] * num_workers  # the version each worker holds once its queued requests ran
        self.startup_timeout = startup_timeout
        self.started_ray = _connect(ray)
        try:
            self._actor_class = ray.remote(_RayWorker).options(**options)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"Collector: Ray(options={dict(options)!r}) are not valid Ray actor options: {exc}"
            ) from exc
        try:
            self._payload = ray.put(acting_policy)  # once for all actors, however many restarts
            self._ready_refs = [self._start(k) for k in range(num_workers)]
            self.autoreset_mode = self._await_ready(
                startup_timeout,
                "the Ray workers were not placed (Ray waits until a node offers the resources of Ray(options=...)) "
                "or did not build their envs",
            )
        except BaseException:
            self.close(0.0)
            raise

    def _start(self, k: int) -> Any:
        """Creates worker ``k``'s actor and asks it to build its envs (not reset them); returns its answer's ref."""
        setup = worker_setup(
            k,
            self._recipe,
            self.settings,
            self.shares,
            threads=self._threads,  # one per CPU Ray gives the actor (1 by default): K actors share a node's cores
            device=None,  # the actor's GPU where Ray gives it one
            restart=self.restarts[k],
        )
        self.actors[k] = actor = self._actor_class.remote()
        self._sent[k] = 0
        return actor.setup.remote(setup, self._payload)

    @property
    def extra_starts(self) -> int:
        """Parts of the seed stream past this placement's own that restarted workers took (their shares' envs)."""
        return max(self.restarts)

    # -- weights -------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def refresh(self, dst: list[Tensor], src: list[Tensor]) -> None:
        """Copies ``src`` into the acting copy's ``dst`` and publishes it as a new version with one ``ray.put``."""
        if self.closed:
            return
        # All or nothing under Ctrl-C: the copy, the object and the version are one step for the consumer.
        with sigint_deferred():
            if dst:
                torch._foreach_copy_(dst, src)
            self._weights = self.ray.put(self._flat.numpy())
            self._version += 1

    def set_version(self, version: int) -> None:
        """Counts versions on from ``version`` (a resumed collector's), before the first batch.

        The actors hold the weights of the set-up payload, which are those of this version.
        """
        self._version = version
        self._sent = [version] * self.num_workers

    # -- batches -------------------------------------------------------------------------------

    def reseed(self, seed: int | None) -> None:
        """Has each worker reset its envs from ``seed`` (its share from ``seed + start``) before its next batch.

        Before the first request: an actor runs its calls in order, so the reseed comes first.
        Restarted workers count their restarts on from this seed.
        """
        self.settings = replace(self.settings, seed=seed)  # what restarted workers' set-ups take
        for k, (start, _) in enumerate(self.shares):
            self.actors[k].reseed.remote(None if seed is None else seed + start)

    def request(self) -> None:
        # Ctrl-C waits: a request that reached only some workers would let those run a batch ahead.
        with sigint_deferred():
            self.requested += 1
            if self._failure is None and not self.closed:
                self._pending.append([self._submit(k) for k in range(self.num_workers)])

    def _submit(self, k: int) -> Any:
        weights = None
        if self._sent[k] != self._version:
            weights, self._sent[k] = self._weights, self._version
        return self.actors[k].collect.remote(self._version, weights)

    def _send_call(self, k: int, call: EnvCall) -> None:
        self._call_refs[k] = self.actors[k].env_call.remote(call)  # an actor runs its calls in order

    def _poll(self, kind: str, pending: list[int], timeout: float) -> None:
        # The refs of the batch being gathered (a restart replaces a dead worker's), or of the answers awaited.
        refs = {"ready": self._ready_refs, "env call": self._call_refs}.get(kind) or self._pending[0]
        waiting = {refs[k]: k for k in pending}
        done, _ = self.ray.wait(list(waiting), num_returns=len(waiting), timeout=timeout, fetch_local=True)
        with sigint_deferred():  # an answer taken must be recorded
            for ref in done:
                if self._failure is None and waiting[ref] not in self._received:
                    self._take(waiting[ref], ref, kind)

    def _taken(self) -> None:
        self._pending.popleft()

    def _take(self, k: int, ref: Any, kind: str) -> None:
        """Records worker ``k``'s answer, or its error, or handles its death (a restart or ``_failure``)."""
        exceptions = self.ray.exceptions
        try:
            message = self.ray.get(ref)
        except exceptions.RayTaskError as exc:  # before our code ran: e.g. the recipe did not unpickle there
            cause = getattr(exc, "cause", None)
            self._failure = self._remote_error(k, cause if isinstance(cause, BaseException) else exc, str(exc))
            return
        except exceptions.RayError as exc:  # the actor died, its node was lost, or it is unreachable
            if kind == "batch" and self.restarts[k] < self.max_restarts:
                self._restart(k, exc)
            else:
                self._failure = self._death(k, kind, exc)
            return
        if isinstance(message, Ready):
            self.where[k] = message.info
        self._record(k, message)

    def _offer(self, parts: list[dict[Any, Any]]) -> int | None:
        """The sink copies each actor's arrays straight from the object store into its storage: no batch is made."""
        assert self.sink is not None  # offered only to a sink
        return self.sink(blocks_batch([{k: v for k, v in part.items() if type(v) is np.ndarray} for part in parts]))

    def _assemble(self, parts: list[dict[Any, Any]]) -> TensorDict:
        # One copy out of the object store: the concatenation (also for one worker, whose arrays are read-only).
        T = len(parts[0]["reward"])
        batch = TensorDict({}, batch_size=[T, self.num_envs], device=torch.device("cpu"))
        for key, first in parts[0].items():
            pieces = [part[key] for part in parts]
            if isinstance(first, np.ndarray):
                batch.set(key, torch.from_numpy(np.concatenate(pieces, axis=1)))
            else:  # a dtype NumPy lacks (bfloat16): pickled as a tensor
                batch.set(key, torch.cat(pieces, dim=1))
        return batch.to(self.device) if self.device.type != "cpu" else batch

    # -- faults --------------------------------------------------------------------------------

    def _describe(self, k: int) -> str:
        where = self.where[k]
        start, count = self.shares[k]
        if not where:
            return f"envs {start}..{start + count - 1}, not placed yet"
        return (
            f"actor {where['actor'][:12]}, pid {where['pid']}, node {where['node']}, envs {start}..{start + count - 1}"
        )

    def _who(self, k: int) -> str:
        return f"Ray worker {k} ({self._describe(k)})"

    def _death(self, k: int, kind: str, exc: BaseException) -> RuntimeError:
        lines = str(exc).strip().splitlines()
        cause = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        restarts = f" after {self.restarts[k]} restart{'s' * (self.restarts[k] != 1)}" if self.restarts[k] else ""
        when = {"ready": "before its envs were built", "env call": "during an env call"}.get(kind, "while collecting")
        error = RuntimeError(
            f"Collector: Ray worker {k} ({self._describe(k)}) died {when}{restarts} ({cause}); the collector is "
            "closed and its other workers are stopped"
            + (
                ""
                if self.max_restarts
                else "; Ray(num_workers, options={'max_restarts': n}) recreates a dead worker instead"
            )
        )
        error.__cause__ = exc
        return error

    def _restart(self, k: int, exc: BaseException) -> None:
        """Replaces dead worker ``k`` by a new actor with new envs and asks it again for its undelivered parts."""
        self.restarts[k] += 1
        logger.warning(
            "Collector: Ray worker %d (%s) died (%s); recreating it, restart %d of max_restarts=%d",
            k,
            self._describe(k),
            type(exc).__name__,
            self.restarts[k],
            self.max_restarts,
        )
        try:
            self.ray.kill(self.actors[k])
        except Exception:
            pass
        ready = self._start(k)
        try:
            message = self.ray.get(ready, timeout=self.startup_timeout)
        except self.ray.exceptions.RayError as error:  # GetTimeoutError too
            self._failure = self._death(k, "ready", error)
            return
        if isinstance(message, Failed):
            self._failure = self._remote_error(k, message.error, message.traceback)
            return
        self.where[k] = message.info
        # Its answers not received yet are lost with the old actor (those it finished too: the envs they
        # continued are gone). Ask again, in order, from the new envs.
        for refs in self._pending:
            if refs is not self._pending[0] or k not in self._received:
                refs[k] = self._submit(k)

    # -- shutdown ------------------------------------------------------------------------------

    def close(self, join_timeout: float) -> None:
        """Stops every actor: cancels its queued batches, lets it close its envs (at most 5 s), then kills it."""
        if self.closed:
            return
        self.closed = True
        ray = self.ray
        actors = [actor for actor in self.actors if actor is not None]
        if ray.is_initialized():  # else Ray shut down first (interpreter exit), and the actors with it
            for refs in self._pending:
                for ref in refs:
                    _quietly(ray.cancel, ref)  # queued: dropped; running: stops at its next step
            closing = [ref for actor in actors if (ref := _quietly(actor.close.remote)) is not None]
            wait = min(join_timeout, _EXIT_WAIT)
            if closing and wait > 0:
                _quietly(ray.wait, closing, num_returns=len(closing), timeout=wait)
            for actor in actors:
                _quietly(ray.kill, actor)
        self.actors = [None] * self.num_workers
        self._pending.clear()
        self._received = {}
        self._weights = self._payload = None


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, or None if it raised: for shutting down what may be gone already."""
    try:
        return fn(*args, **kwargs)
    except Exception:
        return None


def _connect(ray: Any) -> bool:
    """Uses the Ray this process is connected to, or starts a local one (or joins ``RAY_ADDRESS``); True if started."""
    if ray.is_initialized():
        return False
    ray.init(include_dashboard=False)
    logger.info(
        "Collector(backend='ray'): started a local Ray (none was initialised); it stays up after the collector "
        "closes, for later collectors, until interpreter exit or ray.shutdown()"
    )
    return True


# -- the actor ------------------------------------------------------------------------------------


class _RayWorker:
    """One Ray actor: a share of the envs, the collection loop, and a copy of the policy.

    Every method answers with a message of :mod:`torch_rollout.placements._messages` instead of
    raising: :class:`Ready`, :class:`Batch` (its arrays), :class:`Failed`, or :data:`STOP`
    once the collection was stopped.
    """

    def __init__(self) -> None:
        self.envs: VectorEnv | None = None
        self.out: TensorDict | None = None

    def setup(self, setup: WorkerSetup, policy: nn.Module) -> Ready | Failed:
        import ray

        context = ray.get_runtime_context()
        self.is_canceled = getattr(context, "is_canceled", lambda: False)
        self.start_index = setup.start_index
        info = {
            "actor": context.get_actor_id(),
            "node": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "pid": os.getpid(),
        }
        try:
            device = torch.device("cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu")
            self.acting_policy = policy.to(device)
            self.flat = flatten_weights_(self.acting_policy, device)
            self.version = 0
            spec = setup.spec
            # With compile_options, this actor compiles its own calls of the acting_policy (at the first one).
            self.act = acting_call(
                self.acting_policy, spec.compile_options, num_envs=setup.num_envs, obs_key=spec.obs_key, owned=True
            )
            with torch.no_grad():
                self.envs = start_worker(setup)
                self.loop = worker_loop(self.envs, setup, self.forward, device=device, stop=self.is_canceled)
        except BaseException as exc:
            return self._error(exc)
        spaces = (self.envs.single_observation_space, self.envs.single_action_space)
        return Ready({**info, "autoreset_mode": self.loop.autoreset_mode.value, "spaces": spaces})

    def forward(self, call: PolicyCall) -> tuple[Any, int]:
        return self.act(call), self.version

    def reseed(self, seed: int | None) -> None:
        self.loop.reseed(seed)

    def collect(self, version: int, weights: np.ndarray | None) -> Batch | Stop | Failed:
        try:
            if weights is not None:
                self._load(weights)
            self.version = version
            with torch.no_grad():
                self.out = cast(TensorDict, self.loop.collect(self.out))  # serialized by Ray: the next may reuse it
            arrays = {key: _numpy(value) for key, value in self.out.items(include_nested=True, leaves_only=True)}
        except Stopped:
            return STOP
        except BaseException as exc:
            return self._error(exc)
        return Batch(arrays, account=self.loop.account.totals(), autoreset_mode=self.loop.autoreset_mode.value)

    def env_call(self, call: EnvCall) -> EnvAnswer:
        import ray

        assert self.envs is not None  # built by setup, which ran first
        return run_env_call(self.envs, call, ray.cloudpickle.dumps)

    def _load(self, weights: np.ndarray) -> None:
        if self.flat.device.type == "cpu":
            self.flat.numpy()[...] = weights
        else:
            with warnings.catch_warnings():  # the object store's array is read-only; it is only read here
                warnings.simplefilter("ignore", UserWarning)
                self.flat.copy_(torch.from_numpy(weights))

    def _error(self, exc: BaseException) -> Failed:
        import ray

        if self.envs is not None:
            exc = explain_env_error(self.envs, exc, env_offset=self.start_index)
        return error_message(exc, ray.cloudpickle.dumps)

    def close(self) -> None:
        if self.envs is not None:
            envs, self.envs = self.envs, None
            _quietly(envs.close)


def _numpy(tensor: Tensor) -> np.ndarray | Tensor:
    """The tensor's NumPy view, for Ray to send out of band; a tensor of a dtype NumPy lacks stays a tensor."""
    try:
        return tensor.numpy()
    except TypeError:
        return tensor
