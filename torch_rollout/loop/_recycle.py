"""Rows of delivered batches written again once the trainer has let go of them: :class:`RowRing`."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict, TensorDictBase

if TYPE_CHECKING:
    from torch_rollout.loop._rows import DeviceRows, HostRows

__all__ = ["RowRing", "new_tensordict"]


class RowRing:
    """The rows of the last ``size`` batches delivered on the CPU, written again once nothing else refers to them.

    A batch leaves as new views of its rows' tensors. While the trainer keeps
    the batch, one of its tensors, a view or a NumPy array of one, that view
    holds the tensor's storage, whose use count then stands above the count
    taken at delivery: those rows are left alone, and the loop makes new ones.
    Rows that nothing outside refers to any more are written again, so that a
    trainer that copies each batch out (a replay buffer) makes the loop
    allocate nothing per batch, and one that keeps its batches (a list of
    rollouts) keeps them intact.
    """

    def __init__(self, size: int) -> None:
        self.size = size if _USE_COUNT is not None else 0
        # Per rows kept: (their storages with each one's use count at delivery, the batch's nesting).
        self.slots: deque[tuple[HostRows | DeviceRows, tuple[list[tuple[Any, int]], _Nest]]] = deque()

    def take(self) -> HostRows | DeviceRows | None:
        """Rows of an earlier batch that nothing outside refers to, ready to be written again; or None."""
        for i, (rows, (storages, _)) in enumerate(self.slots):
            if all(_USE_COUNT(storage._cdata) == uses for storage, uses in storages):
                del self.slots[i]
                rows.recycle()
                return rows
        return None

    def deliver(self, rows: HostRows | DeviceRows, batch: TensorDict) -> TensorDict:
        """Keeps ``rows`` (whose tensors ``batch`` holds) for a later batch, and returns ``batch`` as new views."""
        if not self.size:
            return batch
        kept = rows.kept
        if kept is None:  # the first batch of these rows: counted before any view of the batch exists
            # The storages themselves (their Python objects count once, at delivery as later).
            storages = [tensor.untyped_storage() for tensor in batch.values(True, True)]
            kept = rows.kept = ([(storage, _USE_COUNT(storage._cdata)) for storage in storages], _nest(batch))
        self.slots.append((rows, kept))
        if len(self.slots) > self.size:
            self.slots.popleft()  # the trainer keeps that batch: it is its own now
        return _views(kept[1])


# A batch's nesting, to make views of it quickly: its entries (tensors, or nestings), batch size and device.
_Nest = tuple[dict[str, Any], torch.Size, Any]


def _nest(batch: TensorDictBase) -> _Nest:
    entries = {key: _nest(value) if isinstance(value, TensorDictBase) else value for key, value in batch.items()}
    return entries, batch.batch_size, batch.device


def _views(nest: _Nest) -> TensorDict:
    """The batch of ``nest`` with each tensor a new view of its storage (so that a reference to any counts)."""
    entries, batch_size, device = nest
    views = {key: _views(value) if isinstance(value, tuple) else value.detach() for key, value in entries.items()}
    return new_tensordict(views, batch_size=batch_size, device=device)


# torch's private count of a storage's references: without it, every batch gets new storage.
_USE_COUNT: Any = getattr(torch._C, "_storage_Use_Count", None)
# A TensorDict made without checking its entries: they are those of a batch checked when it was made.
new_tensordict = getattr(TensorDict, "_new_unsafe", TensorDict)
