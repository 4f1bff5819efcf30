"""The shared part of the torch-tensor vector envs: autoreset bookkeeping, time limit and counter-based seeding."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from torch import Tensor

from torch_rollout.util._devices import indexed

__all__ = ["TorchVectorEnv", "mix64", "read_reset_mask"]

# splitmix64's constants as signed int64 (torch has no full uint64 arithmetic); products wrap modulo 2**64.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MUL1 = 0xBF58476D1CE4E5B9 - 2**64
_MUL2 = 0x94D049BB133111EB - 2**64
_KEY_LIMIT = 2**63
# Keys drawn for a reset without a seed stay well inside int64, so that key + j never wraps.
_DRAWN_KEY_LIMIT = 2**62


def _shift_right(z: Tensor, bits: int) -> Tensor:
    # `>>` on int64 is arithmetic (copies the sign bit); the mask turns it into splitmix64's logical shift.
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: Tensor) -> Tensor:
    """splitmix64's finalizer on an int64 tensor: a bijection of 64-bit words that scrambles every bit.

    The words are read as unsigned 64-bit integers stored in int64 (two's
    complement), so the result equals splitmix64's ``mix`` on ``z mod 2**64``,
    written back as signed int64. Elementwise, on the tensor's device, with no
    host synchronisation.

    Args:
        z: an int64 tensor of any shape.

    Returns:
        An int64 tensor of the same shape and device.

    Examples:
        >>> import torch
        >>> mix64(torch.tensor([0, 1]))
        tensor([                  0, 6238072747940578789])
    """
    z = (z ^ _shift_right(z, 30)) * _MUL1
    z = (z ^ _shift_right(z, 27)) * _MUL2
    return z ^ _shift_right(z, 31)


class TorchVectorEnv(VectorEnv[Tensor, Tensor, Tensor]):
    """A gymnasium vector env whose state, actions and results are torch tensors on one device.

    A subclass gives the spaces, the bounds of the uniform initial state and
    three pure tensor functions (actions checked and converted, one step of
    the dynamics, the observation of a state); this class does everything
    else, the same way for every env:

    - ``step`` counts each env's steps in its episode and truncates at
      ``max_episode_steps`` (``truncated`` may be true together with
      ``terminated`` at the last step, as gymnasium's ``TimeLimit`` does).
    - Autoreset as gymnasium defines it for vector envs (``autoreset_mode``):

      - ``NEXT_STEP``: the step after an env's episode ended resets that env,
        ignores its action and returns its reset observation with reward 0,
        ``terminated`` and ``truncated`` false.
      - ``SAME_STEP``: an env whose episode ends is reset in the same step;
        the returned row is the reset observation, and the observation that
        ended the episode is in ``infos[final_obs_key]``, a dense tensor of
        the batch's observation shape (rows of envs that did not end hold
        their current observation), with the bool mask
        ``infos["_" + final_obs_key]`` of the envs that ended. ``infos`` also
        holds ``"final_info"`` (``{}``: these envs have no infos) and
        ``"_final_info"`` (the same mask). These keys are there at every step,
        with an all-false mask when no env ended, since testing for an
        episode end would wait for the device.
      - ``DISABLED``: no autoreset; ``reset(options={"reset_mask": mask})``
        resets the envs of the bool ``mask`` (a tensor or a NumPy array) and
        returns every env's observation. Stepping an env whose episode ended
        without resetting it goes on integrating it (its ``truncated`` stays
        true), as gymnasium's single envs do; the result is not meaningful
        (gymnasium's ``SyncVectorEnv`` refuses such a step, which here would
        mean waiting for the device).

    - Seeding is counter based: the initial state of an env's episode is a
      pure function of the env's key and the episode's number, computed with
      a splitmix64 hash (int64 ops on the device) mapped to uniform floats
      (53 random bits each) in the subclass's bounds. ``reset(seed=s)`` keys
      env ``j`` with ``s + j`` and starts its episode 0; ``reset(seed=[s0,
      s1, ...])`` keys each env with its own seed (``None`` draws one).
      An env's episodes do not depend on the number of envs beside it nor on
      what they do: env ``j`` of a vector env reset with seed ``s`` has the
      episodes of env ``0`` of one reset with ``s + j``, under the same
      actions. The first ``reset()`` without a seed draws the keys from
      torch's default (CPU) generator, so ``torch.manual_seed`` fixes them;
      a later ``reset()`` without a seed starts each env's next episode.

    ``step`` and the autoresets run without host synchronisation (dense ops
    and ``torch.where`` only), and so does ``reset`` with an int seed or with
    a ``reset_mask`` tensor already on the device. Every tensor returned is
    new: the env never writes into a tensor it gave out.

    Attributes:
        num_envs: the number of envs.
        device: where the state, the actions and every result live.
        autoreset_mode: the autoreset mode, also in ``metadata["autoreset_mode"]``.
        max_episode_steps: the step of an episode that is truncated.
        final_obs_key: the infos key of the final observations in ``SAME_STEP`` mode.
        state: the physical state of every env, ``[num_envs, state_dim]`` float64 as gymnasium keeps it
            (observations and rewards are float32); ``None`` before the first reset.
    """

    metadata: dict[str, Any]
    autoreset_mode: AutoresetMode
    num_envs: int
    device: torch.device
    max_episode_steps: int
    final_obs_key: str
    state: Tensor | None = None
    _keys: Tensor | None = None  # [N] int64: the key of each env's episode stream
    _key_words: Tensor  # [N] int64: mix64(_keys), kept since the step's autoresets need it
    _episodes: Tensor  # [N] int64: the number of each env's current episode in its stream
    _steps: Tensor  # [N] int64: steps taken in each env's current episode
    _ended: Tensor  # [N] bool: in NEXT_STEP mode, the envs that the next step resets
    _low: Tensor  # [state_dim] float64: lower bounds of the initial state
    _span: Tensor  # [state_dim] float64: high - low
    _components: Tensor  # [state_dim] int64: 0, 1, ..., state_dim - 1

    def __init__(
        self,
        num_envs: int,
        *,
        single_observation_space: spaces.Space,
        single_action_space: spaces.Space,
        initial_low: Sequence[float],
        initial_high: Sequence[float],
        device: str | torch.device,
        autoreset_mode: AutoresetMode | str,
        max_episode_steps: int,
        final_obs_key: str,
    ) -> None:
        """Checks the options and lays out the constant tensors; the state comes with the first reset.

        Args:
            num_envs: the number of envs, at least 1.
            single_observation_space: one env's observation space.
            single_action_space: one env's action space.
            initial_low: per state component, the lower bound of its uniform initial value.
            initial_high: per state component, the (excluded) upper bound.
            device: where the envs run.
            autoreset_mode: an :class:`~gymnasium.vector.AutoresetMode` or its value (``"NextStep"``, ...).
            max_episode_steps: episodes are truncated at this step, at least 1.
            final_obs_key: the infos key of the final observations in ``SAME_STEP`` mode.

        Raises:
            TypeError: ``num_envs``, ``max_episode_steps`` or ``final_obs_key`` of the wrong type.
            ValueError: ``num_envs`` or ``max_episode_steps`` below 1, an unknown ``autoreset_mode``,
                an empty ``final_obs_key``.
        """
        name = type(self).__name__
        self.num_envs = _positive_int(num_envs, f"{name}(num_envs=...)", "the number of envs")
        self.max_episode_steps = _positive_int(
            max_episode_steps, f"{name}(max_episode_steps=...)", "the step at which episodes are truncated"
        )
        self.autoreset_mode = _autoreset_mode(autoreset_mode, name)
        if not isinstance(final_obs_key, str) or not final_obs_key:
            raise TypeError(
                f"{name}(final_obs_key={final_obs_key!r}): expected a non-empty str, the infos key of the final "
                "observations in SAME_STEP mode (e.g. 'final_obs', or 'final_observation' as ManiSkill3 says it)"
            )
        self.final_obs_key = final_obs_key
        self.device = indexed(device)  # "cuda": the current device, fixed now (a thread starts on cuda:0)
        self.metadata = {"render_modes": [], "autoreset_mode": self.autoreset_mode}
        self.render_mode = None
        self.single_observation_space = single_observation_space
        self.single_action_space = single_action_space
        self.observation_space = batch_space(single_observation_space, self.num_envs)
        self.action_space = batch_space(single_action_space, self.num_envs)
        low = torch.tensor(initial_low, dtype=torch.float64, device=self.device)
        self._low = low
        self._span = torch.tensor(initial_high, dtype=torch.float64, device=self.device) - low
        self._components = torch.arange(len(initial_low), device=self.device)

    # What a subclass gives.

    def _as_actions(self, actions: Any) -> Tensor:
        """``actions`` checked (type and shape only: values would need the host) and on :attr:`device`."""
        raise NotImplementedError

    def _dynamics(self, state: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One step of every env: ``(next state [N, state_dim] float64, reward [N] float32, terminated [N] bool)``."""
        raise NotImplementedError

    def _observe(self, state: Tensor) -> Tensor:
        """The observations of ``state``, a new float32 tensor (never ``state`` itself)."""
        raise NotImplementedError

    # The shared part.

    def initial_states(self, keys: Tensor, episodes: Tensor) -> Tensor:
        """The state that episode ``episodes[i]`` of the env keyed ``keys[i]`` starts from.

        A pure function of the two, the same on every device: uniform in the
        env's initial bounds, 53 random bits per component. The env keyed
        ``k`` reads a splitmix64 stream whose state starts at ``mix64(k)``:
        component ``c`` of episode ``e`` takes the stream's output number
        ``e * state_dim + c``.

        Args:
            keys: int64 ``[M]``, env keys (``seed + j`` for env ``j`` after ``reset(seed=seed)``).
            episodes: int64 ``[M]``, episode numbers (0 for the episode a seeded reset starts).

        Returns:
            float64 ``[M, state_dim]`` on the device of ``keys``.

        Examples:
            >>> import torch
            >>> from torch_rollout.envs import CartPole
            >>> envs = CartPole(2)
            >>> obs, _ = envs.reset(seed=7)
            >>> first = envs.initial_states(torch.tensor([7, 8]), torch.tensor([0, 0]))
            >>> torch.equal(envs.state, first), torch.equal(obs, first.float())
            (True, True)
        """
        on = keys.device
        return self._starts(mix64(keys), episodes, self._components.to(on), self._low.to(on), self._span.to(on))

    @staticmethod
    def _starts(key_words: Tensor, episodes: Tensor, components: Tensor, low: Tensor, span: Tensor) -> Tensor:
        """:meth:`initial_states` from the keys' words ``mix64(keys)``, and the constants on their device."""
        draws = episodes[:, None] * len(components) + components  # [M, state_dim]: the outputs' numbers
        # splitmix64's output i (from 0) is mix64(state + (i + 1) * golden), here with the state mix64(key).
        words = mix64(key_words[:, None] + (draws + 1) * _GOLDEN)
        unit = _shift_right(words, 11).to(torch.float64) * 2.0**-53  # top 53 bits: exact floats in [0, 1)
        return low + span * unit

    def reset(
        self, *, seed: int | Sequence[int | None] | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[Tensor, dict[str, Any]]:
        """Starts new episodes of every env, or of the envs of ``options["reset_mask"]``.

        Args:
            seed: ``None`` (the first time: keys drawn from torch's default generator; later: each env's
                next episode), an int ``s`` (env ``j`` is keyed ``s + j``, episode 0), or one int or
                ``None`` per env.
            options: ``None``, or ``{"reset_mask": mask}``: a bool ``[num_envs]`` tensor or NumPy array; only
                these envs start new episodes (seeded ones with the seeds of their own index), the others go
                on, and the observations of every env are returned.

        Returns:
            ``(obs, {})``: the observations ``[num_envs, *obs_shape]`` of every env.

        Raises:
            TypeError: a seed or mask of the wrong type.
            ValueError: a seed out of range, a seed list or mask of the wrong length, an unknown option.
            RuntimeError: the env is closed, or a masked reset comes before the first full one.
        """
        self._check_open("reset")
        mask = self._reset_mask(options)
        keys = self._seed_keys(seed)
        if mask is not None and self._keys is None:  # with a seed or without
            raise RuntimeError(
                f"{self!r}.reset(options={{'reset_mask': ...}}) before any full reset: the envs outside the "
                "mask have no episode to go on with; call reset(seed=...) first"
            )
        if keys is None and self._keys is None:
            keys = self._drawn_keys(self.num_envs)
        if keys is None:  # each env's next episode in its stream
            assert self._keys is not None  # else keys were drawn above
            keys, episodes = self._keys, self._episodes + 1
        else:
            episodes = torch.zeros(self.num_envs, dtype=torch.int64, device=self.device)
        key_words = mix64(keys)
        state = self._starts(key_words, episodes, self._components, self._low, self._span)
        if mask is None:
            self._keys, self._key_words, self._episodes, self.state = keys, key_words, episodes, state
            self._steps = torch.zeros(self.num_envs, dtype=torch.int64, device=self.device)
            self._ended = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        else:
            assert self._keys is not None and self.state is not None  # a masked reset comes after a full one
            self._keys = torch.where(mask, keys, self._keys)
            self._key_words = torch.where(mask, key_words, self._key_words)
            self._episodes = torch.where(mask, episodes, self._episodes)
            self.state = torch.where(mask[:, None], state, self.state)
            self._steps = torch.where(mask, 0, self._steps)
            self._ended = self._ended & ~mask
        return self._observe(self.state), {}

    def step(self, actions: Any) -> tuple[Tensor, Tensor, Tensor, Tensor, dict[str, Any]]:
        """Steps every env with its action, autoresetting as :attr:`autoreset_mode` says.

        Args:
            actions: one action per env, a tensor (or anything ``torch.as_tensor`` takes) of the batched
                action space's shape; moved to :attr:`device` if it is elsewhere.

        Returns:
            ``(obs, reward, terminated, truncated, infos)``: ``obs`` ``[num_envs, *obs_shape]`` float32,
            ``reward`` ``[num_envs]`` float32, ``terminated`` and ``truncated`` ``[num_envs]`` bool, all on
            :attr:`device`; ``infos`` is ``{}`` except in ``SAME_STEP`` mode (see the class docstring).

        Raises:
            TypeError, ValueError: actions of the wrong dtype or shape.
            RuntimeError: the env is closed or was never reset.
        """
        self._check_open("step")
        if self.state is None:
            raise RuntimeError(f"{self!r}.step() before reset(): call reset(seed=...) first")
        actions = self._as_actions(actions)
        state, reward, terminated = self._dynamics(self.state, actions)
        steps = self._steps + 1
        truncated = steps >= self.max_episode_steps
        infos: dict[str, Any] = {}
        if self.autoreset_mode is AutoresetMode.NEXT_STEP:
            # The envs that ended last step start anew; what _dynamics made of their action is dropped.
            state, steps = self._restart(self._ended, state, steps)
            reward = torch.where(self._ended, 0.0, reward)
            terminated = terminated & ~self._ended
            truncated = truncated & ~self._ended
            self._ended = terminated | truncated
        elif self.autoreset_mode is AutoresetMode.SAME_STEP:
            ended = terminated | truncated
            final_obs = self._observe(state)
            state, steps = self._restart(ended, state, steps)
            key = self.final_obs_key
            infos = {key: final_obs, f"_{key}": ended, "final_info": {}, "_final_info": ended}
        self.state, self._steps = state, steps
        return self._observe(state), reward, terminated, truncated, infos

    def _restart(self, ended: Tensor, state: Tensor, steps: Tensor) -> tuple[Tensor, Tensor]:
        """``state`` and ``steps`` with the envs of ``ended`` at the start of their next episode."""
        self._episodes = self._episodes + ended
        first = self._starts(self._key_words, self._episodes, self._components, self._low, self._span)
        return torch.where(ended[:, None], first, state), torch.where(ended, 0, steps)

    def close_extras(self, **kwargs: Any) -> None:
        """Drops the state; :meth:`close` (gymnasium's) calls this once, however often it is called."""
        self.state = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_envs={self.num_envs}, device={str(self.device)!r}, "
            f"autoreset_mode={self.autoreset_mode.value!r})"
        )

    def _check_open(self, call: str) -> None:
        if self.closed:
            raise RuntimeError(f"{self!r}.{call}() after close(): build a new env")

    def _seed_keys(self, seed: int | Sequence[int | None] | None) -> Tensor | None:
        """The keys that ``seed`` gives every env, or ``None`` for no seed."""
        n = self.num_envs
        if seed is None:
            return None
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
            seed = int(seed)
            if not 0 <= seed <= _KEY_LIMIT - n:
                raise ValueError(
                    f"{self!r}.reset(seed={seed}): env j is keyed seed + j, an int64, so the seed must be in "
                    f"[0, {_KEY_LIMIT - n}]"
                )
            # arange + seed on the device: no copy from the host.
            return torch.arange(n, dtype=torch.int64, device=self.device) + seed
        if isinstance(seed, (str, bytes)) or not isinstance(seed, Sequence):
            raise TypeError(
                f"{self!r}.reset(seed={seed!r}): expected an int, a list of {n} ints or Nones, or None; "
                f"got {type(seed).__name__}"
            )
        if len(seed) != n:
            raise ValueError(f"{self!r}.reset(seed=[...]): got {len(seed)} seeds, expected one per env ({n})")
        drawn = iter(self._drawn_keys(sum(s is None for s in seed)).tolist())
        keys = []
        for j, s in enumerate(seed):
            if s is None:
                keys.append(next(drawn))
                continue
            if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
                raise TypeError(f"{self!r}.reset(seed=[...]): seed[{j}] is {s!r}, expected an int or None")
            if not 0 <= s < _KEY_LIMIT:
                raise ValueError(f"{self!r}.reset(seed=[...]): seed[{j}]={s} is outside [0, 2**63)")
            keys.append(operator.index(s))
        return torch.tensor(keys, dtype=torch.int64, device=self.device)

    def _drawn_keys(self, count: int) -> Tensor:
        # On the CPU generator, so that torch.manual_seed gives the same keys on every device.
        return torch.randint(_DRAWN_KEY_LIMIT, (count,), dtype=torch.int64).to(self.device)

    def _reset_mask(self, options: Mapping[str, Any] | None) -> Tensor | None:
        """``options["reset_mask"]`` as a bool tensor on the device, or ``None`` for a full reset."""
        return read_reset_mask(repr(self), options, self.num_envs, self.device)


