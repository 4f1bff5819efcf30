"""Where worker processes start from: a fork server forked from the trainer where that is safe, else a fresh one.

Worker processes fork from a single-threaded server, never from the trainer
itself, so they inherit none of the trainer's threads, locks held by them or
CUDA context. multiprocessing's forkserver starts that server as a fresh
interpreter, which imports torch, tensordict and gymnasium again before the
first worker can fork: seconds, on a small machine. When the trainer is still
safe to fork at the first worker's start (no thread of its own, no CUDA context), the
server is forked from the trainer instead, with those modules already
imported, and the first workers start in a fraction of a second. Either way the
server serves every later worker of every collector, whatever the trainer
starts meanwhile.

The forked server keeps nothing of the trainer that could hold others up or
act for it: its pipes and sockets are replaced by ``/dev/null`` (the numbers
stay taken, so nothing the trainer's objects refer to is reused), the trainer's
Python signal handlers are reset, pending output is flushed first (no worker
prints it again), and workers import the trainer's ``__main__`` script again,
as they do from a fresh server.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import socket
import stat
import sys
import threading
import types
import warnings
from multiprocessing import connection, forkserver, resource_tracker, util
from typing import Any

import torch

__all__ = ["TrainerEnvironment", "context", "fork_is_safe", "start_server"]

# The modules a fresh server imports before it forks the first worker: what a worker needs (torch, tensordict,
# gymnasium and this package come with it), once per server instead of once per worker.
PRELOAD = ["torch_rollout._process"]
# multiprocessing.forkserver.ForkServer's state in the Pythons whose fork server protocol this module speaks
# (3.10-3.12); another set of fields (3.13 added authentication) starts the server multiprocessing's own way.
_SERVER_FIELDS = {"_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds", "_lock"}
_SERVER_FIELDS_WITH_PRELOAD = _SERVER_FIELDS | {"_preload_modules"}
_TASKS = "/proc/self/task"  # one entry per OS thread of this process (Linux)
# The trainer's __main__ module, kept alive in a forked server that replaced it, so that nothing it holds is freed.
_trainer_main: list[types.ModuleType] = []


def context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """The multiprocessing context that worker processes start from (forkserver where there is one, else spawn)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    start_server()
    return ctx


class TrainerEnvironment:
    """The trainer's environment variables, which a worker process takes on as it unpickles this object.

    A server's are those of the moment it started (the trainer's import of torch_rollout, say): a trainer that
    sets ``MUJOCO_GL=egl`` later, in its ``main()``, has its workers see it all the same. A worker's first
    argument, so that the modules that unpickling its env recipe and its policy imports see them too.
    """

    variables: dict[str, str]

    def __init__(self) -> None:
        self.variables = dict(os.environ)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if os.environ != self.variables:
            os.environ.clear()
            os.environ.update(self.variables)


def fork_is_safe() -> bool:
    """Whether this process can be forked safely: no CUDA context, no Python thread but this one, and no OS
    thread beyond those that importing torch_rollout found (the BLAS pool of numpy, which stops itself before
    a fork); a thread pool of OpenMP, CUDA's threads, a Ray or gRPC client's all count."""
    if threading.active_count() != 1 or torch.cuda.is_initialized():
        return False
    threads = _os_threads()
    return threads is not None and threads <= _THREADS_AT_IMPORT


def _os_threads() -> int | None:
    """This process's OS threads, or None where they cannot be counted (not Linux)."""
    try:
        return len(os.listdir(_TASKS))
    except OSError:
        return None


# What importing the package leaves running (torch imports numpy, whose OpenBLAS starts a pool of threads
# that its fork handler stops and restarts): more than that at a worker's start is a thread of the trainer's.
# Where other threads ran already, only the main thread is allowed.
_THREADS_AT_IMPORT = (_os_threads() or 1) if threading.active_count() == 1 else 1


def start_server() -> bool:
    """Starts multiprocessing's fork server by forking this process, if it is not running and the fork is safe.

    Returns whether it did; otherwise the server starts (or runs already) multiprocessing's own way. Call it
    before anything of the trainer's that the server should not hold a copy of, e.g. shared-memory tensors.
    """
    server: Any = forkserver._forkserver  # its private fields, which typeshed does not declare
    if set(vars(server)) not in (_SERVER_FIELDS, _SERVER_FIELDS_WITH_PRELOAD):
        return False
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # A worker importing the trainer's script, which creates a collector outside its main guard: the
        # start of its workers raises multiprocessing's error about it (no server forked from here, again and again).
        return False
    with server._lock:
        if server._forkserver_pid is not None or not fork_is_safe():
            return False
        resource_tracker.ensure_running()  # a process of its own: it comes before the fork, as in ensure_running()
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]  # typeshed: private, undeclared
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            # Every client holds the write end of the "alive" pipe: the server exits when the last one is gone.
            alive_r, alive_w = os.pipe()
            # What is buffered now would be written again by the server's workers.
            util._flush_std_streams()  # type: ignore[attr-defined]  # typeshed: private, undeclared
            try:
                with warnings.catch_warnings():
                    # Python 3.12+ warns of any second OS thread; the ones fork_is_safe() allows stop for the fork.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
            except OSError:
                os.close(alive_r)
                os.close(alive_w)
                return False
            if pid == 0:
                try:
                    _serve(listener.fileno(), alive_r, alive_w)
                finally:
                    os._exit(1)  # never the trainer's atexit handlers or buffers
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
        return True


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked server: lets go of what it inherited from the trainer, then serves multiprocessing's protocol."""
    gc.freeze()  # the trainer's objects are never collected here: no finalizer of theirs runs twice
    # Held by the trainer's thread at the fork: a worker that starts processes of its own takes it.
    forkserver._forkserver._lock = threading.Lock()  # type: ignore[attr-defined]  # typeshed: private, undeclared
    os.close(alive_w)
    _release_inherited_fds(keep={0, 1, 2, listener_fd, alive_r})
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        if callable(signal.getsignal(signum)):  # the trainer's own handlers (a checkpoint on SIGTERM) stay there
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    # Workers import the trainer's script again, as from a fresh server: multiprocessing does it unless
    # __main__ is that script already.
    _trainer_main.append(sys.modules["__main__"])
    sys.modules["__main__"] = types.ModuleType("__main__")
    forkserver.main(listener_fd, alive_r, [])


def _release_inherited_fds(keep: set[int]) -> None:
    """Points the trainer's pipes and sockets at /dev/null here, so that their other ends see EOF when the trainer
    closes them; files, terminals and the rest stay open, as after any fork."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd in keep or fd == devnull:
                continue
            try:
                mode = os.fstat(fd).st_mode
            except OSError:  # the listing's own descriptor, closed by now
                continue
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)
