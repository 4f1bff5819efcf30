"""Exactly-once delivery across batches and weight refreshes, and torn-weight freedom under concurrency.

The weights a row acted with are those of its ``policy_version``, also after the
trainer replaced the policy's tensors instead of writing into them.
"""

from __future__ import annotations

import itertools
import re
import time
from functools import partial

import gymnasium
import pytest
import torch
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from torch import nn

from torch_rollout import Collector

from counting_env import TransitionCountingEnv, TransitionCountingPolicy, counting_vec
from placements import PLACEMENTS, envs_for
from reliability_envs import AUTORESET_MODES, SlowReadPolicy, close_envs, copy_reason, take

TIMEOUT = 60.0
FAULTY = partial(gymnasium.make_vec, "torch_rollout_tests/Faulty-v0")  # healthy FaultyEnvs, for any placement
N, T, BATCHES = 3, 7, 8  # T is prime to every episode length: episode ends fall on batch boundaries too


def expected_transitions(index: int, count: int) -> list[dict]:
    """The first ``count`` real transitions of TransitionCountingEnv ``index``, worked out by hand."""
    rows, episode, t, ret = [], 0, 0, 0.0
    for k in range(count):
        length = TransitionCountingEnv.episode_length(index, episode)
        end = t + 1 == length
        ret += k
        rows.append(
            {
                "obs": [index, episode, t, k],
                "reward": float(k),
                "terminated": end and episode % 2 == 0,
                "truncated": end and episode % 2 == 1,
                # V of the true next state [.., t + 1, k + 1]: at an episode end the final observation.
                "next_value": (k + 1) + (t + 1) / 8,
                "episode_length": t + 1,
                "episode_return": ret,
            }
        )
        t += 1
        if end:
            episode, t, ret = episode + 1, 0, 0.0
    return rows


# AsyncVectorEnv inside worker processes once (two workers); the other combinations add only time.
VECTOR_ENVS_AND_PLACEMENTS = [
    pytest.param(cls, placement.values[0], id=f"{cls.__name__}-{placement.id}", marks=placement.marks)
    for cls in (SyncVectorEnv, AsyncVectorEnv)
    for placement in PLACEMENTS
    if cls is SyncVectorEnv or placement.id in ("thread", "process2")
]


@pytest.mark.ray(prefetch=(3,), mode=(AutoresetMode.NEXT_STEP,))
@pytest.mark.parametrize("cls, placement", VECTOR_ENVS_AND_PLACEMENTS)
@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("mode", AUTORESET_MODES, ids=lambda m: m.value)
def test_every_transition_once_and_in_order(mode, prefetch, cls, placement):
    envs, extra = envs_for(placement, partial(counting_vec, cls=cls, mode=mode), N)
    received: dict[str, list[torch.Tensor]] = {key: [] for key in expected_transitions(0, 1)[0]}
    masks = []
    with Collector(
        envs,
        TransitionCountingPolicy(),
        num_steps=T,
        device="cpu",
        prefetch=prefetch,
        total_timesteps=N * T * BATCHES,
        seed=0,
        timeout=TIMEOUT,
        **placement,
        **extra,
    ) as collector:
        for b, batch in enumerate(collector):
            # Refreshes in the middle of iterations too, not only the one next() does.
            if b % 3 == 1:
                collector.update_policy()
            for key in received:
                received[key].append(batch[key])
            masks.append(batch["mask"])
            if b % 3 == 2:
                collector.update_policy()
    if not extra:
        envs.close()
    assert b == BATCHES - 1

    mask = torch.cat(masks)  # [BATCHES * T, N]
    if mode != AutoresetMode.NEXT_STEP:
        assert mask.all()
    for i in range(N):
        real = mask[:, i]
        got = {key: torch.cat(values)[:, i][real] for key, values in received.items()}
        count = int(real.sum())
        want = expected_transitions(i, count)
        for key in received:
            expected = torch.tensor([row[key] for row in want], dtype=got[key].dtype)
            assert torch.equal(got[key], expected), f"env {i}, {key}"
        done = got["terminated"] | got["truncated"]
        assert got["terminated"].any() and got["truncated"].any()  # both kinds of episode end were crossed
        if mode == AutoresetMode.NEXT_STEP:
            # The other rows are exactly the reset steps, one after each episode end (the last
            # one's may fall after the final batch).
            resets = int(done.sum()) - int(bool(real[-1]) and bool(done[-1]))
            assert BATCHES * T - count == resets


