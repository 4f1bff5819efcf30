"""``BatchKeys(next_obs=True)``: every row's true next observation, in every autoreset mode, placement and env kind.

The counting envs' observations encode env, episode and step, so the observation
after each real step is known by hand: at an episode end the final one, never the
reset observation, also where the episode ends on a batch's last row.
"""

from __future__ import annotations

import re
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from tensordict import TensorDict
from torch import nn

from torch_rollout import BatchKeys, Collector, Processes, double_buffered

import counting_env
from async_pool import AsyncCountingPool, make_async_counting_pool
from counting_env import TransitionCountingEnv, TransitionCountingPolicy, counting_vec
from placements import PLACEMENTS, envs_for
from reliability_envs import AUTORESET_MODES

TIMEOUT = 60.0
N, T, BATCHES = 3, 7, 5  # T is prime to every episode length: episode ends fall on batch boundaries too
STEP = torch.tensor([0.0, 0.0, 1.0, 1.0])  # counting_env.TransitionCountingEnv: a step adds 1 to t and to k
NEXT_OBS = BatchKeys(next_obs=True)


def collect(envs, policy, *, num_steps=T, batches=BATCHES, num_envs=N, keys=NEXT_OBS, **kwargs):
    kwargs = {"backend": "thread", "device": "cpu", "timeout": TIMEOUT, **kwargs}
    if not isinstance(envs, VectorEnv):  # a recipe
        kwargs["num_envs"] = num_envs
    total = batches * num_steps * num_envs
    with Collector(envs, policy, num_steps=num_steps, total_timesteps=total, keys=keys, **kwargs) as collector:
        got = list(collector)
    assert len(got) == batches
    return got


def streams(batches: list[TensorDict]) -> TensorDict:
    """All batches one after the other: ``[batches * T, N]``."""
    return torch.cat(batches)


def assert_true_next_obs(rows: TensorDict, obs_key: str = "obs") -> None:
    """counting_env.TransitionCountingEnv ``[i, episode, t, k]``: the observation after a real step is
    ``[i, episode, t + 1, k + 1]``; at an episode end the final one, whose ``t`` is the episode's length."""
    obs, next_obs, real, done = rows[obs_key], rows["next_" + obs_key], rows["mask"], rows["done"]
    assert next_obs.dtype == obs.dtype and next_obs.shape == obs.shape
    assert torch.equal(next_obs[real], obs[real] + STEP)
    # Within an episode the next observation is the next row's.
    inside = real[:-1] & ~done[:-1]
    assert torch.equal(next_obs[:-1][inside], obs[1:][inside])
    ended = real & done
    lengths = [TransitionCountingEnv.episode_length(int(i), int(e)) for i, e in obs[ended][:, :2].tolist()]
    assert ended.any() and next_obs[ended][:, 2].tolist() == lengths


@pytest.mark.ray(mode=(AutoresetMode.SAME_STEP,))
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("mode", AUTORESET_MODES, ids=lambda m: m.value)
def test_next_obs_is_the_observation_after_each_step(mode, placement):
    envs, extra = envs_for(placement, partial(counting_vec, mode=mode), N)
    batches = collect(envs, TransitionCountingPolicy(), seed=0, **placement)
    if not extra:
        envs.close()
    rows = streams(batches)
    assert_true_next_obs(rows)
    assert rows["done"][:-1][rows["mask"][:-1]].any()  # episode ends were crossed ...
    assert any(batch["done"][-1].any() for batch in batches[:-1])  # ... on a batch's last row too
    if mode == AutoresetMode.NEXT_STEP:
        # A reset row (mask False) holds what the env returned: the next row's observation, the reset one.
        reset = ~rows["mask"][:-1]
        assert reset.any() and torch.equal(rows["next_obs"][:-1][reset], rows["obs"][1:][reset])
    else:
        # No row is masked, and the row after an episode end starts the next one: its observation is a reset one.
        assert rows["mask"].all()
        assert (rows["obs"][1:][rows["done"][:-1]][:, 2] == 0).all()


@pytest.mark.parametrize("mode", AUTORESET_MODES, ids=lambda m: m.value)
def test_next_obs_is_absent_by_default(mode):
    envs = counting_vec(N, mode=mode)
    (batch,) = collect(envs, TransitionCountingPolicy(), batches=1, keys=BatchKeys())
    envs.close()
    assert not any(str(key).startswith("next_") and key != "next_value" for key in batch.keys())


def test_the_key_follows_obs_key():
    envs = counting_vec(N, mode=AutoresetMode.SAME_STEP)
    batches = collect(envs, TransitionCountingPolicy(), keys=BatchKeys(obs_key="observation", next_obs=True))
    envs.close()
    assert "next_obs" not in batches[0].keys()
    assert_true_next_obs(streams(batches), obs_key="observation")


# -- Dict observations ---------------------------------------------------------------------------------


class DictCountingEnv(TransitionCountingEnv):
    """TransitionCountingEnv with the observation ``{"state": [i, episode, t, k], "t": t}`` (int64 ``t``)."""

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.observation_space = spaces.Dict(
            {"state": spaces.Box(-np.inf, np.inf, (4,), np.float32), "t": spaces.Discrete(10)}
        )

    def reset(self, **kwargs):
        obs, info = super().reset(**kwargs)
        return {"state": obs, "t": int(obs[2])}, info

    def step(self, action):
        obs, *rest = super().step(action)
        return {"state": obs, "t": int(obs[2])}, *rest


