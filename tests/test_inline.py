"""Lockstep collection in the caller's thread, and batch storage written again once the trainer lets go of it.

With ``prefetch=0`` and no ``timeout`` the thread backend collects each batch
inside ``next()``, in the calling thread. Batches on the CPU (thread backend)
are views of storage that the collector writes again for a later batch once
nothing refers to it any more; a trainer that keeps batches, tensors of them,
views or NumPy arrays keeps them intact.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from torch import nn

from torch_rollout import BatchKeys, Collector

from counting_env import TransitionCountingEnv, TransitionCountingPolicy, counting_vec
from reliability_envs import collector_threads

T, N = 4, 2


class WhereCalled(nn.Module):
    """TransitionCountingPolicy that also records the thread and the intra-op thread count of each forward.

    In a list of the class, which the collector's copy of the policy (``prefetch >= 1``) shares.
    """

    calls: list[tuple[threading.Thread, int]] = []

    def __init__(self) -> None:
        super().__init__()
        self.inner = TransitionCountingPolicy()
        WhereCalled.calls.clear()

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls.append((threading.current_thread(), torch.get_num_threads()))
        return self.inner(obs)


def test_lockstep_collects_in_the_callers_thread_with_its_torch_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        policy = WhereCalled()
        with Collector(counting_vec(N), policy, num_steps=T, device="cpu", backend="thread", prefetch=0) as collector:
            assert collector_threads() == []
            for _, _ in zip(range(3), collector):
                assert collector_threads() == []
        assert {thread for thread, _ in policy.calls} == {threading.current_thread()}
        assert {threads for _, threads in policy.calls} == {2}
    finally:
        torch.set_num_threads(previous)


def test_a_timeout_or_prefetch_collects_on_the_background_thread():
    for options in ({"prefetch": 0, "timeout": 60.0}, {"prefetch": 1}):
        policy = WhereCalled()
        with Collector(counting_vec(N), policy, num_steps=T, device="cpu", backend="thread", **options) as collector:
            next(iter(collector))
            assert len(collector_threads()) == 1
        assert {thread.name for thread, _ in policy.calls} == {"torch_rollout-collector"}, options
        assert {threads for _, threads in policy.calls} == {1}


# -- storage written again -------------------------------------------------------------------------


def _counting(mode: AutoresetMode) -> SyncVectorEnv:
    return counting_vec(N, mode=mode)


def _torch_cartpole(mode: AutoresetMode) -> gym.vector.VectorEnv:
    return gym.make_vec("torch_rollout/CartPole-v1", num_envs=N, device="cpu", autoreset_mode=mode)


class Greedy(nn.Module):
    """A fixed linear policy acting greedily, with a value: the same rollouts on every run from one seed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        with torch.no_grad():
            self.linear.weight.copy_(torch.arange(12.0).reshape(3, 4).sin())
            self.linear.bias.zero_()

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.linear(obs)
        return {"action": out[:, :2].argmax(-1), "value": out[:, 2]}


def _policy(envs: gym.vector.VectorEnv) -> nn.Module:
    return Greedy() if envs.unwrapped.__class__.__module__.startswith("torch_rollout") else TransitionCountingPolicy()


def _batches(make_envs, mode, num_steps, prefetch, keep):
    """Ten batches, as a trainer that ``keep``s them ("batch", "tensors", "views", "numpy") or copies each one."""
    envs = make_envs(mode)
    options = dict(num_steps=num_steps, device="cpu", backend="thread", prefetch=prefetch, seed=3)
    copies, kept, pointers = [], [], []
    with Collector(envs, _policy(envs), keys=BatchKeys(next_obs=True), **options) as collector:
        for _, batch in zip(range(10), collector):
            pointers.append(batch["obs"].data_ptr())
            copies.append(batch.clone())
            if keep == "batch":
                kept.append(batch)
            elif keep == "tensors":
                kept.append({key: batch[key] for key in ("obs", "reward", "next_obs", "next_value")})
            elif keep == "views":
                kept.append({key: batch[key][:] for key in ("obs", "reward", "next_obs", "next_value")})
            elif keep == "numpy":
                kept.append({key: batch[key].numpy() for key in ("obs", "reward", "next_obs", "next_value")})
    envs.close()
    return copies, kept, pointers


ENVS = [pytest.param(_counting, id="numpy"), pytest.param(_torch_cartpole, id="torch")]
MODES = [pytest.param(mode, id=mode.value) for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP)]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("num_steps", [1, 8])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make_envs", ENVS)
def test_batches_kept_in_any_form_stay_intact_and_batches_let_go_of_are_written_again(
    make_envs, mode, num_steps, prefetch
):
    reference, _, reused = _batches(make_envs, mode, num_steps, prefetch, keep=None)
    # A trainer that copies each batch out and lets go of it: the collector writes the same storage again.
    assert len(set(reused)) <= prefetch + 2 < len(reused)
    for keep in ("batch", "tensors", "views", "numpy"):
        copies, kept, pointers = _batches(make_envs, mode, num_steps, prefetch, keep)
        assert len(set(pointers)) == len(pointers), keep  # nothing kept was written again
        for b, (expected, copy, held) in enumerate(zip(reference, copies, kept)):
            # The same rollouts as the trainer that copies (the weights' version of a row depends on timing).
            assert (copy.exclude("policy_version") == expected.exclude("policy_version")).all(), (keep, b)
            for key in ("obs", "reward", "next_obs", "next_value"):
                now = torch.as_tensor(held[key])
                assert torch.equal(now, expected[key]), (keep, b, key)


