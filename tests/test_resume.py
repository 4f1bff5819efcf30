"""Checkpoints: state_dict() / load_state_dict() carry a run on in a new collector, in every placement."""

from __future__ import annotations

import copy
import functools
import pickle
import re

import gymnasium
import pytest
import torch
from test_process import deterministic_cartpole_policy

from torch_rollout import Collector

from placements import PLACEMENTS, envs_for

TIMEOUT = 60.0
N, T = 4, 16
RECIPE = functools.partial(gymnasium.make_vec, "CartPole-v1", vectorization_mode="sync")


def cartpole(num_envs: int, start_index: int = 0) -> gymnasium.vector.VectorEnv:
    return RECIPE(num_envs=num_envs)


def collector(placement: dict, *, seed: int | None = 3, total_batches: int = 6, **kwargs) -> Collector:
    envs, extra = envs_for(placement, cartpole, N)
    return Collector(
        envs,
        deterministic_cartpole_policy(),
        num_steps=T,
        total_timesteps=total_batches * T * N,
        seed=seed,
        device="cpu",
        timeout=TIMEOUT,
        **placement,
        **extra,
        **kwargs,
    )


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_resumed_collector_counts_on_and_continues_the_seed_stream(placement):
    with collector(placement, prefetch=1) as first:
        batches = [next(first) for _ in range(3)]
        state = first.state_dict()
    assert state["batches"] == 3 and state["env_steps"] == 3 * T * N
    assert state["policy_version"] == first.policy_version >= int(batches[-1]["policy_version"].max())
    assert state["starts"] == 1 and state["seed"] == 3

    second = collector(placement, prefetch=1)
    with second:
        second.load_state_dict(pickle.loads(pickle.dumps(state)))
        assert second.policy_version == state["policy_version"]
        assert len(second) == 3
        rest = list(second)
        again = second.state_dict()
    assert len(rest) == 3, "with total_timesteps only the batches left of the budget are delivered"
    versions = torch.cat([b["policy_version"] for b in rest])
    # the acting copy made at construction counts as the saved version; each next() refreshes it once more
    assert int(versions.min()) >= state["policy_version"], "rows' versions go on from the saved one"
    assert state["policy_version"] < int(versions.max()) <= state["policy_version"] + 3
    assert again["batches"] == 6 and again["starts"] == 2 and again["policy_version"] == state["policy_version"] + 3

    # The second collector over seed 3 resets env j with 3 + 1 * N + j: exactly a fresh collector seeded 3 + N.
    with collector(placement, seed=3 + N, total_batches=1) as fresh:
        reference = next(fresh)
    assert torch.equal(rest[0]["obs"], reference["obs"])
    assert not torch.equal(rest[0]["obs"][0], batches[0]["obs"][0]), "the resumed run replays its first episodes"


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("start", [iter, next])
def test_load_state_dict_once_collection_started_is_refused(placement, start):
    with collector(placement, prefetch=1) as first:
        state = first.state_dict()
        start(first)  # iter() already collects ahead: a reseed would come too late for that batch
        with pytest.raises(RuntimeError, match=re.escape("must be called before iterating")):
            first.load_state_dict(state)


def test_a_state_of_another_batch_size_or_shape_is_refused():
    with collector({"backend": "thread"}) as first:
        next(first)
        state = first.state_dict()
    with collector({"backend": "thread"}) as second:
        other = {**state, "num_steps": T * 2}
        with pytest.raises(ValueError, match=re.escape(f"{T * 2} * {N} = {2 * T * N} env steps, this collector's are")):
            second.load_state_dict(other)
        with pytest.raises(ValueError, match="expected the dict of Collector.state_dict"):
            second.load_state_dict({"batches": 1})
        with pytest.raises(ValueError, match="expected the dict of Collector.state_dict"):
            second.load_state_dict({**state, "policy_version": 1.5})
        second.load_state_dict(state)  # the refused ones changed nothing
        assert second.policy_version == state["policy_version"]


def test_an_unseeded_collector_resumes_without_a_seed():
    with collector({"backend": "thread"}, seed=None) as first:
        next(first)
        state = first.state_dict()
    assert state["seed"] is None
    with collector({"backend": "thread"}, seed=None, total_batches=2) as second:
        second.load_state_dict(state)
        assert len(list(second)) == 1


@pytest.mark.parametrize("how", [pickle.dumps, copy.deepcopy, copy.copy], ids=["pickle", "deepcopy", "copy"])
def test_a_collector_cannot_be_pickled_or_copied_and_says_what_to_save(how):
    with collector({"backend": "thread"}) as c:
        with pytest.raises(TypeError, match=re.escape("save collector.state_dict() and load it into a new Collector")):
            how(c)
