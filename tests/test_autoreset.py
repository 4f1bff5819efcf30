"""Envs whose metadata names no autoreset mode: read in the mode their step infos show, never a wrong row.

An env that resets within the step (SAME_STEP) but declares nothing, as gymnax
through gymnasium's ``JaxToTorch`` does, is read in SAME_STEP mode with one
warning; infos that contradict the mode read stop the batch with an error. Each
row is checked against the env's own log (NumPy) or a reference loop over a twin
env (torch), with the values computed eagerly.
"""

from __future__ import annotations

import re
import warnings
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv, VectorWrapper
from torch import nn

from torch_rollout import BatchKeys, Collector
from torch_rollout.envs import CartPole

from counting_env import CountingEnv, CountingPolicy, value_fn
from placements import LOCAL_PLACEMENTS
from rowwise import RowwiseLinear

T, N = 5, 3
BATCHES = 4
MAX_STEPS = 7  # CartPole's time limit, prime to T: episode ends fall on batch boundaries too
WARNING = "names no autoreset mode, but its step infos carry final observations"
DECLARE = "metadata['autoreset_mode'] = gymnasium.vector.AutoresetMode.SAME_STEP"


class Undeclared(VectorWrapper):
    """A vector env presented with a metadata that names no autoreset mode.

    ``layout``: ``"gymnasium"`` keeps the env's own infos (``final_obs`` as a per-env object array, at the steps
    where an episode ended); ``"dense"`` and ``"dense-nomask"`` put ``final_observation`` at every step as one
    array of every env's rows (the step's own where no episode ended), with or without ``_final_observation``,
    as gymnax does. ``from_step``: final observations only from this step on (counted from 1).
    """

    def __init__(self, envs: VectorEnv, layout: str = "gymnasium", from_step: int = 1) -> None:
        super().__init__(envs)
        self.metadata = {key: value for key, value in envs.metadata.items() if key != "autoreset_mode"}
        self.layout, self.from_step, self.steps = layout, from_step, 0

    def step(self, actions: Any) -> tuple:
        obs, reward, terminated, truncated, infos = self.env.step(actions)
        self.steps += 1
        infos = dict(infos)
        final, ended = infos.pop("final_obs", None), infos.pop("_final_obs", None)
        if self.steps < self.from_step:
            return obs, reward, terminated, truncated, infos
        if self.layout == "gymnasium":
            if final is not None:
                infos["final_obs"], infos["_final_obs"] = final, ended
        else:
            done = terminated | truncated
            dense = obs.copy()
            for i in np.flatnonzero(done):
                dense[i] = final[i]
            infos["final_observation"] = dense
            if self.layout == "dense":
                infos["_final_observation"] = done
        return obs, reward, terminated, truncated, infos


def counting_envs(num_envs: int, mode: AutoresetMode) -> SyncVectorEnv:
    return SyncVectorEnv([partial(CountingEnv, i) for i in range(num_envs)], autoreset_mode=mode)


def collect(envs: VectorEnv, policy: nn.Module, *, batches: int = BATCHES) -> list:
    keys = BatchKeys(next_obs=True)
    options = dict(num_steps=T, total_timesteps=batches * T * N, seed=0, device="cpu", backend="thread", keys=keys)
    with Collector(envs, policy, **options) as collector:
        return list(collector)


