# mypy: disallow-any-generics, disallow-untyped-decorators, disallow-subclassing-any, warn-return-any
"""The public API as a trainer's code calls it, for mypy (``make lint``); pytest imports it and runs nothing.

Every way of building a :class:`~torch_rollout.Collector` that its signature accepts, the README's
``for batch in collector:`` loop and the checkpoint calls, with the types each name gives annotated as
a user would (``x: T = value`` fails mypy where ``value`` is not a ``T``). Only names of
``torch_rollout.__all__`` (and of ``torch_rollout.envs.__all__``). The first line adds the flags of
``mypy --strict`` that pyproject.toml leaves out, but disallow-untyped-calls (``torch.distributions`` has
no annotations). tensordict ships no type information: to mypy a TensorDict and its entries are Any, so the
annotations of a batch and its keys document them without checking them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gymnasium
import torch
from gymnasium.vector import VectorEnv
from tensordict import TensorDict
from torch import Tensor, nn
from torch.distributions import Categorical

from torch_rollout import (
    GAE,
    BatchKeys,
    Collector,
    CudaGraph,
    DoubleBufferedVectorEnv,
    EnvCalls,
    Processes,
    Ray,
    Seed,
    Thread,
    compute_gae,
    double_buffered,
    envpool_envs,
    gym_envs,
    tune,
)
from torch_rollout.envs import CartPole


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor, self.critic = nn.Linear(4, 2), nn.Linear(4, 1)

    def forward(self, obs: Tensor) -> dict[str, Tensor]:
        dist = Categorical(logits=self.actor(obs))
        action = dist.sample()
        return {"action": action, "log_prob": dist.log_prob(action), "value": self.critic(obs)}


def make_envs(num_envs: int) -> VectorEnv:
    return gymnasium.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")


def make_share(num_envs: int, *, start_index: int = 0) -> VectorEnv:
    """A worker's share of the envs, the first of which has the global index ``start_index``."""
    return gymnasium.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")


def readme_loop() -> None:
    """The README's quick start."""
    agent = Agent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=3e-4)
    with Collector(
        "CartPole-v1",
        agent,
        num_envs=8,
        num_steps=128,
        total_timesteps=8 * 128 * 4,
        device="cpu",
        seed=1,
        backend=Processes(num_workers=2),
    ) as collector:
        for batch in collector:
            real = batch[batch["mask"]]
            new_log_prob = Categorical(logits=agent.actor(real["obs"])).log_prob(real["action"])
            ratio = (new_log_prob - real["log_prob"]).exp()
            adv: Tensor = real["advantage"]
            policy_loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
            value_loss = (agent.critic(real["obs"]).squeeze(-1) - real["return"]).pow(2).mean()
            optimizer.zero_grad()
            (policy_loss + 0.5 * value_loss).backward()
            optimizer.step()


