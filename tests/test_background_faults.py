"""Faults in the background: env step/reset and policy raising, a killed worker process, a hung env.

Each test checks what issue 5 asks of every fault: the consumer gets an
exception naming the real cause within a bounded time (every collector has a
generous ``timeout`` so that a regression fails instead of hanging), no thread
or child process is left behind, and iterating the collector again is a clear
error.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import signal
import sys
import threading
import traceback
import warnings

import pytest
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv

from torch_rollout import Collector

from placements import PLACEMENTS, envs_for, local_ray, on_ray
from reliability_envs import (
    BLOCK_RELEASE,
    BlockingPolicy,
    ConstantPolicy,
    EnvFault,
    PolicyFault,
    RaisingPolicy,
    Snapshot,
    close_envs,
    collector_threads,
    faulty_fns,
    faulty_vec,
    make_vec,
    read_pid,
    take,
    wait_until,
    warm_up_multiprocessing,
)

# A hang guard, not a measurement: far above what any of these batches takes on a loaded 2-core box.
TIMEOUT = 60.0

# AsyncVectorEnv reports a worker's exception through gymnasium.logger.error, which calls
# warnings.warn; the suite turns warnings into errors, and that would replace the real error.
ASYNC_ERROR_LOG = pytest.mark.filterwarnings("ignore::UserWarning:gymnasium.vector.async_vector_env")


@pytest.fixture(autouse=True, scope="module")
def _warm_up():
    warm_up_multiprocessing()


def vec_id(cls: type) -> str:
    return cls.__name__


def frames(exc: BaseException) -> list[str]:
    return [frame.name for frame in traceback.extract_tb(exc.__traceback__)]


def assert_failed_for_good(collector: Collector, error: type[BaseException]) -> None:
    """The collector is closed, its thread gone, and a new iteration says why it cannot run."""
    assert collector.closed
    assert wait_until(lambda: not collector_threads(), TIMEOUT)
    message = f"cannot iterate after the background collection failed with {error.__name__}"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        next(collector)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        for _ in take(collector):
            pass


@pytest.mark.parametrize("cls", [SyncVectorEnv, AsyncVectorEnv], ids=vec_id)
@pytest.mark.parametrize("prefetch", [0, 2])
@ASYNC_ERROR_LOG
def test_env_step_raising_reaches_consumer(cls, prefetch):
    snapshot = Snapshot()
    envs = make_vec(cls, faulty_fns(3, 1, fault="step_raises", at=7))
    collector = Collector(envs, ConstantPolicy(), num_steps=4, device="cpu", prefetch=prefetch, timeout=TIMEOUT)
    delivered = 0
    with pytest.raises(EnvFault, match=re.escape("step 7 of env 1 failed")) as info:
        for _ in take(collector):
            delivered += 1
    # Step 7 falls in the second batch: the first one is delivered, nothing after the error.
    assert delivered == 1
    if cls is SyncVectorEnv:  # the original traceback, down to the env's step
        assert "step" in frames(info.value) and "collect" in frames(info.value)
    assert_failed_for_good(collector, EnvFault)
    envs.close()
    del envs, collector, info
    snapshot.assert_no_leaks()


@pytest.mark.parametrize(
    "cls, mode, at",
    [
        (SyncVectorEnv, AutoresetMode.NEXT_STEP, 1),  # the collector's first reset
        (SyncVectorEnv, AutoresetMode.NEXT_STEP, 2),  # an autoreset inside envs.step
        (SyncVectorEnv, AutoresetMode.SAME_STEP, 2),
        (SyncVectorEnv, AutoresetMode.DISABLED, 2),  # the collector's reset_mask reset
        (AsyncVectorEnv, AutoresetMode.NEXT_STEP, 1),
        (AsyncVectorEnv, AutoresetMode.SAME_STEP, 2),
        (AsyncVectorEnv, AutoresetMode.DISABLED, 2),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else getattr(x, "value", x),
)
@ASYNC_ERROR_LOG
def test_env_reset_raising_reaches_consumer(cls, mode, at):
    snapshot = Snapshot()
    envs = make_vec(cls, faulty_fns(2, 1, fault="reset_raises", at=at, episode_length=3), mode)
    collector = Collector(envs, ConstantPolicy(), num_steps=4, device="cpu", timeout=TIMEOUT)
    with pytest.raises(EnvFault, match=re.escape(f"reset {at} of env 1 failed")):
        for _ in take(collector):
            pass
    assert_failed_for_good(collector, EnvFault)
    envs.close()
    del envs, collector
    snapshot.assert_no_leaks()


@pytest.mark.parametrize("cls", [SyncVectorEnv, AsyncVectorEnv], ids=vec_id)
@pytest.mark.parametrize("placement", PLACEMENTS)
@ASYNC_ERROR_LOG
def test_env_raising_is_named_by_its_global_index(placement, cls):
    """Env 3 of 4 raises in its step; with two workers it is the second worker's env 1."""
    recipe = functools.partial(faulty_vec, cls=cls, faulty_index=3, fault="step_raises", at=7)
    envs, extra = envs_for(placement, recipe, 4)
    collector = Collector(envs, ConstantPolicy(), num_steps=4, device="cpu", timeout=TIMEOUT, **placement, **extra)
    with pytest.raises(EnvFault, match=re.escape("step 7 of env 3 failed")) as info:
        for _ in take(collector):
            pass
    assert getattr(info.value, "__notes__", [])[:1] == ["(raised by env 3)"]
    collector.close()
    close_envs(envs)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("at", [1, 9], ids=["first-call", "mid-rollout"])
