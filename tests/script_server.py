"""A warm interpreter that runs Python scripts as ``python -W error SCRIPT`` would, each in a fork of itself.

A fresh interpreter spends seconds of CPU importing torch, tensordict and gymnasium before a script's first line.
This server imports them once, then forks a child per script: the child starts with the modules imported and
nothing else done, runs the script as ``__main__`` (worker processes import it again by its path, as they do a
script started on the command line) and ends as that interpreter would, atexit handlers included. Each child
is the leader of a process group of its own, so that a script that hangs can be killed with its workers.

Started by :class:`ScriptServer`; speaks one JSON object a line: on stdin a request
``{"script", "cwd", "stdout", "stderr"}`` (paths), on stdout ``{"pid": ...}`` once the child is forked, then
``{"returncode": ...}`` once it has ended.
"""

from __future__ import annotations

import gc
import json
import os
import queue
import random
import runpy
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

__all__ = ["ScriptServer"]

PRELOAD = ("numpy", "torch", "tensordict", "gymnasium", "torch_rollout")


class ScriptServer:
    """The test side: starts the server and runs scripts in it, each under a timeout."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-W", "error", __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()  # so that a wait for a line can time out

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        line = self.lines.get(timeout=timeout)
        if line is None:
            self.proc.wait()
            raise RuntimeError(f"the script server ended (exit code {self.proc.returncode}): {self.proc.stderr.read()}")
        return json.loads(line)

    def run(self, script: Path, *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        """Runs ``script`` in a child with ``cwd``; its output goes to files beside it. Raises
        ``subprocess.TimeoutExpired`` (the child's process group killed) if it runs past ``timeout`` seconds."""
        out, err = script.with_suffix(".stdout"), script.with_suffix(".stderr")
        request = {"script": str(script), "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = self._next(timeout)["pid"]  # the server's start (its imports) counts as none of the script's time
        try:
            returncode = self._next(timeout)["returncode"]
        except queue.Empty:
            os.killpg(pid, signal.SIGKILL)
            self._next(timeout)  # the server has reaped it
            raise subprocess.TimeoutExpired([str(script)], timeout) from None
        return subprocess.CompletedProcess([str(script)], returncode, out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()  # the server ends at the end of its input
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


def serve() -> dict[str, str] | None:
    """The server's loop; returns a request in the child forked for it, None in the server at the end of input."""
    for module in PRELOAD:
        __import__(module)
    # The children's collections then skip the imported modules' objects, which the server keeps alive anyway:
    # fewer of its memory pages copied into each child (a second of CPU at each child's exit otherwise).
    gc.freeze()
    for line in sys.stdin:
        request = json.loads(line)
        with warnings.catch_warnings():
            # Python 3.12 warns of fork() in a process with threads: numpy's BLAS pool here, which is fork-safe.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            return request
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
    return None


def run_as_main(request: dict[str, str]) -> None:
    """In the child: becomes ``python -W error SCRIPT`` started in ``cwd`` with its output to files."""
    os.setsid()
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], write), (2, request["stderr"], write)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115  # the server's had read ahead in its requests
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script]
    sys.path[0] = os.path.dirname(script)  # as for `python SCRIPT`: the script's folder first
    random.seed()  # not the server's stream
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    child_request = serve()
    if child_request is not None:
        run_as_main(child_request)  # an exception ends the child as it would end the script: traceback, exit code 1
