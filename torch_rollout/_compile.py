"""Compiled acting policies: the policy's calls through ``torch.compile``, every one at ``[num_envs, ...]``."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor, nn
from torch._dynamo.exc import TorchDynamoException

from torch_rollout._loop import PolicyCall, call_policy

__all__ = ["CompiledPolicy", "acting_call", "check_compile_policy"]

# torch.compile modes that record CUDA graphs on a CUDA device (their outputs live in the graphs' memory).
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_policy(compile_policy: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments that ``compile_policy`` asks for, or None to act eagerly.

    Raises:
        TypeError: for a value that is neither a bool nor a Mapping.
        ValueError: for keyword arguments that ``torch.compile`` refuses (an
            unknown name or backend, ``mode`` together with ``options``).
    """
    if compile_policy is False or compile_policy is None:
        return None
    if compile_policy is True:
        return {}
    if not isinstance(compile_policy, Mapping) or not all(isinstance(key, str) for key in compile_policy):
        raise TypeError(
            "Collector: compile_policy must be a bool or a dict of torch.compile keyword arguments (e.g. "
            f"{{'mode': 'reduce-overhead'}}), got {type(compile_policy).__name__} {compile_policy!r}"
        )
    options = dict(compile_policy)
    if "model" in options:
        raise ValueError("Collector: compile_policy must not hold 'model': the collector compiles its acting policy")
    try:
        torch.compile(_identity, **options)  # checks the names and the backend; nothing is compiled before a call
    except Exception as exc:
        raise ValueError(
            f"Collector: compile_policy={options!r} are not valid torch.compile keyword arguments ({exc}); pass "
            "names of torch.compile (fullgraph, dynamic, backend, mode, options, disable), or compile_policy=False"
        ) from exc
    return options


def _identity(x: Any) -> Any:
    return x


def acting_call(
    policy: nn.Module, compile_options: dict[str, Any] | None, *, num_envs: int, obs_key: str, owned: bool
) -> Callable[[PolicyCall], Any]:
    """The placement's policy call: :func:`call_policy` on ``policy``, compiled when ``compile_options`` is a dict.

    ``owned``: ``policy`` is the collector's acting copy (see :func:`call_policy`).
    """
    if compile_options is None:
        return functools.partial(call_policy, policy, obs_key=obs_key, owned=owned)
    return CompiledPolicy(policy, compile_options, num_envs=num_envs, obs_key=obs_key, owned=owned)


class CompiledPolicy:
    """Makes :func:`call_policy`'s calls through ``torch.compile``, each one with ``num_envs`` rows.

    The forward (``policy(...)``, hooks included) and ``policy.get_value`` are
    compiled separately, lazily at their first call, on the thread or in the
    process that makes it. ``policy`` itself is left as it is: its parameters
    and buffers are inputs of the compiled graphs, read at every call, so a
    weight refresh copied into them in place (or a parameter the trainer
    replaced) is what the next call computes with, and the placement's weights
    lock still keeps every call on one version.

    Bootstrap calls on fewer envs (final observations of the envs that ended,
    ``n`` of ``1..num_envs``) are padded to ``num_envs`` rows by repeating their
    last row, and the outputs cut back to ``n``: one graph per function and no
    recompilation per size, and static shapes for CUDA graphs. Rows must not
    depend on one another (they do not in any per-env policy).

    With a CUDA-graph mode (``"reduce-overhead"``, ``"max-autotune"``) the
    outputs are cloned, since the graphs' next replay overwrites their memory.
    """

    def __init__(self, policy: nn.Module, options: dict[str, Any], *, num_envs: int, obs_key: str, owned: bool) -> None:
        self.policy = policy
        self.owned = owned
        self.options = options
        self.num_envs = num_envs
        self.obs_key = obs_key
        get_value = getattr(policy, "get_value", None)
        self.functions = (_compile(policy, options), None if get_value is None else _compile(get_value, options))
        inductor = options.get("options") or {}
        self.cudagraphs = options.get("mode") in _CUDAGRAPH_MODES or bool(inductor.get("triton.cudagraphs"))

    def __call__(self, call: PolicyCall) -> Any:
        n = call.obs.shape[0]
        if n < self.num_envs:
            # [num_envs]: rows 0..n-1, then row n-1 again
            rows = torch.arange(self.num_envs, device=_device(call.obs)).clamp_(max=n - 1)
            call = PolicyCall(
                call.obs[rows],
                None if call.state is None else call.state[rows],
                None if call.is_init is None else call.is_init[rows],
                call.value_only,
            )
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        try:
            raw = call_policy(self.policy, call, self.obs_key, functions=self.functions, owned=self.owned)
        except TorchDynamoException as exc:
            which = "get_value" if call.value_only and self.functions[1] is not None else "forward"
            raise RuntimeError(
                f"Collector(compile_policy={self.options!r}): torch.compile failed on the policy's {which}: "
                f"{_cause(exc)}; fix the cause, or pass compile_policy=False to act without compiling"
            ) from exc
        if n < self.num_envs or self.cudagraphs:
            raw = _first_rows(raw, n, clone=self.cudagraphs)
        return raw


def _compile(function: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    with warnings.catch_warnings():
        # torch.compile's first use imports torch.jit modules that warn of their own deprecation (torch's, not ours).
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
        return torch.compile(function, **options)


def _cause(exc: BaseException) -> str:
    """The failure inside a torch.compile error, in one line: a backend's (Inductor's) own exception if any."""
    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, BaseException):
        exc = inner
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _device(obs: Tensor | TensorDictBase) -> torch.device:
    if isinstance(obs, Tensor):
        return obs.device
    return next(iter(obs.values(include_nested=True, leaves_only=True))).device


def _first_rows(raw: Any, n: int, *, clone: bool) -> Any:
    """``raw``'s tensors (in Mappings and TensorDicts too) cut to their first ``n`` rows, cloned if asked."""
    if isinstance(raw, (Tensor, TensorDictBase)):
        rows = raw[:n] if len(raw.shape) and raw.shape[0] > n else raw
        return rows.clone() if clone else rows
    if isinstance(raw, Mapping):
        return {key: _first_rows(value, n, clone=clone) for key, value in raw.items()}
    return raw  # not the policy's contract: the loop names the problem