@pytest.mark.parametrize("layout", ["gymnasium", "dense", "dense-nomask"])
def test_an_undeclared_numpy_env_that_resets_within_the_step_is_read_in_same_step_mode(layout):
    envs = Undeclared(counting_envs(N, AutoresetMode.SAME_STEP), layout)
    with pytest.warns(UserWarning, match=re.escape(WARNING)) as record:
        batches = collect(envs, CountingPolicy(deterministic=True))
    assert sum(WARNING in str(w.message) for w in record) == 1  # once, not at every switch or batch
    assert DECLARE in str(record[0].message)
    base = envs.unwrapped.envs
    for j in range(N):
        log = base[j].log  # every real step of env j: (obs, action, reward, next_obs, terminated, truncated)
        rows = [(b, t) for b in range(BATCHES) for t in range(T)]
        assert len(log) == len(rows)  # no masked reset rows: every row is a real transition
        for (b, t), (obs, action, reward, next_obs, terminated, truncated) in zip(rows, log):
            row = batches[b][t, j]
            assert row["obs"].tolist() == obs.tolist()
            assert row["next_obs"].tolist() == next_obs.tolist()  # the final observation at an episode end
            assert int(row["action"]) == action and float(row["reward"]) == reward
            assert bool(row["terminated"]) == terminated and bool(row["truncated"]) == truncated
            assert bool(row["done"]) == (terminated or truncated)
            assert bool(row["mask"])
            expected = value_fn(torch.tensor(next_obs, dtype=torch.float32).double()).float()
            torch.testing.assert_close(row["next_value"], expected[0])
    assert any(bool(batch["done"].any()) for batch in batches)


