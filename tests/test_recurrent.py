"""Recurrent policies, the acting mode and value-only bootstraps, checked row by row on CountingEnv."""

from __future__ import annotations

import re
from functools import partial

import gymnasium as gym
import pytest
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict

from torch_rollout import Collector, Processes

from counting_env import make_counting_envs, value_fn
from placements import PLACEMENTS, envs_for
from recurrent_policies import (
    CallCountingPolicy,
    CallCountingValuePolicy,
    ModeProbePolicy,
    StepCountingPolicy,
    StepCountingValuePolicy,
    steps_state,
    torchrl_recurrent_policy,
)

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
MODE_IDS = ["next_step", "same_step", "disabled"]
NUM_ENVS, NUM_STEPS, NUM_BATCHES = 3, 5, 4


def collect(placement, mode, policy, *, prefetch, num_batches=NUM_BATCHES, **kwargs):
    envs, extra = envs_for(placement, partial(make_counting_envs, mode=mode), NUM_ENVS)
    total = NUM_STEPS * NUM_ENVS * num_batches
    with Collector(
        envs,
        policy,
        num_steps=NUM_STEPS,
        total_timesteps=total,
        prefetch=prefetch,
        device="cpu",
        seed=0,
        **placement,
        **extra,
        **kwargs,
    ) as collector:
        batches = list(collector)
    assert len(batches) == num_batches
    return batches


def values(obs: torch.Tensor) -> torch.Tensor:
    """value_fn of observations of any leading shape, in float32 as stored."""
    return value_fn(obs).reshape(obs.shape[:-1]).float()


