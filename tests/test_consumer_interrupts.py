"""The consumer side: the trainer raising or breaking, Ctrl-C, a dropped collector, interpreter exit.

In none of these may anything hang or outlive the collector: no thread, no
child process, no file descriptor. Ctrl-C and interpreter exit run in a
subprocess, the only place where they can be delivered for real.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

from reliability_envs import (
    GC_ARMED,
    GC_GO,
    ConstantPolicy,
    GcPolicy,
    Snapshot,
    collector_threads,
    faulty_fns,
    wait_until,
    warm_up_multiprocessing,
)
from torch_rollout import Collector

TIMEOUT = 60.0  # hang guard for next(); never reached when things work
SUBPROCESS_TIMEOUT = 180.0  # a fresh interpreter imports torch: slow on a loaded 2-core box
TESTS = Path(__file__).resolve().parent


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
        collector = Collector(envs, ConstantPolicy(), num_steps=8, device="cpu", prefetch=2, timeout=TIMEOUT)
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
            "torch_rollout_tests/Faulty-v0", GcPolicy(), num_envs=2, num_steps=8, device="cpu", prefetch=1,
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


def run_script(body: str, *args: str, interrupt: str | None = None) -> subprocess.CompletedProcess:
    """Runs PRELUDE + ``body`` in a fresh interpreter; ``interrupt`` sends SIGINT once it prints "ready".

    ``interrupt="pid"`` signals the process (``kill -INT``), ``"group"`` its whole
    process group with the AsyncVectorEnv workers, as Ctrl-C in a terminal does.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, so that "group" reaches nothing else
    )
    try:
        if interrupt is not None:
            line = proc.stdout.readline()  # blocks until the script is iterating (or dies)
            assert line.strip() == "ready", (line, proc.stderr.read() if proc.poll() is not None else "")
            if interrupt == "pid":
                os.kill(proc.pid, signal.SIGINT)
            else:
                os.killpg(proc.pid, signal.SIGINT)
            rest, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
            out = line + rest
        else:
            out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


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
def test_keyboard_interrupt_in_main_thread(vec, interrupt):
    result = run_script(INTERRUPTED, vec, interrupt=interrupt)
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
def test_interpreter_exit_with_running_collector(vec, how, envs):
    result = run_script(EXITING, vec, how, envs)
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
from reliability_envs import CountingEnv, CountingPolicy

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
    envs = VEC([partial(CountingEnv, i) for i in range(2)])
    collector = Collector(envs, CountingPolicy(), num_steps=4, device="cpu", prefetch=prefetch, timeout=120)
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


def test_keyboard_interrupt_storm_then_close():
    """150 KeyboardInterrupts at random points of next(), prefetch 0 and 2: no lock is left held
    (close() then deadlocked), and the batches that do arrive keep their order."""
    result = run_script(STORM, "sync")
    assert result.returncode == 0, result.stderr
    out = report(result.stdout)
    for prefetch in (0, 2):
        assert int(out[f"batches{prefetch}"]) >= 5
        assert out[f"threads{prefetch}"] == "0"
