"""EnvPool as an env source: seeds in every placement, NEXT_STEP exactness on its CartPole, warnings, refusals.

EnvPool is an optional extra: the tests that need it skip where it is not
installed (``pytest.importorskip``).
"""

from __future__ import annotations

import pickle
import re
import sys
import warnings

import gymnasium
import numpy as np
import pytest
import torch

from torch_rollout import BatchKeys, Collector, envpool_envs
from torch_rollout.envs._envpool import EnvPoolVectorEnv

from placements import PLACEMENTS, local_ray, on_ray

TIMEOUT = 60.0
N, T, LIMIT, SEED = 4, 32, 20, 3
INFO_KEYS = ("env_id", "elapsed_step", "players")
# CartPole's physics (EnvPool's classic_control/cartpole.h): x moves by tau * x_dot each step; an episode
# terminates past these bounds and starts within +-0.05 in every coordinate.
TAU, X_LIMIT, THETA_LIMIT, INIT_RANGE = 0.02, 2.4, 12 * 2 * np.pi / 360, 0.05


@pytest.fixture
def envpool():
    return pytest.importorskip("envpool")


class Recentre(torch.nn.Module):
    """Pushes the cart toward x = 0 (the pole falls within ~10 steps in some episodes, not in others).

    Deterministic, so every placement takes the same actions; the value is a
    fixed linear function of the observation.
    """

    def forward(self, obs):
        return {"action": (obs[:, 0] < 0).long(), "value": value_of(obs)}


def own_pool(num_envs: int, **kwargs) -> gymnasium.vector.VectorEnv:
    """A pool built with EnvPool's own API (its default seed unless given), as a user would build it."""
    import envpool

    with warnings.catch_warnings():  # EnvPool's spaces warn when first read, which its reset() does
        warnings.filterwarnings("ignore", message=".*Box (low|high)'s precision lowered")
        pool = envpool.make_gymnasium("CartPole-v1", num_envs=num_envs, **kwargs)
        _ = pool.observation_space  # built here, under the filter
    return pool


def value_of(obs: torch.Tensor) -> torch.Tensor:
    return (obs * torch.tensor([1.0, -2.0, 3.0, -4.0])).sum(-1)


def collect(placement: dict, *, seed: int | None = SEED, batches: int = 2, **kwargs) -> torch.Tensor:
    if on_ray(placement):
        local_ray()
    with Collector(
        envpool_envs("CartPole-v1", max_episode_steps=LIMIT),
        Recentre(),
        num_envs=N,
        num_steps=T,
        total_timesteps=batches * T * N,
        seed=seed,
        device="cpu",
        timeout=TIMEOUT,
        **placement,
        **kwargs,
    ) as collector:
        return torch.cat(list(collector))  # [batches * T, N]


@pytest.fixture(scope="module")
def thread_batches():
    pytest.importorskip("envpool")
    return collect({"backend": "thread"}, keys=BatchKeys(info_keys=INFO_KEYS))


