"""Hostile input: NaN and inf, observations of the wrong shape or dtype, actions outside the space,
outputs on the wrong device, non-contiguous tensors, a vector env that another collector steps, a
lazy policy. Each works or fails with an error that names the key, what was received and what was
expected.
"""

from __future__ import annotations

import math
import re
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from torch import nn

from torch_rollout import Collector
from torch_rollout.envs._spaces import ActionConverter

from counting_env import make_counting_envs
from placements import PLACEMENTS, envs_for
from reliability_envs import (
    ActionEchoEnv,
    BadObsVectorEnv,
    ConstantPolicy,
    FaultyEnv,
    close_envs,
    collect_error,
    collector_threads,
    copy_reason,
    faulty_fns,
    faulty_vec,
    make_vec,
)

TIMEOUT = 60.0
FAULTY = partial(gym.make_vec, "torch_rollout_tests/Faulty-v0")  # healthy FaultyEnvs, for any placement
ASYNC_ERROR_LOG = pytest.mark.filterwarnings("ignore::UserWarning:gymnasium.vector.async_vector_env")


def first_batch(envs, policy=None, **kwargs):
    kwargs = {"num_steps": 4, "device": "cpu", "prefetch": 0, "timeout": TIMEOUT, **kwargs}
    with Collector(envs, policy or ConstantPolicy(), **kwargs) as collector:
        batch = next(collector)
    envs.close()
    return batch


# -- NaN and inf ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["nan_obs", "inf_obs", "nan_reward", "inf_reward"])
def test_non_finite_values_pass_through_by_default(fault):
    """The documented default: NaN and inf are valid floats, stored as the env returned them."""
    batch = first_batch(SyncVectorEnv(faulty_fns(2, 1, fault=fault, at=3)))
    obs, reward = batch["obs"], batch["reward"]
    if fault.endswith("obs"):  # the observation after step 3 is row 3's
        assert (math.isnan if fault == "nan_obs" else lambda x: x == -math.inf)(obs[3, 1, 1].item())
        assert torch.isfinite(obs).sum() == obs.numel() - 1
        assert torch.isfinite(reward).all()
    else:  # the reward of step 3 is row 2's
        assert (math.isnan if fault == "nan_reward" else lambda x: x == math.inf)(reward[2, 1].item())
        assert torch.isfinite(reward).sum() == reward.numel() - 1
        assert torch.isfinite(obs).all()


@pytest.mark.parametrize(
    "fault, at, message",
    [
        ("nan_obs", 3, "obs of env 1 is nan at step 2 (row 2 of batch 0), returned by envs.step()"),
        ("inf_obs", 3, "obs of env 1 is -inf at step 2 (row 2 of batch 0), returned by envs.step()"),
        ("nan_reward", 3, "reward of env 1 is nan at step 2 (row 2 of batch 0), returned by envs.step()"),
        # NEXT_STEP: the reset after the episode end at step 5 takes a step, so the env's 7th is the 8th.
        ("inf_reward", 7, "reward of env 1 is inf at step 7 (row 3 of batch 1), returned by envs.step()"),
    ],
)
@pytest.mark.parametrize("cls", [SyncVectorEnv, AsyncVectorEnv], ids=lambda c: c.__name__)
def test_check_finite_names_key_env_and_step(cls, fault, at, message):
    info = collect_error(make_vec(cls, faulty_fns(2, 1, fault=fault, at=at)), check_finite=True)
    suffix = "; pass check_finite=False to let NaN and inf through"
    assert str(info.value) == f"Collector(check_finite=True): {message}{suffix}"


@pytest.mark.parametrize(
    "mode, returned_by",
    [
        (AutoresetMode.NEXT_STEP, "envs.step()"),
        (AutoresetMode.SAME_STEP, "envs.step() in infos['final_obs']"),
        (AutoresetMode.DISABLED, "envs.step()"),
    ],
    ids=lambda x: getattr(x, "value", None),
)
def test_check_finite_sees_final_observations(mode, returned_by):
    """A NaN in the last observation of an episode is caught in every autoreset mode."""
    envs = make_vec(SyncVectorEnv, faulty_fns(2, 1, fault="nan_obs", at=5, episode_length=5), mode)
    info = collect_error(envs, check_finite=True)
    assert f"obs of env 1 is nan at step 4 (row 0 of batch 1), returned by {returned_by};" in str(info.value)


