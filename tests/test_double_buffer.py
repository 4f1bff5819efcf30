"""Double-buffered collection (``double_buffered(envs)``): two groups of AsyncVectorEnv, one stepping while the
policy acts on the other; the batches must be those of one vector env, in every placement."""

from __future__ import annotations

import re
import traceback
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from torch_rollout import BatchKeys, Collector, DoubleBufferedVectorEnv, Processes, double_buffered, gym_envs

from counting_env import CountingEnv, CountingPolicy, make_async_counting_envs, make_counting_envs
from placements import PLACEMENTS, local_ray, on_ray
from reliability_envs import ConstantPolicy, EnvFault, faulty_vec

TIMEOUT = 60.0  # hang guard for next(); never reached when things work
N, T, BATCHES = 4, 5, 4
LOCAL = [param for param in PLACEMENTS if not on_ray(param.values[0])][:2]  # thread, process1


def collect(envs, placement, *, num_envs=N, batches=BATCHES, policy=None, **kwargs):
    if on_ray(placement):
        local_ray()
    with Collector(
        envs,
        policy or CountingPolicy(deterministic=True),
        num_envs=num_envs,
        num_steps=T,
        total_timesteps=batches * T * num_envs,
        device="cpu",
        timeout=TIMEOUT,
        **placement,
        **kwargs,
    ) as collector:
        return list(collector)


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for b, (a, e) in enumerate(zip(got, expected)):
        keys = set(e.keys(True, True)) - {"policy_version"}  # when a row was acted differs; what it holds may not
        assert set(a.keys(True, True)) - {"policy_version"} == keys
        for key in keys:
            assert torch.equal(a[key], e[key]), f"batch {b}, key {key}"


@pytest.mark.ray(prefetch=(1,))
@pytest.mark.parametrize("prefetch", [0, 1, 3], ids=lambda p: f"prefetch{p}")
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_batches_are_those_of_one_vector_env(placement, prefetch):
    """Every transition once and in order, episode ends (terminated and truncated) across batch boundaries,
    bootstrap values, episode totals: all as CountingEnvs in one SyncVectorEnv give them."""
    expected = collect(partial(make_counting_envs, mode=AutoresetMode.NEXT_STEP), placement, prefetch=prefetch)
    got = collect(double_buffered(make_async_counting_envs), placement, prefetch=prefetch)
    assert_same_batches(got, expected)
    assert sum(int(batch["done"].sum()) for batch in got) >= 4  # episode ends were crossed


@pytest.mark.parametrize("placement", [PLACEMENTS[0], PLACEMENTS[2]])  # thread, process2
def test_an_env_id_is_made_async_and_every_env_gets_its_seed(placement):
    """CartPole by its id: the groups are AsyncVectorEnvs, and env j is reset with seed + j."""
    policy = CartPoleRecentre()
    kwargs = dict(num_envs=8, policy=policy, seed=11, batches=2)
    expected = collect(gym_envs("CartPole-v1", vectorization_mode="sync"), placement, **kwargs)
    got = collect(double_buffered("CartPole-v1"), placement, **kwargs)
    assert_same_batches(got, expected)
    assert len(set(got[0]["obs"][0, :, 0].tolist())) == 8  # eight different seeds


class CartPoleRecentre(torch.nn.Module):
    def forward(self, obs):
        return {"action": (obs[:, 2] > 0).long(), "value": obs.sum(-1)}


def test_a_resumed_collector_continues_as_without_double_buffering():
    """load_state_dict reseeds the envs: the groups are drained of the steps left in flight, then reset."""

    def resumed(envs):
        options = dict(num_envs=8, num_steps=T, device="cpu", seed=4, backend="thread", timeout=TIMEOUT)
        with Collector(envs, CartPoleRecentre(), **options) as first:
            next(first)
            next(first)
            state = first.state_dict()
        with Collector(envs, CartPoleRecentre(), **options) as second:
            second.load_state_dict(state)
            return [next(second), next(second)]

    expected = resumed(gym_envs("CartPole-v1", vectorization_mode="sync"))
    assert_same_batches(resumed(double_buffered("CartPole-v1")), expected)


class InfoCountingEnv(CountingEnv):
    """CountingEnv whose step infos hold the step's count in the episode, and whether it ended one."""

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, {"t": self.t, "ended": terminated or truncated}