def every_kind_of_argument() -> list[Collector]:
    """A Collector from each kind of ``envs``, ``backend``, ``seed`` and ``device``, and every option."""
    agent = Agent()
    live: VectorEnv = make_envs(4)
    return [
        Collector("CartPole-v1", agent, num_envs=4, num_steps=8),  # an env id
        Collector(make_envs, agent, num_envs=4, num_steps=8),  # a make_envs function
        Collector(make_share, agent, num_envs=4, num_steps=8, backend="process"),  # one that takes start_index
        Collector(live, agent, num_steps=8),  # a live vector env: its num_envs
        Collector(CartPole(4, device="cpu"), agent, num_steps=8),  # a vector env of torch tensors
        Collector(gym_envs("CartPole-v1", max_episode_steps=50), agent, num_envs=4, num_steps=8),
        Collector(envpool_envs("CartPole-v1"), agent, num_envs=4, num_steps=8),
        Collector(double_buffered("CartPole-v1"), agent, num_envs=4, num_steps=8),
        Collector("CartPole-v1", agent, num_envs=4, num_steps=8, backend="auto"),
        Collector("CartPole-v1", agent, num_envs=4, num_steps=8, backend="thread", prefetch=0),
        Collector("CartPole-v1", agent, num_envs=4, num_steps=8, backend=Thread()),
        Collector("CartPole-v1", agent, num_envs=4, num_steps=8, backend=Processes(num_workers=2)),
        Collector("CartPole-v1", agent, num_envs=4, num_steps=8, backend=Ray(num_workers=2, options={"num_cpus": 1})),
        Collector("CartPole-v1", agent, num_envs=4, num_steps=8, seed=0, device=torch.device("cpu")),
        Collector("CartPole-v1", agent, num_envs=4, num_steps=8, seed=Seed(0, rank=1, world_size=2), device="cpu"),
        Collector(
            "CartPole-v1",
            agent,
            num_envs=4,
            num_steps=8,
            gae=GAE(gamma=0.99, gae_lambda=0.95),
            keys=BatchKeys(obs_key="obs", info_keys=["episode"], next_obs=True),
            total_timesteps=4 * 8 * 10,
            timeout=60.0,
            check_finite=True,
            compile_policy=False,
        ),
        Collector("CartPole-v1", agent, num_envs=4, num_steps=8, gae=None, compile_policy={"mode": "default"}),
        Collector("CartPole-v1", agent, num_envs=4, num_steps=8, device="cuda", compile_policy=CudaGraph(warmup=3)),
        Collector(
            "CartPole-v1",
            agent,
            num_envs=4,
            num_steps=8,
            initial_state=lambda n: TensorDict({"h": torch.zeros(n, 16)}, batch_size=[n]),
        ),
    ]


def reading_a_collector(collector: Collector) -> None:
    """What a collector and its batches give."""
    batches: Iterator[TensorDict] = iter(collector)
    batch: TensorDict = next(batches)
    obs: Tensor = batch["obs"]
    action: Tensor = batch["action"]
    reward: Tensor = batch["reward"]
    done: Tensor = batch["terminated"] | batch["truncated"]
    advantage, returns = compute_gae(
        batch["reward"],
        batch["value"],
        batch["next_value"],
        batch["terminated"],
        batch["truncated"],
        gamma=0.99,
        gae_lambda=0.95,
    )
    both: tuple[Tensor, Tensor] = (advantage, returns)
    batches_per_run: int = len(collector)
    version: int = collector.policy_version
    collector.update_policy()
    state: dict[str, Any] = collector.state_dict()
    collector.load_state_dict(state)
    envs: VectorEnv | None = collector.envs
    calls: EnvCalls = collector.env_calls
    obs_rms: tuple[Any, ...] = calls.get_attr("obs_rms")
    calls.set_attr("update_running_mean", False)
    sizes: tuple[Any, ...] = calls.call("get_wrapper_attr", "spec")
    closed: bool = collector.closed
    device: torch.device = collector.device
    gae: GAE | None = collector.gae
    collector.close()
    del obs, action, reward, done, both, batches_per_run, version, envs, calls, obs_rms, sizes, closed, device, gae


def the_vector_envs() -> None:
    pair: DoubleBufferedVectorEnv = DoubleBufferedVectorEnv([make_envs(2), make_envs(2)])
    seeded: Seed = Seed(0)
    del pair, seeded


def tuning() -> Collector:
    best: dict[str, Any] = tune("CartPole-v1", Agent(), num_envs=8, num_steps=128, seconds=20.0)
    tune(make_envs, num_envs=8, num_steps=128, train_seconds=0.05, device="cpu")  # the default MLP policy
    tune(gymnasium.make_vec("CartPole-v1", num_envs=8), Agent(), num_steps=128)  # a live env: the thread only
    with_ray = [{"backend": "thread", "prefetch": 0}, {"backend": Ray(num_workers=2), "prefetch": 1}]
    tune("CartPole-v1", Agent(), num_envs=8, num_steps=128, placements=with_ray)
    return Collector("CartPole-v1", Agent(), num_envs=8, num_steps=128, **best)
