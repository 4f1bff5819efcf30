"""The thread backend: the collection loop in the trainer's process, on a daemon thread or in the caller's thread.

:class:`ThreadPlacement` runs the loop on a daemon thread of its own, which
collects ahead of the consumer (``prefetch >= 1``) or watches the time a batch
takes (``timeout``). :class:`InlinePlacement` runs it in the thread that calls
``next()`` (``prefetch=0`` without a ``timeout``): no hand-off between threads,
and the caller's own torch settings (intra-op threads, CUDA device and stream)
apply to the policy's forward.
"""

from __future__ import annotations

# signal.signal without its enum conversions, which cost more than the call: twice a batch
import _signal  # type: ignore[import-not-found]  # typeshed has no stub for signal's C module
import collections
import contextlib
import queue
import signal
import sys
import threading
import time
import traceback
from functools import partial
from typing import Any

import torch
from gymnasium import Space
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict
from torch import Tensor, nn

from torch_rollout.envs._gym import explain_env_error
from torch_rollout.loop._acting import PolicyCall, TrainingModes
from torch_rollout.loop._compile import acting_call
from torch_rollout.loop._direct import Sink
from torch_rollout.loop._drivers import make_loop
from torch_rollout.loop._interaction import own_interaction_type
from torch_rollout.loop._rollout import RolloutLoop, Stopped
from torch_rollout.loop._spec import LoopPlace, LoopSpec
from torch_rollout.loop._stats import Totals
from torch_rollout.loop._weights import named_weights
from torch_rollout.placements._env_calls import run_env_call
from torch_rollout.placements._messages import EnvAnswer, EnvCall
from torch_rollout.util._devices import indexed, is_device
from torch_rollout.util._grad import NoGrad

__all__ = ["InlinePlacement", "ThreadPlacement"]


class _LocalPlacement:
    """What both placements of the thread backend share: the loop, the acting call and the weights' lock.

    The placement holds no reference to the ``Collector`` so that dropping the
    collector lets it be garbage collected (and closed). ``lock`` guards the
    policy's weights: every forward pass and every weight refresh holds it, so
    no forward sees two weight versions.
    """

    lock: threading.Lock
    version: int
    requested: int
    ready: collections.deque[tuple[TensorDict | int | None, BaseException | None]]
    sink: Sink | None = None  # taken up by InlinePlacement only
    extra_starts: int = 0  # its envs are reset from the Collector's seeds only

    def __init__(
        self,
        envs: VectorEnv,
        acting_policy: nn.Module,
        spec: LoopSpec,
        *,
        owns_envs: bool,
        owned: bool,
        device: torch.device,
        seed: int | None,
    ):
        self.envs = envs
        self.acting_policy = acting_policy
        self.owns_envs = owns_envs
        # The CUDA device the loop makes current (a new thread starts on cuda:0): the policy's, else
        # the env's ("cuda": the consumer's current device).
        self.cuda_device = _cuda_device(device, getattr(envs, "device", None))
        # The acting copy's tensors (owned: the collector's copy, not the trainer's module; see call_policy).
        self.weights = dict(named_weights(acting_policy)) if owned else None
        self.lock = threading.Lock()
        self.version = 0
        self.requested = 0
        self.stop = threading.Event()
        # An EnvPool in async mode gets the loop that acts on whichever envs are ready.
        place = LoopPlace(device=device, storage_device=device, seed=seed, stop=self.stop.is_set)
        self.loop: RolloutLoop = make_loop(envs, self.forward, spec, place)
        # With compile_options, torch.compile'd calls (compiled at the loop's first call).
        self.modes = None if owned else TrainingModes(acting_policy)  # the trainer's module: its modes put back
        self.act = acting_call(
            acting_policy,
            spec.compile_options,
            num_envs=envs.num_envs,
            obs_key=spec.obs_key,
            owned=owned,
            modes=self.modes,
        )
        self.num_envs = envs.num_envs
        self.ready = collections.deque()

    @property
    def autoreset_mode(self) -> AutoresetMode:
        """The envs' autoreset mode as the loop reads it now (an undeclared env's, once its steps showed it)."""
        return self.loop.autoreset_mode

    @property
    def spaces(self) -> tuple[Space[Any], Space[Any]]:
        return self.envs.single_observation_space, self.envs.single_action_space

    # -- weights -------------------------------------------------------------------------------

    def forward(self, call: PolicyCall) -> tuple[Any, int]:
        with self.lock:
            return self.act(call), self.version

    def refresh(self, dst: list[Tensor], src: list[Tensor]) -> None:
        """Copies ``src`` into the acting copy's ``dst`` and counts a new version, no forward pass running."""
        with self.lock:
            # All or nothing under Ctrl-C: a signal handler runs only between calls, and none comes between
            # the new version and the one C call that copies every tensor.
            self.version += 1
            if dst:
                torch._foreach_copy_(dst, src)

    def set_version(self, version: int) -> None:
        """Counts versions on from ``version`` (a resumed collector's), before the first batch."""
        with self.lock:
            self.version = version

    # -- batches -------------------------------------------------------------------------------

    def accounts(self) -> list[Totals]:
        """The loop's account of its time, idle counted up to now (see :class:`torch_rollout.loop._stats.Account`)."""
        return [self.loop.account.totals(time.perf_counter())]

    def reseed(self, seed: int | None) -> None:
        # Before the first request: the loop has not touched the envs yet; its first batch resets them.
        self.loop.reseed(seed)

    def _release(self) -> None:
        """Closes the envs it owns and frees the loop, once it has stopped for good."""
        if self.owns_envs:
            self.envs.close()
        # Nothing may keep the envs in a reference cycle (see RolloutLoop.release): freed now, not by gc.
        self.loop.release()


