"""The Collector: rollout collection of ``[num_steps, num_envs]`` TensorDict batches beside training."""

from __future__ import annotations

import atexit
import copy
import functools
import math
import pickle
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import gymnasium
import torch
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from torch_rollout._compile import check_compile_policy
from torch_rollout._double_buffer import DoubleBufferedRecipe, check_double_buffer, check_double_buffer_shares
from torch_rollout._envs import autoreset_mode, build_envs, check_picklable, split_envs
from torch_rollout._infos import check_info_keys
from torch_rollout._interaction import greedy_modules
from torch_rollout._loop import add_advantages
from torch_rollout._process import ProcessPlacement
from torch_rollout._ray import RayPlacement, check_ray_picklable
from torch_rollout._thread import ThreadPlacement

__all__ = ["Collector"]

# How long close() waits for the background thread; a thread stuck in an env's
# step past this is left behind (it is a daemon) with a warning.
_JOIN_TIMEOUT = 10.0
# At interpreter exit nobody can use a stuck thread any more: wait less before leaving it.
_EXIT_JOIN_TIMEOUT = 2.0
_BACKENDS = ("auto", "thread", "process", "ray")
# Keys the collector writes into every batch: obs_key cannot take one of them.
_BATCH_KEYS = frozenset(
    ("action", "reward", "terminated", "truncated", "done", "mask", "episode_return", "episode_length",
     "policy_version", "next_value", "advantage", "return", "info")
)  # fmt: skip
_live: weakref.WeakSet[Collector] = weakref.WeakSet()
# id(envs.unwrapped) -> the open collector stepping that live vector env: a second one would interleave
# its steps with the first one's. Reentrant: a collector's __del__ may run (gc) while it is held.
_drivers: weakref.WeakValueDictionary[int, Collector] = weakref.WeakValueDictionary()
_drivers_lock = threading.RLock()


