"""The start of worker processes: where they fork from, what they inherit of the trainer, how they start together,
and what the fork server costs a trainer that never starts one.

Each test runs a trainer script in a fresh Python process: the fork server is
forked when the process imports torch_rollout, or started by its first
collector with worker processes, so the pytest process (which imported
torch_rollout long ago, and may run threads) cannot tell.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reliability_envs import wait_until

TESTS = Path(__file__).resolve().parent
PREFORK = "TORCH_ROLLOUT_PREFORK"

# The trainer. Its first import of torch_rollout sits under its main guard, after `wave` (so a process forked
# from the trainer at that import has `wave`, and one forked later has `sched` too; the workers never import
# either themselves). Its workers' make_envs writes what it sees of its process to facts-<start_index>.json first.
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
    (OUT / f"facts-{{start_index}}.json").write_text(json.dumps(facts))
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
    if mode == "a thread before the import":  # a trainer that imports torch_rollout late, inside its main()
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    if mode == "a threaded runtime before the import":  # JAX's thread pools run once it is imported and used
        import ray  # noqa: F401  (one of the runtimes named; no thread of its own until ray.init())
    if mode == "a CUDA context before the import":
        import torch

        torch.cuda.is_initialized = lambda: True  # as a trainer with its model on a GPU
    from torch_rollout.placements import _forkserver

    (OUT / "server-at-import.json").write_text(json.dumps(_forkserver._idle and _forkserver._idle.pid))
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


def run_trainer(tmp_path: Path, mode: str, *, prefork: str | None = None) -> tuple[str, list[dict]]:
    """Runs the trainer in ``mode``; returns its stdout and its workers' facts (two collectors': four)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAINER).format(tests=str(TESTS), out=str(tmp_path)))
    env = {key: value for key, value in os.environ.items() if key != PREFORK}
    if prefork is not None:
        env[PREFORK] = prefork
    proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=300, env=env)
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


@pytest.mark.parametrize(
    ("mode", "prefork", "origin"),
    [
        ("threads after the import", None, "forked at import"),
        ("single-threaded", "0", "forked at the first collector"),
        ("threads after the import", "0", "fresh"),
        ("a thread before the import", None, "fresh"),
        ("a CUDA context before the import", None, "fresh"),
        ("a threaded runtime before the import", None, "fresh"),
    ],
    ids=[
        "threads-after-import",
        "opted-out-single-threaded",
        "opted-out-threads",
        "thread-first",
        "cuda-first",
        "runtime-first",
    ],
)
def test_the_server_is_forked_from_the_trainer_only_while_it_is_safe(tmp_path, mode, prefork, origin):
    out, facts = run_trainer(tmp_path, mode, prefork=prefork)
    at_import = json.loads((tmp_path / "server-at-import.json").read_text())
    server = json.loads((tmp_path / "server.json").read_text())
    # Forked at import: the server was running when the import returned, and it is every worker's parent.
    assert (at_import == server) if origin == "forked at import" else (at_import is None)
    assert {f["server"] for f in facts} == {server}  # either server serves every collector
    assert len({f["pid"] for f in facts}) == 4
    # What the workers hold of the trainer tells when it was forked, if ever (a fresh server holds none of it).
    assert [f["forked_at_import"] for f in facts] == [origin != "fresh"] * 4
    assert [f["forked_later"] for f in facts] == [origin == "forked at the first collector"] * 4
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


# A module that imports torch_rollout first, so that the server is forked while the module is half imported:
# what it defines below that import is not in the server, and the import lock of its half-done import is held
# there by the trainer's thread (which the server does not have). A worker imports it whole, after taking on the
# environment variables that the trainer set since.
HALF_IMPORTED = """
import os

import torch_rollout  # noqa: F401

import gymnasium

# Read as a worker imports the module: the trainer set it after its server was forked.
SEEN_AT_IMPORT = os.environ.get("SET_BY_THE_TRAINER")


def build(num_envs, start_index=0):
    if SEEN_AT_IMPORT != "in main()":
        raise RuntimeError(f"imported with SET_BY_THE_TRAINER={SEEN_AT_IMPORT!r}")
    return gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * num_envs)
"""

HALF_IMPORTED_TRAINER = """
import os, sys, threading
from multiprocessing import forkserver

sys.path[:0] = [{tests!r}, {here!r}]


def make_envs(num_envs, start_index=0):
    # Built by a thread of the worker, which imports the half-imported module first, and a submodule of the
    # package whose import was under way at the fork: either would wait forever for its import lock.
    built = []
    thread = threading.Thread(target=lambda: built.append(_build(num_envs)), daemon=True)
    thread.start()
    thread.join(60)
    if not built:
        raise TimeoutError("the thread that imports and builds the envs is stuck")
    return built[0]


def _build(num_envs):
    import helpers
    import torch_rollout.gae  # noqa: F401

    return helpers.build(num_envs)


if __name__ == "__main__":
    import helpers  # its import of torch_rollout forks the server

    os.environ["SET_BY_THE_TRAINER"] = "in main()"
    from reliability_envs import ConstantPolicy
    from torch_rollout import Collector, Processes

    from torch_rollout.placements import _forkserver

    server = _forkserver._idle.pid  # forked at the import, not yet multiprocessing's
    # The workers' main thread imports the module first, to unpickle its function; then a thread of theirs does.
    for envs in (helpers.build, make_envs):
        with Collector(envs, ConstantPolicy(), num_envs=2, num_steps=4, backend=Processes(2), timeout=120) as c:
            next(c)
        assert forkserver._forkserver._forkserver_pid == server
        print("collected with", envs.__name__, flush=True)
"""