class BoxActionEnv(FaultyEnv):
    """A FaultyEnv that takes (and ignores) Box actions; it observes ``[index, t, steps so far]``."""

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)


def box_action_envs(num_envs: int, start_index: int = 0) -> SyncVectorEnv:
    return SyncVectorEnv([partial(BoxActionEnv, start_index + i) for i in range(num_envs)])


class NonFiniteActionPolicy(nn.Module):
    """Zero actions, except ``bad`` for env 1 after its second step (row 2 of batch 0), wherever env 1 runs."""

    def __init__(self, bad: float) -> None:
        super().__init__()
        self.bad = bad

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        action = torch.zeros(obs.shape[0], 2)
        action[(obs[:, 0] == 1) & (obs[:, 2] == 2), 0] = self.bad
        return {"action": action, "value": torch.zeros(obs.shape[0])}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")], ids=["nan", "-inf"])
def test_check_finite_catches_non_finite_box_actions(bad, placement):
    """check_finite=True covers what the env receives too: a NaN action is not clipped into anything."""
    envs, extra = envs_for(placement, box_action_envs, 2)
    info = collect_error(envs, NonFiniteActionPolicy(bad), prefetch=0, check_finite=True, **placement, **extra)
    assert str(info.value) == (
        f"Collector(check_finite=True): action of env 1 is {bad} at step 2 (row 2 of batch 0), returned by the "
        "policy; pass check_finite=False to let NaN and inf through"
    )


# -- observations of the wrong shape or dtype --------------------------------------------------------


def test_sub_env_observation_of_wrong_shape_sync():
    info = collect_error(SyncVectorEnv(faulty_fns(3, 1, fault="obs_shape", at=3)))
    assert str(info.value).startswith(
        "Collector: env 1 returned an observation of shape (4,) and dtype float32, expected shape (3,) and "
        "dtype float32 of its observation space Box(-inf, inf, (3,), float32)"
    )
    assert isinstance(info.value.__cause__, ValueError)  # gymnasium's own "Output array is the wrong shape"


@ASYNC_ERROR_LOG
def test_sub_env_observation_of_wrong_shape_async():
    # Raised in the AsyncVectorEnv worker, re-raised by gymnasium: the collector names the env, keeping its text.
    info = collect_error(AsyncVectorEnv(faulty_fns(3, 1, fault="obs_shape", at=3)))
    assert "could not broadcast input array from shape (4,) into shape (3,)" in str(info.value)


# The env at fault is env 2 of 3: with two worker processes it is the first env of the second worker,
# which must name it by its global index.


@ASYNC_ERROR_LOG
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "pipes"])
def test_sub_env_observation_of_wrong_shape_async_names_the_env(shared_memory, placement):
    """As with SyncVectorEnv: the error names the env, the shape it returned and its space."""
    vector = partial(AsyncVectorEnv, shared_memory=shared_memory)
    envs, extra = envs_for(placement, partial(faulty_vec, cls=vector, faulty_index=2, fault="obs_shape", at=3), 3)
    info = collect_error(envs, **placement, **extra)
    message = str(info.value)
    assert message.startswith("Collector: env 2 returned an observation of shape (4,)"), message
    assert "expected shape (3,) and dtype float32 of its observation space Box(-inf, inf, (3,), float32)" in message
    if not extra:  # from a worker process only a traceback's text comes back, as the cause
        assert isinstance(info.value.__cause__, ValueError)  # gymnasium's own error