class ThreadPlacement(_LocalPlacement):
    """Runs a :class:`RolloutLoop` on a daemon thread; right for GPU policies and envs that step outside the GIL.

    The consumer talks to it through ``request()`` (one token per batch),
    ``wait()``, ``ready`` and ``stop``. The queues are C-level
    ``SimpleQueue``: a KeyboardInterrupt landing in the consumer's ``put``
    cannot leave a lock held, as it can inside ``threading.Semaphore.release``
    (and then ``close()`` would deadlock). Results wait in the deque ``ready``
    until the consumer has taken them, which it does without a call (where a
    KeyboardInterrupt could land and lose one); ``_wakeup`` only wakes it.
    ``close()`` hands the closing of owned envs to the thread when the
    consumer cannot wait for it to stop.
    """

    thread: threading.Thread

    def __init__(self, envs: VectorEnv, acting_policy: nn.Module, spec: LoopSpec, **options: Any):
        super().__init__(envs, acting_policy, spec, **options)
        # On CUDA the loop runs on a stream of its own: its kernels neither wait behind the trainer's nor run
        # into them; each batch is handed over with an event (see _hand_over).
        self.stream = None if self.cuda_device is None else torch.cuda.Stream(self.cuda_device)
        self._credits: queue.SimpleQueue = queue.SimpleQueue()  # per request: the consumer's CUDA stream, or None
        self._wakeup: queue.SimpleQueue = queue.SimpleQueue()  # one token per result
        self.thread = threading.Thread(target=self._run, name="torch_rollout-collector", daemon=True)
        # Whoever of the thread (on exit) and the consumer (in abandon) comes last closes owned envs.
        self._exit_lock = threading.Lock()
        self._exited = False
        self._abandoned = False

    def start(self) -> None:
        self.thread.start()

    def refresh(self, dst: list[Tensor], src: list[Tensor]) -> None:
        if self.stream is None or not dst:
            return super().refresh(dst, src)
        # The copy runs on the trainer's stream: after the forwards queued on the loop's stream, which read the
        # weights of their version, and before the next one.
        current = torch.cuda.current_stream(self.cuda_device)
        current.wait_stream(self.stream)
        try:
            super().refresh(dst, src)
        finally:
            self.stream.wait_stream(current)

    def request(self) -> None:
        consumer = None if self.stream is None else torch.cuda.current_stream(self.cuda_device)
        # No call between the count and the request: a KeyboardInterrupt cannot separate them.
        self.requested += 1
        self._credits.put(consumer)

    def env_call(self, calls: list[EnvCall], deadline: float | None) -> list[EnvAnswer]:
        """Has the loop's thread run the call between its batches: after those requested so far, in their order."""
        job = _EnvJob(calls[0])
        if self.stop.is_set():
            raise RuntimeError(f"{job.call.label}: the collector is closed; create a new Collector")
        self._credits.put(job)
        try:
            while not job.done.wait(0.25):
                if not self.thread.is_alive():
                    raise RuntimeError(
                        f"{job.call.label}: the collector's thread stopped before it ran the call (the collection "
                        "failed or the collector was closed; next() raises why)"
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{job.call.label}: no answer within the collector's timeout: the env call or a batch "
                        "collected before it is stuck"
                    )
        except BaseException:
            job.cancel()  # not run later, unless it runs already
            raise
        assert job.answer is not None  # set before done
        return [job.answer]

    def wait(self, deadline: float | None) -> bool:
        """Waits until ``ready`` holds a result; False when ``deadline`` (monotonic) passes first."""
        while not self.ready:
            try:
                # A short poll so that a thread that died without a word is noticed.
                self._wakeup.get(timeout=0.25)
                continue
            except queue.Empty:
                pass
            if not self.thread.is_alive() and not self.ready:
                error = RuntimeError("Collector: the background thread exited without producing a batch")
                self.ready.append((None, error))
            elif deadline is not None and time.monotonic() > deadline:
                return False
        return True

    def _deliver(self, batch: TensorDict | None, error: BaseException | None) -> None:
        self.ready.append((batch, error))
        self._wakeup.put(None)

    def _run(self) -> None:
        _one_intra_op_thread()
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)  # as torch's pin-memory thread does
        try:
            # Sample as the policy's own default says, whatever interaction type the trainer's thread sets.
            stream = contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)
            with torch.no_grad(), own_interaction_type(), stream:
                while True:  # the first batch resets the envs (with a resumed collector's seeds, if reseeded)
                    consumer = self._credits.get()
                    if self.stop.is_set():
                        return
                    if isinstance(consumer, _EnvJob):  # an env call, between two batches
                        consumer.run(self.envs)
                        continue
                    batch = self.loop.collect()
                    if consumer is not None:
                        assert self.stream is not None  # a consumer's stream is taken only with a stream of the loop's
                        _hand_over(batch, self.stream, consumer)
                    self._deliver(batch, None)
        except Stopped:
            pass
        except BaseException as exc:  # every failure reaches the consumer, KeyboardInterrupt included
            if not self.stop.is_set():  # else nobody reads it, and the envs are their owner's again
                exc = explain_env_error(self.envs, exc)
            self._deliver(None, exc)
        finally:
            with self._exit_lock:
                self._exited = True
                close_envs = self._abandoned and self.owns_envs
            if close_envs:
                self.envs.close()

    # -- shutdown ------------------------------------------------------------------------------

    def close(self, join_timeout: float) -> str | None:
        """Stops the thread and closes the envs it owns; where it is stuck if it did not stop within ``join_timeout``.

        A thread that did not stop is left as a daemon; still stuck in an env or
        policy call, it closes the envs it owns itself once that call returns.
        Returns None when it stopped, or when it was not waited for (``join_timeout``
        0, or called on the thread itself, as garbage collection can).
        """
        self.stop.set()
        self._credits.put(None)  # wakes a thread waiting for the next request
        on_own_thread = threading.current_thread() is self.thread
        if not on_own_thread:
            self.thread.join(join_timeout)
        with self._exit_lock:
            self._abandoned = not self._exited
            stopped = self._exited
        if stopped:
            self._release()
        if stopped or on_own_thread or join_timeout <= 0:
            return None
        return self._stuck_in()

    def _stuck_in(self) -> str:
        """The call the loop is inside and the thread's innermost frames: where a thread that did not stop is."""
        ident = self.thread.ident  # None: never started
        frame = None if ident is None else sys._current_frames().get(ident)
        frames = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else ""
        return f"{self.loop.call}, at:\n{frames}"


