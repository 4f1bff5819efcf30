"""The start of worker processes: where they fork from, what they inherit of the trainer, how they start together,
and that importing the package starts nothing.

Each test runs a trainer script in a fresh Python process: the fork server
starts with its first collector with worker processes (or at
``start_workers_early()``), so the pytest process (which started one long ago)
cannot tell.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reliability_envs import wait_until

TESTS = Path(__file__).resolve().parent

# The trainer. Its first import of torch_rollout sits under its main guard, after `wave`, and `sched` comes after
# it (a process forked from the trainer would have them; the workers never import either themselves). Its
# workers' make_envs writes what it sees of its process to facts-<start_index>.json first.
TRAINER = """
import functools, json, os, signal, sys, threading, time, warnings
from multiprocessing import forkserver
from pathlib import Path

import gymnasium

sys.path.insert(0, {tests!r})
OUT = Path({out!r})


class TrainerWarning(UserWarning):  # a category of the trainer's __main__
    pass


def shown(message):
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(message)
    return len(caught) > 0


def make_envs(mode, num_envs, start_index=0):
    facts = {{
        "pid": os.getpid(),
        "server": os.getppid(),
        "forked_at_import": "wave" in sys.modules,
        "forked_later": "sched" in sys.modules,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        # free: this worker can start processes of its own from a forkserver (an AsyncVectorEnv's, say)
        "forkserver_lock_free": forkserver._forkserver._lock.acquire(timeout=5),
        "environ": os.environ.get("SET_BY_THE_TRAINER"),
        "warning_shown": shown("a warning that the trainer ignores"),
    }}
    # written whole, then renamed: the other worker waits for the name, and may fail (and this worker be stopped)
    # as soon as it sees it
    (OUT / f"facts-{{start_index}}.part").write_text(json.dumps(facts))
    os.replace(OUT / f"facts-{{start_index}}.part", OUT / f"facts-{{start_index}}.json")
    print(f"worker {{start_index}} built its envs", flush=True)
    # "together": each worker's envs wait for the other worker's start (a start that waited for a Ready before
    # the next would never see both); "fail": worker 1 fails once worker 0 has started, which then must not run on
    if mode == "together" or (mode == "fail" and start_index == 1):
        deadline = time.monotonic() + 60
        while not all((OUT / f"facts-{{k}}.json").exists() for k in range(2)):
            if time.monotonic() > deadline:
                raise TimeoutError("the other worker did not start while this one built its envs")
            time.sleep(0.01)
    if mode == "fail" and start_index == 1:
        raise ValueError("env 1 cannot be built")
    return gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * num_envs)


def collect(mode):
    from reliability_envs import ConstantPolicy
    from torch_rollout import Collector, Processes

    envs = functools.partial(make_envs, mode)
    with Collector(envs, ConstantPolicy(), num_envs=2, num_steps=4, backend=Processes(2), timeout=120) as c:
        next(c)