class SyncVectorEnvWithoutEnvObs(SyncVectorEnv):
    """A SyncVectorEnv as a gymnasium without the private ``_env_obs`` would be: nothing to read after a step.

    The one place these tests touch gymnasium's private name, to take it away.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kept = self.__dict__.pop("_env_obs")

    def _with_env_obs(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        self._env_obs = self._kept
        try:
            return method(*args, **kwargs)
        finally:
            del self._env_obs

    def reset(self, **kwargs: Any) -> Any:
        return self._with_env_obs(super().reset, **kwargs)

    def step(self, actions: Any) -> Any:
        return self._with_env_obs(super().step, actions)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_sub_env_observation_of_wrong_shape_sync_without_private_env_obs(placement):
    """The explanation must not depend on one private attribute of SyncVectorEnv."""
    recipe = partial(faulty_vec, cls=SyncVectorEnvWithoutEnvObs, faulty_index=2, fault="obs_shape", at=3)
    envs, extra = envs_for(placement, recipe, 3)
    info = collect_error(envs, **placement, **extra)
    assert str(info.value).startswith(
        "Collector: env 2 returned an observation of shape (4,) and dtype float32, expected shape (3,) and "
        "dtype float32 of its observation space Box(-inf, inf, (3,), float32)"
    )
    if not extra:  # from a worker process only a traceback's text comes back, as the cause
        assert isinstance(info.value.__cause__, ValueError)  # gymnasium's own "Output array is the wrong shape"


@pytest.mark.parametrize(
    "fault, at, message",
    [
        (
            "shape",
            3,
            "Collector: envs.step() returned obs of shape (2, 4) and dtype float32, expected shape (2, 3) "
            "(num_envs, *observation_space.shape) and dtype float32 for Box(0.0, 255.0, (3,), float32)",
        ),
        (
            "shape",
            0,
            "Collector: envs.reset() returned obs of shape (2, 4) and dtype float32, expected shape (2, 3)",
        ),
        (
            "dtype_float_for_uint8",
            2,
            "Collector: envs.step() returned obs of shape (2, 3) and dtype float64, expected shape (2, 3) "
            "(num_envs, *observation_space.shape) and dtype uint8 for Box(0, 255, (3,), uint8)",
        ),
    ],
)
def test_vector_env_observation_of_wrong_shape_or_dtype(fault, at, message):
    """A hand-written VectorEnv has no Sync/Async checks in between: the collector's own catch it."""
    info = collect_error(BadObsVectorEnv(2, fault=fault, at=at))
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("fault", ["float64", "reversed", "list"])
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED], ids=lambda m: m.value)
def test_vector_env_observations_that_must_just_work(fault, mode):
    """float64 for a float32 space, negative strides, nested lists: stored like the proper arrays."""
    batches = {}
    for kind in ("proper", fault):
        envs = BadObsVectorEnv(2, fault="none" if kind == "proper" else fault, at=0, mode=mode)
        with Collector(envs, ConstantPolicy(), num_steps=6, device="cpu", prefetch=0, total_timesteps=24) as collector:
            batches[kind] = torch.cat([batch["obs"] for batch in collector])  # two batches: bootstraps too
    assert batches[fault].dtype == torch.float32
    assert torch.equal(batches[fault], batches["proper"])
    assert batches["proper"][:, :, 1].max() >= 3  # episodes ran to their end


# -- actions ---------------------------------------------------------------------------------------


def action_policy(action: list) -> ConstantPolicy:
    return ConstantPolicy(lambda n: {"action": torch.tensor(action), "value": torch.zeros(n)})


@pytest.mark.parametrize(
    "space, action, message",
    [
        (spaces.Discrete(2), [0, 2], "for env 1 is 2, outside Discrete(2); expected integers from 0 to 1"),
        (spaces.Discrete(2), [-1, 0], "for env 0 is -1, outside Discrete(2); expected integers from 0 to 1"),
        (
            spaces.Discrete(3, start=-1),
            [-2, 0],
            "for env 0 is -2, outside Discrete(3, start=-1); expected integers from -1 to 1",
        ),
        (
            spaces.MultiDiscrete([2, 3]),
            [[1, 2], [1, 3]],
            "for env 1 is [1, 3], outside MultiDiscrete([2 3]); expected integers from [0, 0] to [1, 2]",
        ),
        (
            spaces.MultiBinary(3),
            [[0, 1, 1], [0, 2, 0]],
            "for env 1 is [0, 2, 0], outside MultiBinary(3); expected integers from 0 to 1",
        ),
    ],
    ids=["discrete-high", "discrete-negative", "discrete-start", "multidiscrete", "multibinary"],
)
def test_actions_outside_the_action_space(space, action, message):
    envs = SyncVectorEnv([lambda: ActionEchoEnv(space)] * 2)
    info = collect_error(envs, action_policy(action))
    assert str(info.value) == f"Collector: policy output 'action' {message}"