class Linear(nn.Module):
    """A deterministic CartPole policy: action and value from one seeded linear layer (rows computed alone)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = RowwiseLinear(4, 2)

    def forward(self, obs: torch.Tensor) -> dict:
        out = self.layer(obs)
        return {"action": (out[:, 0] > 0).long(), "value": out[:, 1]}


def undeclared_cartpole(key: str = "final_observation") -> CartPole:
    envs = CartPole(N, autoreset_mode=AutoresetMode.SAME_STEP, max_episode_steps=MAX_STEPS, final_obs_key=key)
    envs.metadata = {"render_modes": []}  # gymnax's JaxToTorch: an empty metadata
    return envs


@pytest.mark.parametrize("key", ["final_obs", "final_observation"])
def test_an_undeclared_torch_env_that_resets_within_the_step_is_read_in_same_step_mode(key):
    policy = Linear()
    with pytest.warns(UserWarning, match=re.escape(WARNING)) as record:
        batches = collect(undeclared_cartpole(key), policy)
    assert sum(WARNING in str(w.message) for w in record) == 1
    twin = CartPole(N, autoreset_mode=AutoresetMode.SAME_STEP, max_episode_steps=MAX_STEPS, final_obs_key=key)
    obs, _ = twin.reset(seed=0)
    with torch.no_grad():
        for b, batch in enumerate(batches):
            for t in range(T):
                action = policy(obs)["action"]
                next_obs, reward, terminated, truncated, infos = twin.step(action)
                done = terminated | truncated
                final = torch.where(done[:, None], infos[key], next_obs)
                row = batch[t]
                torch.testing.assert_close(row["obs"], obs, rtol=0, atol=0, msg=f"obs, batch {b} row {t}")
                torch.testing.assert_close(row["next_obs"], final, rtol=0, atol=0, msg=f"next_obs, {b}, {t}")
                assert torch.equal(row["action"], action)
                assert torch.equal(row["reward"], reward)
                assert torch.equal(row["terminated"], terminated) and torch.equal(row["truncated"], truncated)
                assert torch.equal(row["done"], done)
                assert bool(row["mask"].all())
                torch.testing.assert_close(row["next_value"], policy(final)["value"], rtol=0, atol=0)
                obs = next_obs
    assert sum(int(batch["done"].sum()) for batch in batches) >= N  # every env ended an episode at least once


def test_a_declared_mode_is_read_as_declared_without_a_warning():
    envs = CartPole(N, autoreset_mode=AutoresetMode.SAME_STEP, max_episode_steps=MAX_STEPS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batches = collect(envs, Linear(), batches=2)
    assert bool(torch.cat([batch["mask"] for batch in batches]).all())


def test_an_undeclared_env_without_final_observations_is_read_in_next_step_mode():
    envs = Undeclared(counting_envs(N, AutoresetMode.NEXT_STEP))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batches = collect(envs, CountingPolicy(deterministic=True))
    assert not bool(torch.cat([batch["mask"] for batch in batches]).all())  # the reset rows are masked


CONTRADICTION = (
    "carry final observations (infos[{key!r}]), which only an env that resets ended envs within the step "
    "(SAME_STEP) gives"
)


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED], ids=lambda m: m.value)
def test_final_observations_from_a_torch_env_declared_otherwise_stop_the_batch(mode):
    envs = CartPole(N, autoreset_mode=mode, max_episode_steps=MAX_STEPS)
    step = envs.step

    def step_with_finals(actions: Any) -> tuple:
        obs, reward, terminated, truncated, infos = step(actions)
        return obs, reward, terminated, truncated, {**infos, "final_observation": obs}

    envs.step = step_with_finals
    message = CONTRADICTION.format(key="final_observation") + f", but its metadata['autoreset_mode'] is {mode.name}"
    with pytest.raises(ValueError, match=re.escape(message)):
        collect(envs, Linear())


def test_final_observations_from_a_numpy_env_declared_next_step_stop_the_batch():
    envs = Undeclared(counting_envs(N, AutoresetMode.SAME_STEP))
    envs.metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}  # declared wrongly
    message = CONTRADICTION.format(key="final_obs") + ", but its metadata['autoreset_mode'] is NEXT_STEP"
    with pytest.raises(ValueError, match=re.escape(message)):
        collect(envs, CountingPolicy(deterministic=True))
    assert len(envs.unwrapped.envs[0].log) == CountingEnv(0).length(0)  # at the first episode end, env 0's


def test_an_undeclared_numpy_env_whose_final_observations_come_after_an_episode_end_stops_the_batch():
    # Env 0's first episode lasts 3 steps: it ends before final observations appear at step 4.
    envs = Undeclared(counting_envs(N, AutoresetMode.SAME_STEP), "dense", from_step=4)
    message = (
        CONTRADICTION.format(key="final_observation")
        + ", but its metadata names no autoreset mode and an episode ended at an earlier step without final "
        "observations in the infos, so the collector reads it in NEXT_STEP mode (gymnasium's default)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        collect(envs, CountingPolicy(deterministic=True))


def test_an_undeclared_torch_env_whose_final_observations_come_after_an_episode_end_stops_the_batch():
    envs = undeclared_cartpole()
    step, steps = envs.step, []

    def step_late_finals(actions: Any) -> tuple:
        obs, reward, terminated, truncated, infos = step(actions)
        steps.append(1)
        if len(steps) <= MAX_STEPS:  # every env has ended an episode by its time limit
            infos = {}
        return obs, reward, terminated, truncated, infos

    envs.step = step_late_finals
    message = (
        "names no autoreset mode, and its step infos carried final observations only after episodes had ended "
        "without them, which the collector had read in NEXT_STEP mode (gymnasium's default); the batch is not "
        "delivered"
    )
    with pytest.warns(UserWarning, match=re.escape(WARNING)), pytest.raises(ValueError, match=re.escape(message)):
        collect(envs, Linear())


def undeclared_counting_envs(num_envs: int) -> Undeclared:
    """A recipe (for worker processes too): counting envs that reset within the step and do not say so."""
    return Undeclared(counting_envs(num_envs, AutoresetMode.SAME_STEP))


@pytest.mark.parametrize("placement", LOCAL_PLACEMENTS)
def test_collector_autoreset_mode_is_the_mode_read(placement):
    """Before any step the collector reports gymnasium's default; once the steps show SAME_STEP, it reports that."""
    options = dict(num_envs=N, num_steps=T, total_timesteps=BATCHES * T * N, seed=0, device="cpu", **placement)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the warning of the mode read (in workers: on their stderr)
        with Collector(undeclared_counting_envs, CountingPolicy(deterministic=True), **options) as collector:
            assert collector.autoreset_mode is AutoresetMode.NEXT_STEP
            batches = list(collector)
            assert any(bool(batch["done"].any()) for batch in batches)
            assert collector.autoreset_mode is AutoresetMode.SAME_STEP
    assert collector.autoreset_mode is AutoresetMode.SAME_STEP  # also once closed
