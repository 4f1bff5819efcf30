"""A complete batch's rows handed to a sink as host arrays, with no TensorDict made for them.

A :class:`~torch_rollout.ReplayRing` filled from a collector that collects in the
trainer's thread takes each batch this way: it copies the keys it keeps from the
loop's arrays into its storage, and writes the next observations and ``done``
there itself. From worker processes it takes each worker's block of envs from the
shared-memory slot the worker wrote the batch into (:func:`slot_batch`), and from Ray
actors each actor's arrays as the object store holds them (:func:`blocks_batch`). What it
copies are the values the batch would hold, so the ring's rows are those a batch
would have given it. Where a batch needs more than the arrays (bootstrap values on
the thread, rows acted ahead, storage off the CPU), there is no :class:`HostBatch`
and the batch is delivered as usual. A torch env's rows stored on the CPU are offered as NumPy views of
their tensors, and their next observations written with the same torch ops as the batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from torch_rollout.loop._bootstrap import batch_finals, write_next
from torch_rollout.loop._rows import DeviceRows, HostRows

if TYPE_CHECKING:
    from torch_rollout.loop._rollout import RolloutLoop

__all__ = ["HostBatch", "Sink", "blocks_batch", "host_batch", "slot_batch"]


class HostBatch:
    """The ``[T, N]`` rows of a complete batch, as NumPy arrays on the host, until the sink returns.

    Made once for the loop's rows and offered again each time they hold a new batch: the arrays are views of
    the rows' storage, the same objects from batch to batch (a sink may keep what it worked out from them).

    Worker processes' rows come as several parts: each worker's ``[T, N_k]`` block of a batch in its
    shared-memory slot, with its next observations and ``done`` written by the worker (see :func:`slot_batch`).

    Attributes:
        parts: ``(first env, {batch key: [T, N_k, ...] array})`` per block of envs, in env order: the
            observations, the policy's outputs and the loop's own rows (``reward``, ``terminated``,
            ``truncated``, ``mask``, ...). Views of the loop's rows (or of the slots): copy them.
        every_row: whether every row of this batch is a transition (``mask`` all True).
        obs_key: the batch key of the observations (None for the slots' parts, which hold the next ones).
        next_obs_key: the batch key of the next observations, or None when the collector makes none or the
            parts hold them; where the loop's own rows lack them, :meth:`write_next_obs` writes them.
    """

    def __init__(
        self,
        head: HostRows | DeviceRows | None,
        parts: list[tuple[int, dict[str, np.ndarray]]],
        shape: tuple[int, int],
        obs_key: str | None,
        next_obs_key: str | None,
    ):
        self.head = head
        self.parts = parts
        self.num_steps, self.num_envs = shape
        self.obs_key, self.next_obs_key = obs_key, next_obs_key
        self.last: Any = None  # the observations after the last row, set for each batch
        self.every_row = True
        self.plan: Any = None  # what the sink worked out for these arrays, kept for the next batch

    def read_masks(self) -> None:
        """Sets :attr:`every_row` from the parts' ``mask`` rows, for the batch they hold now."""
        for _, arrays in self.parts:  # a loop and np.count_nonzero: a third of the cost of all(mask.all() ...)
            mask = arrays["mask"]
            if np.count_nonzero(mask) != mask.size:
                self.every_row = False
                return
        self.every_row = True

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays of a batch in one part (the loop's rows)."""
        return self.parts[0][1]

    def write_next_obs(self, rows: np.ndarray) -> None:
        """Writes each row's next observation into ``rows`` (``[T, N, ...]``), as the batch's ``next_obs``."""
        head = self.head
        assert head is not None  # the loop's own rows
        if type(head) is HostRows:
            head.write_next_obs(rows, self.last)
            return
        assert isinstance(head, DeviceRows)  # a torch env's rows, stored on the CPU: written with torch ops
        finals, dense = batch_finals(head, True, torch.device("cpu"))  # as the batch's end takes them
        write_next(torch.from_numpy(rows), head.obs, self.last, finals, dense, head.own_finals())

    def write_done(self, rows: np.ndarray) -> None:
        """Writes ``terminated | truncated`` into ``rows`` (``[T, N]`` bool), as the batch's ``done``."""
        np.logical_or(self.arrays["terminated"], self.arrays["truncated"], out=rows)


# What takes a batch's rows: returns the rows it wrote, or None to be given the batch as a TensorDict instead.
Sink = Callable[[HostBatch], "int | None"]


def host_batch(loop: RolloutLoop, head: Any) -> HostBatch | None:
    """The rows of ``head`` (complete) as a :class:`HostBatch`, or None where the batch must be delivered whole.

    That is where a bootstrap value is wanted (the policy returns ``value``), rows were acted on ahead, the rows
    are not arrays on the host (a Dict observation space, storage on a GPU), or the batch is written into a
    slot given by the placement. A torch env's rows stored on the CPU are offered as NumPy views of their
    tensors.
    """
    if loop.buffers or (type(head) is not HostRows and type(head) is not DeviceRows):
        return None
    made = head.direct
    if made is None:  # the first batch of these rows: the same for every later one
        made = head.direct = _made(loop, head) or False
    if made is False:
        return None
    assert loop.waiting is not None  # the observations after the last row
    made.last = loop.waiting.obs
    made.read_masks()
    return made


def _made(loop: RolloutLoop, head: HostRows | DeviceRows) -> HostBatch | None:
    outputs = loop.outputs
    if head.out is not None or outputs is None or outputs.value_key is not None:
        return None
    assert head.outputs is not None  # acted on
    arrays: dict[str, Any] | None
    if isinstance(head, HostRows):
        if not head.writes_next_obs():
            return None
        arrays = dict(head.host)
        arrays[loop.obs_key] = head.obs.arrays
    else:
        arrays = _device_arrays(head, loop.obs_key)
    if arrays is None:
        return None
    for key, value in head.outputs.items():
        if type(value) is not Tensor:
            return None  # a TensorDict of outputs: delivered whole
        try:
            arrays[key] = value.numpy()
        except TypeError:  # a dtype NumPy has not (bfloat16)
            return None
    return HostBatch(head, [(0, arrays)], (head.T, head.N), loop.obs_key, loop.next_obs_key)


def _device_arrays(head: DeviceRows, obs_key: str) -> dict[str, np.ndarray] | None:
    """NumPy views of a torch env's rows (its observations and the loop's own keys), where they are tensors on
    the CPU; else None."""
    if head.store.type != "cpu" or type(head.obs) is not Tensor:  # on a GPU, or a Dict space's TensorDict
        return None
    try:
        arrays = {key: value.numpy() for key, value in head.rows.items()}
        arrays[obs_key] = head.obs.numpy()
    except TypeError:  # a dtype NumPy has not (bfloat16)
        return None
    return arrays


def slot_batch(slots: list[Any]) -> HostBatch:
    """The rows of one batch in the workers' shared-memory slots (``[T, N_k]`` TensorDicts on the CPU, in
    worker order) as parts of a :class:`HostBatch`: every key that is a tensor NumPy can view."""
    blocks = []
    for slot in slots:
        arrays = {}
        for key, value in slot.items():
            if type(value) is Tensor:
                try:
                    arrays[key] = value.numpy()
                except TypeError:  # a dtype NumPy has not (bfloat16): the batch is made whole for it
                    pass
        blocks.append(arrays)
    return blocks_batch(blocks)


def blocks_batch(blocks: list[dict[str, Any]]) -> HostBatch:
    """One batch's rows as the workers' ``[T, N_k]`` blocks of arrays by batch key (next observations and
    ``done`` written by the workers), in worker order; :attr:`~HostBatch.every_row` read from their ``mask``."""
    parts, first = [], 0
    for arrays in blocks:
        parts.append((first, arrays))
        first += arrays["mask"].shape[1]
    rows = HostBatch(None, parts, (blocks[0]["mask"].shape[0], first), None, None)
    rows.read_masks()
    return rows
