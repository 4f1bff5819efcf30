"""Autograd off for a block, as ``torch.no_grad()`` turns it off, at a fraction of its cost per use."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NoGrad"]


class NoGrad:
    """``with NoGrad():`` is ``with torch.no_grad():`` for a block (not a decorator), in the calling thread.

    ``torch.no_grad()`` makes two grad-mode objects per use, a few microseconds: as much as the rest of a
    short batch's hand-off. This sets and restores the thread's grad mode directly.
    """

    __slots__ = ("previous",)

    def __enter__(self) -> None:
        self.previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc_info: Any) -> None:
        torch._C._set_grad_enabled(self.previous)
