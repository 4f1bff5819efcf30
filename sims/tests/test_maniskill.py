"""ManiSkill3's PushCube-v1 on PhysX CPU, as the collector takes it: one env through ManiSkillVectorEnv (torch
tensors), several in gymnasium's SyncVectorEnv of CPUGymWrapper envs (NumPy), on the thread and in worker processes
that build them; rows against what it returned."""

from __future__ import annotations

import functools

import pytest
import torch
from maniskill_setup import cpu_envs as sync_cpu_envs
from maniskill_setup import maniskill_vector_env

from _common import LinearAgent, Recorder, check_rows_in_workers, check_same_step_rows, collect_lockstep

NUM_STEPS, BATCHES = 32, 3
# Short episodes, so that a few batches hold several time-outs (and their final observations)
MAX_EPISODE_STEPS = 20
GAMMA, LAMBDA = 0.99, 0.95


# SyncVectorEnv of CPUGymWrapper envs with the short episodes (a module-level recipe, for worker processes)
cpu_envs = functools.partial(sync_cpu_envs, max_episode_steps=MAX_EPISODE_STEPS)


@pytest.fixture(scope="module")
def collected():
    envs = Recorder(maniskill_vector_env(max_episode_steps=MAX_EPISODE_STEPS))
    agent = LinearAgent(envs.single_observation_space.shape[0], envs.single_action_space.shape[0])
    batches = collect_lockstep(
        envs, agent, num_steps=NUM_STEPS, batches=BATCHES, gamma=GAMMA, gae_lambda=LAMBDA, seed=0
    )
    envs.close()
    return batches, envs.record, agent


def test_rows_match_what_maniskill_returned(collected):
    batches, record, agent = collected
    assert sum(int(batch["truncated"].sum()) for batch in batches) >= 3, "too few time-outs to check"
    check_same_step_rows(batches, record, agent, final_key="final_observation", gamma=GAMMA, gae_lambda=LAMBDA)


def test_time_outs_bootstrap_from_the_final_observation(collected):
    batches, record, agent = collected
    steps = iter(record.steps)
    for batch in batches:
        for t in range(NUM_STEPS):
            step = next(steps)
            if bool(step.truncated[0]):
                final = step.infos["final_observation"]
                assert not torch.equal(final, step.obs), "the reset observation is the final one?"
                torch.testing.assert_close(batch["next_obs"][t], final)
                with torch.no_grad():
                    torch.testing.assert_close(batch["next_value"][t], agent.get_value(final))


def test_episode_totals(collected):
    batches, _, _ = collected
    length, total = torch.zeros(1, dtype=torch.int64), torch.zeros(1)
    for batch in batches:
        for t in range(NUM_STEPS):
            length, total = length + 1, total + batch["reward"][t]
            torch.testing.assert_close(batch["episode_length"][t], length)
            torch.testing.assert_close(batch["episode_return"][t], total)
            done = batch["done"][t]
            length, total = torch.where(done, 0, length), torch.where(done, 0.0, total)
    assert int(length.max()) < MAX_EPISODE_STEPS


SYNC_ENVS = 2


def test_sync_vector_env_of_cpu_envs_on_the_thread():
    envs = Recorder(cpu_envs(SYNC_ENVS))
    agent = LinearAgent(envs.single_observation_space.shape[0], envs.single_action_space.shape[0])
    batches = collect_lockstep(envs, agent, num_steps=NUM_STEPS, batches=2, gamma=GAMMA, gae_lambda=LAMBDA, seed=0)
    envs.close()
    assert sum(int(batch["truncated"].sum()) for batch in batches) >= SYNC_ENVS, "too few time-outs to check"
    check_same_step_rows(batches, envs.record, agent, final_key="final_obs", gamma=GAMMA, gae_lambda=LAMBDA)


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_processes_that_build_the_envs(workers, tmp_path):
    """Each worker builds its share of the envs from a recipe and records what they returned; every row of the
    trainer's batches is checked against the record of the worker that stepped it."""
    shapes = cpu_envs(1)
    agent = LinearAgent(shapes.single_observation_space.shape[0], shapes.single_action_space.shape[0])
    shapes.close()
    batches = check_rows_in_workers(
        cpu_envs,
        agent,
        folder=str(tmp_path),
        num_envs=SYNC_ENVS,
        num_steps=NUM_STEPS,
        batches=2,
        workers=workers,
        final_key="final_obs",
        gamma=GAMMA,
        gae_lambda=LAMBDA,
    )
    assert sum(int(batch["truncated"].sum()) for batch in batches) >= SYNC_ENVS, "too few time-outs to check"
