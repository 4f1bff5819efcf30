"""mjlab 1.6's Mjlab-Cartpole-Balance (with a pole-fell termination) and Mjlab-Velocity-Flat-Unitree-Go1 on
MuJoCo-Warp on Warp's CPU device: through FromMjlab (auto_reset=False, exact bootstraps) and through mjlab's
RslRlVecEnvWrapper and FromRslRl (bootstrap="last_obs"), on the thread and in worker processes. Every row is checked
against what mjlab's own env returned, recorded beneath the adapters; and an env that fails mid-step, in the
thread and in a worker, reaches the trainer with its cause and leaves nothing behind."""

from __future__ import annotations

import functools
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from mjlab.rl.vecenv_wrapper import RslRlVecEnvWrapper
from mjlab_setup import TASKS, make_env, mjlab_envs

from torch_rollout import GAE, BatchKeys, Collector, Processes
from torch_rollout.envs import FromMjlab, FromRslRl
from torch_rollout.envs._gym import split_envs

from _common import LinearAgent, Record, Step, _clone, _where, check_same_step_rows, load_records

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from reliability_envs import Snapshot, collector_threads, wait_until  # noqa: E402

NUM_STEPS, BATCHES = 16, 2
GAMMA, LAMBDA = 0.99, 0.95
# Each task's envs and episodes: short enough that every batch has episode ends. Under the linear agent the
# cartpole's pole falls past 0.5 rad after 3 to 7 steps: episodes of 6 steps both terminate and time out (27 and
# 14 of 256 rows in a trial run). Go1 does not fall in 10 steps: its episodes time out.
CASES = {
    "cartpole": {"num_envs": 8, "episode_steps": 6, "pole_limit": 0.5},
    "go1": {"num_envs": 4, "episode_steps": 10},
}
THROUGH = ["FromMjlab", "FromRslRl"]


class RecordingEnv:
    """mjlab's env, every ``step`` and ``reset`` of it kept as it returned them (cloned), for the adapters above it.

    Its ``unwrapped`` is itself, so that ``FromMjlab`` and mjlab's ``RslRlVecEnvWrapper`` step it, not the env
    beneath; everything else is the env's. ``save`` (a path) writes the calls there when it is closed (in a worker
    process, at its end).
    """

    def __init__(self, env: Any, *, save: str | None = None) -> None:
        self._env, self.calls, self._save = env, [], save

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    @property
    def unwrapped(self) -> RecordingEnv:
        return self

    def reset(self, *, seed=None, env_ids=None, options=None):
        obs, extras = self._env.reset(seed=seed, env_ids=env_ids, options=options)
        self.calls.append(("reset", None if env_ids is None else env_ids.clone(), _clone(obs)))
        return obs, extras

    def step(self, action):
        obs, reward, terminated, time_outs, extras = self._env.step(action)
        self.calls.append(("step", action.clone(), _clone(obs), reward.clone(), terminated.clone(), time_outs.clone()))
        return obs, reward, terminated, time_outs, extras

    def close(self) -> None:
        self._env.close()
        if self._save is not None:
            torch.save(self.calls, f"{self._save}.part")
            Path(f"{self._save}.part").replace(self._save)


def adapt(env: RecordingEnv, through: str):
    if through == "FromMjlab":
        return FromMjlab(env)
    return FromRslRl(RslRlVecEnvWrapper(env), bootstrap="last_obs")


