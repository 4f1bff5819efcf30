"""JAX simulators with Brax's functional API (Brax, MuJoCo Playground) as gymnasium vector envs of torch tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from torch import Tensor
from torch.utils.dlpack import from_dlpack

from torch_rollout.envs._base import read_reset_mask

__all__ = ["FromJax"]

# jax.random.PRNGKey keeps only a seed's low 32 bits (without jax_enable_x64): env j's key s + j must fit.
_SEED_LIMIT = 2**32


class FromJax(VectorEnv):
    """A JAX env with Brax's functional API, vectorised and jitted, as a gymnasium vector env of torch tensors.

    ``env`` is anything shaped like a Brax env: ``env.reset(rng) -> state``,
    ``env.step(state, action) -> state``, where ``state.obs`` (an array, or a
    dict of arrays), ``state.reward`` and ``state.done`` (float, 1 at an
    episode's end) are one env's, and ``env.action_size`` (the observation's
    structure is read from a trace of ``reset``). Brax's envs (``brax.envs.get_environment``, with or
    without its ``EpisodeWrapper``) and MuJoCo Playground's
    (``mujoco_playground.registry.load``) are. Their ``reset`` and ``step`` run
    under ``jax.jit(jax.vmap(...))`` over ``num_envs`` envs, compiled once
    (at the first reset and the first step), and the arrays cross between JAX
    and torch with DLPack, without a copy: observations, rewards and flags are
    torch tensors sharing JAX's buffers, on the device JAX computes on
    (:attr:`device`), and actions reach JAX the same way. Actions are Box
    ``[-1, 1]^action_size`` (float32).

    - **Time limit.** Brax's ``EpisodeWrapper`` counts the steps itself and
      marks a time-out in ``state.info["truncation"]``; it is used as is
      (``max_episode_steps`` must then be ``None``). Otherwise the adapter
      counts each env's steps and times it out at ``max_episode_steps``, or,
      where that is ``None``, at a MuJoCo Playground env's
      ``config.episode_length``. An env with none of these raises
      ``ValueError``. With ``EpisodeWrapper``, whose ``done`` is set at its
      time limit too, ``terminated = done & ~truncation`` and ``truncated =
      truncation``: a step that ends the episode by the env's own ``done`` at
      the time limit is ``terminated`` only, as ``EpisodeWrapper`` says it.
      Where the adapter counts, ``terminated = done`` and ``truncated`` is set
      at the time limit whatever ``done`` says, as gymnasium's ``TimeLimit``
      does: a step that terminates at the time limit has both flags (and does
      not bootstrap).
    - **Autoreset** (``autoreset_mode``, also in ``metadata``):

      - ``SAME_STEP`` (the default): an env whose episode ends is reset within
        the same jitted step (``jax.numpy.where`` over the state, so no
        host synchronisation); the observation returned is the new
        episode's, and the one that ended it is in ``infos["final_obs"]``,
        dense over all envs, with the bool mask ``infos["_final_obs"]`` (and
        ``infos["final_info"]`` ``{}`` with ``infos["_final_info"]``), at
        every step.
      - ``DISABLED``: ``step`` never resets; ``reset(options={"reset_mask":
        mask})`` resets the envs of ``mask`` (a bool tensor or NumPy array)
        and returns every env's observation.

    - **Seeding.** ``reset(seed=s)`` keys env ``j`` with
      ``jax.random.PRNGKey(s + j)``, so env ``j``'s episodes are the same
      whatever the number of envs beside it; each reset of an env (the
      first too) splits the env's own key and resets from one half. A
      ``reset()`` without a seed draws ``s`` the first time (from torch's
      default generator, so ``torch.manual_seed`` fixes it) and later starts
      each env's next episode.

    The tensors returned alias JAX arrays, which JAX never overwrites (no
    buffer is donated): do not write into them in place.

    Args:
        env: the JAX env (see above).
        num_envs: how many copies of it step together, at least 1.
        max_episode_steps: the time limit the adapter counts; ``None`` for the
            env's own (Brax's ``EpisodeWrapper``, Playground's
            ``config.episode_length``).
        autoreset_mode: ``AutoresetMode.SAME_STEP`` or ``DISABLED`` (or their
            values, ``"SameStep"``, ``"Disabled"``).

    Raises:
        ModuleNotFoundError: JAX is not installed.
        TypeError: ``num_envs`` or ``max_episode_steps`` not an int; ``env`` without
            ``reset``, ``step`` or ``action_size``.
        ValueError: ``num_envs`` or ``max_episode_steps`` below 1, an autoreset mode
            other than the two, ``max_episode_steps`` for an env that has its own
            ``truncation``, or no time limit at all.

    Examples:
        A Brax env through the collector (``text``: JAX is not a requirement of
        ``torch_rollout``):

        .. code-block:: text

            from brax import envs as brax_envs
            from torch_rollout import Collector
            from torch_rollout.envs import FromJax

            envs = FromJax(brax_envs.get_environment("inverted_pendulum"), 1024, max_episode_steps=1000)
            collector = Collector(envs, policy, num_steps=32, device="cpu", seed=0)
    """

    metadata: dict[str, Any]
    num_envs: int
    device: torch.device
    autoreset_mode: AutoresetMode
    max_episode_steps: int | None
    own_time_limit: bool
    _carry: Any = None  # (states, keys [N, 2], steps [N]) as JAX arrays; None before the first reset

    def __init__(
        self,
        env: Any,
        num_envs: int,
        *,
        max_episode_steps: int | None = None,
        autoreset_mode: AutoresetMode | str = AutoresetMode.SAME_STEP,
    ) -> None:
        try:
            import jax
            import jax.numpy as jnp
        except ImportError as error:
            raise ModuleNotFoundError(
                f"FromJax needs JAX, which torch_rollout does not require: install jax (and the simulator, e.g. brax "
                f"or playground) in this environment ({error})"
            ) from error
        self._jax = jax
        for name in ("reset", "step", "action_size"):
            if not hasattr(env, name):
                raise TypeError(
                    f"FromJax(env={env!r}): the env has no {name!r}; expected Brax's functional API, "
                    "env.reset(rng) -> state, env.step(state, action) -> state, env.action_size"
                )
        self.env = env
        self.num_envs = _positive_int(num_envs, "num_envs", "the number of envs")
        if max_episode_steps is not None:
            max_episode_steps = _positive_int(max_episode_steps, "max_episode_steps", "the time limit")
        try:
            mode = AutoresetMode(autoreset_mode)
        except ValueError:
            mode = None
        if mode not in (AutoresetMode.SAME_STEP, AutoresetMode.DISABLED):
            raise ValueError(
                f"FromJax(autoreset_mode={autoreset_mode!r}): expected AutoresetMode.SAME_STEP ('SameStep') or "
                "AutoresetMode.DISABLED ('Disabled')"
            )
        self.autoreset_mode = mode
        self.metadata = {"render_modes": [], "autoreset_mode": mode}
        self.render_mode = None

        # One env's state, traced without running anything: its observation's structure and its info's keys.
        shape = jax.eval_shape(env.reset, jax.random.PRNGKey(0))
        self.own_time_limit = "truncation" in getattr(shape, "info", {})
        self.max_episode_steps = _time_limit(env, own=self.own_time_limit, max_episode_steps=max_episode_steps)

        single = _space(shape.obs)
        self.single_observation_space = single
        self.observation_space = batch_space(single, self.num_envs)
        self.single_action_space = spaces.Box(-1.0, 1.0, (int(env.action_size),), np.float32)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.device = from_dlpack(jnp.zeros(1)).device  # where JAX computes by default

        self._reset_all = jax.jit(self._reset_all_fn)
        self._reset_some = jax.jit(self._reset_some_fn)
        self._step = jax.jit(self._step_fn)

    # The jitted functions: pure, over all envs at once.

    def _reset_envs(self, keys: Any) -> tuple[Any, Any]:
        """``(the keys kept, the reset states)``: each env's key split, one half for its reset."""
        jax = self._jax
        pairs = jax.vmap(jax.random.split)(keys)  # [N, 2, 2]
        return pairs[:, 0], jax.vmap(self.env.reset)(pairs[:, 1])

    # Each value leaves a jitted function once: an output repeated (the observations in the states and on their
    # own) would be a second buffer, copied by XLA. The observations are read from the states.

    def _reset_all_fn(self, keys: Any) -> tuple[Any, Any, Any]:
        keys, states = self._reset_envs(keys)
        steps = self._jax.numpy.zeros(self.num_envs, dtype=self._jax.numpy.int32)
        return states, keys, steps

    def _reset_some_fn(self, carry: Any, keys: Any, mask: Any) -> tuple[Any, Any, Any]:
        states, old_keys, steps = carry
        new_keys, fresh = self._reset_envs(keys)
        states = self._where(mask, fresh, states)
        keys = self._jax.numpy.where(mask[:, None], new_keys, old_keys)
        steps = self._jax.numpy.where(mask, 0, steps)
        return states, keys, steps

    def _step_fn(self, carry: Any, action: Any) -> tuple[Any, dict[str, Any]]:
        jnp = self._jax.numpy
        states, keys, steps = carry
        states = self._jax.vmap(self.env.step)(states, action)
        steps = steps + 1
        done = states.done > 0
        if self.own_time_limit:  # EpisodeWrapper's done includes its time-outs; its truncation excludes terminations
            truncated = states.info["truncation"] > 0
            terminated = done & ~truncated
        else:
            truncated = steps >= self.max_episode_steps
            terminated = done
        out = {"terminated": terminated, "truncated": truncated}  # the reward: in the states (DISABLED)
        if self.autoreset_mode is AutoresetMode.SAME_STEP:
            ended = terminated | truncated
            new_keys, fresh = self._reset_envs(keys)
            # The step's reward and observation leave before the swap, the new episodes' in the states.
            out.update(reward=states.reward, final_obs=states.obs, ended=ended)
            states = self._where(ended, fresh, states)
            keys = jnp.where(ended[:, None], new_keys, keys)
            steps = jnp.where(ended, 0, steps)
        return (states, keys, steps), out

    def _where(self, mask: Any, new: Any, old: Any) -> Any:
        """The state pytree ``new`` in the envs of ``mask``, ``old`` elsewhere."""
        jax = self._jax
        if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(old):
            raise ValueError(
                f"FromJax: the env's reset and step return states of different structures, so an ended env's "
                f"state cannot be swapped for a reset one: reset gives {jax.tree_util.tree_structure(new)}, step "
                f"{jax.tree_util.tree_structure(old)}"
            )

        def pick(a: Any, b: Any) -> Any:
            if b.shape[:1] != mask.shape:  # not batched over the envs (MJX keeps some empty arrays): shared
                return b
            return jax.numpy.where(mask.reshape(-1, *[1] * (b.ndim - 1)), a.astype(b.dtype), b)

        return jax.tree_util.tree_map(pick, new, old)

    # The gymnasium API.

    def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[Tensor | dict[str, Tensor], dict[str, Any]]:
        """Starts new episodes of every env, or of the envs of ``options["reset_mask"]``.

        Args:
            seed: ``None`` (the first time: drawn; later: each env's next episode) or an int ``s`` in
                ``[0, 2**32 - num_envs]``: env ``j`` is keyed ``jax.random.PRNGKey(s + j)``.
            options: ``None``, or ``{"reset_mask": mask}``, a bool ``[num_envs]`` tensor or NumPy array:
                only these envs start new episodes.

        Returns:
            ``(obs, {})``: every env's observation, ``[num_envs, *obs_shape]`` (a dict of them for a dict
            observation), sharing memory with JAX's arrays.

        Raises:
            TypeError: a seed or mask of the wrong type.
            ValueError: a seed out of range, a mask of the wrong shape, an unknown option.
            RuntimeError: the env is closed, or a masked reset before the first full one.
        """
        if self.closed:
            raise RuntimeError(f"{self!r}.reset() after close(): build a new env")
        mask = self._reset_mask(options)
        keys = self._seed_keys(seed)
        if mask is not None:
            if self._carry is None:
                raise RuntimeError(
                    f"{self!r}.reset(options={{'reset_mask': ...}}) before any full reset: call reset(seed=...) first"
                )
            self._carry = self._reset_some(self._carry, self._carry[1] if keys is None else keys, mask)
            return _to_torch(self._carry[0].obs), {}
        if keys is None:
            keys = self._carry[1] if self._carry is not None else self._seed_keys(int(torch.randint(2**31, ())))
        self._carry = self._reset_all(keys)
        return _to_torch(self._carry[0].obs), {}

    def step(self, actions: Any) -> tuple[Any, Tensor, Tensor, Tensor, dict[str, Any]]:
        """Steps every env with its action, resetting ended envs in ``SAME_STEP`` mode.

        Args:
            actions: ``[num_envs, action_size]``, a tensor (or anything ``torch.as_tensor`` takes); it reaches JAX
                without a copy where it is a contiguous float32 tensor on :attr:`device`.

        Returns:
            ``(obs, reward, terminated, truncated, infos)`` as torch tensors sharing JAX's buffers: ``reward``
            float32 and the flags bool, ``[num_envs]``; ``infos`` is ``{}`` in ``DISABLED`` mode, and in
            ``SAME_STEP`` mode holds the final observations (see the class docstring).

        Raises:
            ValueError: actions of the wrong shape.
            RuntimeError: the env is closed or was never reset.
        """
        if self.closed:
            raise RuntimeError(f"{self!r}.step() after close(): build a new env")
        if self._carry is None:
            raise RuntimeError(f"{self!r}.step() before reset(): call reset(seed=...) first")
        action = torch.as_tensor(actions, dtype=torch.float32, device=self.device)
        expected = (self.num_envs, int(self.env.action_size))
        if tuple(action.shape) != expected:
            raise ValueError(f"{self!r}.step(actions): actions of shape {tuple(action.shape)}, expected {expected}")
        self._carry, out = self._step(self._carry, self._jax.dlpack.from_dlpack(action.contiguous()))
        states = self._carry[0]
        infos: dict[str, Any] = {}
        reward = states.reward
        if self.autoreset_mode is AutoresetMode.SAME_STEP:
            reward = out["reward"]
            ended = from_dlpack(out["ended"])
            infos = {"final_obs": _to_torch(out["final_obs"]), "_final_obs": ended, "final_info": {}}
            infos["_final_info"] = ended
        return (
            _to_torch(states.obs),
            from_dlpack(reward),
            from_dlpack(out["terminated"]),
            from_dlpack(out["truncated"]),
            infos,
        )

    @property
    def states(self) -> Any:
        """The JAX env's states, every env's (a pytree of ``[num_envs, ...]`` arrays; ``state.info`` and
        ``state.metrics`` among them), as of the last reset or step; ``None`` before the first reset. The
        observations returned share their memory with ``states.obs``."""
        return None if self._carry is None else self._carry[0]

    def close_extras(self, **kwargs: Any) -> None:
        """Drops the states; gymnasium's :meth:`close` calls this once, however often it is called."""
        self._carry = None

    def __repr__(self) -> str:
        return (
            f"FromJax({type(self.env).__name__}, num_envs={self.num_envs}, "
            f"autoreset_mode={self.autoreset_mode.value!r})"
        )

    def _seed_keys(self, seed: int | None) -> Any:
        """``jax.random.PRNGKey(seed + j)`` for every env ``j``, ``[num_envs, 2]``, or ``None`` for no seed."""
        if seed is None:
            return None
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"{self!r}.reset(seed={seed!r}): expected an int or None, got {type(seed).__name__}")
        if not 0 <= seed <= _SEED_LIMIT - self.num_envs:
            raise ValueError(
                f"{self!r}.reset(seed={seed}): env j is keyed jax.random.PRNGKey(seed + j), which keeps 32 bits, so "
                f"the seed must be in [0, {_SEED_LIMIT - self.num_envs}]"
            )
        jnp = self._jax.numpy
        seeds = jnp.arange(self.num_envs, dtype=jnp.uint32) + jnp.uint32(seed)
        return self._jax.vmap(self._jax.random.PRNGKey)(seeds)

    def _reset_mask(self, options: Mapping[str, Any] | None) -> Any:
        """``options["reset_mask"]`` as a JAX bool array (sharing the tensor's memory), or ``None``."""
        mask = read_reset_mask(repr(self), options, self.num_envs, self.device)
        return None if mask is None else self._jax.dlpack.from_dlpack(mask.contiguous())


