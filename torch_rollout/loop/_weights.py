"""The policy's weights on the acting side: the acting copy, and refreshing it from the trainer's module by name."""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

__all__ = [
    "PlainSettings",
    "WeightPairs",
    "acting_copy",
    "check_policy_device",
    "check_same_structure",
    "named_weights",
    "weight_pairs",
]


def named_weights(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The module's parameters, then its buffers, by name: what a refresh copies."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def check_policy_device(policy: nn.Module, device: torch.device) -> None:
    """Refuses a policy that is to act as given (no copy) with a tensor off ``device``."""
    for name, tensor in named_weights(policy):
        if tensor.device != device:
            raise ValueError(
                f"Collector: with prefetch=0 the policy runs as given, but its tensor {name!r} is on "
                f"{tensor.device}, not on device={device}; call policy.to({str(device)!r}) first"
            )


def acting_copy(policy: nn.Module, device: torch.device, *, why: str, fix: str) -> nn.Module:
    """The acting copy of ``policy``: on ``device``, without gradients, in eval mode.

    ``why``: the argument that makes the collector copy the policy; ``fix``: the arguments that avoid it.
    """
    for name, tensor in named_weights(policy):
        if is_lazy(tensor):
            raise ValueError(
                f"Collector: {why} copies the policy when the Collector is built, but its parameter {name!r} is "
                "uninitialized (a lazy module such as nn.LazyLinear); run the policy once on a batch of "
                f"observations before building the Collector, or pass {fix} to act with the module itself"
            )
    try:
        acting_policy = copy.deepcopy(policy)
    except Exception as exc:
        raise TypeError(
            f"Collector: {why} copies the policy but copy.deepcopy({type(policy).__name__}) failed ({exc}); "
            f"make it deep-copyable or pass {fix} to act with the module itself"
        ) from exc
    acting_policy.to(device)
    acting_policy.requires_grad_(False)
    acting_policy.eval()  # the collector always acts in eval mode (see call_policy)
    return acting_policy


_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_MISSING = object()


def _is_plain(value: object) -> bool:
    """A number, string, None, or a tuple of them: a setting that ``==`` compares as a value."""
    return isinstance(value, _PLAIN) or (type(value) is tuple and all(map(_is_plain, value)))


class PlainSettings:
    """The policy's public plain attributes (``epsilon``, ``temperature``: numbers, strings, None, tuples of them)
    as the acting copy was made with them, to refuse a change that the copy would never see.

    Weights travel to the acting copy as tensors; a plain attribute stays as it was when the Collector was built.
    Private names (``_cache``) and ``training`` (the copy always acts in eval mode) are not watched.
    """

    def __init__(self, policy: nn.Module, why: str, fix: str) -> None:
        self.why, self.fix = why, fix
        self.entries = [
            (f"{prefix}.{name}" if prefix else name, module.__dict__, name, value)
            for prefix, module in policy.named_modules()
            for name, value in module.__dict__.items()
            if not name.startswith("_") and name != "training" and _is_plain(value)
        ]

    def check(self) -> None:
        """Raises ValueError naming the first watched attribute that no longer holds its value."""
        for where, entries, name, value in self.entries:
            now = entries.get(name, _MISSING)
            if now is value or (type(now) is type(value) and now == value):
                continue
            shown = "was deleted" if now is _MISSING else f"is now {now!r}"
            if isinstance(value, (bool, int, float)):  # a number: a buffer carries it
                fix = (
                    f"Make it a buffer, which every weight refresh carries (self.register_buffer({name!r}, "
                    f"torch.tensor({value!r})), then policy.{where}.fill_(x)), or pass {self.fix} to act with the "
                    "module itself"
                )
            else:
                fix = f"Create a new Collector after changing it, or pass {self.fix} to act with the module itself"
            raise ValueError(
                f"Collector: the policy's attribute {where!r} was {value!r} when the Collector was built and {shown}, "
                f"but the copy of the policy that acts ({self.why}) still has {value!r}: only tensors travel to it. "
                + fix
            )


def check_same_structure(src: dict[str, Tensor], dst: dict[str, Tensor], why: str) -> None:
    """Raises ValueError naming the first tensor of the policy (``src``) and its copy (``dst``) that differ.

    ``why``: the argument that made the collector copy the policy.
    """
    if src.keys() == dst.keys() and all(src[name].shape == dst[name].shape for name in src):
        return  # the usual case, at every refresh
    for name in sorted(src.keys() | dst.keys()):
        if name not in dst:
            problem = "is new since the Collector was built"
        elif name not in src:
            problem = "no longer exists"
        elif src[name].shape != dst[name].shape:
            problem = (
                f"now has shape {tuple(src[name].shape)}, but the collector's copy of the policy ({why}) has "
                f"shape {tuple(dst[name].shape)}"
            )
        else:
            continue
        raise ValueError(
            f"Collector: the policy's parameter {name!r} {problem}; the copy follows replaced parameters of the "
            "same shape only: create a new Collector after changing the policy's structure"
        )


def weight_pairs(policy: nn.Module, dst: dict[str, Tensor] | None, why: str) -> tuple[list[Tensor], list[Tensor]]:
    """The acting copy's tensors ``dst`` and the policy's current ones of the same names, to copy in that order.

    Pairing by name on every refresh follows tensors the trainer replaced
    (``load_state_dict(assign=True)``, a new submodule); a change of names or
    shapes raises before anything is copied. ``dst`` None: no copy (an empty refresh).
    """
    if dst is None:
        return [], []
    src = dict(named_weights(policy))
    check_same_structure(src, dst, why)
    return [dst[name] for name in src], list(src.values())


class WeightPairs:
    """:func:`weight_pairs` at every refresh, walked again only when the policy's structure may have changed.

    The walk over the modules' named parameters and buffers costs tens of microseconds at every batch, as much
    as the rest of a small batch's work on the trainer's side. Between walks, a refresh checks what a change
    would touch: every module's own submodules, parameters and buffers (a tensor or submodule assigned, added or
    removed changes one of them), and the shape of each tensor (``param.data = ...`` keeps the object).
    """

    def __init__(self, policy: nn.Module, why: str, fix: str) -> None:
        self.why = why
        self.settings = PlainSettings(policy, why, fix)  # as the acting copy was made with them
        self.policy: nn.Module | None = None
        self.dst: dict[str, Tensor] | None = None
        self.pairs: tuple[list[Tensor], list[Tensor]] = ([], [])
        self.modules: list[nn.Module] = []
        self.members: list[object] = []
        self.shapes: list[torch.Size] = []

    def __call__(self, policy: nn.Module, dst: dict[str, Tensor] | None) -> tuple[list[Tensor], list[Tensor]]:
        if dst is None:
            return [], []
        self.settings.check()  # a copy acts: a setting changed on the policy would not reach it
        if policy is not self.policy or dst is not self.dst or not self._unchanged():
            self.pairs = weight_pairs(policy, dst, self.why)
            self.policy, self.dst = policy, dst
            self.modules = list(policy.modules())
            self.members = self._members()
            self.shapes = [tensor.shape for tensor in self.pairs[1]]
        return self.pairs

    def forget(self) -> None:
        """Lets go of the policy, the acting copy's tensors (shared memory, for worker processes) and the rest."""
        self.policy, self.dst, self.pairs = None, None, ([], [])
        self.settings.entries = []
        self.modules, self.members, self.shapes = [], [], []

    def _members(self) -> list[object]:
        members: list[object] = []
        for module in self.modules:
            for entries in (module._modules, module._parameters, module._buffers):
                members.append(entries)
                members.extend(entries.values())
        return members

    def _unchanged(self) -> bool:
        members, known = self._members(), self.members
        # by identity (the objects are held here, so no new one can take the id of one that went), each dict
        # before its entries: an entry added to one and removed from the next cannot cancel out
        if len(members) != len(known) or not all(map(operator.is_, members, known)):
            return False
        return all(tensor.shape == shape for tensor, shape in zip(self.pairs[1], self.shapes))
