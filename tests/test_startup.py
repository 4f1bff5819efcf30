"""The start of worker processes: where they fork from, what they inherit of the trainer, how they start together.

Each test runs a trainer script in a fresh Python process: the fork server is
started once per process, by the first collector with worker processes, so the
pytest process (which may have started it already, or run threads) cannot tell.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# The trainer. Its workers' make_envs writes what it sees of its process to facts-<start_index>.json first.
TRAINER = """
import functools, json, os, signal, sys, threading, time
from multiprocessing import forkserver
from pathlib import Path

import gymnasium

sys.path.insert(0, {tests!r})
from reliability_envs import ConstantPolicy

from torch_rollout import Collector, Processes

OUT = Path({out!r})


def make_envs(mode, num_envs, start_index=0):
    facts = {{
        "pid": os.getpid(),
        "server": os.getppid(),
        # imported by the trainer under its main guard only: seen here when this process is a fork of the trainer's
        "forked_from_trainer": "wave" in sys.modules,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        # free: this worker can start processes of its own from a forkserver (an AsyncVectorEnv's, say)
        "forkserver_lock_free": forkserver._forkserver._lock.acquire(timeout=5),
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
    envs = functools.partial(make_envs, mode)
    with Collector(envs, ConstantPolicy(), num_envs=2, num_steps=4, backend=Processes(2), timeout=120) as c:
        next(c)


if __name__ == "__main__":
    import wave  # noqa: F401  (a module that nothing else imports)

    mode = sys.argv[1]
    signal.signal(signal.SIGTERM, lambda *_: (OUT / "trainer-handler-ran").touch())
    sys.stdout.write("written by the trainer, not yet flushed\\n")  # stdout is a pipe: block-buffered
    read_end, write_end = os.pipe()
    if mode == "a thread running":
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    if mode == "a CUDA context":
        import torch

        torch.cuda.is_initialized = lambda: True  # as a trainer with its model on a GPU
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


@pytest.mark.parametrize(
    ("mode", "forked"),
    [("single-threaded", True), ("a thread running", False), ("a CUDA context", False)],
    ids=["single-threaded", "thread", "cuda"],
)
def test_workers_fork_from_the_trainer_only_while_it_is_safe(tmp_path, mode, forked):
    out, facts = run_trainer(tmp_path, mode)
    # A trainer with threads or a CUDA context: its workers come from a fresh server, which never imported wave.
    assert [f["forked_from_trainer"] for f in facts] == [forked] * 4
    # Either server serves every collector: the workers of both forked from it.
    assert len({f["server"] for f in facts}) == 1
    assert len({f["pid"] for f in facts}) == 4
    # What the trainer holds stays the trainer's: its signal handlers, its buffered output, its pipes.
    assert all(f["sigterm_default"] and f["forkserver_lock_free"] for f in facts)
    assert not (tmp_path / "trainer-handler-ran").exists()
    assert out.count("written by the trainer, not yet flushed") == 1
    assert "pipe end seen: True" in out
    assert out.count("built its envs") == 4  # two collectors of two workers


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
