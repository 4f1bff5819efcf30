"""Where worker processes start from: a fork server forked from the trainer where that is safe, else a fresh one.

Worker processes fork from a single-threaded server, never from the trainer
itself, so they inherit none of the trainer's threads, locks held by them or
CUDA context. multiprocessing's forkserver starts that server as a fresh
interpreter, which imports torch, tensordict and gymnasium again before the
first worker can fork: seconds, on a small machine. So the server is forked
from the trainer instead, with those modules already imported, at the first
moment the trainer is safe to fork (no thread of its own, no CUDA context):

- when ``torch_rollout`` is imported (the last statement of its
  ``__init__``): a trainer imports it at its top, before ``wandb.init()``,
  ``SummaryWriter()`` or a ``tqdm`` bar start their threads. The server then
  waits, idle, for the first collector with worker processes, and becomes
  multiprocessing's only then (what else starts processes from a forkserver
  before then gets a server of its own, which serves the collectors too, and
  this one exits);
  ``TORCH_ROLLOUT_PREFORK=0`` skips this;
- else at the first worker's start, if the trainer is safe to fork then;
- else multiprocessing starts a fresh server, as it would by itself.

Whichever it is, it serves every later worker of every collector, whatever the
trainer starts meanwhile.

The forked server keeps nothing of the trainer that could hold others up or
act for it: its pipes and sockets are replaced by ``/dev/null`` (the numbers
stay taken, so nothing the trainer's objects refer to is reused), the trainer's
Python signal handlers are reset, and pending output is flushed first (no
worker prints it again). The imports under way at the fork give up their locks
(a worker's thread that imports would wait for them forever), and the modules
that were importing torch_rollout are dropped, for the workers to import
whole. Workers import the trainer's ``__main__`` script again, as from a fresh
server, and take on the trainer's environment variables as of their start
(:class:`TrainerEnvironment`; the server's are those of its own start).

A child that the trainer forks (``os.fork``, multiprocessing's fork start
method) lets go of the trainer's server, and starts one of its own if it needs
workers. At the trainer's exit the server exits too; one that serves no worker
is waited for, so that none outlives the trainer.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib._bootstrap
import multiprocessing
import os
import pickle
import re
import signal
import socket
import stat
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass
from multiprocessing import connection, forkserver, util
from typing import Any

import torch

__all__ = ["TrainerEnvironment", "context", "fork_is_safe", "start_server", "start_server_at_import"]

# What a worker needs (torch, tensordict, gymnasium and this package come with it), imported once per server
# instead of once per worker: by a fresh server before it forks the first worker, by the trainer before it
# forks the server at import.
PRELOAD = ["torch_rollout.placements._process"]
# multiprocessing.forkserver.ForkServer's state in the Pythons whose fork server protocol this module speaks
# (3.10-3.12); another set of fields (3.13 added authentication) starts the server multiprocessing's own way.
_SERVER_FIELDS = {"_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds", "_lock"}
_SERVER_FIELDS_WITH_PRELOAD = _SERVER_FIELDS | {"_preload_modules"}
_TASKS = "/proc/self/task"  # one entry per OS thread of this process (Linux)
# Set to 0, the server is not forked at import, only at the first worker's start (where that is safe).
PREFORK_VARIABLE = "TORCH_ROLLOUT_PREFORK"
_PACKAGE = __name__.partition(".")[0]
# How long the trainer's exit waits for a server that serves no worker (it exits as soon as it sees the pipe's end).
_EXIT_WAIT = 2.0
# The trainer's __main__ module, kept alive in a forked server that replaced it, so that nothing it holds is freed.
_trainer_main: list[types.ModuleType] = []


@dataclass(frozen=True)
class _Forked:
    """A fork server that this process forked: where it listens, this process's end of its alive pipe, its pid."""

    address: str
    alive_w: int
    pid: int


# Forked at import, and kept to this package until its first worker: until then, whatever else starts processes
# with multiprocessing's forkserver gets a server of its own, as it would without torch_rollout.
_idle: _Forked | None = None
# The pid of the server that this process forked, once it serves as multiprocessing's (None: none, or not ours).
_server_pid: int | None = None