if __name__ == "__main__":
    import wave  # noqa: F401  (a module that nothing else imports)

    mode = sys.argv[1]
    sys.stdout.write("written by the trainer, not yet flushed\\n")  # stdout is a pipe: block-buffered
    import torch_rollout

    # the import starts no process (and no thread beside those of torch's and numpy's own pools)
    children = Path(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read_text().split()
    (OUT / "children-at-import.json").write_text(json.dumps(children))
    if mode == "early":  # the documented call, at the trainer's top
        torch_rollout.start_workers_early()
    import sched  # noqa: F401  (another module that nothing else imports)

    signal.signal(signal.SIGTERM, lambda *_: (OUT / "trainer-handler-ran").touch())
    read_end, write_end = os.pipe()
    os.environ["SET_BY_THE_TRAINER"] = "after the import"
    warnings.filterwarnings("ignore", message="a warning that the trainer ignores")
    warnings.filterwarnings("error", category=TrainerWarning)
    if mode == "threads after the import":  # the threads of wandb.init(), SummaryWriter(), a tqdm bar
        import io

        from tqdm import tqdm

        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        bar = tqdm(total=10, file=io.StringIO())  # its monitor thread
        assert threading.active_count() >= 3, threading.enumerate()
    if mode == "fail":
        try:
            collect(mode)
        except ValueError as exc:
            print("raised:", exc, *getattr(exc, "__notes__", []), flush=True)
        for k in range(2):  # the collector is closed: none of its workers runs on, the other one included
            pid = json.loads((OUT / f"facts-{{k}}.json").read_text())["pid"]
            try:
                state = Path(f"/proc/{{pid}}/stat").read_text().rpartition(")")[2].split()[0]
            except OSError:
                state = "gone"
            print(f"worker {{k}} after the failure:", "gone" if state in ("gone", "Z") else "running", flush=True)
    else:
        for n in range(2):  # the second collector's workers come from the same server
            collect(mode)
            for k in range(2):
                (OUT / f"facts-{{k}}.json").rename(OUT / f"collector-{{n}}-facts-{{k}}.json")
    (OUT / "server.json").write_text(json.dumps(forkserver._forkserver._forkserver_pid))
    # The workers and the server hold no copy of the trainer's pipes: the reader sees the end as soon as it closes.
    os.close(write_end)
    import select

    readable, _, _ = select.select([read_end], [], [], 30)
    print("pipe end seen:", bool(readable) and os.read(read_end, 1) == b"", flush=True)
"""


def run_trainer(tmp_path: Path, mode: str) -> tuple[str, list[dict]]:
    """Runs the trainer in ``mode``; returns its stdout and its workers' facts (two collectors': four)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAINER).format(tests=str(TESTS), out=str(tmp_path)))
    proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    names = (
        ["facts-0.json", "facts-1.json"]
        if mode == "fail"
        else [f"collector-{n}-facts-{k}.json" for n in (0, 1) for k in (0, 1)]
    )
    return proc.stdout, [json.loads((tmp_path / name).read_text()) for name in names]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("mode", ["single-threaded", "threads after the import", "early"])
def test_workers_start_from_one_fresh_server_and_take_on_what_the_trainer_set_since(tmp_path, mode):
    out, facts = run_trainer(tmp_path, mode)
    assert json.loads((tmp_path / "children-at-import.json").read_text()) == []
    server = json.loads((tmp_path / "server.json").read_text())
    assert {f["server"] for f in facts} == {server}  # one server serves every collector
    assert len({f["pid"] for f in facts}) == 4
    # A fresh server holds nothing of the trainer's: not the modules it had imported.
    assert [f["forked_at_import"] for f in facts] == [False] * 4
    assert [f["forked_later"] for f in facts] == [False] * 4
    # What the trainer holds stays the trainer's: its signal handlers, its buffered output, its pipes.
    assert all(f["sigterm_default"] and f["forkserver_lock_free"] for f in facts)
    assert not (tmp_path / "trainer-handler-ran").exists()
    assert out.count("written by the trainer, not yet flushed") == 1
    assert "pipe end seen: True" in out
    assert out.count("built its envs") == 4  # two collectors of two workers
    # The environment variables that the trainer set after its server started reach the workers all the same.
    assert [f["environ"] for f in facts] == ["after the import"] * 4
    # So do its warnings filters, one of a category of its own script among them.
    assert [f["warning_shown"] for f in facts] == [False] * 4
    # Nothing is left once the trainer has exited: not its server, not a worker.
    assert wait_until(lambda: not any(running(pid) for pid in {server} | {f["pid"] for f in facts}), 10.0)


def test_workers_build_their_envs_at_the_same_time(tmp_path):
    # Worker 0's envs wait for worker 1's start and the other way round: started one after the other's Ready,
    # the first would time out.
    out, _ = run_trainer(tmp_path, "together")
    assert "pipe end seen: True" in out


def test_a_worker_that_fails_to_start_reports_its_cause(tmp_path):
    out, _ = run_trainer(tmp_path, "fail")
    assert "raised: env 1 cannot be built (raised in torch_rollout worker 1 (pid " in out
    assert "worker 0 after the failure: gone" in out
    assert "worker 1 after the failure: gone" in out
    assert "pipe end seen: True" in out


