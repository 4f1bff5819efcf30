"""torch_rollout.tune: a row per placement that applies, a best that builds a working Collector, the thread's
placements only for a live vector env, worker processes ahead where the env waits or holds the GIL, and the
command line.

No test asserts a speed of the machine, except orderings that the envs make large: two worker processes step
an env that sleeps, or (given two cores to spare) one that holds the GIL, about twice as fast as the thread.
"""

from __future__ import annotations

import functools
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
import pytest
import torch

import torch_rollout
from torch_rollout import Collector, Processes, tune
from torch_rollout.__main__ import main
from torch_rollout.loop._stats import available_cores
from torch_rollout.tuning import MLPPolicy, default_placements

from reliability_envs import ConstantPolicy
from timed_envs import make_busy_envs, make_slow_envs

ROOT = Path(__file__).resolve().parent.parent
N, T = 2, 8
LOCKSTEP = "backend='thread', prefetch=0"
AHEAD = "backend='thread', prefetch=1"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The trainer on one torch thread, as trainers on small CPU machines set it (tune uses the caller's setting)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def workers(k: int) -> str:
    return f"backend=Processes(num_workers={k}), prefetch=1"


def table_rows(out: str) -> dict[str, str]:
    """The printed table's rows by placement: ``{label: the rest of its line}``."""
    rows = {}
    for line in out.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| backend="):
            rows[cells[0]] = " | ".join(cells[1:])
    return rows


def test_a_row_per_placement_that_applies_and_the_best_builds_a_collector(capsys):
    best = tune("CartPole-v1", num_envs=N, num_steps=T, seconds=1.0, device="cpu")  # the default MLP policy
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert list(rows) == [LOCKSTEP, AHEAD] + [workers(k) for k in range(1, min(available_cores(), N) + 1)]
    assert not any("refused" in row for row in rows.values())
    assert "1 torch thread in the trainer" in out
    assert "no training between batches" in out
    assert best in default_placements(N)
    assert f"best: {', '.join(f'{key}={value!r}' for key, value in best.items())} (" in out
    with Collector(
        "CartPole-v1", ConstantPolicy(), num_envs=N, num_steps=T, device="cpu", total_timesteps=N * T, **best
    ) as collector:
        batches = list(collector)
    assert len(batches) == 1 and batches[0].batch_size == (T, N)


def test_a_live_vector_env_gets_the_thread_placements_only(capsys):
    envs = gymnasium.make_vec("CartPole-v1", num_envs=N, vectorization_mode="sync")
    try:
        best = tune(envs, ConstantPolicy(), num_steps=T, seconds=0.4, device="cpu")
    finally:
        envs.close()
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [label for label, row in rows.items() if "refused" not in row] == [LOCKSTEP, AHEAD]
    assert all(rows[workers(k)].startswith("refused [") for k in range(1, min(available_cores(), N) + 1))
    assert "envs is a live SyncVectorEnv" in out  # the Collector's own reason, under the table
    assert best["backend"] == "thread"


def cores_to_spare(seconds: float = 0.3) -> float:
    """The cores that two processes spinning side by side get now: 2 on an idle machine, fewer beside other work.

    Linux shares the CPU fairly between sessions (autogroups), not processes: beside the work of other sessions,
    two worker processes of this one get no more CPU than one would.
    """
    spin = f"import time\nend = time.perf_counter() + {seconds}\nwhile time.perf_counter() < end: pass"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    for child in [subprocess.Popen([sys.executable, "-S", "-c", spin]) for _ in range(2)]:
        child.wait()
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / wall


def test_worker_processes_win_on_an_env_that_holds_the_gil(capsys):
    cores = available_cores()
    if cores < 2:
        pytest.skip(f"two worker processes outrun the thread only on 2 cores or more; this process may use {cores}")
    spare = cores_to_spare()
    if spare < 1.6:
        pytest.skip(
            f"two spinning processes got {spare:.1f} cores together just now (other work): two workers would too"
        )
    # 2 ms of Python per env step: the thread's batch holds the GIL for 64 ms; two workers split it over two cores.
    envs = functools.partial(make_busy_envs, busy=0.002)
    placements = [{"backend": "thread", "prefetch": 0}, {"backend": "thread", "prefetch": 1}]
    placements.append({"backend": Processes(num_workers=2), "prefetch": 1})
    best = tune(envs, ConstantPolicy(), num_envs=2, num_steps=16, seconds=1.5, placements=placements, device="cpu")
    rows = table_rows(capsys.readouterr().out)
    assert best == placements[2], rows


def test_worker_processes_win_on_an_env_that_waits():
    # 2 ms of sleep per env step (the GIL released, little CPU): two workers wait side by side, even on a busy
    # machine, where the thread's batch waits 64 ms.
    envs = functools.partial(make_slow_envs, pause=0.002)
    placements = [{"backend": "thread", "prefetch": 0}, {"backend": Processes(num_workers=2), "prefetch": 1}]
    best = tune(envs, ConstantPolicy(), num_envs=2, num_steps=16, seconds=1.0, placements=placements, device="cpu")
    assert best == placements[1]


def test_given_placements_and_a_stand_in_update(capsys):
    placements = [{"backend": "thread", "prefetch": 1}, {"backend": "thread", "prefetch": 0, "check_finite": True}]
    best = tune(
        "CartPole-v1",
        ConstantPolicy(),
        num_envs=N,
        num_steps=T,
        seconds=0.3,
        train_seconds=0.01,
        placements=placements,
        device="cpu",
    )
    out = capsys.readouterr().out
    assert list(table_rows(out)) == [AHEAD, f"{LOCKSTEP}, check_finite=True"]
    assert "train_seconds=0.01" in out
    assert best in placements


class EvenShares:
    """CartPole envs, from a recipe that refuses a worker an odd number of them (as EnvPool's refuses some splits)."""

    def __call__(self, num_envs: int) -> gymnasium.vector.VectorEnv:
        return gymnasium.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")

    def check_shares(self, shares: list[tuple[int, int]]) -> None:
        for start, stop in shares:
            if (stop - start) % 2:
                raise ValueError(f"EvenShares: envs {start}..{stop - 1} are an odd share; give each worker an even one")


def test_a_placement_that_the_recipe_refuses_gets_a_row_saying_why(capsys):
    placements = [{"backend": "thread", "prefetch": 0}, {"backend": Processes(num_workers=2)}]
    best = tune(
        EvenShares(), ConstantPolicy(), num_envs=2, num_steps=T, seconds=0.2, placements=placements, device="cpu"
    )
    out = capsys.readouterr().out
    assert table_rows(out)["backend=Processes(num_workers=2)"].startswith("refused [1]")
    assert "[1] backend=Processes(num_workers=2): refused: ValueError: EvenShares: envs 0..0 are an odd share" in out
    assert best == placements[0]


def test_every_placement_refused_raises_the_collectors_error():
    envs = gymnasium.make_vec("CartPole-v1", num_envs=N, vectorization_mode="sync")
    try:
        with pytest.raises(TypeError, match=re.escape("Collector(backend='process'): envs is a live SyncVectorEnv")):
            tune(envs, ConstantPolicy(), num_steps=T, seconds=0.2, placements=[{"backend": "process"}], device="cpu")
    finally:
        envs.close()


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"num_steps": T}, ValueError, "tune: num_envs is required with an env id or a function"),
        ({"num_steps": 0, "num_envs": N}, ValueError, "tune: num_steps must be an int >= 1, got 0"),
        (
            {"num_steps": T, "num_envs": N, "seconds": 0},
            ValueError,
            "tune: seconds must be a finite number > 0 of seconds, got 0",
        ),
        (
            {"num_steps": T, "num_envs": N, "seconds": float("inf")},
            ValueError,
            "seconds must be a finite number > 0 of seconds, got inf",
        ),
        (
            {"num_steps": T, "num_envs": N, "train_seconds": -1},
            ValueError,
            "tune: train_seconds must be a finite number >= 0 of seconds, got -1",
        ),
        (
            {"num_steps": T, "num_envs": N, "placements": {"backend": "thread"}},
            TypeError,
            "tune: placements must be a non-empty list of dicts of Collector keyword arguments",
        ),
        (
            {"num_steps": T, "num_envs": N, "placements": [{"backend": "thread", "num_envs": 4}]},
            ValueError,
            "tune: placements[0] has ['num_envs'], which are not Collector keyword arguments that a placement may set",
        ),
        (
            {"num_steps": T, "num_envs": N, "placements": ["thread"]},
            TypeError,
            "tune: placements[0] must be a dict of Collector keyword arguments",
        ),
    ],
    ids=[
        "no-num-envs",
        "num-steps-0",
        "seconds-0",
        "seconds-inf",
        "train-seconds-negative",
        "placements-a-dict",
        "fixed-key",
        "placement-a-str",
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        tune("CartPole-v1", ConstantPolicy(), **kwargs)


def test_the_default_policy_refuses_spaces_it_does_not_take():
    with pytest.raises(TypeError, match=re.escape("tune: the default policy takes Discrete or Box actions")):
        MLPPolicy(gymnasium.spaces.Box(-1, 1, (3,)), gymnasium.spaces.MultiBinary(2))
    continuous = MLPPolicy(gymnasium.spaces.Box(-1, 1, (3,)), gymnasium.spaces.Box(-1, 1, (2, 2)))
    assert continuous(torch.zeros(5, 3))["action"].shape == (5, 2, 2)


def test_python_m_torch_rollout_tune_prints_the_table_and_the_collector_call():
    # A fresh interpreter run with -m: its worker processes import __main__ by its module name.
    command = [sys.executable, "-m", "torch_rollout", "tune", "CartPole-v1", "--num-envs", "1", "--num-steps", "4"]
    options = ["--seconds", "0.2", "--device", "cpu", "--threads", "1", "--policy", "torch_rollout.tuning:MLPPolicy"]
    done = subprocess.run(
        [*command, *options],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    rows = table_rows(done.stdout)
    assert list(rows) == [LOCKSTEP, AHEAD, workers(1)] and "refused" not in rows[workers(1)]
    assert "1 torch thread in the trainer" in done.stdout
    assert re.search(r"^Collector\('CartPole-v1', policy, num_envs=1, num_steps=4, backend=", done.stdout, re.MULTILINE)


def test_the_command_lines_json_holds_every_trial_as_printed(tmp_path, capsys):
    path = tmp_path / "tune.json"
    argv = ["tune", "CartPole-v1", "--num-envs", "1", "--num-steps", "4", "--seconds", "0.3", "--device", "cpu"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    record = json.loads(path.read_text())
    assert record["command"] == "python -m torch_rollout " + " ".join([*argv, "--json", str(path)])
    assert record["cores"] == available_cores() and record["torch_threads"] == 1
    printed = table_rows(out)
    assert [entry["placement"] for entry in record["placements"]] == list(printed) == [LOCKSTEP, AHEAD, workers(1)]
    for entry in record["placements"]:
        assert len(entry["frames_per_s"]) == 3 and entry["median"] == sorted(entry["frames_per_s"])[1]
        assert printed[entry["placement"]].startswith(f"{entry['median']:,.0f} | ")
    assert f"best: {record['best']} (" in out


def test_the_command_line_refuses_a_json_path_in_no_folder(tmp_path):
    missing = tmp_path / "nowhere" / "tune.json"
    with pytest.raises(SystemExit, match=re.escape(f"--json {str(missing)!r}: no folder")):
        main(["tune", "CartPole-v1", "--num-envs", "1", "--num-steps", "4", "--json", str(missing)])


@pytest.mark.parametrize(
    "option,message",
    [
        ("--policy=nowhere", "--policy must be MODULE:FACTORY (e.g. mypackage.agents:make_agent), got 'nowhere'"),
        ("--policy=torch_rollout.tuning:Nothing", "module 'torch_rollout.tuning' has no 'Nothing'"),
    ],
    ids=["policy-without-colon", "policy-missing"],
)
def test_the_command_line_refuses_a_bad_policy(option, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["tune", "CartPole-v1", "--num-envs", "1", "--num-steps", "4", option])


@pytest.mark.parametrize(
    "option,message",
    [
        ("--threads=0", "argument --threads: expected an int >= 1, got '0'"),
        ("--num-envs=-2", "argument --num-envs: expected an int >= 1, got '-2'"),
        ("--seconds=inf", "argument --seconds: expected a finite number of seconds > 0, got 'inf'"),
        ("--seconds=0", "argument --seconds: expected a finite number of seconds > 0, got '0'"),
        ("--train-seconds=x", "argument --train-seconds: expected a finite number of seconds >= 0, got 'x'"),
    ],
    ids=["threads-0", "num-envs-negative", "seconds-inf", "seconds-0", "train-seconds-not-a-number"],
)
def test_the_command_line_refuses_bad_numbers(option, message, capsys):
    with pytest.raises(SystemExit):
        main(["tune", "CartPole-v1", "--num-envs", "1", "--num-steps", "4", option])
    assert message in capsys.readouterr().err


def test_tune_is_the_function():
    assert torch_rollout.tune is tune and callable(torch_rollout.tune)


def test_the_advice_printed_never_names_a_placement_just_measured_slower():
    """The rule, on stubbed timings: the best's account would advise two workers, which the trials measured slower."""
    from torch_rollout.loop._stats import Setting, Stats, WorkerStats
    from torch_rollout.tuning import _Row, _table

    def measured(fps: float, backend: str) -> Stats:
        setting = Setting(
            backend=backend, num_workers=1, num_envs=8, num_steps=128, prefetch=0, device="cpu", live_envs=False,
            check_finite=False, info_keys=0, cores=2, gpus=0,
        )  # fmt: skip
        worker = WorkerStats(env=8.0, policy=1.0, collector=1.0, idle=0.0, frames=int(fps * 10))
        return Stats(
            seconds=10.0, frames=int(fps * 10), batches=10, env=8.0, policy=1.0, collector=1.0, idle=0.0, wait=9.0,
            workers=(worker,), setting=setting,
        )  # fmt: skip

    best = _Row(options={"backend": "thread", "prefetch": 0}, stats=[measured(1000.0, "thread")])
    assert "Processes(num_workers=2)" in best.median_stats().verdict()  # what it would advise unmeasured
    two = _Row(options={"backend": Processes(num_workers=2), "prefetch": 1}, stats=[measured(840.0, "process")])
    out = _table([best, two], best, wall=1.0)
    (account,) = [line for line in out.splitlines() if line.startswith("its median round's account")]
    assert "Processes(" not in account and "a faster env" in account
    assert "not advised, measured slower than the best here: Processes(num_workers=2) 0.84x" in out
    # a placement measured faster is not named as slower
    faster = _Row(options={"backend": Processes(num_workers=2), "prefetch": 1}, stats=[measured(1200.0, "process")])
    assert "not advised" not in _table([best, faster], faster, wall=1.0)


def test_a_collector_of_the_same_envs_and_shape_leaves_out_of_its_verdict_what_tune_measured_slower(monkeypatch):
    """tune's timings stubbed (Processes(2) at 0.8x the thread), everything else real: the trials' collectors, and a
    collector of an env that sleeps, whose own account is env-bound on the 4 cores it is told it has."""
    import torch_rollout.tuning as tuning
    from torch_rollout.loop._stats import Setting, Stats, WorkerStats

    monkeypatch.setattr("torch_rollout.placements._backends.available_cores", lambda: 4)
    setting = Setting(
        backend="thread", num_workers=1, num_envs=N, num_steps=T, prefetch=0, device="cpu", live_envs=False,
        check_finite=False, info_keys=0, cores=4, gpus=0,
    )  # fmt: skip

    def stubbed_time(collector: Collector, update: object, window: float) -> Stats:
        fps = 1000.0 if collector.num_workers == 1 else 800.0
        worker = WorkerStats(env=8.0, policy=1.0, collector=1.0, idle=0.0, frames=int(fps * 10))
        return Stats(
            seconds=10.0, frames=int(fps * 10), batches=10, env=8.0, policy=1.0, collector=1.0, idle=0.0, wait=9.0,
            workers=(worker,), setting=setting,
        )  # fmt: skip

    monkeypatch.setattr(tuning, "_time", stubbed_time)
    make_envs = functools.partial(make_slow_envs, pause=0.002)

    def verdict(num_steps: int) -> str:
        with Collector(make_envs, ConstantPolicy(), num_envs=N, num_steps=num_steps, prefetch=0, device="cpu") as c:
            for _, _ in zip(range(3), c):
                pass
            return c.stats().verdict()

    assert "Processes(num_workers=2)" in verdict(T)  # the account's expectation, unmeasured
    placements = [{"backend": "thread", "prefetch": 0}, {"backend": Processes(num_workers=2), "prefetch": 1}]
    tune(make_envs, ConstantPolicy(), num_envs=N, num_steps=T, seconds=0.1, placements=placements, device="cpu")
    after = verdict(T)
    assert "Processes(" not in after and "a faster env" in after  # measured slower here: not offered
    assert "Processes(num_workers=2)" in verdict(2 * T)  # another batch shape, which tune did not measure
