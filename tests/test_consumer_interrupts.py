"""The consumer side: the trainer raising or breaking, Ctrl-C, a dropped collector, interpreter exit, a second loop.

In none of these may anything hang or outlive the collector: no thread, no
child process, no file descriptor. Ctrl-C in the main thread and interpreter
exit run in a subprocess, the only place where they can be delivered for real;
Ctrl-C inside ``next()`` and ``update_policy()`` is a real SIGINT that this
process sends itself at chosen points, and no batch or weight may be torn by it.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
import torch
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv
from script_server import ScriptServer
from torch.overrides import TorchFunctionMode

from torch_rollout import Collector, Processes, ReplayRing

from counting_env import TransitionCountingPolicy, counting_vec
from placements import LOCAL_PLACEMENTS, PLACEMENTS, envs_for, num_loops
from reliability_envs import (
    GC_ARMED,
    GC_GO,
    ConstantPolicy,
    FaultyEnv,
    GcPolicy,
    SlowReadPolicy,
    Snapshot,
    close_envs,
    collector_threads,
    faulty_fns,
    wait_until,
    warm_up_multiprocessing,
)

TIMEOUT = 60.0  # hang guard for next(); never reached when things work
SUBPROCESS_TIMEOUT = 180.0  # a fresh interpreter imports torch: slow on a loaded 2-core box
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# Points in one next() where Ctrl-C can land: about 200 with the thread, 1,400 with two worker processes.
MAX_POINTS = 5000
FAULTY = partial(gym.make_vec, "torch_rollout_tests/Faulty-v0")  # healthy FaultyEnvs, for any placement


@pytest.fixture(autouse=True, scope="module")
def _warm_up():
    warm_up_multiprocessing()


class TrainerError(Exception):
    """What the trainer's update raises in these tests."""


def vec_id(cls: type) -> str:
    return cls.__name__


def build(cls: type, **kwargs) -> tuple:
    envs = cls(faulty_fns(2))
    return envs, Collector(envs, ConstantPolicy(), num_steps=8, device="cpu", timeout=TIMEOUT, **kwargs)


@pytest.mark.parametrize("cls", [SyncVectorEnv, AsyncVectorEnv], ids=vec_id)
@pytest.mark.parametrize("prefetch", [0, 3])
def test_trainer_raising_inside_with_block(cls, prefetch):
    snapshot = Snapshot()
    envs, collector = build(cls, prefetch=prefetch)
    with pytest.raises(TrainerError):
        with collector:
            for i, _ in enumerate(collector):
                if i == 2:
                    raise TrainerError("update failed")
    assert collector.closed
    assert not collector_threads()
    # The trainer's error was the trainer's: the collector did not fail and says it is closed.
    with pytest.raises(RuntimeError, match="cannot iterate a closed collector"):
        next(collector)
    envs.close()
    del envs, collector
    snapshot.assert_no_leaks()


@pytest.mark.parametrize("cls", [SyncVectorEnv, AsyncVectorEnv], ids=vec_id)
def test_trainer_raising_without_with_block_then_collector_dropped(cls):
    snapshot = Snapshot()
    envs = cls(faulty_fns(2))

    def train() -> None:
        collector = Collector(envs, ConstantPolicy(), num_steps=8, device="cpu", prefetch=2, timeout=TIMEOUT)  # noqa: F821
        for i, _ in enumerate(collector):
            if i == 1:
                raise TrainerError("update failed")

    with pytest.raises(TrainerError) as info:
        train()
    # The traceback holds train's frame, which holds the collector: dropping it closes the collector.
    assert collector_threads()
    del info
    assert wait_until(lambda: not collector_threads(), TIMEOUT)
    envs.close()
    del envs
    snapshot.assert_no_leaks()


@pytest.mark.parametrize("cls", [SyncVectorEnv, AsyncVectorEnv], ids=vec_id)
@pytest.mark.parametrize("with_block", [True, False], ids=["with", "no-with"])
def test_break(cls, with_block):
    snapshot = Snapshot()
    envs, collector = build(cls, prefetch=2)
    if with_block:
        with collector:
            for _ in collector:
                break
        assert collector.closed
        del collector
    else:
        for _ in collector:
            break
        assert not collector.closed  # the user may go on iterating
        next(collector)
        ref = weakref.ref(collector)
        del collector  # no close(): dropping the last reference closes it
        assert ref() is None
    assert not collector_threads()
    envs.close()
    del envs
    snapshot.assert_no_leaks()