@pytest.mark.ray  # each Ray actor builds a pool of its own share of the envs
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_batches_are_exact_and_the_same_in_every_placement(placement, thread_batches):
    batch = collect(placement, keys=BatchKeys(info_keys=INFO_KEYS))
    obs, done, real = batch["obs"], batch["done"], batch["mask"]
    terminated, truncated, length = batch["terminated"], batch["truncated"], batch["episode_length"]
    assert terminated.any() and truncated.any(), "the test needs both kinds of episode end"

    # NEXT_STEP: the step after an episode end only resets the env: masked, reward 0, no episode end.
    reset_rows = torch.zeros_like(done)
    reset_rows[1:] = done[:-1]
    assert torch.equal(~real, reset_rows)
    assert (batch["reward"][reset_rows] == 0).all() and (batch["reward"][real] == 1).all()
    assert not done[reset_rows].any() and (batch["advantage"][reset_rows] == 0).all()
    # CartPole pays 1 per real step: the running return is the running length, and both restart after an end.
    assert torch.equal(batch["episode_return"], length.float())
    assert (length[real] >= 1).all() and (length[reset_rows] == 0).all()
    # Truncated exactly at max_episode_steps, terminated before it.
    assert (length[truncated] == LIMIT).all() and (length[terminated] < LIMIT).all()

    # The observation returned at an episode end is the final one: CartPole's physics carries on into it
    # (x += tau * x_dot, as on every real step), a terminated one lies past the bounds, and only the step
    # after it (the reset row's) returns a fresh start.
    step = real[:-1]
    assert torch.allclose(obs[1:, :, 0][step], (obs[:-1, :, 0] + TAU * obs[:-1, :, 1])[step], atol=1e-5)
    final = obs[1:][terminated[:-1]]
    assert ((final[:, 0].abs() > X_LIMIT) | (final[:, 2].abs() > THETA_LIMIT)).all()
    assert (obs[2:][reset_rows[1:-1]].abs() <= INIT_RANGE).all()
    # ... and it is what an ended row bootstraps from (across the batch boundary too): V(final obs).
    assert torch.allclose(batch["value"], value_of(obs))
    assert torch.equal(batch["next_value"][:-1], batch["value"][1:])

    # EnvPool's infos: env_id is the env's global index (in a worker's share too), elapsed_step the step
    # in the episode; those of the reset rows (their reset's) are masked out.
    info = batch["info"]
    for key in ("_env_id", "_elapsed_step", "_players"):
        assert torch.equal(info[key], real)
    env_index = torch.arange(N, dtype=torch.int32).expand(len(batch), N)
    assert torch.equal(info["env_id"][real], env_index[real])
    assert torch.equal(info["players", "env_id"][real], env_index[real])
    assert torch.equal(info["elapsed_step"][real].long(), length[real])

    # Env j is seeded SEED + j wherever it runs: the deterministic policy sees the same episodes.
    for key in batch.keys(include_nested=True, leaves_only=True):
        if key != "policy_version":
            assert torch.equal(batch[key], thread_batches[key]), key


def test_env_j_starts_as_envpool_seeds_it_with_seed_plus_j(envpool):
    first = collect({"backend": "thread"}, batches=1)["obs"][0]
    for j in range(N):
        own = own_pool(1, seed=SEED + j)
        obs, _ = own.reset()
        own.close()
        assert torch.equal(first[j], torch.from_numpy(obs[0])), j


def test_a_termination_at_the_time_limit_is_reported_truncated_only(thread_batches):
    """Where EnvPool is not exact (README, EnvPool): documented, and noticed here if EnvPool changes it."""
    terminated = thread_batches["terminated"]
    t, env = (int(i) for i in terminated.nonzero()[0])
    ends_at = int(thread_batches["episode_length"][t, env])
    # The same seed and policy with the time limit at that step: the same episode, ended by both.
    with Collector(
        envpool_envs("CartPole-v1", max_episode_steps=ends_at),
        Recentre(),
        num_envs=N,
        num_steps=t + 2,
        total_timesteps=(t + 2) * N,
        seed=SEED,
        device="cpu",
        backend="thread",
    ) as collector:
        batch = next(iter(collector))
    assert torch.equal(batch["obs"][: t + 2, env], thread_batches["obs"][: t + 2, env])
    assert batch["truncated"][t, env] and not batch["terminated"][t, env]
    final = batch["obs"][t + 1, env]
    assert final[0].abs() > X_LIMIT or final[2].abs() > THETA_LIMIT, "the pole fell at that step"


def test_a_resumed_collector_reseeds_the_pools(envpool):
    # The pools of worker processes are reseeded by the same EnvPoolVectorEnv.reset(seed=...), through the
    # placements' reseed that tests/test_resume.py checks with gymnasium envs; a worker starts in seconds
    # (it imports EnvPool), so this runs on the thread only.
    with Collector(
        envpool_envs("CartPole-v1"), Recentre(), num_envs=N, num_steps=T, seed=SEED, device="cpu", backend="thread"
    ) as first:
        started = next(first)
        state = first.state_dict()
    with Collector(
        envpool_envs("CartPole-v1"), Recentre(), num_envs=N, num_steps=T, seed=SEED, device="cpu", backend="thread"
    ) as resumed:
        resumed.load_state_dict(state)
        batch = next(resumed)
    # The second collector over SEED resets env j with SEED + N + j (EnvPool's pools are built anew for it).
    fresh = collect({"backend": "thread"}, seed=SEED + N, batches=1)
    assert torch.equal(batch["obs"][0], fresh["obs"][0])
    assert not torch.equal(batch["obs"][0], started["obs"][0])


