"""The worker-process placement: what only processes can get wrong (recipes, shared memory, deaths, exits).

The batch contract itself (exactly once, weight versions, spaces) is tested for
every placement by the parametrized tests of the other modules.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import gymnasium
import pytest
import torch

from torch_rollout import Collector, Processes, gym_envs
from torch_rollout.envs._gym import RemoteTraceback

from counting_env import CountingPolicy, make_counting_envs
from placements import PLACEMENTS, local_ray, on_ray
from reliability_envs import ConstantPolicy, EnvFault, PolicyFault, RaisingPolicy, Snapshot, take, wait_until
from rowwise import RowwiseLinear

TIMEOUT = 60.0
TESTS = Path(__file__).resolve().parent
FAULTY = "torch_rollout_tests/Faulty-v0"
IMAGE = "torch_rollout_tests/Image-v0"


def descendants(pid: int | None = None) -> set[int]:
    """Every process below ``pid`` (default: this one), forkserver and its workers included."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                continue
    found, frontier = set(), {os.getpid() if pid is None else pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def workers() -> set[int]:
    """Live torch_rollout worker processes below this one: the fork server's children (a server forked from this
    process runs its command line), and any process that runs a fresh server's command line."""
    servers = _forkservers()
    alive = set()
    for pid in descendants():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state, parent = f.read().rpartition(")")[2].split()[:2]
        except OSError:
            continue
        if (int(parent) in servers or b"forkserver" in cmdline) and state != "Z" and pid not in servers:
            alive.add(pid)
    return alive


def _forkservers() -> set[int]:
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return set() if pid is None else {pid}


def shm_in_use(pids: set[int]) -> set[str]:
    """The /dev/shm entries that processes ``pids`` have mapped or open (named semaphores, shared memory).

    Only these: other processes on the machine (tests run in parallel) create and remove entries too.
    """
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                found |= {line.split()[-1] for line in f if " /dev/shm/" in line and "(deleted)" not in line}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/") and "(deleted)" not in target:
                    found.add(target)
        except OSError:  # it exited meanwhile
            continue
    return found


def shm_bytes() -> int:
    """Bytes of /dev/shm that this process holds: files it maps or has open, removed ones (torch's) included.

    Only this process's: other processes on the machine create and remove entries too.
    """
    sizes: dict[int, int] = {}  # inode -> bytes
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                sizes[int(fields[4])] = max(sizes.get(int(fields[4]), 0), end - start)
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/"):
                stat = os.stat(f"/proc/self/fd/{fd}")
                sizes[stat.st_ino] = max(sizes.get(stat.st_ino, 0), stat.st_size)
        except OSError:  # the directory listing's own descriptor, closed by now
            continue
    return sum(sizes.values())


def mapped_semaphores() -> set[str]:
    """Named semaphores this process has open (other processes' entries in /dev/shm do not count)."""
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "/dev/shm/sem." in line}


@pytest.fixture(autouse=True, scope="module")
def _warm_up():
    # The forkserver and multiprocessing's resource tracker live as long as this process: start them first.
    with Collector(FAULTY, ConstantPolicy(), num_envs=1, num_steps=2, backend="process", total_timesteps=2) as c:
        list(c)


def deterministic_cartpole_policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return CartPolePolicy()


