"""The process placement: the collection loop in worker processes, batches and weights in shared memory.

Each of ``K`` workers builds its share of the envs from a picklable recipe and
runs the same :class:`~torch_rollout.loop._rollout.RolloutLoop` as the thread. Only
small messages travel through the pipes: a request for the next batch, the
index of the slot it was written to, an error. At set-up a worker sends its
``prefetch + 1`` batch slots (TensorDicts in shared memory) once; the
policy's weights are one shared-memory copy that the trainer refreshes in
place, under one lock per worker, so no forward pass sees two versions and
workers never wait for one another.

Every wait on the other side has a way out when it is gone. The trainer waits
for messages together with each worker's process sentinel; it takes a
worker's weights lock in short turns with a liveness check between them (a
worker killed inside its forward pass never releases it); its sends to a dead
worker fail at once. It reads a slot only once its worker has sent the slot's
index, after writing it whole. A worker waits only on the trainer (its pipe,
its lock), and exits as soon as the trainer's process is gone.
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from contextlib import ExitStack
from multiprocessing.reduction import ForkingPickler
from typing import Any, cast

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (registers the reductions that share tensors between processes)
from gymnasium.vector import VectorEnv
from tensordict import TensorDict
from torch import Tensor, nn

from torch_rollout.envs._gym import EnvRecipe, explain_env_error
from torch_rollout.loop._acting import PolicyCall
from torch_rollout.loop._compile import acting_call
from torch_rollout.loop._direct import HostBatch, slot_batch
from torch_rollout.loop._rollout import RolloutLoop, Stopped
from torch_rollout.loop._spec import LoopSpec
from torch_rollout.loop._weights import named_weights
from torch_rollout.placements._env_calls import run_env_call
from torch_rollout.placements._forkserver import TrainerEnvironment, context
from torch_rollout.placements._messages import (
    COLLECT,
    SLOTS_MAPPED,
    STOP,
    Batch,
    EnvCall,
    Ready,
    Reseed,
    SlotsMapped,
    Stop,
)
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

__all__ = ["ProcessPlacement", "check_shared_memory"]

# Slots of the control block shared with the workers (an int64 tensor).
_VERSION, _STOP = 0, 1
# How long close() waits for a worker to exit by itself before it is terminated.
_EXIT_WAIT = 5.0
# A refresh waits for a worker's weights lock in turns this long, checking between them that the worker lives.
_LOCK_TURN = 0.1
# Where torch keeps the shared memory of tensors (share_memory_()) on Linux: a tmpfs, 64 MB in a Docker container.
_SHM_DIR = "/dev/shm"


def check_shared_memory(needed: int, what: str) -> None:
    """Raises RuntimeError, naming ``what`` and the fixes, when ``needed`` bytes exceed /dev/shm's free space.

    Skipped where there is no /dev/shm (torch then shares memory some other way).
    """
    room = _shm_room()
    if room is not None and needed > room[0]:
        raise RuntimeError(_shm_message(needed, what, *room))


def _shm_room() -> tuple[int, int] | None:
    """``(free, size)`` bytes of /dev/shm, or None where there is none."""
    if not os.path.isdir(_SHM_DIR):
        return None
    stat = os.statvfs(_SHM_DIR)
    return stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize


def _shm_message(needed: int, what: str, free: int, size: int) -> str:
    # A size that holds what is in use now and twice this (a lower bound where it is the batch slots'), in
    # steps of 64 MiB. A tmpfs takes memory only for what is in it: a generous size costs nothing.
    suggested = math.ceil((size - free + 2 * needed) / 2**26) * 64
    return (
        f"Collector(backend='process'): {what} need at least {needed:,} bytes ({_mib(needed)}) of shared memory, "
        f"but {_SHM_DIR} has only {free:,} bytes ({_mib(free)}) free of {_mib(size)}; give it more (Docker: e.g. "
        f"docker run --shm-size={suggested}m ...; Kubernetes: an emptyDir volume with medium: Memory at {_SHM_DIR}), "
        "collect smaller batches (num_steps * num_envs), keep fewer batch slots (prefetch=0: one per worker), or "
        "pass backend='thread', which needs no shared memory"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class ProcessPlacement(RemotePlacement):
    """Runs the collection loop in ``num_workers`` processes; envs in global order in every batch.

    Args:
        recipe: env id or ``make_envs(num_envs[, start_index])``, pickled to each worker.
        acting_policy: the acting copy, already in shared memory (its tensors are refreshed in place).
        settings: the placement's settings; its loops' spec is pickled to each worker, batches are
            delivered on its ``device`` (where the workers run the policy), a worker collects up to
            ``prefetch`` batches ahead in ``prefetch + 1`` slots, and ``timeout`` bounds the wait for the
            workers to build their envs and for a worker's forward pass to end before a weight refresh.
        num_workers: worker processes (``K``).

    Before any batch it checks that the workers' slots fit in /dev/shm (at
    least their observations, actions and the loop's own keys), and refuses
    them with the numbers and the fixes where they do not; ``close()`` frees
    every segment (the delivered batches are copies).

    Unlike the thread's, its calls talk to the workers one call at a time
    (pipes, locks), so they hold Ctrl-C back while they do: what an
    interrupted ``next()`` received stays for the next one.
    """

    slots: list[list[TensorDict] | None]  # each worker's batch slots, once its first batch came
    # The slots of each batch as a sink takes them in place, by slot index per worker (see _offer).
    _offered: dict[tuple[int, ...], tuple[list[TensorDict], HostBatch]]

    def __init__(
        self, recipe: EnvRecipe, acting_policy: nn.Module, settings: PlacementSettings, *, num_workers: int
    ) -> None:
        super().__init__(num_envs=settings.num_envs, num_workers=num_workers, device=settings.device)
        spec, prefetch, num_envs = settings.spec, settings.prefetch, settings.num_envs
        self.timeout = settings.timeout  # the collector's timeout: also how long a refresh waits for a forward pass
        ctx = context()
        self.weights: dict[str, Tensor] | None = dict(named_weights(acting_policy))
        self.control = torch.zeros(2, dtype=torch.int64).share_memory_()
        # read and written through NumPy at every batch: no torch op's cost
        self._ctrl: np.ndarray | None = self.control.numpy()
        self.locks = [ctx.Lock() for _ in range(num_workers)]
        self.slots, self._offered = [None] * num_workers, {}
        self._row_bytes = [0] * num_workers  # each worker's RolloutLoop.min_row_bytes(), from its Ready
        self.conns: list[multiprocessing.connection.Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        try:
            for index in range(num_workers):
                parent_end, child_end = ctx.Pipe()
                process = ctx.Process(
                    target=_worker_main,
                    name=f"torch_rollout-worker-{index}",
                    args=(
                        TrainerEnvironment(),  # first: unpickled before the modules of the recipe and the policy
                        worker_setup(
                            index,
                            recipe,
                            settings,
                            self.shares,
                            threads=1,
                            device=settings.device,
                            num_slots=settings.prefetch + 1,
                        ),
                        child_end,
                        acting_policy,
                        self.locks[index],
                        self.control,
                    ),
                )
                process.start()
                child_end.close()
                self.conns.append(parent_end)
                self.processes.append(process)
            # Each worker reports once its envs are built (or the error that stopped it); its first batch resets them.
            self.autoreset_mode = self._await_ready(settings.timeout, "the worker processes did not build their envs")
            # Before the first batch: the slots are allocated then, and torch's error would not say why or what helps.
            rows = sum(self._row_bytes[k] * count for k, (_, count) in enumerate(self.shares))
            check_shared_memory(
                (prefetch + 1) * spec.num_steps * rows,
                f"the batch slots ({prefetch + 1} per worker for prefetch={prefetch}, x {spec.num_steps} steps x "
                f"{num_envs} envs x {self._row_bytes[0]:,} bytes per row of the observation, the action and the "
                "collector's own keys, before the policy's other outputs such as value and log_prob)",
            )
        except BaseException:
            self.close(0.0)
            raise

    # -- weights -------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return int(self._ctrl[_VERSION]) if self._ctrl is not None else self.final_version

    def refresh(self, dst: list[Tensor], src: list[Tensor]) -> None:
        """Copies ``src`` into the shared copy's ``dst`` and publishes a new version, no worker in a forward pass."""
        ctrl = self._ctrl
        if ctrl is None or self._failure is not None:  # closed (the shared copy went with the workers)
            return
        # Ctrl-C waits: the locks are taken one call at a time, and one left held would stall its worker.
        with sigint_deferred(), ExitStack() as stack:
            if not self._lock_all(stack):
                return  # a worker died or is stuck: wait() reports it, and no batch comes after it
            ctrl[_VERSION] += 1
            if dst:
                torch._foreach_copy_(dst, src)

    def set_version(self, version: int) -> None:
        """Counts versions on from ``version`` (a resumed collector's), before the first batch."""
        with sigint_deferred(), ExitStack() as stack:
            self._lock_all(stack)
            self.control[_VERSION] = version

    def _lock_all(self, stack: ExitStack) -> bool:
        """Takes every worker's weights lock onto ``stack``; False when a worker died or is stuck first.

        A worker holds its lock during each forward pass: one killed inside it (the OOM killer's SIGKILL) never
        releases it. So each lock is waited for in short turns, checking between them that its worker lives,
        and for at most the collector's ``timeout``; a dead or stuck worker becomes ``_failure``.
        """
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for k, lock in enumerate(self.locks):
            while not lock.acquire(timeout=_LOCK_TURN):
                if self.processes[k].exitcode is not None:
                    self._failure = self._death(k, "batch")
                    return False
                if deadline is not None and time.monotonic() > deadline:
                    start, count = self.shares[k]
                    self._failure = TimeoutError(
                        f"Collector: no batch within timeout={self.timeout} s; worker process {k} (pid "
                        f"{self.processes[k].pid}, envs {start}..{start + count - 1}) did not finish its policy's "
                        "forward() for a weight refresh: the policy is stuck; the collector is closed"
                    )
                    return False
            stack.callback(lock.release)
        return True

    # -- batches -------------------------------------------------------------------------------

    def reseed(self, seed: int | None) -> None:
        """Has each worker reset its envs from ``seed`` (its share from ``seed + start``) before its next batch."""
        with sigint_deferred():
            for conn, (start, _) in zip(self.conns, self.shares):
                try:
                    conn.send(Reseed(None if seed is None else seed + start))
                except OSError:  # a worker that died: wait() reports why
                    pass

    def request(self) -> None:
        # Ctrl-C waits: a request that reached only some workers would let those run a batch ahead.
        with sigint_deferred():
            self.requested += 1
            for conn in self.conns:
                try:
                    conn.send(COLLECT)
                except OSError:  # a worker that died: wait() reports why
                    pass

    def _send_call(self, k: int, call: EnvCall) -> None:
        try:
            self.conns[k].send(call)
        except OSError:  # a worker that died: the wait for its answer reports why
            pass

    def _offer(self, indices: list[int]) -> int | None:
        """The sink copies the rows straight from the slots ``indices`` (one per worker): no batch is made.

        Under the caller's deferred SIGINT, and before the slots are let go of: a worker writes a slot
        again only ``prefetch + 1`` batches later.
        """
        assert self.sink is not None  # offered only to a sink
        slots = [cast(list, self.slots[k])[i] for k, i in enumerate(indices)]
        found = self._offered.get(tuple(indices))
        if found is None or any(a is not b for a, b in zip(found[0], slots)):  # new slots: a worker remade them
            found = self._offered[tuple(indices)] = (slots, slot_batch(slots))
        rows = found[1]
        rows.read_masks()
        return self.sink(rows)

    def _assemble(self, indices: list[int]) -> TensorDict:
        parts = []
        for k, i in enumerate(indices):
            slots = self.slots[k]
            assert slots is not None  # came with the worker's first batch
            parts.append(slots[i])
        if len(parts) == 1:
            # A copy, so that the slot can be refilled: the worker may reuse it prefetch + 1 batches later.
            return parts[0].to(self.device) if self.device.type != "cpu" else parts[0].clone()
        return torch.cat(parts, dim=1).to(self.device)

    def _poll(self, kind: str, pending: list[int], timeout: float) -> None:
        conns = {self.conns[k]: k for k in pending}
        sentinels = {self.processes[k].sentinel: k for k in pending}
        readable = multiprocessing.connection.wait([*conns, *sentinels], timeout)
        exited = [sentinels[s] for s in readable if s in sentinels]
        with sigint_deferred():  # a message read must be recorded: half-read, the pipe is out of step
            for conn, k in conns.items():
                if conn.poll():
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        self._failure = self._death(k, kind)
                        return
                    self._record(k, message)
                    if self._failure is not None:
                        return
                elif k in exited:
                    self._failure = self._death(k, kind)
                    return

    def _who(self, k: int) -> str:
        return f"worker {k} (pid {self.processes[k].pid})"

    def _unpack(self, k: int, message: Ready | Batch) -> Any:
        if isinstance(message, Ready):
            self._row_bytes[k] = message.info["row_bytes"]
            return message.info
        slots = message.slots
        if slots is not None:
            # They arrive locked (share_memory_() locks a TensorDict), and a locked TensorDict caches the key
            # views that torch.cat takes, which refer back to it: a reference cycle that kept the slots' shared
            # memory after close() until the garbage collector ran. Unlocked, dropping them frees it.
            for slot in slots:
                slot.unlock_()
            self.slots[k] = slots
            # The slots' file descriptors came from the worker's resource sharer: it may go on now.
            try:
                self.conns[k].send(SLOTS_MAPPED)
            except OSError:  # it died meanwhile: its next message is the end of its pipe
                pass
        return message.data  # the slot's index

    def _death(self, k: int, kind: str) -> RuntimeError:
        process = self.processes[k]
        process.join(2.0)  # the pipe reports EOF a moment before the dead process can be reaped
        code = process.exitcode
        if code is None:
            cause = "closed its pipe"
        elif code < 0:
            cause = f"was killed by {signal.Signals(-code).name}"
        else:
            cause = f"exited with code {code}"
        start, count = self.shares[k]
        if kind == "ready":
            # It died before running any of our code: while re-importing the trainer's script (most often), or
            # unpickling its arguments; only its traceback tells which.
            return RuntimeError(
                f"Collector: worker process {k} (pid {process.pid}, envs {start}..{start + count - 1}) {cause} "
                "before its envs were built; its traceback is on stderr. Worker processes import the trainer's "
                "__main__ script again, then unpickle the envs, the policy and their locks: if the traceback "
                "shows the script's import running a Collector, the code that creates the Collector must sit under "
                "'if __name__ == \"__main__\":' (or pass backend='thread')"
            )
        return RuntimeError(
            f"Collector: worker process {k} (pid {process.pid}, envs {start}..{start + count - 1}) {cause} "
            "while collecting; the collector is closed and its other workers are stopped"
        )

    # -- shutdown ------------------------------------------------------------------------------

    def close(self, join_timeout: float) -> None:
        """Stops every worker: asks, waits up to ``join_timeout`` (at most 5 s), then terminates."""
        if self.closed:
            return
        self.closed = True
        self.control[_STOP] = 1  # a worker inside a batch stops at its next step
        for conn in self.conns:
            try:
                conn.send(STOP)
            except (OSError, ValueError):  # its worker is gone already
                pass
        _end_processes(self.processes, min(join_timeout, _EXIT_WAIT))
        for conn in self.conns:
            conn.close()
        for process in self.processes:
            process.close()
        # Shared memory (file descriptors) and named semaphores (/dev/shm) live until their objects are
        # dropped: not as long as a closed collector that the trainer still holds.
        self.final_version = int(self.control[_VERSION])
        self.control = self._ctrl = None
        self.weights = None  # the shared-memory copy goes with the workers
        self.locks = []
        self.slots, self._offered = [None] * self.num_workers, {}  # their shared memory: freed once unreferenced