class InlinePlacement(_LocalPlacement):
    """Runs a :class:`RolloutLoop` in the thread that waits for its batch: ``prefetch=0`` without a ``timeout``.

    ``wait()`` collects the batch that ``request()`` counted, under ``torch.no_grad()``
    and the policy's own interaction type, with the policy's CUDA device
    current; the caller's intra-op threads and CUDA stream apply. Nothing is
    handed between threads. Ctrl-C in the main thread during a batch: the
    first is held until the batch is in ``ready`` and then raised, so that
    ``next()`` raises KeyboardInterrupt and the next call returns that batch,
    whole; a second during the same batch interrupts at once (an env that
    hangs) and leaves the collector unable to go on, its envs mid-batch.
    """

    def __init__(self, envs: VectorEnv, acting_policy: nn.Module, spec: LoopSpec, **options: Any):
        super().__init__(envs, acting_policy, spec, **options)
        self._on_device = (
            contextlib.nullcontext if self.cuda_device is None else partial(torch.cuda.device, self.cuda_device)
        )
        # A close() from another thread while this one collects leaves the envs to the collecting thread.
        self._exit_lock = threading.Lock()
        self._busy = False
        self._abandoned = False

    def start(self) -> None:
        pass  # nothing runs before the first request

    def request(self) -> None:
        self.requested += 1

    def env_call(self, calls: list[EnvCall], deadline: float | None) -> list[EnvAnswer]:
        """Runs the call in the calling thread; refused while another thread collects a batch inside ``next()``."""
        label = calls[0].label
        with self._exit_lock:
            if self.stop.is_set():
                raise RuntimeError(f"{label}: the collector is closed; create a new Collector")
            if self._busy:
                raise RuntimeError(
                    f"{label}: another thread is collecting a batch inside next() (prefetch=0 collects in the "
                    "calling thread); make env calls between batches, from the thread that iterates"
                )
            self._busy = True
        try:
            return [run_env_call(self.envs, calls[0])]
        finally:
            self._let_go()

    def wait(self, deadline: float | None) -> bool:
        """Collects the batch requested, unless ``ready`` holds a result already; the deadline is not used."""
        if not self.ready:
            self._collect()
        return True

    def _collect(self) -> None:
        with self._exit_lock:
            if self.stop.is_set():  # closed from another thread meanwhile
                self.ready.append((None, RuntimeError(_CLOSED)))
                return
            self._busy = True
        try:
            with _HeldInterrupt(), NoGrad(), own_interaction_type(), self._on_device(), self._evaluating():
                try:
                    batch = self.loop.collect(sink=self.sink)
                except KeyboardInterrupt:
                    self.ready.append((None, RuntimeError(_TORN)))
                    raise
                except Stopped:
                    self.ready.append((None, RuntimeError(_CLOSED)))
                except BaseException as exc:  # every failure reaches the consumer, as from the thread
                    self.ready.append((None, explain_env_error(self.envs, exc)))
                else:
                    self.ready.append((batch, None))
        finally:
            self._let_go()

    def _evaluating(self) -> contextlib.AbstractContextManager[None]:
        """The trainer's module in eval mode for the whole batch (nothing else runs meanwhile), switched once."""
        return contextlib.nullcontext() if self.modes is None else self.modes.evaluating()

    def _let_go(self) -> None:
        """Ends a batch or env call in the calling thread; releases the envs where close() came meanwhile."""
        with self._exit_lock:
            self._busy = False
            abandoned = self._abandoned
        if abandoned:
            self._release()

    def close(self, join_timeout: float) -> str | None:
        """Closes the envs it owns, or leaves that to a batch being collected in another thread; returns None."""
        self.stop.set()
        with self._exit_lock:
            self._abandoned = self._busy
            busy = self._busy
        if not busy:
            self._release()
        return None