def test_dropped_in_a_reference_cycle_closed_by_gc():
    snapshot = Snapshot()
    collector = Collector(
        "torch_rollout_tests/Faulty-v0", ConstantPolicy(), num_envs=2, num_steps=8, device="cpu", backend="thread"
    )
    next(collector)
    envs = collector.envs
    collector.myself = collector  # only the cycle collector can free it now
    del collector
    gc.collect()
    assert wait_until(lambda: not collector_threads(), TIMEOUT)
    assert envs.closed  # the envs it built from the id
    del envs
    snapshot.assert_no_leaks()


def test_garbage_collected_on_its_own_thread(monkeypatch):
    """gc may run Collector.__del__ on the collector's thread, which cannot join itself."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    snapshot = Snapshot()
    GC_GO.clear()
    GC_ARMED.set()
    gc.disable()  # only the collector's thread may find the cycle
    try:
        collector = Collector(
            "torch_rollout_tests/Faulty-v0",
            GcPolicy(),
            num_envs=2,
            num_steps=8,
            device="cpu",
            prefetch=1,
            backend="thread",
        )
        iter(collector)  # starts collecting ahead
        envs = collector.envs
        collector.myself = collector
        del collector
        GC_GO.set()  # the thread's next forward runs gc.collect() and finds the cycle
        assert wait_until(lambda: not collector_threads(), TIMEOUT)
    finally:
        gc.enable()
        GC_ARMED.clear()
        GC_GO.set()
    assert [u.exc_value for u in unraisable] == []
    assert envs.closed  # closed by the thread itself on its way out
    del envs
    snapshot.assert_no_leaks()


# -- in a subprocess: Ctrl-C and interpreter exit ---------------------------------------------------

PRELUDE = """
import os, signal, sys, threading, time
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv
from reliability_envs import ConstantPolicy, child_pids, collector_threads, faulty_fns
from torch_rollout import Collector

