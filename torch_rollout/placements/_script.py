"""The trainer's ``__main__`` as worker processes see it: what they can import of it, and what they run again.

A worker process (forkserver or spawn) starts by running the trainer's
``__main__`` again from its file, as ``__mp_main__`` (a module run with ``-m``:
by its name), and then unpickles ``envs`` and ``policy``, which name their
classes and functions of ``__main__`` by module and name. So worker processes
cannot start where ``__main__`` was read from stdin (its ``__file__`` is
``"<stdin>"``), cannot find what a notebook, the REPL or ``python -c``
defined (no file), nor what the script defines only under
``if __name__ == "__main__":`` or by code ``exec``'d into ``__main__`` (the
file they run does not define it at its top level), and they create a
collector of their own where the script creates one outside the guard.
These checks run in the trainer, before any worker is started.
"""

from __future__ import annotations

import ast
import functools
import os
import pickle
import sys
import tokenize
import types
from typing import Any

__all__ = ["import_problem", "main_globals", "main_problem", "unguarded_call"]

_GUARD = "'if __name__ == \"__main__\":'"


def main_globals(obj: Any) -> list[type | types.FunctionType]:
    """The classes and functions of ``__main__`` that pickling ``obj`` names; raises what pickling raises."""
    finder = _MainFinder(_Sink())
    finder.dump(obj)
    return finder.found


class _Sink:
    """A file that forgets what is written: pickling only to see what is pickled."""

    def write(self, data: bytes) -> int:
        return len(data)


class _MainFinder(pickle.Pickler):
    def __init__(self, file: _Sink) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.found: list[type | types.FunctionType] = []

    def persistent_id(self, obj: Any) -> None:
        # Called for every object before it is pickled: classes and functions are pickled by module and name.
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.found.append(obj)
        return None


def main_problem() -> str | None:
    """Why no worker process can start from this ``__main__`` (read from stdin, not from a file), or None."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return None  # python -m: workers import it by name
    path = getattr(main, "__file__", None)
    if path is None or os.path.isfile(path):
        return None  # no file (a notebook, python -c): workers do not run it again
    return (
        f"the trainer's __main__ was read from {path!r} (python - or a pipe), not from a file, and worker processes "
        "start by running __main__ again from its file: save the script to a file and run that (python train.py), "
        "or pass backend='thread'"
    )


def import_problem(name: str, found: list[type | types.FunctionType]) -> str | None:
    """Why worker processes cannot import ``found`` (:func:`main_globals` of the argument ``name``), or None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    fix = "define it in a module that you import (e.g. a .py file next to the script), or pass backend='thread'"
    for obj in found:
        what = f"{name} uses {'class' if isinstance(obj, type) else 'function'} {obj.__qualname__} of __main__"
        if path is None:
            return (
                f"{what}, defined in an interactive __main__ (a notebook, the REPL or python -c), which worker "
                f"processes cannot import; {fix}"
            )
        bound = _bound_in_worker(path)
        if bound is not None and obj.__qualname__.split(".")[0] not in bound:
            return (
                f"{what}, which the script {path!r} does not define outside {_GUARD} (code exec'd into __main__, or "
                f"a definition under the guard): worker processes run the script again to import __main__ and would "
                f"not find it; {fix}"
            )
    return None


def _bound_in_worker(path: str) -> set[str] | None:
    """The names that running the script ``path`` as ``__mp_main__`` binds at its top level; None if unreadable."""
    try:
        stat = os.stat(path)
        return _bound_names(path, stat.st_mtime_ns, stat.st_size)
    except (OSError, SyntaxError, ValueError):
        return None


@functools.lru_cache(maxsize=8)
def _bound_names(path: str, mtime_ns: int, size: int) -> set[str]:
    """Names bound at the top level of the script: defs, classes, imports and assignments, not under the guard."""
    with tokenize.open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                # Decorators and default values run at import: a walrus in them binds too (rare; not followed).
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, ast.If) and _mentions_name(node.test):
                continue  # the guard (either way round): what it holds is not run in both processes
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child])
                    elif isinstance(child, ast.ExceptHandler | ast.match_case):
                        visit(child.body)
                    else:
                        names.update(n.id for n in ast.walk(child) if isinstance(n, ast.Name) and _stores(n))

    visit(tree.body)
    return names


def _mentions_name(test: ast.expr) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(test))


def _stores(node: ast.Name) -> bool:
    return isinstance(node.ctx, ast.Store)


def unguarded_call() -> str | None:
    """Where the script creates this Collector outside ``if __name__ == "__main__":``, or None.

    Found from the frame of the script's top level on the stack, and the
    script's source: the statement it runs now is unguarded when no ``if``,
    ``try``, ``match`` or ``while`` around it could tell a worker process from
    the trainer (``for`` and ``with`` run the same in both). None wherever that
    cannot be told for sure: then a worker that dies while importing the script
    is explained instead.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or not os.path.isfile(path):
        return None
    frame: types.FrameType | None = sys._getframe(1)
    script = os.path.realpath(path)
    while frame is not None:
        if (
            frame.f_code.co_name == "<module>"
            and frame.f_globals is vars(main)
            and os.path.realpath(frame.f_code.co_filename) == script
        ):
            break
        frame = frame.f_back
    else:
        return None  # created after the script's top level ran (a callback, a thread)
    line = frame.f_lineno
    try:
        with tokenize.open(path) as f:
            tree = ast.parse(f.read(), filename=path)
        # The file as it is now, which may have been edited since the script started: read only if it compiles
        # to the code that runs (the same instructions on the same lines), else its line numbers mean nothing.
        now = compile(tree, frame.f_code.co_filename, "exec", dont_inherit=True)
    except (OSError, SyntaxError, ValueError):
        return None
    if not _same_code(now, frame.f_code) or _conditional_around(tree.body, line):
        return None
    return (
        f"Collector(backend='process'): the script {path} creates this Collector at line {line}, outside an "
        f"{_GUARD} block; worker processes import the trainer's __main__ script again, and would run that line "
        f"too: the code that creates the Collector must sit under {_GUARD} (or pass backend='thread')"
    )


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Whether two module code objects run the same instructions from the same lines."""
    return a.co_code == b.co_code and list(a.co_lines()) == list(b.co_lines())


_CONDITIONAL = (ast.If, ast.Try, ast.Match, ast.While) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())


def _conditional_around(body: list[ast.stmt], line: int) -> bool:
    """Whether a statement that decides what runs (``if``, ``try``, ...) encloses ``line`` among ``body``.

    A ``def`` or ``class`` that encloses it is run at import (a decorator, a class body), as ``for`` and ``with`` are.
    """
    for node in body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            if isinstance(node, _CONDITIONAL):
                return True
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                return False  # a decorator or a class body: run at import too
            return _conditional_around([*getattr(node, "body", []), *getattr(node, "orelse", [])], line)
    return False