def test_policy_raising_reaches_consumer(prefetch, at):
    snapshot = Snapshot()
    envs = SyncVectorEnv(faulty_fns(2))
    collector = Collector(envs, RaisingPolicy(at), num_steps=4, device="cpu", prefetch=prefetch, timeout=TIMEOUT)
    with pytest.raises(PolicyFault, match=f"policy call {at} failed") as info:
        for _ in take(collector):
            pass
    assert "forward" in frames(info.value)
    assert not getattr(info.value, "__notes__", [])  # no env is blamed for the policy's error
    assert_failed_for_good(collector, PolicyFault)
    envs.close()
    del envs, collector, info
    snapshot.assert_no_leaks()


@pytest.mark.parametrize("how", ["killed-by-test", "killed-in-step"])
def test_async_worker_sigkilled_mid_rollout(how):
    snapshot = Snapshot()
    if how == "killed-in-step":  # deterministic: the worker kills itself inside its 6th step
        envs = AsyncVectorEnv(faulty_fns(3, 1, fault="sigkill", at=6))
    else:
        envs = AsyncVectorEnv(faulty_fns(3))
    collector = Collector(envs, ConstantPolicy(), num_steps=4, device="cpu", prefetch=2, timeout=TIMEOUT)
    next(collector)
    victim = envs.processes[1].pid
    if how == "killed-by-test":
        os.kill(victim, signal.SIGKILL)
    expected = f"worker process 1 of the AsyncVectorEnv (pid {victim}) was killed by SIGKILL"
    with pytest.raises(RuntimeError, match=re.escape(expected)) as info:
        for _ in take(collector):  # an endless collector: only the error ends it
            pass
    # The pipe error that gymnasium would have shown is kept as the cause.
    assert isinstance(info.value.__cause__, (EOFError, OSError))
    assert_failed_for_good(collector, RuntimeError)
    # The broken vector env was shut down: no worker process left, and closing it is a no-op.
    assert envs.closed
    assert all(p.exitcode is not None for p in envs.processes)
    envs.close()
    del envs, collector, info
    snapshot.assert_no_leaks()


@pytest.fixture
def release_blocked_steps():
    BLOCK_RELEASE.clear()
    yield BLOCK_RELEASE
    BLOCK_RELEASE.set()  # whatever happened, no step stays blocked after the test


@pytest.mark.parametrize("owned", [False, True], ids=["user-envs", "env-id"])
def test_step_blocking_forever_times_out(release_blocked_steps, owned):
    snapshot = Snapshot()
    if owned:  # the collector builds and owns the envs: it must close them once the thread can stop
        envs = "torch_rollout_tests/FaultyBlockingAt3-v0"
        collector = Collector(
            envs, ConstantPolicy(), num_envs=2, num_steps=4, device="cpu", timeout=1.0, backend="thread"
        )
    else:
        envs = SyncVectorEnv(faulty_fns(2, 0, fault="step_blocks", at=3))
        collector = Collector(envs, ConstantPolicy(), num_steps=4, device="cpu", timeout=1.0)
    with pytest.raises(TimeoutError, match=re.escape("no batch within timeout=1.0 s; the env or the policy is stuck")):
        for _ in take(collector):
            pass
    assert collector.closed
    with pytest.raises(RuntimeError, match="cannot iterate after the background collection failed with TimeoutError"):
        next(collector)
    # A thread stuck in foreign code cannot be interrupted; it stops as soon as the call returns.
    assert len(collector_threads()) == 1
    assert not collector.envs.closed
    release_blocked_steps.set()
    assert wait_until(lambda: not collector_threads(), TIMEOUT)
    if owned:
        assert wait_until(lambda: collector.envs.closed, TIMEOUT)  # noqa: F821 (deleted below, after this runs)
    else:
        envs.close()
    del envs, collector
    snapshot.assert_no_leaks()


@pytest.mark.filterwarnings("ignore:.*Calling `close` while waiting for a pending call:UserWarning")
def test_async_step_blocking_forever_times_out():
    """The step blocks in a worker process for good; terminating the vector env frees everything."""
    snapshot = Snapshot()
    envs = AsyncVectorEnv(faulty_fns(2, 0, fault="step_blocks", at=3))
    collector = Collector(envs, ConstantPolicy(), num_steps=4, device="cpu", timeout=1.0)
    with pytest.raises(TimeoutError, match="no batch within timeout=1.0 s"):
        next(collector)
    with pytest.raises(RuntimeError, match="cannot iterate after the background collection failed with TimeoutError"):
        next(collector)
    envs.close(terminate=True)  # what a user does with a hung AsyncVectorEnv
    assert wait_until(lambda: not collector_threads(), TIMEOUT)
    del envs, collector
    snapshot.assert_no_leaks()