def expected(calls: list, through: str) -> Record:
    """What the collector's rows must be, from mjlab's own calls, as a SAME_STEP record (``check_same_step_rows``).

    FromMjlab: after the collector's reset, each step's observation is mjlab's, replaced by that of the reset that
    follows it (``reset(env_ids=...)`` of exactly the envs that ended) in the envs that ended; mjlab's observation
    is the final one. FromRslRl: mjlab resets inside its step (no reset call); the wrapper's constructor reset and
    the collector's come first, and a row that ended an episode bootstraps from its own observation (V(s_t)).
    """
    resets = 1 if through == "FromMjlab" else 2  # the collector's reset; before it, the wrapper's own
    assert [call[0] for call in calls[:resets]] == ["reset"] * resets
    assert all(call[1] is None for call in calls[:resets]), "the first resets reset every env"
    obs = calls[resets - 1][2]
    record = Record(resets=[obs])
    rest = iter(calls[resets:])
    for call in rest:
        assert call[0] == "step", f"a reset of mjlab's env with no step before it: {call[1]}"
        _, action, returned, reward, terminated, time_outs = call
        done = terminated | time_outs
        if through == "FromMjlab":
            final = returned
            if bool(done.any()):
                kind, env_ids, fresh = next(rest)
                assert kind == "reset" and torch.equal(env_ids, done.nonzero().squeeze(-1)), "reset of the ended envs"
                returned = _where(done, fresh, returned)
        else:
            final = obs  # V(s_t): the row's own observation stands for the final one
        record.steps.append(
            Step(
                action=action,
                obs=returned,
                reward=reward,
                terminated=terminated,
                truncated=time_outs,
                infos={"final_obs": final},
            )
        )
        obs = returned
    return record


def agent_for(task: str) -> LinearAgent:
    _, (actor, _), actions = TASKS[task]
    return LinearAgent(actor, actions, group="actor")


def options_of(task: str, through: str) -> dict[str, Any]:
    """``make_env``'s keywords for ``task`` stepped ``through`` an adapter: FromMjlab needs ``auto_reset=False``."""
    return {**episodes(task), "auto_reset": through != "FromMjlab"}


def episodes(task: str) -> dict[str, Any]:
    """``CASES[task]`` but for its number of envs: the episodes' options of ``make_env``."""
    return {key: value for key, value in CASES[task].items() if key != "num_envs"}


def collector_for(envs: Any, agent: LinearAgent, through: str, **options: Any) -> Collector:
    num_envs = options.pop("num_envs", None) or envs.num_envs
    return Collector(
        envs,
        agent,
        num_envs=num_envs,
        num_steps=NUM_STEPS,
        total_timesteps=num_envs * NUM_STEPS * BATCHES,
        device="cpu",
        gae=GAE(gamma=GAMMA, gae_lambda=LAMBDA),
        keys=BatchKeys(next_obs=True, info_keys=("bootstrap",) if through == "FromRslRl" else ()),
        **options,
    )


def check_rows(batches: list, calls: list, agent: LinearAgent, through: str) -> None:
    """Every row against mjlab's calls (``expected``), and the bootstrap each adapter promises."""
    record = expected(calls, through)
    check_same_step_rows(batches, record, agent, final_key="final_obs", gamma=GAMMA, gae_lambda=LAMBDA)
    steps = iter(record.steps)
    for batch in batches:
        for t in range(batch.batch_size[0]):
            step, row = next(steps), batch[t]
            time_out = step.truncated & ~step.terminated
            if through == "FromMjlab":  # exact: the final observation is mjlab's, not the row's own
                assert torch.equal(row["next_obs", "actor"][time_out], step.infos["final_obs"]["actor"][time_out])
            else:  # approximate: V(s_t) reused, each such row marked 1
                assert torch.equal(row["info", "bootstrap"], time_out.to(torch.int8))
                assert torch.equal(row["next_value"][time_out], row["value"][time_out])


@pytest.mark.parametrize("through", THROUGH)
@pytest.mark.parametrize("task", list(CASES))
def test_rows_match_what_mjlab_returned(task, through):
    env = RecordingEnv(make_env(task, CASES[task]["num_envs"], **options_of(task, through)))
    envs, agent = adapt(env, through), agent_for(task)
    assert set(envs.single_observation_space.keys()) == {"actor", "critic"}
    assert envs.single_observation_space["critic"].shape == (TASKS[task][1][1],)
    with collector_for(envs, agent, through, backend="thread", prefetch=0) as collector:
        batches = list(collector)
    envs.close()
    check_rows(batches, env.calls, agent, through)
    truncated = sum(int(batch["truncated"].sum()) for batch in batches)
    assert truncated >= 4, f"only {truncated} time-outs to check"
    if task == "cartpole":
        assert sum(int(batch["terminated"].sum()) for batch in batches) >= 4, "too few terminations to check"
        both = sum(int((call[4] & call[5]).sum()) for call in env.calls if call[0] == "step")
        assert both >= 1, "no step that both terminated and timed out"  # both flags in the batch (check_rows)