# A trainer that imports the package and never starts a worker process, in a TMPDIR of its own.
IDLE_TRAINER = """
import json, os, sys, threading, time
from pathlib import Path

OUT = Path({out!r})
import torch  # its own pools (OpenMP, OpenBLAS) are counted before the package's import
before = len(os.listdir("/proc/self/task"))
import torch_rollout  # noqa: F401

children = Path(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read_text().split()
threads = len(os.listdir("/proc/self/task")) - before
facts = {{"children": children, "threads": threading.active_count(), "os_threads": threads}}
(OUT / "facts.json").write_text(json.dumps(facts))
if sys.argv[1] == "killed":
    print("ready", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("mode", ["exit", "killed"])
def test_importing_the_package_starts_nothing_and_leaves_nothing(tmp_path, mode):
    script, tmpdir = tmp_path / "train.py", tmp_path / "tmp"
    script.write_text(textwrap.dedent(IDLE_TRAINER).format(out=str(tmp_path)))
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("w") as out, stderr.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(script), mode], stdout=out, stderr=err, env=env)
        try:
            if mode == "killed":
                assert wait_until(lambda: "ready" in stdout.read_text(), 120.0), stderr.read_text()
                proc.send_signal(signal.SIGKILL)  # no exit handler runs
            assert proc.wait(timeout=300) == (-signal.SIGKILL if mode == "killed" else 0), stderr.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts == {"children": [], "threads": 1, "os_threads": 0}
    assert list(tmpdir.iterdir()) == []
    assert stderr.read_text() == ""


def test_the_package_sets_no_private_attribute_of_multiprocessing():
    """Nothing in the package assigns to a private name of the standard library's multiprocessing."""
    package = TESTS.parent / "torch_rollout"
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"(forkserver|multiprocessing|util|spawn|connection)\.\w*\._\w+\s*=(?!=)", line)
        or re.search(r"(forkserver|multiprocessing|util|spawn|connection)\._\w+\s*=(?!=)", line)
        or "forkserver._forkserver" in line  # the private server object itself, under any name later
    ]
    assert found == []


# A trainer in which something else starts processes from multiprocessing's forkserver before the first collector.
OTHER_USER_TRAINER = """
import multiprocessing, os, sys
from multiprocessing import forkserver

sys.path.insert(0, {tests!r})
from reliability_envs import ConstantPolicy
from torch_rollout import Collector, Processes


if __name__ == "__main__":
    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        other = pool.apply(os.getppid)
    with Collector("CartPole-v1", ConstantPolicy(), num_envs=2, num_steps=2, backend=Processes(2), timeout=120) as c:
        next(c)
    # The same server serves both, multiprocessing's one.
    assert forkserver._forkserver._forkserver_pid == other, other
    print("one server serves", flush=True)
"""


def test_other_users_of_the_forkserver_share_its_server_with_the_collectors(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(OTHER_USER_TRAINER).format(tests=str(TESTS)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "one server serves\n"


# A trainer that records, at the first named semaphore's registration with multiprocessing's resource tracker,
# whether the tracker was running already: if not, registering starts it, a new process between the semaphore's
# creation in /dev/shm and its registration, where a kill leaves the entry behind for good.
TRACKED_TRAINER = """
import json, sys
from multiprocessing import resource_tracker

sys.path.insert(0, {tests!r})
from reliability_envs import ConstantPolicy
from torch_rollout import Collector, Processes

seen = []
register = resource_tracker.register


def recording(name, rtype):
    if rtype == "semaphore":
        seen.append(resource_tracker._resource_tracker._pid is not None)
    register(name, rtype)


resource_tracker.register = recording

if __name__ == "__main__":
    with Collector("CartPole-v1", ConstantPolicy(), num_envs=2, num_steps=2, backend=Processes(2), timeout=120) as c:
        next(c)
    print(json.dumps(seen), flush=True)
"""


def test_the_resource_tracker_runs_before_the_first_worker_lock_is_made(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRACKED_TRAINER).format(tests=str(TESTS)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [True, True]  # both workers' weights locks
