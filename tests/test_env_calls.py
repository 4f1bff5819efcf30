"""``collector.env_calls``: gymnasium's call, get_attr and set_attr on the envs, the same on every placement."""

from __future__ import annotations

import re
from functools import partial

import gymnasium
import pytest
import torch

from torch_rollout import Collector

from counting_env import CountingEnv, CountingPolicy, make_counting_envs
from env_call_envs import make_flagged_envs, make_one_answer_envs
from placements import PLACEMENTS, envs_for, num_loops
from reliability_envs import ConstantPolicy

N, T, BATCHES = 5, 6, 4  # 5 envs: two workers step 3 and 2


def _collector(placement, make_envs, prefetch, **kwargs):
    envs, extra = envs_for(placement, make_envs, N)
    return Collector(
        envs,
        CountingPolicy(deterministic=True),
        num_steps=T,
        device="cpu",
        seed=0,
        prefetch=prefetch,
        timeout=60.0,
        **placement,
        **extra,
        **kwargs,
    )


def _batches(placement, prefetch, calls):
    """Every batch of a run, with ``calls(collector, i)`` made after batch ``i`` (and ``i = -1`` before the first)."""
    batches = []
    with _collector(placement, make_counting_envs, prefetch, total_timesteps=N * T * BATCHES) as collector:
        calls(collector, -1)
        for i, batch in enumerate(collector):
            batches.append(batch.clone())
            calls(collector, i)
    return batches


def _calls(collector, i):
    envs = collector.env_calls
    assert envs.get_attr("env_id") == tuple(range(N))  # global env order, across the workers' shares
    assert envs.call("length", 0) == tuple(CountingEnv(k).length(0) for k in range(N))
    envs.set_attr("log", [[] for _ in range(N)])  # a list per env: each env gets its own
    assert envs.get_attr("log") == ([],) * N


@pytest.mark.ray(prefetch=(1,))
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("prefetch", [0, 1])
def test_batches_around_env_calls_are_those_of_a_run_without_them(placement, prefetch):
    plain = _batches(placement, prefetch, lambda collector, i: None)
    called = _batches(placement, prefetch, _calls)
    assert len(plain) == len(called) == BATCHES
    for i, (a, b) in enumerate(zip(plain, called)):
        assert a.keys() == b.keys()
        for key in a.keys(True, True):
            if key == "policy_version" and prefetch:
                continue  # collected ahead, a batch acts with the version current when its collection began: timing
            assert torch.equal(a[key], b[key]), f"batch {i}, key {key}"


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_name_the_envs_lack_raises_attribute_error_and_the_collector_goes_on(placement):
    with _collector(placement, make_counting_envs, 1, total_timesteps=N * T * 3) as collector:
        batches = iter(collector)
        next(batches)
        label = "Collector.env_calls.get_attr('nope'): envs 0.."
        with pytest.raises(AttributeError, match=re.escape(label)) as caught:
            collector.env_calls.get_attr("nope")
        assert "have no attribute 'nope'" in str(caught.value) and "wrapper" in str(caught.value)
        assert caught.value.name == "nope"
        with pytest.raises(AttributeError, match=re.escape("set_attr sets only an attribute the envs have")):
            collector.env_calls.set_attr("nope", 1)  # not added: a misspelt name would be read by nothing
        # What the env's method raises reaches the trainer as itself, naming the call and the envs.
        with pytest.raises(TypeError, match="length") as raised:
            collector.env_calls.call("length")  # its argument missing
        assert any("Collector.env_calls.call('length') on envs 0.." in note for note in raised.value.__notes__)
        assert collector.env_calls.get_attr("env_id") == tuple(range(N))
        assert len(list(batches)) == 2  # the rest, whole


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_call_waits_for_the_loop_to_stand_between_batches(placement):
    with _collector(placement, make_flagged_envs, 1, total_timesteps=N * T * 4) as collector:
        for batch in collector:  # each call comes while the next batch is collected ahead
            assert collector.env_calls.get_attr("stepping") == (False,) * N
            assert batch["obs"].shape == (T, N, 4)


@pytest.mark.parametrize("placement", [p for p in PLACEMENTS if p.id in ("thread", "process2")])
def test_envs_that_do_not_answer_per_env_are_refused(placement):
    one = "answered with one value (int), expected a tuple of"
    with _collector(placement, make_one_answer_envs, 0) as collector:
        with pytest.raises(TypeError, match=re.escape(one)):
            collector.env_calls.get_attr("env_id")
    native = partial(gymnasium.make_vec, "CartPole-v1", vectorization_mode="vector_entry_point")
    envs, extra = envs_for(placement, native, 4)
    with Collector(envs, CountingPolicy(), num_steps=T, device="cpu", **placement, **extra) as collector:
        with pytest.raises(TypeError, match=re.escape("has no get_attr() that reaches each of its envs")):
            collector.env_calls.get_attr("spec")
    if placement["backend"] == "thread":
        envs.close()


def test_set_attr_with_a_value_per_env_needs_one_per_env_and_a_closed_collector_refuses():
    placement = {"backend": "thread"}
    collector = _collector(placement, make_counting_envs, 0)
    with pytest.raises(ValueError, match=re.escape("set_attr('log'): got 2 values for 5 envs")):
        collector.env_calls.set_attr("log", [[], []])
    with pytest.raises(TypeError, match=re.escape("name must be a str")):
        collector.env_calls.get_attr(3)
    collector.close()
    with pytest.raises(
        RuntimeError, match=re.escape("Collector.env_calls.get_attr('env_id'): the collector is closed")
    ):
        collector.env_calls.get_attr("env_id")
    collector.envs.close()
    assert num_loops(placement) == 1


@pytest.mark.parametrize("name", ["step", "reset", "close"])
def test_the_loops_own_calls_are_refused(name):
    with Collector("CartPole-v1", ConstantPolicy(), num_envs=2, num_steps=2, device="cpu", backend="thread") as c:
        with pytest.raises(ValueError, match=re.escape(f"Collector.env_calls.call({name!r}): the collector's loop")):
            c.env_calls.call(name)
