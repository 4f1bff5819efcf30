"""Brax and MuJoCo Playground on XLA's CPU: their own jitted reset/step, and through FromJax the collector's rows.

Neither ships a gymnasium vector env of torch tensors (Brax's wrappers speak the old gym 4-tuple API; Playground's
RSLRLBraxWrapper drops final observations): ``torch_rollout.envs.FromJax`` vmaps and jits their functional
``reset``/``step`` and hands their arrays to torch through DLPack. Every row the collector makes from it is checked
against what it returned, in SAME_STEP and DISABLED modes, with a short time limit so that episodes end in the run.
"""

from __future__ import annotations

import jax
import pytest
import torch
from brax import envs as brax_envs
from brax.envs.base import Wrapper
from brax.envs.wrappers.training import EpisodeWrapper
from gymnasium.vector import AutoresetMode
from mujoco_playground import registry
from playground_setup import load

from torch_rollout.envs import FromJax

from _common import (
    LinearAgent,
    Recorder,
    as_same_step,
    check_rows_in_workers,
    check_same_step_rows,
    check_values_and_gae,
    collect_lockstep,
)

NUM_ENVS, STEPS = 16, 5
# The collector's runs: few envs (each new shape compiles for seconds) and a time limit short enough that several
# episodes end in the run.
ENVS, NUM_STEPS, BATCHES, LIMIT = 4, 16, 2, 10
# The linear agent lets the pendulum fall after 6 or 7 steps: at this limit some episodes terminate (one at the
# limit itself, which then has both flags where FromJax counts the limit, and is terminated only under Brax's
# EpisodeWrapper), the others time out.
PENDULUM_LIMIT = 6
GAMMA, LAMBDA = 0.99, 0.95


@pytest.mark.parametrize(
    ("framework", "name"),
    [("playground", "CartpoleBalance"), ("brax", "inverted_pendulum")],
    ids=["playground-CartpoleBalance", "brax-inverted_pendulum"],
)
def test_jitted_steps_reach_torch_without_a_copy(framework, name):
    env = load(framework, name)
    reset, step = jax.jit(jax.vmap(env.reset)), jax.jit(jax.vmap(env.step))
    state = reset(jax.random.split(jax.random.PRNGKey(0), NUM_ENVS))
    action = jax.numpy.zeros((NUM_ENVS, env.action_size))
    for _ in range(STEPS):
        state = step(state, action)
    obs = torch.from_dlpack(state.obs)
    assert obs.shape == (NUM_ENVS, env.observation_size) and obs.dtype == torch.float32
    assert torch.isfinite(obs).all()
    assert obs.data_ptr() == state.obs.unsafe_buffer_pointer(), "DLPack copied the observations"
    reward, done = torch.from_dlpack(state.reward), torch.from_dlpack(state.done)
    assert reward.shape == done.shape == (NUM_ENVS,)