def info_envs(num_envs, start_index=0, cls=SyncVectorEnv):
    return cls([partial(InfoCountingEnv, start_index + i) for i in range(num_envs)])


def test_infos_are_those_of_each_rows_step():
    keys = BatchKeys(info_keys=("t", "ended"))
    expected = collect(info_envs, {"backend": "thread"}, prefetch=1, keys=keys)
    got = collect(double_buffered(partial(info_envs, cls=AsyncVectorEnv)), {"backend": "thread"}, prefetch=1, keys=keys)
    assert_same_batches(got, expected)
    assert int(got[-1]["info", "ended"].sum()) >= 1


def test_the_groups_can_be_given_as_a_live_vector_env_and_are_closed_with_the_collector():
    groups = [make_async_counting_envs(2, start_index=2 * g) for g in range(2)]
    envs = DoubleBufferedVectorEnv(groups)
    expected = collect(partial(make_counting_envs, mode=AutoresetMode.NEXT_STEP), {"backend": "thread"}, prefetch=1)
    with Collector(
        envs,
        CountingPolicy(deterministic=True),
        num_steps=T,
        total_timesteps=BATCHES * T * N,
        device="cpu",
        prefetch=1,
        backend="thread",
        timeout=TIMEOUT,
    ) as collector:
        got = list(collector)
    assert_same_batches(got, expected)
    envs.close()
    assert all(group.closed for group in groups)
    assert not any(process.is_alive() for group in groups for process in group.processes)


def test_reset_and_step_step_every_group_as_one_vector_env():
    """Outside the collector it is a vector env like any other: reset and step concatenate the groups."""
    envs = DoubleBufferedVectorEnv([make_async_counting_envs(2, start_index=2 * g) for g in range(2)])
    reference = make_counting_envs(4)
    try:
        for got, expected in ((envs.reset(seed=1), reference.reset(seed=1)),):
            np.testing.assert_array_equal(got[0], expected[0])
        for _ in range(9):
            action = np.array([0, 1, 2, 1])
            got, expected = envs.step(action), reference.step(action)
            for a, e in zip(got[:4], expected[:4]):
                np.testing.assert_array_equal(a, e)
            np.testing.assert_array_equal(got[4]["env_id"], np.arange(4))
        assert envs.observation_space == reference.observation_space
        assert envs.action_space == reference.action_space
    finally:
        envs.close()
        reference.close()


@pytest.mark.parametrize("placement", LOCAL)
def test_an_env_error_in_a_group_reaches_next_with_the_env_named(placement):
    """Env 3 (group 1's second env) raises at its 6th step: the same exception, naming its group."""
    fault = partial(faulty_vec, faulty_index=3, cls=AsyncVectorEnv, fault="step_raises", at=6)
    collector = Collector(
        double_buffered(fault), ConstantPolicy(), num_envs=N, num_steps=T, device="cpu", timeout=TIMEOUT, **placement
    )
    try:
        with pytest.raises(EnvFault, match=re.escape("step 6 of env 3 failed")) as info:
            for _ in range(4):
                next(collector)
    finally:
        collector.close()
    text = "".join(traceback.format_exception(info.value))
    assert "(in group 1 of the DoubleBufferedVectorEnv: envs 2..3)" in text
    if placement["backend"] == "thread":
        # Under -W error (this suite's setting) gymnasium's log line is raised; the env's traceback is then
        # attached from that line. A worker process keeps the default filters: gymnasium logs it to stderr.
        assert "reliability_envs.py" in text


def test_a_killed_group_worker_is_named_and_the_groups_are_shut_down():
    fault = partial(faulty_vec, faulty_index=2, cls=AsyncVectorEnv, fault="sigkill", at=3)
    collector = Collector(
        double_buffered(fault),
        ConstantPolicy(),
        num_envs=N,
        num_steps=T,
        device="cpu",
        timeout=TIMEOUT,
        backend="thread",
    )
    groups = collector.envs.groups
    try:
        killed = r"worker process 0 of the AsyncVectorEnv \(pid \d+\) was killed by SIGKILL"
        with pytest.raises(RuntimeError, match=killed):
            next(collector)
    finally:
        collector.close()
    assert not any(process.is_alive() for group in groups for process in group.processes)