@pytest.mark.ray(prefetch=(3,))
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_no_row_mixes_two_weight_versions(prefetch, placement):
    """The trainer updates in place, parameter by parameter, slowly; the policy reads its weights slowly.

    Every row must come from one weight version, the one its ``policy_version``
    names; versions never go back, and a batch lags at most ``prefetch``
    refreshes behind. The second half of the run also refreshes by hand in the
    middle of iterations, while the thread is inside a forward pass.
    """
    policy = SlowReadPolicy(k=4, pause=0.0005)
    envs, extra = envs_for(placement, partial(gymnasium.make_vec, "torch_rollout_tests/Faulty-v0"), 2)
    num_batches = 30
    value = 0.0  # every weight of the trainer's policy
    weights_of = {0: 0.0}  # policy_version -> the weight value it copied
    refreshes_of = {0: 0}  # policy_version -> refreshes by next() when it was made
    seen_versions: list[int] = []
    with Collector(
        envs,
        policy,
        num_steps=8,
        device="cpu",
        prefetch=prefetch,
        total_timesteps=2 * 8 * num_batches,
        timeout=TIMEOUT,
        **placement,
        **extra,
    ) as collector:
        for b, batch in enumerate(collector):
            # next() refreshed the inference copy from the trainer's weights, which are `value` now.
            weights_of[collector.policy_version] = value
            refreshes_of[collector.policy_version] = b + 1
            weights = batch["weights"]  # [T, N, 4]
            versions = batch["policy_version"]  # [T, N]
            assert (weights == weights[..., :1]).all(), "a forward pass read two weight versions"
            # Each worker process steps its own envs: rows of one step agree within a worker only.
            for t, i in itertools.product(range(weights.shape[0]), range(weights.shape[1])):
                assert weights[t, i, 0].item() == weights_of[versions[t, i].item()]
            oldest = versions.min().item()
            assert b + 1 - refreshes_of[oldest] <= prefetch
            if b < num_batches // 2:  # no refresh by hand yet: versions and refreshes agree
                assert collector.policy_version - oldest <= prefetch
            seen_versions += versions[:, -1].tolist()
            # The trainer's update: in place, one parameter at a time, while the thread collects.
            with torch.no_grad():
                for w in policy.ws:
                    w.add_(1.0)
                    time.sleep(0.0003)
            value += 1.0
            if b >= num_batches // 2 and b % 2 == 0:
                collector.update_policy()
                weights_of[collector.policy_version] = value
                refreshes_of[collector.policy_version] = b + 1
    if not extra:
        envs.close()
    assert seen_versions == sorted(seen_versions)
    assert len(set(seen_versions)) > 10  # the weights did change under the collector


