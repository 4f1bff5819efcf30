"""collector.stats(): the account of where the time goes, per phase and per worker, and its verdict.

The phases are made slow on purpose (an env or a policy that sleeps, a trainer that sleeps between batches), so
that the assertions hold on any machine: a sleep lasts at least its length, and each slow phase is many times
longer than everything else.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import time

import pytest

from torch_rollout import Collector, Stats, WorkerStats
from torch_rollout.loop._stats import Setting

from placements import PLACEMENTS, local_ray, num_loops, on_ray
from reliability_envs import ConstantPolicy
from timed_envs import make_slow_envs

T, N = 5, 4
PAUSE = 0.004  # seconds per env's step, or per forward
# The pause of the phase whose share is asserted: long enough that it outweighs the rest under coverage.py's
# tracing on a loaded 2-core machine too (the rest took 0.29 s of a 3-batch run there, against 0.24 s of env sleeps
# at PAUSE).
SLOW = 5 * PAUSE


def collector(env_pause: float = 0.0, policy_pause: float = 0.0, **options) -> Collector:
    options.setdefault("backend", "thread")
    options.setdefault("prefetch", 0)
    return Collector(
        functools.partial(make_slow_envs, pause=env_pause),
        ConstantPolicy(pause=policy_pause),
        num_envs=N,
        num_steps=T,
        device="cpu",
        **options,
    )


def take(c: Collector, batches: int, pause: float = 0.0) -> None:
    it = iter(c)
    for _ in range(batches):
        next(it)
        time.sleep(pause)


@pytest.mark.parametrize("backend,prefetch", [("thread", 0), ("thread", 1)])
def test_env_time_is_counted_as_env(backend, prefetch):
    with collector(env_pause=SLOW, backend=backend, prefetch=prefetch) as c:
        take(c, 3)
        stats = c.stats()
    assert stats.batches == 3 and stats.frames == 3 * T * N
    # Each of the T vector steps of a batch sleeps N times (no episode ends).
    assert stats.env >= 3 * T * N * SLOW
    assert stats.env > 2 * (stats.policy + stats.collector)  # a loaded machine slows the rest too
    assert max(stats.shares(), key=stats.shares().get) == "env"
    assert "env steps took" in stats.verdict()


def test_policy_time_is_counted_as_policy():
    with collector(policy_pause=SLOW) as c:
        take(c, 3)
        stats = c.stats()
    # A forward per step, and one more per batch for the value of the observations the next batch starts with.
    assert stats.policy >= 3 * (T + 1) * SLOW
    assert stats.policy > 2 * (stats.env + stats.collector)  # a loaded machine slows the rest too
    assert "the policy's forward took" in stats.verdict()


@pytest.mark.parametrize("prefetch", [0, 1])
def test_the_collectors_work_around_the_env_and_policy_calls_is_counted_as_the_collectors(monkeypatch, prefetch):
    """The checks of what the env returned, the conversion of the actions for it and the checks of the policy's
    outputs run around the env's and the policy's own calls: slowed down, they show in ``collector`` only."""
    from torch_rollout.envs._spaces import ActionConverter, ObsChecker
    from torch_rollout.loop._acting import Acting

    def slowed(method):
        def slow(*args, **kwargs):
            time.sleep(SLOW)
            return method(*args, **kwargs)

        return slow

    monkeypatch.setattr(ObsChecker, "__call__", slowed(ObsChecker.__call__))  # after each reset and step
    monkeypatch.setattr(ActionConverter, "__call__", slowed(ActionConverter.__call__))  # before each step
    monkeypatch.setattr(Acting, "check_outputs", slowed(Acting.check_outputs))  # after each forward
    with collector(prefetch=prefetch) as c:
        take(c, 2)
        stats = c.stats()
    slowed_down = 2 * T * 3 * SLOW  # three sleeps a step at least, over the 2 batches' T steps
    assert stats.collector >= slowed_down
    assert stats.env < slowed_down / 4 and stats.policy < slowed_down / 4, stats


def test_lockstep_trainer_time_is_the_loops_idle_and_not_waiting():
    pause = 0.05
    with collector() as c:
        take(c, 4, pause=pause)
        stats = c.stats()
    # The loop runs inside next(): between batches it is idle while the trainer sleeps.
    assert stats.idle >= 3 * pause
    assert stats.wait < stats.seconds - 3 * pause
    assert stats.training >= 3 * pause


def test_a_slow_trainer_is_named_as_what_bounds_the_run():
    with collector(backend="thread", prefetch=1) as c:
        take(c, 4, pause=0.1)
        stats = c.stats()
    assert stats.verdict().startswith("training bounds the run")
    assert stats.wait < 0.1 * stats.seconds


def test_the_thread_waits_for_requests_as_idle():
    with collector(backend="thread", prefetch=1) as c:
        take(c, 3, pause=0.1)
        stats = c.stats()
    # With one batch ahead, the loop waits for the trainer's next request about as long as the trainer sleeps.
    assert stats.idle >= 0.1
    assert stats.workers[0].idle == stats.idle


def test_reset_starts_a_new_account():
    with collector(env_pause=PAUSE) as c:
        take(c, 2)
        before = c.stats(reset=True)
        assert before.batches == 2
        after = c.stats()
        assert after.batches == 0 and after.frames == 0 and after.seconds < before.seconds
        assert after.env < PAUSE * N  # nothing stepped since the reset, except perhaps nothing at all
        take_more = iter(c)
        next(take_more)
        later = c.stats()
    assert later.batches == 1 and later.frames == T * N
    assert later.env >= T * N * PAUSE


@pytest.mark.ray
@pytest.mark.parametrize("placement", [p for p in PLACEMENTS if num_loops(p.values[0]) == 2])
def test_workers_send_their_accounts(placement):
    if on_ray(placement):
        local_ray()
    with collector(env_pause=PAUSE, prefetch=1, **placement) as c:
        take(c, 3)
        stats = c.stats()
    assert len(stats.workers) == 2
    for worker in stats.workers:
        # Each worker steps N / 2 envs; its account counts up to its last batch (3 or more, collected ahead).
        assert worker.frames >= 3 * T * (N // 2)
        assert worker.env >= 3 * T * (N // 2) * PAUSE
    assert stats.env == pytest.approx(sum(w.env for w in stats.workers))
    assert stats.setting.backend == ("ray" if on_ray(placement) else "process") and stats.setting.num_workers == 2


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_each_loops_account_adds_up_to_the_wall_time(placement):
    """Every collection loop accounts for its whole time since the collector started: its env, policy, own work
    and idle seconds add up to the wall time, less what a worker has not reported yet (the batch it collects
    ahead, whose account comes with it)."""
    if on_ray(placement):
        local_ray()
    batches = 30
    with collector(env_pause=PAUSE / 4, prefetch=1, **placement) as c:
        take(c, batches, pause=0.01)
        stats = c.stats()
    assert stats.workers, "no loop reported its account"
    for worker in stats.workers:
        collected = worker.frames // (T * N // len(stats.workers))
        per_batch = (worker.env + worker.policy + worker.collector) / collected
        # within 5% (a worker's clock starts a little before the trainer's: it reports ready once its loop is built)
        assert 0.95 * stats.seconds - per_batch <= worker.seconds <= 1.05 * stats.seconds, (stats, worker)


def test_stats_pickle_and_print_in_one_line():
    with collector(env_pause=PAUSE) as c:
        take(c, 2)
        stats = c.stats()
    again = pickle.loads(pickle.dumps(stats))
    assert again == stats
    line = str(stats)
    assert "\n" not in line
    assert "frames/s" in line and "env " in line and "trainer waits" in line


def _setting(**changes) -> Setting:
    base = dict(
        backend="thread",
        num_workers=1,
        num_envs=8,
        num_steps=128,
        prefetch=0,
        device="cpu",
        live_envs=False,
        check_finite=False,
        info_keys=0,
        cores=2,
        gpus=0,
    )
    return Setting(**{**base, **changes})


def _stats(setting: Setting, *, env=8.0, policy=1.0, collector=1.0, idle=0.0, wait=9.0, seconds=10.0) -> Stats:
    workers = tuple(
        WorkerStats(
            env=env / setting.num_workers,
            policy=policy / setting.num_workers,
            collector=collector / setting.num_workers,
            idle=idle / setting.num_workers,
            frames=100,
        )
        for _ in range(setting.num_workers)
    )
    return Stats(
        seconds=seconds,
        frames=1000,
        batches=10,
        env=env,
        policy=policy,
        collector=collector,
        idle=idle,
        wait=wait,
        workers=workers,
        setting=setting,
    )


def test_verdict_recommends_workers_up_to_the_cores_and_never_past_them():
    assert "Processes(num_workers=2)" in _stats(_setting(cores=2)).verdict()
    assert "Processes(num_workers=4)" in _stats(_setting(cores=4)).verdict()
    at_the_cores = _stats(_setting(backend="process", num_workers=2, cores=2)).verdict()
    assert "Processes(" not in at_the_cores and "not more workers" in at_the_cores
    assert "Processes(" not in _stats(_setting(cores=1)).verdict()
    # A trainer busy most of the time keeps a core for itself.
    busy_trainer = _stats(_setting(cores=4), wait=3.0)
    assert "Processes(num_workers=3)" in busy_trainer.verdict()
    # Never more workers than envs.
    assert "Processes(num_workers=2)" in _stats(_setting(cores=16, num_envs=2)).verdict()


def test_verdict_names_the_collectors_setting_to_change():
    verdict = _stats(_setting(num_steps=1, check_finite=True, info_keys=3), env=1.0, collector=8.0).verdict()
    assert "the collector's own work took" in verdict
    assert "num_steps=1" in verdict and "check_finite=False" in verdict and "info_keys" in verdict


def test_verdict_offers_a_gpu_only_where_there_is_one():
    policy_bound = dict(env=1.0, policy=8.0)
    assert "device='cuda'" not in _stats(_setting(gpus=0), **policy_bound).verdict()
    assert "device='cuda'" in _stats(_setting(gpus=1), **policy_bound).verdict()


def test_a_live_env_is_pointed_to_a_recipe_for_worker_processes():
    verdict = _stats(_setting(live_envs=True)).verdict()
    assert "make_envs(num_envs)" in verdict


def test_a_trainer_bound_run_on_the_thread_is_pointed_to_a_worker_process_where_the_thread_was_busy():
    # SAC's shape: the trainer hardly waits, the collector's thread is busy 8% of the time beside it
    def trainer_bound(setting, env=0.3, policy=0.4):
        return _stats(setting, env=env, policy=policy, collector=0.1, idle=9.2, wait=0.1).verdict()

    on_the_thread = trainer_bound(_setting(prefetch=1))
    assert on_the_thread.startswith("training bounds the run")
    assert "busy 8% of the time" in on_the_thread and "Processes(num_workers=1)" in on_the_thread
    # not where the thread hardly ran, where it is not beside the trainer, nor where it cannot move
    assert "Processes(" not in trainer_bound(_setting(prefetch=1), env=0.05, policy=0.05)
    assert "Processes(" not in trainer_bound(_setting(prefetch=0))
    assert "Processes(" not in trainer_bound(_setting(prefetch=1, live_envs=True))
    assert "Processes(" not in trainer_bound(_setting(prefetch=1, cores=1))
    assert "Processes(" not in trainer_bound(_setting(backend="process", prefetch=1))


def test_a_policy_bound_run_is_not_sent_to_workers_that_would_only_split_its_cores():
    # A 512x512 MLP on CartPole, 2 cores: the forward already runs on both of them as torch threads
    policy_bound = dict(env=1.0, policy=8.0)
    on_two_threads = _stats(_setting(cores=2, threads=2), **policy_bound).verdict()
    assert "Processes(" not in on_two_threads
    assert "compile_policy=True" in on_two_threads and "would split those cores" in on_two_threads
    # where workers would add cores past the forward's threads, they are offered after the policy's own lever,
    # saying what they expect
    on_one_thread = _stats(_setting(cores=4, threads=1), **policy_bound).verdict()
    assert on_one_thread.index("compile_policy=True") < on_one_thread.index("Processes(num_workers=4)")
    assert "expects the policy's forward on 4 cores instead of 1" in on_one_thread
    # env-bound: the env steps run on one core in the thread, so workers are still offered first
    env_bound = _stats(_setting(cores=2, threads=2)).verdict()
    assert env_bound.index("Processes(num_workers=2)") < env_bound.index("a faster env")
    assert "expects env steps on 2 cores instead of 1" in env_bound


def test_workers_are_not_offered_where_each_step_is_mostly_a_cost_per_call_that_every_worker_would_pay():
    # A near-free env with a 64x64 actor-critic, N=16, one torch thread, 2 cores: the forward took about 160 us a
    # step whatever its rows, and Processes(num_workers=2) measured 0.86x-0.90x the thread there (tune).
    def policy_bound(per_step: float, backend="thread", num_workers=1, cores=2) -> str:
        steps = 1000
        setting = _setting(num_envs=16, cores=cores, backend=backend, num_workers=num_workers)
        stats = _stats(setting, env=0.05 * per_step * steps, policy=per_step * steps, collector=0.3 * per_step * steps)
        return dataclasses.replace(stats, frames=16 * steps).verdict()

    near_free = policy_bound(160e-6)
    assert "Processes(" not in near_free and "compile_policy=True" in near_free
    assert "not more worker processes" in near_free and "160 us a step" in near_free
    # where the forward costs milliseconds, most of it grows with the rows, which workers share
    heavy = policy_bound(8e-3)
    assert "Processes(num_workers=2)" in heavy and "about 2.0x as fast" in heavy
    # the same accounts from a run that already has two workers, on 4 cores: each worker's call 80 us, or 4 ms
    assert "Processes(" not in policy_bound(160e-6, backend="process", num_workers=2, cores=4)
    assert "Processes(num_workers=4)" in policy_bound(8e-3, backend="process", num_workers=2, cores=4)


def test_the_verdict_leaves_out_a_placement_measured_slower():
    env_bound = _stats(_setting(cores=2))
    assert "Processes(num_workers=2)" in env_bound.verdict()
    assert "Processes(" not in env_bound.verdict(slower=["Processes(num_workers=2)"])
    assert "a faster env" in env_bound.verdict(slower=["Processes(num_workers=2)"])
    gil = _stats(_setting(prefetch=1), env=0.3, policy=0.4, collector=0.1, idle=9.2, wait=0.1)
    assert "Processes(num_workers=1)" in gil.verdict()
    assert "Processes(" not in gil.verdict(slower=["Processes(num_workers=1)"])
    assert "Processes(" not in gil.describe(slower=["Processes(num_workers=1)"])


def test_the_verdict_on_accounts_with_nothing_to_judge_or_no_lever():
    none_yet = Stats(
        seconds=0.0, frames=0, batches=0, env=0.0, policy=0.0, collector=0.0, idle=0.0, wait=0.0, workers=(),
        setting=_setting(),
    )  # fmt: skip
    assert none_yet.verdict() == "no batch delivered yet: nothing to judge"
    assert none_yet.shares() == dict.fromkeys(("env", "policy", "collector", "idle"), 0.0)
    idle = _stats(_setting(), env=0.0, policy=0.0, collector=0.0, idle=1.0)
    assert idle.verdict() == "the trainer waited 90% of the time, with no collection accounted"
    # the collector's own work bounds a run with none of its costly settings, on workers already at the cores
    at_the_cores = _setting(backend="process", num_workers=2, cores=2)
    verdict = _stats(at_the_cores, env=1.0, policy=1.0, collector=8.0).verdict()
    assert "none of the collector's settings is to blame" in verdict
    # Ray's lever names Ray, and a GPU simulator in lockstep is pointed to prefetch=1
    assert (
        "more Ray actors: backend=torch_rollout.Ray(num_workers=4)"
        in _stats(_setting(backend="ray", cores=4)).verdict()
    )
    gpu_lockstep = _setting(live_envs=True, device="cuda", cores=1)
    assert "prefetch=1, to step a GPU simulator beside training" in _stats(gpu_lockstep).verdict()


def test_stats_of_another_collector_cannot_be_subtracted():
    later, other = _stats(_setting(), seconds=10.0), _stats(_setting(num_envs=4), seconds=5.0)
    with pytest.raises(ValueError, match="of another collector's settings"):
        later - other
    assert later.__sub__(object()) is NotImplemented