def test_rows_collected_a_batch_ahead():
    env = RecordingEnv(make_env("cartpole", CASES["cartpole"]["num_envs"], **options_of("cartpole", "FromMjlab")))
    envs, agent = FromMjlab(env), agent_for("cartpole")
    with collector_for(envs, agent, "FromMjlab", backend="thread", prefetch=1, seed=3) as collector:
        batches = list(collector)
    envs.close()
    assert len(env.calls) > 1 + NUM_STEPS * BATCHES, "collected no step ahead"
    check_rows(batches, env.calls, agent, "FromMjlab")


@pytest.mark.parametrize("through", THROUGH)
def test_seeded_runs_repeat(through):
    """FromMjlab: the collector's seed reaches mjlab's reset. FromRslRl: cfg.seed seeds the env when it is built,
    before the wrapper's reset and the collector's; either way a second run gives the same batches, bit for bit."""
    runs = []
    for _ in range(2):
        env = make_env("cartpole", CASES["cartpole"]["num_envs"], seed=5, **options_of("cartpole", through))
        envs, agent = adapt(env, through), agent_for("cartpole")
        seed = 5 if through == "FromMjlab" else None
        with collector_for(envs, agent, through, backend="thread", prefetch=0, seed=seed) as collector:
            runs.append(list(collector))
        envs.close()
    for first, second in zip(*runs, strict=True):
        for key in ("obs", "next_obs", "action", "reward", "terminated", "truncated", "value", "next_value"):
            assert (first[key] == second[key]).all(), key


def recording_envs(num_envs: int, start_index: int = 0, *, task: str, through: str, folder: str):
    """A worker's share, recorded beneath the adapter and saved to ``folder/<start_index>.pt`` when closed (a
    module-level recipe, for worker processes)."""
    env = RecordingEnv(make_env(task, num_envs, **options_of(task, through)), save=f"{folder}/{start_index}.pt")
    return adapt(env, through)


@pytest.mark.parametrize(
    ("task", "through"), [("cartpole", "FromMjlab"), ("cartpole", "FromRslRl"), ("go1", "FromMjlab")]
)
def test_worker_processes_that_build_mjlab_envs(task, through, tmp_path):
    """Two worker processes each build mjlab's env of their share; every row of the trainer's batches is checked
    against what mjlab returned in the worker that stepped it."""
    num_envs, agent = CASES[task]["num_envs"], agent_for(task)
    recipe = functools.partial(recording_envs, task=task, through=through, folder=str(tmp_path))
    seed = 0 if through == "FromMjlab" else None  # an rsl_rl-style env is seeded when it is built
    with collector_for(recipe, agent, through, num_envs=num_envs, backend=Processes(2), seed=seed) as collector:
        batches = list(collector)
    shares = split_envs(num_envs, 2)
    records = load_records(str(tmp_path), [start for start, _ in shares], timeout=60)
    for (start, count), calls in zip(shares, records, strict=True):
        check_rows([batch[:, start : start + count] for batch in batches], calls, agent, through)
    assert sum(int(batch["truncated"].sum()) for batch in batches) >= 4, "too few time-outs to check"


def test_from_mjlab_refuses_an_env_that_resets_itself():
    env = make_env("cartpole", 2)  # the task's default: auto_reset=True
    with pytest.raises(ValueError, match=r"cfg.auto_reset=True.*Set cfg.auto_reset = False.*bootstrap='last_obs'"):
        FromMjlab(env)
    with pytest.raises(ValueError, match=r"FromMjlab: env=object is not an mjlab env"):
        FromMjlab(object())
    env.close()


def never_reset_envs(num_envs: int, start_index: int = 0):
    """mjlab's env with auto_reset=False behind mjlab's own rsl_rl wrapper, which never resets it: at the first step
    after an episode's end mjlab's step raises RuntimeError (a real fault of the simulator, in the trainer's
    process or a worker's). A module-level recipe."""
    env = make_env("cartpole", num_envs, **options_of("cartpole", "FromMjlab"))
    return FromRslRl(RslRlVecEnvWrapper(env), bootstrap="last_obs")


