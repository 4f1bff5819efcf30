"""Where worker processes start from: multiprocessing's fork server, started when the first collector needs it.

Worker processes fork from a single-threaded server, never from the trainer
itself, so they inherit none of the trainer's threads, locks held by them or
CUDA context. The server is multiprocessing's own (the ``forkserver`` start
method; ``spawn`` where there is none), a fresh interpreter that imports
torch, tensordict, gymnasium and this package once, before it forks the first
worker: each worker then starts with them imported. Importing torch_rollout
starts nothing: the server starts with the first collector with worker
processes (seconds, on a small machine, most of it importing torch), or
earlier at :func:`start_workers_early`, which lets that import run while the
trainer builds its model and envs. It serves every later worker of every
collector, and exits with the trainer.

Workers import the trainer's ``__main__`` script again (multiprocessing's
preparation), and take on the trainer's environment variables and warnings
filters as of their collector's start (:class:`TrainerEnvironment`; the
server's are those of its own start).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import warnings
from multiprocessing import forkserver
from typing import Any

__all__ = ["TrainerEnvironment", "context", "start_workers_early"]

# What a worker needs (torch, tensordict, gymnasium and this package come with it), imported once by the server
# before it forks the first worker, instead of once per worker.
PRELOAD = ["torch_rollout.placements._process"]


def context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """The multiprocessing context that worker processes start from (forkserver where there is one, else spawn),
    with its server started."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: a server running already keeps its own
    # The server's start starts multiprocessing's resource tracker first. A named lock made later registers with
    # the running tracker at once: no process starts between the lock's creation and its registration, where a
    # kill would leave its /dev/shm entry behind for good.
    forkserver.ensure_running()
    return ctx


def start_workers_early() -> None:
    """Starts the server that worker processes fork from now, instead of at the first collector that needs it.

    The server is a fresh interpreter that imports torch, tensordict, gymnasium and torch_rollout before it
    can fork a worker: a few seconds, which a trainer that calls this at its top spends building its model and
    envs meanwhile, so that its first collector with worker processes starts its workers at once. It serves
    every collector of the process, and exits with it. Calling it again, or after a collector started the
    server, does nothing; without the ``forkserver`` start method (Windows) it does nothing either.

    Example::

        import torch_rollout

        if __name__ == "__main__":
            torch_rollout.start_workers_early()  # first: the server imports torch while the trainer sets up
            ...  # the model, the optimiser, a logger
            collector = torch_rollout.Collector(..., backend=torch_rollout.Processes(2))
    """
    context()


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