def _end_processes(processes: list[multiprocessing.process.BaseProcess], wait: float) -> None:
    """Waits up to ``wait`` s for the processes to exit, then terminates them, then kills any left after 2 s."""
    deadline = time.monotonic() + wait
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    for process in processes:
        process.join(2.0)
        if process.exitcode is None:
            process.kill()
            process.join()


# -- the worker process -------------------------------------------------------------------------


def _worker_main(
    environment: TrainerEnvironment,
    setup: WorkerSetup,
    conn: multiprocessing.connection.Connection,
    policy: nn.Module,
    lock: Any,
    control: Tensor,
) -> None:
    """A worker process: builds its envs, says it is ready, then serves the trainer's requests until it stops.

    It took on the trainer's ``environment`` as it unpickled its arguments.
    """
    _set_up_worker_process()
    ctrl = control.numpy()
    envs = None
    device = setup.device
    assert device is not None  # a worker process runs the policy on the collector's device
    try:
        with torch.no_grad():
            envs = start_worker(setup)
            forward = _WorkerForward(policy, lock, ctrl, device, setup.spec, setup.num_envs)
            loop = worker_loop(envs, setup, forward, device=device, stop=lambda: bool(ctrl[_STOP]))
            conn.send(
                Ready(
                    {
                        "autoreset_mode": loop.autoreset_mode.value,
                        "envs": repr(envs),
                        "row_bytes": loop.min_row_bytes(),
                        "spaces": (envs.single_observation_space, envs.single_action_space),
                    }
                )
            )
            _serve(conn, loop, setup, envs)
    except (Stopped, EOFError, BrokenPipeError):
        pass
    except BaseException as exc:
        if not ctrl[_STOP]:
            if envs is not None:
                exc = explain_env_error(envs, exc, env_offset=setup.start_index)
            conn.send(error_message(exc, ForkingPickler.dumps))
    finally:
        if envs is not None:
            try:
                envs.close()
            except Exception:
                pass