def async_envs_where_warnings_are_errors(num_envs: int, start_index: int = 0) -> VectorEnv:
    """FaultyEnvs in an AsyncVectorEnv, env 1 raising in its step 7, built where warnings are errors.

    In a worker process that is the worker's own setting (python -W error for it).
    """
    warnings.simplefilter("error")
    return faulty_vec(num_envs, start_index, cls=AsyncVectorEnv, faulty_index=1, fault="step_raises", at=7)


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_async_env_error_reaches_consumer_when_warnings_are_errors(placement):
    """gymnasium reports a worker's exception with warnings.warn before raising it; under -W error (this
    suite's setting) that warning would be raised instead. The user must get the env's exception."""
    with warnings.catch_warnings():
        envs, extra = envs_for(placement, async_envs_where_warnings_are_errors, 3)
        collector = Collector(envs, ConstantPolicy(), num_steps=4, device="cpu", timeout=TIMEOUT, **placement, **extra)
        try:
            with pytest.raises(EnvFault, match=re.escape("step 7 of env 1 failed")) as info:
                for _ in take(collector):
                    pass
        finally:
            collector.close()
            try:
                if not extra:
                    envs.close()  # no call left pending in the vector env: closing it warns of nothing
            except Warning:
                with warnings.catch_warnings():  # free the workers anyway, then fail
                    warnings.simplefilter("ignore")
                    envs.close(terminate=True)
                raise
    # The worker's traceback (the env's step) is shown with it, and the env is named.
    assert "reliability_envs.py" in "".join(traceback.format_exception(info.value))
    assert "(raised by env 1)" in getattr(info.value, "__notes__", [])


# Where a worker is killed (T = 4 steps a batch, one env per worker; prefetch=1 collects batch 2 ahead):
# (prefetch, the policy's call that blocks, the env step that blocks); "refresh": as "forward", but the
# trainer is already waiting in update_policy() for the worker's weights lock when the worker dies.
# The policy's 5th call acts on the observations after step 4: batch 1's next_value; its 6th is batch 2's.
KILL_POINTS = {
    "forward": (1, 6, None),  # inside its policy's forward pass of batch 2, holding its weights lock
    "refresh": (1, 6, None),
    "env_step": (1, None, 5),  # inside an env's step (the first of batch 2)
    "slot": (1, None, 8),  # batch 2's last env step: its slot written but for the last row's results
    "idle": (0, None, None),  # done with batch 1, waiting for the next request
}
WORKER_DEATH = {
    "process": r"Collector: worker process [01] \(pid {pid}, envs [01]\.\.[01]\) was killed by SIGKILL while "
    r"collecting",
    "ray": r"Collector: Ray worker [01] \(actor [0-9a-f]+, pid {pid}, node [\d.]+, envs [01]\.\.[01]\) died while "
    r"collecting",
}


def in_refresh(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside a placement's weight refresh."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "refresh":
            return True
        frame = frame.f_back
    return False


@pytest.mark.ray(point=("forward", "env_step", "idle"), timeout=(None,))
@pytest.mark.parametrize("timeout", [None, TIMEOUT], ids=["no-timeout", "timeout"])
@pytest.mark.parametrize("point", list(KILL_POINTS))
@pytest.mark.parametrize("placement", [param for param in PLACEMENTS if param.id in ("process2", "ray2")])
def test_a_worker_killed_at_any_point_is_reported_at_once(placement, point, timeout, tmp_path):
    """SIGKILL (the OOM killer's signal) to a worker, wherever it is: the next next() names it, without a hang."""
    prefetch, block_call, block_step = KILL_POINTS[point]
    backend = placement["backend"]
    if on_ray(placement):
        local_ray()
    marker = str(tmp_path / "inside")
    envs = functools.partial(
        faulty_vec,
        faulty_index=1,
        **({"fault": "step_blocks", "at": block_step, "marker": marker, "episode_length": 100} if block_step else {}),
    )
    collector = Collector(
        envs,
        BlockingPolicy(str(tmp_path), block_at=block_call),
        num_envs=2,
        num_steps=4,
        prefetch=prefetch,
        device="cpu",
        timeout=timeout,
        backend=backend,
    )
    outcome: list[BaseException | None] = []

    def second_next() -> None:
        try:
            next(collector)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=second_next, daemon=True)  # daemon: a regression fails instead of hanging
    try:
        next(collector)
        pid = read_pid(marker if point != "idle" else glob.glob(str(tmp_path / "pid-*"))[0])
        if point == "refresh":
            waiter.start()
            assert wait_until(lambda: in_refresh(waiter), TIMEOUT), "next() never asked for the worker's lock"
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
            waiter.start()
        waiter.join(5.0)
        assert not waiter.is_alive(), f"next() still waits 5 s after worker pid {pid} was killed ({point})"
    finally:
        if not waiter.is_alive():
            collector.close()
    (error,) = outcome
    assert isinstance(error, RuntimeError), error
    assert re.match(WORKER_DEATH[backend.name].format(pid=pid), str(error)), str(error)
    assert collector.closed