VEC = {"sync": SyncVectorEnv, "async": AsyncVectorEnv}[sys.argv[1]]
# A shell starts background jobs with SIGINT ignored, and Python keeps it so: Ctrl-C must work here.
signal.signal(signal.SIGINT, signal.default_int_handler)
"""


@pytest.fixture(scope="module")
def python():
    """Starts ``python -c CODE`` (PYTHONPATH: the tests' folder and the repository, then the inherited one) in a
    fork of a warm interpreter, torch imported once; each script is the leader of a process group of its own."""
    server = ScriptServer(warnings_as_errors=False, pythonpath=(TESTS, ROOT))
    try:
        yield server
    finally:
        server.close()


def run_script(
    python: ScriptServer, body: str, *args: str, interrupt: str | None = None
) -> subprocess.CompletedProcess:
    """Runs PRELUDE + ``body`` as ``python -c``; ``interrupt`` sends SIGINT once it prints "ready".

    ``interrupt="pid"`` signals the process (``kill -INT``), ``"group"`` its whole
    process group with the AsyncVectorEnv workers, as Ctrl-C in a terminal does.
    """
    script = python.start(code=textwrap.dedent(PRELUDE) + textwrap.dedent(body), args=args, cwd=ROOT)
    try:
        if interrupt is not None:
            line = script.first_line(SUBPROCESS_TIMEOUT)  # once the script is iterating (or has died)
            assert line.strip() == "ready", (line, script.stderr.read_text())
            if interrupt == "pid":
                os.kill(script.pid, signal.SIGINT)
            else:
                os.killpg(script.pid, signal.SIGINT)
        return script.wait(SUBPROCESS_TIMEOUT)
    finally:
        script.kill()


def report(out: str) -> dict[str, str]:
    """``key value`` lines printed by a script."""
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def assert_gone(pids: str) -> None:
    """Processes the script started are dead (a zombie left to an init that does not reap is dead too)."""
    for pid in map(int, pids.split()):

        def dead(pid: int = pid) -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
            except OSError:
                return True

        assert wait_until(dead, TIMEOUT), f"process {pid} outlived its parent"


INTERRUPTED = """
envs = VEC(faulty_fns(2))
pids = " ".join(str(p.pid) for p in getattr(envs, "processes", []))
try:
    # The policy is slow, the trainer instant: the main thread waits inside next() when SIGINT lands.
    with Collector(envs, ConstantPolicy(pause=0.002), num_steps=16, device="cpu", timeout=120) as collector:
        for i, batch in enumerate(collector):
            if i == 0:
                print("ready", flush=True)
except KeyboardInterrupt:
    print("interrupted yes", flush=True)
print("closed", collector.closed, flush=True)
print("threads", len(collector_threads()), flush=True)
try:
    envs.close()
except Exception as exc:  # gymnasium's close after its workers got SIGINT too
    print("envs.close", type(exc).__name__, flush=True)
print("children", len(child_pids()), flush=True)
print("workers", pids or "-", flush=True)
"""


# Each scenario starts an interpreter (seconds of imports): the rarer variants run with the slow tests.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "vec, interrupt",
    [("sync", "pid"), pytest.param("async", "pid", marks=SLOW), ("async", "group")],
    ids=lambda x: x,
)
def test_keyboard_interrupt_in_main_thread(python, vec, interrupt):
    result = run_script(python, INTERRUPTED, vec, interrupt=interrupt)
    assert result.returncode == 0, result.stderr
    out = report(result.stdout)
    assert out.get("interrupted") == "yes", result.stdout + result.stderr
    assert out["closed"] == "True"
    assert out["threads"] == "0"
    if interrupt == "pid":  # the workers were not interrupted: closing the envs works as usual
        assert "envs.close" not in out
        assert out["children"] == "0"
    if out["workers"] != "-":
        assert_gone(out["workers"])


EXITING = """
how = sys.argv[2]
if sys.argv[3] == "env-id":
    collector = Collector("torch_rollout_tests/Faulty-v0", ConstantPolicy(), num_envs=2, num_steps=8,
                          device="cpu", prefetch=2)
    pids = ""
else:
    envs = VEC(faulty_fns(2))
    pids = " ".join(str(p.pid) for p in getattr(envs, "processes", []))
    collector = Collector(envs, ConstantPolicy(), num_steps=8, device="cpu", prefetch=2)
print("workers", pids or "-", flush=True)
for i, batch in enumerate(collector):
    if i == 2:
        if how == "sys.exit":
            sys.exit(0)
        if how == "raise":
            raise RuntimeError("the trainer gave up")
        break
# "return": fall off the end, collector still running and envs open
"""


@pytest.mark.parametrize(
    "vec, how, envs",
    [
        pytest.param("sync", "return", "user", marks=SLOW),
        ("sync", "return", "env-id"),
        pytest.param("sync", "raise", "user", marks=SLOW),
        pytest.param("async", "return", "user", marks=SLOW),
        pytest.param("async", "sys.exit", "user", marks=SLOW),
        ("async", "raise", "user"),
    ],
    ids=lambda x: x,
)
def test_interpreter_exit_with_running_collector(python, vec, how, envs):
    result = run_script(python, EXITING, vec, how, envs)
    if how == "raise":
        assert result.returncode == 1
        assert result.stderr.count("Traceback") == 1 and "RuntimeError: the trainer gave up" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""
    assert "Exception ignored" not in result.stderr
    workers = report(result.stdout)["workers"]
    if workers != "-":
        assert_gone(workers)


STORM = """
import _thread, random
from functools import partial
from counting_env import TransitionCountingEnv, TransitionCountingPolicy

done = threading.Event()

def storm():  # KeyboardInterrupts at random moments of the main thread, as many Ctrl-C in a notebook
    rng = random.Random(0)
    while not done.wait(rng.uniform(0.0002, 0.004)):
        _thread.interrupt_main()

# Python raises the KeyboardInterrupt only while armed, i.e. inside the try below around next():
# the collector is what is under test, not this script's own loop.
armed = False

def on_sigint(signum, frame):
    if armed:
        raise KeyboardInterrupt

signal.signal(signal.SIGINT, on_sigint)
for prefetch in (0, 2):
    envs = VEC([partial(TransitionCountingEnv, i) for i in range(2)])
    collector = Collector(envs, TransitionCountingPolicy(), num_steps=4, device="cpu", prefetch=prefetch, timeout=120)
    done.clear()
    thread = threading.Thread(target=storm)
    thread.start()
    interrupts, batches, last = 0, 0, [-1.0, -1.0]
    while interrupts < 150 or batches < 5:
        try:
            armed = True
            batch = next(collector)
            armed = False
        except KeyboardInterrupt:
            armed = False
            interrupts += 1
            continue
        for i in range(2):  # rewards count each env's transitions: increasing, never repeated
            rewards = batch["reward"][:, i][batch["mask"][:, i]].tolist()
            assert rewards == sorted(set(rewards)) and rewards[0] > last[i], (last[i], rewards)
            last[i] = rewards[-1]
        batches += 1
    done.set()
    thread.join()
    collector.close()
    envs.close()
    print(f"batches{prefetch}", batches, flush=True)
    print(f"threads{prefetch}", len(collector_threads()), flush=True)
"""


def test_keyboard_interrupt_storm_then_close(python):
    """150 KeyboardInterrupts at random points of next(), prefetch 0 and 2: no lock is left held
    (close() then deadlocked), and the batches that do arrive keep their order."""
    result = run_script(python, STORM, "sync")
    assert result.returncode == 0, result.stderr
    out = report(result.stdout)
    for prefetch in (0, 2):
        assert int(out[f"batches{prefetch}"]) >= 5
        assert out[f"threads{prefetch}"] == "0"


# -- Ctrl-C at chosen points of next() and update_policy(), and a thread stuck at exit -------------


class CtrlCAfterCopy(TorchFunctionMode):
    """Counts this thread's torch copy calls; Ctrl-C (a real SIGINT to this process) right after the ``at``-th.

    Any op whose name has "copy" counts (``Tensor.copy_``, ``torch._foreach_copy_``).
    Right after a call returns is where CPython runs a signal handler. Torch
    function modes are thread-local: the collector's thread is not affected.
    """

    def __init__(self, at: int | None = None) -> None:
        super().__init__()
        self.at = at
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if "copy" in getattr(func, "__name__", ""):
            self.calls += 1
            if self.calls == self.at:
                signal.raise_signal(signal.SIGINT)
        return result


@pytest.fixture
def sigint_raises_keyboard_interrupt():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class GatedEnv(FaultyEnv):
    """A FaultyEnv of 100-step episodes; env 0 shows its progress on ``board``, shared memory seen wherever it runs.

    Env 0 writes the number of its step to ``board[0]`` when the step starts,
    and waits in step ``at`` until the test sets ``board[1]``.
    """

    def __init__(self, index: int, *, board: torch.Tensor, at: int) -> None:
        super().__init__(index, episode_length=100)
        self.board = board
        self.gate_at = at

    def step(self, action: Any) -> Any:
        if self.index == 0:
            self.board[0] = self.steps + 1
            if self.steps + 1 == self.gate_at:
                wait_until(lambda: bool(self.board[1]), 600)
        return super().step(action)


def gated_envs(num_envs: int, start_index: int = 0, *, board: torch.Tensor, at: int) -> SyncVectorEnv:
    return SyncVectorEnv([partial(GatedEnv, start_index + i, board=board, at=at) for i in range(num_envs)])


@pytest.fixture
def board():
    board = torch.zeros(2, dtype=torch.int64).share_memory_()
    yield board
    board[1] = 1  # whatever happened, no step stays blocked after the test


@pytest.mark.parametrize("placement", LOCAL_PLACEMENTS)  # the envs read `board` from shared memory
def test_keyboard_interrupt_in_update_policy_refreshes_all_or_nothing(
    sigint_raises_keyboard_interrupt, board, placement
):
    """Ctrl-C in the middle of the copy of 4 weights: the acting copy is all old or all new, as its version says."""
    T = 4
    policy = SlowReadPolicy(k=4, pause=0.0)  # reports the 4 weights it acted with
    # Env 0 waits in the first step of batch 1 until released: the rest of its batch 1 acts after the Ctrl-C.
    envs, extra = envs_for(placement, partial(gated_envs, board=board, at=T + 1), 2)
    options = dict(num_steps=T, device="cpu", prefetch=1, timeout=TIMEOUT, **placement, **extra)
    with Collector(envs, policy, **options) as collector:
        next(collector)
        with CtrlCAfterCopy() as count:  # how many copy calls one refresh makes
            collector.update_policy()
        old = collector.policy_version
        with torch.no_grad():
            for w in policy.ws:
                w.fill_(1.0)
        # After the last copy but one: 3 of the 4 weights when they are copied one by one.
        with pytest.raises(KeyboardInterrupt):
            with CtrlCAfterCopy(at=max(1, count.calls - 1)):
                collector.update_policy()
        assert collector.policy_version in (old, old + 1)  # nothing copied, or all of it
        board[1] = 1
        assert wait_until(lambda: board[0] >= 2 * T, TIMEOUT)  # batch 1 acted, before any new refresh
        batch = next(collector)  # batch 1
        weights, versions = batch["weights"], batch["policy_version"]  # [T, N, 4], [T, N]
        assert (weights == weights[..., :1]).all(), f"rows acted with a half-refreshed copy: {weights[:, 0].tolist()}"
        # Versions up to `old` copied the weights 0, version old + 1 the weights 1.
        assert (versions <= old + 1).all()
        assert torch.equal(weights[:, :, 0], (versions > old).float()), (weights[:, 0], versions[:, 0])
    close_envs(envs)


class StepCount(gym.vector.VectorWrapper):
    """Counts ``envs.step()`` calls in ``calls[slot]``, shared memory seen wherever the envs run."""

    def __init__(self, env: gym.vector.VectorEnv, calls: torch.Tensor, slot: int) -> None:
        super().__init__(env)
        self.calls = calls
        self.slot = slot

    def step(self, actions: Any) -> Any:
        self.calls[self.slot] += 1
        return super().step(actions)


def counted_envs(num_envs: int, start_index: int = 0, *, calls: torch.Tensor) -> VectorEnv:
    """TransitionCountingEnvs whose steps are counted in ``calls[start_index]``: each worker's envs have a slot of
    their own."""
    return StepCount(counting_vec(num_envs, start_index), calls, start_index)


def next_with_ctrl_c_at(collector: Collector, k: int) -> tuple[Any, int]:
    """``next(collector)`` with Ctrl-C (a real SIGINT) at the ``k``-th point inside it where one can land.

    CPython runs a signal handler at the start of a Python function and right
    after a call returns, i.e. at the profiler's "call", "return" and "c_return"
    events; the return of ``next()`` itself to this frame is outside it. The
    KeyboardInterrupt comes at once, or where the collector stops deferring
    SIGINT. Returns the batch (None if interrupted) and the number of such
    points seen. Finalizers and weakref callbacks that happen to run meanwhile
    are skipped: Python swallows a KeyboardInterrupt there ("Exception ignored
    in ...").
    """
    outer = sys._getframe()
    points = 0

    def profile(frame, event, arg):
        nonlocal points
        if frame is outer or event not in ("call", "return", "c_return"):
            return
        if frame.f_code.co_name == "__del__" or frame.f_code.co_filename.endswith(("weakref.py", "_weakrefset.py")):
            return
        if event == "return" and frame.f_back is outer:
            return
        points += 1
        if points == k:
            signal.raise_signal(signal.SIGINT)  # the profiler unsets itself if the handler raises here

    grad = torch.is_grad_enabled()  # an interrupted `with torch.no_grad()` may not restore it
    sys.setprofile(profile)
    try:
        batch = next(collector)
    except KeyboardInterrupt:
        batch = None
    finally:
        sys.setprofile(None)
        torch.set_grad_enabled(grad)
    return batch, points


@pytest.mark.parametrize("placement", LOCAL_PLACEMENTS)  # the envs count their steps in shared memory
@pytest.mark.parametrize("prefetch", [0, 1])
def test_keyboard_interrupt_anywhere_in_next_drops_no_batch_and_runs_no_batch_ahead(
    sigint_raises_keyboard_interrupt, prefetch, placement
):
    """Ctrl-C at every point of next() in turn: no batch is lost, and collection stays within prefetch."""
    T, N = 4, 2
    calls = torch.zeros(N, dtype=torch.int64).share_memory_()
    envs, extra = envs_for(placement, partial(counted_envs, calls=calls), N)
    loops = num_loops(placement)  # vector envs, each stepped T times per batch

    def collected() -> float:
        return int(calls.sum()) / (T * loops)

    batches = []
    options = dict(num_steps=T, device="cpu", prefetch=prefetch, timeout=TIMEOUT, **placement, **extra)
    with Collector(envs, TransitionCountingPolicy(), **options) as collector:
        iter(collector)  # starts collecting ahead
        k = 0
        while True:
            k += 1
            assert k < MAX_POINTS, "next() never got through without an interrupt"
            if prefetch:  # the batch is ready when next() starts, so that each k lands at the same point
                assert wait_until(lambda: collected() >= len(batches) + prefetch, TIMEOUT, interval=0.001)
                time.sleep(0.003)  # its last steps are done: the batch is being sent
            batch, points = next_with_ctrl_c_at(collector, k)
            # As a trainer would after Ctrl-C: carry on. The next k then starts from the same state again.
            batches.append(next(collector) if batch is None else batch)
            if points < k:  # went through: every point has had its interrupt
                break
        batches.append(next(collector))
        time.sleep(0.3)  # collection running ahead of the trainer would step on now
        ahead = collected() - len(batches)
        assert ahead <= prefetch, f"{ahead:g} batches were collected ahead of the trainer, prefetch={prefetch}"
    close_envs(envs)
    assert k > 5  # next() had that many points to interrupt
    mask = torch.cat([b["mask"] for b in batches])
    reward = torch.cat([b["reward"] for b in batches])
    for i in range(N):  # TransitionCountingEnv's reward counts its real transitions: 0, 1, 2, ... with nothing missing
        got = reward[:, i][mask[:, i]]
        assert torch.equal(got, torch.arange(len(got), dtype=got.dtype)), f"env {i}: a batch was dropped"


class _NoValue(TransitionCountingPolicy):
    """The counting policy without a value (a Q-network's outputs): a ring takes its batches' rows directly."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(obs)
        del out["value"]
        return out


@pytest.mark.parametrize(
    "placement",
    [pytest.param({"backend": "thread"}, id="thread"), pytest.param({"backend": Processes(1)}, id="process1")],
)
def test_keyboard_interrupt_anywhere_in_filling_a_ring_loses_no_row_and_writes_none_twice(
    sigint_raises_keyboard_interrupt, placement
):
    """prefetch=0 and a ReplayRing taking the rows in place (the loop's, or a worker's slot): Ctrl-C at every
    point of the fill's next() in turn."""
    T, N = 4, 2
    envs, extra = envs_for(placement, partial(counting_vec, mode=AutoresetMode.SAME_STEP), N)
    options = {**placement, **extra}
    taken = []

    class Ring(ReplayRing):
        def _take(self, rows):
            taken.append(super()._take(rows))
            return taken[-1]

    ring = Ring(10_000, ("reward", "mask"))
    with Collector(envs, _NoValue(), num_steps=T, device="cpu", gae=None, prefetch=0, **options) as collector:
        # The first batch is written whole, to make the storage: a KeyboardInterrupt inside tensordict's
        # TensorDict() leaves its per-thread construction flag set (tensordict 0.14), whoever made it.
        next(ring.fill(collector))
        k = 0
        while True:
            k += 1
            assert k < MAX_POINTS, "the fill's next() never got through without an interrupt"
            written, points = next_with_ctrl_c_at(ring.fill(collector), k)
            if written is None:  # as a trainer would after Ctrl-C: carry on, with a fresh fill
                written = next(ring.fill(collector))
            if points < k:  # went through: every point has had its interrupt
                break
    close_envs(envs)
    assert k > 5 and written == T * N
    # The first batch makes the storage; every later one's rows were taken, no batch made of them.
    assert taken[0] is None and len(taken) > 5 and all(n == T * N for n in taken[1:])
    held = ring.rows()
    assert bool(held["mask"].all())  # SAME_STEP: every row is a transition
    rewards = held["reward"].view(-1, N)  # rows t * N + env
    for i in range(N):  # TransitionCountingEnv's reward counts its real transitions: 0, 1, 2, ... once each
        assert torch.equal(rewards[:, i], torch.arange(len(rewards), dtype=rewards.dtype)), f"env {i}"


def test_next_after_a_fill_stopped_by_ctrl_c_goes_on_past_the_rows_the_ring_took(sigint_raises_keyboard_interrupt):
    """A fill stopped after the ring took a batch's rows, then plain next(): those rows stay the ring's only."""
    T, N = 4, 2
    envs = counting_vec(N, mode=AutoresetMode.SAME_STEP)
    ring = ReplayRing(10_000, ("reward",))
    with Collector(envs, _NoValue(), num_steps=T, device="cpu", gae=None, prefetch=0) as collector:
        next(ring.fill(collector))  # makes the storage
        for k in range(1, MAX_POINTS):
            written, _ = next_with_ctrl_c_at(ring.fill(collector), k)
            assert written is None, "no interrupt left a batch's rows taken and not handed out"
            if collector._placement.ready:  # the ring took the rows; Ctrl-C came before the fill yielded them
                break
        batch = next(collector)
    envs.close()
    assert len(ring) == 2 * T * N  # the first batch and the one the stopped fill took
    rewards = torch.cat([ring.rows()["reward"].view(-1, N), batch["reward"]])  # rows t * N + env, then [T, N]
    for i in range(N):  # TransitionCountingEnv's reward counts its real transitions: 0, 1, 2, ... once each
        assert torch.equal(rewards[:, i], torch.arange(3 * T, dtype=rewards.dtype)), f"env {i}"


STUCK_AT_EXIT = """
from gymnasium.vector import SyncVectorEnv
from reliability_envs import ConstantPolicy, faulty_fns, wait_until
from torch_rollout import Collector

envs = SyncVectorEnv(faulty_fns(2, 0, fault="step_blocks", at=3))
collector = Collector(envs, ConstantPolicy(), num_steps=4, device="cpu", prefetch=1)  # no timeout
iter(collector)  # starts collecting ahead
assert wait_until(lambda: envs.envs[0].steps == 3, 60)  # the thread is in env 0's third step for good
print("exiting", flush=True)
"""

# The interpreter must be gone this long after the script's last line: the collector's bounded wait
# for its stuck thread (2 s, which the warning states) plus the interpreter's own teardown. That
# teardown took over 2 s on the 2-core machine under a load of 9; before the fix the wait alone was 10 s.
EXIT_BOUND = 8.0


def test_interpreter_exit_with_a_thread_stuck_in_the_env_is_bounded_and_says_where(python):
    script = python.start(code=textwrap.dedent(STUCK_AT_EXIT), cwd=ROOT)
    try:
        line = script.first_line(SUBPROCESS_TIMEOUT)  # once the thread is stuck
        assert line.strip() == "exiting", (line, script.stderr.read_text())
        start = time.monotonic()
        try:
            result = script.wait(EXIT_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the interpreter did not exit within {EXIT_BOUND} s; stderr: {script.stderr.read_text()}")
    finally:
        script.kill()
    assert time.monotonic() - start < EXIT_BOUND
    err = result.stderr
    assert result.returncode == 0, err
    assert "RuntimeWarning: Collector.close: at interpreter exit the background thread did not stop within 2.0 s" in err
    assert "envs.step()" in err, err  # the call the thread is stuck in
    assert "reliability_envs.py" in err, err  # and where: the env's own code


# -- a second loop ---------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_iterating_a_finished_collector_again_raises(placement):
    """A second ``for`` loop over a collector that delivered all its batches is an error, not an empty loop."""
    envs, extra = envs_for(placement, FAULTY, 2)
    message = (
        "Collector: cannot iterate again: the collector already delivered all 3 batches of total_timesteps=24; "
        "create a new Collector"
    )
    options = dict(num_steps=4, device="cpu", total_timesteps=24, timeout=TIMEOUT, **placement, **extra)
    with Collector(envs, ConstantPolicy(), **options) as collector:
        assert sum(1 for _ in collector) == 3
        with pytest.raises(StopIteration):  # the iterator protocol: an exhausted iterator stays exhausted
            next(collector)
        with pytest.raises(RuntimeError, match=re.escape(message)):
            for _ in collector:
                pass
    close_envs(envs)