@pytest.mark.parametrize("bad", [-2, 2], ids=["below", "above"])
@pytest.mark.parametrize("num_envs", [4, 40], ids=["few-envs", "many-envs"])
def test_a_discrete_action_outside_the_space_is_refused_for_few_and_many_envs(num_envs, bad):
    """Few envs' actions are checked as a list, many envs' with one NumPy reduction: both refuse either end."""
    convert = ActionConverter(spaces.Discrete(3, start=-1), num_envs)
    good = torch.arange(num_envs) % 3 - 1
    assert convert(good).tolist() == good.tolist()
    action = good.clone()
    action[num_envs - 2] = bad
    with pytest.raises(ValueError, match=re.escape(f"for env {num_envs - 2} is {bad}, outside Discrete(3, start=-1)")):
        convert(action)


class OutOfRangeForEnv3(nn.Module):
    """Action 0, except 3 (outside Discrete(3)) for the CountingEnv whose global index (obs[:, 0]) is 3."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": torch.where(obs[:, 0] == 3, 3, 0), "value": torch.zeros(obs.shape[0])}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_an_action_outside_the_space_names_the_env_by_its_global_index(placement):
    # with two worker processes env 3 is the second env of the second worker
    envs, extra = envs_for(placement, make_counting_envs, 4)
    with pytest.raises(ValueError, match=re.escape("'action' for env 3 is 3, outside Discrete(3); expected integers")):
        kwargs = {"num_steps": 4, "device": "cpu", "timeout": TIMEOUT, **placement, **extra}
        with Collector(envs, OutOfRangeForEnv3(), **kwargs) as collector:
            next(collector)


@pytest.mark.parametrize(
    "space, action",
    [
        (spaces.Discrete(2), [1, 0]),
        (spaces.Discrete(3, start=-1), [1, -1]),
        (spaces.MultiDiscrete([2, 3]), [[1, 2], [0, 0]]),
        (spaces.MultiBinary(3), [[1, 1, 1], [0, 0, 0]]),
    ],
    ids=["discrete", "discrete-start", "multidiscrete", "multibinary"],
)
def test_actions_at_the_edges_of_the_action_space_reach_the_env(space, action):
    batch = first_batch(SyncVectorEnv([lambda: ActionEchoEnv(space)] * 2), action_policy(action))
    received = batch["obs"][1, :, : np.prod(space.shape, dtype=int) or 1]
    assert torch.equal(received, torch.tensor(action, dtype=torch.float32).reshape(2, -1))


def test_box_actions_outside_the_bounds_are_clipped_for_the_env_only():
    space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    envs = SyncVectorEnv([lambda: ActionEchoEnv(space)] * 2)
    returned = torch.tensor([[5.0, -5.0], [0.5, 0.0]])
    clipped = torch.tensor([[1.0, -1.0], [0.5, 0.0]])  # what the env got: it echoes the action it was given
    options = dict(num_steps=4, device="cpu", prefetch=0, timeout=TIMEOUT)
    with Collector(envs, action_policy(returned.tolist()), **options) as collector:
        # the first batch (the policy's first call) and the second, the loop's plain steps
        for batch in [next(collector), next(collector)]:
            assert torch.equal(batch["action"], returned.expand(4, 2, 2))  # stored as returned
            assert torch.equal(batch["obs"][1:, :, :2], clipped.expand(3, 2, 2))
    envs.close()


# -- device and memory layout of policy outputs ----------------------------------------------------


@pytest.mark.parametrize("key", ["action", "value", "logits"])
def test_policy_output_on_the_wrong_device(key):
    """A CPU-only box cannot make a CUDA tensor; the meta device is just as foreign to the collector."""

    def make(n: int) -> dict[str, torch.Tensor]:
        out = {"action": torch.zeros(n, dtype=torch.long), "value": torch.zeros(n), "logits": torch.zeros(n, 2)}
        out[key] = out[key].to("meta")
        return out

    info = collect_error(SyncVectorEnv(faulty_fns(2)), ConstantPolicy(make))
    assert str(info.value).startswith(
        f"Collector: policy output {key!r} is on device meta, expected cpu (the collector's device)"
    )


def test_non_contiguous_policy_outputs_just_work():
    def make(n: int) -> dict[str, torch.Tensor]:
        base = torch.arange(4 * n).reshape(n, 4)
        return {
            "action": base[:, 2] % 2,  # strided
            "value": base.float().t()[1],  # a row of a transpose
            "log_prob": torch.full((1,), -0.5).expand(n),  # stride 0
            "logits": base.float().t().contiguous().t()[:, 1:3],  # column-major slice
        }

    batch = first_batch(SyncVectorEnv(faulty_fns(3)), ConstantPolicy(make))
    base = torch.arange(12).reshape(3, 4)
    assert torch.equal(batch["action"], (base[:, 2] % 2).expand(4, 3))
    assert torch.equal(batch["value"], base[:, 1].float().expand(4, 3))
    assert torch.equal(batch["log_prob"], torch.full((4, 3), -0.5))
    assert torch.equal(batch["logits"], base[:, 1:3].float().expand(4, 3, 2))
    assert torch.isfinite(batch["advantage"]).all()


def test_non_contiguous_box_action_just_works():
    space = spaces.Box(-10.0, 10.0, (2,), np.float32)
    policy = ConstantPolicy(lambda n: {"action": torch.arange(2 * n, dtype=torch.float32).reshape(2, n).t()})
    batch = first_batch(SyncVectorEnv([lambda: ActionEchoEnv(space)] * 3), policy)
    expected = torch.tensor([[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]])
    assert torch.equal(batch["action"][0], expected)
    assert torch.equal(batch["obs"][1, :, :2], expected)


# -- envs another collector steps, a policy that cannot be copied yet ------------------------------


def test_second_collector_on_a_driven_vector_env_is_refused():
    """Two collectors stepping one vector env interleave their steps: both trajectories are garbage."""
    envs = SyncVectorEnv(faulty_fns(2))
    build = partial(Collector, policy=ConstantPolicy(), num_steps=4, device="cpu", timeout=TIMEOUT)
    refused = (
        "two collectors stepping one vector env corrupt each other's trajectories: close that one first "
        "(close() or a with block) or give each collector its own vector env"
    )
    first = build(envs)
    try:
        next(first)
        for other in (envs, gym.wrappers.vector.RecordEpisodeStatistics(envs)):  # a wrapper steps the same envs
            with pytest.raises(ValueError, match=re.escape(refused)) as info:
                build(other)
            assert str(info.value).startswith("Collector: envs is already driven by another open Collector(")
        next(first)  # the refusal left the first collector alone
    finally:
        first.close()
    # Closed or dropped, a collector lets go of its envs.
    second = build(envs)
    next(second)
    del second
    with build(envs) as third:
        next(third)
    envs.close()


class LazyPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.LazyLinear(1)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": torch.zeros(obs.shape[0], dtype=torch.long), "value": self.body(obs).squeeze(1)}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_lazy_policy_parameters_with_prefetch_name_the_fix(placement):
    policy = LazyPolicy()
    envs, extra = envs_for(placement, FAULTY, 2)
    options = dict(num_steps=4, device="cpu", prefetch=1, timeout=TIMEOUT, **placement, **extra)
    why, fix = copy_reason(placement, prefetch=1)
    message = (
        f"Collector: {why} copies the policy when the Collector is built, but its parameter 'body.weight' is "
        "uninitialized (a lazy module such as nn.LazyLinear); run the policy once on a batch of observations "
        f"before building the Collector, or pass {fix} to act with the module itself"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        Collector(envs, policy, **options)
    assert not collector_threads()
    policy(torch.zeros(2, 3))  # what the message says to do
    with Collector(envs, policy, **options) as collector:
        assert next(collector)["value"].shape == (4, 2)
    close_envs(envs)
