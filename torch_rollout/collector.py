"""The Collector: rollout collection of ``[num_steps, num_envs]`` TensorDict batches beside training."""

from __future__ import annotations

import atexit
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Concatenate, ParamSpec

import gymnasium
import torch
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from tensordict import TensorDict, TensorDictBase
from torch import nn

from torch_rollout.envs._isaac_lab import adapt_isaac_lab
from torch_rollout.gae import GAE, add_advantages
from torch_rollout.loop._arguments import (
    check_envs,
    check_options,
    check_policy,
    check_shares,
    loop_spec,
    resolve_device,
    resolve_num_envs,
)
from torch_rollout.loop._checkpoint import Progress
from torch_rollout.loop._compile import check_compile_policy
from torch_rollout.loop._direct import Sink
from torch_rollout.loop._seed import Seed, resolve_seed, seed_step
from torch_rollout.loop._spec import BatchKeys, CudaGraph
from torch_rollout.loop._stats import Stats, StatsClock, tuned_key, tuned_slower
from torch_rollout.loop._weights import WeightPairs
from torch_rollout.placements._backends import Backend, resolve_backend
from torch_rollout.placements._env_calls import EnvCalls
from torch_rollout.placements._protocol import Placement
from torch_rollout.util._grad import NoGrad
from torch_rollout.util._warnings import warn

__all__ = ["Collector"]

# How long close() waits for the background thread; a thread stuck in an env's
# step past this is left behind (it is a daemon) with a warning.
_JOIN_TIMEOUT = 10.0
# At interpreter exit nobody can use a stuck thread any more: wait less before leaving it.
_EXIT_JOIN_TIMEOUT = 2.0
_live: weakref.WeakSet[Collector] = weakref.WeakSet()
# id(envs.unwrapped) -> the open collector stepping that live vector env: a second one would interleave
# its steps with the first one's. Reentrant: a collector's __del__ may run (gc) while it is held.
_drivers: weakref.WeakValueDictionary[int, Collector] = weakref.WeakValueDictionary()
_drivers_lock = threading.RLock()
# Keywords of earlier releases -> their spelling now.
_RETIRED = {
    "num_workers": "backend=torch_rollout.Processes(num_workers={v!r}) (or torch_rollout.Ray(num_workers={v!r}))",
    "ray_options": "backend=torch_rollout.Ray(num_workers=..., options={v!r})",
    "env_kwargs": "envs=torch_rollout.gym_envs(env_id, **{v!r})",
    "double_buffer": "envs=torch_rollout.double_buffered(env_id or make_envs)",
    "gamma": "gae=torch_rollout.GAE(gamma={v!r})",
    "gae_lambda": "gae=torch_rollout.GAE(gae_lambda={v!r})",
    "info_keys": "keys=torch_rollout.BatchKeys(info_keys={v!r})",
    "obs_key": "keys=torch_rollout.BatchKeys(obs_key={v!r})",
}


_P = ParamSpec("_P")


