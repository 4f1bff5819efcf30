"""A recurrent policy's state in the collection loop: what each env's next row acts with, across episode ends."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDictBase
from torch import Tensor

from torch_rollout.envs._seam import StepRecord
from torch_rollout.util._devices import to_device

__all__ = ["RecurrentState"]


class RecurrentState:
    """The state of ``initial``'s envs: the one each env's next row acts with, and the one after its last row.

    ``state`` goes into each env's next row; ``carried`` is the policy's state after
    each env's last row (before any reset), which the final observation of an
    episode that ended is valued with; ``is_init`` marks the envs whose next row
    starts an episode (their ``state`` is ``initial``'s rows). ``is_init`` is a NumPy
    array for the host drivers, a tensor on ``device`` for the torch one.

    Args:
        initial: the initial state of this loop's envs, ``[num_envs, ...]`` on ``device``.
        device: where the policy runs.
        on_device: whether step records are torch tensors (the torch driver).
    """

    state: TensorDictBase
    carried: TensorDictBase
    is_init: np.ndarray | Tensor

    def __init__(self, initial: TensorDictBase, *, device: torch.device, on_device: bool) -> None:
        self.initial = initial
        self.device = device
        self.on_device = on_device
        self.keys = list(initial.keys(include_nested=True, leaves_only=True))

    def row_bytes(self) -> int:
        """Bytes of one env's state."""
        return sum(t[0].nbytes for _, t in self.initial.items(include_nested=True, leaves_only=True))

    def reset(self) -> None:
        """Every env starts an episode: its next row acts with the initial state."""
        N = self.initial.batch_size[0]
        self.state = self.initial.clone()
        self.carried = self.initial.clone()
        if self.on_device:
            self.is_init = torch.ones(N, dtype=torch.bool, device=self.device)
        else:
            self.is_init = np.ones(N, dtype=bool)

    def of(self, ids: np.ndarray | None, index: Tensor | None = None) -> tuple[TensorDictBase, np.ndarray | Tensor]:
        """``(state, is_init)`` of the next rows of the envs ``ids`` (None: all); ``index``: ``ids`` on the device."""
        if ids is None:
            return self.state, self.is_init
        return self.state[index], self.is_init[ids]

    def carry(self, next_state: TensorDictBase, index: Tensor | None) -> None:
        """Keeps the policy's next state of the envs ``index`` (on the device; None: all) after their last row."""
        if index is None:
            self.carried = next_state
        else:
            self.carried[index] = next_state

    def is_init_tensor(self, is_init: np.ndarray | Tensor) -> Tensor:
        """``is_init`` as the policy gets it: a bool tensor on its device."""
        if isinstance(is_init, np.ndarray):
            return torch.from_numpy(is_init).to(self.device)
        return to_device(is_init, self.device)

    def advance(self, record: StepRecord) -> None:
        """The state of the envs' next rows: the carried one, or the initial one where an episode starts."""
        ids = record.ids
        assert record.is_init is not None  # set on every record with results
        if ids is None:
            self.state = self._reset_rows(self.carried, record.is_init, self.initial)
            self.is_init = record.is_init
            return
        if record.stepped is not None:
            ids, is_init = ids[record.stepped], record.is_init[record.stepped]
        else:
            is_init = record.is_init
        index = torch.from_numpy(ids).to(self.device)
        self.state[index] = self._reset_rows(self.carried[index], is_init, self.initial[index])
        self.is_init[ids] = is_init

    def _reset_rows(
        self, carried: TensorDictBase, is_init: np.ndarray | Tensor, initial: TensorDictBase
    ) -> TensorDictBase:
        """``carried``, with the rows of ``initial`` for the envs that start an episode (dense on the device)."""
        if isinstance(is_init, np.ndarray):
            if not is_init.any():
                return carried
            is_init = torch.from_numpy(is_init)
        rows = to_device(is_init, self.device)

        def reset(first: Tensor, now: Tensor) -> Tensor:
            return torch.where(rows.view(-1, *(1,) * (now.dim() - 1)), first, now)

        return initial.apply(reset, carried)
