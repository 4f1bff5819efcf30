"""The Ray placement: what only Ray actors can get wrong (the object store, deaths, restarts, whose Ray it is).

The batch contract itself (exactly once, weight versions, lag, spaces, the same
batches as the thread) and errors raised in a worker are tested for every
placement, Ray included, by the parametrized tests of the other modules. These
tests run against a real local Ray of 2 CPUs, started once for the session
(``placements.local_ray``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch
from test_consumer_interrupts import next_with_ctrl_c_at, sigint_raises_keyboard_interrupt  # noqa: F401 (a fixture)

from torch_rollout import Collector, Ray, Seed, gym_envs

from counting_env import TransitionCountingPolicy, counting_vec, make_seed_envs
from placements import local_ray
from reliability_envs import ConstantPolicy, take, wait_until

ray = pytest.importorskip("ray")

TIMEOUT = 60.0  # hang guard for next(); never reached when things work
TESTS = Path(__file__).resolve().parent
FAULTY = "torch_rollout_tests/Faulty-v0"
# How a Ray worker is named in errors: its index, actor, pid, node and envs.
WORKER = r"Ray worker (\d) \(actor [0-9a-f]+, pid (\d+), node [\d.]+, envs (\d+)\.\.(\d+)\)"


@pytest.fixture(scope="module", autouse=True)
def _local_ray():
    local_ray()


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


class PidPolicy(TransitionCountingPolicy):
    """TransitionCountingPolicy that also reports the pid of the process it runs in: which actor collected each row."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**super().forward(obs), "pid": torch.full((obs.shape[0],), os.getpid())}


# -- weights through the object store -----------------------------------------------------------


def test_one_ray_put_per_weight_refresh_and_a_lambda_recipe(monkeypatch):
    """Weights reach all workers through one object per refresh, not one pickled copy per worker.

    Ray pickles with cloudpickle: a lambda recipe works, unlike with worker processes.
    """
    put = ray.put
    arrays: list[int] = []

    def counting_put(value, **kwargs):
        if isinstance(value, np.ndarray):
            arrays.append(value.nbytes)
        return put(value, **kwargs)

    monkeypatch.setattr(ray, "put", counting_put)
    with Collector(
        lambda n: gymnasium.make_vec(FAULTY, n),
        ConstantPolicy(),
        num_envs=4,
        num_steps=4,
        total_timesteps=4 * 4 * 5,
        device="cpu",
        backend=Ray(2),
        timeout=TIMEOUT,
    ) as collector:
        assert len(list(collector)) == 5
        refreshes = collector.policy_version
    assert refreshes >= 5 and len(arrays) == refreshes
    assert set(arrays) == {64}  # ConstantPolicy's one float32 weight, in one aligned buffer


# -- errors and deaths -----------------------------------------------------------------------------


def test_killed_worker_is_named():
    """An actor whose process is SIGKILLed (from inside its env's step) is a RuntimeError, not a hang."""
    collector = Collector(
        gym_envs(FAULTY, fault="sigkill", at=6),
        ConstantPolicy(),
        num_envs=4,
        num_steps=4,
        backend=Ray(2),
        timeout=TIMEOUT,  # the bound: a TimeoutError would fail the test
    )
    with pytest.raises(RuntimeError) as info:
        for _ in take(collector):
            pass
    message = str(info.value)
    found = re.match(f"Collector: {WORKER} died while collecting \\(\\w+Error", message)
    assert found, message
    k, pid, first, last = map(int, found.groups())
    assert (first, last) == (2 * k, 2 * k + 1)
    assert wait_until(lambda: not alive(pid), 5.0)  # its process may still be exiting when Ray reports it
    assert message.endswith("Ray(num_workers, options={'max_restarts': n}) recreates a dead worker instead")
    assert collector.closed


