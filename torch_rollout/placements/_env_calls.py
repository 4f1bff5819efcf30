"""Calls on the envs wherever they step: gymnasium's ``VectorEnv.call``, ``get_attr`` and ``set_attr``, between batches.

:class:`EnvCalls` is the trainer's side (``collector.env_calls``): it splits a call
into one :class:`~torch_rollout.placements._messages.EnvCall` per collection loop,
has the placement run them between batches, and joins the answers in global env
order. :func:`run_env_call` is the loop's side, the same in the thread, in a worker
process and in a Ray actor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv, VectorEnv

from torch_rollout.envs._gym import RemoteTraceback, split_envs
from torch_rollout.placements._messages import EnvAnswer, EnvCall
from torch_rollout.placements._remote import error_message
from torch_rollout.util._notes import add_note

if TYPE_CHECKING:
    from torch_rollout.placements._protocol import Placement

__all__ = ["EnvCalls", "run_env_call"]

# Vector envs whose call reaches each sub-env through gymnasium.Env's get_wrapper_attr: has_wrapper_attr checks
# a name first (an AttributeError inside an AsyncVectorEnv's worker would leave it unable to step on).
_PER_ENV = (SyncVectorEnv, AsyncVectorEnv)


# What only the collection loop calls on its envs
_LOOP_CALLS = frozenset({"step", "reset", "close"})


class EnvCalls:
    """The envs' own methods and attributes, wherever they step: gymnasium's ``VectorEnv.call``, ``get_attr`` and
    ``set_attr`` on the thread, in worker processes and in Ray actors alike.

    ``collector.env_calls`` returns one. Its three methods mean what they mean
    on a gymnasium vector env (and SB3's ``env_method``, ``get_attr`` and
    ``set_attr``): :meth:`call` and :meth:`get_attr` return a tuple with one
    value per env, in global env order (env ``j`` of the batch is value ``j``),
    and :meth:`set_attr` takes one value for every env or a list or tuple with
    one per env. Each collection loop applies the call to its own vector env
    (a worker's share of the envs) and the trainer joins the answers. The
    names sit on their own object, not on the Collector, so that they read as
    gymnasium's do and ``collector.envs`` stays what it is: the live vector
    env on the thread, None where the envs step in workers.

    A call runs between batches, never while a loop steps the envs: after
    every batch requested so far (with ``prefetch`` > 0 the batches collected
    ahead, which stay in order for ``next()``) and before any later one. So a
    value read after ``next()`` returned batch ``i`` holds what the envs saw up
    to batch ``i + prefetch``, and a value set then acts from batch
    ``i + prefetch + 1`` on. Before the first batch (right after construction
    or :meth:`~torch_rollout.Collector.load_state_dict`) it runs before any
    step. It waits for its answer at most the collector's ``timeout``.

    The envs must be a vector env of separate envs, such as gymnasium's
    ``SyncVectorEnv`` and ``AsyncVectorEnv`` (``gymnasium.make_vec`` with
    ``vectorization_mode="sync"``, or a ``make_envs`` function that builds
    one); their vector wrappers are looked through. Values travel from worker
    processes and Ray actors by pickle.

    Raises (every method):
        AttributeError: when the envs lack the name (neither an env nor any
            wrapper around it has it); :meth:`set_attr` too, rather than add
            a new attribute that nothing reads. The collector goes on.
        TypeError: when the envs are not a vector env of separate envs (no
            such method, or a vector env of torch tensors that answers with
            one value for all its envs), or ``name`` is not a str.
        RuntimeError: on a closed collector, or after the collection failed.
        TimeoutError: when no answer came within the collector's ``timeout``;
            the collector's next ``next()`` raises it too.
        Exception: what the env's method raised, with the worker's traceback
            chained; the collector goes on.

    Examples:
        >>> import gymnasium, torch
        >>> from torch import nn
        >>> from torch_rollout import Collector
        >>> class Policy(nn.Module):
        ...     def forward(self, obs):
        ...         return {"action": torch.zeros(obs.shape[0], dtype=torch.long)}
        >>> def make_env():
        ...     return gymnasium.wrappers.NormalizeObservation(gymnasium.make("CartPole-v1"))
        >>> envs = gymnasium.vector.SyncVectorEnv([make_env] * 2)
        >>> with Collector(envs, Policy(), num_steps=4, device="cpu", backend="thread") as collector:
        ...     _ = next(iter(collector))
        ...     [rms.mean.shape for rms in collector.env_calls.get_attr("obs_rms")]
        ...     collector.env_calls.set_attr("update_running_mean", [True, False])
        ...     collector.env_calls.get_attr("update_running_mean")
        ...     try:
        ...         collector.env_calls.get_attr("obs_rsm")
        ...     except AttributeError as exc:
        ...         print(str(exc)[:50])
        [(4,), (4,)]
        (True, False)
        Collector.env_calls.get_attr('obs_rsm'): envs 0..1
        >>> envs.close()
    """

    def __init__(self, placement: Placement, *, num_envs: int, num_workers: int, timeout: float | None) -> None:
        self._placement = placement
        self._num_envs = num_envs
        self._shares = split_envs(num_envs, num_workers)
        self._timeout = timeout

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls method ``name`` of every env with ``args`` and ``kwargs`` (where it is not callable: its value).

        Returns:
            The results, one per env in global env order.

        Raises:
            ValueError: for ``step``, ``reset`` and ``close``, which the collector's loop alone calls.
        """
        if name in _LOOP_CALLS:
            raise ValueError(
                f"Collector.env_calls.call({name!r}): the collector's loop steps, resets and closes its envs; a "
                f"{name}() from here would put them out of step with it. Call another method of the envs, or use "
                "a collector's own reset (a new Collector, or load_state_dict) and close()"
            )
        return self._values(EnvCall(method="call", name=name, args=args, kwargs=kwargs))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Attribute ``name`` of every env (of the env or of the outermost wrapper around it that has it).

        Returns:
            The values, one per env in global env order.
        """
        return self._values(EnvCall(method="get_attr", name=name))

    def set_attr(self, name: str, values: Any) -> None:
        """Sets attribute ``name`` of every env: to ``values`` itself, or where it is a list or tuple, env ``j``'s to
        ``values[j]``.

        Raises:
            ValueError: for a list or tuple whose length is not ``num_envs``.
        """
        if isinstance(values, (list, tuple)):
            if len(values) != self._num_envs:
                raise ValueError(
                    f"Collector.env_calls.set_attr({name!r}): got {len(values)} values for {self._num_envs} envs; "
                    f"pass one per env (a list or tuple of {self._num_envs}), or one value that is not a list or "
                    "tuple for every env"
                )
            calls = [
                EnvCall(method="set_attr", name=name, args=(list(values[start : start + count]),))
                for start, count in self._shares
            ]
        else:
            calls = [EnvCall(method="set_attr", name=name, args=(values,))] * len(self._shares)
        self._answers(calls)

    def _values(self, call: EnvCall) -> tuple[Any, ...]:
        values: list[Any] = []
        for answer, (start, count) in zip(self._answers([call] * len(self._shares)), self._shares):
            value = answer.value
            if not isinstance(value, (tuple, list)) or len(value) != count:
                found = f"a {type(value).__name__} of {len(value)}" if isinstance(value, (tuple, list)) else "one value"
                raise TypeError(
                    f"{call.label}: {_envs(start, count)} ({answer.envs}) answered with {found} "
                    f"({type(value).__name__}), expected a tuple of {count} values, one per env: these envs are "
                    "not a vector env of separate envs (a vector env of torch tensors answers for all its envs at "
                    "once); use gymnasium's SyncVectorEnv or AsyncVectorEnv, or reach the env itself on the thread "
                    "(collector.envs with a live vector env)"
                )
            values.extend(value)
        return tuple(values)

    def _answers(self, calls: list[EnvCall]) -> list[EnvAnswer]:
        call = calls[0]
        if not isinstance(call.name, str):
            raise TypeError(
                f"Collector.env_calls.{call.method}: name must be a str (an attribute or method of the envs), got "
                f"{type(call.name).__name__} {call.name!r}"
            )
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        answers = self._placement.env_call(calls, deadline)
        for answer, (start, count) in zip(answers, self._shares):
            _raise_for(answer, call, start, count)
        return answers


def _envs(start: int, count: int) -> str:
    return f"envs {start}..{start + count - 1}"


def _raise_for(answer: EnvAnswer, call: EnvCall, start: int, count: int) -> None:
    """Raises the error of ``answer`` (of the loop stepping envs ``start .. start + count - 1``), if it has one."""
    where = f"{_envs(start, count)} ({answer.envs})"
    if answer.unsupported:
        raise TypeError(
            f"{call.label}: the vector env of {where} has no {call.method}() that reaches each of its envs; build "
            "them as a vector env of separate envs, gymnasium's SyncVectorEnv or AsyncVectorEnv "
            "(gymnasium.make_vec(env_id, num_envs, vectorization_mode='sync'), or SyncVectorEnv([...]) in make_envs)"
        )
    if answer.missing:
        unset = " (set_attr sets only an attribute the envs have: a new one would be read by nothing)"
        raise AttributeError(
            f"{call.label}: {where} have no attribute {call.name!r}, neither the envs nor any wrapper around them"
            f"{unset if call.method == 'set_attr' else ''}; check the name, or add the wrapper that has it to each "
            "env where the envs are built (e.g. gymnasium.wrappers.NormalizeObservation for 'obs_rms')",
            name=call.name,
        )
    error = answer.error
    if error is not None:
        if answer.traceback:  # raised in another process: its traceback as the cause
            error.__cause__ = RemoteTraceback(f'\n"""\nin {_envs(start, count)}:\n{answer.traceback}"""')
        add_note(error, f"(raised in {call.label} on {_envs(start, count)})")
        raise error


def run_env_call(envs: VectorEnv, call: EnvCall, dumps: Callable[[Any], Any] | None = None) -> EnvAnswer:
    """Applies ``call`` to ``envs`` and answers with its value or error; never raises.

    ``dumps`` (a worker's pickler) checks that the value can travel: one that cannot is the call's error, and the
    worker goes on serving.
    """
    described = repr(envs)
    # gymnasium's vector wrappers do not pass call, get_attr and set_attr on: the vector env beneath has them
    target = envs if hasattr(envs, call.method) else envs.unwrapped
    method = getattr(target, call.method, None)
    if not callable(method):
        return EnvAnswer(envs=described, unsupported=True)
    try:
        if isinstance(target, _PER_ENV) and not all(target.call("has_wrapper_attr", call.name)):
            return EnvAnswer(envs=described, missing=True)
        value = method(call.name, *call.args, **call.kwargs)
        if dumps is not None:
            dumps(value)
    except Exception as exc:
        if isinstance(exc, AttributeError) and call.name in str(exc) and not isinstance(target, _PER_ENV):
            return EnvAnswer(envs=described, missing=True)
        if dumps is None:  # in the trainer's process: the exception itself, with its traceback
            return EnvAnswer(envs=described, error=exc)
        failed = error_message(exc, dumps)
        return EnvAnswer(envs=described, error=failed.error, traceback=failed.traceback)
    return EnvAnswer(envs=described, value=value)
