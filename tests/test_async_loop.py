"""EnvPool's async mode (``batch_size < num_envs``) driven with send/recv: exact ``[T, N]`` batches, row by row."""

from __future__ import annotations

import inspect
import re
from functools import partial

import numpy as np
import pytest
import torch
from gymnasium.vector import SyncVectorEnv
from torch import nn

from torch_rollout import BatchKeys, Collector, Processes

from async_pool import AsyncCountingPool, make_async_counting_pool
from counting_env import CountingEnv, CountingPolicy, value_fn
from recurrent_policies import StepCountingPolicy, steps_state

# (num_envs, batch_size, num_steps, lag of env 0): envs of equal speed; a slow env 0, whose batch ends many
# rows after the others' (their rows of the next batches carried over); T=1, where every row ends a batch;
# batch_size = num_envs - 1, where one env held back would leave too few in flight for recv().
CASES = [(4, 2, 5, 0), (5, 3, 4, 7), (3, 2, 1, 2), (5, 4, 3, 3)]
CASE_IDS = ["even", "slow-env", "T1", "B=N-1"]


def collect(pool, policy, *, num_batches, num_steps, prefetch=0, **kwargs):
    total = num_batches * num_steps * pool.num_envs
    with Collector(
        pool,
        policy,
        num_steps=num_steps,
        total_timesteps=total,
        prefetch=prefetch,
        device="cpu",
        backend="thread",
        **kwargs,
    ) as collector:
        batches = list(collector)
    assert len(batches) == num_batches
    return batches


def env_stream(batches, j):
    """Env ``j``'s rows of all batches, in order: a TensorDict [num_batches * T]."""
    return torch.cat([batch[:, j] for batch in batches])


@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_transition_once_and_in_order_per_env(case, prefetch):
    N, B, T, lag = case
    pool = AsyncCountingPool(N, B, lag=lag)
    batches = collect(pool, CountingPolicy(deterministic=True), num_batches=4, num_steps=T, prefetch=prefetch)
    for j, env in enumerate(pool.envs):
        rows = env_stream(batches, j)
        real = rows[rows["mask"]]
        log = env.log[: len(real)]
        assert len(log) == len(real)  # the env took at least every step the rows hold
        obs, action, reward, next_obs, terminated, truncated = (np.array(column) for column in zip(*log))
        assert np.array_equal(real["obs"].numpy(), obs.astype(np.float32))
        assert np.array_equal(real["action"].numpy(), action)
        assert np.array_equal(real["reward"].numpy(), reward.astype(np.float32))
        assert np.array_equal(real["terminated"].numpy(), terminated)
        assert np.array_equal(real["truncated"].numpy(), truncated)
        # The bootstrap of every real row, batch ends and final observations included: V(true next state).
        torch.testing.assert_close(real["next_value"], value_fn(next_obs).float(), atol=1e-5, rtol=0)
        # Episode totals, and a reset row (mask False, reward 0) exactly after each episode end.
        assert np.array_equal(real["episode_length"].numpy(), obs[:, 2].astype(np.int64) + 1)
        after_end = torch.cat([torch.tensor([False]), rows["done"][:-1]])
        assert torch.equal(~rows["mask"], after_end)
        assert (rows["reward"][~rows["mask"]] == 0).all() and (rows["advantage"][~rows["mask"]] == 0).all()
        # Rows acted before a weight refresh keep their version: never decreasing along an env's rows.
        versions = rows["policy_version"]
        assert (versions[1:] >= versions[:-1]).all()
    for batch, after in zip(batches, batches[1:]):
        # The end of a batch: each env's forward after its row T - 1 is both the bootstrap and row 0 of the next.
        assert torch.equal(batch["next_value"][-1], after["value"][0])
    if prefetch == 0:
        # Lockstep: batch k comes from version k + 1, except rows its envs acted on while earlier batches filled.
        for k, batch in enumerate(batches):
            assert 1 <= batch["policy_version"].min() and batch["policy_version"].max() <= k + 1
        if lag:
            carried = sum(int((batch["policy_version"] <= k).sum()) for k, batch in enumerate(batches))
            assert carried > 0  # the fast envs did act on rows of later batches while the slow one caught up


