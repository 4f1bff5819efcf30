"""Notes on exceptions that say where they were raised (which env, which worker), on every Python supported."""

from __future__ import annotations

import sys

__all__ = ["add_note"]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, and its like on Python 3.10, which has no ``add_note``.

    There the note is kept in ``exc.__notes__`` as 3.11 keeps it (code that reads the notes finds them), and the
    message stays as it was. 3.10's tracebacks print no notes; a worker's error names the worker in the traceback
    text chained to it as its cause, which they do print.
    """
    if sys.version_info >= (3, 11):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined]  # (3.10's BaseException declares no __notes__)
    notes.append(note)