class _EnvJob:
    """An env call queued among the batch requests of :class:`ThreadPlacement`: run by its thread, in order."""

    def __init__(self, call: EnvCall) -> None:
        self.call = call
        self.answer: EnvAnswer | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._state = "queued"  # then "running" or "cancelled"

    def run(self, envs: VectorEnv) -> None:
        with self._lock:
            if self._state == "cancelled":  # its caller gave up waiting (a timeout, Ctrl-C)
                return
            self._state = "running"
        self.answer = run_env_call(envs, self.call)
        self.done.set()

    def cancel(self) -> None:
        with self._lock:
            if self._state == "queued":
                self._state = "cancelled"


_CLOSED = "Collector: closed from another thread while a batch was collected; create a new Collector"
_TORN = (
    "Collector: a second Ctrl-C interrupted a batch in the middle (with prefetch=0 the batch is collected in the "
    "calling thread, and a first Ctrl-C waits for its end); its envs stand mid-batch, so collection cannot go on; "
    "create a new Collector (load_state_dict() continues a saved state)"
)


class _HeldInterrupt:
    """Holds the first SIGINT (Ctrl-C) that lands in the main thread inside the block, and raises it at its end.

    The handler in place before the block then runs as SIGINT would have run it
    (Python's default raises KeyboardInterrupt); a second SIGINT inside the block
    raises KeyboardInterrupt at once. Outside the main thread, or when SIGINT is
    ignored or handled outside Python, nothing changes.
    """

    def __enter__(self) -> _HeldInterrupt:
        self.previous = self.held = None
        if threading.current_thread() is not threading.main_thread():
            return self
        previous = _signal.getsignal(signal.SIGINT)
        if previous is None or previous == signal.SIG_IGN:
            return self
        try:
            _signal.signal(signal.SIGINT, self._hold)
        except ValueError:  # not the main interpreter
            return self
        self.previous = previous
        return self

    def _hold(self, signum: int, frame: Any) -> None:
        if self.held is not None:
            raise KeyboardInterrupt
        self.held = frame

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        previous = self.previous
        if previous is None:
            return
        _signal.signal(signal.SIGINT, previous)
        if self.held is None or exc_type is not None:
            return
        if callable(previous):
            previous(signal.SIGINT, self.held)
        else:  # SIG_DFL: what the signal does without a handler
            signal.raise_signal(signal.SIGINT)