def true_next_obs(obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """CountingEnv's next observation of a real step, final observations included: [env, episode, step + 1, action]."""
    nxt = obs.clone()
    nxt[..., 2] += 1
    nxt[..., 3] = action.to(obs.dtype)
    return nxt


# ---------------------------------------------------------------------------- recurrent state


@pytest.mark.ray(policy_cls=(StepCountingValuePolicy,), mode=(AutoresetMode.SAME_STEP,), prefetch=(1,))
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("policy_cls", [StepCountingValuePolicy, StepCountingPolicy], ids=["get_value", "forward"])
def test_state_counts_steps_since_episode_start_on_every_row(policy_cls, mode, prefetch, placement):
    """The state that went into each row is the env's step in its episode: reset at every start, carried across
    batch boundaries and never advanced by a bootstrap; bootstraps value with the state of the observation."""
    batches = collect(placement, mode, policy_cls(), prefetch=prefetch, initial_state=steps_state)
    for b, batch in enumerate(batches):
        obs, steps = batch["obs"], batch["steps"]
        assert steps.shape == (NUM_STEPS, NUM_ENVS, 1) and batch["is_init"].dtype == torch.bool
        # Every row, NEXT_STEP's reset rows included (they see the ended episode's state).
        assert torch.equal(steps[..., 0], obs[..., 2]), f"batch {b}"
        assert torch.equal(batch["is_init"], obs[..., 2] == 0), f"batch {b}"
        # Acting values and bootstrap values were computed with the state of their observation.
        assert torch.allclose(batch["value"], values(obs))
        real = batch["mask"]
        expected = values(true_next_obs(obs, batch["action"]))
        assert torch.allclose(batch["next_value"][real], expected[real]), f"batch {b}"
    assert sum(int(batch["is_init"].sum()) for batch in batches) >= NUM_ENVS + 3  # episode starts were seen


def test_state_rows_replay_a_sequence_from_any_row():
    """Truncated BPTT: from the stored state at any row, the policy's own steps give the stored states that follow."""
    (batch,) = collect(
        {"backend": "thread"},
        AutoresetMode.SAME_STEP,
        StepCountingValuePolicy(),
        prefetch=0,
        num_batches=1,
        initial_state=steps_state,
    )
    policy, initial = StepCountingValuePolicy(), steps_state(NUM_ENVS)
    for start in range(NUM_STEPS):
        state = batch[start].select("steps")
        for t in range(start, NUM_STEPS):
            is_init = batch["is_init"][t]
            state = TensorDict({"steps": torch.where(is_init[:, None], initial["steps"], state["steps"])}, [NUM_ENVS])
            assert torch.equal(state["steps"], batch["steps"][t])
            state = TensorDict(policy(batch["obs"][t], state, is_init)["next_state"], [NUM_ENVS])


def test_initial_state_as_a_tensordict_gives_each_env_its_row():
    """A TensorDict initial state: env i starts (and restarts) from row i, in worker processes too."""
    start = TensorDict({"steps": torch.tensor([[10.0], [20.0], [30.0]])}, batch_size=[3])
    placement = {"backend": Processes(2)}
    batches = collect(
        placement, AutoresetMode.NEXT_STEP, StepCountingValuePolicy(), prefetch=1, initial_state=start, num_batches=2
    )
    steps = torch.cat([batch["steps"][..., 0] for batch in batches])
    obs = torch.cat([batch["obs"] for batch in batches])
    offset = torch.tensor([10.0, 20.0, 30.0])
    assert torch.equal(steps, obs[..., 2] + offset)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_torchrl_recurrent_modules_through_the_tensordict_path(kind, mode, placement):
    """TorchRL's LSTMModule and GRUModule read "is_init" and their recurrent-state keys and write ("next", key); each
    stored state is the module's next state of the row before, or zeros where an episode starts, across batches."""
    pytest.importorskip("torchrl")
    hidden = 8
    keys = ["recurrent_state_h", "recurrent_state_c"] if kind == "lstm" else ["recurrent_state"]
    initial = TensorDict({key: torch.zeros(NUM_ENVS, 1, hidden) for key in keys}, [NUM_ENVS])
    policy = torchrl_recurrent_policy(kind, hidden)
    batches = collect(placement, mode, policy, prefetch=1, initial_state=initial)
    rows = torch.cat(list(batches))  # [B * T, N]
    assert rows[keys[0]].shape == (NUM_BATCHES * NUM_STEPS, NUM_ENVS, 1, hidden)
    assert "next" not in rows.keys() and "features" in rows.keys()
    assert torch.equal(rows["is_init"], rows["obs"][..., 2] == 0)
    with torch.no_grad():
        replayed = policy(rows.select("obs", *keys).set("is_init", rows["is_init"].unsqueeze(-1)))
    for key in keys:
        stored, following = rows[key], replayed["next", key]
        start = rows["is_init"][1:]
        assert torch.allclose(stored[1:][~start], following[:-1][~start], atol=1e-6), key
        assert not stored[1:][start].any() and start.any(), key
        assert torch.allclose(replayed["value"], rows["value"], atol=1e-6)


# ---------------------------------------------------------------------------- value-only bootstraps


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_bootstraps_with_get_value_make_no_forward_call(mode, placement):
    """Acting calls are numbered 1, 2, 3, ... row after row in each copy of the policy: no bootstrap in between."""
    batches = collect(placement, mode, CallCountingValuePolicy(), prefetch=1)
    calls = torch.cat([batch["call"] for batch in batches])  # [B * T, N]
    rows = torch.arange(1, len(calls) + 1)
    for i in range(NUM_ENVS):
        assert torch.equal(calls[:, i], rows), f"env {i}"
    # The values still bootstrap: the next value of a real row is that of its true next observation.
    for batch in batches:
        real = batch["mask"]
        expected = values(true_next_obs(batch["obs"], batch["action"]))
        assert torch.allclose(batch["next_value"][real], expected[real])


def test_bootstraps_without_get_value_call_the_forward():
    """The negative of the test above: a policy without get_value is called for the bootstraps too."""
    batches = collect({"backend": "thread"}, AutoresetMode.SAME_STEP, CallCountingPolicy(), prefetch=0)
    calls = torch.cat([batch["call"] for batch in batches])[:, 0]
    assert (calls[1:] - calls[:-1] > 1).any()


@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
def test_torch_rng_stream_of_acting_calls_is_that_of_a_plain_loop(prefetch):
    """With get_value the actions are those of a loop that calls the policy once per step and never bootstraps."""
    mode = AutoresetMode.SAME_STEP  # bootstraps at every episode end and at every batch end
    torch.manual_seed(0)
    batches = collect({"backend": "thread"}, mode, CallCountingValuePolicy(), prefetch=prefetch)
    actions = torch.cat([batch["action"] for batch in batches])

    torch.manual_seed(0)
    envs, policy = make_counting_envs(NUM_ENVS, mode), CallCountingValuePolicy()
    obs, _ = envs.reset(seed=0)
    plain = []
    for _ in range(len(actions)):
        with torch.no_grad():
            action = policy(torch.as_tensor(obs, dtype=torch.float32))["action"]
        plain.append(action)
        obs, *_ = envs.step(action.numpy())
    envs.close()
    assert torch.equal(actions, torch.stack(plain))

    torch.manual_seed(0)  # and without get_value the bootstraps draw from the stream
    batches = collect({"backend": "thread"}, mode, CallCountingPolicy(), prefetch=prefetch)
    assert not torch.equal(torch.cat([batch["action"] for batch in batches]), actions)


# ---------------------------------------------------------------------------- acting mode


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
def test_acting_runs_in_eval_mode_and_leaves_the_trainers_module_as_it_was(prefetch, placement):
    policy = ModeProbePolicy().train()
    policy.frozen.eval()
    modes = {name: module.training for name, module in policy.named_modules()}
    buffers = {name: buffer.clone() for name, buffer in policy.named_buffers()}
    # SAME_STEP: bootstraps of a single env, which a BatchNorm in training mode would refuse.
    batches = collect(placement, AutoresetMode.SAME_STEP, policy, prefetch=prefetch)
    for batch in batches:
        assert not batch["training"].any()
    assert {name: module.training for name, module in policy.named_modules()} == modes
    for name, buffer in policy.named_buffers():
        assert torch.equal(buffer, buffers[name]), name


def test_acting_on_the_trainers_module_sees_submodules_it_added_or_replaced_between_batches():
    """prefetch=0 acts with the trainer's module itself: a submodule replaced, added or deleted between batches
    (in training mode) acts in eval mode too, and is left in training mode."""
    policy = ModeProbePolicy().train()
    with Collector(
        make_counting_envs(NUM_ENVS, mode=AutoresetMode.SAME_STEP),
        policy,
        num_steps=NUM_STEPS,
        device="cpu",
        backend="thread",
        prefetch=0,
        seed=0,
    ) as collector:
        assert not next(collector)["training"].any()
        policy.drop = torch.nn.Dropout(0.5)  # replaced: a new module in training mode
        assert not next(collector)["training"].any()
        policy.norm.extra = torch.nn.Dropout(0.5)  # added below a module already listed
        policy.drop = torch.nn.Sequential(torch.nn.Dropout(0.5))  # a new tree in its place
        assert not next(collector)["training"].any()
        del policy.norm.extra
        assert not next(collector)["training"].any()
    assert policy.drop.training and policy.drop[0].training and policy.norm.training


def test_a_batch_that_fails_leaves_the_trainers_module_in_the_modes_it_had():
    """prefetch=0 switches the trainer's module to eval mode once for the batch: an env that raises mid-batch
    still gets its modes put back."""

    class Failing(gym.vector.SyncVectorEnv):
        steps = 0

        def step(self, actions):  # type: ignore[no-untyped-def]
            Failing.steps += 1
            if Failing.steps == 3:
                assert not policy.training  # inside the batch: in eval mode
                raise RuntimeError("the env broke")
            return super().step(actions)

    policy = ModeProbePolicy().train()
    policy.frozen.eval()
    modes = {name: module.training for name, module in policy.named_modules()}
    envs = Failing([lambda: gym.make("CartPole-v1")] * 2, autoreset_mode=AutoresetMode.SAME_STEP)
    with Collector(envs, policy, num_steps=4, device="cpu", backend="thread", prefetch=0) as collector:
        with pytest.raises(RuntimeError, match="the env broke"):
            next(collector)
    assert Failing.steps == 3
    assert {name: module.training for name, module in policy.named_modules()} == modes


# ---------------------------------------------------------------------------- errors


def _thread_collector(policy, initial_state):
    return Collector(
        make_counting_envs(2),
        policy,
        num_steps=3,
        total_timesteps=6,
        device="cpu",
        backend="thread",
        initial_state=initial_state,
    )


@pytest.mark.parametrize(
    ("initial_state", "error", "message"),
    [
        (
            TensorDict({"steps": torch.zeros(3, 1)}, [3]),
            ValueError,
            "Collector: initial_state entry 'steps' has shape (3, 1), expected a leading size of num_envs=2",
        ),
        (
            torch.zeros(2, 1),
            TypeError,
            "Collector: initial_state must be a TensorDict of [num_envs, ...] tensors or a function "
            "initial_state(num_envs) returning one, got Tensor",
        ),
        (
            {"reward": torch.zeros(2)},
            ValueError,
            "Collector: initial_state entries ['reward'] would overwrite keys of the batch",
        ),
        (lambda n: [torch.zeros(n)], TypeError, "returning list"),
    ],
    ids=["wrong-size", "tensor", "batch-key", "function-returns-list"],
)
def test_bad_initial_state_is_named(initial_state, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _thread_collector(StepCountingValuePolicy(), initial_state)


class _NoNextState(StepCountingValuePolicy):
    def forward(self, obs, state, is_init):
        out = super().forward(obs, state, is_init)
        del out["next_state"]
        return out


class _WrongNextState(StepCountingValuePolicy):
    def forward(self, obs, state, is_init):
        out = super().forward(obs, state, is_init)
        out["next_state"] = {"steps": out["next_state"]["steps"][:, 0]}
        return out


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (_NoNextState(), "Collector: with initial_state the policy must return its next state, as 'next_state'"),
        (
            _WrongNextState(),
            "Collector: the policy's next state has entries {'steps': (2,)}, expected "
            "{'steps': (2, 1)} (as initial_state)",
        ),
    ],
    ids=["missing", "wrong-shape"],
)
def test_bad_next_state_is_named(policy, message):
    with _thread_collector(policy, steps_state) as collector, pytest.raises(ValueError, match=re.escape(message)):
        next(iter(collector))


def test_collector_without_initial_state_calls_the_policy_with_obs_only():
    with pytest.raises(TypeError, match="missing 2 required positional arguments"):
        with _thread_collector(StepCountingValuePolicy(), None) as collector:
            next(iter(collector))