class CartPolePolicy(torch.nn.Module):
    """Greedy over a fixed linear map: the same actions and values wherever it runs, bit for bit on any CPU
    (RowwiseLinear: a worker's share of the envs is valued row by row as the thread's call on all of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = RowwiseLinear(4, 3)

    def forward(self, obs):
        out = self.linear(obs)
        return {"action": out[:, :2].argmax(-1), "value": out[:, 2]}


# -- batches out of shared memory ------------------------------------------------------------------


def test_batches_are_not_overwritten_by_later_collection():
    """The slot a batch was copied from is reused prefetch + 1 batches later: the delivered copy keeps its rows."""
    recipe = functools.partial(make_counting_envs, start_index=0)
    with Collector(
        recipe,
        CountingPolicy(deterministic=True),
        num_envs=2,
        num_steps=5,
        total_timesteps=2 * 5 * 8,
        device="cpu",
        backend="process",
        prefetch=1,
        timeout=TIMEOUT,
    ) as collector:
        batches = list(collector)
        snapshots = [batch.clone() for batch in batches]
    for batch, snapshot in zip(batches, snapshots):
        assert (batch == snapshot).all()
    steps = torch.cat([b["obs"][..., 2] for b in batches])  # steps keep counting across batches
    assert len(set(map(tuple, torch.cat([b["obs"] for b in batches]).reshape(-1, 4).tolist()))) > 10
    assert steps.shape == (40, 2)


SMALL_SHM = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import torch
from reliability_envs import ConstantPolicy
from torch_rollout import Collector, Processes, gym_envs


def used():
    stat = os.statvfs("/dev/shm")
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def large_outputs(n):  # a policy output of 128 KiB per row, beyond the check's lower bound
    return {{"action": torch.zeros(n, dtype=torch.long), "features": torch.zeros(n, 2**17, dtype=torch.uint8)}}


def run(case, envs, policy, num_steps):
    start, before = time.monotonic(), used()
    result = {{"case": case}}
    try:
        collector = Collector(envs, policy, num_envs=4, num_steps=num_steps, backend=Processes(2), prefetch=1,
                              timeout=60.0, device="cpu")
    except RuntimeError as exc:
        return {{**result, "raised_by": "Collector", "error": str(exc), "seconds": time.monotonic() - start}}
    try:
        for _ in zip(range(2), collector):
            pass
        result["raised_by"] = None
    except RuntimeError as exc:
        result.update(raised_by="next", error=str(exc))
    collector.close()
    return {{**result, "kept_after_close": used() - before}}


if __name__ == "__main__":
    # The 8 MiB /dev/shm: 2 slots of [32, 4] rows of 64 KiB observations (16 MiB) do not fit; [16, 4] of 16 KiB do.
    print(json.dumps([
        run("slots", gym_envs("torch_rollout_tests/Image-v0", size=2**16), ConstantPolicy(), 32),
        run("fits", gym_envs("torch_rollout_tests/Image-v0", size=2**14), ConstantPolicy(), 16),
        run("outputs", "torch_rollout_tests/Faulty-v0", ConstantPolicy(make=large_outputs), 16),
    ]))
"""


def private_small_shm() -> bool:
    """Whether this machine lets a process mount its own 8 MiB tmpfs at /dev/shm (root, mount namespaces)."""
    command = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=8m tmpfs /dev/shm"]
    try:
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not private_small_shm(), reason="needs unshare -m and mount (root): a private 8 MiB /dev/shm")
def test_a_small_dev_shm_is_refused_by_the_constructor_with_the_fixes(tmp_path):
    """In a private mount namespace whose /dev/shm is an 8 MiB tmpfs (Docker gives 64 MB), as a real script."""
    script = tmp_path / "small_shm.py"
    script.write_text(textwrap.dedent(SMALL_SHM).format(tests=str(TESTS)))
    command = f"mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} {script}"
    proc = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    slots, fits, outputs = json.loads(proc.stdout.splitlines()[-1])

    # Refused before any batch is collected: the constructor raises, with the numbers and the fixes.
    assert slots["raised_by"] == "Collector", slots
    assert slots["seconds"] < 60.0  # no wait for a batch: only the workers' start, even on a loaded 2-core machine
    needed = 2 * 32 * 4 * (2**16 + 8 + 28)  # slots x T x N x (obs + int64 action + the collector's keys)
    message = slots["error"]
    assert (
        f"the batch slots (2 per worker for prefetch=1, x 32 steps x 4 envs x {2**16 + 36:,} bytes per row" in message
    )
    assert f"need at least {needed:,} bytes (16.0 MiB) of shared memory, but /dev/shm has only " in message
    assert "free of 8.0 MiB" in message and "docker run --shm-size=" in message
    assert "num_steps * num_envs" in message and "prefetch=0" in message and "backend='thread'" in message

    # Slots that fit are used, and close() gives back every byte of /dev/shm (the workers' too).
    assert fits["raised_by"] is None, fits
    assert fits["kept_after_close"] == 0

    # Policy outputs that the check cannot foresee: the worker that cannot allocate its slots says the same.
    assert outputs["raised_by"] == "next", outputs
    assert "batch slots of " in outputs["error"] and "the policy's outputs included" in outputs["error"]
    assert "docker run --shm-size=" in outputs["error"] and "backend='thread'" in outputs["error"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="the check needs /dev/shm (Linux)")