def test_a_pool_built_by_the_user_is_refused_with_a_seed_and_runs_quietly_without(envpool):
    pool = envpool.make_gymnasium("CartPole-v1", num_envs=N, seed=7)  # its spaces are not read yet
    fix = "pass envs=torch_rollout.envpool_envs('<task id>', ...) with num_envs instead"
    with pytest.raises(ValueError, match=re.escape(fix)):
        Collector(pool, Recentre(), num_steps=T, seed=SEED, device="cpu", backend="thread")
    # A make_envs function returning a pool of its own is refused the same way (and its pool is closed).
    with pytest.raises(ValueError, match=re.escape("ignores reset(seed=...), so seed=3 would not reach the envs")):
        Collector(own_pool, Recentre(), num_envs=N, num_steps=T, seed=SEED, device="cpu", backend="thread")
    # Unseeded, the live pool runs on its own seeds; its spaces' precision warnings (errors in this
    # test-suite) are not raised.
    with Collector(pool, Recentre(), num_steps=T, total_timesteps=T * N, device="cpu", backend="thread") as collector:
        batch = next(iter(collector))
    own = own_pool(N, seed=7)
    assert torch.equal(batch["obs"][0], torch.from_numpy(own.reset()[0]))
    own.close()
    pool.close()


def test_async_mode_is_left_to_pools_the_user_makes(envpool):
    # The recipe resets its pools with seeds, which only sync mode has; an async pool is given itself
    # (tests/test_async_loop.py) and its seed, fixed when it was made, cannot come from the collector.
    refused = "batch_size=2 < num_envs=4, EnvPool's async mode, which envpool_envs does not build"
    with pytest.raises(ValueError, match=re.escape(refused)):
        Collector(envpool_envs("CartPole-v1", batch_size=2), Recentre(), num_envs=4, num_steps=T, backend="thread")
    pool = own_pool(4, batch_size=2)
    with pytest.raises(ValueError, match=re.escape("make the pool with seed=3 and pass seed=None")):
        Collector(pool, Recentre(), num_steps=T, seed=3, device="cpu", backend="thread")
    pool.close()
    # In sync mode batch_size may be given as num_envs.
    with Collector(
        envpool_envs("CartPole-v1", batch_size=4),
        Recentre(),
        num_envs=4,
        num_steps=2,
        total_timesteps=8,
        device="cpu",
        backend="thread",
    ) as collector:
        assert next(iter(collector)).batch_size == (2, 4)


def test_recipe_arguments_are_checked_and_the_recipe_pickles(envpool):
    with pytest.raises(ValueError, match=re.escape("EnvPool has no task 'CartPole-v2'; did you mean 'CartPole-v1' or")):
        envpool_envs("CartPole-v2")
    with pytest.raises(ValueError, match=re.escape("envpool_envs: seed=1 is set by the collector; give Collector(")):
        envpool_envs("CartPole-v1", seed=1)
    with pytest.raises(ValueError, match=re.escape("num_envs=8 is set by the collector; give Collector(num_envs=...)")):
        envpool_envs("CartPole-v1", num_envs=8)
    refused = "envpool_envs('CartPole-v1'): EnvPool refused the options {'frame_skip': 4}"
    with pytest.raises(TypeError, match=re.escape(refused)):
        envpool_envs("CartPole-v1", frame_skip=4)
    recipe = envpool_envs("CartPole-v1", max_episode_steps=LIMIT)
    assert repr(recipe) == "envpool_envs('CartPole-v1', max_episode_steps=20)"
    copy = pickle.loads(pickle.dumps(recipe))
    assert (copy.task_id, copy.kwargs) == ("CartPole-v1", {"max_episode_steps": LIMIT})