ALL_MODES = [pytest.param(mode, id=mode.value) for mode in AutoresetMode]


@pytest.mark.parametrize("num_steps", [1, 5])
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("make_envs", ENVS)
def test_batches_collected_in_the_callers_thread_equal_the_background_threads(make_envs, mode, num_steps):
    """The same loop in either thread: every key of every batch equal to the daemon thread's (``timeout`` set),
    which the exactness tests check against the envs' own counts."""
    runs = []
    for timeout in (None, 60.0):
        envs = make_envs(mode)
        options = dict(num_steps=num_steps, device="cpu", backend="thread", prefetch=0, seed=3, timeout=timeout)
        keys = BatchKeys(next_obs=True)
        with Collector(envs, _policy(envs), keys=keys, total_timesteps=12 * num_steps * N, **options) as collector:
            runs.append([batch.clone() for batch in collector])
        envs.close()
    inline, thread = runs
    assert len(inline) == len(thread) == 12
    for b, (got, expected) in enumerate(zip(inline, thread)):
        assert set(got.keys(True, True)) == set(expected.keys(True, True))
        for key in expected.keys(True, True):
            assert torch.equal(got[key], expected[key]), (b, key)


def test_rows_of_the_counting_env_read_every_transition_once_with_storage_written_again():
    with Collector(counting_vec(N), TransitionCountingPolicy(), num_steps=3, device="cpu", prefetch=0) as collector:
        copies = [batch.clone() for _, batch in zip(range(12), collector)]
    mask, reward = torch.cat([b["mask"] for b in copies]), torch.cat([b["reward"] for b in copies])
    for i in range(N):
        got = reward[:, i][mask[:, i]]
        assert torch.equal(got, torch.arange(len(got), dtype=got.dtype))


# -- Ctrl-C during a batch collected in the caller's thread ----------------------------------------


class InterruptingEnv(TransitionCountingEnv):
    """Sends this process SIGINT (Ctrl-C) at the steps ``at`` (its ``k``), from inside ``step``."""

    def __init__(self, index: int = 0, *, at: tuple[int, ...] = ()) -> None:
        super().__init__(index)
        self.at = at

    def step(self, action):
        if self.k in self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return super().step(action)


@pytest.fixture
def default_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupting(at: tuple[int, ...]) -> SyncVectorEnv:
    """In SAME_STEP mode, where every row is a step: env 0's step ``k`` is in batch ``k // T``."""
    fns = [partial(InterruptingEnv, 0, at=at), partial(TransitionCountingEnv, 1)]
    return SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)


def test_ctrl_c_inside_a_batch_is_raised_at_its_end_and_the_batch_comes_next(default_sigint):
    envs = _interrupting(at=(5, 13))  # env 0's steps 5 and 13: inside the second and the fourth batch
    batches = []
    with Collector(envs, TransitionCountingPolicy(), num_steps=T, device="cpu", prefetch=0) as collector:
        interrupts = 0
        while len(batches) < 5:
            try:
                batches.append(next(collector))
            except KeyboardInterrupt:
                interrupts += 1
                steps = envs.envs[0].k
                batches.append(next(collector))
                assert envs.envs[0].k == steps  # raised once the batch was complete: no step more to return it
    envs.close()
    assert interrupts == 2
    mask, reward = torch.cat([b["mask"] for b in batches]), torch.cat([b["reward"] for b in batches])
    for i in range(N):  # no batch lost, none collected twice
        got = reward[:, i][mask[:, i]]
        assert torch.equal(got, torch.arange(len(got), dtype=got.dtype))


def test_a_second_ctrl_c_inside_a_batch_interrupts_at_once_and_the_collector_says_it_cannot_go_on(default_sigint):
    envs = _interrupting(at=(5, 6))  # both inside the second batch
    with Collector(envs, TransitionCountingPolicy(), num_steps=T, device="cpu", prefetch=0) as collector:
        next(collector)
        with pytest.raises(KeyboardInterrupt):
            next(collector)
        assert envs.envs[0].k == 6  # interrupted at once, inside the step that sent the second signal
        with pytest.raises(RuntimeError, match=re.escape("a second Ctrl-C interrupted a batch in the middle")):
            next(collector)
        with pytest.raises(RuntimeError, match="create a new Collector"):
            next(collector)
    envs.close()


def test_an_ignored_or_custom_sigint_handler_is_left_as_it_is():
    seen = []
    for handler in (signal.SIG_IGN, lambda signum, frame: seen.append(signum)):
        previous = signal.signal(signal.SIGINT, handler)
        try:
            envs = _interrupting(at=(1,))
            with Collector(envs, TransitionCountingPolicy(), num_steps=T, device="cpu", prefetch=0) as collector:
                batch = next(collector)
                assert signal.getsignal(signal.SIGINT) is handler
            envs.close()
            assert batch["reward"].shape == (T, N)
        finally:
            signal.signal(signal.SIGINT, previous)
    assert seen == [signal.SIGINT]  # the custom handler ran once, after the batch


def test_lockstep_from_a_thread_that_is_not_the_main_one_collects_there():
    results = []

    def train():
        policy = WhereCalled()
        with Collector(counting_vec(N), policy, num_steps=T, device="cpu", prefetch=0) as collector:
            results.append(np.asarray(next(collector)["reward"]).shape)
        results.append({thread for thread, _ in policy.calls})

    worker = threading.Thread(target=train)
    worker.start()
    worker.join(60)
    assert results[0] == (T, N)
    assert results[1] == {worker}
