"""TensorDict and TorchRL policies: the observation key, "state_value", interaction types, and ClipPPOLoss."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from tensordict.nn import (
    InteractionType,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    TensorDictSequential,
    probabilistic,
    set_interaction_type,
)
from tensordict.nn.probabilistic import interaction_type
from torch import nn
from torch.distributions import Categorical

from torch_rollout import BatchKeys, Collector
from torch_rollout.loop import _interaction

from counting_env import TransitionCountingPolicy, counting_vec
from placements import PLACEMENTS, envs_for

N, T, BATCHES = 4, 16, 3


class Uniform(nn.Module):
    """Logits of 0 for two actions: sampling picks action 1 half the time, the mode never."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(observation.shape[0], 2) + 0 * observation[:, :1]


class Half(nn.Module):
    """A critic of TransitionCountingEnv: k + t / 8 (what counting_env.TransitionCountingPolicy values), as [n, 1]."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (observation[:, 3] + observation[:, 2] / 8).unsqueeze(-1)


def td_actor_critic() -> TensorDictSequential:
    """A tensordict actor (default interaction RANDOM) and a critic writing "state_value", reading "observation"."""
    actor = ProbabilisticTensorDictSequential(
        TensorDictModule(Uniform(), in_keys=["observation"], out_keys=["logits"]),
        ProbabilisticTensorDictModule(
            in_keys=["logits"],
            out_keys=["action"],
            distribution_class=Categorical,
            default_interaction_type=InteractionType.RANDOM,
        ),
    )
    return TensorDictSequential(actor, TensorDictModule(Half(), in_keys=["observation"], out_keys=["state_value"]))


@pytest.fixture(params=["installed", "legacy"])
def tensordict_modes(request, monkeypatch):
    """The installed tensordict, and the path for one that keeps a single process-wide interaction type."""
    if request.param == "legacy":
        monkeypatch.setattr(_interaction, "_has_thread_local", lambda probabilistic: False)
        _interaction._own_mode.cache_clear()  # worked out once per process: again with the path patched
        request.addfinalizer(_interaction._own_mode.cache_clear)  # and again with the library's
        # the legacy path replaces this holder: put the library's own back afterwards
        monkeypatch.setattr(probabilistic, "_interaction_type", probabilistic._interaction_type)
    return request.param


def test_collector_thread_samples_while_the_trainer_acts_deterministically(tensordict_modes):
    policy = td_actor_critic()
    trainer_view = TensorDictModule(Uniform(), in_keys=["observation"], out_keys=["logits"])
    trainer_actor = ProbabilisticTensorDictSequential(
        trainer_view,
        ProbabilisticTensorDictModule(
            in_keys=["logits"],
            out_keys=["action"],
            distribution_class=Categorical,
            default_interaction_type=InteractionType.RANDOM,
        ),
    )
    actions = []
    # As TorchRL's losses do while they run, for the whole loop: the collector thread must not see it.
    with set_interaction_type(InteractionType.DETERMINISTIC):
        with Collector(
            "CartPole-v1",
            policy,
            num_envs=N,
            num_steps=T,
            total_timesteps=N * T * BATCHES,
            device="cpu",
            backend="thread",
            prefetch=1,
            keys=BatchKeys(obs_key="observation"),
        ) as collector:
            for batch in collector:
                actions.append(batch["action"])
                for _ in range(20):  # while the collector thread collects the next batch
                    assert interaction_type() == InteractionType.DETERMINISTIC
                    out = trainer_actor(batch.select("observation").reshape(-1))  # 64 rows
                    assert not out["action"].any()  # the mode: argmax of equal logits is action 0
        assert interaction_type() == InteractionType.DETERMINISTIC
    assert interaction_type() is None
    share = torch.stack(actions).float().mean().item()
    assert 0.3 < share < 0.7, f"share of action 1: {share} (0 when the collector acts greedily)"


def collect(placement: dict, policy: nn.Module, **kwargs) -> list:
    envs, extra = envs_for(placement, counting_vec, N)
    with Collector(
        envs,
        policy,
        num_steps=T,
        total_timesteps=N * T * 2,
        device="cpu",
        seed=0,
        timeout=60.0,
        **placement,
        **extra,
        **kwargs,
    ) as collector:
        return [batch.clone() for batch in collector]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_observation_key_and_state_value_give_the_same_advantages(placement):
    expected = collect(placement, TransitionCountingPolicy())  # plain module: reads obs, writes "value"
    # TransitionCountingEnv needs action t % 2: a TensorDict policy that reads "observation" and writes "state_value".
    parity = TensorDictModule(Parity(), in_keys=["observation"], out_keys=["action"])
    policy = TensorDictSequential(parity, TensorDictModule(Half(), in_keys=["observation"], out_keys=["state_value"]))
    got = collect(placement, policy, keys=BatchKeys(obs_key="observation"))
    assert len(got) == len(expected) == 2
    for want, batch in zip(expected, got):
        assert "obs" not in batch.keys() and torch.equal(batch["observation"], want["obs"])
        assert batch["state_value"].shape == (T, N)
        for key in ("next_value", "advantage", "return"):
            assert torch.allclose(batch[key], want[key]), key


class Parity(nn.Module):
    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return observation[:, 2].long() % 2


@pytest.mark.parametrize("obs_key", ["action", "", 3])
def test_bad_obs_key_is_named(obs_key):
    with pytest.raises(ValueError, match="BatchKeys: obs_key must be a str other than the batch's own keys"):
        Collector(
            "CartPole-v1", td_actor_critic(), num_envs=1, num_steps=1, backend="thread", keys=BatchKeys(obs_key=obs_key)
        )


# ------------------------------------------------------------------------------------------ TorchRL


def torchrl_actor_critic(num_actions: int = 2):
    """TorchRL's ProbabilisticActor over near-uniform logits and a ValueOperator, as a user builds them."""
    from torchrl.modules import ProbabilisticActor, ValueOperator

    torch.manual_seed(0)
    net = nn.Linear(4, num_actions)
    nn.init.normal_(net.weight, std=1e-3)
    nn.init.zeros_(net.bias)
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=Categorical,
        return_log_prob=True,
        default_interaction_type=InteractionType.RANDOM,
    )
    critic = ValueOperator(nn.Linear(4, 1), in_keys=["observation"])
    return actor, critic


