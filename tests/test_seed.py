"""The seed stream keyed by rank (``torch_rollout.Seed``): the seed of every env of every rank, fresh and resumed."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch.distributed

from torch_rollout import Collector, Seed

from counting_env import CountingPolicy, logged_seeds, make_seed_envs, make_seed_log_envs
from placements import PLACEMENTS, envs_for
from reliability_envs import close_envs

N, T = 3, 4
VALUE = 10
TIMEOUT = 60.0


def first_batch(placement: dict[str, Any], seed: Any, state: dict | None = None) -> tuple[list[int], dict[str, Any]]:
    """The seeds that each env's first reset received (SeedEnv's ``obs[0]``), and the collector's state after it."""
    envs, extra = envs_for(placement, make_seed_envs, N)
    try:
        with Collector(
            envs, CountingPolicy(), num_steps=T, seed=seed, device="cpu", timeout=TIMEOUT, **placement, **extra
        ) as collector:
            if state is not None:
                collector.load_state_dict(state)
            batch = next(collector)
            return batch["obs"][0, :, 0].long().tolist(), collector.state_dict()
    finally:
        close_envs(envs)


def thread_batch(seed: Any, state: dict | None = None) -> tuple[list[int], dict[str, Any]]:
    return first_batch({"backend": "thread"}, seed, state)


@pytest.mark.parametrize("world_size", [1, 3])
def test_no_two_ranks_or_resumes_share_a_seed(world_size):
    """Env j of rank r in start k (k - 1 resumes) is seeded value + (k * world_size + r) * N + j: each seed once."""
    seen: dict[int, tuple[int, int, int]] = {}
    for rank in range(world_size):
        state = None
        for k in range(4):
            seeds, state = thread_batch(Seed(VALUE, rank=rank, world_size=world_size), state)
            assert seeds == [VALUE + (k * world_size + rank) * N + j for j in range(N)], (rank, k)
            assert state["starts"] == k + 1 and (state["rank"], state["world_size"]) == (rank, world_size)
            for j, seed in enumerate(seeds):
                assert seed not in seen, f"rank {rank} start {k} env {j} replays {seen[seed]} (rank, start, env)"
                seen[seed] = (rank, k, j)
    assert len(seen) == world_size * 4 * N


def test_one_rank_is_the_rule_of_an_int_seed():
    """seed=VALUE without a process group: rank 0 of 1, env j of start k seeded VALUE + k * N + j, as before Seed."""
    fresh, state = thread_batch(VALUE)
    assert fresh == [VALUE + j for j in range(N)]
    assert (state["seed"], state["rank"], state["world_size"]) == (VALUE, 0, 1)
    resumed, _ = thread_batch(Seed(VALUE, rank=0, world_size=1), state)
    assert resumed == [VALUE + N + j for j in range(N)]


@pytest.mark.parametrize("placement", PLACEMENTS)  # Ray's restarts: tests/test_ray.py
def test_every_placement_seeds_its_shares_from_the_rank_keyed_stream(placement):
    seed = Seed(VALUE, rank=1, world_size=2)
    fresh, state = first_batch(placement, seed)
    assert fresh == [VALUE + N + j for j in range(N)]
    resumed, _ = first_batch(placement, seed, state)
    assert resumed == [VALUE + 3 * N + j for j in range(N)]


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_no_env_is_reset_before_the_iteration_and_each_seed_once_fresh_and_resumed(placement, tmp_path):
    """The envs see the resets they get (not only the batches): none at construction, one per start of the stream."""
    seed, n = Seed(100, rank=1, world_size=2), 2
    state = None
    for k, log in enumerate(["never", "fresh", "resumed"]):
        log_dir = tmp_path / log
        log_dir.mkdir()
        envs, extra = envs_for(placement, functools.partial(make_seed_log_envs, log_dir=str(log_dir)), n)
        try:
            with Collector(
                envs, CountingPolicy(), num_steps=T, seed=seed, device="cpu", timeout=TIMEOUT, **placement, **extra
            ) as collector:
                assert logged_seeds(str(log_dir), n) == [[], []], "an env was reset at construction"
                if state is not None:
                    collector.load_state_dict(state)
                    assert logged_seeds(str(log_dir), n) == [[], []], "an env was reset by load_state_dict"
                if log != "never":
                    next(collector)
                    state = collector.state_dict()
        finally:
            close_envs(envs)
        # rank 1 of 2: start 0 resets with 102, 103; start 1 with 106, 107
        expected = [] if log == "never" else [[100 + ((k - 1) * 2 + 1) * n + j] for j in range(n)]
        assert logged_seeds(str(log_dir), n) == (expected or [[], []]), log


