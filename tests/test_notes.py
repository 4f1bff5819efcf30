"""Where an error came from (which env, which worker) is noted on every Python, with or without ``add_note``."""

from __future__ import annotations

import types

import pytest

from torch_rollout.util import _notes


@pytest.mark.parametrize("version", [(3, 10), (3, 11)], ids=["3.10", "3.11+"])
def test_a_note_is_kept_and_the_message_left_alone(monkeypatch, version):
    if version >= (3, 11) and not hasattr(BaseException, "add_note"):
        pytest.skip("this Python has no add_note")
    monkeypatch.setattr(_notes, "sys", types.SimpleNamespace(version_info=version))
    exc = ValueError("the env's message")
    _notes.add_note(exc, "(raised by env 3)")
    _notes.add_note(exc, "(raised in torch_rollout worker 1)")
    assert exc.__notes__ == ["(raised by env 3)", "(raised in torch_rollout worker 1)"]
    assert str(exc) == "the env's message"


def test_an_exception_of_other_arguments_keeps_them_on_3_10(monkeypatch):
    monkeypatch.setattr(_notes, "sys", types.SimpleNamespace(version_info=(3, 10)))
    exc = OSError(2, "No such file")
    _notes.add_note(exc, "(raised by env 0)")
    assert exc.args == (2, "No such file") and exc.__notes__ == ["(raised by env 0)"]