class FailingEnv(RecordingEnv):
    """mjlab's env whose ``at``-th step raises after mjlab's own step ran (a fault injected over the real env)."""

    def __init__(self, env: Any, *, at: int) -> None:
        super().__init__(env)
        self.at, self.steps = at, 0

    def step(self, action):
        result = super().step(action)
        self.steps += 1
        if self.steps == self.at:
            raise RuntimeError(f"mjlab step {self.at} failed")
        return result


def failing_envs(num_envs: int, start_index: int = 0):
    """FromMjlab over mjlab's env whose 5th step raises (the second batch's), in the worker with envs 2 and 3 only
    (a module-level recipe)."""
    env = make_env("cartpole", num_envs, **options_of("cartpole", "FromMjlab"))
    return FromMjlab(FailingEnv(env, at=5 if start_index + num_envs == 4 else 0))


# Each fault: the recipe of 4 envs, its adapter, what the error says, and the file of the frame that raised it
FAULTS = {
    "rsl_rl-wrapper-never-resets": (
        never_reset_envs,
        "FromRslRl",
        r"Environments \[\d(, \d)*\] must be reset via reset\(env_ids=\.\.\.\) before calling step\(\)",
        "mjlab/envs/manager_based_rl_env.py",
    ),
    "FromMjlab-step-5-raises": (failing_envs, "FromMjlab", r"^mjlab step 5 failed", "sims/tests/test_mjlab.py"),
}


@pytest.fixture(scope="module")
def forkserver():
    """The fork server that worker processes start from, and multiprocessing's resource tracker, live as long as
    this process: started before a test takes its snapshot of this process's children (a bundled env, cheap)."""
    with Collector(
        "torch_rollout/CartPole-v1",
        LinearAgent(4, 2, discrete=True),
        num_envs=2,
        num_steps=2,
        total_timesteps=4,
        device="cpu",
        backend=Processes(1),
    ) as collector:
        list(collector)


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("backend", ["thread", "processes"])
def test_an_env_that_fails_mid_step_reaches_the_trainer(backend, fault, forkserver):
    """The fault reaches next() with its cause, nothing is left behind (threads, processes, file descriptors), and
    a new collector over mjlab's envs then collects."""
    recipe, through, message, where = FAULTS[fault]
    agent = agent_for("cartpole")
    snapshot = Snapshot()
    options: dict[str, Any] = {"backend": "thread"} if backend == "thread" else {"backend": Processes(2)}
    envs = recipe(4) if backend == "thread" else recipe
    collector = collector_for(envs, agent, through, num_envs=4, timeout=120, **options)
    with pytest.raises(RuntimeError, match=message) as info:
        for _ in collector:
            pass
    if backend == "thread":  # the original traceback, down to the frame that raised
        files = [frame.filename for frame in traceback.extract_tb(info.value.__traceback__)]
        assert any(file.endswith(where) for file in files), files
    else:  # the worker's traceback chained, the worker named
        assert where in str(info.value.__cause__)
        assert re.match(r"\(raised in torch_rollout worker [01] \(pid \d+\)\)", info.value.__notes__[0])
    assert collector.closed
    assert wait_until(lambda: not collector_threads(), 30)
    with pytest.raises(RuntimeError, match="cannot iterate after the background collection failed with RuntimeError"):
        next(collector)
    if backend == "thread":
        envs.close()
    del collector, envs, info
    snapshot.assert_no_leaks()
    healthy = functools.partial(mjlab_envs, task="cartpole", **episodes("cartpole"))
    envs = healthy(4) if backend == "thread" else healthy
    with collector_for(envs, agent, "FromMjlab", num_envs=4, **options) as collector:
        batches = list(collector)
    if backend == "thread":
        envs.close()
    assert len(batches) == BATCHES and any(bool(batch["done"].any()) for batch in batches)


DOCS = Path(__file__).resolve().parents[2] / "docs" / "mjlab.md"
EXAMPLES = re.findall(r"^```python\n(.*?)^```", DOCS.read_text(), re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example-{i + 1}" for i in range(len(EXAMPLES))])
def test_the_docs_examples_run(code):
    """docs/mjlab.md's examples, which the main suite's docs test skips (it has no mjlab), run here as written."""
    assert len(EXAMPLES) == 2
    exec(compile(code, str(DOCS), "exec"), {"__name__": "docs_mjlab"})