def test_a_state_of_another_seed_value_is_refused_naming_both_and_the_fix():
    _, state = thread_batch(Seed(VALUE, rank=1, world_size=2))
    with pytest.raises(ValueError, match=re.escape(f"saved by a collector with seed={VALUE}, but this collector has")):
        thread_batch(Seed(VALUE + 1, rank=1, world_size=2), state)
    with pytest.raises(ValueError, match=re.escape(f"(seed=torch_rollout.Seed({VALUE}, rank=1, world_size=2))")):
        thread_batch(Seed(VALUE + 1, rank=1, world_size=2), state)
    # another stream on purpose: the state without its seed; this collector's own stream, from its next part
    resumed, again = thread_batch(Seed(VALUE + 1, rank=1, world_size=2), {**state, "seed": None})
    assert resumed == [VALUE + 1 + 3 * N + j for j in range(N)]
    assert again["seed"] == VALUE + 1 and again["starts"] == 2


def test_an_int_seed_is_keyed_by_the_rank_of_an_initialised_process_group(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    seeds, state = thread_batch(VALUE)
    assert seeds == [VALUE + N + j for j in range(N)]
    assert (state["rank"], state["world_size"]) == (1, 2)
    assert Seed(VALUE, world_size=4).resolved() == Seed(VALUE, rank=1, world_size=4)  # a given field wins
    # said explicitly, another stream than the group's (e.g. collectors that must replay the same episodes)
    assert thread_batch(Seed(VALUE, rank=0, world_size=1))[0] == [VALUE + j for j in range(N)]
    with pytest.raises(ValueError, match=re.escape("got rank=1 (torch.distributed's) with world_size=1 (given)")):
        Seed(VALUE, world_size=1).resolved()


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: Seed("1"), TypeError, "Seed: value must be an int >= 0, got str '1'"),
        (lambda: Seed(-1), ValueError, "Seed: value must be an int >= 0, got -1"),
        (lambda: Seed(1, rank=True), TypeError, "Seed: rank must be an int >= 0 or None, got bool True"),
        (lambda: Seed(1, rank=-1), ValueError, "Seed: rank must be an int >= 0, got -1"),
        (lambda: Seed(1, world_size=0), ValueError, "Seed: world_size must be an int >= 1, got 0"),
        (
            lambda: Seed(1, rank=2, world_size=2),
            ValueError,
            "Seed: rank must be in [0, world_size), got rank=2 with world_size=2; ranks of 2 collectors are 0..1",
        ),
        (
            lambda: Seed(1, rank=1).resolved(),
            ValueError,
            "Seed: rank must be in [0, world_size), got rank=1 (given) with world_size=1 (no process group); "
            "give both, e.g. Seed(1, rank=1, world_size=2)",
        ),
    ],
    ids=["value-type", "value-negative", "rank-bool", "rank-negative", "world-size-0", "rank-too-big", "no-group"],
)
def test_bad_seeds_are_named(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make()


@pytest.mark.parametrize(
    ("seed", "error", "message"),
    [
        ("3", TypeError, "Collector: seed must be an int >= 0, a torch_rollout.Seed(value, rank=..., world_size=...) "),
        (True, TypeError, "Collector: seed must be an int >= 0, a torch_rollout.Seed"),
        (-1, ValueError, "Collector: seed must be an int >= 0, got -1"),
        (Seed(1, rank=1), ValueError, "Seed: rank must be in [0, world_size), got rank=1 (given)"),
    ],
    ids=["str", "bool", "negative", "rank-without-world-size"],
)
def test_the_collector_refuses_a_bad_seed_before_building_anything(seed, error, message):
    with pytest.raises(error, match=re.escape(message)):
        Collector("CartPole-v1", CountingPolicy(), num_envs=2, num_steps=T, seed=seed, backend="thread")


def test_a_state_of_another_rank_or_world_size_is_refused_naming_both_and_the_fix():
    _, state = thread_batch(Seed(VALUE, rank=0, world_size=2))
    fix = "resume with the same seeding as the saved run, the same number of ranks each loading its own rank's state"
    with pytest.raises(ValueError, match=re.escape("saved by rank 0 of world_size 2, but this collector is rank 1 of")):
        thread_batch(Seed(VALUE, rank=1, world_size=2), state)
    with pytest.raises(ValueError, match=re.escape(f"is rank 0 of world_size 1 (Seed(value={VALUE}, rank=0, w")):
        thread_batch(VALUE, state)
    with pytest.raises(ValueError, match=re.escape(fix)) as info:
        thread_batch(Seed(VALUE, rank=0, world_size=3), state)
    assert f"seed=torch_rollout.Seed({VALUE}, rank=0, world_size=2)" in str(info.value)
    with pytest.raises(ValueError, match="expected the dict of Collector.state_dict"):
        thread_batch(VALUE, {**state, "rank": "0"})
    # unseeded, there is no stream to keep apart: any rank carries on
    _, unseeded = thread_batch(None)
    thread_batch(None, {**unseeded, "rank": 1, "world_size": 2})


def test_a_state_of_an_earlier_release_loads_as_rank_0_of_1():
    _, state = thread_batch(VALUE)
    old = {key: value for key, value in state.items() if key not in ("rank", "world_size")}
    resumed, again = thread_batch(VALUE, old)
    assert resumed == [VALUE + N + j for j in range(N)]
    assert again["starts"] == 2
    with pytest.raises(ValueError, match=re.escape("saved by rank 0 of world_size 1, but this collector is rank 1")):
        thread_batch(Seed(VALUE, rank=1, world_size=2), old)
