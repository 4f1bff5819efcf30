"""What the placements in other processes share: the K workers' bookkeeping in the trainer, and the worker's set-up.

A remote placement (worker processes, Ray actors) asks each of its ``K``
workers for its share of every batch and gathers one message per worker
(:mod:`torch_rollout.placements._messages`): :class:`Ready` once its envs are built (they are
reset by its first batch), then a :class:`Batch` per request, or :class:`Failed`.
:class:`RemotePlacement` keeps what has arrived, the first failure, and the results for the consumer; a subclass only
says how to wait for its workers' messages and how to put their shares
together. On the worker's side, :class:`WorkerSetup` (made by :func:`worker_setup`), :func:`start_worker`,
:func:`worker_loop` and :func:`error_message` are the set-up, the loop and the error reply that every
worker uses.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (typeshed has no stub of it)
import collections
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from gymnasium import Space
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict

from torch_rollout.envs._gym import EnvRecipe, RemoteTraceback, build_envs, split_envs
from torch_rollout.loop._acting import Forward
from torch_rollout.loop._direct import Sink
from torch_rollout.loop._drivers import make_loop
from torch_rollout.loop._rollout import RolloutLoop
from torch_rollout.loop._spec import LoopPlace, LoopSpec
from torch_rollout.loop._stats import NO_TOTALS, Totals
from torch_rollout.placements._messages import Batch, EnvAnswer, EnvCall, Failed, Ready, Stop
from torch_rollout.placements._settings import PlacementSettings
from torch_rollout.util._notes import add_note

__all__ = [
    "RemotePlacement",
    "WorkerSetup",
    "error_message",
    "sigint_deferred",
    "start_worker",
    "worker_loop",
    "worker_rng_seed",
    "worker_setup",
]

_SIGINT = int(signal.SIGINT)


class RemotePlacement:
    """The trainer's side of ``num_workers`` workers that each collect a contiguous share of the envs.

    Subclasses implement :meth:`_poll` (wait a little for the messages of some
    workers and hand each to :meth:`_record`, or set :attr:`_failure` for a worker
    that died), :meth:`_unpack` (a message's payload), :meth:`_assemble` (the
    workers' shares as one ``[T, N]`` batch on ``device``) and :meth:`_who` (how
    errors name a worker). What arrives for the batch being gathered waits in
    ``_received`` until every worker's share is there, so a wait interrupted by
    Ctrl-C or a deadline loses nothing.
    """

    envs: VectorEnv | None = None  # the envs step in the workers
    autoreset_mode: AutoresetMode
    spaces: tuple[Space[Any], Space[Any]]  # one env's, from the workers' Ready

    def __init__(self, *, num_envs: int, num_workers: int, device: torch.device) -> None:
        self.device = device
        self.num_envs = num_envs
        self.num_workers = num_workers
        self.shares = split_envs(num_envs, num_workers)
        self.requested = 0
        # Results for the consumer: the next batches, or the error that ended collection.
        self.ready: collections.deque[tuple[TensorDict | int | None, BaseException | None]] = collections.deque()
        self.sink: Sink | None = None  # batches are made in the workers
        self._received: dict[int, Any] = {}  # worker -> its message of the batch being gathered
        self._failure: BaseException | None = None  # a worker's error or death
        self._assembled = 0  # batches gathered into ready
        self.closed = False
        # Each worker's Account.totals() as of its last batch (see torch_rollout.loop._stats).
        self._accounts: list[Totals] = [NO_TOTALS] * num_workers

    @property
    def extra_starts(self) -> int:
        """Parts of the seed stream past its own that workers building envs anew (Ray's restarts) took: none."""
        return 0

    # -- for subclasses ------------------------------------------------------------------------

    def _poll(self, kind: str, pending: list[int], timeout: float) -> None:
        """Waits up to ``timeout`` s for a message of ``kind`` from the ``pending`` workers; records what comes."""
        raise NotImplementedError

    def _unpack(self, k: int, message: Ready | Batch) -> Any:
        """What to keep of worker ``k``'s message (not an error) for :meth:`_assemble`."""
        return message.info if isinstance(message, Ready) else message.data

    def _assemble(self, parts: list[Any]) -> TensorDict:
        """The workers' shares, in worker order, as one ``[T, N]`` batch on ``device``."""
        raise NotImplementedError

    def _offer(self, parts: list[Any]) -> int | None:
        """The workers' shares offered to :attr:`sink` where it can take them in place: the rows it wrote,
        or None to assemble them (:meth:`_assemble`)."""
        return None

    def _taken(self) -> None:
        """Called once a batch was assembled from ``_received``, before the next one is gathered."""

    def _who(self, k: int) -> str:
        """Worker ``k`` as errors name it, e.g. ``"worker 0 (pid 123)"``."""
        raise NotImplementedError

    # -- the shared bookkeeping ----------------------------------------------------------------

    def _record(self, k: int, message: Ready | Batch | EnvAnswer | Failed) -> None:
        """Keeps worker ``k``'s message, or makes its error the failure."""
        if isinstance(message, Failed):
            self._failure = self._remote_error(k, message.error, message.traceback)
        elif isinstance(message, EnvAnswer):
            self._received[k] = message
        elif not isinstance(message, Stop):  # a worker stopped by close() has nothing to give
            self._received[k] = self._unpack(k, message)
            if isinstance(message, Batch) and message.account is not None:
                self._accounts[k] = message.account
            if isinstance(message, Batch) and message.autoreset_mode is not None:
                # an undeclared env's mode, once its steps showed it (every worker's envs are alike)
                self.autoreset_mode = AutoresetMode(message.autoreset_mode)

    def _remote_error(self, k: int, exc: BaseException, text: str) -> BaseException:
        """The worker's exception, its traceback text chained as the cause and a note naming the worker."""
        who = self._who(k)
        exc.__cause__ = RemoteTraceback(f'\n"""\nin {who}:\n{text}"""')
        add_note(exc, f"(raised in torch_rollout {who})")
        return exc

    def _gather(self, kind: str, deadline: float | None) -> bool:
        """One message of ``kind`` from every worker into ``_received``.

        Returns False when a worker failed (its error or death is ``_failure``)
        or ``deadline`` (monotonic) passes first.
        """
        while len(self._received) < self.num_workers and self._failure is None:
            if deadline is not None and time.monotonic() > deadline:
                return False
            timeout = 0.25 if deadline is None else max(0.0, min(0.25, deadline - time.monotonic()))
            self._poll(kind, [k for k in range(self.num_workers) if k not in self._received], timeout)
        return self._failure is None

    def start(self) -> None:
        pass  # the workers started in __init__: their envs had to exist before the Collector did

    def accounts(self) -> list[Totals]:
        """Each worker's account of its time, as of its last batch (see :class:`torch_rollout.loop._stats.Account`)."""
        return list(self._accounts)

    def _await_ready(self, timeout: float | None, waiting_for: str) -> AutoresetMode:
        """Gathers every worker's :class:`Ready` (its envs built); returns their autoreset mode.

        ``waiting_for`` ends the TimeoutError's message ``the workers did not ... within timeout=``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._gather("ready", deadline):
            raise self._failure or TimeoutError(f"Collector: {waiting_for} within timeout={timeout} s")
        modes = {self._received[k]["autoreset_mode"] for k in range(self.num_workers)}
        self.spaces = self._received[0]["spaces"]
        self._received = {}
        if len(modes) > 1:
            raise ValueError(f"Collector: the workers' vector envs run in different autoreset modes {sorted(modes)}")
        return AutoresetMode(modes.pop())

    def wait(self, deadline: float | None) -> bool:
        """Waits until ``ready`` holds the next ``[T, N]`` batch on ``device`` or the error of a worker.

        Returns False when ``deadline`` (monotonic) passes first. Ctrl-C lands
        only while waiting: what was received stays for the next call.
        """
        while not self.ready:
            if not self._next_batch(deadline):
                return False
        return True

    def _next_batch(self, deadline: float | None) -> bool:
        """Gathers the oldest batch not gathered yet into ``ready`` (or the failure); False past ``deadline``."""
        gathered = self._failure is None and self._gather("batch", deadline)
        with sigint_deferred():
            if self._failure is not None:
                self.ready.append((None, self._failure))
            elif not gathered:
                return False
            else:
                parts = [self._received[k] for k in range(self.num_workers)]
                written = None if self.sink is None or self.device.type != "cpu" else self._offer(parts)
                batch = self._assemble(parts) if written is None else written
                self._received = {}
                self._taken()
                self._assembled += 1
                self.ready.append((batch, None))
        return True

    def env_call(self, calls: list[EnvCall], deadline: float | None) -> list[EnvAnswer]:
        """Gathers every batch requested so far into ``ready``, then has each worker run its call; their answers.

        The workers serve the call between batches, since none is outstanding. A
        deadline that passes while waiting for the answers, or Ctrl-C then, leaves
        the pipes out of step: that becomes the failure that ``next()`` raises.
        """
        label = calls[0].label
        if self.closed:
            raise RuntimeError(f"{label}: the collector is closed; create a new Collector")
        while self._failure is None and self._assembled < self.requested:
            if not self._next_batch(deadline):
                raise TimeoutError(
                    f"{label}: the batches requested before it did not arrive within the collector's timeout"
                )
        if self._failure is not None:
            raise RuntimeError(f"{label}: the collection failed; next() raises why") from self._failure
        with sigint_deferred():
            for k, call in enumerate(calls):
                self._send_call(k, call)
        try:
            answered = self._gather("env call", deadline)
        except BaseException:
            self._failure = RuntimeError(f"{label} was interrupted waiting for the answers; create a new Collector")
            raise
        if not answered:
            if self._failure is None:
                self._failure = TimeoutError(
                    f"{label}: no answer within the collector's timeout; the env call is stuck; next() raises this "
                    "error and closes the collector"
                )
            raise self._failure
        answers = [self._received[k] for k in range(self.num_workers)]
        self._received = {}
        return answers

    def _send_call(self, k: int, call: EnvCall) -> None:
        """Sends ``call`` to worker ``k``, to run after the batches requested before it."""
        raise NotImplementedError


class sigint_deferred:  # noqa: N801  (a context manager used as a function: `with sigint_deferred():`)
    """Holds Ctrl-C (SIGINT) back until the block ends, then delivers it to the handler it was meant for.

    For the consumer's short critical sections, which talk to the workers one
    call at a time: there a KeyboardInterrupt would leave a pipe half-read, a
    worker's lock held or a received batch unrecorded. Signals run their
    handlers in the main thread only, so elsewhere there is nothing to defer.
    Several of these blocks run at every batch: they swap the handler through
    ``_signal``, the C functions beneath ``signal.signal``, whose conversions of
    every argument and result to enums cost more than the swap itself.
    """

    __slots__ = ("caught", "previous")

    def __enter__(self) -> None:
        self.caught, self.previous = False, None
        if threading.current_thread() is not threading.main_thread():
            return
        previous = _signal.getsignal(_SIGINT)
        if previous is None:  # a handler installed outside Python, which could not be put back
            return
        self.previous = previous
        _signal.signal(_SIGINT, self._catch)

    def _catch(self, signum: int, frame: Any) -> None:
        self.caught = True

    def __exit__(self, *exc_info: object) -> None:
        if self.previous is not None:
            _signal.signal(_SIGINT, self.previous)
            if self.caught:
                _signal.raise_signal(_SIGINT)


# -- the worker's side ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WorkerSetup:
    """What worker ``index`` of a remote placement starts with, besides the policy and what it shares with the trainer.

    The same for a worker process and a Ray actor: :func:`worker_setup` makes it in the trainer,
    :func:`start_worker` and :func:`worker_loop` use it in the worker.
    """

    index: int
    recipe: EnvRecipe  # sent to the worker, which builds its envs from it
    spec: LoopSpec
    num_envs: int  # of its share
    start_index: int  # the global index of its first env
    seed: int | None  # of its first env's first reset
    rng_seed: int  # of its sampling stream (worker_rng_seed)
    threads: int  # torch's intra-op threads: the cores it was given
    device: torch.device | None  # where it runs the policy; None: a Ray actor's GPU where Ray gave it one, else the CPU
    num_slots: int = 0  # batch slots in shared memory (worker processes: prefetch + 1)


def worker_setup(
    k: int,
    recipe: EnvRecipe,
    settings: PlacementSettings,
    shares: list[tuple[int, int]],
    *,
    threads: int,
    device: torch.device | None,
    num_slots: int = 0,
    restart: int = 0,
) -> WorkerSetup:
    """Worker ``k``'s set-up (its ``restart``-th actor's, for Ray): its share of the envs, their seed and its stream.

    A restarted worker's envs take the next part of the rank's seed stream, ``seed_step`` per restart.
    """
    start, count = shares[k]
    seed = settings.seed
    return WorkerSetup(
        index=k,
        recipe=recipe,
        spec=settings.spec,
        num_envs=count,
        start_index=start,
        seed=None if seed is None else seed + start + restart * settings.seed_step,
        rng_seed=worker_rng_seed(k, restart),
        threads=threads,
        device=device,
        num_slots=num_slots,
    )


def start_worker(setup: WorkerSetup) -> VectorEnv:
    """Sets the worker's torch threads and sampling stream, then builds its envs (not reset: its first batch does)."""
    torch.set_num_threads(setup.threads)  # K workers and the trainer share the cores; a team per worker would spin
    torch.manual_seed(setup.rng_seed)  # a sampling stream of its own (without it, every forked worker's is one)
    return build_envs(setup.recipe, setup.num_envs, start_index=setup.start_index)


