"""A replay ring that the collector writes each batch's transitions into: no batch handed to the trainer.

Off-policy learners (DQN, SAC, TD3, FastTD3) keep their transitions in a preallocated ring of tensors
and sample minibatches from it. :class:`ReplayRing` is that ring; :meth:`ReplayRing.fill` iterates a
collector and copies each batch's real rows into it (one copy per key, in global env order, on the
ring's device), so the training loop sees only the ring.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn

import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from torch_rollout.collector import Collector
from torch_rollout.loop._arguments import resolve_device
from torch_rollout.loop._direct import HostBatch
from torch_rollout.loop._recycle import new_tensordict  # unchecked: rows of the ring's own storage, checked when made
from torch_rollout.util._devices import copy_into

__all__ = ["ReplayRing"]

DEFAULT_KEYS = ("obs", "action", "reward", "next_obs", "terminated")


class ReplayRing:
    """``capacity`` transitions in preallocated tensors on ``device``, overwritten oldest first.

    Args:
        capacity: rows the ring holds; at least one batch's rows (``num_steps * num_envs``).
        keys: the batch keys kept (a nested observation's key keeps its whole TensorDict). The
            default is a Q-learner's transition; ``next_obs`` needs ``keys=BatchKeys(next_obs=True)``
            in the collector.
        device: where the ring lives (a batch on another device is copied over).

    The storage is allocated at the first write, from that batch's dtypes and shapes. A later batch
    must have the same shapes, and dtypes that the storage holds without loss (an ``int32`` action
    into ``int64`` storage, not a ``float64`` observation into ``float32`` storage). Rows are
    written in the order ``t * num_envs + env``: row ``t`` of every env, then row ``t + 1``. Rows
    with ``mask`` False (the reset rows of NEXT_STEP envs, which are no transition) are left out.

    :meth:`state_dict` and :meth:`load_state_dict` save and restore the rows held and the write
    position with a run's checkpoint (``torch.save``, and ``torch.load`` with its default
    ``weights_only=True``).

    Example::

        ring = ReplayRing(100_000)
        for written in ring.fill(collector):  # each batch's rows into the ring
            minibatch = ring.sample(256)      # a TensorDict [256] of the keys
    """

    def __init__(self, capacity: int, keys: Iterable[str] = DEFAULT_KEYS, *, device: torch.device | str = "cpu"):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"ReplayRing: capacity must be a positive int, got {capacity!r}")
        if isinstance(keys, str):
            raise TypeError(
                f"ReplayRing: keys must be a sequence of batch keys, got the string {keys!r}; pass keys=({keys!r},)"
            )
        self.keys = tuple(keys)
        if not self.keys or not all(isinstance(key, str) for key in self.keys):
            raise ValueError(f"ReplayRing: keys must be a non-empty sequence of batch keys (str), got {keys!r}")
        self.capacity = capacity
        self.device = resolve_device(device, who="ReplayRing")
        self.storage: TensorDict | None = None  # [capacity], allocated at the first write
        self._kept: dict[str, Any] = {}  # the storage's entries by key
        self._arrays: list[Any] | None = None  # NumPy views of the entries (CPU storage of tensors), in key order
        self._plain = False  # every entry a tensor (no nested observation)
        self.position = 0  # the row the next write starts at
        self.size = 0  # rows held

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"ReplayRing(capacity={self.capacity}, keys={self.keys}, device={str(self.device)!r}, size={self.size})"

    def fill(self, collector: Iterable[TensorDictBase]) -> Iterator[int]:
        """Iterates ``collector``, writes each batch's real rows into the ring and yields how many it wrote.

        The batch itself is let go of at once: the collector's rows are free to be written again, and
        the trainer holds nothing but the ring. From a :class:`~torch_rollout.Collector` with ``gae=None``
        that collects in the calling thread (``prefetch=0``, no ``timeout``), in worker processes or on Ray,
        the ring copies the rows straight from the collection loop's arrays (a torch env's tensors, where
        they are stored on the CPU), the workers' slots or the actors' arrays, with no batch made, wherever
        they fit its storage as they are.
        """
        if not isinstance(collector, Collector):
            for batch in collector:
                written = self._write(batch, every_row=_no_reset_rows(collector, batch))
                del batch
                yield written
            return
        iter(collector)  # what a for loop does first: refuses a finished collector, starts collection
        while True:
            try:
                got: TensorDictBase | int = collector.__next__(self._take)
            except StopIteration:
                return
            if type(got) is not int:  # a batch made whole: the rows could not be taken as they were
                got = self._write(got, every_row=_no_reset_rows(collector, got))
            yield got

    def _take(self, rows: HostBatch) -> int | None:
        """Copies the kept keys of a batch's rows on the host into the storage, where they fit it as they are.

        Returns the rows written, or None for a batch to be written whole (:meth:`_write`): the first one,
        one with reset rows, one that would wrap around the ring's end, a key the rows do not have or that
        the storage does not hold in the same dtype and shape (where :meth:`_write` explains a mismatch).
        """
        n = rows.num_steps * rows.num_envs
        start = self.position
        stop = start + n
        if self._arrays is None or stop > self.capacity or not rows.every_row:
            return None
        plan = rows.plan  # kept with the rows (the collector's), which live as long as their sources
        if plan is None or plan[0] is not self._arrays:
            plan = rows.plan = (self._arrays, self._plan_for(rows))
        if plan[1] is None:
            return None
        T, N = rows.num_steps, rows.num_envs
        for source, array, write, envs in plan[1]:
            if write is not None:  # the next observations or done, written into the ring's rows
                write(array[start:stop].reshape(source.shape))
            elif envs is None:  # every env's rows: one flat copy
                array[start:stop] = source
            else:  # a worker's block of envs: its columns of the rows t * N + env
                array[start:stop].reshape(T, N, *array.shape[1:])[:, envs] = source
        self.position = stop % self.capacity
        self.size = min(self.size + n, self.capacity)
        return n

    def _plan_for(self, rows: HostBatch) -> list[tuple[Any, Any, Any, Any]] | None:
        """``(source, storage array, writer or None, envs or None)`` per kept key and part of the rows, in key
        order; None where one does not fit.

        The sources are views of the loop's rows or of the workers' slots (flat ``[T * N, ...]`` where one part
        holds every env), so the plan holds for each later batch offered in the same rows.
        """
        assert self._arrays is not None  # the storage is made
        plan: list[tuple[Any, Any, Any, Any]] = []
        whole, n = len(rows.parts) == 1, rows.num_steps * rows.num_envs
        for key, array in zip(self.keys, self._arrays):
            for first, given in rows.parts:
                source, write = given.get(key), None
                if source is None and whole and key == rows.next_obs_key and rows.obs_key is not None:
                    source, write = given[rows.obs_key], rows.write_next_obs  # the loop's rows: written here
                elif source is None and whole and key == "done":
                    source, write = given["terminated"], rows.write_done
                if source is None or source.dtype != array.dtype or source.shape[2:] != array.shape[1:]:
                    return None
                if not source.flags.c_contiguous:  # its flat rows would be a copy, not a view
                    return None
                if write is not None:
                    plan.append((source, array, write, None))
                elif whole:
                    plan.append((source.reshape(n, *source.shape[2:]), array, None, None))
                else:
                    plan.append((source, array, None, slice(first, first + source.shape[1])))
        return plan

    def write(self, batch: TensorDictBase) -> int:
        """Writes the real rows (``mask`` True) of a ``[num_steps, num_envs]`` batch; returns how many."""
        return self._write(batch, every_row=False)

    def _write(self, batch: TensorDictBase, every_row: bool) -> int:
        rows, dims = batch.batch_size.numel(), batch.batch_dims
        if rows > self.capacity:
            raise ValueError(
                f"ReplayRing: capacity={self.capacity} is smaller than one batch's {rows} rows; "
                "give it at least num_steps * num_envs rows"
            )
        values = [batch.get(key, None) for key in self.keys]
        mask = None if every_row else batch.get("mask", None)
        every_row = mask is None or bool(mask.all())
        if every_row and self._fits(values, rows, dims):  # the usual write: no reset row, no wrap, no new dtype
            start = self.position
            stop = start + rows
            if self._arrays is not None and all(value.is_cpu and not value.requires_grad for value in values):
                # Through NumPy on the host: a third of the cost of torch's views at a short batch's few rows.
                for value, array in zip(values, self._arrays):
                    source = value.numpy()
                    array[start:stop] = source.reshape(rows, *source.shape[dims:])
            else:
                with torch.no_grad():  # the rows' values, not their graph: the storage stays a leaf
                    for value, kept in zip(values, self._kept.values()):
                        copy_into(kept[start:stop].view(value.shape), value)
            self.position = stop % self.capacity
            self.size = min(self.size + rows, self.capacity)
            return rows
        # [rows, ...] in the order t * num_envs + env: views of the batch's entries
        leaves = {}
        for key, value in zip(self.keys, values):
            if value is None:
                self._missing(batch, key)
            leaves[key] = _flat(value, rows, dims)
        if not every_row:
            assert mask is not None  # every_row is False only where a mask said so
            index = mask.reshape(-1).nonzero().squeeze(1)
            return self._put({key: value[index] for key, value in leaves.items()}, len(index))
        return self._put(leaves, rows)

    def _fits(self, values: list[Any], rows: int, dims: int) -> bool:
        """Whether ``values`` (a batch's entries of the keys) go into the storage as they are, in one piece:
        tensors of the storage's dtypes and row shapes, ``rows`` of them before the ring's end."""
        if self.storage is None or self.position + rows > self.capacity:
            return False
        for value, kept in zip(values, self._kept.values()):
            if type(value) is not Tensor or value.dtype is not kept.dtype or value.shape[dims:] != kept.shape[1:]:
                return False
        return True

    def _missing(self, batch: TensorDictBase, key: str) -> NoReturn:
        fix = (
            " (pass keys=BatchKeys(next_obs=True) to the Collector)"
            if key.startswith("next_") and "next_obs" not in batch.keys()
            else ""
        )
        raise KeyError(
            f"ReplayRing: the batch has no key {key!r}{fix}; its keys are {sorted(map(str, batch.keys()))}, "
            f"the ring keeps {list(self.keys)}"
        )

    @torch.no_grad()  # the rows' values, not their graph: the storage stays a leaf
    def _put(self, leaves: dict[str, Any], n: int) -> int:
        if self.storage is None:
            self._keep(self._allocate(leaves))
        start, capacity = self.position, self.capacity
        stop = start + n
        kept_of = self._kept
        for key, value in leaves.items():  # every key checked before any is written
            kept = kept_of[key]
            if isinstance(kept, TensorDictBase):
                for name, leaf in kept.items(include_nested=True, leaves_only=True):
                    _check_rows((key, *name) if isinstance(name, tuple) else (key, name), value.get(name), leaf)
            elif value.dtype is not kept.dtype or value.shape[1:] != kept.shape[1:]:
                _check_rows((key,), value, kept)
        for key, value in leaves.items():
            kept = kept_of[key]
            if stop <= capacity:
                copy_into(kept[start:stop], value)  # queued on the GPU, complete on the host
            else:  # around the ring's end
                first = capacity - start
                copy_into(kept[start:], value[:first])
                copy_into(kept[: n - first], value[first:])
        self.position = stop % capacity
        self.size = min(self.size + n, capacity)
        return n

    def _keep(self, storage: TensorDict) -> None:
        """Takes ``storage`` as the ring's, with its entries by key and, on the CPU, NumPy views of them."""
        self.storage = storage
        self._kept = {key: storage.get(key) for key in self.keys}
        self._arrays = None
        kept = list(self._kept.values())
        self._plain = all(type(value) is Tensor for value in kept)
        if self.device.type == "cpu" and self._plain:
            try:
                self._arrays = [value.numpy() for value in kept]
            except TypeError:  # a dtype NumPy has not (bfloat16): written with torch
                self._arrays = None

    def _allocate(self, leaves: dict[str, Any]) -> TensorDict:
        entries: dict[str, Any] = {}
        for key, value in leaves.items():
            if isinstance(value, TensorDictBase):
                entries[key] = value[:1].to(self.device).expand(self.capacity).clone()
            else:
                entries[key] = torch.zeros((self.capacity, *value.shape[1:]), dtype=value.dtype, device=self.device)
        return TensorDict(entries, batch_size=[self.capacity], device=self.device)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> TensorDict:
        """``batch_size`` rows drawn uniformly (with replacement) from those held, as a TensorDict."""
        try:
            rows = operator.index(batch_size)  # an int, or an integer that says it is one (NumPy's)
        except TypeError:
            rows = 0
        if isinstance(batch_size, bool) or rows < 1:
            raise ValueError(
                f"ReplayRing.sample: batch_size must be a positive int (the rows to draw), got "
                f"{type(batch_size).__name__} {batch_size!r}"
            )
        if self.storage is None or self.size == 0:
            raise RuntimeError("ReplayRing.sample: the ring is empty; fill it from a collector first")
        index = torch.randint(self.size, (rows,), device=self.device, generator=generator)
        if self._plain:  # every key a tensor: indexed one by one, half the cost of indexing the TensorDict
            picked = {key: kept[index] for key, kept in self._kept.items()}
            return new_tensordict(picked, batch_size=torch.Size([rows]), device=self.device)
        return self.storage[index]

    def rows(self) -> TensorDict:
        """A copy of the rows held, oldest first: later writes into the ring do not change it."""
        if self.storage is None:
            raise RuntimeError("ReplayRing.rows: the ring is empty; fill it from a collector first")
        if self.size < self.capacity:
            return self.storage[: self.size].clone()
        return torch.cat([self.storage[self.position :], self.storage[: self.position]])

    def state_dict(self) -> dict[str, Any]:
        """The rows held and the write position, as tensors, ints and strings (``torch.load`` with
        ``weights_only=True`` reads it back).

        A ring that has not wrapped around yet gives a copy of the rows it holds, one that has gives
        its storage itself (no copy): save it before writing to the ring again.
        """
        rows: dict[str, Any] | None = None
        if self.storage is not None:
            # torch.save writes a view's whole storage: only the rows held are copied out
            held = self.storage if self.size == self.capacity else self.storage[: self.size].clone()
            rows = held.to_dict()
        return {
            "capacity": self.capacity,
            "keys": list(self.keys),
            "position": self.position,
            "size": self.size,
            "rows": rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the rows and the write position of :meth:`state_dict`, onto this ring's device.

        The ring must have the state's ``capacity`` and ``keys``; its own rows are replaced.
        """
        missing = {"capacity", "keys", "position", "size", "rows"} - set(state)
        if missing:
            raise ValueError(
                f"ReplayRing.load_state_dict: the state lacks {sorted(missing)}; pass what ReplayRing.state_dict() "
                "returned"
            )
        if state["capacity"] != self.capacity or tuple(state["keys"]) != self.keys:
            raise ValueError(
                f"ReplayRing.load_state_dict: the state is of a ring with capacity={state['capacity']} and keys="
                f"{tuple(state['keys'])}, this one has capacity={self.capacity} and keys={self.keys}; make the ring "
                "as the saved one was"
            )
        size, rows = state["size"], state["rows"]
        if rows is None:
            self.storage, self.position, self.size, self._kept, self._arrays = None, 0, 0, {}, None
            return
        held = TensorDict(rows, batch_size=[size]).to(self.device)
        if size == self.capacity:
            storage = held
        else:
            storage = self._allocate({key: held.get(key) for key in self.keys})
            storage[:size] = held
        self._keep(storage)
        self.position, self.size = state["position"], size


def _no_reset_rows(collector: Any, batch: TensorDictBase) -> bool:
    """Whether every row of ``batch`` is a transition, known without reading its mask back from the GPU.

    Envs in SAME_STEP and DISABLED modes make no reset rows; on the CPU the mask itself is read (it costs less
    than a lookup of the mode in a worker's report).
    """
    device = batch.device
    if device is None or device.type == "cpu":
        return False
    return getattr(collector, "autoreset_mode", AutoresetMode.NEXT_STEP) != AutoresetMode.NEXT_STEP


def _check_rows(key: tuple[str, ...], value: Any, kept: torch.Tensor) -> None:
    """Refuses rows of ``value`` that ``kept`` (the ring's storage of ``key``) cannot hold as they are."""
    name = key[0] if len(key) == 1 else key
    if value.shape[1:] != kept.shape[1:]:
        raise ValueError(
            f"ReplayRing: batch key {name!r} has rows of shape {tuple(value.shape[1:])}, the ring's "
            f"{tuple(kept.shape[1:])} (set by its first batch); a ring keeps one shape"
        )
    if value.dtype != kept.dtype and torch.promote_types(value.dtype, kept.dtype) != kept.dtype:
        raise ValueError(
            f"ReplayRing: batch key {name!r} is {value.dtype}, which the ring's {kept.dtype} storage (set by its "
            f"first batch) would not hold without loss; give every batch the first one's dtype (e.g. cast it in "
            f"the env or the policy), or start a new ring"
        )


def _flat(value: Any, rows: int, dims: int) -> Any:
    return value.reshape(rows) if isinstance(value, TensorDictBase) else value.reshape(rows, *value.shape[dims:])