def test_the_vector_env_honours_reset_seed(envpool):
    envs = envpool_envs("CartPole-v1")(3)
    assert isinstance(envs, gymnasium.vector.VectorEnv) and envs.num_envs == 3
    # EnvPool resets an env on the step after its episode ends; said where gymnasium's vector envs say it
    assert envs.autoreset_mode == envs.metadata["autoreset_mode"] == gymnasium.vector.AutoresetMode.NEXT_STEP
    with pytest.raises(RuntimeError, match=re.escape("call reset() before step()")):
        envs.step(np.zeros(3, dtype=np.int64))
    first, _ = envs.reset(seed=5)
    envs.step(np.ones(3, dtype=np.int64))
    again, _ = envs.reset(seed=5)
    assert np.array_equal(first, again), "a seeded reset starts the same episodes every time"
    on, _ = envs.reset()
    assert not np.array_equal(on, first), "an unseeded reset lets the generators run on"
    shifted, _ = envpool_envs("CartPole-v1")(2).reset(seed=6)
    assert np.array_equal(shifted, first[1:]), "env i of a pool reset with seed s is seeded s + i"
    with pytest.raises(ValueError, match=re.escape("the seed must be in [0, 2147483645]")):
        envs.reset(seed=2**31 - 2)
    envs.close()
    envs.close()
    assert envs.pool is None


def test_only_envpools_box_precision_warnings_are_quieted(envpool):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        envs = envpool_envs("CartPole-v1")(2)
        envs.reset(seed=0)
        _ = envs.single_observation_space, envs.observation_space
        envs.close()
        assert isinstance(EnvPoolVectorEnv("Pendulum-v1", 2).single_action_space, gymnasium.spaces.Box)
    # The user's own Boxes still warn.
    with pytest.warns(UserWarning, match="precision lowered"):
        gymnasium.spaces.Box(np.zeros(2), np.ones(2), dtype=np.float32)


def test_missing_envpool_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "envpool", None)  # import envpool now raises ImportError
    with pytest.raises(ImportError, match=re.escape("pip install 'torch_rollout[envpool]'")):
        envpool_envs("CartPole-v1")


@pytest.mark.parametrize("task_id", ["TicTacToe-v1", "IntersectionMultiAgent-v0"])
def test_a_multi_player_task_is_refused_by_name_with_the_alternative(envpool, task_id):
    fix = "collect a single-player task, or make each env single-player"
    with pytest.raises(ValueError, match=re.escape(f"envpool_envs({task_id!r}): a multi-player task (2 players")) as e:
        envpool_envs(task_id)
    assert fix in str(e.value)
    pool = envpool.make_gymnasium(task_id, num_envs=2)
    try:
        with pytest.raises(ValueError, match=re.escape("a multi-player task (2 players per env)")) as e:
            Collector(pool, torch.nn.Linear(1, 1), num_steps=4, device="cpu", backend="thread")
        assert fix in str(e.value)
    finally:
        pool.close()


def async_pool(num_envs: int, start_index: int = 0):
    """A pool in EnvPool's async mode (half its envs per recv) whose env j is seeded 1 + its global index."""
    import envpool

    return envpool.make_gymnasium("CartPole-v1", num_envs=num_envs, batch_size=num_envs // 2, seed=1 + start_index)


@pytest.mark.ray
@pytest.mark.filterwarnings("ignore:.*precision lowered:UserWarning")  # gymnasium on EnvPool's float64 bounds
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_async_pools_in_every_placement_give_the_rows_of_a_sync_pool(envpool, placement):
    """Async pools built by a make_envs function (in the workers, one per worker's share) against one sync pool."""
    sync = envpool.make_gymnasium("CartPole-v1", num_envs=8, seed=1)
    try:
        with Collector(sync, Recentre(), num_steps=T, total_timesteps=2 * T * 8, device="cpu", backend="thread") as c:
            expected = torch.cat(list(c))
    finally:
        sync.close()
    if on_ray(placement):
        local_ray()
    envs = async_pool(8) if placement["backend"] == "thread" else async_pool
    options = {} if placement["backend"] == "thread" else {"num_envs": 8}
    try:
        with Collector(
            envs, Recentre(), num_steps=T, total_timesteps=2 * T * 8, device="cpu", timeout=TIMEOUT, **placement,
            **options,
        ) as collector:  # fmt: skip
            batch = torch.cat(list(collector))
    finally:
        if placement["backend"] == "thread":
            envs.close()
    for key in ("obs", "action", "reward", "terminated", "truncated", "mask", "episode_length", "value"):
        assert torch.equal(batch[key], expected[key]), key
