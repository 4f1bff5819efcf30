"""Compiled acting policies: the policy's calls through ``torch.compile``, or its forward replayed as a CUDA graph."""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor, nn
from torch._dynamo.exc import TorchDynamoException
from torch.distributions import Distribution

from torch_rollout.loop._acting import PolicyCall, TrainingModes, call_policy
from torch_rollout.loop._spec import CudaGraph

__all__ = ["CompiledPolicy", "CudaGraph", "CudaGraphPolicy", "acting_call", "check_compile_policy"]

# torch.compile modes that record CUDA graphs on a CUDA device (their outputs live in the graphs' memory).
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
# torch.cuda.graph: "only one capture may be underway at a time in the process" (two collectors' threads). Replays
# and the eager calls of a CudaGraphPolicy hold it too: a random op (a replay advances the generator) while another
# thread records makes that recording fail with "Offset increment outside graph capture".
_CAPTURE_LOCK = threading.Lock()
# Until torch 2.5, torch.multinomial (Categorical.sample) read values back to the host: no sampling policy recordable.
_GRAPH_TORCH = (2, 5)


def check_compile_policy(compile_policy: Any) -> dict[str, Any] | CudaGraph | None:
    """The ``torch.compile`` keyword arguments that ``compile_policy`` asks for, a :class:`CudaGraph`, or None: eager.

    Raises:
        TypeError: for a value that is neither a bool, a Mapping nor a :class:`CudaGraph`.
        ValueError: for keyword arguments that ``torch.compile`` refuses (an
            unknown name or backend, ``mode`` together with ``options``).
    """
    if compile_policy is False or compile_policy is None:
        return None
    if compile_policy is True:
        return {}
    if isinstance(compile_policy, CudaGraph):
        _check_torch_version(compile_policy)
        return compile_policy  # its device is checked where the acting policy is built (see CudaGraphPolicy)
    if not isinstance(compile_policy, Mapping) or not all(isinstance(key, str) for key in compile_policy):
        raise TypeError(
            "Collector: compile_policy must be a bool or a dict of torch.compile keyword arguments (e.g. "
            "{'mode': 'reduce-overhead'}), or torch_rollout.CudaGraph() to replay a CUDA graph of the forward, got "
            f"{type(compile_policy).__name__} {compile_policy!r}"
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


def _check_torch_version(config: CudaGraph) -> None:
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found is not None and tuple(map(int, found.groups())) < _GRAPH_TORCH:
        raise ValueError(
            f"Collector: compile_policy={config!r} needs torch >= {'.'.join(map(str, _GRAPH_TORCH))}, found torch "
            f"{torch.__version__}, whose torch.multinomial (Categorical.sample) reads values back to the host, which "
            "a CUDA graph cannot record; upgrade torch, or pass compile_policy=False to act eagerly"
        )


def acting_call(
    policy: nn.Module,
    compile_options: dict[str, Any] | CudaGraph | None,
    *,
    num_envs: int,
    obs_key: str,
    owned: bool,
    modes: TrainingModes | None = None,
) -> Callable[[PolicyCall], Any]:
    """The placement's policy call: :func:`call_policy` on ``policy``, compiled when ``compile_options`` is a dict.

    A :class:`CudaGraph` gives a :class:`CudaGraphPolicy`, which refuses a policy
    whose weights are not on a CUDA device. ``owned``: ``policy`` is the
    collector's acting copy (see :func:`call_policy`); else ``modes`` is its
    :class:`TrainingModes` (made here when not given).
    """
    modes = None if owned else modes or TrainingModes(policy)
    if compile_options is None:
        return functools.partial(call_policy, policy, obs_key=obs_key, owned=owned, modes=modes)
    if isinstance(compile_options, CudaGraph):
        return CudaGraphPolicy(policy, compile_options, num_envs=num_envs, obs_key=obs_key, modes=modes)
    return CompiledPolicy(policy, compile_options, num_envs=num_envs, obs_key=obs_key, modes=modes)


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

    def __init__(
        self, policy: nn.Module, options: dict[str, Any], *, num_envs: int, obs_key: str, modes: TrainingModes | None
    ) -> None:
        self.policy = policy
        self.owned = modes is None  # the collector's own copy, else the trainer's module
        self.modes = modes
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
            raw = call_policy(
                self.policy, call, self.obs_key, functions=self.functions, owned=self.owned, modes=self.modes
            )
        except TorchDynamoException as exc:
            which = "get_value" if call.value_only and self.functions[1] is not None else "forward"
            raise RuntimeError(
                f"Collector(compile_policy={self.options!r}): torch.compile failed on the policy's {which}: "
                f"{_cause(exc)}; fix the cause, or pass compile_policy=False to act without compiling"
            ) from exc
        if n < self.num_envs or self.cudagraphs:
            raw = _first_rows(raw, n, clone=self.cudagraphs)
        return raw


class CudaGraphPolicy:
    """Makes the forward calls at ``num_envs`` rows by replaying a CUDA graph of ``policy``'s forward.

    The graph is recorded at the first such call, after ``config.warmup`` eager
    calls on a side stream, with static copies of that call's inputs
    (observations, and in recurrent mode the state and ``is_init``). Each call
    then copies its inputs into them, replays the graph and returns clones of
    its outputs, since the next replay overwrites the graph's memory. The
    forward is recorded eagerly (no ``torch.compile``): its random ops draw from
    the device's generator, whose offset every replay advances, so sampling is
    fresh at every call. Python in the forward (hooks, prints, branches on
    values) runs at the recording only.

    Value-only calls (the bootstrap values) and calls with fewer rows (the final
    observations of the envs that ended, an async pool's ready envs) run
    eagerly: a few per batch, against one replay per step.

    The graph reads the parameters' and buffers' memory: a refresh copied into
    them in place is what the next replay computes with. When the policy is not
    the collector's own copy (``owned=False``: the trainer's module, on the
    thread with ``prefetch=0``) a parameter or buffer may be replaced; a
    changed ``data_ptr`` (a host-side read, no sync) then records the graph anew.
    """

    def __init__(
        self, policy: nn.Module, config: CudaGraph, *, num_envs: int, obs_key: str, modes: TrainingModes | None
    ) -> None:
        self.policy = policy
        self.config = config
        self.num_envs = num_envs
        self.obs_key = obs_key
        self.owned = modes is None  # the collector's own copy, else the trainer's module
        self.modes = modes
        weight = next(_weights(policy), None)
        if weight is not None:  # a policy without weights is checked at its first call
            _check_cuda(config, weight.device)
        self.graph: Any = None
        self.inputs: PolicyCall | None = None
        self.outputs: Any = None
        self.weights: list[Tensor] = []  # what the graph reads, kept alive while it may read them
        self.pointers: list[int] = []

    def __call__(self, call: PolicyCall) -> Any:
        if call.value_only or call.obs.shape[0] != self.num_envs:
            with _CAPTURE_LOCK:  # its random ops must not run while another collector records
                return call_policy(self.policy, call, self.obs_key, owned=self.owned, modes=self.modes)
        if self.graph is None or (not self.owned and [t.data_ptr() for t in _weights(self.policy)] != self.pointers):
            self._record(call)
        inputs = self.inputs
        assert inputs is not None  # recorded above
        inputs.obs.copy_(call.obs)
        if call.state is not None:
            # Recorded with a state as well: every call of a recurrent policy has one, with is_init.
            assert inputs.state is not None and inputs.is_init is not None and call.is_init is not None
            inputs.state.copy_(call.state)
            inputs.is_init.copy_(call.is_init)
        with _CAPTURE_LOCK:  # a replay advances the random generators' offsets: not while another thread records
            self.graph.replay()
        return _first_rows(self.outputs, self.num_envs, clone=True)

    def _record(self, call: PolicyCall) -> None:
        self.graph = self.outputs = None  # the previous graph's memory is freed first
        device = _device(call.obs)
        _check_cuda(self.config, device)
        self.inputs = PolicyCall(
            call.obs.clone(),
            None if call.state is None else call.state.clone(),
            None if call.is_init is None else call.is_init.clone(),
        )
        self.weights = [t.detach() for t in _weights(self.policy)]
        self.pointers = [t.data_ptr() for t in self.weights]
        forward = functools.partial(call_policy, self.policy, self.inputs, self.obs_key, owned=self.owned)
        self.graph, self.outputs = _capture(forward, self.config, device, _own_generators(self.policy, device))


def _weights(policy: nn.Module) -> Iterator[Tensor]:
    return itertools.chain(policy.parameters(), policy.buffers())


def _own_generators(policy: nn.Module, device: torch.device) -> list[torch.Generator]:
    """The CUDA generators on ``device`` that the policy's modules hold as attributes (drawn from by its forward)."""
    found: dict[int, torch.Generator] = {}
    for module in policy.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Generator) and value.device == device:
                found.setdefault(id(value), value)
    return list(found.values())