def worker_loop(
    envs: VectorEnv, setup: WorkerSetup, forward: Forward, *, device: torch.device, stop: Callable[[], bool]
) -> RolloutLoop:
    """A worker's loop over its share of the envs, batches on the CPU.

    The envs are not reset here: the first batch resets them, after any reseed (a resumed collector's).
    """
    place = LoopPlace(
        device=device, storage_device=torch.device("cpu"), seed=setup.seed, env_offset=setup.start_index, stop=stop
    )
    return make_loop(envs, forward, setup.spec, place)  # the driver of the envs' kind


def worker_rng_seed(k: int, restart: int = 0) -> int:
    """The seed of worker ``k``'s torch generator (its action sampling), in its ``restart``-th actor.

    Distinct per worker and restart, and fixed by the trainer's ``torch.manual_seed``: without it every
    worker process, forked from one server, would sample from the same stream. A splitmix64 mix of the
    trainer's ``torch.initial_seed()``, the worker's index and the restart.
    """
    z = (torch.initial_seed() + 0x9E3779B97F4A7C15 * (k + 1) + 0xD1B54A32D192ED03 * restart) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) % 2**63


def error_message(exc: BaseException, dumps: Callable[[Any], Any]) -> Failed:
    """A worker's error reply: :class:`Failed`, ``exc`` replaced where ``dumps`` cannot send it.

    An exception that cannot be pickled still sends its type name and message, as a RuntimeError.
    """
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        dumps(exc)
    except Exception:
        exc = RuntimeError(f"{type(exc).__qualname__}: {exc}")
    return Failed(exc, text)
