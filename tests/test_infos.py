"""Env infos in the batch (``info_keys``): exact per row in every autoreset mode and placement, and clear errors."""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv

from torch_rollout import BatchKeys, Collector

from counting_env import TransitionCountingEnv, TransitionCountingPolicy
from placements import PLACEMENTS, envs_for
from reliability_envs import AUTORESET_MODES

N, T, BATCHES = 3, 7, 4  # T is prime to every episode length: episode ends fall on batch boundaries too
TIMEOUT = 60.0


class InfoEnv(TransitionCountingEnv):
    """TransitionCountingEnv with infos: ``k`` (the step's reward) and ``flags`` each step, ``ended`` at episode ends.

    Its reset gives ``k=-1`` and ``flags`` too, so a row that took the reset's
    infos (NEXT_STEP reset rows, SAME_STEP top level) would show it.
    """

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        obs, _ = super().reset(seed=seed, options=options)
        self.episode_sum = 0.0
        return obs, {"k": -1, "flags": {"terminated": True, "t": -1}}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated, _ = super().step(action)
        self.episode_sum += reward
        info = {"k": int(reward), "flags": {"terminated": terminated, "t": self.t}}
        if terminated or truncated:
            info["ended"] = {"length": self.t, "sum": self.episode_sum}
        return obs, reward, terminated, truncated, info


def info_env(index: int, *, wrap: bool = True) -> gymnasium.Env:
    """An InfoEnv, with RecordEpisodeStatistics (its "episode" info in the sub-env's step infos) when ``wrap``."""
    env = InfoEnv(index)
    return gymnasium.wrappers.RecordEpisodeStatistics(env) if wrap else env


def info_vec(
    num_envs: int, start_index: int = 0, *, mode: AutoresetMode = AutoresetMode.NEXT_STEP, wrap: bool = True
) -> VectorEnv:
    """InfoEnvs; with ``wrap``, RecordEpisodeStatistics per env and for the vector env, beneath NormalizeReward."""
    fns = [partial(info_env, start_index + i, wrap=wrap) for i in range(num_envs)]
    envs = SyncVectorEnv(fns, autoreset_mode=mode)
    if wrap:
        # Its "vepisode" info is at the top level of the step infos, also in SAME_STEP mode.
        envs = gymnasium.wrappers.vector.RecordEpisodeStatistics(envs, stats_key="vepisode")
        envs = gymnasium.wrappers.vector.NormalizeReward(envs)
    return envs


EPISODE = {"r": 0.0, "l": 0, "t": 0.0}
INFO_KEYS = {"k": None, "flags": None, "ended": {"length": 0, "sum": 0.0}, "episode": None, "vepisode": EPISODE}


def collect(placement: dict, mode: AutoresetMode, **kwargs: Any) -> list:
    envs, extra = envs_for(placement, partial(info_vec, mode=mode), N)
    with Collector(
        envs,
        TransitionCountingPolicy(),
        num_steps=T,
        total_timesteps=T * N * BATCHES,
        device="cpu",
        seed=0,
        timeout=TIMEOUT,
        **placement,
        **extra,
        **kwargs,
    ) as collector:
        return [batch.clone() for batch in collector]


@pytest.mark.ray(mode=(AutoresetMode.NEXT_STEP,))
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("mode", AUTORESET_MODES, ids=lambda m: m.value)
def test_infos_are_those_of_each_rows_step(mode, placement):
    batches = collect(placement, mode, keys=BatchKeys(info_keys=INFO_KEYS))
    for batch in batches:
        info, real = batch["info"], batch["mask"]
        done = batch["done"] & real
        assert info.batch_size == (T, N)
        assert sorted(info.keys()) == sorted(f"{p}{key}" for key in INFO_KEYS for p in ("", "_"))
        obs_t, k = batch["obs"][..., 2], batch["obs"][..., 3]
        # Every real step gave k and flags; NEXT_STEP reset rows took the reset's and are masked out.
        assert torch.equal(info["_k"], real) and torch.equal(info["_flags"], real)
        assert torch.equal(info["k"], torch.where(real, k.long(), 0)) and info["k"].dtype == torch.int64
        assert torch.equal(info["flags", "terminated"], batch["terminated"] & real)
        assert torch.equal(info["flags", "t"], torch.where(real, obs_t.long() + 1, 0))
        # At episode ends only: the sub-envs' own (in SAME_STEP from final_info) and the vector wrapper's (top level).
        # gymnasium 1.4's vector RecordEpisodeStatistics is wrong in DISABLED mode (SyncVectorEnv.reset pops
        # options["reset_mask"] before the wrapper reads it, so it resets every env's statistics): not checked.
        stats = ["ended", "episode"] + (["vepisode"] if mode != AutoresetMode.DISABLED else [])
        length = batch["episode_length"].float()
        raw_return = length * (2 * k - length + 1) / 2  # k, k - 1, ..., k - length + 1: the env's rewards
        for key in stats:
            assert torch.equal(info["_" + key], done), key
            for sub, want in (
                [("length", length), ("sum", raw_return)] if key == "ended" else [("l", length), ("r", raw_return)]
            ):
                assert torch.equal(info[key, sub].float(), torch.where(done, want, 0.0)), (key, sub)
        assert info["episode", "r"].dtype == torch.float32 and info["episode", "l"].dtype == torch.int64
        assert (info["episode", "t"][done] >= 0).all()
    # NormalizeReward scales the collector's episode_return, not the env's return kept by the info.
    rows = [
        (b["info", "episode", "r"][b["info", "_episode"]], b["episode_return"][b["info", "_episode"]]) for b in batches
    ]
    raw, scaled = (torch.cat(x) for x in zip(*rows))
    assert raw.numel() >= 10 and not torch.allclose(raw, scaled)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_info_key_that_the_env_never_gives_is_named(placement):
    envs, extra = envs_for(placement, partial(info_vec, wrap=False), N)
    message = (
        re.escape("Collector: info_keys names 'is_success', but the infos of envs ")
        + r"\d\.\.\d"  # a worker's share
        + re.escape(
            " have no 'is_success' at their first reset and first step (their keys: ['flags', 'k']); for an info"
        )
    )
    with pytest.raises(ValueError, match=message):
        collector = Collector(
            envs,
            TransitionCountingPolicy(),
            num_steps=T,
            device="cpu",
            timeout=TIMEOUT,
            keys=BatchKeys(info_keys=("k", "is_success")),
            **placement,
            **extra,
        )
        with collector:
            next(iter(collector))
    if placement["backend"] == "thread":
        envs.close()


