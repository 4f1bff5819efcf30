"""The acting side of the collection loop: calling the policy, checking what it returns, bootstrap values.

The loop hands a :class:`PolicyCall` to :class:`Acting`, which makes it through
the placement's forward (the placement holds the weights lock and knows the
version), takes a recurrent policy's next state out of the outputs, and checks
the outputs against the layout that the first call set (:class:`OutputLayout`):
every later call must return the same keys, each a tensor with one row per env
on the policy's device.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import Tensor, nn

from torch_rollout.envs._spaces import Obs
from torch_rollout.loop._spec import BATCH_KEYS

__all__ = ["Acting", "Forward", "OutputLayout", "PolicyCall", "TrainingModes", "call_policy"]

# The keys the collector fills in every batch (besides "action", which the policy returns): no output may take one.
FILLED_KEYS = BATCH_KEYS - {"action"}


@dataclass
class PolicyCall:
    """One call of the policy that the loop asks its placement to make (see :func:`call_policy`).

    ``state`` and ``is_init`` are set in recurrent mode only. ``value_only``
    marks a bootstrap: only the value is wanted, and ``policy.get_value`` is
    called instead of the forward when the policy has one.
    """

    obs: Obs
    state: TensorDictBase | None = None
    is_init: Tensor | None = None
    value_only: bool = False


# The placement's policy call: a PolicyCall on the policy's device -> (raw outputs, weights version).
Forward = Callable[[PolicyCall], "tuple[Any, int]"]


def call_policy(
    policy: nn.Module,
    call: PolicyCall,
    obs_key: str = "obs",
    functions: tuple[Callable[..., Any], Callable[..., Any] | None] | None = None,
    *,
    owned: bool = False,
    modes: TrainingModes | None = None,
) -> Any:
    """Makes ``call`` on ``policy`` in eval mode, and puts back the modes its modules had.

    The forward is ``policy(obs)``, or ``policy(obs, state, is_init)`` in
    recurrent mode; a value-only call uses ``policy.get_value`` with the same
    arguments when it exists. A TensorDictModule gets one TensorDict with
    ``obs_key`` (and in recurrent mode ``"is_init"`` of shape ``[n, 1]`` and the
    state's entries at their own keys), as TorchRL's recurrent modules read it.
    ``functions``: ``(forward, get_value or None)`` called instead of the
    policy's own (its compiled ones, see ``torch_rollout.loop._compile``).
    ``owned`` marks the collector's own acting copy, which is in eval mode from
    its creation on: its modes are then neither read nor switched. ``modes``: the policy's
    :class:`TrainingModes`, which finds its modules without walking its tree on every call.
    """
    # Acting is inference whatever the trainer's module is doing: no dropout, no BatchNorm statistics
    # updated, in every placement (the thread with prefetch=0 acts with the trainer's module itself).
    # The flags are set as nn.Module.train sets them, but without nn.Module.__setattr__, which made the switch
    # and back 4x to 7x dearer (the example's Agent, 2-core machine: 67 us against 18 us at a load of 4).
    # Walking the modules costs ~10 us a call even when none is training, so a copy nobody else
    # touches is left as it is, and the trainer's module is walked again only when its tree changed.
    if owned:
        training = []
    elif modes is not None:
        training = modes.training()
    else:
        training = [module for module in policy.modules() if module.training]
    for module in training:
        object.__setattr__(module, "training", False)
    obs = call.obs
    one = call.state is None and type(obs) is Tensor and not obs.is_inference()  # the usual call: one tensor
    version = obs._version if one else 0
    inputs = [] if one else _inputs(call, obs_key)
    versions = [tensor._version for _, tensor in inputs]
    try:
        result = _call(policy, call, obs_key, functions)
    finally:
        for module in training:
            object.__setattr__(module, "training", True)
    if one:
        if obs._version != version:
            _refuse_written_inputs(policy, [(obs_key, obs)], [version], call.value_only)
    elif any(tensor._version != version for (_, tensor), version in zip(inputs, versions)):
        _refuse_written_inputs(policy, inputs, versions, call.value_only)
    return result


class TrainingModes:
    """The modules of a policy that are in training mode now, for :func:`call_policy` to switch around a call.

    The policy's modules are listed once and listed again only when a module's children changed (a submodule
    added, replaced or deleted): a check of each module's children against the list, a few times cheaper than
    the walk through ``modules()``. What it returns is what ``[m for m in policy.modules() if m.training]``
    returns.
    """

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy
        self.held = False  # inside evaluating(): every module is in eval mode already
        self._list()

    def _list(self) -> None:
        self.modules = list(self.policy.modules())
        self.children = [tuple(module._modules.values()) for module in self.modules]

    def training(self) -> list[nn.Module]:
        if self.held:
            return []
        if [tuple(module._modules.values()) for module in self.modules] != self.children:
            self._list()
        return [module for module in self.modules if module.training]

    def evaluating(self) -> _Evaluating:
        """The policy in eval mode for a whole batch, its modes put back after it: the calls inside switch nothing.

        For a placement that acts with the trainer's module in the trainer's own thread (``prefetch=0``), where
        nothing else runs while the batch is collected.
        """
        return _Evaluating(self)


class _Evaluating:
    """:meth:`TrainingModes.evaluating`'s context (a class: a generator's context costs microseconds a batch)."""

    def __init__(self, modes: TrainingModes) -> None:
        self.modes = modes
        self.training: list[nn.Module] = []

    def __enter__(self) -> None:
        self.training = training = self.modes.training()
        for module in training:
            object.__setattr__(module, "training", False)
        self.modes.held = True

    def __exit__(self, *exc_info: Any) -> None:
        self.modes.held = False
        for module in self.training:
            object.__setattr__(module, "training", True)


def _call(
    policy: nn.Module,
    call: PolicyCall,
    obs_key: str,
    functions: tuple[Callable[..., Any], Callable[..., Any] | None] | None,
) -> Any:
    """The call itself: the forward, ``get_value`` or their compiled forms, with the arguments the policy takes."""
    if functions is None:
        method = getattr(policy, "get_value", None) if call.value_only else None
        function = policy if method is None else method
    else:
        function = functions[1] if call.value_only and functions[1] is not None else functions[0]
    if isinstance(policy, TensorDictModuleBase):
        entries: dict[str, Any] = {obs_key: call.obs}
        if call.state is not None:
            assert call.is_init is not None  # set with every state
            entries["is_init"] = call.is_init.unsqueeze(-1)
        td = TensorDict(entries, batch_size=call.obs.shape[:1], device=call.obs.device)
        if call.state is not None:
            td.update(call.state)
        return function(td)
    if call.state is None:
        return function(call.obs)
    return function(call.obs, call.state, call.is_init)


def _inputs(call: PolicyCall, obs_key: str) -> list[tuple[str, Tensor]]:
    """The tensors a call hands the policy, by their batch keys: they share memory with the batch's rows.

    Inference tensors (an env's own, made under ``torch.inference_mode()``, as Isaac Lab's are) have no version
    counter and are left out: outside inference mode torch itself refuses to write them in place.
    """
    found: list[tuple[str, Tensor]] = []
    parts: list[tuple[str, Any]] = [(obs_key, call.obs)]
    if call.state is not None:
        parts += [("", call.state), ("is_init", call.is_init)]
    for key, value in parts:
        if isinstance(value, Tensor):
            found.append((key, value))
        elif isinstance(value, TensorDictBase):
            for name, leaf in value.items(include_nested=True, leaves_only=True):
                name = ".".join(name) if isinstance(name, tuple) else name
                found.append((f"{key}.{name}" if key else name, leaf))
    return [(key, tensor) for key, tensor in found if not tensor.is_inference()]


def _refuse_written_inputs(
    policy: nn.Module, inputs: list[tuple[str, Tensor]], versions: list[int], value_only: bool
) -> None:
    """The error for a policy that wrote a tensor it was given: the batch stores that very tensor.

    Detected with torch's version counters (one read per input tensor before and after the call), so that
    it is refused the same way on every placement and device, whether or not the input shared memory.
    """
    written = [key for (key, tensor), version in zip(inputs, versions) if tensor._version != version]
    call = "get_value" if value_only and hasattr(policy, "get_value") else "forward"
    raise ValueError(
        f"Collector: the policy's {call} ({type(policy).__name__}) wrote its input {', '.join(map(repr, written))} "
        "in place; the collector keeps those tensors (the batch's rows, the next step's input), so the batch would "
        "hold the changed values: compute new tensors instead, e.g. obs = obs.clamp(-5, 5), not obs.clamp_(-5, 5); "
        "obs = (obs - self.mean) / self.std, not obs -= self.mean; obs = obs / 255, not obs.div_(255)"
    )


@dataclass(frozen=True)
class OutputLayout:
    """The policy's outputs, as its first call returned them: every later call returns the same keys.

    ``value_key`` is ``"value"``, TorchRL's ``"state_value"`` (when the policy
    returns that instead), or None for a policy without values (no bootstraps).
    """

    keys: tuple[str, ...]
    value_key: str | None

    @functools.cached_property
    def key_set(self) -> frozenset[str]:
        return frozenset(self.keys)

    @property
    def has_value(self) -> bool:
        return self.value_key is not None


class Acting:
    """Makes the loop's policy calls through the placement's ``forward`` and checks their outputs.

    Args:
        forward: the placement's policy call, ``PolicyCall -> (raw outputs, weights version)``.
        device: where the policy runs: every output must be there.
        obs_key: the batch key of observations (no output may take it).
        next_obs_key: the batch key of next observations, or None.
        initial_state: a recurrent policy's initial state (rows of this loop's envs), or None.
    """

    layout: OutputLayout | None  # None until the first forward
    in_policy: bool  # inside the policy's call now (for a stuck thread's report)

    def __init__(
        self,
        forward: Forward,
        *,
        device: torch.device,
        obs_key: str,
        next_obs_key: str | None,
        initial_state: TensorDictBase | None,
    ) -> None:
        self.forward = forward
        self.device = device
        self.obs_key = obs_key
        self.next_obs_key = next_obs_key
        self.initial_state = initial_state
        self.state_keys = (
            [] if initial_state is None else list(initial_state.keys(include_nested=True, leaves_only=True))
        )
        self.layout = None
        self.in_policy = False
        self.seconds = 0.0  # in the placement's forward so far: the loop's account of policy time

    @property
    def _value_key(self) -> str:
        return "value" if self.layout is None or self.layout.value_key is None else self.layout.value_key

    def act(self, call: PolicyCall, n: int) -> tuple[dict[str, Tensor], int, TensorDictBase | None]:
        """The checked outputs of the forward on ``n`` rows, the weights' version, and the next state (recurrent)."""
        raw, version = self._call(call)
        next_state = None
        if call.state is not None:
            raw, next_state = self._split_state(raw, n)
        return self.check_outputs(raw, n), version, next_state

    def _call(self, call: PolicyCall) -> tuple[Any, int]:
        self.in_policy = True
        began = perf_counter()
        try:
            return self.forward(call)
        finally:
            self.seconds += perf_counter() - began
            self.in_policy = False

    def value(self, call: PolicyCall, n: int) -> Tensor:
        """The value of a bootstrap call: from ``policy.get_value`` when the policy has one, else its forward."""
        raw, _ = self._call(call)
        if isinstance(raw, (TensorDictBase, Mapping)):
            value = raw.get(self._value_key, None)
            if value is None:
                raise ValueError(
                    f"Collector: a bootstrap call of the policy (or its get_value) returned keys "
                    f"{sorted(map(str, raw.keys()))}, without {self._value_key!r}"
                )
        else:
            value = raw
        if not isinstance(value, Tensor):
            raise TypeError(
                f"Collector: policy.get_value must return a Tensor of shape ({n},), got {type(value).__name__}"
            )
        if value.dim() == 2 and value.shape[1] == 1:
            value = value.squeeze(1)
        if value.shape != (n,) or not value.is_floating_point() or value.device != self.device:
            raise ValueError(
                f"Collector: the bootstrap value has shape {tuple(value.shape)}, dtype {value.dtype} and device "
                f"{value.device}, expected a floating-point tensor of shape ({n},) or ({n}, 1) on {self.device}"
            )
        return value

    def write_final_values(
        self, next_value: Tensor, finals: tuple[Tensor, Tensor, Obs, TensorDictBase | None], width: int
    ) -> None:
        """V(final observation) of every episode that ended into ``next_value``, in calls of at most ``width`` rows.

        ``finals``: the rows ``t``, the envs, their final observations and (recurrent) their states after the
        episode's last step, as the batch's rows gather them.
        """
        ts, envs, obs, states = finals
        for start in range(0, len(ts), width):
            part = slice(start, start + width)
            n = len(ts[part])
            call = _bootstrap_call(obs[part], None if states is None else states[part], n, self.device)
            target = (ts[part].to(next_value.device), envs[part].to(next_value.device))
            next_value[target] = self.value(call, n).to(next_value.device)

    def write_dense_final_values(self, next_value: Tensor, dense: tuple[Tensor, Obs, TensorDictBase | None]) -> None:
        """V(final observation) into ``next_value`` where an episode ended, valuing every row: no host sync.

        ``dense``: the ``[T, N]`` mask of the envs that ended, their final observations and (recurrent) states
        after the episode's last step, ``[T, N, ...]``; one call of ``N`` rows per step.
        """
        mask, obs, states = dense
        T, N = mask.shape
        for t in range(T):
            call = _bootstrap_call(obs[t], None if states is None else states[t], N, self.device)
            value = self.value(call, N).to(next_value.device)
            next_value[t] = torch.where(mask[t].to(next_value.device), value, next_value[t])

    def _split_state(self, raw: Any, n: int) -> tuple[Any, TensorDictBase]:
        """Takes the next state out of a recurrent policy's outputs: ``"next_state"`` or ``("next", key)``."""
        if isinstance(raw, TensorDictBase):
            if "next" in raw.keys() and all(("next", *_as_tuple(key)) in raw.keys(True) for key in self.state_keys):
                next_state = raw.get("next").select(*self.state_keys)
                raw = raw.exclude("next", "is_init", *self.state_keys)
            else:
                next_state = raw.get("next_state", None)
                raw = raw.exclude("next_state", "is_init", *self.state_keys)
        elif isinstance(raw, Mapping):
            raw = dict(raw)
            next_state = raw.pop("next_state", None)
        else:
            return raw, None  # check_outputs names the problem
        if next_state is None:
            raise ValueError(
                f"Collector: with initial_state the policy must return its next state, as 'next_state' (a Mapping "
                f"or TensorDict with the keys {self._state_names()}) or, from a TensorDictModule, at ('next', key); "
                f"it returned keys {sorted(map(str, raw.keys()))}"
            )
        if not isinstance(next_state, TensorDictBase):
            try:
                next_state = TensorDict(dict(next_state), batch_size=[n], device=self.device)
            except Exception as exc:
                raise ValueError(
                    f"Collector: the policy's 'next_state' must be a Mapping of tensors [{n}, ...] with the keys "
                    f"{self._state_names()}, got {type(next_state).__name__} ({exc})"
                ) from None
        keys = set(next_state.keys(include_nested=True, leaves_only=True))
        assert self.initial_state is not None  # a recurrent policy's call
        want = {str(key): (n, *self.initial_state.get(key).shape[1:]) for key in self.state_keys}
        if keys != set(self.state_keys) or any(
            tuple(next_state.get(key).shape) != want[str(key)] for key in self.state_keys
        ):
            got = {str(key): tuple(next_state.get(key).shape) for key in sorted(keys, key=str)}
            raise ValueError(
                f"Collector: the policy's next state has entries {got}, expected {want} (as initial_state)"
            )
        return raw, next_state

    def _state_names(self) -> list[str]:
        return [str(key) for key in self.state_keys]

    # -- policy outputs ------------------------------------------------------------------------

    def check_outputs(self, raw: Any, n: int) -> dict[str, Tensor]:
        """The outputs as a dict, ``value`` squeezed to ``[n]``; the first call sets :attr:`layout`."""
        items = _items(raw, self.obs_key)
        for key, value in items.items():
            _check_output(key, value, n, self.device)
        layout = self.layout
        value_key = layout.value_key if layout is not None else _value_key(items)
        if value_key is not None and value_key in items:
            items[value_key] = _checked_value(value_key, items[value_key], n)
        if layout is None:
            self._check_names(items)
            self.layout = OutputLayout(tuple(items), value_key)
        elif items.keys() != layout.key_set:
            raise ValueError(
                f"Collector: policy output keys changed from {sorted(layout.keys)} to {sorted(items)} between steps"
            )
        return items

    def _check_names(self, items: Mapping[str, Any]) -> None:
        """Refuses outputs named like a key the batch fills itself: they would be overwritten."""
        taken = sorted(str(key) for key in items if key in FILLED_KEYS)
        if taken:
            raise ValueError(
                f"Collector: the policy returns {taken}, keys the collector fills in every batch "
                f"({sorted(FILLED_KEYS)}); rename those outputs"
            )
        if self.obs_key in items:
            raise ValueError(
                f"Collector: the policy returns {self.obs_key!r}, the batch key of the observations (obs_key); "
                "rename that output, or pass another BatchKeys(obs_key=...)"
            )
        clash = sorted(str(key) for key in items if key in {_as_tuple(k)[0] for k in self.state_keys})
        if clash:
            raise ValueError(
                f"Collector: policy outputs {clash} have the names of initial_state's entries, which the "
                "batch stores at those keys; rename one of them"
            )
        if self.next_obs_key is not None and self.next_obs_key in items:
            raise ValueError(
                f"Collector: the policy returns {self.next_obs_key!r}, the batch key of the next observations "
                f"with BatchKeys(next_obs=True) ('next_' + obs_key); rename that output, or pass another obs_key"
            )