def test_restart_policy_recreates_a_dead_worker_and_delivers_no_transition_twice(caplog):
    """max_restarts: a killed worker is recreated with new envs; its undelivered transitions are lost, none doubled."""
    T, N = 5, 4
    with Collector(
        counting_vec,
        PidPolicy(),
        num_envs=N,
        num_steps=T,
        total_timesteps=T * N * 6,
        backend=Ray(2, options={"max_restarts": 1}),
        timeout=TIMEOUT,
    ) as collector:
        batches = []
        for b, batch in enumerate(collector):
            batches.append(batch)
            if b == 1:
                os.kill(int(batch["pid"][0, 2]), signal.SIGKILL)  # worker 1's actor (envs 2 and 3)
    assert len(batches) == 6  # every batch was delivered, whole
    rows = torch.cat(batches)
    pid, obs, mask, reward = rows["pid"], rows["obs"], rows["mask"], rows["reward"]
    for i in range(N):
        first = pid[:, i] == pid[0, i]
        switch = int(first.sum())
        assert first[:switch].all()  # one actor, then (worker 1 only) the other: never back
        segments = [slice(0, switch)] + ([slice(switch, None)] if switch < len(first) else [])
        assert len(segments) == (2 if i >= 2 else 1)
        for segment in segments:
            # Each actor's envs count their real transitions 0, 1, 2, ...: none missing inside, none twice.
            got = reward[segment, i][mask[segment, i]]
            assert torch.equal(got, torch.arange(len(got), dtype=got.dtype)), (i, got)
        if i >= 2:
            assert switch >= 2 * T  # the batches delivered before the kill are kept
            assert obs[switch, i, 1] == 0 and obs[switch, i, 2] == 0  # new envs: episode 0, step 0
    assert any("recreating it, restart 1 of max_restarts=1" in r.getMessage() for r in caplog.records)


def test_a_restarted_worker_takes_the_next_part_of_its_ranks_seed_stream_and_the_state_counts_it():
    """Rank 1 of 2: env j starts at 10 + N + j; worker 1's first restart reseeds its envs as the first resume would
    (10 + 3N + j), never as another rank's start; the state counts that part, so a resume goes on past it."""
    T, N = 4, 4
    with Collector(
        make_seed_envs,
        PidPolicy(),
        num_envs=N,
        num_steps=T,
        seed=Seed(10, rank=1, world_size=2),
        backend=Ray(2, options={"max_restarts": 1}),
        timeout=TIMEOUT,
    ) as collector:
        first = next(collector)
        assert first["obs"][0, :, 0].tolist() == [10 + N + j for j in range(N)]
        os.kill(int(first["pid"][0, 2]), signal.SIGKILL)  # worker 1's actor (envs 2 and 3)
        rows = torch.cat([next(collector) for _ in range(3)])
        state = collector.state_dict()
    new = rows["pid"][:, 2] != first["pid"][0, 2]
    assert new.any(), "worker 1 was restarted"
    restarted = rows["obs"][new][:, 2:, 0]  # the new envs' rows: their seed
    assert (restarted == torch.tensor([10 + 3 * N + 2, 10 + 3 * N + 3])).all()
    assert rows["obs"][:, :2, 0].eq(10 + N + torch.arange(2)).all(), "worker 0 keeps its envs"
    assert state["starts"] == 2
    # A resumed rank 1 takes part 2: 10 + (2 * 2 + 1) * N + j, past what the restart used.
    with Collector(
        make_seed_envs, PidPolicy(), num_envs=N, num_steps=T, seed=Seed(10, rank=1, world_size=2), backend="thread"
    ) as resumed:
        resumed.load_state_dict(state)
        assert next(resumed)["obs"][0, :, 0].tolist() == [10 + 5 * N + j for j in range(N)]


def test_close_frees_the_actors_and_leaves_the_users_ray_running():
    """The session's Ray was initialised by the test (as a user would): the collector uses it and leaves it up."""
    cpus = ray.available_resources().get("CPU", 0)
    with Collector(
        counting_vec,
        PidPolicy(),
        num_envs=2,
        num_steps=3,
        backend=Ray(2, options={"num_cpus": 1}),
        timeout=TIMEOUT,
    ) as collector:
        pids = set(next(collector)["pid"].unique().tolist())
        assert len(pids) == 2 and os.getpid() not in pids
        assert wait_until(lambda: ray.available_resources().get("CPU", 0) == cpus - 2, 10.0)
    assert ray.is_initialized()
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 10.0)
    assert wait_until(lambda: ray.available_resources().get("CPU", 0) == cpus, 10.0)