# -- refusals ------------------------------------------------------------------------------------


def test_the_retired_double_buffer_keyword_names_the_recipe():
    with pytest.raises(TypeError, match=re.escape("double_buffer= is now envs=torch_rollout.double_buffered(env_id")):
        Collector("CartPole-v1", ConstantPolicy(), num_envs=4, num_steps=T, device="cpu", double_buffer=True)


def test_a_live_vector_env_cannot_be_split_into_groups():
    envs = make_counting_envs(4)
    refused = r"double_buffered: builds two groups .* live SyncVectorEnv.*DoubleBufferedVectorEnv"
    with pytest.raises(ValueError, match=refused):
        double_buffered(envs)
    envs.close()


@pytest.mark.parametrize(
    ("num_envs", "num_workers", "message"),
    [
        (5, 1, r"num_envs=5 is odd; pass a num_envs that is a multiple of 2"),
        (6, 2, r"num_envs=6 over 2 workers gives shares of \[3, 3\] envs; pass a num_envs that is a multiple of 4"),
    ],
)
def test_each_workers_share_must_split_into_two_equal_groups(num_envs, num_workers, message):
    backend = "thread" if num_workers == 1 else Processes(num_workers)
    with pytest.raises(ValueError, match=message):
        Collector(
            double_buffered(make_async_counting_envs),
            ConstantPolicy(),
            num_envs=num_envs,
            num_steps=T,
            device="cpu",
            backend=backend,
        )


def test_groups_that_cannot_step_asynchronously_are_refused_with_the_fix():
    refused = r"groups\[0\] is .*SyncVectorEnv.* has no reset_async, reset_wait, step_async, step_wait.*mode='async'"
    with pytest.raises(TypeError, match=refused):
        Collector(
            double_buffered(gym_envs("CartPole-v1", vectorization_mode="sync")),
            ConstantPolicy(),
            num_envs=4,
            num_steps=T,
            device="cpu",
            backend="thread",
        )


def test_groups_must_be_alike_and_in_next_step_mode():
    same_step = [AsyncVectorEnv([CountingEnv] * 2, autoreset_mode=AutoresetMode.SAME_STEP) for _ in range(2)]
    unequal = [make_async_counting_envs(2), make_async_counting_envs(3)]
    try:
        with pytest.raises(ValueError, match=r"groups\[0\] runs in autoreset mode .*SAME_STEP.*NEXT_STEP"):
            DoubleBufferedVectorEnv(same_step)
        with pytest.raises(ValueError, match=r"groups\[1\].num_envs is 3 but groups\[0\].num_envs is 2"):
            DoubleBufferedVectorEnv(unequal)
        with pytest.raises(ValueError, match=r"at least two vector envs, got 1"):
            DoubleBufferedVectorEnv(unequal[:1])
    finally:
        for group in same_step + unequal:
            group.close()


def test_a_wrapped_double_buffered_env_is_refused_with_the_fix():
    envs = DoubleBufferedVectorEnv([make_async_counting_envs(2, start_index=2 * g) for g in range(2)])
    assert envs.autoreset_mode == envs.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    wrapped = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    try:
        refused = (
            re.escape("envs is RecordEpisodeStatistics around a DoubleBufferedVectorEnv of 2 groups of 2 envs")
            + r".*pass it unwrapped, or pass its envs as one vector env \(not double_buffered\)"
        )
        with pytest.raises(TypeError, match=refused):
            Collector(wrapped, ConstantPolicy(), num_steps=T, device="cpu", backend="thread")
    finally:
        envs.close()


def test_send_takes_one_whole_group_in_order():
    envs = DoubleBufferedVectorEnv([make_async_counting_envs(2, start_index=2 * g) for g in range(2)])
    try:
        envs.async_reset(seed=0)
        envs.recv()
        refused = re.escape("send() steps one whole group of 2 envs") + r".*got env_id=\[1, 2\]"
        with pytest.raises(ValueError, match=refused):
            envs.send(np.zeros(2, dtype=np.int64), np.array([1, 2]))
        with pytest.raises(RuntimeError, match=r"send\(\) to group 1, which is still stepping"):
            envs.send(np.zeros(2, dtype=np.int64), np.array([2, 3]))
    finally:
        envs.close()