def _to_torch(x: Any) -> Any:
    """A JAX array (or a dict of them) as torch tensors sharing its memory."""
    if isinstance(x, Mapping):
        return {key: from_dlpack(value) for key, value in x.items()}
    return from_dlpack(x)


def _space(obs: Any) -> spaces.Space:
    """One env's observation space from its traced observation (``jax.ShapeDtypeStruct``, or a dict of them)."""
    if isinstance(obs, Mapping):
        return spaces.Dict({key: _space(value) for key, value in obs.items()})
    return spaces.Box(-np.inf, np.inf, tuple(obs.shape), np.dtype(obs.dtype))


def _time_limit(env: Any, *, own: bool, max_episode_steps: int | None) -> int | None:
    """The step at which episodes time out: the env's own (``own``: Brax's EpisodeWrapper, its ``episode_length``
    where it says), ``max_episode_steps``, or a Playground env's ``config.episode_length``."""
    if own:
        if max_episode_steps is not None:
            raise ValueError(
                f"FromJax(max_episode_steps={max_episode_steps}): the env keeps its own time limit "
                "(state.info['truncation'], Brax's EpisodeWrapper); drop max_episode_steps, or the EpisodeWrapper"
            )
        limit = getattr(env, "episode_length", None)  # EpisodeWrapper's, forwarded by Brax's wrappers
        return limit if isinstance(limit, int) else None
    if max_episode_steps is None:
        max_episode_steps = _config_episode_length(env)
    if max_episode_steps is None:
        raise ValueError(
            f"FromJax(env={env!r}): the env has no time limit (no state.info['truncation'] from Brax's "
            "EpisodeWrapper, no config.episode_length as MuJoCo Playground's envs have): pass max_episode_steps=..."
        )
    return max_episode_steps


def _config_episode_length(env: Any) -> int | None:
    """MuJoCo Playground's time limit: ``config.episode_length`` of the (unwrapped) env, kept as ``_config``."""
    for candidate in (env, getattr(env, "unwrapped", None)):
        config = getattr(candidate, "_config", None)
        length = getattr(config, "episode_length", None) if config is not None else None
        if isinstance(length, int) and length >= 1:
            return length
    return None


def _positive_int(value: Any, name: str, meaning: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"FromJax({name}={value!r}): expected an int, {meaning}; got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"FromJax({name}={value}): expected an int of at least 1, {meaning}")
    return int(value)