def _set_up_worker_process() -> None:
    # Ctrl-C reaches the whole process group: the trainer decides, and closes the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "fork" in multiprocessing.get_all_start_methods():
        # This process came from the forkserver, whose start method it inherits: every process that a vector env
        # of processes (AsyncVectorEnv) starts would then import the trainer's main module again (seconds each,
        # measured). Fork them from this process instead, before any thread of its own is started.
        multiprocessing.set_start_method("fork", force=True)
    _watch_parent()


def _serve(conn: multiprocessing.connection.Connection, loop: RolloutLoop, setup: WorkerSetup, envs: VectorEnv) -> None:
    """Answers each :data:`COLLECT` with a batch written into the next slot and each :class:`EnvCall` with its
    answer, in the order they came, until :data:`STOP`."""
    slots: list[TensorDict] = []
    credits: int | None = 0  # requests that arrived while the worker waited for the trainer to map its slots
    produced = 0
    while True:
        if credits:
            credits -= 1
        else:
            message = conn.recv()
            if isinstance(message, Reseed):  # before the first request
                loop.reseed(message.seed)
                continue
            if isinstance(message, EnvCall):  # between batches: the trainer waited for those requested before it
                conn.send(run_env_call(envs, message, ForkingPickler.dumps))
                continue
            if isinstance(message, Stop):
                return
        i = produced % setup.num_slots
        if slots:
            loop.collect(slots[i])
            conn.send(Batch(i, account=loop.account.totals(), autoreset_mode=loop.autoreset_mode.value))
        else:
            # The first batch tells the policy's outputs: allocate every slot like it, once. Their
            # file descriptors are served by this process until the trainer has mapped them.
            slots = _shared_slots(loop.collect(), setup.num_slots, setup.index)
            conn.send(Batch(i, slots, loop.account.totals(), loop.autoreset_mode.value))
            credits = _await_mapped(conn)
            if credits is None:
                return
        produced += 1