def test_a_probabilistic_module_that_does_not_sample_is_named():
    policy = td_actor_critic()
    policy[0][1].default_interaction_type = InteractionType.DETERMINISTIC
    message = (
        re.escape("Collector: the policy's probabilistic module ")
        + r"'[\w.]+'"  # its name in the policy, which tensordict versions spell differently
        + re.escape(" has default_interaction_type=InteractionType.DETERMINISTIC, so the collector acts with it")
    )
    with pytest.warns(UserWarning, match=message) as warned:
        line = inspect.currentframe().f_lineno + 1  # the warning points at the user's line, not into the package
        Collector(
            "CartPole-v1", policy, num_envs=1, num_steps=1, backend="thread", keys=BatchKeys(obs_key="observation")
        ).close()
    assert (warned[0].filename, warned[0].lineno) == (__file__, line)


def recipe(batch):
    """The README's recipe: a collector batch as TorchRL's PPO losses read it."""
    data = batch[batch["mask"]]  # [B]: real transitions only
    data["advantage"] = data["advantage"].unsqueeze(-1)  # TorchRL's losses want [B, 1]
    data["value_target"] = data["return"].unsqueeze(-1)  # TorchRL's name for the return
    data["state_value"] = data["state_value"].unsqueeze(-1)  # read with clip_value
    return data


def test_clip_ppo_loss_reads_the_batch_as_the_readme_says():
    pytest.importorskip("torchrl")
    from torchrl.objectives import ClipPPOLoss

    actor, critic = torchrl_actor_critic()
    loss_fn = ClipPPOLoss(actor, critic, entropy_bonus=False, loss_critic_type="l2", critic_coeff=1.0, clip_value=0.2)
    with Collector(
        "CartPole-v1",
        TensorDictSequential(actor, critic),
        num_envs=N,
        num_steps=T,
        total_timesteps=N * T,
        keys=BatchKeys(obs_key="observation"),
        device="cpu",
        backend="thread",
        prefetch=0,
        seed=0,
    ) as collector:
        batch = next(iter(collector))
    assert {"observation", "action", "action_log_prob", "state_value", "advantage", "return"} <= set(batch.keys())
    data = recipe(batch)
    losses = loss_fn(data)
    advantage = data["advantage"]
    # The weights that acted, so the ratio is 1: the objective is -mean(advantage), and the critic's value is
    # the stored one, so its squared error against the return (advantage + value) is mean(advantage ** 2).
    assert torch.allclose(losses["loss_objective"], -advantage.mean(), atol=1e-6)
    assert torch.allclose(losses["loss_critic"], advantage.pow(2).mean(), rtol=1e-5)
    losses["loss_objective"].backward()
    assert actor.module[0].module.weight.grad.abs().sum() > 0


def test_clip_ppo_loss_in_the_trainer_leaves_the_collector_sampling():
    """The issue's repro: with prefetch=1, ClipPPOLoss in the trainer made the collector's actor act greedily."""
    pytest.importorskip("torchrl")
    from torchrl.objectives import ClipPPOLoss

    actor, critic = torchrl_actor_critic()
    loss_fn = ClipPPOLoss(actor, critic)
    shares = []
    with Collector(
        "CartPole-v1",
        TensorDictSequential(actor, critic),
        num_envs=8,
        num_steps=64,
        total_timesteps=8 * 64 * 4,
        keys=BatchKeys(obs_key="observation"),
        device="cpu",
        backend="thread",
        prefetch=1,
        seed=0,
    ) as collector:
        for batch in collector:
            shares.append((batch["action"] == batch["logits"].argmax(-1)).float().mean().item())
            data = recipe(batch)
            for _ in range(10):  # while the collector thread collects the next batch
                loss_fn(data)
    # Near-uniform logits: sampling picks the greedy action half the time (1.0 when acting greedily).
    assert all(0.35 < share < 0.65 for share in shares), shares
