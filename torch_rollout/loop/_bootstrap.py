"""A batch's bootstraps: each row's next observation and ``next_value``, from the next row, the batch after it or
the episode's final observation."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torch_rollout.envs._spaces import Obs, where_rows
from torch_rollout.loop._acting import Acting
from torch_rollout.util._devices import to_device

__all__ = ["batch_finals", "write_next", "write_next_values"]

# Batches of at most this many steps value final observations densely, every env's row at every step, in
# num_steps calls of num_envs rows: no host sync, where gathering the ended rows first reads their count back.
DENSE_FINALS_STEPS = 4

# A gathered batch's final observations (rows, envs, observations, states) and a dense one's (mask, observations,
# states), as the rows give them
Finals = tuple[Tensor, Tensor, Obs, Any] | None
Dense = tuple[Tensor, Obs, Any] | None


def batch_finals(head: Any, on_device: bool, device: Any) -> tuple[Finals, Dense]:
    """``(finals, dense)`` of the complete rows ``head``, one of them None: dense for a short batch of a driver on
    the device (``head`` then a ``DeviceRows``), else gathered onto ``device``."""
    if on_device and head.T <= DENSE_FINALS_STEPS:
        return None, head.dense_finals()  # no host sync: a short batch on the device (off-policy learners' T=1)
    return head.gather_finals(device), None


def write_next(rows: Obs, of: Obs, last: Obs, finals: Finals, dense: Dense, own: Tensor | None = None) -> None:
    """Writes each row's next entry: the next row's ``of``, ``last`` after the last row; a final one where given.

    ``own``: the rows whose episode ended on their own observation (an approximated bootstrap), which take
    ``of`` itself.
    """
    device = rows.device
    if len(rows) > 1:
        rows[:-1].copy_(of[1:])
    rows[-1].copy_(last)  # from its device (an upload or a readback blocks, as .to() would)
    if finals is not None:  # SAME_STEP and DISABLED: the next row starts after a reset
        ts, envs, obs, _ = finals
        rows[to_device(ts, device), to_device(envs, device)] = to_device(obs, device)
    elif dense is not None:
        mask, obs, _ = dense
        _where_into(rows, to_device(mask, device), to_device(obs, device))
    if own is not None:
        _where_into(rows, to_device(own, device), of)


def _where_into(rows: Obs, mask: Tensor, value: Obs) -> None:
    """``rows`` takes ``value`` where ``mask`` is True: a tensor in place (no new tensor and copy), a
    TensorDict leaf by leaf."""
    if isinstance(rows, Tensor):
        torch.where(mask.view(*mask.shape, *(1,) * (rows.dim() - mask.dim())), value, rows, out=rows)
    else:
        rows.copy_(where_rows(mask, value, rows))


def write_next_values(
    acting: Acting,
    next_value: Tensor,
    value: Tensor,
    last: Tensor,
    finals: Finals,
    dense: Dense,
    own: Tensor | None,
    num_envs: int,
) -> None:
    """``next_value``: the next row's value, ``last`` after the last row, and a value call on each final observation
    (not on the reset one after it); ``own`` rows bootstrap from their own value."""
    write_next(next_value, value, last, None, None)
    if finals is not None:
        acting.write_final_values(next_value, finals, num_envs)
    elif dense is not None:
        acting.write_dense_final_values(next_value, dense)
    if own is not None:
        next_value.copy_(where_rows(own.to(next_value.device), value, next_value))
