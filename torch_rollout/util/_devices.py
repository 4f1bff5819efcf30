"""Copies between devices that the host never reads before they land, and CUDA devices with their index.

``non_blocking=True`` is safe only when the copy's destination is a CUDA device:
the stream orders every later kernel after it. A non-blocking copy from CUDA to
the CPU returns at once, into page-locked memory that the host may read before
the copy has landed (an env stepping on stale actions). Every copy between
devices in the collection loop goes through :func:`to_device` or
:func:`copy_into`, which block exactly when the host is the destination.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from tensordict import TensorDictBase
from torch import Tensor

__all__ = ["copy_into", "indexed", "is_device", "to_device"]

T = TypeVar("T", Tensor, TensorDictBase)


def to_device(value: T, device: torch.device) -> T:
    """``value`` on ``device``: a copy that the host can read at once when ``device`` is the CPU."""
    if value.device == device:  # a no-op .to() costs more than the comparison, at every step
        return value
    return value.to(device, non_blocking=device.type == "cuda")


def copy_into(dst: T, src: Tensor | TensorDictBase) -> T:
    """Copies ``src`` into ``dst`` in place, blocking when ``dst`` is on the CPU (or a TensorDict without a device)."""
    if type(dst) is Tensor and not dst.is_cuda:  # per step: without reading the device, half the cost
        return dst.copy_(src)
    device = dst.device
    return dst.copy_(src, non_blocking=device is not None and device.type == "cuda")


def indexed(device: torch.device | str | int) -> torch.device:
    """``device`` as a ``torch.device``, a CUDA device with its index (``"cuda"``: the current device's)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def is_device(device: object) -> bool:
    """Whether ``device`` names a torch device: a ``torch.device`` or a string torch parses (``"cuda:0"``)."""
    if isinstance(device, torch.device):
        return True
    if not isinstance(device, str):
        return False
    try:
        torch.device(device)
    except RuntimeError:
        return False
    return True
