"""The thread placement: the collection loop on a daemon thread of the trainer's process."""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
import traceback
from typing import Any

import torch
from gymnasium.vector import VectorEnv
from tensordict import TensorDict
from torch import Tensor, nn

from torch_rollout._acting import PolicyCall
from torch_rollout._compile import acting_call
from torch_rollout._devices import indexed, is_device
from torch_rollout._drivers import make_loop
from torch_rollout._envs import explain_env_error
from torch_rollout._interaction import own_interaction_type
from torch_rollout._loop import RolloutLoop, Stopped
from torch_rollout._spec import LoopSpec
from torch_rollout._weights import named_weights

__all__ = ["ThreadPlacement"]


class ThreadPlacement:
    """Runs a :class:`RolloutLoop` on a daemon thread; right for GPU policies and envs that step outside the GIL.

    The placement holds no reference to the ``Collector`` so that dropping the
    collector lets it be garbage collected (and closed). The consumer talks to
    it through ``request()`` (one token per batch), ``wait()``, ``ready`` and
    ``stop``. The queues are C-level ``SimpleQueue``: a KeyboardInterrupt
    landing in the consumer's ``put`` cannot leave a lock held, as it can
    inside ``threading.Semaphore.release`` (and then ``close()`` would
    deadlock). Results wait in the deque ``ready`` until the consumer has
    taken them, which it does without a call (where a KeyboardInterrupt could
    land and lose one); ``_wakeup`` only wakes it. ``lock`` guards the
    policy's weights: every forward pass and every weight refresh holds it, so
    no forward sees two weight versions. ``close()`` hands the closing of owned
    envs to the thread when the consumer cannot wait for it to stop.
    """

    lock: threading.Lock
    version: int
    requested: int
    ready: collections.deque[tuple[TensorDict | None, BaseException | None]]
    thread: threading.Thread
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
        # The CUDA device the thread makes current at its start (a new thread starts on cuda:0): the policy's, else
        # the env's ("cuda": the consumer's current device).
        self.cuda_device = _cuda_device(device, getattr(envs, "device", None))
        # The acting copy's tensors (owned: the collector's copy, not the trainer's module; see call_policy).
        self.weights = dict(named_weights(acting_policy)) if owned else None
        self.lock = threading.Lock()
        self.version = 0
        self.requested = 0
        self.stop = threading.Event()
        # An EnvPool in async mode gets the loop that acts on whichever envs are ready.
        self.loop: RolloutLoop = make_loop(envs, self.forward, spec, device=device, seed=seed, stop=self.stop.is_set)
        self.autoreset_mode = self.loop.autoreset_mode
        # With compile_options, torch.compile'd calls (compiled by the collector thread at its first call).
        self.act = acting_call(
            acting_policy, spec.compile_options, num_envs=envs.num_envs, obs_key=spec.obs_key, owned=owned
        )
        self.num_envs = envs.num_envs
        self._credits: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = collections.deque()
        self._wakeup: queue.SimpleQueue = queue.SimpleQueue()  # one token per result
        self.thread = threading.Thread(target=self._run, name="torch_rollout-collector", daemon=True)
        # Whoever of the thread (on exit) and the consumer (in abandon) comes last closes owned envs.
        self._exit_lock = threading.Lock()
        self._exited = False
        self._abandoned = False

    def start(self) -> None:
        self.thread.start()

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

    def reseed(self, seed: int | None) -> None:
        # Before the first request: the thread has not touched the envs yet; its first batch resets them.
        self.loop.reseed(seed)

    def request(self) -> None:
        # No call between the count and the request: a KeyboardInterrupt cannot separate them.
        self.requested += 1
        self._credits.put(None)

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
            with torch.no_grad(), own_interaction_type():
                while True:  # the first batch resets the envs (with a resumed collector's seeds, if reseeded)
                    self._credits.get()
                    if self.stop.is_set():
                        return
                    self._deliver(self.loop.collect(), None)
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
        if stopped and self.owns_envs:
            self.envs.close()
        if stopped:
            # Nothing may keep the envs in a reference cycle (see RolloutLoop.release): freed now, not by gc.
            self.loop.release()
        if stopped or on_own_thread or join_timeout <= 0:
            return None
        return self._stuck_in()

    def _stuck_in(self) -> str:
        """The call the loop is inside and the thread's innermost frames: where a thread that did not stop is."""
        frame = sys._current_frames().get(self.thread.ident)
        frames = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else ""
        return f"{self.loop.call}, at:\n{frames}"


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