def test_slow_env_carries_others_into_later_batches_and_none_is_held():
    # Env 0 comes back only every 10th recv(): the other envs must keep stepping (recv() needs batch_size of
    # them) and fill rows of the batches after the one env 0 is still in. The pool raises if an env got held
    # back so long that fewer than batch_size were in flight.
    pool = AsyncCountingPool(4, 3, lag=10)
    batches = collect(pool, CountingPolicy(deterministic=True), num_batches=3, num_steps=2)
    steps = [len(env.log) for env in pool.envs]  # real steps each env took
    assert steps[0] < 2 * 3 + 2 < min(steps[1:])  # the others got more than a batch past the 3 delivered
    for j in range(4):
        rows = env_stream(batches, j)
        # Each env's own rows in order: its step count goes up by one, and back to 0 after a reset row.
        step = rows["obs"][:, 2]
        assert torch.equal(step[1:], torch.where(rows["mask"][:-1], step[:-1] + 1, 0.0))


def test_recurrent_state_goes_with_each_env():
    pool = AsyncCountingPool(5, 3, lag=4)
    batches = collect(pool, StepCountingPolicy(), num_batches=3, num_steps=4, initial_state=steps_state)
    for batch in batches:
        # The state that went into each row counts the steps of its episode, reset rows included.
        assert torch.equal(batch["steps"][..., 0], batch["obs"][..., 2])
        assert torch.equal(batch["is_init"], batch["obs"][..., 2] == 0)
        # Bootstraps were made with the right state: value_fn of the true next observation.
        real = batch["mask"]
        nxt = batch["obs"].clone()
        nxt[..., 2] += 1
        nxt[..., 3] = batch["action"].float()
        torch.testing.assert_close(batch["next_value"][real], value_fn(nxt[real]).float(), atol=1e-5, rtol=0)


def test_infos_are_those_of_each_rows_step():
    pool = AsyncCountingPool(4, 2, lag=3)
    batches = collect(
        pool,
        CountingPolicy(deterministic=True),
        num_batches=3,
        num_steps=4,
        keys=BatchKeys(info_keys=("elapsed_step",)),
    )
    for batch in batches:
        real = batch["mask"]
        # elapsed_step is the env's step in its episode after the row's step; reset rows' infos are masked out.
        assert torch.equal(batch["info", "_elapsed_step"], real)
        assert torch.equal(batch["info", "elapsed_step"][real].long(), batch["episode_length"][real])


def test_a_second_collector_on_the_live_pool_takes_back_the_steps_left_in_flight():
    pool = AsyncCountingPool(5, 3, lag=2)
    collect(pool, CountingPolicy(deterministic=True), num_batches=1, num_steps=3)
    assert pool.queue  # the first collector left envs in flight
    # The pool raises if an env in flight gets a second request, or if recv() could not fill a batch.
    batches = collect(pool, CountingPolicy(deterministic=True), num_batches=2, num_steps=3)
    assert (batches[0]["obs"][0, :, 2] == 0).all()  # every env starts a new episode
    for j, env in enumerate(pool.envs):
        real = env_stream(batches, j)
        real = real[real["mask"]]
        episode = int(real["obs"][0, 1])
        log = [step for step in env.log if step[0][1] >= episode][: len(real)]
        assert np.array_equal(real["obs"].numpy(), np.array([step[0] for step in log], dtype=np.float32))


def test_wrapped_async_pool_and_seed_are_refused_or_named():
    pool = AsyncCountingPool(4, 2, seed=3)

    class Wrapper(SyncVectorEnv):
        unwrapped = pool

    wrapped = Wrapper([lambda: CountingEnv(0)])
    with pytest.raises(TypeError, match=re.escape("around an EnvPool in async mode (batch_size=2 < num_envs=4)")):
        Collector(wrapped, CountingPolicy(), num_steps=2, device="cpu", backend="thread")
    wrapped.close()
    message = "seed=5 cannot reach an EnvPool, whose envs were seeded when it was made (with seed=3)"
    with pytest.warns(UserWarning, match=re.escape(message)) as warned:
        line = inspect.currentframe().f_lineno + 1  # the warning points at the user's line, not into the package
        Collector(pool, CountingPolicy(), num_steps=2, device="cpu", backend="thread", seed=5).close()
    assert (warned[0].filename, warned[0].lineno) == (__file__, line)
    collect(pool, CountingPolicy(), num_batches=1, num_steps=2, seed=3)  # the pool's own seed: no warning