class Collector:
    """Collects rollouts of gymnasium vector envs with a torch policy, beside the training loop.

    ``for batch in collector`` yields a :class:`tensordict.TensorDict` with
    ``batch_size=[num_steps, num_envs]`` on ``device`` per iteration, while the
    next batch is being collected. Row ``t`` of env ``i`` is one call of
    ``envs.step``:

    ================== ======================================================
    key                meaning
    ================== ======================================================
    ``obs``            observation the action was chosen from (a nested
                       TensorDict for Dict spaces; float64 stored as float32,
                       integer dtypes kept); named ``obs_key``
    ``action``         as the policy returned it (a Box env receives it
                       clipped to the bounds; the stored one is not clipped)
    ``log_prob``, ...  every other per-env tensor the policy returned
    ``reward``         float32 reward of the step
    ``terminated``,    bool, the episode ended at this step (by the MDP, or
    ``truncated``,     by a time limit); ``done`` is their ``or``
    ``done``
    ``next_value``     value of the true next state: at an episode end of the
                       final observation, never of the reset observation
    ``advantage``,     GAE(``gamma``, ``gae_lambda``); only when the policy
    ``return``         returns ``"value"`` (or TorchRL's ``"state_value"``);
                       without either there are no ``next_value``,
                       ``advantage`` and ``return``
    ``mask``           False only for rows that are no transition (see below)
    ``episode_return``, running totals of the episode including this step:
    ``episode_length`` the episode's totals where ``done``
    ``policy_version`` version of the weights that chose the action
    ``info``           with ``info_keys`` only: the env infos of the step
                       (see Infos)
    ================== ======================================================

    Infos: ``info_keys=("is_success", "episode")`` keeps those keys of the
    infos that ``envs.step()`` returns, in ``batch["info"]``, a TensorDict of
    ``[num_steps, num_envs]``. For each kept key ``k`` it holds ``k`` (the
    value: a tensor of ``[T, N, *shape]``, or for a dict info such as
    RecordEpisodeStatistics' ``episode`` a nested TensorDict with one such
    tensor per entry, e.g. ``batch["info", "episode", "r"]``) and ``_k``
    (bool ``[T, N]``, gymnasium's presence mask: True where the env gave
    ``k`` at that row's step). Numbers and booleans keep their dtype except
    float64, stored as float32; where ``_k`` is False the values are 0 (or
    False). The infos of a row are those of its step: in SAME_STEP mode those
    of an ended step come from ``infos["final_info"]`` (the top level then
    holds the reset's), and keys that ``final_info`` lacks for that env from
    the top level (where vector wrappers such as
    ``gymnasium.wrappers.vector.RecordEpisodeStatistics`` put theirs); in
    NEXT_STEP mode the reset rows' infos (their reset's) are masked out; in
    DISABLED mode the infos of the collector's ``reset_mask`` resets belong to
    no row. Every batch holds every kept key, so its structure (nested keys,
    shapes, dtypes) is fixed when collection starts: from the infos of the
    first reset and step, or from an example value of one env given as
    ``info_keys={"ended": {"length": 0, "sum": 0.0}}`` (``None``: learn it);
    ``"episode"`` defaults to RecordEpisodeStatistics' ``{"r": float32,
    "l": int64, "t": float32}``. A key with no structure then, one whose
    structure changes later, and values that are not numbers raise errors
    naming the key. Under ``NormalizeReward`` the batch's ``episode_return``
    sums the scaled rewards; RecordEpisodeStatistics beneath the scaling
    keeps the env's own return in ``batch["info", "episode", "r"]``.

    Autoreset: all three gymnasium modes give the same real transitions. In
    NEXT_STEP mode (gymnasium's default) the step after an episode end only
    resets the env; its row has ``mask=False``, ``advantage=0``, and must be
    left out of losses. In SAME_STEP mode the final observation is read from
    ``infos["final_obs"]``; in DISABLED mode the collector resets ended envs
    with ``reset_mask``. A terminated step does not bootstrap, a truncated one
    bootstraps from the value of its final observation (one batched forward
    per step for the envs that ended), and the last row of a batch bootstraps
    from the observation the next batch starts with.

    Placements: one collection loop runs either on a background thread of this
    process (``backend="thread"``: right for a CUDA policy, and for envs that
    step outside the GIL) or in ``num_workers`` worker processes
    (``backend="process"``), each stepping a contiguous share of the envs that
    it builds itself from ``envs`` (an env id or a picklable function), with
    batches and weights in shared memory, or in ``num_workers`` Ray actors
    (``backend="ray"``, on the Ray this process is connected to, or on a local
    one that it starts), with batches and weights in Ray's object store.
    ``backend="auto"`` takes processes
    for a CPU policy whenever ``envs`` is an id or a function and both it and
    the policy can be pickled, else the thread. Env ``j`` is reset with seed
    ``seed + j`` in every placement, so a deterministic policy gets the same
    batches from all of them (vector envs that draw every sub-env from one
    generator, such as gymnasium's ``CartPoleVectorEnv``, differ once split
    across workers: pass ``env_kwargs={"vectorization_mode": "sync"}``). Worker
    processes start from a forkserver: a script that creates a collector needs
    the usual ``if __name__ == "__main__":`` guard.

    Acting mode: the policy is called under ``torch.no_grad()`` and in eval
    mode (``policy.eval()``: no dropout, BatchNorm uses and keeps its running
    statistics) in every placement and whatever mode the trainer's module is
    in; with ``prefetch=0`` on the thread, which acts with the trainer's module
    itself, each call puts back the modes its modules had. Acting never changes
    the trainer's buffers (a module that updates buffers even in eval mode is
    outside this contract: keep running statistics in the trainer or in an env
    wrapper). Bootstrap values (the last row's ``next_value``; final
    observations in SAME_STEP and DISABLED modes) come from
    ``policy.get_value`` when the policy has such a method, called with the
    same arguments as the forward and returning the value (``[n]`` or
    ``[n, 1]``, or a Mapping or TensorDict with ``"value"``): bootstraps then
    sample no actions (torch's RNG sees acting calls only) and never run the
    forward. Without it they run the forward and keep only ``"value"``.

    Recurrent policies (``initial_state`` given): the collector owns the state.
    ``initial_state`` is a TensorDict of ``[num_envs, ...]`` tensors (or a
    function ``initial_state(num_envs)`` returning one, called once); its
    entries are the state, under names of your choice. The policy is called
    as ``policy(obs, state, is_init)`` with ``state`` a TensorDict ``[n]`` of
    those entries and ``is_init`` a bool tensor ``[n]`` (True where the step
    starts an episode, where ``state`` is the env's row of ``initial_state``),
    and returns ``"next_state"`` (a Mapping or TensorDict of the same entries)
    beside its outputs. A TensorDictModule (TorchRL's ``LSTMModule``,
    ``GRUModule``) reads ``"obs"``, ``"is_init"`` (``[n, 1]``) and the
    state's entries at their keys, and writes the next state at
    ``("next", key)``. Row ``t`` of the batch stores ``is_init`` and the
    state that went into the step at the state's own keys (e.g.
    ``batch["h"]`` of ``[T, N, ...]``), so a trainer replays any sequence from
    the stored state at its first row (truncated BPTT), resetting to the
    initial state where ``is_init``. An env's state is reset at the first
    step of each episode (in NEXT_STEP mode: after its reset row, which is
    called with the ended episode's state), and carried across batches.
    Bootstraps value the final observation with the state after the
    episode's last step, and the last row with the state the next batch
    starts with; they never advance the carried state. With worker processes
    each worker keeps the state of its own envs; only its rows travel.

    Weights and policy lag:
    With ``prefetch >= 1`` the collector runs its own copy of the policy and
    refreshes it from ``policy`` whenever the next batch is requested (the
    trainer has finished its update then) and on :meth:`update_policy`; each
    refresh increments :attr:`policy_version`. The thread may collect up to
    ``prefetch`` batches ahead, so a batch's rows may come from weights up to
    ``prefetch`` versions old (plus one per :meth:`update_policy` called by
    hand meanwhile): use the stored ``log_prob`` in importance ratios. With
    ``prefetch=0`` collection runs in lockstep with the consumer (on the
    thread: on ``policy`` itself), and with a seed (and ``torch.manual_seed``
    for the policy's sampling) two runs give identical batches. Worker
    processes act with a shared-memory copy, refreshed in place under a lock
    per worker; rows of different workers may carry different versions. A
    copy is refreshed by name, all or nothing (even under Ctrl-C): tensors the
    trainer replaced (``load_state_dict(assign=True)``, a new submodule) are
    followed, and a change of names or shapes raises ``ValueError``.

    Compiled acting (``compile_policy``): the policy's forward and its
    ``get_value`` run through ``torch.compile`` (``True``: its defaults; a dict:
    its keyword arguments, e.g. ``{"mode": "reduce-overhead"}`` for CUDA graphs
    on a CUDA device), compiled by whoever acts (the thread, each worker
    process, each Ray actor) at its first call, so the first batch carries the
    compile time. The weights are inputs of the compiled graphs, never
    constants: a refresh copied into the acting copy is what the next call
    computes with, under the same lock as eager calls. On the thread with
    ``prefetch=0`` the collector compiles a wrapper of ``policy`` and acts
    with the trainer's own weights as they are at each step; ``policy``
    itself, and the trainer's calls of it, stay eager. Bootstrap calls on fewer
    envs (final observations) are padded to all of a loop's envs by repeating
    a row, and cut back, so each function compiles once, whatever the number of
    envs that end (rows must not depend on one another). Recurrent policies and
    TensorDictModules compile the same way. A compile failure (no C++ compiler,
    an unsupported op) is raised by ``next()`` as a ``RuntimeError`` naming
    ``compile_policy`` and the fix, ``compile_policy=False``.

    Double-buffering (``double_buffer=True``): each loop's envs (each
    worker's share) are built as two groups that step asynchronously
    (gymnasium ``AsyncVectorEnv``, one process per env) and presented as a
    :class:`DoubleBufferedVectorEnv`; the loop acts on one group's
    observations while the other group steps, and then starts that group's
    next step. Each env still fills its own rows in order, so the batches are
    those of ``double_buffer=False`` (with a deterministic policy, identical).
    Rows run up to a step ahead into the next batch's storage, never lost;
    in NEXT_STEP mode only (gymnasium's default).

    Errors: an exception raised by the env or the policy in the background is
    re-raised by ``next()`` with its original traceback (from a worker process:
    the same exception type, with the worker's traceback text as its
    ``__cause__``), and the collector closes; iterating it again raises
    ``RuntimeError``. A worker process that dies becomes a ``RuntimeError``
    naming it, its pid and the signal; workers exit by themselves when the
    trainer's process dies. A Ray actor that dies becomes a ``RuntimeError``
    naming the worker, its node and pid (or, with ``ray_options={"max_restarts":
    n}``, is recreated). Envs the collector
    created are closed by :meth:`close`, which is idempotent and also runs on
    garbage collection and at interpreter exit. Where gymnasium's own error
    hides the cause, the collector names it: a killed AsyncVectorEnv worker
    process becomes a ``RuntimeError`` with its index, pid and signal (the
    broken vector env is shut down, since it can no longer close itself), and
    a sub-env observation of the wrong shape a ``ValueError`` naming the env.

    Hostile input: observations of the wrong shape or of a dtype that would not
    cast safely, actions outside a Discrete, MultiDiscrete or MultiBinary
    space and policy outputs on another device raise ``ValueError`` naming the
    key, what was received and what was expected. NaN and inf in observations,
    rewards and Box actions pass through unchanged (they are valid floats, and
    some envs use inf on purpose) unless ``check_finite=True``. A live vector
    env is stepped by one open collector at a time: a second one raises
    ``ValueError``, as it would corrupt both trajectories.

    Args:
        envs: a :class:`gymnasium.vector.VectorEnv` in any autoreset mode (thread only),
            an env id for :func:`gymnasium.make_vec`, or a function
            ``make_envs(num_envs)`` (or ``make_envs(num_envs, start_index=...)``)
            returning a vector env, such as ``torch_rollout.envpool_envs(task_id)``
            for EnvPool; with an id or a function ``num_envs`` is required.
        policy: ``policy(obs) -> Mapping[str, Tensor] | TensorDict`` with at least
            ``"action"`` (``[num_envs, *action_shape]``) and optionally ``"value"``
            (``[num_envs]`` or ``[num_envs, 1]``, stored as ``[T, N]``; TorchRL's
            ``"state_value"`` when there is no ``"value"``) and ``"log_prob"``. ``obs`` is
            ``[num_envs, *obs_shape]`` on ``device`` (a TensorDict for Dict
            spaces). A ``tensordict.nn.TensorDictModule`` reads ``obs_key``; in the
            collector thread its probabilistic modules sample as their own
            ``default_interaction_type`` says, whatever interaction type the
            trainer's thread sets (TorchRL's losses set DETERMINISTIC while they run).
        num_steps: steps per env per batch (``T``).
        num_envs: number of envs to build when ``envs`` is an env id or a function.
        env_kwargs: keyword arguments of :func:`gymnasium.make_vec` with an env id.
        backend: ``"thread"``, ``"process"``, ``"ray"`` or ``"auto"`` (see Placements).
        num_workers: worker processes with ``backend="process"``, Ray actors with
            ``backend="ray"`` (at most ``num_envs``).
        gamma: discount factor.
        gae_lambda: GAE lambda.
        device: where the policy runs and batches live; ``None``: ``"cuda"``
            when available, else ``"cpu"``.
        total_timesteps: stop after ``ceil(total_timesteps / (T * num_envs))``
            batches; ``None``: endless.
        prefetch: batches collected ahead of the consumer; 0: lockstep; ``None``: 1,
            except 0 for the thread with a CPU policy (it shares the GIL with the
            trainer, and collecting ahead was measured to slow training down).
            Collection starts with the iteration (``iter()`` or ``next()``).
        seed: seed of the envs' first reset.
        timeout: seconds ``next()`` waits for a batch before raising
            ``TimeoutError`` (an env that hangs); ``None``: wait forever. The
            stuck thread cannot be interrupted: it is left behind as a daemon,
            stops when the stuck call returns, and then closes the envs the
            collector created.
        check_finite: raise ``ValueError`` naming the key, env and step when an
            observation, a reward or a Box action (before the env receives it)
            is NaN or infinite (costs a few ``np.isfinite`` per step).
        info_keys: env info keys to keep in ``batch["info"]`` (see Infos): a
            sequence of names, or a mapping of names to an example value of one
            env (``None``: learn it from the first reset and step).
        obs_key: the batch key of observations, and the key a TensorDictModule
            policy reads them from (TorchRL's modules read ``"observation"``).
        ray_options: with ``backend="ray"``, Ray actor options for every worker
            (``num_cpus``, ``num_gpus``, ``resources``, ``runtime_env``,
            ``scheduling_strategy``, ...; a worker given GPUs runs the policy on
            its GPU), and ``max_restarts``: how many times a worker whose actor
            died is recreated with new envs (default 0: the death is an error).
        initial_state: a recurrent policy's initial state, a TensorDict (or a
            Mapping) of ``[num_envs, ...]`` tensors or a function
            ``initial_state(num_envs)`` returning one (see Recurrent policies);
            ``None``: the policy is called as ``policy(obs)``.
        compile_policy: act through ``torch.compile`` (see Compiled acting):
            ``True``, or a dict of ``torch.compile`` keyword arguments
            (``fullgraph``, ``dynamic``, ``backend``, ``mode``, ``options``);
            ``False`` (default): eager (compiling did not win clearly on the
            CPU: README, Compiled policies).
        double_buffer: step the envs in two groups of AsyncVectorEnv processes
            and act on one while the other steps (see Double-buffering); with
            an env id (made with ``vectorization_mode="async"``) or a function,
            and an even number of envs per worker. ``False`` (default): it lost
            to stepping one SyncVectorEnv on 2 cores (README, Double-buffering).

    Raises:
        TypeError: for an unsupported space or argument type.
        ValueError: for an out-of-range argument, an unknown env id, a live
            vector env that another open collector steps, or a lazy policy
            (``nn.LazyLinear``) not run yet that the collector must copy.

    Warns:
        UserWarning: for each probabilistic tensordict module of the policy whose
            ``default_interaction_type`` is not RANDOM: the collector acts with it
            without sampling (TorchRL's ``ProbabilisticActor`` defaults to
            DETERMINISTIC).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> class RandomPolicy(nn.Module):
        ...     def forward(self, obs):
        ...         n = obs.shape[0]
        ...         return {"action": torch.randint(0, 2, (n,)), "value": torch.zeros(n)}
        >>> with Collector("CartPole-v1", RandomPolicy(), num_envs=4, num_steps=16,
        ...                total_timesteps=128, device="cpu", seed=0, backend="thread") as collector:
        ...     for batch in collector:
        ...         pass
        >>> batch.batch_size
        torch.Size([16, 4])
        >>> sorted(batch.keys())[:5]
        ['action', 'advantage', 'done', 'episode_length', 'episode_return']
        >>> collector.closed
        True
    """

    envs: VectorEnv | None
    policy: nn.Module
    backend: str
    num_workers: int
    num_steps: int
    num_envs: int
    device: torch.device
    prefetch: int
    total_timesteps: int | None
    autoreset_mode: AutoresetMode
    closed: bool

    def __init__(
        self,
        envs: VectorEnv | str | Callable[..., VectorEnv],
        policy: nn.Module,
        *,
        num_steps: int,
        num_envs: int | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        backend: str = "auto",
        num_workers: int = 1,
        gamma: float = 0.99,
        gae_lambda: float = 0.95,
        device: torch.device | str | None = None,
        total_timesteps: int | None = None,
        prefetch: int | None = None,
        seed: int | None = None,
        timeout: float | None = None,
        check_finite: bool = False,
        info_keys: Sequence[str] | Mapping[str, Any] | None = None,
        obs_key: str = "obs",
        ray_options: Mapping[str, Any] | None = None,
        initial_state: TensorDictBase | Callable[[int], TensorDictBase] | None = None,
        compile_policy: bool | Mapping[str, Any] = False,
        double_buffer: bool = False,
    ) -> None:
        self.closed = True  # until fully built, so that __del__ of a failed init is a no-op
        _check_int("num_steps", num_steps, minimum=1)
        _check_int("num_workers", num_workers, minimum=1)
        if prefetch is not None:
            _check_int("prefetch", prefetch, minimum=0)
        if total_timesteps is not None:
            _check_int("total_timesteps", total_timesteps, minimum=1)
        if seed is not None:
            _check_int("seed", seed, minimum=0)
        for name, x in (("gamma", gamma), ("gae_lambda", gae_lambda)):
            if not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0:
                raise ValueError(f"Collector: {name} must be a float in [0, 1], got {x!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"Collector: timeout must be a positive number of seconds or None, got {timeout!r}")
        info_specs = check_info_keys(info_keys)
        compile_options = check_compile_policy(compile_policy)
        if not isinstance(obs_key, str) or not obs_key or obs_key in _BATCH_KEYS:
            raise ValueError(
                f"Collector: obs_key must be a str other than the batch's own keys {sorted(_BATCH_KEYS)}, got "
                f"{obs_key!r} (TorchRL's modules read 'observation')"
            )
        if not isinstance(policy, nn.Module):
            raise TypeError(f"Collector: policy must be a torch.nn.Module, got {type(policy).__name__}")
        for name, mode in greedy_modules(policy):
            warnings.warn(
                f"Collector: the policy's probabilistic module {name!r} has default_interaction_type={mode}, so the "
                "collector acts with it without sampling (TorchRL's collectors would set RANDOM around collection; "
                "this one keeps each module's default, whatever the trainer sets): build it with "
                "default_interaction_type=InteractionType.RANDOM to sample",
                UserWarning,
                stacklevel=2,
            )
        if env_kwargs is not None and not isinstance(envs, str):
            raise ValueError(
                f"Collector: env_kwargs are passed to gymnasium.make_vec with an env id, but envs is a "
                f"{type(envs).__name__}; build them into your vector env or make_envs function instead"
            )
        check_double_buffer(double_buffer, envs)
        if double_buffer and (isinstance(envs, str) or callable(envs)):
            envs, env_kwargs = DoubleBufferedRecipe(envs, env_kwargs=env_kwargs), None
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        backend = _resolve_backend(backend, envs, policy, self.device, num_workers)
        if compile_options and backend in ("process", "ray"):  # e.g. a backend function, sent to the workers
            hint = "pass the backend by its name or as a module-level function"
            check_picklable("compile_policy", compile_options, hint) if backend == "process" else (
                check_ray_picklable("compile_policy", compile_options)
            )  # fmt: skip
        if ray_options is not None and (backend != "ray" or not isinstance(ray_options, Mapping)):
            raise ValueError(
                f"Collector: ray_options must be a dict of Ray actor options, for backend='ray' only; got "
                f"{type(ray_options).__name__} {ray_options!r} with backend={backend!r}"
            )
        if prefetch is None:
            # Measured (README, Performance): on a CPU the thread shares the GIL with the trainer and
            # collecting ahead made training slower; in lockstep it is never slower.
            prefetch = 0 if backend == "thread" and self.device.type == "cpu" else 1
        if not isinstance(envs, (VectorEnv, str)) and not callable(envs):
            raise TypeError(
                f"Collector: envs must be a gymnasium.vector.VectorEnv, an env id str or a function "
                f"make_envs(num_envs) -> VectorEnv, got {type(envs).__name__}"
                + (" (wrap a single env with gymnasium.vector.SyncVectorEnv)" if isinstance(envs, gymnasium.Env) else "")
            )
        if isinstance(envs, VectorEnv):
            if num_envs is not None and num_envs != envs.num_envs:
                raise ValueError(
                    f"Collector: num_envs={num_envs} but the given vector env has num_envs={envs.num_envs}; "
                    "pass num_envs only with an env id or a make_envs function"
                )
            num_envs = envs.num_envs
        elif num_envs is None:
            raise ValueError(f"Collector: num_envs is required with an env id or a function (envs={envs!r}), e.g. num_envs=8")
        _check_int("num_envs", num_envs, minimum=1)
        if num_workers > num_envs:
            raise ValueError(f"Collector: num_workers={num_workers} is more than num_envs={num_envs}; each worker needs an env")
        if double_buffer:
            check_double_buffer_shares(split_envs(num_envs, num_workers))

        self.policy = policy
        self.backend = backend
        self.num_workers = num_workers
        self.num_steps = num_steps
        self.num_envs = num_envs
        self.prefetch = prefetch
        self.timeout = timeout
        self.gamma = float(gamma)
        self.gae_lambda = float(gae_lambda)
        loop_kwargs = {
            "num_steps": num_steps, "check_finite": bool(check_finite), "info_keys": info_specs, "obs_key": obs_key,
        }  # fmt: skip
        if initial_state is not None:
            loop_kwargs["initial_state"] = _initial_state(initial_state, num_envs, obs_key)
        if backend == "thread":
            self._owns_envs = not isinstance(envs, VectorEnv)
            built = envs if isinstance(envs, VectorEnv) else build_envs(envs, num_envs, env_kwargs=env_kwargs)
            try:
                if prefetch == 0:
                    _check_policy_device(policy, self.device)
                    runner = policy
                else:
                    runner = _inference_copy(policy, self.device, backend, prefetch)
                mode = autoreset_mode(built)
                self._placement: ThreadPlacement | ProcessPlacement | RayPlacement = ThreadPlacement(
                    built, runner, owns_envs=self._owns_envs, owns_runner=runner is not policy, device=self.device,
                    seed=seed, autoreset_mode=mode, compile_options=compile_options, **loop_kwargs,
                )  # fmt: skip
            except BaseException:
                if self._owns_envs:
                    built.close()
                raise
            self.envs = built
        else:
            self._owns_envs = True
            runner = _inference_copy(policy, torch.device("cpu"), backend, prefetch)
            # Processes share the acting copy's memory; Ray actors get it through the object store.
            placement, extra = (
                (ProcessPlacement, {}) if backend == "process" else (RayPlacement, {"options": ray_options})
            )
            self._placement = placement(
                envs, runner.share_memory() if backend == "process" else runner, num_envs=num_envs,
                num_workers=num_workers, prefetch=prefetch, device=self.device, seed=seed, env_kwargs=env_kwargs,
                startup_timeout=timeout, compile_options=compile_options, **extra, **loop_kwargs,
            )  # fmt: skip
            mode = AutoresetMode(self._placement.info["autoreset_mode"])
            self.envs = None
        self.autoreset_mode = mode
        self.total_timesteps = total_timesteps
        # The acting copy's tensors by name, refreshed in place from the policy's tensors of the same names
        # (which the trainer may have replaced); None when the thread acts with the policy itself.
        self._acting: dict[str, Tensor] | None = None if runner is policy else dict(_named_weights(runner))
        self._num_batches = None if total_timesteps is None else math.ceil(total_timesteps / (num_steps * num_envs))
        self._delivered = 0  # batches delivered, by earlier collectors (a resumed state's) included
        self._resumed = 0  # of which earlier collectors delivered
        self._error: BaseException | None = None
        self._driven = self._claim(envs) if isinstance(envs, VectorEnv) else None
        self.seed = seed
        self._starts = 1  # collectors over this seed stream, this one included (load_state_dict continues it)
        self.closed = False
        _live.add(self)
        # Nothing is collected before iter() or next(): until then load_state_dict() may still reseed the envs.
        self._placement.start()

    def _claim(self, envs: VectorEnv) -> int:
        """Records this collector as the one stepping ``envs`` (wrappers included); refuses a second one."""
        key = id(envs.unwrapped)
        with _drivers_lock:
            other = _drivers.get(key)
            if other is not None:
                raise ValueError(
                    f"Collector: envs is already driven by another open {other!r}; two collectors stepping one "
                    "vector env corrupt each other's trajectories: close that one first (close() or a with block) "
                    "or give each collector its own vector env"
                )
            _drivers[key] = self
        return key

    # -- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[TensorDict]:
        if self._error is None and self._num_batches is not None and self._delivered >= self._num_batches:
            # A second `for` over a finished collector would silently train on nothing.
            raise RuntimeError(
                f"Collector: cannot iterate again: the collector already delivered all {self._num_batches} batches "
                f"of total_timesteps={self.total_timesteps}; create a new Collector"
            )
        if not self.closed and self._error is None:
            self._request(ahead=self.prefetch)  # collection starts here (or at the first next())
        return self

    def __next__(self) -> TensorDict:
        if self._error is not None:
            raise RuntimeError(
                "Collector: cannot iterate after the background collection failed with "
                f"{type(self._error).__name__}: {self._error}; create a new Collector"
            )
        if self.closed:
            if self._num_batches is not None and self._delivered >= self._num_batches:
                raise StopIteration
            raise RuntimeError("Collector: cannot iterate a closed collector; create a new Collector")
        if self._num_batches is not None and self._delivered >= self._num_batches:
            self.close()
            raise StopIteration
        # Ctrl-C can land anywhere in here; a later call then picks up where this one stopped.
        self.update_policy()
        self._request(ahead=self.prefetch + 1)
        placement = self._placement
        ready = placement.ready
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        if placement.wait(deadline):
            batch, error = ready[0]
            if error is None:
                # In place, so that a call interrupted in here is redone on the same batch.
                add_advantages(batch, gamma=self.gamma, gae_lambda=self.gae_lambda)
                # From here to the return no call is made, so no signal handler runs: the batch cannot be lost.
                del ready[0]
                self._delivered += 1
                return batch
        else:
            error = TimeoutError(
                f"Collector: no batch within timeout={self.timeout} s; the env or the policy is stuck "
                f"(backend={self.backend!r}, autoreset_mode={self.autoreset_mode.value}, num_envs={self.num_envs}); "
                "the collector is closed"
                + (" and its thread is left to stop when the stuck call returns" if self.backend == "thread" else "")
            )
        self._error = error
        # After a timeout the thread is stuck: waiting for it in close() would hang as well.
        self._shut_down(join_timeout=0.0 if isinstance(error, TimeoutError) else _JOIN_TIMEOUT)
        raise error

    def _request(self, *, ahead: int) -> None:
        """Asks for batches until ``ahead`` are asked beyond those delivered (never past ``total_timesteps``).

        Counted by the placement together with each request: a request that an interrupted call made is not
        made again, so collection never runs more than ``prefetch`` batches ahead.
        """
        # The placement counts its own requests; batches of earlier collectors (load_state_dict) are not its.
        wanted = self._delivered - self._resumed + ahead
        if self._num_batches is not None:
            wanted = min(wanted, self._num_batches - self._resumed)
        while self._placement.requested < wanted:
            self._placement.request()

    def __len__(self) -> int:
        """Batches this collector delivers in all: those of ``total_timesteps`` left after a resumed state's."""
        if self._num_batches is None:
            raise TypeError("Collector: len() needs total_timesteps; this collector is endless")
        return max(0, self._num_batches - self._resumed)

    # -- weights ---------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Number of weight refreshes so far; rows store the version that produced them."""
        return self._placement.version

    def update_policy(self) -> None:
        """Copies the weights of ``policy`` into the collector's acting copy now.

        Called automatically each time the next batch is requested. Call it
        yourself after an update that happens in the middle of an iteration.
        """
        dst, src = self._weight_pairs()
        with torch.no_grad():
            self._placement.refresh(dst, src)

    def _weight_pairs(self) -> tuple[list[Tensor], list[Tensor]]:
        """The acting copy's tensors and the policy's current ones of the same names, to copy in that order.

        Pairing by name on every refresh follows tensors the trainer replaced
        (``load_state_dict(assign=True)``, a new submodule); a change of names or
        shapes raises before anything is copied.
        """
        if self._acting is None:
            return [], []
        src, dst = dict(_named_weights(self.policy)), self._acting
        _check_same_structure(src, dst, _copy_reason(self.backend, self.prefetch)[0])
        return [dst[name] for name in src], list(src.values())

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a new collector needs to carry on where this one stands, for a checkpoint.

        Returns:
            A dict of plain ints (``torch.save`` and ``pickle`` it as it is):
            ``batches`` and ``env_steps`` delivered, ``policy_version``, and the
            seed stream (``seed``, ``starts``: collectors that have reset the envs
            from it), with ``num_steps`` and ``num_envs`` to check it against.

        What it cannot hold is the envs' own state: episodes in progress (and
        the batches collected ahead but not delivered) are lost, and a resumed
        collector starts every env on a new episode.
        """
        return {
            "batches": self._delivered,
            "env_steps": self._delivered * self.num_steps * self.num_envs,
            "policy_version": self.policy_version,
            "seed": self.seed,
            "starts": self._starts,
            "num_steps": self.num_steps,
            "num_envs": self.num_envs,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Carries on from the :meth:`state_dict` of an earlier collector; call it before iterating.

        Afterwards this collector counts on from the batches delivered (with
        ``total_timesteps`` it delivers only those left of the budget, and
        ``len()`` counts those),
        :attr:`policy_version` and the rows' ``policy_version`` continue from the
        saved one, and the envs are reset from the next part of the seed stream:
        the ``k``-th collector over ``seed`` (``k = starts``) resets env ``j``
        with ``seed + k * num_envs + j``, so a resumed run never replays the
        episodes its first part began with. Pass the same ``seed`` as before to
        continue the same stream.

        Raises:
            RuntimeError: once collection has started (``iter()`` or ``next()``), or on a closed collector.
            ValueError: for a state that is not a :meth:`state_dict` or was saved
                with another ``num_steps * num_envs``.
        """
        if self.closed:
            raise RuntimeError("Collector.load_state_dict: the collector is closed; create a new Collector")
        if self._delivered or self._placement.requested:
            raise RuntimeError(
                "Collector.load_state_dict: must be called before iterating (this collector has started "
                "collecting); create a new Collector and load the state into it before iter() or next()"
            )
        keys = ("batches", "policy_version", "starts", "num_steps", "num_envs")
        if not isinstance(state, Mapping) or any(not isinstance(state.get(k), int) for k in keys):
            raise ValueError(
                f"Collector.load_state_dict: expected the dict of Collector.state_dict() with int entries "
                f"{list(keys)}, got {state!r}"
            )
        saved, now = state["num_steps"] * state["num_envs"], self.num_steps * self.num_envs
        if saved != now:
            raise ValueError(
                f"Collector.load_state_dict: the state counts batches of num_steps * num_envs = "
                f"{state['num_steps']} * {state['num_envs']} = {saved} env steps, this collector's are "
                f"{self.num_steps} * {self.num_envs} = {now}; resume with the same batch size"
            )
        self._placement.set_version(state["policy_version"])
        self._delivered = self._resumed = state["batches"]
        self._starts = state["starts"] + 1
        if self.seed is not None:
            self._placement.reseed(self.seed + state["starts"] * self.num_envs)

    def __reduce__(self) -> Any:
        raise TypeError(
            "Collector cannot be pickled or copied: it runs a thread or worker processes that step live envs; "
            "save collector.state_dict() and load it into a new Collector with load_state_dict()"
        )

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the background collection and closes the envs the collector created. Idempotent."""
        self._shut_down(join_timeout=_JOIN_TIMEOUT)

    def _shut_down(self, *, join_timeout: float, at_exit: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        with _drivers_lock:
            if self._driven is not None and _drivers.get(self._driven) is self:
                del _drivers[self._driven]
        placement = self._placement
        if placement.name == "process":
            self._acting = None  # the shared-memory copy goes with the workers
        on_own_thread = threading.current_thread() is getattr(placement, "thread", None)
        if not placement.close(join_timeout) and join_timeout > 0 and not on_own_thread:
            when = "at interpreter exit " if at_exit else ""
            warnings.warn(
                f"Collector.close: {when}the background thread did not stop within {join_timeout} s; it is left "
                f"running as a daemon, inside {placement.stuck_in()}",
                RuntimeWarning,
                stacklevel=3,
            )

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.close()

    def __repr__(self) -> str:
        return (
            f"Collector(backend={getattr(self, 'backend', None)!r}, num_workers={getattr(self, 'num_workers', None)}, "
            f"num_envs={getattr(self, 'num_envs', None)}, num_steps={getattr(self, 'num_steps', None)}, "
            f"device={getattr(self, 'device', None)}, prefetch={getattr(self, 'prefetch', None)}, "
            f"autoreset_mode={getattr(getattr(self, 'autoreset_mode', None), 'value', None)}, closed={self.closed})"
        )


def _check_int(name: str, x: Any, *, minimum: int) -> None:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"Collector: {name} must be an int >= {minimum}, got {type(x).__name__} {x!r}")
    if x < minimum:
        raise ValueError(f"Collector: {name} must be an int >= {minimum}, got {x}")


def _resolve_backend(
    backend: str, envs: Any, policy: nn.Module, device: torch.device, num_workers: int
) -> str:
    """The placement for ``backend``; "auto": worker processes for a CPU policy when they can be used."""
    if backend not in _BACKENDS:
        raise ValueError(f"Collector: backend must be one of {list(_BACKENDS)}, got {backend!r}")
    if backend == "thread" and num_workers != 1:
        raise ValueError(
            f"Collector: num_workers={num_workers} needs backend='process' or backend='ray'; the thread runs one loop"
        )
    if backend == "auto":
        if device.type != "cpu" or isinstance(envs, VectorEnv) or not _can_travel(envs, policy):
            if num_workers != 1:
                raise ValueError(
                    f"Collector: num_workers={num_workers} needs backend='process'; backend='auto' chose the "
                    f"thread (device={device}, envs={type(envs).__name__})"
                )
            return "thread"
        return "process"
    if backend == "ray":
        if isinstance(envs, VectorEnv):
            raise TypeError(
                f"Collector(backend='ray'): envs is a live {type(envs).__name__}, but each Ray worker builds its own "
                "envs; pass an env id with num_envs (and env_kwargs), or a function make_envs(num_envs) -> VectorEnv"
            )
        check_ray_picklable("envs", envs)
        check_ray_picklable("policy", policy)
    if backend == "process":
        if isinstance(envs, VectorEnv):
            raise TypeError(
                f"Collector(backend='process'): envs is a live {type(envs).__name__}, but each worker process "
                "builds its own envs; pass an env id with num_envs (and env_kwargs), or a picklable function "
                "make_envs(num_envs) -> VectorEnv (e.g. functools.partial(gymnasium.make_vec, 'CartPole-v1'))"
            )
        hint = "define it at module level (not a lambda or a local function) or use backend='thread'"
        check_picklable("envs", envs, hint)
        check_picklable("policy", policy, "make it picklable or use backend='thread'")
        for name, obj in (("envs", envs), ("policy", policy)):
            if not _importable_in_worker(obj):
                raise TypeError(
                    f"Collector(backend='process'): {name} is defined in an interactive __main__ (a notebook or "
                    f"the REPL), which worker processes cannot import; {hint}"
                )
    return backend


def _can_travel(envs: Any, policy: nn.Module) -> bool:
    """Whether ``envs`` and ``policy`` can be sent to a worker process (``backend="auto"``)."""
    try:
        pickle.dumps(envs)
        pickle.dumps(policy)
    except Exception:
        return False
    return _importable_in_worker(envs) and _importable_in_worker(policy)


def _importable_in_worker(obj: Any) -> bool:
    """False for objects of a ``__main__`` that has no file (a notebook): workers cannot re-import it."""
    module = getattr(obj, "__module__", None) or type(obj).__module__
    if isinstance(obj, functools.partial):
        module = getattr(obj.func, "__module__", module)
    main = sys.modules.get("__main__")
    return not (module == "__main__" and getattr(main, "__file__", None) is None)


# Keys of the batch and of a recurrent policy's call: initial_state's entries cannot use them (nor obs_key).
_STATE_RESERVED_KEYS = _BATCH_KEYS | {"value", "state_value", "log_prob", "is_init", "next", "next_state"}


def _initial_state(initial_state: Any, num_envs: int, obs_key: str) -> TensorDictBase:
    """``initial_state`` as a TensorDict ``[num_envs, ...]`` on the CPU (workers take their rows of it)."""
    given = initial_state
    if callable(initial_state) and not isinstance(initial_state, (TensorDictBase, Mapping)):
        initial_state = initial_state(num_envs)
    if isinstance(initial_state, Mapping):
        initial_state = TensorDict(dict(initial_state), batch_size=[])
    if not isinstance(initial_state, TensorDictBase):
        raise TypeError(
            "Collector: initial_state must be a TensorDict of [num_envs, ...] tensors or a function "
            f"initial_state(num_envs) returning one, got {type(given).__name__}"
            + ("" if initial_state is given else f" returning {type(initial_state).__name__}")
        )
    leaves = list(initial_state.items(include_nested=True, leaves_only=True))
    if not leaves:
        raise ValueError("Collector: initial_state has no entries; pass initial_state=None for a policy without state")
    for key, tensor in leaves:
        if tensor.dim() == 0 or tensor.shape[0] != num_envs:
            raise ValueError(
                f"Collector: initial_state entry {key!r} has shape {tuple(tensor.shape)}, expected a leading size of "
                f"num_envs={num_envs} (one row per env)"
            )
    clash = sorted(key for key in initial_state.keys() if key in _STATE_RESERVED_KEYS | {obs_key})
    if clash:
        raise ValueError(
            f"Collector: initial_state entries {clash} would overwrite keys of the batch; the batch stores the state "
            f"at initial_state's own keys, so name them otherwise (e.g. 'h', 'c', or 'recurrent_state_h')"
        )
    state = initial_state.detach().to("cpu").clone()
    state.batch_size = [num_envs]
    return state


def _check_policy_device(policy: nn.Module, device: torch.device) -> None:
    for name, tensor in _named_weights(policy):
        if tensor.device != device:
            raise ValueError(
                f"Collector: with prefetch=0 the policy runs as given, but its tensor {name!r} is on "
                f"{tensor.device}, not on device={device}; call policy.to({str(device)!r}) first"
            )


def _copy_reason(backend: str, prefetch: int) -> tuple[str, str]:
    """The argument that makes the collector act with a copy of the policy, and the arguments that avoid it."""
    if backend in ("process", "ray"):
        return f"backend={backend!r}", "backend='thread' with prefetch=0"
    return f"prefetch={prefetch}", "prefetch=0"


def _inference_copy(policy: nn.Module, device: torch.device, backend: str, prefetch: int) -> nn.Module:
    """The acting copy of ``policy``: on ``device``, without gradients."""
    why, fix = _copy_reason(backend, prefetch)
    for name, tensor in _named_weights(policy):
        if is_lazy(tensor):
            raise ValueError(
                f"Collector: {why} copies the policy when the Collector is built, but its parameter {name!r} is "
                "uninitialized (a lazy module such as nn.LazyLinear); run the policy once on a batch of "
                f"observations before building the Collector, or pass {fix} to act with the module itself"
            )
    try:
        runner = copy.deepcopy(policy)
    except Exception as exc:
        raise TypeError(
            f"Collector: {why} copies the policy but copy.deepcopy({type(policy).__name__}) failed ({exc}); "
            f"make it deep-copyable or pass {fix} to act with the module itself"
        ) from exc
    runner.to(device)
    runner.requires_grad_(False)
    runner.eval()  # the collector always acts in eval mode (see call_policy)
    return runner


def _named_weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _check_same_structure(src: dict[str, Tensor], dst: dict[str, Tensor], why: str) -> None:
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


@atexit.register
def _close_all() -> None:
    # Runs before interpreter teardown: stop threads while the env code can still run.
    for collector in list(_live):
        collector._shut_down(join_timeout=_EXIT_JOIN_TIMEOUT, at_exit=True)
