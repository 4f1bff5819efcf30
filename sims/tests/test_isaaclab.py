"""Isaac Lab 3.0's Isaac-Cartpole-Direct and Isaac-Cartpole (manager-based), kit-less on Newton/MuJoCo-Warp on
Warp's CPU device, with compute_final_obs=True, as the collector takes them (FromIsaacLab) and through isaaclab_rl's
RslRlVecEnvWrapper and torch_rollout's FromRslRl: rows against what they returned."""

from __future__ import annotations

import functools

import pytest
from isaaclab_rl.rsl_rl import RslRlVecEnvWrapper
from isaaclab_setup import TASKS, cartpole_usd, episode_length_s, make_isaac_env

from torch_rollout import Collector
from torch_rollout.envs import FromIsaacLab, FromRslRl

from _common import LinearAgent, Recorder, check_rows_in_workers, check_same_step_rows, collect_lockstep

NUM_ENVS, NUM_STEPS = 4, 16
GAMMA, LAMBDA = 0.99, 0.95


@pytest.fixture(scope="module", params=list(TASKS))
def isaac_env(request, tmp_path_factory):
    env = make_isaac_env(request.param, NUM_ENVS, cartpole_usd(tmp_path_factory.mktemp("usd")))
    yield env
    env.close()


def set_episodes(env, *, steps: int, cart_bound: float) -> None:
    """Episodes of ``steps`` env steps that terminate where the cart passes ``cart_bound`` (either kind of env)."""
    unwrapped = env.unwrapped
    unwrapped.cfg.episode_length_s = episode_length_s(steps)
    if hasattr(unwrapped.cfg, "max_cart_pos"):  # DirectRLEnv's cartpole
        unwrapped.cfg.max_cart_pos = cart_bound
    else:
        term = unwrapped.termination_manager.get_term_cfg("cart_out_of_bounds")
        term.params["bounds"] = (-cart_bound, cart_bound)
        unwrapped.termination_manager.set_term_cfg("cart_out_of_bounds", term)


# How the collector gets the env: Isaac Lab's own env (the collector adapts it as FromIsaacLab; here the adapter is
# made by hand, so that the recorder sees what it returned), or rsl_rl's VecEnv of it
THROUGH = {
    "own": FromIsaacLab,
    "rsl_rl": lambda env: FromRslRl(RslRlVecEnvWrapper(env)),
}


def collect(env, batches: int, through: str, prefetch: int = 0):
    """Collects ``batches`` (in lockstep, or ``prefetch`` ahead on the collector's thread), recording the vector
    env's steps and Isaac Lab's own flags after each."""
    unwrapped = env.unwrapped
    envs = Recorder(
        THROUGH[through](env),
        extra=lambda: (unwrapped.reset_terminated, unwrapped.reset_time_outs),
    )
    agent = LinearAgent(4, 1, group="policy")
    info_keys = ("bootstrap",) if through == "rsl_rl" else ()
    got = collect_lockstep(
        envs,
        agent,
        num_steps=NUM_STEPS,
        batches=batches,
        gamma=GAMMA,
        gae_lambda=LAMBDA,
        info_keys=info_keys,
        prefetch=prefetch,
    )
    return got, envs.record, agent


def isaac_flags(step):
    return step.extra


@pytest.mark.parametrize("given", ["gym.make", "unwrapped"])
def test_isaac_lab_env_itself_is_a_vector_env(isaac_env, given):
    env = isaac_env if given == "gym.make" else isaac_env.unwrapped
    set_episodes(isaac_env, steps=3, cart_bound=1e3)
    agent = LinearAgent(4, 1, group="policy")
    with Collector(
        env, agent, num_steps=4, total_timesteps=4 * NUM_ENVS * 2, device="cpu", backend="thread"
    ) as collector:
        assert isinstance(collector.envs, FromIsaacLab) and collector.autoreset_mode.value == "SameStep"
        batches = list(collector)
    assert set(batches[0]["obs"].keys()) == {"policy"} and batches[0]["obs", "policy"].shape == (4, NUM_ENVS, 4)
    assert all(bool(batch["mask"].all()) for batch in batches) and any(bool(b["done"].any()) for b in batches)