class OutOfRangeForEnv3(nn.Module):
    """Discrete(3) actions, except 7 for env 3 (CountingEnv's obs[0] is its env id)."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        action = torch.where(obs[:, 0] == 3, 7, 0).long()
        return {"action": action, "value": torch.zeros(obs.shape[0])}


def test_an_action_out_of_range_names_the_env_not_its_place_in_the_recv():
    """recv() returns envs 2 and 3 together: env 3 is row 1 of that call, and must be named env 3."""
    pool = AsyncCountingPool(4, 2)
    with pytest.raises(ValueError, match=re.escape("policy output 'action' for env 3 is 7, outside Discrete(3)")):
        collect(pool, OutOfRangeForEnv3(), num_batches=1, num_steps=2)


def test_async_pools_in_worker_processes_give_exact_rows():
    # A worker process building a pool of 6 envs with batch_size 2 (env 0 slow); batches in shared-memory slots.
    recipe = partial(make_async_counting_pool, batch_size=2, lag=3)
    with Collector(
        recipe,
        CountingPolicy(deterministic=True),
        num_envs=6,
        num_steps=4,
        total_timesteps=6 * 4 * 3,
        backend=Processes(1),
        device="cpu",
    ) as collector:
        batches = list(collector)
    rows = torch.cat(batches)  # [3 * T, 6], each env's rows in order
    obs, real = rows["obs"], rows["mask"]
    assert torch.equal(obs[..., 0], torch.arange(6.0).expand(len(rows), 6))  # column j holds env j
    step = obs[..., 2]
    assert torch.equal(step[1:], torch.where(real[:-1], step[:-1] + 1, 0.0))
    assert torch.equal(rows["reward"][real], 10 * step[real] + rows["action"][real])
    nxt = obs.clone()
    nxt[..., 2] += 1
    nxt[..., 3] = rows["action"].float()
    torch.testing.assert_close(rows["next_value"][real], value_fn(nxt[real]).float(), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- EnvPool itself


class Greedy(nn.Module):
    """CartPole: push toward the pole's lean (a function of obs), with a value that tells observations apart."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Linear(4, 1)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        action = (obs[:, 2] + 0.5 * obs[:, 3] > 0).long()
        return {"action": action, "value": self.critic(obs)}


@pytest.mark.filterwarnings("ignore:.*precision lowered:UserWarning")  # gymnasium on EnvPool's float64 bounds
@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
def test_envpool_async_batches_equal_sync_ones_env_by_env(prefetch):
    envpool = pytest.importorskip("envpool")
    N, T = 8, 16
    policy = Greedy()
    runs = {}
    for batch_size in (N, 3):
        envs = envpool.make_gymnasium("CartPole-v1", num_envs=N, batch_size=batch_size, seed=1)
        runs[batch_size] = collect(
            envs, policy, num_batches=4, num_steps=T, prefetch=prefetch, keys=BatchKeys(info_keys=("elapsed_step",))
        )
        envs.close()
    for sync, async_ in zip(*runs.values()):
        # Each env's episodes depend on its seed and its actions only: async mode gives each env the same rows.
        for key in ("obs", "action", "reward", "terminated", "truncated", "mask", "episode_length"):
            assert torch.equal(async_[key], sync[key]), key
        # Values of the same observations, from forwards of 3 rows instead of 8 (float rounding may differ).
        torch.testing.assert_close(async_["next_value"], sync["next_value"])
    for batch in runs[3]:
        assert torch.equal(batch["episode_return"], batch["episode_length"].float())
        real = batch["mask"]
        assert torch.equal(batch["info", "elapsed_step"][real].long(), batch["episode_length"][real])