def _retired_keywords(init: Callable[Concatenate[Collector, _P], None]) -> Callable[Concatenate[Collector, _P], None]:
    """Refuses the keywords of :data:`_RETIRED` with a TypeError that gives each one's new spelling.

    ``__init__``'s signature stays the one that type checkers see.
    """

    @functools.wraps(init)
    def checked(self: Collector, /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        retired = [name for name in kwargs if name in _RETIRED]
        if retired:
            self.closed = True
            fixes = "; ".join(f"{name}= is now {_RETIRED[name].format(v=kwargs[name])}" for name in retired)
            raise TypeError(f"Collector: {fixes}")
        init(self, *args, **kwargs)

    return checked


class Collector:
    """Collects rollouts of gymnasium vector envs with a torch policy, beside the training loop.

    ``for batch in collector`` yields a :class:`tensordict.TensorDict` with
    ``batch_size=[num_steps, num_envs]`` on ``device`` per iteration, while the
    next batch is being collected. Row ``t`` of env ``i`` is one call of
    ``envs.step``: ``obs`` (named by ``keys``), every policy output
    (``action``, ``log_prob``, ``value``, ...), ``reward``, ``terminated``,
    ``truncated``, ``done``, ``mask`` (False for NEXT_STEP reset rows, which are
    no transition), ``next_value`` (the value of the true next state: at an
    episode end of the final observation), ``advantage`` and ``return`` (with
    ``gae``), ``episode_return``, ``episode_length``, ``policy_version``,
    with ``keys=BatchKeys(info_keys=...)`` ``info`` and, with
    ``keys=BatchKeys(next_obs=True)``, ``next_obs`` (the true next observation:
    at an episode end the final one).

    The whole contract (keys, autoreset modes, bootstrapping, acting mode,
    policy lag, errors) is in ``docs/contract.md``; ``docs/`` has a page each
    on placements, env kinds (EnvPool, double-buffering), infos, recurrent
    policies, compiled acting, checkpoints and data-parallel ranks.

    Args:
        envs: a :class:`gymnasium.vector.VectorEnv` in any autoreset mode (thread only),
            an env id for :func:`gymnasium.make_vec`, or a function ``make_envs(num_envs)``
            (or ``make_envs(num_envs, start_index=...)``) returning a vector env:
            :func:`torch_rollout.gym_envs` (an id with keyword arguments),
            :func:`torch_rollout.envpool_envs`, :func:`torch_rollout.double_buffered`; or
            Isaac Lab's own env (``gym.make(task, cfg=env_cfg)``), or a function returning one,
            taken as :class:`torch_rollout.envs.FromIsaacLab`.
        policy: ``policy(obs) -> Mapping[str, Tensor] | TensorDict`` on ``[n, ...]``
            observations (``num_envs`` rows on the thread, a worker's share of them in
            worker processes and Ray actors, fewer in bootstrap calls on final
            observations) with at least ``"action"`` (``[n, ...]``) and optionally
            ``"value"`` (``[n]`` or ``[n, 1]``; TorchRL's
            ``"state_value"`` when there is no ``"value"``) and ``"log_prob"``; a
            ``tensordict.nn.TensorDictModule`` reads ``obs_key``. With a
            ``get_value`` method, bootstraps call that instead of the forward.
        num_steps: steps per env per batch (``T``).
        num_envs: number of envs to build when ``envs`` is an env id or a function.
        backend: where the loop runs: ``"thread"``, ``"process"``, ``"ray"``, ``"auto"``
            (worker processes for a CPU policy with an env id or a picklable function that
            they can import, else the thread), or :class:`Thread`, :class:`Processes` (``num_workers``),
            :class:`Ray` (``num_workers``, actor ``options``); :attr:`backend` names the choice.
        device: where the policy runs and batches live; ``None``: ``"cuda"`` when
            available, else ``"cpu"``.
        gae: the advantages added to each batch, :class:`GAE` (``gamma``,
            ``gae_lambda``); ``None``: no ``advantage`` and ``return``.
        total_timesteps: stop after ``ceil(total_timesteps / (T * num_envs))``
            batches; ``None``: endless.
        prefetch: batches collected ahead of the consumer; 0: lockstep (on the thread without
            ``timeout``: inside ``next()``, in the calling thread); ``None``: 1, except 0 for the
            thread with a CPU policy (measured faster there).
        seed: seed of the envs' first reset (env ``j``: ``seed + j``, in every placement), an int
            or a :class:`Seed` that keys it by the rank of data-parallel collectors (an int is
            ``Seed(seed)``: keyed by the ``torch.distributed`` rank when a process group is
            initialised); ``None``: unseeded. See ``docs/data-parallel.md``.
        timeout: seconds ``next()`` waits for a batch before raising ``TimeoutError``
            (an env that hangs); ``None``: wait forever.
        check_finite: raise ``ValueError`` naming the key, env and step when an
            observation, a reward or a Box action is NaN or infinite.
        keys: :class:`BatchKeys`: the observations' key (``obs_key``), the env
            infos kept in ``batch["info"]`` (``info_keys``), and whether rows keep their
            true next observation (``next_obs``, for off-policy learners).
        initial_state: a recurrent policy's initial state, a TensorDict of
            ``[num_envs, ...]`` tensors or a function ``initial_state(num_envs)``
            returning one; the policy is then called as ``policy(obs, state, is_init)``.
        compile_policy: act through ``torch.compile``: ``True``, or a dict of its
            keyword arguments; or :class:`CudaGraph`: replay a CUDA graph of the
            forward (a policy on a CUDA device); ``False`` (default): eager.

    Raises:
        TypeError: for an unsupported space or argument type, and for a keyword
            that has a new spelling (the message gives it).
        ValueError: for an out-of-range argument, a ``device`` this machine does
            not have (CUDA or MPS unavailable, a CUDA index past the last GPU),
            an unknown env id, a live vector env that another open collector
            steps, or a lazy policy (``nn.LazyLinear``) not run yet that the
            collector must copy.

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
    single_observation_space: gymnasium.Space[Any]  # one env's: ready at construction, on every placement
    single_action_space: gymnasium.Space[Any]
    policy: nn.Module
    _backend: str
    num_workers: int
    num_steps: int
    num_envs: int
    device: torch.device
    gae: GAE | None
    keys: BatchKeys
    prefetch: int
    total_timesteps: int | None
    seed: Seed | None
    closed: bool

    @_retired_keywords
    def __init__(
        self,
        envs: VectorEnv | gymnasium.Env | str | Callable[..., VectorEnv | gymnasium.Env],
        policy: nn.Module,
        *,
        num_steps: int,
        num_envs: int | None = None,
        backend: str | Backend = "auto",
        device: torch.device | str | None = None,
        gae: GAE | None = GAE(),
        total_timesteps: int | None = None,
        prefetch: int | None = None,
        seed: int | Seed | None = None,
        timeout: float | None = None,
        check_finite: bool = False,
        keys: BatchKeys = BatchKeys(),
        initial_state: TensorDictBase | Callable[[int], TensorDictBase] | None = None,
        compile_policy: bool | Mapping[str, Any] | CudaGraph = False,
    ) -> None:
        self.closed = True  # until fully built, so that __del__ of a failed init is a no-op
        check_options(num_steps, total_timesteps, keys, timeout)
        _check_gae(gae)
        seeding = resolve_seed(seed)
        compile_options = check_compile_policy(compile_policy)
        check_policy(policy)
        given = envs  # Isaac Lab's own env, which the collector adapts: claimed as itself, not as the adapter
        envs = adapt_isaac_lab(envs)
        check_envs(envs)
        self.device = resolve_device(device)
        chosen = resolve_backend(backend, envs, policy, self.device)
        chosen.check(envs, policy, compile_options)
        num_envs = resolve_num_envs(envs, num_envs)
        check_shares(envs, num_envs, chosen.num_workers)
        spec = loop_spec(
            keys,
            num_steps=num_steps,
            num_envs=num_envs,
            check_finite=check_finite,
            initial_state=initial_state,
            compile_options=compile_options,
        )
        settings = chosen.settings(
            spec,
            num_envs=num_envs,
            device=self.device,
            prefetch=prefetch,
            seed=None if seeding is None else seeding.env_seed(0, num_envs=num_envs),
            # a placement that builds envs anew (a restarted Ray worker) seeds them from its rank's next part
            seed_step=seed_step(seeding, num_envs),
            timeout=timeout,
        )
        self.policy, self.gae, self.keys, self.seed = policy, gae, keys, seeding
        self._backend, self.num_workers, self.prefetch = chosen.name, chosen.num_workers, settings.prefetch
        self.num_steps, self.num_envs = num_steps, num_envs
        self.timeout, self.total_timesteps = timeout, total_timesteps
        self._weight_pairs = WeightPairs(policy, settings.copy_why, settings.copy_fix)
        self._placement: Placement = chosen.build(envs, policy, settings)
        self.envs = self._placement.envs
        self.single_observation_space, self.single_action_space = self._placement.spaces
        self._setting = chosen.verdict_setting(settings, live_envs=isinstance(envs, VectorEnv))
        self._clock = StatsClock()
        self._tuned_key = tuned_key(given, num_envs, num_steps)  # what tune() measured here leaves the verdict
        self._progress = Progress(total_timesteps, num_steps, num_envs)
        self._error: BaseException | None = None
        self._driven = _claim(given if isinstance(given, gymnasium.Env) else envs, self)
        self.closed = False
        _live.add(self)
        # Nothing is collected before iter() or next(): until then load_state_dict() may still reseed the envs.
        self._placement.start()

    # -- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[TensorDict]:
        if self._error is None and self._progress.finished:
            # A second `for` over a finished collector would silently train on nothing.
            raise RuntimeError(
                f"Collector: cannot iterate again: the collector already delivered all {self._progress.total} batches "
                f"of total_timesteps={self.total_timesteps}; create a new Collector"
            )
        if not self.closed and self._error is None:
            self._request(ahead=self.prefetch)  # collection starts here (or at the first next())
        return self

    def __next__(self, sink: Sink | None = None) -> TensorDict:
        """The next batch; ``sink``: offered its rows first (``ReplayRing.fill``), then the rows it took (an int)."""
        if self._error is not None:
            raise RuntimeError(
                "Collector: cannot iterate after the background collection failed with "
                f"{type(self._error).__name__}: {self._error}; create a new Collector"
            )
        if self._progress.finished:
            self.close()
            raise StopIteration
        if self.closed:
            raise RuntimeError("Collector: cannot iterate a closed collector; create a new Collector")
        # Ctrl-C can land anywhere in here; a later call then picks up where this one stopped.
        clock = self._clock
        began = time.perf_counter()
        self.update_policy()
        self._request(ahead=self.prefetch + 1)
        placement = self._placement
        placement.sink = sink if self.gae is None else None  # advantages are written into a batch
        ready = placement.ready
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        waiting = time.perf_counter()
        if placement.wait(deadline):
            batch, error = ready[0]
            if error is None:
                received = time.perf_counter()
                if type(batch) is int and sink is None:  # rows a ReplayRing took, its fill stopped by Ctrl-C
                    del ready[0]
                    self._progress.delivered += 1
                    return self.__next__()
                # In place, so that a call interrupted in here is redone on the same batch.
                add_advantages(batch, self.gae)
                ended = time.perf_counter()
                clock.wait += received - waiting
                clock.work += (waiting - began) + (ended - received)
                clock.delivered += 1
                # From here to the return no call is made, so no signal handler runs: the batch cannot be lost.
                del ready[0]
                self._progress.delivered += 1
                return batch  # an int only to a sink
        else:
            error = TimeoutError(
                f"Collector: no batch within timeout={self.timeout} s; the env or the policy is stuck "
                f"(backend={self.backend!r}, autoreset_mode={self.autoreset_mode.value}, num_envs={self.num_envs}); "
                "the collector is closed"
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
        wanted = self._progress.wanted(ahead)
        while self._placement.requested < wanted:
            self._placement.request()

    @property
    def autoreset_mode(self) -> AutoresetMode:
        """The envs' autoreset mode: declared in their ``metadata``, else NEXT_STEP (gymnasium's default) until
        their step infos carry final observations, then SAME_STEP (see ``docs/envs.md``).

        In worker processes and Ray actors, as of their last batch.
        """
        return self._placement.autoreset_mode

    def __len__(self) -> int:
        """Batches this collector delivers in all: those of ``total_timesteps`` left after a resumed state's."""
        return self._progress.left()

    @property
    def backend(self) -> str:
        """Where the collection loop runs, as ``backend=`` names it: ``"thread"``, ``"process"`` or ``"ray"``.

        With ``backend="auto"`` it is the placement that was chosen; :attr:`num_workers`
        is its number of worker processes or Ray actors (1 for the thread).

        Examples:
            >>> class Policy(nn.Module):
            ...     def forward(self, obs):
            ...         return {"action": torch.zeros(obs.shape[0], dtype=torch.long)}
            >>> envs = gymnasium.make_vec("CartPole-v1", num_envs=2)
            >>> with Collector(envs, Policy(), num_steps=4, device="cpu") as collector:  # a live env: the thread
            ...     collector.backend, collector.num_workers
            ('thread', 1)
            >>> envs.close()
        """
        return self._backend

    @property
    def observation_space(self) -> gymnasium.Space[Any]:
        """The observations of all ``num_envs`` envs, as gymnasium batches :attr:`single_observation_space`: ready
        right after construction on every placement (worker processes and Ray actors report their envs' spaces),
        to size an agent without building an env of its own."""
        return batch_space(self.single_observation_space, self.num_envs)

    @property
    def action_space(self) -> gymnasium.Space[Any]:
        """The actions of all ``num_envs`` envs, batched from :attr:`single_action_space`."""
        return batch_space(self.single_action_space, self.num_envs)

    @property
    def env_calls(self) -> EnvCalls:
        """The envs' ``call``, ``get_attr`` and ``set_attr``, on every placement, between batches: :class:`EnvCalls`."""
        return EnvCalls(self._placement, num_envs=self.num_envs, num_workers=self.num_workers, timeout=self.timeout)

    # -- where the time goes ---------------------------------------------------------------------

    def stats(self, reset: bool = False) -> Stats:
        """The collector's account of its time since it was built or last reset: what bounds the run.

        Always kept, at a few clock reads per env step. ``print(collector.stats())``
        gives one line: frames per second; the collection loops' shares of their
        time stepping the envs (``env``), in the policy's forward (``policy``),
        in the collector's own work (``collector``: rows, bootstraps, infos, and
        in the trainer's thread the weight refresh and GAE) and waiting for the
        trainer to ask for the next batch (``idle``); the share of the trainer's
        time spent waiting in ``next()``; and a verdict that names what bounds
        the run and the change that would help. Worker processes and Ray actors
        each keep their own account (``stats.workers``), sent with each batch.
        ``docs/bottleneck.md`` shows how to read it.

        Args:
            reset: start a new account after this one (e.g. once per logging interval, or after warm-up).

        Returns:
            A :class:`torch_rollout.Stats` (picklable): ``seconds``, ``frames``, ``fps``, ``env``, ``policy``,
            ``collector``, ``idle`` and ``wait`` in seconds, ``shares()``, ``verdict()``, ``workers``.
        """
        accounts = self._placement.accounts()
        stats = self._clock.stats(
            accounts,
            frames_per_batch=self.num_steps * self.num_envs,
            setting=self._setting,
            tuned=tuned_slower(self._tuned_key),
        )
        if reset:
            self._clock.reset(accounts)
        return stats

    # -- weights ---------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Number of weight refreshes so far, the version acting from now on; rows store the version that acted.

        A version counts refreshes (each ``next()`` and each :meth:`update_policy`
        makes one), not weight changes: it rises even when the weights did not
        change. After ``next()`` it is the version just refreshed, not the
        returned batch's: with ``prefetch >= 1`` the batch's rows may be older. The
        batch's versions are ``batch["policy_version"]`` (per row; its ``min()``
        is the oldest), and ``collector.policy_version - int(batch["policy_version"].min())``
        its lag.
        """
        return self._placement.version

    def update_policy(self) -> None:
        """Copies the weights of ``policy`` into the collector's acting copy now.

        Called automatically each time the next batch is requested. Call it
        yourself after an update that happens in the middle of an iteration.
        """
        dst, src = self._weight_pairs(self.policy, self._placement.weights)
        with NoGrad():
            self._placement.refresh(dst, src)

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a new collector needs to carry on where this one stands, for a checkpoint.

        Returns:
            A dict of plain ints (``torch.save`` and ``pickle`` it as it is): ``batches`` and ``env_steps``
            delivered, ``policy_version``, and the seed stream (``seed``, the ``rank`` and ``world_size`` it is
            keyed by, ``starts``: the parts of it used, by collectors that reset the envs and by restarted Ray
            workers), with ``num_steps`` and ``num_envs`` to check it against.

        What it cannot hold is the envs' own state: episodes in progress (and the batches collected ahead but
        not delivered) are lost, and a resumed collector starts every env on a new episode.
        """
        return self._progress.state(self.policy_version, self.seed, self._placement.extra_starts)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Carries on from the :meth:`state_dict` of an earlier collector; call it before iterating.

        Afterwards this collector counts on from the batches delivered (with ``total_timesteps`` it delivers
        only those left of the budget, and ``len()`` counts those), :attr:`policy_version` and the rows'
        ``policy_version`` continue from the saved one, and the envs are reset from the next part of the seed
        stream: the ``k``-th start over ``seed`` (``k = starts``) resets env ``j`` of rank ``r`` of
        ``world_size`` with ``seed + (k * world_size + r) * num_envs + j`` (one rank: ``seed + k * num_envs +
        j``), so a resumed run never replays the episodes its earlier parts began with, nor those of another
        rank. Pass the same ``seed`` as before to continue the same stream; each rank loads the state that its
        own rank saved. The envs are built when the collector is, but not reset until the iteration starts:
        that first reset is the resumed one, so each seed of the stream is used once.

        Raises:
            RuntimeError: once collection has started (``iter()`` or ``next()``), or on a closed collector.
            ValueError: for a state that is not a :meth:`state_dict`, was saved
                with another ``num_steps * num_envs``, or (both seeded) with
                another seed value, rank or world size: a state without ``rank``
                and ``world_size`` (of an earlier release) is rank 0 of 1.
        """
        if self.closed:
            raise RuntimeError("Collector.load_state_dict: the collector is closed; create a new Collector")
        if self._progress.delivered or self._placement.requested:
            raise RuntimeError(
                "Collector.load_state_dict: must be called before iterating (this collector has started "
                "collecting); create a new Collector and load the state into it before iter() or next()"
            )
        env_seed = self._progress.resume(state, self.seed)
        self._placement.set_version(state["policy_version"])
        if env_seed is not None:
            self._placement.reseed(env_seed)

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
        _release(self._driven, self)
        stuck = self._placement.close(join_timeout)
        self._weight_pairs.forget()  # it holds the acting copy's tensors
        if stuck is not None:
            when = "at interpreter exit " if at_exit else ""
            warn(
                f"Collector.close: {when}the background thread did not stop within {join_timeout} s; it is left "
                f"running as a daemon, inside {stuck}",
                RuntimeWarning,
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


def _check_gae(gae: Any) -> None:
    if gae is not None and not isinstance(gae, GAE):
        raise TypeError(
            f"Collector: gae must be a torch_rollout.GAE(gamma=..., gae_lambda=...) or None, got "
            f"{type(gae).__name__} {gae!r}"
        )


def _claim(envs: Any, collector: Collector) -> int | None:
    """Records ``collector`` as the one stepping live ``envs`` (wrappers included); refuses a second one.

    Returns the key that :func:`_release` takes, or None where ``envs`` is a recipe (its envs are the collector's).
    """
    if not isinstance(envs, (VectorEnv, gymnasium.Env)):
        return None
    key = id(envs.unwrapped)
    with _drivers_lock:
        other = _drivers.get(key)
        if other is not None:
            raise ValueError(
                f"Collector: envs is already driven by another open {other!r}; two collectors stepping one "
                "vector env corrupt each other's trajectories: close that one first (close() or a with block) "
                "or give each collector its own vector env"
            )
        _drivers[key] = collector
    return key


def _release(key: int | None, collector: Collector) -> None:
    """Forgets ``collector`` as the one stepping the envs of ``key`` (``_claim``'s), if it still is."""
    with _drivers_lock:
        if key is not None and _drivers.get(key) is collector:
            del _drivers[key]


@atexit.register
def _close_all() -> None:
    # Runs before interpreter teardown: stop threads while the env code can still run.
    for collector in list(_live):
        collector._shut_down(join_timeout=_EXIT_JOIN_TIMEOUT, at_exit=True)
