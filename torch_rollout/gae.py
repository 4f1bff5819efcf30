"""Generalized advantage estimation with torch ops, as a log-depth parallel scan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["GAE", "compute_gae"]


@dataclass(frozen=True)
class GAE:
    """The advantages a Collector adds to each batch: GAE(``gamma``, ``gae_lambda``), see :func:`compute_gae`.

    Args:
        gamma: discount factor, in [0, 1].
        gae_lambda: GAE's bias/variance trade-off, in [0, 1] (1: Monte-Carlo returns, 0: one-step TD).

    Examples:
        >>> GAE(gamma=0.999)
        GAE(gamma=0.999, gae_lambda=0.95)
    """

    gamma: float = 0.99
    gae_lambda: float = 0.95

    def __post_init__(self) -> None:
        for name in ("gamma", "gae_lambda"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0:
                raise ValueError(f"GAE: {name} must be a float in [0, 1], got {x!r}")
            object.__setattr__(self, name, float(x))


def compute_gae(
    reward: Tensor,
    value: Tensor,
    next_value: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    *,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """Computes GAE advantages and returns for time-first transitions.

    For each step ``t`` of ``T``::

        delta_t = reward_t + gamma * (1 - terminated_t) * next_value_t - value_t
        A_t     = delta_t + gamma * gae_lambda * (1 - done_t) * A_{t+1},   A_T = 0
        return_t = A_t + value_t

    with ``done = terminated | truncated``. ``next_value_t`` is the value of the
    true next state of step ``t`` (at a truncation: of the final observation), so
    a truncated step bootstraps while a terminated one does not, and neither
    lets the next episode's advantage leak back.

    The backward recurrence ``A_t = delta_t + c_t * A_{t+1}`` is a composition
    of affine maps, evaluated by a Hillis-Steele scan in ``ceil(log2(T))``
    rounds of whole-tensor ops instead of ``T`` Python iterations. float16 and
    bfloat16 inputs are computed in float32 and cast back.

    Args:
        reward: ``[T, ...]`` rewards.
        value: ``[T, ...]`` values of the observations the actions were chosen from.
        next_value: ``[T, ...]`` values of the true next states.
        terminated: ``[T, ...]`` bool (or 0/1) episode terminations.
        truncated: ``[T, ...]`` bool (or 0/1) episode truncations.
        gamma: discount factor in ``[0, 1]``.
        gae_lambda: GAE lambda in ``[0, 1]``.

    Returns:
        ``(advantage, return_)``, both shaped like ``value`` with its dtype and device.

    Raises:
        ValueError: if shapes differ, ``T`` is 0, or ``gamma``/``gae_lambda`` lie outside ``[0, 1]``.
        TypeError: if ``value`` is not a floating-point tensor.

    Examples:
        >>> import torch
        >>> reward = torch.tensor([1.0, 1.0, 1.0])
        >>> value = torch.zeros(3)
        >>> next_value = torch.tensor([0.0, 0.0, 10.0])
        >>> terminated = torch.tensor([False, True, False])
        >>> truncated = torch.zeros(3, dtype=torch.bool)
        >>> advantage, return_ = compute_gae(
        ...     reward, value, next_value, terminated, truncated, gamma=0.5, gae_lambda=1.0
        ... )
        >>> advantage
        tensor([1.5000, 1.0000, 6.0000])
    """
    _check_inputs(reward, value, next_value, terminated, truncated, gamma, gae_lambda)

    out_dtype = value.dtype
    dtype = torch.float32 if value.element_size() < 4 else value.dtype
    reward, value_, next_value = (x.to(dtype) for x in (reward, value, next_value))
    terminated = terminated.bool()
    done = terminated | truncated.bool()

    not_terminated = (~terminated).to(dtype)
    delta = reward + gamma * not_terminated * next_value - value_
    # A_t = d_t + c_t * A_{t+1}: after the round with offset k, (c_t, d_t) is the
    # composition of steps t..t+2k-1; compositions that run past T use A_T = 0.
    coef = (gamma * gae_lambda) * (~done).to(dtype)
    advantage = delta
    T = value.shape[0]
    k = 1
    while k < T:
        nxt = advantage.clone()
        nxt[:-k].addcmul_(coef[:-k], advantage[k:])
        advantage = nxt
        if 2 * k < T:
            nxt_coef = torch.zeros_like(coef)
            torch.mul(coef[:-k], coef[k:], out=nxt_coef[:-k])
            coef = nxt_coef
        k *= 2
    return_ = advantage + value_
    return advantage.to(out_dtype), return_.to(out_dtype)


def _check_inputs(
    reward: Tensor,
    value: Tensor,
    next_value: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    gae_lambda: float,
) -> None:
    """Refuses inputs that are not same-shaped time-first tensors, or a discount outside [0, 1]."""
    tensors = {
        "reward": reward,
        "value": value,
        "next_value": next_value,
        "terminated": terminated,
        "truncated": truncated,
    }
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"compute_gae: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != value.shape:
            raise ValueError(
                f"compute_gae: {name} has shape {tuple(tensor.shape)}, expected the shape of value "
                f"{tuple(value.shape)} (time-first [T, ...])"
            )
    if value.dim() == 0 or value.shape[0] == 0:
        raise ValueError(
            f"compute_gae: expected time-first tensors [T, ...] with T >= 1, got shape {tuple(value.shape)}"
        )
    if not value.is_floating_point():
        raise TypeError(f"compute_gae: value must be a floating-point tensor, got dtype {value.dtype}")
    for name, x in (("gamma", gamma), ("gae_lambda", gae_lambda)):
        if not 0.0 <= float(x) <= 1.0:
            raise ValueError(f"compute_gae: {name} must lie in [0, 1], got {x}")


def add_advantages(batch: TensorDict, gae: GAE | None) -> TensorDict:
    """Adds GAE ``advantage`` and ``return`` with ``gae`` and when the batch has values (in place)."""
    if gae is None or "next_value" not in batch.keys():
        return batch
    value = batch["value" if "value" in batch.keys() else "state_value"]
    advantage, return_ = compute_gae(
        batch["reward"],
        value,
        batch["next_value"],
        batch["terminated"],
        batch["truncated"],
        gamma=gae.gamma,
        gae_lambda=gae.gae_lambda,
    )
    # Reset rows of NEXT_STEP carry no transition: zero advantage, excluded by mask.
    mask = batch["mask"]
    batch["advantage"] = torch.where(mask, advantage, 0.0)
    batch["return"] = torch.where(mask, return_, value)
    return batch