def _await_mapped(conn: multiprocessing.connection.Connection) -> int | None:
    """Waits for :data:`SLOTS_MAPPED`: the requests that came meanwhile, or None for :data:`STOP`."""
    credits = 0
    while not isinstance(message := conn.recv(), SlotsMapped):
        if isinstance(message, Stop):
            return None
        credits += 1
    return credits


def _shared_slots(first: TensorDict, num_slots: int, index: int) -> list[TensorDict]:
    """``first`` and ``num_slots - 1`` copies of it, in shared memory; a clear error where /dev/shm is too small."""
    try:
        first.share_memory_()
        return [first] + [first.clone().share_memory_() for _ in range(num_slots - 1)]
    except RuntimeError as exc:
        room = _shm_room()
        if room is None or "unable to allocate shared memory" not in str(exc):
            raise
        free, size = room
        what = (
            f"worker process {index}'s {num_slots} batch slots of {first.bytes():,} bytes each (every key of the "
            "batch, the policy's outputs included)"
        )
        raise RuntimeError(_shm_message(num_slots * first.bytes(), what, free, size)) from exc


class _WorkerForward:
    """The worker's policy call: under its weights lock, with the version the trainer last published."""

    def __init__(
        self,
        shared: nn.Module,
        lock: Any,
        ctrl: Any,
        device: torch.device,
        spec: LoopSpec,
        num_envs: int,
    ) -> None:
        self.shared = shared
        self.lock = lock
        self.ctrl = ctrl
        self.device = device
        # On the CPU the worker runs the shared copy itself; elsewhere a copy on its device,
        # refreshed from the shared one whenever the version changes.
        self.acting_policy = shared if device.type == "cpu" else copy.deepcopy(shared).to(device).eval()
        # With compile_options, this worker compiles its own calls of the acting_policy (at the first one).
        self.act = acting_call(
            self.acting_policy, spec.compile_options, num_envs=num_envs, obs_key=spec.obs_key, owned=True
        )
        self.seen = -1

    def __call__(self, call: PolicyCall) -> tuple[Any, int]:
        with self.lock:
            version = int(self.ctrl[_VERSION])
            if version != self.seen:
                if self.acting_policy is not self.shared:
                    for dst, src in zip(self.acting_policy.state_dict().values(), self.shared.state_dict().values()):
                        dst.copy_(src)
                self.seen = version
            return self.act(call), version


def _watch_parent() -> None:
    """Exits this worker as soon as the trainer's process is gone, even inside a long env step."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)  # the envs' own worker processes see their pipes close and exit too

    threading.Thread(target=watch, name="torch_rollout-parent-watch", daemon=True).start()