def _hand_over(batch: TensorDict, stream: torch.cuda.Stream, consumer: torch.cuda.Stream) -> None:
    """Orders the work of ``consumer`` (the stream current at the request) after ``batch``'s on ``stream``.

    The consumer's stream waits for an event recorded at the batch's end (on the GPU: no host sync), and
    the batch's CUDA tensors are recorded as used on it, so that their memory, once freed, is not given to
    the loop's stream before the consumer's kernels that read it have run.
    """
    consumer.wait_event(stream.record_event())
    for tensor in batch.values(True, True):
        if tensor.is_cuda:
            tensor.record_stream(consumer)


def _cuda_device(*devices: Any) -> torch.device | None:
    """The first of ``devices`` that is a CUDA device (a torch.device or a device string), with its index."""
    for device in devices:
        if is_device(device) and torch.device(device).type == "cuda":
            return indexed(device)
    return None


def _one_intra_op_thread() -> None:
    """Gives the calling thread one torch intra-op thread and leaves every other thread's setting alone.

    torch's CPU build runs intra-op parallelism on OpenMP, where each OS thread that starts a parallel
    region has a thread team of its own: the collector thread and the trainer would each keep a team of
    ``torch.get_num_threads()`` threads spinning on the same cores (measured on 2 cores: the collector
    at 0.59x the frames/s of one thread once the trainer had run a backward pass). ``set_num_threads``
    sets the calling thread's team size, and also the default that threads started later begin with;
    a short-lived thread puts that default back.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(previous,), name="torch_rollout-threads")
    restore.start()
    restore.join()
