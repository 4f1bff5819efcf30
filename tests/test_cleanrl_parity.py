"""CleanRL's ppo.py, its rollout and its GAE written out as the script has them, against the collector's batches.

The collector with ``gae=None``, ``backend="thread", prefetch=0`` and a policy that has ``get_value`` gives
CleanRL's arrays on a SAME_STEP env, over several updates of the weights: the same observations, actions and
rewards, CleanRL's ``dones`` as the previous row's ``done``, bit for bit (copies, and samples of torch's generator
drawn in the same order), and the same log-probabilities, values and advantages (CleanRL's GAE computed from the
batch, its last row's ``next_value`` as CleanRL's ``agent.get_value(next_obs)``) to float tolerance: the policy
computes them on the same rows in calls of the same shape, but on inputs at other addresses, which some CPUs'
kernels sum in another order (``make test-kernels`` runs this file on such kernels; on this machine's own they
agree to the last bit).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

from torch_rollout import Collector

N, T, ITERATIONS, SEED = 4, 64, 3, 1
GAMMA, LAMBDA = 0.99, 0.95


def make_envs() -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(N)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )


class Agent(nn.Module):
    """CleanRL's discrete PPO agent (64x64 tanh critic and actor), with a forward for the collector."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        self.actor = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        action, logprob, _, value = self.get_action_and_value(x)
        return {"action": action, "logprob": logprob, "value": value}


def cleanrl_advantages(rewards, values, dones, next_value, next_done):  # type: ignore[no-untyped-def]
    """ppo.py's GAE loop, as the script writes it."""
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    for t in reversed(range(T)):
        if t == T - 1:
            nextnonterminal = 1.0 - next_done
            nextvalues = next_value
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            nextvalues = values[t + 1]
        delta = rewards[t] + GAMMA * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + GAMMA * LAMBDA * nextnonterminal * lastgaelam
    return advantages


def update(agent: Agent, optimizer: torch.optim.Optimizer, data: dict[str, torch.Tensor]) -> None:
    """One PPO gradient step on the whole batch, in a fixed order: the same on both sides for the same data."""
    _, newlogprob, _, newvalue = agent.get_action_and_value(data["obs"].reshape(-1, 4), data["actions"].reshape(-1))
    ratio = (newlogprob - data["logprobs"].reshape(-1)).exp()
    advantages = data["advantages"].reshape(-1)
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2)).mean()
    v_loss = 0.5 * ((newvalue.view(-1) - data["returns"].reshape(-1)) ** 2).mean()
    optimizer.zero_grad()
    (pg_loss + 0.5 * v_loss).backward()
    optimizer.step()


def fresh_agent() -> tuple[Agent, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    agent = Agent()
    return agent, torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)


def cleanrl_run() -> list[dict[str, torch.Tensor]]:
    """ppo.py's rollout loop (its storage, its order of calls) for ITERATIONS iterations."""
    agent, optimizer = fresh_agent()
    envs = make_envs()
    obs = torch.zeros((T, N, 4))
    actions = torch.zeros((T, N))
    logprobs, rewards, dones, values = (torch.zeros((T, N)) for _ in range(4))
    next_obs, _ = envs.reset(seed=SEED)
    next_obs, next_done = torch.Tensor(next_obs), torch.zeros(N)
    kept = []
    for _ in range(ITERATIONS):
        for step in range(T):
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            next_obs, reward, terminations, truncations, _ = envs.step(action.cpu().numpy())
            next_done = np.logical_or(terminations, truncations)
            rewards[step] = torch.tensor(reward).view(-1)
            next_obs, next_done = torch.Tensor(next_obs), torch.Tensor(next_done)
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = cleanrl_advantages(rewards, values, dones, next_value, next_done)
        data = {"obs": obs, "actions": actions, "logprobs": logprobs, "rewards": rewards, "dones": dones}
        data = {key: value.clone() for key, value in data.items()}
        data |= {"values": values.clone(), "advantages": advantages, "returns": advantages + values}
        kept.append(data)
        update(agent, optimizer, data)
    envs.close()
    return kept


def collector_run() -> list[dict[str, torch.Tensor]]:
    """The same agent and envs through the collector; CleanRL's arrays and advantages taken from each batch."""
    agent, optimizer = fresh_agent()
    collector = Collector(
        make_envs(),
        agent,
        num_steps=T,
        total_timesteps=ITERATIONS * T * N,
        gae=None,
        backend="thread",
        prefetch=0,
        seed=SEED,
        device="cpu",
    )
    kept = []
    previous_done = torch.zeros(N)
    with collector:
        for batch in collector:
            done = batch["done"].float()
            dones = torch.cat([previous_done[None], done[:-1]])  # CleanRL's dones[t]: the step before's done
            previous_done = done[-1]
            values = batch["value"]
            with torch.no_grad():
                advantages = cleanrl_advantages(
                    batch["reward"], values, dones, batch["next_value"][-1].reshape(1, -1), done[-1]
                )
            data = {
                "obs": batch["obs"],
                "actions": batch["action"].float(),
                "logprobs": batch["logprob"],
                "rewards": batch["reward"],
                "dones": dones,
                "values": values,
                "advantages": advantages,
                "returns": advantages + values,
            }
            data = {key: value.clone() for key, value in data.items()}
            kept.append(data)
            update(agent, optimizer, data)
    return kept


def test_the_collectors_batches_give_cleanrls_ppo_arrays_and_advantages_bit_for_bit():
    hand, collected = cleanrl_run(), collector_run()
    assert len(hand) == len(collected) == ITERATIONS
    ended = 0
    for iteration, (ours, theirs) in enumerate(zip(collected, hand)):
        for key in ("obs", "actions", "rewards", "dones"):
            assert torch.equal(ours[key], theirs[key]), f"iteration {iteration}: {key} differs"
        for key in ("logprobs", "values", "advantages", "returns"):
            torch.testing.assert_close(
                ours[key], theirs[key], rtol=1e-5, atol=1e-5, msg=f"iteration {iteration}: {key}"
            )
        ended += int(theirs["dones"].sum())
    assert ended > 10  # episodes ended inside the batches, and their rows matched too