def read_reset_mask(env: str, options: Mapping[str, Any] | None, num_envs: int, device: Any) -> Tensor | None:
    """``options["reset_mask"]`` of ``env.reset(options=...)`` as a bool tensor on ``device``; ``None``: a full reset.

    Raises:
        ValueError: an option other than ``reset_mask``, or a mask not of shape ``(num_envs,)`` and dtype bool.
        TypeError: a mask that is neither a tensor nor a NumPy array.
    """
    if options is None:
        return None
    unknown = sorted(set(options) - {"reset_mask"})
    if unknown:
        raise ValueError(
            f"{env}.reset(options={dict(options)!r}): unknown option(s) {unknown}; the only option is "
            "'reset_mask', a bool mask of the envs to reset"
        )
    if "reset_mask" not in options:
        return None
    mask = options["reset_mask"]
    if not isinstance(mask, (Tensor, np.ndarray)):
        raise TypeError(
            f"{env}.reset(options={{'reset_mask': ...}}): expected a bool tensor or NumPy array of shape "
            f"({num_envs},), got {type(mask).__name__}"
        )
    is_bool = mask.dtype == torch.bool if isinstance(mask, Tensor) else mask.dtype == np.bool_
    if tuple(mask.shape) != (num_envs,) or not is_bool:
        raise ValueError(
            f"{env}.reset(options={{'reset_mask': ...}}): expected a bool mask of shape ({num_envs},), "
            f"got shape {tuple(mask.shape)} and dtype {mask.dtype}"
        )
    # An all-false mask resets nothing: refusing it, as gymnasium does, would wait for the device.
    return torch.as_tensor(mask, device=device)


def _positive_int(value: Any, where: str, meaning: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: expected an int, {meaning}; got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{where}: expected an int of at least 1, {meaning}; got {value}")
    return int(value)


def _autoreset_mode(value: AutoresetMode | str, name: str) -> AutoresetMode:
    try:
        return AutoresetMode(value)
    except ValueError:
        known = ", ".join(f"AutoresetMode.{mode.name} ({mode.value!r})" for mode in AutoresetMode)
        raise ValueError(f"{name}(autoreset_mode={value!r}): expected one of {known}") from None