def test_a_module_half_imported_at_the_fork_is_imported_whole_by_workers(tmp_path):
    (tmp_path / "helpers.py").write_text(HALF_IMPORTED)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(HALF_IMPORTED_TRAINER).format(tests=str(TESTS), here=str(tmp_path)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "collected with build\ncollected with make_envs\n"


# A trainer that never starts a worker process: what the server forked at its import costs it.
IDLE_TRAINER = """
import json, os, signal, sys, time
from pathlib import Path

OUT = Path({out!r})
handlers = {{s: signal.getsignal(s) for s in signal.valid_signals()}}
from torch_rollout.placements import _forkserver

server = _forkserver._idle.pid
(OUT / "server.json").write_text(json.dumps(server))
assert {{s: signal.getsignal(s) for s in signal.valid_signals()}} == handlers  # no handler of the trainer's replaced
mode = sys.argv[1]
if mode == "fork":  # a child forked from the trainer lets its server go, and starts one of its own
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _forkserver._idle is None else 3)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the child kept the parent's server"
if mode == "killed":
    print("ready", flush=True)
    time.sleep(600)
print("the trainer's last line", flush=True)
"""


@pytest.mark.parametrize("mode", ["exit", "fork", "killed"])
def test_a_server_that_serves_no_worker_is_gone_with_the_trainer(tmp_path, mode):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(IDLE_TRAINER).format(out=str(tmp_path)))
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    env = {key: value for key, value in os.environ.items() if key != PREFORK}
    # Files, not pipes: the call returns as the trainer exits, without waiting for whoever else holds its stdout.
    with stdout.open("w") as out, stderr.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(script), mode], stdout=out, stderr=err, env=env)
        try:
            if mode == "killed":
                assert wait_until(lambda: "ready" in stdout.read_text(), 120.0), stderr.read_text()
                server = json.loads((tmp_path / "server.json").read_text())
                assert running(server)
                proc.send_signal(signal.SIGKILL)  # no exit handler runs: the server sees the end of its pipe
            assert proc.wait(timeout=300) == (-signal.SIGKILL if mode == "killed" else 0), stderr.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    server = json.loads((tmp_path / "server.json").read_text())
    assert isinstance(server, int)
    if mode == "killed":
        assert wait_until(lambda: not running(server), 10.0)
    else:
        assert not Path(f"/proc/{server}").exists()  # waited for by the trainer's exit: not even a zombie
        assert stdout.read_text() == "the trainer's last line\n"
    assert stderr.read_text() == ""  # nothing printed by the server, at its start or at its exit


# A trainer in which something else starts processes from multiprocessing's forkserver before the first collector.
OTHER_USER_TRAINER = """
import multiprocessing, os, sys
from multiprocessing import forkserver
from pathlib import Path

sys.path.insert(0, {tests!r})
from reliability_envs import ConstantPolicy
from torch_rollout import Collector, Processes
from torch_rollout.placements import _forkserver

if __name__ == "__main__":
    idle = _forkserver._idle.pid
    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        other = pool.apply(os.getppid)
    # A server of its own, multiprocessing's fresh one, as without torch_rollout.
    assert other != idle and other == forkserver._forkserver._forkserver_pid, (idle, other)
    with Collector("CartPole-v1", ConstantPolicy(), num_envs=2, num_steps=2, backend=Processes(2), timeout=120) as c:
        next(c)
    # It serves the collectors too; the idle one is gone, waited for.
    assert forkserver._forkserver._forkserver_pid == other
    assert not Path(f"/proc/{{idle}}").exists()
    print("the other server serves", flush=True)
"""


def test_other_users_of_the_forkserver_before_the_first_collector_get_a_server_of_their_own(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(OTHER_USER_TRAINER).format(tests=str(TESTS)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "the other server serves\n"


def test_a_bad_value_of_the_opt_out_is_refused_at_import(tmp_path):
    env = {**os.environ, PREFORK: "no"}
    proc = subprocess.run(
        [sys.executable, "-c", "import torch_rollout"], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 1
    assert (
        "ValueError: import torch_rollout: TORCH_ROLLOUT_PREFORK='no'; set it to 0 (the fork server of worker "
        "processes starts with the first collector that needs one) or 1" in proc.stderr
    )


def test_the_opt_out_forks_nothing_at_import(tmp_path):
    env = {**os.environ, PREFORK: "0"}
    code = "from torch_rollout.placements import _forkserver; print(_forkserver._idle)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "None\n"
