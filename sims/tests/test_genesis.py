"""Genesis 1.4.5 on its CPU backend: a cartpole scene in the shape of Genesis's locomotion example (rsl_rl 1.x's
five-value step, resets inside it, float time-outs, no final observation) through FromRslRl(bootstrap="last_obs"):
every row against what Genesis returned."""

from __future__ import annotations

import pytest
import torch
from genesis_setup import GenesisCartPole

from torch_rollout.envs import FromRslRl

from _common import LinearAgent, collect_lockstep, gae_float64

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
    agent = LinearAgent(4, 1, group="policy" if privileged else None, seed=3)
    agent.actor.bias.data.fill_(0.6)  # pushes hard enough that some poles fall before the time limit
    batches = collect_lockstep(
        envs, agent, num_steps=NUM_STEPS, batches=BATCHES, gamma=GAMMA, gae_lambda=LAMBDA, info_keys=("bootstrap",)
    )
    assert len(env.steps) == NUM_STEPS * BATCHES
    obs = env.resets[-1]  # the collector's reset
    rows = iter(env.steps)
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
        with torch.no_grad():
            value = agent.get_value(batch["obs"])
        torch.testing.assert_close(batch["value"], value, msg=lambda m, w=k: f"batch {w} value: {m}")
        advantage, return_ = gae_float64(
            batch["reward"],
            value,
            batch["next_value"],
            batch["terminated"],
            batch["truncated"],
            gamma=GAMMA,
            gae_lambda=LAMBDA,
        )
        torch.testing.assert_close(batch["advantage"].double(), advantage, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch["return"].double(), return_, rtol=1e-5, atol=1e-5)
    ends = [(int(b["terminated"].sum()), int(b["truncated"].sum())) for b in batches]
    assert sum(e[0] for e in ends) >= 1 and sum(e[1] for e in ends) >= 1, f"too few episode ends: {ends}"