def _check_cuda(config: CudaGraph, device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(
            f"Collector: compile_policy={config!r} replays a CUDA graph of the policy's forward, and CUDA graphs "
            f"need a CUDA device, but the policy acts on device {str(device)!r}; pass device='cuda' (a Ray worker "
            "also needs options={'num_gpus': 1}), or compile_policy=False to act eagerly"
        )


def _capture(
    forward: Callable[[], Any], config: CudaGraph, device: torch.device, generators: list[torch.Generator]
) -> tuple[Any, Any]:
    """A ``torch.cuda.CUDAGraph`` of ``forward()`` and its outputs, by PyTorch's recipe: warm-up on a side stream.

    ``generators``: the policy's own CUDA generators, registered with the graph so that
    each replay advances them too (the device's default generator always is).
    """
    with torch.cuda.device(device), torch.no_grad(), _CAPTURE_LOCK:
        caller = torch.cuda.current_stream()
        stream = torch.cuda.Stream()
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            for _ in range(config.warmup):
                forward()
        caller.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        for generator in generators:
            graph.register_generator_state(generator)
        try:
            # thread_local: the trainer's thread may use CUDA meanwhile; only this thread's calls must be capturable.
            with _distribution_checks_off(), torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                outputs = forward()
        except Exception as exc:
            # A capture_end that fails after an error in the forward raises its own error, with the first as context.
            first = exc.__context__
            cause = _cause(exc) if first is None else f"{_cause(first)}, then {_cause(exc)}"
            torch.cuda.set_stream(caller)  # a capture_end that raised left the capture's stream current
            del graph
            restored = _end_capture_mode(device, generators)
            raise RuntimeError(
                f"Collector(compile_policy={config!r}): recording the policy's forward as a CUDA graph failed: "
                f"{cause}; the forward must run on the GPU without reading values back to the host (no .item(), "
                "bool(tensor), nonzero(), .cpu(), distributions built with validate_args=True), or pass "
                f"compile_policy=False to act eagerly ({restored})"
            ) from exc
    return graph, outputs


def _end_capture_mode(device: torch.device, generators: list[torch.Generator]) -> str:
    """After a failed recording: the random generators it left in capture mode taken out of it; what happened.

    Until torch 2.13 a generator enters capture mode when a recording begins and leaves it
    only when one ends well: after a failure every eager random op on the device would
    raise "Offset increment outside graph capture". A tiny recording that ends well,
    with the same generators, takes them out (later torch versions need nothing).
    """
    try:
        scratch = torch.zeros(1, device=device)
        graph = torch.cuda.CUDAGraph()
        for generator in generators:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
            scratch.add_(1)
        del graph
    except Exception as exc:
        return (
            f"the device's random generators may be left in capture mode ({_cause(exc)}): start a new process "
            "before acting eagerly"
        )
    return "the device's random generators are out of capture mode: eager random ops work in this process"


@contextlib.contextmanager
def _distribution_checks_off() -> Iterator[None]:
    """torch.distributions' argument checks off, in every thread, for the capture.

    They read values back to the host, which a capture forbids; the warm-up calls
    ran them, and replays run no Python, so no checks either way.
    """
    before = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        Distribution.set_default_validate_args(before)


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
