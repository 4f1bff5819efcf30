"""Warnings that point at the user's line: the first frame outside torch_rollout, however deep the call."""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

__all__ = ["warn"]

# the package's root folder (this module is in its util/)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` at the line that called into torch_rollout (its file and line in the warning).

    A fixed ``stacklevel`` breaks whenever the call path changes (the placement that
    builds the loop, a decorator); this one counts the package's own frames.
    """
    frame: FrameType | None
    level, frame = 2, sys._getframe(1)  # stacklevel 2: the caller of this function
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
