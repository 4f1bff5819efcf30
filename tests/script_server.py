"""A warm interpreter that runs Python scripts as ``python SCRIPT`` or ``python -c CODE`` would, each in a fork.

A fresh interpreter spends seconds of CPU importing torch, tensordict and gymnasium before a script's first line.
This server imports them once, then forks a child per script: the child starts with the modules imported and
nothing else done, runs the script as ``__main__`` (worker processes import it again by its path, as they do a
script started on the command line) and ends as that interpreter would, atexit handlers included. Each child
is the leader of a process group of its own, so that a script that hangs can be killed with its workers.

Started by :class:`ScriptServer`; speaks one JSON object a line: on stdin a request
``{"cwd", "script" or "code", "args", "stdout", "stderr"}``, on stdout ``{"pid": ...}`` once the child is forked, then
``{"returncode": ...}`` once it has ended.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import queue
import random
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Any

__all__ = ["Running", "ScriptServer"]

PRELOAD = ("numpy", "torch", "tensordict", "gymnasium", "torch_rollout")
# The one warning that -W error leaves alone, as the suite's configuration does (setup.cfg): torch.compile's note
# that guards may run slower on Python 3.13.0
_SLOWER_GUARDS = "ignore:Guards may run slower on Python 3.13.0:RuntimeWarning"


class ScriptServer:
    """The test side: starts the server and runs scripts in it, one at a time.

    Args:
        warnings_as_errors: the scripts run as under ``python -W error`` (else with Python's default filters).
        pythonpath: folders for the server's PYTHONPATH, before the inherited one.
    """

    def __init__(self, *, warnings_as_errors: bool = True, pythonpath: tuple[Path, ...] = ()) -> None:
        inherited = os.environ.get("PYTHONPATH", "")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, pythonpath), inherited]))
        self.proc = subprocess.Popen(
            [sys.executable, *(["-W", "error", "-W", _SLOWER_GUARDS] if warnings_as_errors else []), __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()  # so that a wait for a line can time out
        self.outputs = Path(tempfile.mkdtemp(prefix="script_server"))
        self.started = 0

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

    def start(
        self, *, cwd: Path, script: Path | None = None, code: str | None = None, args: tuple[str, ...] = ()
    ) -> Running:
        """Starts ``python SCRIPT ARGS`` (``script``) or ``python -c CODE ARGS`` (``code``) in ``cwd``, its output
        to files."""
        self.started += 1
        out, err = self.outputs / f"{self.started}.stdout", self.outputs / f"{self.started}.stderr"
        request = {"cwd": str(cwd), "script": script and str(script), "code": code, "args": list(args)}
        self.proc.stdin.write(json.dumps({**request, "stdout": str(out), "stderr": str(err)}) + "\n")
        self.proc.stdin.flush()
        pid = self._next(180.0)["pid"]  # the first one waits for the server's imports
        return Running(self, pid, [str(script or "-c"), *args], out, err)

    def run(self, script: Path, *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        """Runs ``script`` in ``cwd`` to its end, as ``subprocess.run(..., timeout=timeout)`` would."""
        return self.start(cwd=cwd, script=script).wait(timeout)

    def close(self) -> None:
        self.proc.stdin.close()  # the server ends at the end of its input
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
        shutil.rmtree(self.outputs, ignore_errors=True)


class Running:
    """A script started by :meth:`ScriptServer.start`: ``pid`` leads its process group."""

    server: ScriptServer
    pid: int
    args: list[str]
    stdout: Path
    stderr: Path
    returncode: int | None

    def __init__(self, server: ScriptServer, pid: int, args: list[str], stdout: Path, stderr: Path) -> None:
        self.server, self.pid, self.args, self.stdout, self.stderr = server, pid, args, stdout, stderr
        self.returncode = None

    def first_line(self, timeout: float) -> str:
        """The first line the script prints (flushed), or what it printed if it ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            ended = self.returncode is not None
            text = self.stdout.read_text() if self.stdout.exists() else ""
            if "\n" in text:
                return text.split("\n", 1)[0] + "\n"
            if ended or time.monotonic() > deadline:
                return text
            if not self.server.lines.empty():  # it ended: one more look at what it printed
                self.returncode = self.server._next(0)["returncode"]
            time.sleep(0.01)

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Waits for the end; raises ``subprocess.TimeoutExpired``, its process group killed, after ``timeout`` s."""
        if self.returncode is None:
            try:
                self.returncode = self.server._next(timeout)["returncode"]
            except queue.Empty:
                self.kill()
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return subprocess.CompletedProcess(self.args, self.returncode, self.stdout.read_text(), self.stderr.read_text())

    def kill(self) -> None:
        """Kills its process group (SIGKILL) and waits for the server to have reaped it."""
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet the leader of a group of its own: nothing started from it yet
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
            self.returncode = self.server._next(60.0)["returncode"]


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


def run_as_main(request: dict[str, Any]) -> None:
    """In the child: becomes ``python SCRIPT ARGS`` (or ``python -c CODE ARGS``) started in ``cwd``, its output to
    files."""
    os.setsid()
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], write), (2, request["stderr"], write)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115  # the server's had read ahead in its requests
    os.chdir(request["cwd"])
    random.seed()  # not the server's stream
    script = request["script"]
    if script is None:  # python -c: sys.path starts with "", __main__ has no file
        sys.argv = ["-c", *request["args"]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    else:  # python SCRIPT: sys.path starts with the script's folder
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    child_request = serve()
    if child_request is not None:
        run_as_main(child_request)  # an exception ends the child as it would end the script: traceback, exit code 1