class ChangingInfoEnv(TransitionCountingEnv):
    """Gives ``x`` as a float at first, as an array of 2 from its third step on (env 1 first: env 0 resets first)."""

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, {"x": 0.5 if self.k < 3 else np.zeros(2)}


def test_info_whose_structure_changes_is_named():
    envs = SyncVectorEnv([partial(ChangingInfoEnv, i) for i in range(2)])
    message = (
        "Collector: envs.step() returned info 'x' for env 1 as dtype float64[2], but its structure was fixed as "
        "float32 when collection started"
    )
    with Collector(
        envs, TransitionCountingPolicy(), num_steps=T, device="cpu", backend="thread", keys=BatchKeys(info_keys=["x"])
    ) as collector:
        with pytest.raises(ValueError, match=re.escape(message)):
            next(iter(collector))
    envs.close()


def test_episode_info_comes_with_its_structure_before_any_episode_ended():
    envs = gymnasium.wrappers.vector.RecordEpisodeStatistics(
        SyncVectorEnv([partial(TransitionCountingEnv, i) for i in range(2)])
    )
    with Collector(
        envs,
        TransitionCountingPolicy(),
        num_steps=1,
        device="cpu",
        backend="thread",
        keys=BatchKeys(info_keys=["episode"]),
    ) as c:
        info = next(iter(c))["info"]
    assert not info["_episode"].any() and info["episode"].batch_size == (1, 2)
    assert {key: info["episode", key].dtype for key in "rlt"} == {
        "r": torch.float32,
        "l": torch.int64,
        "t": torch.float32,
    }
    envs.close()


@pytest.mark.parametrize(
    ("info_keys", "error", "message"),
    [
        ("episode", TypeError, "got str 'episode'; write info_keys=('episode',)"),
        (3, TypeError, "Collector: info_keys must be a sequence of info key names or a mapping"),
        (["k", "k"], ValueError, "Collector: info_keys names a key twice: ['k', 'k']"),
        (["_k"], ValueError, "Collector: info_keys cannot name '_k'"),
        (["final_info"], ValueError, "Collector: info_keys cannot name 'final_info'"),
        ({"name": "text"}, TypeError, "Collector: info 'name' example 'text' is of dtype <U4"),
        ({"e": {}}, ValueError, "Collector: info_keys example of 'e' is an empty dict"),
    ],
    ids=["str", "int", "twice", "mask", "final-info", "str-example", "empty-dict"],
)
def test_bad_info_keys_are_named(info_keys, error, message):
    with pytest.raises(error, match=re.escape(message)):
        Collector(
            "CartPole-v1",
            TransitionCountingPolicy(),
            num_envs=1,
            num_steps=1,
            backend="thread",
            keys=BatchKeys(info_keys=info_keys),
        )


class TextInfoEnv(TransitionCountingEnv):
    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, {"name": "abc"}


def test_info_that_is_not_a_number_is_named():
    envs = SyncVectorEnv([partial(TextInfoEnv, i) for i in range(2)])
    message = "Collector: info 'name' holds str values (a NumPy object array); the batch keeps numbers"
    with Collector(
        envs,
        TransitionCountingPolicy(),
        num_steps=T,
        device="cpu",
        backend="thread",
        keys=BatchKeys(info_keys=["name"]),
    ) as collector:
        with pytest.raises(TypeError, match=re.escape(message)):
            next(iter(collector))
    envs.close()