def test_bad_ray_arguments_are_named():
    envs = gymnasium.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    with pytest.raises(TypeError, match=re.escape("Collector(backend='ray'): envs is a live SyncVectorEnv")):
        Collector(envs, ConstantPolicy(), num_steps=4, backend="ray")
    envs.close()
    with pytest.raises(
        TypeError,
        match=re.escape(
            "Collector: ray_options= is now backend=torch_rollout.Ray(num_workers=..., options={'num_cpus': 1})"
        ),
    ):
        Collector(FAULTY, ConstantPolicy(), num_envs=2, num_steps=4, backend="process", ray_options={"num_cpus": 1})
    with pytest.raises(ValueError, match=re.escape("Ray: options must be a dict of Ray actor options, got list")):
        Ray(2, options=["num_cpus"])
    with pytest.raises(ValueError, match=re.escape("Ray: options['max_restarts'] must be an int >= 0")):
        Ray(2, options={"max_restarts": -1})
    with pytest.raises(
        ValueError, match=re.escape("Collector: Ray(options={'num_cpu': 1}) are not valid Ray actor options")
    ):
        Collector(FAULTY, ConstantPolicy(), num_envs=2, num_steps=4, backend=Ray(options={"num_cpu": 1}))
    policy = ConstantPolicy()
    policy.lock = threading.Lock()
    with pytest.raises(TypeError, match=re.escape("cannot be pickled for Ray's workers")):
        Collector(FAULTY, policy, num_envs=2, num_steps=4, backend="ray")


# -- Ctrl-C, and a Ray of its own -------------------------------------------------------------------


def test_ctrl_c_at_points_of_next_drops_no_batch(sigint_raises_keyboard_interrupt):  # noqa: F811
    """Ctrl-C at points spread over next() (where Python can run a signal handler), the trainer carrying on."""
    T, N = 4, 2
    batches, k = [], 1
    with Collector(
        counting_vec,
        TransitionCountingPolicy(),
        num_envs=N,
        num_steps=T,
        backend=Ray(2),
        prefetch=1,
        timeout=TIMEOUT,
    ) as collector:
        while True:
            batch, points = next_with_ctrl_c_at(collector, k)
            # As a trainer would after Ctrl-C: carry on.
            batches.append(next(collector) if batch is None else batch)
            if points < k:  # went through: the points have had their interrupts
                break
            k += 1 + k // 4  # about 30 points, spread over a next() of about 1,600
        batches.append(next(collector))
    assert k > 100
    mask = torch.cat([b["mask"] for b in batches])
    reward = torch.cat([b["reward"] for b in batches])
    for i in range(N):  # TransitionCountingEnv's reward counts its real transitions: 0, 1, 2, ... with nothing missing
        got = reward[:, i][mask[:, i]]
        assert torch.equal(got, torch.arange(len(got), dtype=got.dtype)), f"env {i}: a batch was dropped"


SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
import ray
from test_ray import PidPolicy
from counting_env import counting_vec
from torch_rollout import Collector, Ray

if __name__ == "__main__":
    assert not ray.is_initialized()
    options = dict(num_envs=2, num_steps=8, backend=Ray(2))
    with Collector(counting_vec, PidPolicy(), total_timesteps=2 * 8 * 2, **options) as collector:
        print("first", len(list(collector)), flush=True)
    print("after close", ray.is_initialized(), flush=True)
    with Collector(counting_vec, PidPolicy(), **options) as collector:
        for i, batch in enumerate(collector):
            if i == 1:
                print("collecting", *batch["pid"].unique().tolist(), flush=True)
                time.sleep(600)
"""


def test_a_collector_starts_a_local_ray_keeps_it_for_the_next_and_ctrl_c_closes_everything():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SCRIPT).format(tests=str(TESTS))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        assert proc.stdout.readline() == "first 2\n"
        assert proc.stdout.readline() == "after close True\n"  # the Ray it started is kept for later collectors
        line = proc.stdout.readline()
        assert line.startswith("collecting "), line + proc.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 10.0)