# Each case: how to build the JAX env, FromJax's max_episode_steps (None: the env's own) and the time limit.
CASES = {
    # Terminates when the pole falls, times out otherwise.
    "brax-inverted_pendulum": (lambda: brax_envs.get_environment("inverted_pendulum"), PENDULUM_LIMIT, PENDULUM_LIMIT),
    # Brax's own time limit: EpisodeWrapper's state.info["truncation"].
    "brax-EpisodeWrapper": (
        lambda: EpisodeWrapper(
            brax_envs.get_environment("inverted_pendulum"), episode_length=PENDULUM_LIMIT, action_repeat=1
        ),
        None,
        PENDULUM_LIMIT,
    ),
    # Never terminates: every episode end is a time-out.
    "playground-CartpoleBalance": (lambda: registry.load("CartpoleBalance"), LIMIT, LIMIT),
}
MODES = [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


class DictObs(Wrapper):
    """A Brax env whose observation is a dict of arrays, as some of Playground's envs have (``state``,
    ``privileged_state``)."""

    def _dict(self, state):
        return state.replace(obs={"state": state.obs, "twice": 2 * state.obs})

    def reset(self, rng):
        return self._dict(self.env.reset(rng))

    def step(self, state, action):
        return self._dict(self.env.step(state.replace(obs=state.obs["state"]), action))


def collect(case: str, mode: AutoresetMode, *, group: str | None = None):
    make, limit, _ = CASES[case]
    env = make() if group is None else DictObs(make())
    envs = Recorder(FromJax(env, ENVS, max_episode_steps=limit, autoreset_mode=mode))
    space = envs.single_observation_space
    obs_dim = (space if group is None else space[group]).shape[0]
    agent = LinearAgent(obs_dim, envs.single_action_space.shape[0], group=group)
    batches = collect_lockstep(
        envs, agent, num_steps=NUM_STEPS, batches=BATCHES, gamma=GAMMA, gae_lambda=LAMBDA, seed=0
    )
    envs.close()
    return batches, envs.record, agent


@pytest.fixture(
    scope="module", params=[(case, mode) for case in CASES for mode in MODES], ids=lambda p: f"{p[0]}-{p[1].name}"
)
def collected(request):
    case, mode = request.param
    return case, mode, *collect(case, mode)


def test_rows_match_what_the_env_returned(collected):
    case, mode, batches, record, agent = collected
    assert sum(int(batch["truncated"].sum()) for batch in batches) >= ENVS, "too few time-outs to check"
    if case != "playground-CartpoleBalance":
        assert sum(int(batch["terminated"].sum()) for batch in batches) >= 1, "no termination to check"
    if mode is AutoresetMode.DISABLED:
        record = as_same_step(record, final_key="final_obs")
    check_same_step_rows(batches, record, agent, final_key="final_obs", gamma=GAMMA, gae_lambda=LAMBDA)


def test_time_limit_and_flags(collected):
    case, _, batches, _, _ = collected
    limit = CASES[case][2]
    own_limit = CASES[case][1] is None
    for batch in batches:
        truncated = batch["truncated"]
        if own_limit:
            assert not bool((batch["terminated"] & truncated).any()), "EpisodeWrapper's convention: one or the other"
        else:  # FromJax's own count, as gymnasium's TimeLimit: every step at the limit, terminated or not
            assert torch.equal(truncated, batch["episode_length"] == limit)
        assert bool((batch["episode_length"][truncated] == limit).all())
        assert bool((batch["episode_length"][~batch["done"]] < limit).all())
        # a time-out's next_obs is the final observation, not the next episode's first
        assert not torch.equal(batch["next_obs"][truncated], batch["obs"].roll(-1, 0)[truncated])


def test_dict_observations():
    batches, record, agent = collect("brax-inverted_pendulum", AutoresetMode.SAME_STEP, group="state")
    assert set(batches[0]["obs"].keys()) == {"state", "twice"}
    assert sum(int(batch["done"].sum()) for batch in batches) >= ENVS
    check_same_step_rows(batches, record, agent, final_key="final_obs", gamma=GAMMA, gae_lambda=LAMBDA)
    torch.testing.assert_close(batches[0]["next_obs", "twice"], 2 * batches[0]["next_obs", "state"])


def test_same_step_and_disabled_give_the_same_batches():
    """Env j's key stream splits only at its own resets, so both modes reset to the same states."""
    same, _, _ = collect("brax-inverted_pendulum", AutoresetMode.SAME_STEP)
    disabled, _, _ = collect("brax-inverted_pendulum", AutoresetMode.DISABLED)
    for a, b in zip(same, disabled, strict=True):
        for key in ("obs", "next_obs", "action", "reward", "terminated", "truncated", "value", "next_value"):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


def test_env_j_has_the_episodes_of_seed_plus_j():
    """reset(seed=s) keys env j with PRNGKey(s + j): env 2 of 3 runs as env 0 of one reset with s + 2, across
    same-step resets too."""
    make, limit, _ = CASES["brax-inverted_pendulum"]
    wide, alone = FromJax(make(), 3, max_episode_steps=limit), FromJax(make(), 1, max_episode_steps=limit)
    obs_wide, _ = wide.reset(seed=5)
    obs_alone, _ = alone.reset(seed=7)
    first = make().reset(jax.random.split(jax.random.PRNGKey(7))[1]).obs
    torch.testing.assert_close(obs_alone[0], torch.from_dlpack(first))
    for _ in range(3 * limit + 1):
        torch.testing.assert_close(obs_wide[2], obs_alone[0], rtol=0, atol=0)
        obs_wide, *_ = wide.step(torch.full((3, 1), 0.3))
        obs_alone, *_ = alone.step(torch.full((1, 1), 0.3))


@pytest.mark.parametrize("mode", MODES, ids=[mode.name for mode in MODES])
def test_observations_share_memory_with_jax(mode):
    make, limit, _ = CASES["playground-CartpoleBalance"]
    envs = FromJax(make(), ENVS, max_episode_steps=limit, autoreset_mode=mode)
    obs, _ = envs.reset(seed=0)
    assert obs.data_ptr() == envs.states.obs.unsafe_buffer_pointer(), "DLPack copied the observations"
    for _ in range(limit):
        obs, reward, terminated, truncated, infos = envs.step(torch.zeros(ENVS, 1))
        if mode is AutoresetMode.DISABLED:
            obs, _ = envs.reset(options={"reset_mask": terminated | truncated})
    assert bool(truncated.all())
    assert obs.data_ptr() == envs.states.obs.unsafe_buffer_pointer(), "DLPack copied the observations"
    assert reward.dtype == torch.float32 and terminated.dtype == truncated.dtype == torch.bool


def test_time_limits():
    assert FromJax(registry.load("CartpoleBalance"), 2).max_episode_steps == 1000  # its config.episode_length
    with pytest.raises(ValueError, match="pass max_episode_steps"):
        FromJax(brax_envs.get_environment("inverted_pendulum"), 2)
    make, _, limit = CASES["brax-EpisodeWrapper"]
    assert FromJax(make(), 2).max_episode_steps == limit
    with pytest.raises(ValueError, match="keeps its own time limit"):
        FromJax(make(), 2, max_episode_steps=limit)


def pendulum_envs(num_envs: int) -> FromJax:
    """Brax's inverted pendulum through FromJax, SAME_STEP, for worker processes (a module-level recipe)."""
    return FromJax(brax_envs.get_environment("inverted_pendulum"), num_envs, max_episode_steps=PENDULUM_LIMIT)


def test_worker_processes_that_build_the_jax_envs(tmp_path):
    """Each worker process imports JAX, jits its share of the envs and records what they returned; every row of
    the trainer's batches is checked against the record of the worker that stepped it."""
    space = pendulum_envs(1)
    agent = LinearAgent(space.single_observation_space.shape[0], space.single_action_space.shape[0])
    batches = check_rows_in_workers(
        pendulum_envs,
        agent,
        folder=str(tmp_path),
        num_envs=ENVS,
        num_steps=NUM_STEPS,
        batches=BATCHES,
        workers=2,  # each compiles its own jitted steps: tens of seconds
        final_key="final_obs",
        gamma=GAMMA,
        gae_lambda=LAMBDA,
    )
    assert sum(int(batch["done"].sum()) for batch in batches) >= ENVS, "too few episode ends to check"


def recording_rsl_rl_wrapper(num_envs: int, limit: int):
    """Playground's own RSLRLBraxWrapper over CartpoleBalance, its step wrapped to keep what it returned (cloned)."""
    from mujoco_playground._src.wrapper_torch import RSLRLBraxWrapper

    wrapper = RSLRLBraxWrapper(registry.load("CartpoleBalance"), num_envs, 0, limit, 1)
    steps: list[tuple[torch.Tensor, ...]] = []
    observed: list[torch.Tensor] = []
    step, get_observations = wrapper.step, wrapper.get_observations

    def recorded_step(actions):
        obs, reward, done, extras = step(actions)
        steps.append((actions.clone(), obs["state"].clone(), reward.clone(), done.clone(), extras["time_outs"].clone()))
        return obs, reward, done, extras

    def recorded_observations():
        obs = get_observations()  # this wrapper's get_observations() resets the envs
        observed.append(obs["state"].clone())
        return obs

    wrapper.step, wrapper.get_observations = recorded_step, recorded_observations
    return wrapper, steps, observed


def test_playgrounds_rsl_rl_wrapper_through_from_rsl_rl():
    """Playground's RSLRLBraxWrapper resets ended envs inside its AutoResetWrapper and drops their final
    observations: FromRslRl(bootstrap="last_obs") makes every time-out a truncated row bootstrapped from its own
    value (rsl_rl's approximation, marked 1 in infos["bootstrap"]). Every row against what the wrapper returned."""
    from torch_rollout.envs import FromRslRl

    wrapper, steps, observed = recording_rsl_rl_wrapper(ENVS, LIMIT)
    envs = FromRslRl(wrapper, bootstrap="last_obs")
    assert envs.device == torch.device("cpu")  # the wrapper sets no device on a CPU: taken from its observations
    agent = LinearAgent(envs.single_observation_space["state"].shape[0], 1, group="state")
    batches = collect_lockstep(
        envs, agent, num_steps=NUM_STEPS, batches=BATCHES, gamma=GAMMA, gae_lambda=LAMBDA, info_keys=("bootstrap",)
    )
    assert len(steps) == NUM_STEPS * BATCHES
    obs = observed[-1]  # the observations of the collector's reset
    rows = iter(steps)
    for k, batch in enumerate(batches):
        for t in range(NUM_STEPS):
            action, next_obs, reward, done, time_outs = next(rows)
            row, where = batch[t], f"batch {k} row {t}"
            done, time_outs = done.bool(), time_outs.bool() & done.bool()
            assert torch.equal(row["obs", "state"], obs), where
            assert torch.equal(row["action"], action), where
            assert torch.equal(row["reward"], reward.float()), where
            assert torch.equal(row["done"], done), where
            assert torch.equal(row["truncated"], time_outs), where
            assert torch.equal(row["terminated"], done & ~time_outs), where
            assert torch.equal(row["info", "bootstrap"], time_outs.to(torch.int8)), where
            assert torch.equal(row["next_value"][time_outs], row["value"][time_outs]), f"{where}: V(s_t) reused"
            assert torch.equal(row["next_obs", "state"][~done], next_obs[~done]), where
            obs = next_obs
        check_values_and_gae(batch, agent, gamma=GAMMA, gae_lambda=LAMBDA, where=f"batch {k}")
    truncated = sum(int(batch["truncated"].sum()) for batch in batches)
    assert truncated == ENVS * (NUM_STEPS * BATCHES // LIMIT), "every episode of CartpoleBalance times out"