def test_isaac_lab_env_without_compute_final_obs_names_it(isaac_env):
    cfg = isaac_env.unwrapped.cfg
    cfg.compute_final_obs = False
    try:
        with pytest.raises(
            ValueError, match=r"cfg.compute_final_obs=False.*FromRslRl\(wrapper, bootstrap='last_obs'\)"
        ):
            Collector(isaac_env, LinearAgent(4, 1, group="policy"), num_steps=4, device="cpu", backend="thread")
    finally:
        cfg.compute_final_obs = True


@pytest.mark.parametrize("through", list(THROUGH))
@pytest.mark.parametrize("prefetch", [0, 1])
def test_time_outs_bootstrap_from_final_obs(isaac_env, through, prefetch):
    # Episodes of 6 steps that never fail (the cart's bound out of reach): every episode end is a time-out
    set_episodes(isaac_env, steps=6, cart_bound=1e3)
    batches, record, agent = collect(isaac_env, batches=2, through=through, prefetch=prefetch)
    assert sum(int(batch["truncated"].sum()) for batch in batches) >= NUM_ENVS * 4
    check_same_step_rows(
        batches, record, agent, final_key="final_obs", flags_of=isaac_flags, gamma=GAMMA, gae_lambda=LAMBDA
    )
    if through == "rsl_rl":  # the env beneath tells time-outs from terminations: every row exact
        assert not any(bool(batch["info", "bootstrap"].any()) for batch in batches)


@pytest.mark.parametrize("through", list(THROUGH))
def test_steps_that_terminate_at_the_time_limit_do_not_bootstrap(isaac_env, through):
    # Episodes of 1 step and a cart bound inside the reset range (-1, 1): every step times out, and those that end
    # with the cart beyond the bound terminate too
    set_episodes(isaac_env, steps=1, cart_bound=0.3)
    batches, record, agent = collect(isaac_env, batches=1, through=through)
    both = sum(int((step.extra[0] & step.extra[1]).sum()) for step in record.steps)
    assert both >= 3, f"only {both} steps both terminated and timed out"
    check_same_step_rows(
        batches, record, agent, final_key="final_obs", flags_of=isaac_flags, gamma=GAMMA, gae_lambda=LAMBDA
    )
    both_kept = batches[0]["terminated"] & batches[0]["truncated"]
    assert int(both_kept.sum()) == both, "both flags, as Isaac Lab gave them"
    if through == "rsl_rl":
        assert not bool(batches[0]["info", "bootstrap"].any())


def isaac_envs(num_envs: int, *, kind: str, usd: str) -> FromIsaacLab:
    """A worker's share of the envs (a module-level recipe, for worker processes): episodes of 6 steps that never
    fail, every episode end a time-out."""
    env = make_isaac_env(kind, num_envs, usd)
    set_episodes(env, steps=6, cart_bound=1e3)
    return FromIsaacLab(env)


def test_worker_processes_that_build_isaac_lab_envs(tmp_path):
    """Two worker processes each build an Isaac Lab env of their share from a recipe and record what it returned;
    every row of the trainer's batches is checked against the record of the worker that stepped it."""
    agent = LinearAgent(4, 1, group="policy")
    recipe = functools.partial(isaac_envs, kind="direct", usd=cartpole_usd(tmp_path))
    batches = check_rows_in_workers(
        recipe,
        agent,
        folder=str(tmp_path),
        num_envs=NUM_ENVS,
        num_steps=NUM_STEPS,
        batches=2,
        workers=2,
        final_key="final_obs",
        gamma=GAMMA,
        gae_lambda=LAMBDA,
    )
    assert sum(int(batch["truncated"].sum()) for batch in batches) >= NUM_ENVS * 4


def test_installing_the_package_into_the_isaac_lab_venv_changes_none_of_its_packages(tmp_path):
    """`pip install torch_rollout` where Isaac Lab is installed must take Isaac Lab's torch, gymnasium, numpy and
    tensordict as they are, not replace them: pip's resolution, reported without installing anything."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # the checkout
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), str(root)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    installs = [entry["metadata"]["name"] for entry in json.loads(report.read_text())["install"]]
    assert installs == ["torch_rollout"], installs