@pytest.mark.parametrize("free", [0, 2**20], ids=["no-room-for-weights", "no-room-for-slots"])
def test_a_small_dev_shm_is_refused_before_the_workers_collect(monkeypatch, free):
    """/dev/shm's free space faked in the trainer: its check, not torch's allocation, refuses the collector."""
    statvfs = os.statvfs

    def fake(path):
        real = statvfs(path)
        if os.path.realpath(path) != "/dev/shm":
            return real
        return types.SimpleNamespace(f_bavail=free // real.f_frsize, f_frsize=real.f_frsize, f_blocks=real.f_blocks)

    monkeypatch.setattr(os, "statvfs", fake)
    needed = 2 * 8 * 4 * (2**16 + 8 + 28)  # 2 slots of [8, 4] rows of 64 KiB observations: 4 MiB
    what = "the policy's weights" if free == 0 else "the batch slots (2 per worker for prefetch=1, x 8 steps x 4 envs"
    with pytest.raises(RuntimeError, match=re.escape(f"Collector(backend='process'): {what}")) as info:
        Collector(gym_envs(IMAGE, size=2**16), ConstantPolicy(), num_envs=4, num_steps=8, backend=Processes(2))
    assert f"but /dev/shm has only {free:,} bytes" in str(info.value)
    if free:
        assert f"need at least {needed:,} bytes (4.0 MiB)" in str(info.value)
    assert wait_until(lambda: not workers(), 5.0)
    monkeypatch.undo()
    # At least: what the check counts is no more than what a batch stores without the policy's outputs (done is the
    # loop's own, in every slot).
    with Collector(gym_envs(IMAGE, size=2**16), ConstantPolicy(), num_envs=4, num_steps=8, backend="thread") as c:
        batch = next(c)
    assert needed // 2 <= batch.exclude("value", "next_value", "advantage", "return").bytes()


# -- recipes and arguments -------------------------------------------------------------------------


def test_bad_recipes_and_arguments_are_named():
    envs = gymnasium.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    with pytest.raises(TypeError, match=re.escape("Collector(backend='process'): envs is a live SyncVectorEnv")):
        Collector(envs, CartPolePolicy(), num_steps=4, backend="process")
    envs.close()
    with pytest.raises(
        TypeError, match=r"Collector: envs=<function .*<lambda>.* cannot be pickled for a worker process"
    ):
        Collector(
            lambda n: gymnasium.make_vec("CartPole-v1", n), CartPolePolicy(), num_envs=2, num_steps=4, backend="process"
        )

    class Local(torch.nn.Module):
        def forward(self, obs):
            return {"action": torch.zeros(obs.shape[0], dtype=torch.long)}

    with pytest.raises(TypeError, match=re.escape("Collector: policy=Local() cannot be pickled for a worker process")):
        Collector("CartPole-v1", Local(), num_envs=2, num_steps=4, backend="process")
    with pytest.raises(ValueError, match=re.escape("Collector: num_workers=3 is more than num_envs=2")):
        Collector("CartPole-v1", CartPolePolicy(), num_envs=2, num_steps=4, backend=Processes(3))
    with pytest.raises(
        TypeError, match=re.escape("Collector: num_workers= is now backend=torch_rollout.Processes(num_workers=2)")
    ):
        Collector("CartPole-v1", CartPolePolicy(), num_envs=2, num_steps=4, backend="thread", num_workers=2)
    with pytest.raises(ValueError, match=re.escape("Processes: num_workers must be an int >= 1, got 0")):
        Processes(0)
    with pytest.raises(
        ValueError,
        match=re.escape("Collector: backend must be one of ['auto', 'thread', 'process', 'ray'], got 'dask'"),
    ):
        Collector("CartPole-v1", CartPolePolicy(), num_envs=2, num_steps=4, backend="dask")
    with pytest.raises(
        TypeError, match=re.escape("Collector: env_kwargs= is now envs=torch_rollout.gym_envs(env_id, **{'x': 1})")
    ):
        Collector(make_counting_envs, CartPolePolicy(), num_envs=2, num_steps=4, env_kwargs={"x": 1})


@pytest.mark.parametrize(
    "backend, expected",
    [("auto", ("process", 1)), ("thread", ("thread", 1)), (Processes(num_workers=2), ("process", 2))],
    ids=["auto", "thread", "Processes(2)"],
)
def test_backend_names_the_placement_chosen_and_is_read_only(backend, expected):
    with Collector(
        make_counting_envs, CountingPolicy(), num_envs=2, num_steps=4, device="cpu", backend=backend
    ) as collector:
        assert (collector.backend, collector.num_workers) == expected
        with pytest.raises(AttributeError):
            collector.backend = "thread"
        assert collector.backend == expected[0]


def test_auto_chooses_processes_for_a_cpu_policy_with_a_recipe_else_the_thread():
    with Collector("CartPole-v1", CartPolePolicy(), num_envs=2, num_steps=4, device="cpu") as collector:
        assert (collector.backend, collector.prefetch) == ("process", 1)
    envs = gymnasium.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    with Collector(envs, CartPolePolicy(), num_steps=4, device="cpu") as collector:
        assert (collector.backend, collector.prefetch) == ("thread", 0)  # lockstep: the GIL is shared
    with Collector(lambda n: make_counting_envs(n), CountingPolicy(), num_envs=2, num_steps=4, device="cpu") as c:
        assert c.backend == "thread"  # a lambda cannot reach a worker
    envs.close()


def test_env_kwargs_reach_every_worker():
    with Collector(
        gym_envs(FAULTY, episode_length=2),
        ConstantPolicy(),
        num_envs=4,
        num_steps=3,
        backend=Processes(2),
        total_timesteps=4 * 3 * 2,
        timeout=TIMEOUT,
    ) as collector:
        batch = torch.cat(list(collector))
    assert (batch["episode_length"][batch["done"]] == 2).all() and batch["done"].any()


def test_env_registered_only_in_the_trainer_is_explained():
    gymnasium.register("TorchRolloutTrainerOnly-v0", entry_point="reliability_envs:FaultyEnv")
    with pytest.raises(
        ValueError, match=re.escape("Collector: unknown env id envs='TorchRolloutTrainerOnly-v0'")
    ) as info:
        Collector("TorchRolloutTrainerOnly-v0", ConstantPolicy(), num_envs=2, num_steps=4, backend="process")
    assert "module:EnvName-v0" in str(info.value)


# -- faults ----------------------------------------------------------------------------------------


# The placements whose envs run in other processes (worker processes, Ray actors): all but the thread.
WORKER_PLACEMENTS = [param for param in PLACEMENTS if param.id != "thread"]
# How a remote traceback names its worker, per placement.
PROCESS_WORKER = r"in worker [01] \(pid \d+\)"
RAY_WORKER = r"in Ray worker \d \(actor [0-9a-f]+, pid \d+, node [\d.]+, envs \d+\.\.\d+\)"
NAMED = {"process1": PROCESS_WORKER, "process2": PROCESS_WORKER, "ray2": RAY_WORKER}
WORKER_PLACEMENTS_NAMED = [
    pytest.param(param.values[0], NAMED[param.id], id=param.id, marks=param.marks) for param in WORKER_PLACEMENTS
]


def uniform_draws(n: int) -> dict:
    """A value drawn from torch's generator per env: what a sampling policy's noise looks like."""
    return {"action": torch.zeros(n, dtype=torch.long), "value": torch.rand(n)}


@pytest.mark.ray
@pytest.mark.parametrize("placement", [PLACEMENTS[2], PLACEMENTS[3]])  # two workers, processes and Ray
def test_each_worker_samples_from_its_own_stream_fixed_by_the_trainers_seed(placement):
    """Workers forked from one server would draw the same numbers; each gets a seed from torch.manual_seed."""
    if on_ray(placement):
        local_ray()

    def draws() -> torch.Tensor:
        torch.manual_seed(7)
        options = dict(num_envs=2, num_steps=5, total_timesteps=20, timeout=TIMEOUT, prefetch=0, **placement)
        with Collector(FAULTY, ConstantPolicy(uniform_draws), **options) as collector:
            return torch.cat([batch["value"] for batch in collector])

    first, second = draws(), draws()
    assert not torch.equal(first[:, 0], first[:, 1])  # env 0 is worker 0's, env 1 worker 1's
    assert torch.equal(first, second)  # the trainer's torch.manual_seed fixes both streams


@pytest.mark.ray
@pytest.mark.parametrize("placement, named", WORKER_PLACEMENTS_NAMED)
def test_env_error_in_a_worker_reaches_next_with_its_traceback(placement, named):
    if on_ray(placement):
        local_ray()  # its workers import the tests' env modules
    snapshot = Snapshot()
    collector = Collector(
        gym_envs(FAULTY, fault="step_raises", at=7),
        ConstantPolicy(),
        num_envs=2,
        num_steps=4,
        timeout=TIMEOUT,
        **placement,
    )
    delivered = 0
    with pytest.raises(EnvFault, match=re.escape("step 7 of env 0 failed")) as info:
        for _ in take(collector):
            delivered += 1
    assert delivered == 1  # step 7 falls in the second batch
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert re.search(named, str(cause)) and "in step" in str(cause) and "EnvFault" in str(cause)
    assert collector.closed
    with pytest.raises(RuntimeError, match="cannot iterate after the background collection failed with EnvFault"):
        next(collector)
    del collector, info, cause
    if not on_ray(placement):  # Ray keeps its own pool of worker processes
        assert wait_until(lambda: not workers(), 5.0)
        snapshot.assert_no_leaks()


@pytest.mark.ray
@pytest.mark.parametrize("placement, named", WORKER_PLACEMENTS_NAMED)
def test_policy_error_in_a_worker_reaches_next(placement, named):
    if on_ray(placement):
        local_ray()  # its workers import the tests' policy modules
    with pytest.raises(PolicyFault, match=re.escape("policy call 6 failed")) as info:
        with Collector(FAULTY, RaisingPolicy(6), num_envs=2, num_steps=4, timeout=TIMEOUT, **placement) as c:
            list(take(c))
    assert "in forward" in str(info.value.__cause__)
    assert re.search(named, str(info.value.__cause__))


@pytest.mark.ray
@pytest.mark.parametrize("placement", WORKER_PLACEMENTS)
def test_error_while_building_envs_is_raised_by_the_constructor_and_in_the_first_reset_by_next(placement):
    """The workers build their envs at construction, but reset them at the first batch only."""
    if on_ray(placement):
        local_ray()  # its workers import the tests' env modules
    kwargs = dict(num_envs=2, num_steps=4, timeout=TIMEOUT, **placement)
    with pytest.raises(TypeError, match="unexpected keyword argument 'episode_lenght'"):
        Collector(gym_envs(FAULTY, episode_lenght=5), ConstantPolicy(), **kwargs)
    collector = Collector(gym_envs(FAULTY, fault="reset_raises"), ConstantPolicy(), **kwargs)
    with pytest.raises(EnvFault, match=re.escape("reset 1 of env 0 failed")):
        next(collector)
    assert collector.closed
    if not on_ray(placement):  # Ray keeps its own pool of worker processes
        assert wait_until(lambda: not workers(), 5.0)


def test_worker_killed_with_sigkill_is_named():
    snapshot = Snapshot()
    collector = Collector(
        gym_envs(FAULTY, fault="sigkill", at=6),
        ConstantPolicy(),
        num_envs=4,
        num_steps=4,
        backend=Processes(2),
    )
    with pytest.raises(RuntimeError) as info:
        for _ in take(collector):
            start = time.monotonic()
    assert time.monotonic() - start < 5.0  # noticed at once (the pipe and the process sentinel), not by a timeout
    message = str(info.value)
    assert re.search(r"Collector: worker process [01] \(pid \d+, envs [02]\.\.[13]\) was killed by SIGKILL", message)
    assert wait_until(lambda: not workers(), 5.0)
    del collector, info
    snapshot.assert_no_leaks()


def test_step_blocking_forever_times_out_and_the_workers_are_terminated():
    collector = Collector(
        "torch_rollout_tests/FaultyBlockingAt3-v0",
        ConstantPolicy(),
        num_envs=2,
        num_steps=4,
        backend="process",
        timeout=1.0,
    )
    with pytest.raises(TimeoutError, match=re.escape("no batch within timeout=1.0 s; the env or the policy is stuck")):
        next(collector)
    assert collector.closed
    assert wait_until(lambda: not workers(), 5.0)


def test_30_create_iterate_close_cycles_leave_nothing_behind():
    """The comparisons are exact: one worker, thread, descriptor or semaphore left by any cycle fails the test.
    The close path and the number of workers repeat every 6 cycles, so each combination runs 5 times."""
    snapshot = Snapshot()
    semaphores = mapped_semaphores()
    for i in range(30):
        options = dict(num_envs=2, num_steps=4, backend=Processes(1 + i % 2), timeout=TIMEOUT)
        if i % 3 == 0:
            with Collector(FAULTY, ConstantPolicy(), total_timesteps=2 * 4 * 2, **options) as collector:
                list(collector)
        elif i % 3 == 1:
            collector = Collector(FAULTY, ConstantPolicy(), **options)
            next(collector)
            collector.close()
        else:
            collector = Collector(FAULTY, ConstantPolicy(), **options)
            next(collector)
            del collector  # dropped without close()
    assert wait_until(lambda: not workers(), 10.0)
    snapshot.assert_no_leaks()
    assert mapped_semaphores() <= semaphores  # the workers' locks are released with their collectors


def test_close_frees_the_shared_memory_at_once():
    """20 collectors one after the other, each closed but still referenced, the garbage collector off: after each
    close() this process holds no more of /dev/shm than before it (its delivered batch is a copy)."""
    slot = 8 * 4 * 2**16  # bytes of the observations of one [8, 4] batch: 2 MiB
    gc.collect()
    baseline = shm_bytes()
    gc.disable()  # freed by close() itself, not by a later collection of reference cycles
    try:
        for i in range(20):
            collector = Collector(
                gym_envs(IMAGE, size=2**16),
                ConstantPolicy(),
                num_envs=4,
                num_steps=8,
                backend=Processes(1 + i % 2),
                prefetch=1,
                timeout=TIMEOUT,
            )
            batch = next(collector)
            held = shm_bytes() - baseline
            collector.close()
            left = shm_bytes() - baseline
            assert held >= slot, f"collector {i}: the measure does not see its slots ({held} bytes)"
            assert left <= 64 * 1024, (
                f"collector {i} ({collector.num_workers} workers): {left} bytes kept after close()"
            )
            assert batch["obs"].shape == (8, 4, 2**16)
    finally:
        gc.enable()


# -- the trainer's process: Ctrl-C and SIGKILL ------------------------------------------------------

SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from reliability_envs import ConstantPolicy
from torch_rollout import Collector, Processes

if __name__ == "__main__":
    collector = Collector("torch_rollout_tests/Faulty-v0", ConstantPolicy(pause=0.01), num_envs=4, num_steps=16,
                          backend=Processes(2))
    with collector:
        for i, batch in enumerate(collector):
            if i == 1:
                print("collecting", flush=True)
                {action}
"""


def run_trainer(action: str) -> tuple[subprocess.Popen, set[int]]:
    """Starts a trainer script in its own process group; returns it and its workers once it collects."""
    script = textwrap.dedent(SCRIPT).format(tests=str(TESTS), action=action)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline() == "collecting\n"
    return proc, descendants(proc.pid)


def test_trainer_killed_with_sigkill_takes_its_workers_and_shared_memory_along():
    proc, children = run_trainer("time.sleep(600)")
    assert len(children) >= 3  # the forkserver and two workers at least
    used = shm_in_use({proc.pid, *children})
    assert any(path.startswith("/dev/shm/sem.") for path in used)  # the workers' weight locks at least
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    gone = wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in children), 5.0)
    assert gone, (
        f"still alive 5 s after the trainer was killed: {[p for p in children if os.path.exists(f'/proc/{p}')]}"
    )
    left = lambda: {path for path in used if os.path.exists(path)}  # noqa: E731
    assert wait_until(lambda: not left(), 5.0), f"left in /dev/shm: {left()}"


def test_ctrl_c_in_the_trainer_closes_everything():
    proc, children = run_trainer("time.sleep(600)")
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert "Traceback" not in err.split("KeyboardInterrupt")[-1]  # nothing after the interrupt's own report
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in children), 5.0)


# -- the trainer's script, as worker processes import it ---------------------------------------------

# A trainer whose policy class lives in __main__: its backend="auto" collector, then an explicit "process" one.
DEFINE = """
import dataclasses, json, sys, time
import torch
from torch_rollout import Collector


@dataclasses.dataclass(frozen=True)
class Settings:  # its methods are all made by dataclasses, from code of its own
    actions: int = 2


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.settings = Settings()

    def forward(self, obs):
        return {"action": torch.zeros(obs.shape[0], dtype=torch.long)}
"""
RUN = """
with Collector("CartPole-v1", Policy(), num_envs=2, num_steps=4, total_timesteps=8, device="cpu") as auto:
    result = {"auto": auto.backend, "batches": len(list(auto)), "error": None}
start = time.monotonic()
try:
    with Collector("CartPole-v1", Policy(), num_envs=2, num_steps=4, device="cpu", backend="process") as explicit:
        next(explicit)
except TypeError as exc:
    result.update(error=str(exc), seconds=time.monotonic() - start)
print(json.dumps(result))
"""
GUARD = 'if __name__ == "__main__":\n'
# How each way of running the trainer names the cause; None: worker processes can import it.
UNIMPORTABLE = {
    "stdin": "the trainer's __main__ was read from '<stdin>' (python - or a pipe), not from a file, and worker "
    "processes start by running __main__ again from its file: save the script to a file and run that",
    "exec": "policy uses class Policy of __main__, which the script '{script}' does not define outside 'if __name__ == "
    "\"__main__\":' (code exec'd into __main__, or a definition under the guard): worker processes run the script "
    "again to import __main__ and would not find it; define it in a module that you import",
    "command": "policy uses class Policy of __main__, defined in an interactive __main__ (a notebook, the REPL or "
    "python -c), which worker processes cannot import; define it in a module that you import",
    "under-the-guard": "policy uses class Policy of __main__, which the script '{script}' does not define outside",
    "file": None,
}


@pytest.mark.parametrize("how", list(UNIMPORTABLE))
def test_a_main_that_worker_processes_cannot_import_gets_the_thread_or_a_clear_error(tmp_path, how):
    """python - (stdin), code exec'd into the __main__ of a runner script, python -c, a class defined under the
    guard: "auto" takes the thread, and backend="process" is refused at once by a TypeError naming the cause (not
    by a worker's death). A script file that defines them at its top level gets worker processes."""
    code = textwrap.dedent(DEFINE) + GUARD + textwrap.indent(textwrap.dedent(RUN), "    ")
    script = tmp_path / "train.py"
    if how == "exec":
        script.write_text(f"{GUARD}    exec(compile({code!r}, '<string>', 'exec'))\n")
    elif how == "under-the-guard":
        script.write_text(GUARD + textwrap.indent(textwrap.dedent(DEFINE) + textwrap.dedent(RUN), "    "))
    else:
        script.write_text(code)
    command = {"stdin": ["-"], "command": ["-c", code]}.get(how, [str(script)])
    stdin = code if how == "stdin" else None
    proc = subprocess.run([sys.executable, *command], input=stdin, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    cause = UNIMPORTABLE[how]
    if cause is None:
        assert (result["auto"], result["batches"], result["error"]) == ("process", 1, None)
        return
    assert (result["auto"], result["batches"]) == ("thread", 1)
    assert result["error"].startswith("Collector(backend='process'): ")
    assert cause.format(script=script) in result["error"]
    assert result["seconds"] < 1.0  # before any worker process is started


NO_GUARD = """
import sys, time
sys.path.insert(0, {tests!r})
from reliability_envs import ConstantPolicy
from torch_rollout import Collector


def report(*exc_info, start=time.monotonic()):
    print(f"raised after {{time.monotonic() - start:.3f}} s", file=sys.stderr)
    sys.__excepthook__(*exc_info)


sys.excepthook = report
{body}
"""
COLLECTOR = 'Collector("CartPole-v1", ConstantPolicy(), num_envs=2, num_steps=4, device="cpu")'
UNGUARDED = {
    # Seen in the script's source: refused by the constructor, before any worker starts.
    "top-level": (
        f"collector = {COLLECTOR}\nnext(collector)",
        "the script {script} creates this Collector at line {line}, outside an 'if __name__ == \"__main__\":' "
        "block; worker processes import the trainer's __main__ script again, and would run that line too",
    ),
    # Inside a try the source cannot tell: the worker that dies importing the script is explained.
    "in-a-try": (
        f"try:\n    {COLLECTOR}\nfinally:\n    pass",
        "before its envs were built; its traceback is on stderr. Worker processes import the trainer's __main__ "
        "script again",
    ),
}


@pytest.mark.parametrize("where", list(UNGUARDED))
def test_script_without_main_guard_is_explained(tmp_path, where):
    body, cause = UNGUARDED[where]
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(NO_GUARD).format(tests=str(TESTS), body=body))
    line = script.read_text().splitlines().index(body.splitlines()[0]) + 1
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert cause.format(script=script, line=line) in proc.stderr
    assert """must sit under 'if __name__ == "__main__":' (or pass backend='thread')""" in proc.stderr
    # From the script's start (just before the Collector call) to the error: in the source, at once; else after the
    # forkserver's and a worker's start, which take seconds on a loaded 2-core machine.
    seconds = float(re.search(r"raised after ([\d.]+) s", proc.stderr).group(1))
    assert seconds < (1.0 if where == "top-level" else 60.0)


# A script that is edited while it runs (a sweep's queued job, a user's change): six comment lines inserted above
# its guarded Collector before the trainer reaches it.
EDITED = """
import sys
from pathlib import Path

sys.path.insert(0, {tests!r})
from reliability_envs import ConstantPolicy
from torch_rollout import Collector, Processes

if __name__ == "__main__":
    script = Path(__file__)
    script.write_text("# an edit\\n" * 6 + script.read_text())
    with Collector("CartPole-v1", ConstantPolicy(), num_envs=2, num_steps=4, backend=Processes(1), device="cpu") as c:
        print("batch of", next(c).batch_size.numel(), "rows", flush=True)
"""


def test_a_script_edited_while_it_runs_is_not_mistaken_for_one_without_the_guard(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(EDITED).format(tests=str(TESTS)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "batch of 8 rows\n"
    assert script.read_text().startswith("# an edit\n" * 6)
