"""gymnax's CartPole-v1 through GymnaxToVectorGymWrapper and gymnasium's JaxToTorch: rows against what it returned."""

from __future__ import annotations

import pytest
import torch
from gymnax_setup import gymnax_envs

from _common import LinearAgent, Recorder, check_rows_in_workers, check_same_step_rows, collect_lockstep

NUM_ENVS, NUM_STEPS, BATCHES = 8, 64, 3
GAMMA, LAMBDA = 0.99, 0.95


def collect(declare: bool):
    envs = Recorder(gymnax_envs(NUM_ENVS, declare=declare))
    agent = LinearAgent(4, 2, discrete=True)
    batches = collect_lockstep(envs, agent, num_steps=NUM_STEPS, batches=BATCHES, gamma=GAMMA, gae_lambda=LAMBDA)
    envs.close()
    assert sum(int(batch["done"].sum()) for batch in batches) > NUM_ENVS, "too few episode ends to check"
    return batches, envs.record, agent


@pytest.fixture(scope="module")
def declared():
    return collect(declare=True)


def test_rows_with_declared_same_step_mode(declared):
    batches, record, agent = declared
    check_same_step_rows(batches, record, agent, final_key="final_observation", gamma=GAMMA, gae_lambda=LAMBDA)


def test_rows_as_gymnax_presents_itself():
    """Its metadata is ``{}`` but its step infos carry final observations: read in SAME_STEP mode, with a warning."""
    with pytest.warns(UserWarning, match=r"names no autoreset mode, but its step infos carry final observations"):
        batches, record, agent = collect(declare=False)
    check_same_step_rows(batches, record, agent, final_key="final_observation", gamma=GAMMA, gae_lambda=LAMBDA)


def test_episode_totals(declared):
    batches, _, _ = declared
    length = torch.zeros(NUM_ENVS, dtype=torch.int64)
    total = torch.zeros(NUM_ENVS)
    for batch in batches:
        for t in range(NUM_STEPS):
            length += 1
            total += batch["reward"][t]
            torch.testing.assert_close(batch["episode_length"][t], length)
            torch.testing.assert_close(batch["episode_return"][t], total)
            done = batch["done"][t]
            length, total = torch.where(done, 0, length), torch.where(done, 0.0, total)


def test_worker_processes_that_build_the_envs(tmp_path):
    """Each of two worker processes builds its share (JAX in it), recording what it returned; every row of the
    trainer's batches is checked against the record of the worker that stepped it."""
    agent = LinearAgent(4, 2, discrete=True)
    batches = check_rows_in_workers(
        gymnax_envs,
        agent,
        folder=str(tmp_path),
        num_envs=NUM_ENVS,
        num_steps=NUM_STEPS,
        batches=BATCHES,
        workers=2,
        final_key="final_observation",
        gamma=GAMMA,
        gae_lambda=LAMBDA,
    )
    assert sum(int(batch["done"].sum()) for batch in batches) > NUM_ENVS, "too few episode ends to check"
