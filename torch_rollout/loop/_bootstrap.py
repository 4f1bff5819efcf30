"""A batch's bootstraps: each row's next observation and ``next_value``, from the next row, the batch after it or
the episode's final observation."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torch_rollout.envs._spaces import Obs, where_rows
from torch_rollout.loop._acting import Acting

__all__ = ["DENSE_FINALS_STEPS", "write_next", "write_next_values"]

# Batches of at most this many steps value final observations densely, every env's row at every step, in
# num_steps calls of num_envs rows: no host sync, where gathering the ended rows first reads their count back.
DENSE_FINALS_STEPS = 4

# A gathered batch's final observations (rows, envs, observations, states) and a dense one's (mask, observations,
# states), as the rows give them
Finals = tuple[Tensor, Tensor, Obs, Any] | None
Dense = tuple[Tensor, Obs, Any] | None


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
        rows[_on(ts, device), _on(envs, device)] = _on(obs, device)
    elif dense is not None:
        mask, obs, _ = dense
        _where_into(rows, _on(mask, device), _on(obs, device))
    if own is not None:
        _where_into(rows, _on(own, device), of)


def _where_into(rows: Obs, mask: Tensor, value: Obs) -> None:
    """``rows`` takes ``value`` where ``mask`` is True: a tensor in place (no new tensor and copy), a
    TensorDict leaf by leaf."""
    if isinstance(rows, Tensor):
        torch.where(mask.view(*mask.shape, *(1,) * (rows.dim() - mask.dim())), value, rows, out=rows)
    else:
        rows.copy_(where_rows(mask, value, rows))


def _on(value: Any, device: Any) -> Any:
    """``value`` on ``device`` (a no-op ``.to()`` costs more than the comparison, at every short batch)."""
    return value if value.device == device else value.to(device)


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