def _bootstrap_call(obs: Obs, states: TensorDictBase | None, n: int, device: torch.device) -> PolicyCall:
    """A value call on ``n`` final observations, with (recurrent) the states after the episodes' last steps."""
    if states is None:
        return PolicyCall(obs, value_only=True)
    return PolicyCall(obs, states, torch.zeros(n, dtype=torch.bool, device=device), value_only=True)


def _items(raw: Any, obs_key: str) -> dict[str, Any]:
    if type(raw) is dict and "action" in raw:  # the usual outputs: checked below, key by key
        return dict(raw)
    if isinstance(raw, TensorDictBase):
        items = {key: raw.get(key) for key in raw.keys() if key != obs_key}
    elif isinstance(raw, Mapping):
        items = dict(raw)
    else:
        raise TypeError(
            f"Collector: policy must return a Mapping[str, Tensor] or a TensorDict with an 'action' key, "
            f"got {type(raw).__name__}"
        )
    if "action" not in items:
        keys = sorted(map(str, items))
        close = difflib.get_close_matches("action", keys, n=1)
        hint = f": did you mean to return {close[0]!r} as 'action'?" if close else ""
        raise ValueError(f"Collector: policy output has no 'action' key; it returned keys {keys}{hint}")
    return items


def _check_output(key: str, value: Any, n: int, device: torch.device) -> None:
    if type(value) is not Tensor and not isinstance(value, (Tensor, TensorDictBase)):
        raise TypeError(
            f"Collector: policy output {key!r} must be a torch.Tensor of shape [{n}, ...], got {type(value).__name__}"
        )
    if value.dim() == 0 or value.shape[0] != n:
        raise ValueError(
            f"Collector: policy output {key!r} has shape {tuple(value.shape)}, expected a leading "
            f"size of {n} (one row per env)"
        )
    if value.device != device:
        raise ValueError(
            f"Collector: policy output {key!r} is on device {value.device}, expected {device} (the collector's device)"
        )


def _value_key(items: Mapping[str, Any]) -> str | None:
    """Which output is the value: ``"value"``, else TorchRL's ``"state_value"`` (what its ValueOperator writes)."""
    if "value" in items:
        return "value"
    return "state_value" if "state_value" in items else None


def _checked_value(key: str, value: Tensor, n: int) -> Tensor:
    """``value`` as ``[n]`` floats: a ``[n, 1]`` value squeezed."""
    if value.dim() == 2 and value.shape[1] == 1:
        value = value.squeeze(1)
    if value.dim() != 1 or not value.is_floating_point():
        raise ValueError(
            f"Collector: policy output {key!r} has shape {tuple(value.shape)} and dtype {value.dtype}, "
            f"expected a floating-point tensor of shape ({n},) or ({n}, 1)"
        )
    return value


def _as_tuple(key: str | tuple[str, ...]) -> tuple[str, ...]:
    return key if isinstance(key, tuple) else (key,)