class LayerPolicy(nn.Module):
    """Values every observation at ``layer.weight + layer.bias``: the batch shows which weights acted."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        with torch.no_grad():
            self.layer.weight.zero_()
            self.layer.bias.zero_()

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        n = obs.shape[0]
        ones = torch.ones(n, 1, device=obs.device)
        return {"action": torch.zeros(n, dtype=torch.long), "value": self.layer(ones).squeeze(1)}


def replace_weights(policy: LayerPolicy, how: str) -> None:
    """Gives ``policy`` new weight tensors (not new values in its old ones) that value everything at 5."""
    if how == "load_state_dict-assign":
        state = {"layer.weight": torch.full((1, 1), 2.0), "layer.bias": torch.full((1,), 3.0)}
        policy.load_state_dict(state, assign=True)
    elif how == "new-submodule":
        layer = nn.Linear(1, 1)
        with torch.no_grad():
            layer.weight.fill_(2.0)
            layer.bias.fill_(3.0)
        policy.layer = layer
    elif how == "new-parameter":
        policy.layer.weight = nn.Parameter(torch.full((1, 1), 5.0))
    else:
        raise AssertionError(how)


@pytest.mark.ray(how=("load_state_dict-assign",))
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "how", ["load_state_dict-assign", "new-submodule", "new-parameter", "new-shape", "new-shape-same-parameter"]
)
def test_replaced_policy_parameters_are_followed_or_named(how, placement):
    """The acting copy (prefetch >= 1, worker processes) must follow tensors the trainer replaced, not the ones
    it had at first, at any refresh (the collector walks the policy's modules again only when they changed)."""
    policy = LayerPolicy()
    envs, extra = envs_for(placement, FAULTY, 2)
    options = dict(num_steps=4, device="cpu", prefetch=1, timeout=TIMEOUT, **placement, **extra)
    with Collector(envs, policy, **options) as collector:
        next(collector)
        next(collector)  # a refresh of the same policy, as at most batches
        if how.startswith("new-shape"):  # a copy cannot follow that: say which parameter
            if how == "new-shape":
                policy.layer = nn.Linear(2, 1)
            else:  # the same Parameter object, with a tensor of another shape in it
                policy.layer.weight.data = torch.zeros(1, 2)
            message = (
                "Collector: the policy's parameter 'layer.weight' now has shape (1, 2), but the collector's copy of "
                f"the policy ({copy_reason(placement, 1)[0]}) has shape (1, 1); the copy follows replaced parameters "
                "of the same shape only: create a new Collector after changing the policy's structure"
            )
            with pytest.raises(ValueError, match=re.escape(message)):
                collector.update_policy()
            close_envs(envs)
            return
        replace_weights(policy, how)
        collector.update_policy()
        version = collector.policy_version  # every row from this version on acts with the new weights
        rows = 0
        for batch in take(collector, 4):
            new = batch["policy_version"] >= version
            assert (batch["value"][~new] == 0.0).all()
            assert (batch["value"][new] == 5.0).all(), f"rows of version >= {version} acted with the old weights"
            rows += int(new.sum())
        assert rows > 0
    close_envs(envs)


class ScaledPolicy(LayerPolicy):
    """Values every observation at ``scale``: a plain attribute, as a DQN's annealed ``epsilon`` is."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self._calls = 0  # private: not a setting, free to change

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(obs)
        return {**out, "value": out["value"] + self.scale}


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_plain_attribute_changed_on_the_policy_is_named_where_a_copy_acts(placement):
    """A copy of the policy acts (prefetch=1, worker processes, Ray) and only tensors reach it: a changed plain
    attribute would act with its first value for the whole run, so the next refresh names it and the fix."""
    policy = ScaledPolicy()
    envs, extra = envs_for(placement, FAULTY, 2)
    options = dict(num_steps=4, device="cpu", prefetch=1, timeout=TIMEOUT, **placement, **extra)
    with Collector(envs, policy, **options) as collector:
        assert (next(collector)["value"] == 1.0).all()
        policy._calls += 1
        assert (next(collector)["value"] == 1.0).all()
        policy.scale = 0.5
        why, fix = copy_reason(placement, 1)
        message = (
            "Collector: the policy's attribute 'scale' was 1.0 when the Collector was built and is now 0.5, but the "
            f"copy of the policy that acts ({why}) still has 1.0: only tensors travel to it. Make it a buffer, which "
            "every weight refresh carries (self.register_buffer('scale', torch.tensor(1.0)), then "
            f"policy.scale.fill_(x)), or pass {fix} to act with the module itself"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            next(collector)
    close_envs(envs)


def test_a_plain_attribute_changed_on_the_policy_acts_at_once_where_the_policy_itself_acts():
    policy = ScaledPolicy()
    envs = FAULTY(num_envs=2)
    with Collector(envs, policy, num_steps=4, device="cpu", prefetch=0, backend="thread") as collector:
        assert (next(collector)["value"] == 1.0).all()
        policy.scale = 0.5
        assert (next(collector)["value"] == 0.5).all()
    envs.close()


def test_a_changed_plain_attribute_that_is_no_number_is_named_with_its_own_fix():
    policy = ScaledPolicy()
    policy.mode = "greedy"  # set before the Collector: watched from its construction on
    envs = FAULTY(num_envs=2)
    with Collector(envs, policy, num_steps=4, device="cpu", prefetch=1, backend="thread", timeout=TIMEOUT) as c:
        next(c)
        policy.mode = "sample"
        message = (
            "Collector: the policy's attribute 'mode' was 'greedy' when the Collector was built and is now 'sample', "
            "but the copy of the policy that acts (prefetch=1) still has 'greedy': only tensors travel to it. Create "
            "a new Collector after changing it, or pass prefetch=0 to act with the module itself"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            next(c)
    envs.close()
