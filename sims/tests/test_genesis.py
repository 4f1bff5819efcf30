"""Genesis 1.4.5 on its CPU backend: a cartpole scene in the shape of Genesis's locomotion example (rsl_rl 1.x's
five-value step, resets inside it, float time-outs, no final observation) through FromRslRl(bootstrap="last_obs"):
every row against what Genesis returned."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from genesis_setup import GenesisCartPole

from torch_rollout import GAE, BatchKeys, Collector, Processes
from torch_rollout.envs import FromRslRl
from torch_rollout.envs._gym import split_envs

from _common import LinearAgent, check_values_and_gae, collect_lockstep, load_records

NUM_ENVS, NUM_STEPS, BATCHES = 4, 24, 3
EPISODE_STEPS = 22  # time-outs after 23 steps; the poles that fall before terminate
GAMMA, LAMBDA = 0.99, 0.95


class Recording(GenesisCartPole):
    """The env, keeping each step's action and what Genesis returned (cloned), and the observations of each reset."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple] = []
        self.resets: list[torch.Tensor] = []

    def step(self, actions: torch.Tensor) -> tuple:
        obs, privileged, rewards, dones, extras = super().step(actions)
        cloned = None if privileged is None else privileged.clone()
        self.steps.append(
            (actions.clone(), obs.clone(), cloned, rewards.clone(), dones.clone(), extras["time_outs"].clone())
        )
        return obs, privileged, rewards, dones, extras

    def reset(self) -> tuple:
        out = super().reset()
        self.resets.append(self.obs_buf.clone())
        return out


@pytest.mark.parametrize("privileged", [False, True], ids=["privileged_obs-None", "privileged_obs"])
def test_rows_match_what_genesis_returned(privileged):
    env = Recording(NUM_ENVS, episode_steps=EPISODE_STEPS, privileged=privileged, seed=1)
    envs = FromRslRl(env, bootstrap="last_obs")
    agent = make_agent(privileged)
    batches = collect_lockstep(
        envs, agent, num_steps=NUM_STEPS, batches=BATCHES, gamma=GAMMA, gae_lambda=LAMBDA, info_keys=("bootstrap",)
    )
    assert len(env.steps) == NUM_STEPS * BATCHES
    check_rows(batches, env.resets, env.steps, agent, privileged=privileged)


def make_agent(privileged: bool) -> LinearAgent:
    agent = LinearAgent(4, 1, group="policy" if privileged else None, seed=3)
    agent.actor.bias.data.fill_(0.6)  # pushes hard enough that some poles fall before the time limit
    return agent


def check_rows(batches, resets, steps, agent, *, privileged: bool) -> None:
    """Every row of ``batches`` against the steps Genesis returned, from the last reset on."""
    obs = resets[-1]  # the collector's reset
    rows = iter(steps)
    for k, batch in enumerate(batches):
        for t in range(NUM_STEPS):
            action, next_obs, next_privileged, reward, dones, time_outs = next(rows)
            row, where = batch[t], f"batch {k} row {t}"
            done, time_outs = dones.bool(), time_outs.bool() & dones.bool()
            got_obs = row["obs", "policy"] if privileged else row["obs"]
            assert torch.equal(got_obs, obs), where
            assert torch.equal(row["action"], action), where
            assert torch.equal(row["reward"], reward.float()), where
            assert torch.equal(row["done"], done), where
            assert torch.equal(row["truncated"], time_outs), where
            assert torch.equal(row["terminated"], done & ~time_outs), where
            assert torch.equal(row["info", "bootstrap"], time_outs.to(torch.int8)), where
            assert torch.equal(row["next_value"][time_outs], row["value"][time_outs]), f"{where}: V(s_t) reused"
            if privileged:
                assert torch.equal(row["obs", "critic"][:, :4], obs), where
                if t + 1 < NUM_STEPS:
                    assert torch.equal(batch[t + 1]["obs", "critic"], next_privileged), where
            obs = next_obs
        check_values_and_gae(batch, agent, gamma=GAMMA, gae_lambda=LAMBDA, where=f"batch {k}")
    ends = [(int(b["terminated"].sum()), int(b["truncated"].sum())) for b in batches]
    assert sum(e[0] for e in ends) >= 1 and sum(e[1] for e in ends) >= 1, f"too few episode ends: {ends}"


class Saving(Recording):
    """A Recording that saves what Genesis returned to ``path`` when it is closed (in a worker, at its end)."""

    def __init__(self, *args, path: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.path = path

    def close(self) -> None:
        torch.save((self.resets, self.steps), f"{self.path}.part")
        os.replace(f"{self.path}.part", self.path)


def saving_envs(num_envs: int, start_index: int = 0, *, folder: str) -> FromRslRl:
    """A worker's share (a module-level recipe): its own scene, seeded by its first env's index."""
    env = Saving(num_envs, episode_steps=EPISODE_STEPS, seed=start_index, path=f"{folder}/{start_index}.pt")
    return FromRslRl(env, bootstrap="last_obs")


def test_worker_processes_that_build_genesis_scenes(tmp_path):
    """Two worker processes, each with its own gs.init and scene; every row against its worker's record."""
    agent = make_agent(False)
    with Collector(
        functools.partial(saving_envs, folder=str(tmp_path)),
        agent,
        num_envs=NUM_ENVS,
        num_steps=NUM_STEPS,
        total_timesteps=NUM_ENVS * NUM_STEPS * BATCHES,
        device="cpu",
        backend=Processes(2),
        gae=GAE(gamma=GAMMA, gae_lambda=LAMBDA),
        keys=BatchKeys(next_obs=True, info_keys=("bootstrap",)),
    ) as collector:
        batches = list(collector)
    shares = split_envs(NUM_ENVS, 2)
    for (start, count), (resets, steps) in zip(shares, load_records(str(tmp_path), [s for s, _ in shares])):
        check_rows(
            [batch[:, start : start + count] for batch in batches],
            resets,
            steps[: NUM_STEPS * BATCHES],
            agent,
            privileged=False,
        )