class DictCountingPolicy(TransitionCountingPolicy):
    def forward(self, obs: TensorDict) -> dict[str, torch.Tensor]:
        return super().forward(obs["state"])


@pytest.mark.parametrize("mode", AUTORESET_MODES, ids=lambda m: m.value)
def test_dict_observations(mode):
    envs = SyncVectorEnv([partial(DictCountingEnv, i) for i in range(N)], autoreset_mode=mode)
    batches = collect(envs, DictCountingPolicy())
    envs.close()
    rows = streams(batches)
    next_obs = rows["next_obs"]
    assert isinstance(next_obs, TensorDict) and next_obs.batch_size == rows.batch_size
    assert next_obs["t"].dtype == torch.int64 and next_obs["state"].dtype == torch.float32
    flat = rows.select("mask", "done")
    flat["obs"], flat["next_obs"] = rows["obs", "state"], next_obs["state"]
    assert_true_next_obs(flat)
    assert torch.equal(next_obs["t"], next_obs["state"][..., 2].long())


# -- envs stepped with send/recv -----------------------------------------------------------------------


@pytest.mark.parametrize("case", [(4, 2, 5, 0), (5, 3, 4, 7), (3, 2, 1, 2)], ids=["even", "slow-env", "T1"])
def test_async_pool_rows_get_the_observation_their_step_returned(case):
    num_envs, batch_size, num_steps, lag = case
    pool = AsyncCountingPool(num_envs, batch_size, lag=lag)
    policy = counting_env.CountingPolicy(deterministic=True)
    batches = collect(pool, policy, num_steps=num_steps, batches=4, num_envs=num_envs, prefetch=1)
    rows = streams(batches)
    for j, env in enumerate(pool.envs):
        real = rows[:, j][rows[:, j]["mask"]]
        logged = np.array([step[3] for step in env.log[: len(real)]], dtype=np.float32)  # the env's own next_obs
        assert len(logged) == len(real) and np.array_equal(real["next_obs"].numpy(), logged)
    # The last row's next observation is row 0 of the next batch, the reset rows' included.
    for batch, after in zip(batches, batches[1:]):
        assert torch.equal(batch["next_obs"][-1], after["obs"][0])
    assert_counting_env_next_obs(rows)


def assert_counting_env_next_obs(rows: TensorDict) -> None:
    """counting_env.CountingEnv ``[j, episode, t, last action]``: a step adds 1 to t and records its action."""
    real = rows[rows["mask"]]
    want = real["obs"].clone()
    want[:, 2] += 1
    want[:, 3] = real["action"].float()
    assert torch.equal(real["next_obs"], want) and real["done"].any()


@pytest.mark.parametrize(
    "envs",
    [
        pytest.param(partial(make_async_counting_pool, batch_size=3, lag=2), id="async-pool"),
        pytest.param(double_buffered(counting_env.make_async_counting_envs), id="double-buffered"),
    ],
)
def test_send_recv_envs_in_a_worker_process(envs):
    # The worker writes each batch into its shared-memory slots, which the first batch shaped.
    policy = counting_env.CountingPolicy(deterministic=True)
    batches = collect(envs, policy, num_steps=5, batches=3, num_envs=4, backend=Processes(1), prefetch=1)
    assert_counting_env_next_obs(streams(batches))


# -- keys that clash -----------------------------------------------------------------------------------


def test_an_obs_key_whose_next_key_is_a_batch_key_is_refused():
    with pytest.raises(ValueError, match=re.escape("'next_' + obs_key = 'next_value', which is one of the batch's")):
        BatchKeys(obs_key="value", next_obs=True)
    assert BatchKeys(obs_key="value").next_obs_key is None  # without next_obs nothing clashes


def test_next_obs_must_be_a_bool():
    with pytest.raises(TypeError, match=re.escape("BatchKeys: next_obs must be True or False, got str 'yes'")):
        BatchKeys(next_obs="yes")


class NextObsPolicy(nn.Module):
    def forward(self, obs):
        n = obs.shape[0]
        return {"action": torch.zeros(n, dtype=torch.long), "next_obs": obs}


def test_a_policy_output_named_like_the_next_observations_is_refused():
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    message = "Collector: the policy returns 'next_obs', the batch key of the next observations with BatchKeys(next_"
    with pytest.raises(ValueError, match=re.escape(message)):
        collect(envs, NextObsPolicy(), batches=1, num_envs=2)
    envs.close()
    # Without next_obs it is an output like any other.
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    (batch,) = collect(envs, NextObsPolicy(), batches=1, num_envs=2, keys=BatchKeys())
    envs.close()
    assert torch.equal(batch["next_obs"], batch["obs"])


def test_an_initial_state_entry_named_like_the_next_observations_is_refused():
    state = TensorDict({"next_obs": torch.zeros(2, 1)}, batch_size=[2])
    with pytest.raises(ValueError, match=re.escape("initial_state entries ['next_obs'] would overwrite keys")):
        Collector(
            "CartPole-v1",
            NextObsPolicy(),
            num_envs=2,
            num_steps=4,
            initial_state=state,
            keys=BatchKeys(next_obs=True),
            backend="thread",
            device="cpu",
        )
