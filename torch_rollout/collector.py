"""The Collector: background rollout collection of ``[num_steps, num_envs]`` TensorDict batches."""

from __future__ import annotations

import atexit
import copy
import math
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import gymnasium
import torch
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict
from torch import nn

from torch_rollout._spaces import check_action_space, check_obs_space
from torch_rollout._worker import Worker

__all__ = ["Collector"]

# How long close() waits for the background thread; a thread stuck in an env's
# step past this is left behind (it is a daemon) with a warning.
_JOIN_TIMEOUT = 10.0
_live: weakref.WeakSet[Collector] = weakref.WeakSet()


class Collector:
    """Collects rollouts of a gymnasium vector env with a torch policy on a background thread.

    ``for batch in collector`` yields a :class:`tensordict.TensorDict` with
    ``batch_size=[num_steps, num_envs]`` on ``device`` per iteration, while the
    next batch is being collected. Row ``t`` of env ``i`` is one call of
    ``envs.step``:

    ================== ======================================================
    key                meaning
    ================== ======================================================
    ``obs``            observation the action was chosen from (a nested
                       TensorDict for Dict spaces; float64 stored as float32,
                       integer dtypes kept)
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
    ``return``         returns ``"value"``
    ``mask``           False only for rows that are no transition (see below)
    ``episode_return``, running totals of the episode including this step:
    ``episode_length`` the episode's totals where ``done``
    ``policy_version`` version of the weights that chose the action
    ================== ======================================================

    Autoreset: all three gymnasium modes give the same real transitions. In
    NEXT_STEP mode (gymnasium's default) the step after an episode end only
    resets the env; its row has ``mask=False``, ``advantage=0``, and must be
    left out of losses. In SAME_STEP mode the final observation is read from
    ``infos["final_obs"]``; in DISABLED mode the collector resets ended envs
    with ``reset_mask``. A terminated step does not bootstrap, a truncated one
    bootstraps from the value of its final observation (one batched forward
    per step for the envs that ended), and the last row of a batch bootstraps
    from the observation the next batch starts with.

    Weights and policy lag: the policy is called under ``torch.no_grad()``.
    With ``prefetch >= 1`` the collector runs its own copy of the policy and
    refreshes it from ``policy`` whenever the next batch is requested (the
    trainer has finished its update then) and on :meth:`update_policy`; each
    refresh increments :attr:`policy_version`. The thread may collect up to
    ``prefetch`` batches ahead, so a batch's rows may come from weights up to
    ``prefetch`` versions old (plus one per :meth:`update_policy` called by
    hand meanwhile): use the stored ``log_prob`` in importance ratios. With
    ``prefetch=0`` collection runs in lockstep with the consumer, on
    ``policy`` itself, and with a seed (and ``torch.manual_seed`` for the
    policy's sampling) two runs give identical batches.

    Errors: an exception raised by the env or the policy in the background is
    re-raised by ``next()`` with its original traceback, and the collector
    closes; iterating it again raises ``RuntimeError``. Envs the collector
    created are closed by :meth:`close`, which is idempotent and also runs on
    garbage collection and at interpreter exit. Where gymnasium's own error
    hides the cause, the collector names it: a killed AsyncVectorEnv worker
    process becomes a ``RuntimeError`` with its index, pid and signal (the
    broken vector env is shut down, since it can no longer close itself), and
    a sub-env observation of the wrong shape a ``ValueError`` naming the env.

    Hostile input: observations of the wrong shape or of a dtype that would not
    cast safely, actions outside a Discrete, MultiDiscrete or MultiBinary
    space and policy outputs on another device raise ``ValueError`` naming the
    key, what was received and what was expected. NaN and inf in observations
    and rewards pass through unchanged (they are valid floats, and some envs
    use inf on purpose) unless ``check_finite=True``.

    Args:
        envs: a :class:`gymnasium.vector.VectorEnv` in any autoreset mode, or an
            env id for :func:`gymnasium.make_vec` (then ``num_envs`` is required).
        policy: ``policy(obs) -> Mapping[str, Tensor] | TensorDict`` with at least
            ``"action"`` (``[num_envs, *action_shape]``) and optionally ``"value"``
            (``[num_envs]`` or ``[num_envs, 1]``) and ``"log_prob"``. ``obs`` is
            ``[num_envs, *obs_shape]`` on ``device`` (a TensorDict for Dict
            spaces). A ``tensordict.nn.TensorDictModule`` reads ``"obs"``.
        num_steps: steps per env per batch (``T``).
        num_envs: number of envs to build when ``envs`` is an env id.
        gamma: discount factor.
        gae_lambda: GAE lambda.
        device: where the policy runs and batches live; ``None``: ``"cuda"``
            when available, else ``"cpu"``.
        total_timesteps: stop after ``ceil(total_timesteps / (T * num_envs))``
            batches; ``None``: endless.
        prefetch: batches the thread may collect ahead of the consumer; 0: lockstep.
        seed: seed of the envs' first reset.
        timeout: seconds ``next()`` waits for a batch before raising
            ``TimeoutError`` (an env that hangs); ``None``: wait forever. The
            stuck thread cannot be interrupted: it is left behind as a daemon,
            stops when the stuck call returns, and then closes the envs the
            collector created.
        check_finite: raise ``ValueError`` naming the key, env and step when an
            observation or reward is NaN or infinite (costs one
            ``np.isfinite`` per step).

    Raises:
        TypeError: for an unsupported space or argument type.
        ValueError: for an out-of-range argument or an unknown env id.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> class RandomPolicy(nn.Module):
        ...     def forward(self, obs):
        ...         n = obs.shape[0]
        ...         return {"action": torch.randint(0, 2, (n,)), "value": torch.zeros(n)}
        >>> with Collector("CartPole-v1", RandomPolicy(), num_envs=4, num_steps=16,
        ...                total_timesteps=128, device="cpu", seed=0) as collector:
        ...     for batch in collector:
        ...         pass
        >>> batch.batch_size
        torch.Size([16, 4])
        >>> sorted(batch.keys())[:5]
        ['action', 'advantage', 'done', 'episode_length', 'episode_return']
        >>> collector.closed
        True
    """

    envs: VectorEnv
    policy: nn.Module
    num_steps: int
    num_envs: int
    device: torch.device
    prefetch: int
    autoreset_mode: AutoresetMode
    closed: bool

    def __init__(
        self,
        envs: VectorEnv | str,
        policy: nn.Module,
        *,
        num_steps: int,
        num_envs: int | None = None,
        gamma: float = 0.99,
        gae_lambda: float = 0.95,
        device: torch.device | str | None = None,
        total_timesteps: int | None = None,
        prefetch: int = 1,
        seed: int | None = None,
        timeout: float | None = None,
        check_finite: bool = False,
    ) -> None:
        self.closed = True  # until fully built, so that __del__ of a failed init is a no-op
        _check_int("num_steps", num_steps, minimum=1)
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
        if not isinstance(policy, nn.Module):
            raise TypeError(f"Collector: policy must be a torch.nn.Module, got {type(policy).__name__}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

        self._owns_envs = isinstance(envs, str)
        envs = _make_envs(envs, num_envs)
        try:
            check_obs_space(envs.single_observation_space)
            check_action_space(envs.single_action_space)
            mode = AutoresetMode(envs.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
            if prefetch == 0:
                _check_policy_device(policy, self.device)
                runner = policy
            else:
                runner = _inference_copy(policy, self.device)
        except BaseException:
            if self._owns_envs:
                envs.close()
            raise

        self.envs = envs
        self.policy = policy
        self.num_steps = num_steps
        self.num_envs = envs.num_envs
        self.prefetch = prefetch
        self.autoreset_mode = mode
        self.timeout = timeout
        self._num_batches = None if total_timesteps is None else math.ceil(total_timesteps / (num_steps * envs.num_envs))
        self._delivered = 0
        self._error: BaseException | None = None
        # (inference param, user param) pairs copied on each refresh; empty in lockstep.
        self._weight_pairs = [] if runner is policy else _weight_pairs(runner, policy)
        self._runner = runner
        self._worker = Worker(
            envs,
            runner,
            num_steps=num_steps,
            gamma=gamma,
            gae_lambda=gae_lambda,
            device=self.device,
            num_batches=self._num_batches,
            prefetch=prefetch,
            seed=seed,
            autoreset_mode=mode,
            check_finite=bool(check_finite),
            owns_envs=self._owns_envs,
        )
        self.closed = False
        _live.add(self)
        self._worker.thread.start()

    # -- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[TensorDict]:
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
        self.update_policy()
        self._worker.credits.put(None)
        batch, error = self._wait_for_result()
        if error is not None:
            self._error = error
            # After a timeout the thread is stuck: waiting for it in close() would hang as well.
            self._shut_down(join_timeout=0.0 if isinstance(error, TimeoutError) else _JOIN_TIMEOUT)
            raise error
        self._delivered += 1
        return batch

    def _wait_for_result(self) -> tuple[TensorDict | None, BaseException | None]:
        worker = self._worker
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            try:
                # A short poll so that a thread that died without a word is noticed.
                return worker.results.get(timeout=0.25)
            except queue.Empty:
                pass
            if not worker.thread.is_alive() and worker.results.empty():
                return None, RuntimeError("Collector: the background thread exited without producing a batch")
            if deadline is not None and time.monotonic() > deadline:
                return None, TimeoutError(
                    f"Collector: no batch within timeout={self.timeout} s; the env or the policy is stuck "
                    f"(autoreset_mode={self.autoreset_mode.value}, num_envs={self.num_envs}); the collector "
                    "is closed and its thread is left to stop when the stuck call returns"
                )

    def __len__(self) -> int:
        if self._num_batches is None:
            raise TypeError("Collector: len() needs total_timesteps; this collector is endless")
        return self._num_batches

    # -- weights ---------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Number of weight refreshes so far; rows store the version that produced them."""
        return self._worker.version

    def update_policy(self) -> None:
        """Copies the weights of ``policy`` into the collector's inference copy now.

        Called automatically each time the next batch is requested. Call it
        yourself after an update that happens in the middle of an iteration.
        """
        worker = self._worker
        with worker.lock, torch.no_grad():
            for dst, src in self._weight_pairs:
                dst.copy_(src)
            if self._runner is not self.policy:
                self._runner.train(self.policy.training)
            worker.version += 1

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the background thread and closes the envs the collector created. Idempotent."""
        self._shut_down(join_timeout=_JOIN_TIMEOUT)

    def _shut_down(self, *, join_timeout: float) -> None:
        if self.closed:
            return
        self.closed = True
        worker = self._worker
        worker.stop.set()
        worker.credits.put(None)  # wakes a thread waiting for the next request
        # Garbage collection can run __del__ on the collector's own thread, which cannot join itself.
        on_worker = threading.current_thread() is worker.thread
        if not on_worker:
            worker.thread.join(join_timeout)
        if not worker.abandon():  # still running: it closes the envs it owns when it stops
            if join_timeout > 0 and not on_worker:
                warnings.warn(
                    f"Collector.close: the background thread did not stop within {join_timeout} s "
                    "(an env step or policy call is stuck); it is left running as a daemon",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        if self._owns_envs:
            self.envs.close()

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.close()

    def __repr__(self) -> str:
        return (
            f"Collector(num_envs={getattr(self, 'num_envs', None)}, num_steps={getattr(self, 'num_steps', None)}, "
            f"device={getattr(self, 'device', None)}, prefetch={getattr(self, 'prefetch', None)}, "
            f"autoreset_mode={getattr(getattr(self, 'autoreset_mode', None), 'value', None)}, closed={self.closed})"
        )


def _check_int(name: str, x: Any, *, minimum: int) -> None:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"Collector: {name} must be an int >= {minimum}, got {type(x).__name__} {x!r}")
    if x < minimum:
        raise ValueError(f"Collector: {name} must be an int >= {minimum}, got {x}")


def _make_envs(envs: VectorEnv | str, num_envs: int | None) -> VectorEnv:
    if isinstance(envs, VectorEnv):
        if num_envs is not None and num_envs != envs.num_envs:
            raise ValueError(
                f"Collector: num_envs={num_envs} but the given vector env has num_envs={envs.num_envs}; "
                "pass num_envs only with an env id"
            )
        return envs
    if not isinstance(envs, str):
        raise TypeError(
            f"Collector: envs must be a gymnasium.vector.VectorEnv or an env id str, got {type(envs).__name__}"
            + (" (wrap a single env with gymnasium.vector.SyncVectorEnv)" if isinstance(envs, gymnasium.Env) else "")
        )
    if num_envs is None:
        raise ValueError(f"Collector: num_envs is required with an env id (envs={envs!r}), e.g. num_envs=8")
    _check_int("num_envs", num_envs, minimum=1)
    try:
        return gymnasium.make_vec(envs, num_envs=num_envs)
    except gymnasium.error.Error as exc:
        raise ValueError(f"Collector: unknown env id envs={envs!r}: {exc}") from exc


def _check_policy_device(policy: nn.Module, device: torch.device) -> None:
    for name, tensor in _named_weights(policy):
        if tensor.device != device:
            raise ValueError(
                f"Collector: with prefetch=0 the policy runs as given, but its tensor {name!r} is on "
                f"{tensor.device}, not on device={device}; call policy.to({str(device)!r}) first"
            )


def _inference_copy(policy: nn.Module, device: torch.device) -> nn.Module:
    try:
        runner = copy.deepcopy(policy)
    except Exception as exc:
        raise TypeError(
            f"Collector: prefetch>=1 needs a copy of the policy but copy.deepcopy({type(policy).__name__}) "
            f"failed ({exc}); make it deep-copyable or use prefetch=0"
        ) from exc
    runner.to(device)
    runner.requires_grad_(False)
    return runner


def _named_weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _weight_pairs(runner: nn.Module, policy: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dst, src = dict(_named_weights(runner)), dict(_named_weights(policy))
    return [(dst[name], tensor) for name, tensor in src.items()]


@atexit.register
def _close_all() -> None:
    # Runs before interpreter teardown: stop threads while the env code can still run.
    for collector in list(_live):
        collector.close()