def context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """The multiprocessing context that worker processes start from (forkserver where there is one, else spawn)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    start_server()
    return ctx


class TrainerEnvironment:
    """The trainer's environment variables and warnings filters, which a worker process takes on as it
    unpickles this object.

    A server's are those of the moment it started (the trainer's import of torch_rollout, say): a trainer that
    sets ``MUJOCO_GL=egl`` later, in its ``main()``, has its workers see it all the same, and a warning that the
    trainer ignores (or turns into an error) around ``Collector(...)`` is ignored (or an error) in its workers
    too. A filter whose category the worker cannot import (a class of the trainer's ``__main__``) is left out.
    A worker's first argument, so that the modules that unpickling its env recipe and its policy imports see
    them too.
    """

    variables: dict[str, str]
    filters: list[bytes]  # warnings.filters, each pickled on its own

    def __init__(self) -> None:
        self.variables = dict(os.environ)
        self.filters = []
        for action, message, category, module, lineno in warnings.filters:
            # the message and module are compiled patterns, or None, or (where a filter was put in by hand) strings
            entry = (action, _pattern(message), category, _pattern(module), lineno)
            try:
                self.filters.append(pickle.dumps(entry))
            except Exception:  # a category or pattern that does not pickle: the worker keeps its own
                continue

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if os.environ != self.variables:
            os.environ.clear()
            os.environ.update(self.variables)
        filters = []
        for entry in self.filters:
            try:
                filters.append(pickle.loads(entry))
            except Exception:  # a category this process cannot import
                continue
        warnings.resetwarnings()
        for action, message, category, module, lineno in reversed(filters):  # each inserted at the front
            warnings.filterwarnings(action, message, category, module, lineno)


def _pattern(pattern: re.Pattern[str] | str | None) -> str:
    if isinstance(pattern, re.Pattern):
        return pattern.pattern
    return pattern or ""


def fork_is_safe() -> bool:
    """Whether this process can be forked safely: no CUDA context, no Python thread but this one, and no OS
    thread beyond those that importing torch_rollout found (the BLAS pool of numpy, which stops itself before
    a fork; none where JAX, TensorFlow or Ray was imported first); a thread pool of OpenMP, CUDA's threads, a
    Ray or gRPC client's all count."""
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


# Runtimes whose threads are running once they are imported or used, and which a fork does not survive (a
# worker of a server forked beside JAX's thread pools waits forever in its first compilation): with one of them
# imported before torch_rollout, the threads found at import are not numpy's alone.
_THREADED_RUNTIMES = ("jax", "jaxlib", "tensorflow", "ray")
# What importing the package leaves running (torch imports numpy, whose OpenBLAS starts a pool of threads
# that its fork handler stops and restarts): more than that at a worker's start is a thread of the trainer's.
# Where other threads ran already, only the main thread is allowed.
_THREADS_AT_IMPORT = (
    (_os_threads() or 1)
    if threading.active_count() == 1 and not any(name in sys.modules for name in _THREADED_RUNTIMES)
    else 1
)


def start_server_at_import() -> bool:
    """Forks the fork server while ``torch_rollout`` is imported, unless ``TORCH_ROLLOUT_PREFORK=0``; whether it did.

    The package's ``__init__`` calls it last. A trainer imports torch_rollout at its top, before anything it
    runs starts threads; the server forked now stays idle until the first collector with worker processes
    (:func:`start_server` hands it to multiprocessing then). Not in a fork server that multiprocessing starts
    (it imports torch_rollout to preload it), nor in a process that multiprocessing prepares (a spawned
    child importing the trainer's script again): neither creates collectors.

    Raises:
        ValueError: ``TORCH_ROLLOUT_PREFORK`` is set to something other than 0 or 1.
    """
    global _idle
    value = os.environ.get(PREFORK_VARIABLE, "1").strip()
    if value not in ("0", "1", ""):
        raise ValueError(
            f"import torch_rollout: {PREFORK_VARIABLE}={value!r}; set it to 0 (the fork server of worker processes "
            "starts with the first collector that needs one) or 1 (it is forked now, at import: the default), "
            "or unset it"
        )
    if value == "0" or _running(forkserver.main.__code__) or not _can_fork():
        return False
    for name in PRELOAD:  # what a worker runs: imported once, before the fork, not once per worker
        importlib.import_module(name)
    server: Any = forkserver._forkserver  # its private fields, which typeshed does not declare
    with server._lock:
        if server._forkserver_pid is not None or _idle is not None or not fork_is_safe():
            return False
        _idle = _fork_server(at_import=True)
    return _idle is not None


def _running(code: types.CodeType) -> bool:
    """Whether the function of ``code`` is running, somewhere up this thread's stack."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def start_server() -> bool:
    """Makes multiprocessing's fork server one forked from this process, if none runs yet; whether it did.

    The one forked at import if there is one, else one forked now if the fork is safe; otherwise the server
    starts (or runs already) multiprocessing's own way. Call it before anything of the trainer's that a server
    forked now should not hold a copy of, e.g. shared-memory tensors.
    """
    global _idle, _server_pid
    if not _can_fork():
        return False
    server: Any = forkserver._forkserver
    with server._lock:
        forked, _idle = _idle, None
        if server._forkserver_pid is not None:
            if forked is not None:  # something else started processes from a forkserver first: its server serves
                _stop(forked)
            return False
        if forked is None:
            forked = _fork_server(at_import=False) if fork_is_safe() else None
            if forked is None:
                return False
        server._forkserver_address = forked.address
        server._forkserver_alive_fd = forked.alive_w
        server._forkserver_pid = _server_pid = forked.pid
        return True


def _can_fork() -> bool:
    """Whether this Python's fork server is one that this module can fork, in this process."""
    server: Any = forkserver._forkserver
    if set(vars(server)) not in (_SERVER_FIELDS, _SERVER_FIELDS_WITH_PRELOAD) or not isinstance(_module_locks(), dict):
        return False
    # A worker importing the trainer's script, which creates a collector outside its main guard: the start of
    # its workers raises multiprocessing's error about it (no server forked from here, again and again).
    return not getattr(multiprocessing.current_process(), "_inheriting", False)


def _fork_server(*, at_import: bool) -> _Forked | None:
    """Forks a fork server from this process (under multiprocessing's server lock, once it is found safe)."""
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
            return None
        if pid == 0:
            try:
                _serve(listener.fileno(), alive_r, alive_w, at_import=at_import)
            finally:
                os._exit(1)  # never the trainer's atexit handlers or buffers
        os.close(alive_r)
    return _Forked(address=address, alive_w=alive_w, pid=pid)


def _serve(listener_fd: int, alive_r: int, alive_w: int, *, at_import: bool) -> None:
    """The forked server: lets go of what it inherited from the trainer, then serves multiprocessing's protocol."""
    gc.freeze()  # the trainer's objects are never collected here: no finalizer of theirs runs twice
    # Held by the trainer's thread at the fork: a worker that starts processes of its own takes it.
    forkserver._forkserver._lock = threading.Lock()  # type: ignore[attr-defined]  # typeshed: private, undeclared
    _leave_imports(at_import=at_import)
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


def _module_locks() -> object:
    """importlib's lock per module being imported (a dict by name in 3.10-3.12)."""
    return getattr(importlib._bootstrap, "_module_locks", None)


def _leave_imports(*, at_import: bool) -> None:
    """Lets go of the imports that the trainer's thread was in at the fork, which never finish here.

    Their module locks are held by that thread: a worker's thread that imports one of those modules (or a
    submodule of it) would wait for it forever. Forked at import, torch_rollout's own import is complete (the
    fork is the last statement of its ``__init__``), and the modules that were importing it stopped at that
    line: they are dropped, with their submodules, so that workers import them whole from their files.
    """
    locks = _module_locks()
    assert isinstance(locks, dict)  # checked by _can_fork() before the fork
    locks.clear()  # later imports take locks of their own
    if not at_import:
        return
    for name, module in list(sys.modules.items()):
        spec: Any = getattr(module, "__spec__", None)
        if not getattr(spec, "_initializing", False):
            continue
        if name == _PACKAGE:
            spec._initializing = False
            continue
        for other in [other for other in sys.modules if other == name or other.startswith(name + ".")]:
            del sys.modules[other]


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


def _forget_server() -> None:
    """In a child that this process forks (``os.fork``, multiprocessing's fork start method): the server stays the
    parent's. The child closes its end of the alive pipe (the server's lifetime stays the parent's) and starts a
    server of its own if it starts workers (multiprocessing checks that its server lives with ``waitpid``,
    which only the parent can call)."""
    global _idle, _server_pid
    forked = _idle or _handed_back()
    _idle = _server_pid = None
    if forked is not None:
        try:
            os.close(forked.alive_w)
        except OSError:
            pass


def _handed_back() -> _Forked | None:
    """The server forked here that serves as multiprocessing's, taken back from it (its fields cleared)."""
    server: Any = forkserver._forkserver
    if _server_pid is None or getattr(server, "_forkserver_pid", None) != _server_pid:
        return None
    forked = _Forked(address=server._forkserver_address, alive_w=server._forkserver_alive_fd, pid=_server_pid)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    server._lock = threading.Lock()  # held, maybe, by a thread that a forked child does not have
    return forked


def _stop_server() -> None:
    """At exit: lets the server forked here go (it exits once no worker holds its alive pipe)."""
    global _idle, _server_pid
    forked = _idle or _handed_back()
    _idle = _server_pid = None
    if forked is not None:
        _stop(forked)


def _stop(forked: _Forked) -> None:
    """Closes this process's end of the alive pipe of ``forked``, and waits for it if it has no worker (it exits at
    once then), so that none is left after this process."""
    try:
        os.close(forked.alive_w)
    except OSError:
        return
    if not util.is_abstract_socket_namespace(forked.address):
        try:
            os.unlink(forked.address)
        except OSError:
            pass
    try:
        with open(f"/proc/{forked.pid}/task/{forked.pid}/children") as f:
            if f.read().split():
                return  # workers of a collector left open: the server exits after them
    except OSError:
        return
    deadline = time.monotonic() + _EXIT_WAIT
    while time.monotonic() < deadline:
        try:
            if os.waitpid(forked.pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:  # reaped already (a SIGCHLD handler, os.wait() of the trainer's)
            return
        time.sleep(0.005)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_server)
# Registered before the collectors' own exit handler (collector.py): runs after it, once their workers are closed.
atexit.register(_stop_server)
