"""Notes on exceptions that say where they were raised (which env, which worker), on every Python supported."""

from __future__ import annotations

import sys

__all__ = ["add_note"]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, and its like on Python 3.10, which has neither ``add_note`` nor notes in tracebacks.

    There the note is kept in ``exc.__notes__`` as 3.11 keeps it, and, so that a traceback shows it, added to
    the message of an exception whose one argument is its message.
    """
    if sys.version_info >= (3, 11):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined]  # (3.10's BaseException declares no __notes__)
    notes.append(note)
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} {note}",)
