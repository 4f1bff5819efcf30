"""rsl_rl-style vector envs (Isaac Lab, Genesis, mjlab) as gymnasium vector envs of torch tensors."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from tensordict import TensorDictBase
from torch import Tensor

from torch_rollout.envs._torch import OWN_FINAL_KEY

__all__ = ["BOOTSTRAPS", "FromRslRl"]

# What a time-out bootstraps from: the env's final observation, or, where it gives none, an approximation.
BOOTSTRAPS = ("final_obs", "last_obs", "none")


class FromRslRl(VectorEnv):
    """An rsl_rl-style vector env presented as a gymnasium vector env of torch tensors, for the Collector.

    rsl_rl's ``VecEnv`` (Isaac Lab's ``RslRlVecEnvWrapper``, mjlab's) steps as
    ``step(actions) -> (obs, rewards, dones, extras)``, rsl_rl 1.x's (legged_gym
    and the envs written after it, Genesis's locomotion examples) as
    ``step(actions) -> (obs, privileged_obs, rewards, dones, extras)``, with
    ``extras["time_outs"]``, and resets ended envs inside ``step``: the observation
    it returns at an episode end is already the next episode's. A terminated step
    needs no final observation (it does not bootstrap); a time-out does, and
    ``bootstrap`` says where it comes from:

    - ``"final_obs"``: from ``extras["final_obs"]``, the observation before the
      same-step reset, as Isaac Lab gives it with ``compute_final_obs=True`` on
      the env config: exact. This is the default where the env (or its
      ``unwrapped`` env) has ``cfg.compute_final_obs`` True; pass it for any other
      env that fills ``extras["final_obs"]``. A step that ends an episode without
      it makes the collector raise ``KeyError`` at the batch's end.
    - ``"last_obs"``: from V(s_t), the observation the action was chosen from,
      instead of V(s_t+1) (what rsl_rl's PPO does). Time-outs are ``truncated``
      rows whose ``next_value`` is this approximation: the row's own ``value``,
      reused (not recomputed), so ``next_value == value`` there exactly.
    - ``"none"``: a time-out ends the episode like a termination (``terminated``
      True, no bootstrap; ``truncated`` stays True), biasing returns near the
      time limit down.

    A step whose extras hold ``"final_obs"`` bootstraps its time-outs from it
    whatever ``bootstrap`` says: ``"last_obs"`` and ``"none"`` only say what to do
    with a time-out whose final observation the env does not give. Without a
    final observation and without ``bootstrap`` the constructor raises.

    ``truncated`` is ``time_outs`` as the env gives it (where ``dones`` is set).
    A step can end an episode that both terminated and reached its time limit:
    Isaac Lab's ``RslRlVecEnvWrapper`` passes it as ``dones`` and ``time_outs``
    both set, like a plain time-out, though it must not bootstrap. Where the env
    beneath the wrapper is reachable (its ``unwrapped`` env keeps Isaac Lab's
    ``reset_terminated`` and ``reset_time_outs``, or a ``termination_manager`` with
    ``terminated`` and ``time_outs``), such a row has both flags, ``terminated``
    and ``truncated``, and does not bootstrap: ``terminated = dones & (~time_outs |
    terminated beneath)``. Where it is not, ``terminated = dones & ~time_outs``,
    and every time-out may have terminated too.

    Each row says what it got: ``infos["bootstrap"]`` is ``0`` where the row is
    exact (no time-out, a time-out that the env beneath says terminated too, or a
    time-out bootstrapped from ``extras["final_obs"]`` that the env beneath says
    did not terminate), ``1`` where a time-out bootstrapped from V(s_t), ``2``
    where a time-out was not bootstrapped, ``3`` where a time-out bootstrapped
    from ``extras["final_obs"]`` may also have terminated (the env cannot tell:
    no env beneath to ask); keep it with ``BatchKeys(info_keys=("bootstrap",))``.

    Observation groups become a Dict observation: rsl_rl 3.x's TensorDict (or
    dict) such as ``{"policy": ..., "critic": ...}``, and rsl_rl 2.x's layout (the
    policy observation as a tensor, the other groups in
    ``extras["observations"]`` of ``get_observations()`` and of every step), whose
    policy tensor becomes the ``"policy"`` group; and rsl_rl 1.x's, whose
    ``get_observations()`` and ``step`` give the policy observation as a tensor
    and whose ``get_privileged_observations()`` and ``step`` give the privileged
    observations or ``None``: the groups ``"policy"`` and ``"critic"`` (the
    privileged ones), or the policy tensor alone where they are ``None``. The env
    steps in SAME_STEP autoreset mode. Seed the wrapped env when you create it:
    ``reset(seed=...)`` is refused.

    Args:
        env: an object with ``num_envs``, ``num_actions``, ``get_observations()``
            (and, for rsl_rl 1.x, ``get_privileged_observations()``) and
            ``step(actions)`` as above (``reset()`` is called too where it
            exists), and ``device``: where it lacks one (MuJoCo Playground's
            ``RSLRLBraxWrapper`` on a CPU), the device of the tensors of
            ``get_observations()``.
        bootstrap: ``"final_obs"``, ``"last_obs"`` or ``"none"`` (see above);
            ``None`` means ``"final_obs"`` where the env has
            ``cfg.compute_final_obs`` True.

    Raises:
        ValueError: ``bootstrap`` not one of :data:`BOOTSTRAPS`, or ``None`` for an
            env that does not say it gives final observations; an env without
            ``device`` whose observations are not torch tensors on one device.
    """

    def __init__(self, env: Any, *, bootstrap: str | None = None) -> None:
        if bootstrap is None and _computes_final_obs(env):
            bootstrap = "final_obs"
        if bootstrap not in BOOTSTRAPS:
            raise ValueError(
                f"FromRslRl: bootstrap={bootstrap!r}, and the env does not say that it gives final observations "
                "(no cfg.compute_final_obs=True on it or on its unwrapped env): it returns the next episode's "
                "observation at a time-out. For exact bootstraps set compute_final_obs=True on the Isaac Lab env "
                "config (extras['final_obs']), or pass bootstrap='final_obs' for an env that fills "
                "extras['final_obs'] itself; otherwise choose an approximation: bootstrap='last_obs' bootstraps "
                "from V(s_t) of the step's own observation (what rsl_rl does), bootstrap='none' ends time-outs "
                "like terminations (no bootstrap); infos['bootstrap'] marks the rows either way"
            )
        self.env = env
        self.bootstrap = bootstrap
        self._terminated_beneath = _terminations_beneath(env)
        self.num_envs = int(env.num_envs)
        self.metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}
        self.autoreset_mode = AutoresetMode.SAME_STEP
        obs = self._observe()
        self.device = _device_of(env, obs)
        if isinstance(obs, dict):
            single: spaces.Space = spaces.Dict({key: _box(value) for key, value in obs.items()})
        else:
            single = _box(obs)
        self.single_observation_space = single
        self.observation_space = batch_space(single, self.num_envs)
        self.single_action_space = spaces.Box(-np.inf, np.inf, (int(env.num_actions),), np.float32)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.obs = obs

    def _observe(self) -> Tensor | dict[str, Tensor]:
        got = self.env.get_observations()
        if isinstance(got, Tensor) and callable(getattr(self.env, "get_privileged_observations", None)):
            return _groups_1x(got, self.env.get_privileged_observations())  # rsl_rl 1.x
        obs, extras = got if isinstance(got, tuple) else (got, {})  # rsl_rl 2.x: (obs, extras)
        return _groups(obs, extras)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        if seed is not None:
            raise ValueError(
                f"FromRslRl.reset: seed={seed}, but an rsl_rl-style env is seeded when it is created; create it "
                "with its seed and give the Collector seed=None"
            )
        if options:
            raise ValueError(f"FromRslRl.reset: options={options!r}; rsl_rl-style envs reset themselves")
        reset = getattr(self.env, "reset", None)
        if callable(reset):
            reset()
        self.obs = self._observe()
        return self.obs, {}

    def step(self, actions: Tensor) -> tuple[Any, Tensor, Tensor, Tensor, dict[str, Any]]:
        result = self.env.step(actions)
        if len(result) == 4:
            obs, rewards, dones, extras = result
            obs = self._check_groups(
                _groups(obs, extras),
                "an rsl_rl 2.x env must put its other groups in extras['observations'] at every step",
            )
        elif len(result) == 5:  # rsl_rl 1.x
            obs, privileged, rewards, dones, extras = result
            obs = self._check_groups(
                _groups_1x(obs, privileged),
                "an rsl_rl 1.x env must give privileged observations at every step or at none, and from "
                "get_privileged_observations() too",
            )
        else:
            raise ValueError(
                f"FromRslRl.step: env.step() returned {len(result)} values, expected 4, (obs, rewards, dones, "
                "extras) as rsl_rl 2.x and later step, or 5, (obs, privileged_obs, rewards, dones, extras) as rsl_rl "
                "1.x steps; wrap the env so that its step returns one of these"
            )
        dones = dones.to(torch.bool)
        time_outs = extras.get("time_outs")
        time_outs = torch.zeros_like(dones) if time_outs is None else time_outs.to(torch.bool) & dones
        terminated = dones & ~time_outs
        # A step that terminated at its time limit reaches rsl_rl as a time-out: the env beneath says which it was
        terminated_beneath = None if self._terminated_beneath is None else self._terminated_beneath()
        if terminated_beneath is not None:
            terminated = terminated | (time_outs & terminated_beneath.to(device=dones.device, dtype=torch.bool))
        bootstraps = time_outs & ~terminated  # the time-outs known not to have terminated, or not known to have
        final = extras.get("final_obs")
        if final is not None:
            final = self._read_final(final)
        infos: dict[str, Any] = {}
        if final is not None or self.bootstrap == "final_obs":
            marks = torch.zeros_like(dones, dtype=torch.int8)
            if terminated_beneath is None:  # a time-out that may have terminated too: the env cannot tell
                marks = time_outs.to(torch.int8) * 3
        else:  # the episodes end on the observation they acted on: V(s_t), their own value, reused
            if self.bootstrap == "last_obs":
                marks = bootstraps.to(torch.int8)
            else:
                terminated = dones
                marks = bootstraps.to(torch.int8) * 2
            infos[OWN_FINAL_KEY] = dones
        infos["bootstrap"], infos["_bootstrap"] = marks, torch.ones_like(dones)
        # Rows of envs that did not end are never read. No final observation at all ("final_obs" without it
        # from the env): the collector raises at the batch's end if an episode ended at this step.
        if final is not None:
            infos["final_obs"], infos["_final_obs"] = final, dones
        self.obs = obs
        return obs, rewards.to(torch.float32), terminated, time_outs, infos

    def _check_groups(self, obs: Tensor | dict[str, Tensor], fix: str) -> Tensor | dict[str, Tensor]:
        """The step's observation groups, which must be those of ``get_observations()``."""
        expected, got = _names(self.obs), _names(obs)
        if got != expected:
            raise ValueError(
                f"FromRslRl.step: env.step() returned {got} as its observation, but get_observations() gave "
                f"{expected}; {fix}"
            )
        return obs

    def _read_final(self, final: Any) -> Tensor | dict[str, Tensor]:
        """``extras["final_obs"]`` in the observation's structure: a tensor, or a dict (TensorDict) of its groups."""
        groups = isinstance(final, (Mapping, TensorDictBase))
        if isinstance(self.obs, Tensor):
            if groups and "policy" in final.keys():
                final = final["policy"]
            if isinstance(final, Tensor):
                return final
        elif groups and all(key in final.keys() for key in self.obs):
            return {key: final[key] for key in self.obs}
        have = sorted(map(str, final.keys())) if groups else type(final).__name__
        raise ValueError(
            f"FromRslRl.step: extras['final_obs'] holds {have}, but the observation is {_names(self.obs)}; the "
            "final observations must come in the observation's structure, dense over all envs (a tensor, or a "
            "dict or TensorDict with every group), as Isaac Lab's compute_final_obs gives them"
        )

    def close_extras(self, **kwargs: Any) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def _groups(obs: Any, extras: Any) -> Tensor | dict[str, Tensor]:
    """The observation as a tensor, or a dict of its groups (rsl_rl 3.x's TensorDict; rsl_rl 2.x's extras)."""
    if isinstance(obs, (TensorDictBase, Mapping)):
        return {key: obs[key] for key in obs.keys()}
    others = extras.get("observations") if isinstance(extras, Mapping) else None
    if others:  # rsl_rl 2.x: the policy observation as a tensor, the other groups in extras["observations"]
        return {"policy": obs, **{key: value for key, value in others.items() if key != "policy"}}
    return obs


def _groups_1x(obs: Any, privileged: Any) -> Tensor | dict[str, Tensor]:
    """rsl_rl 1.x's observations: the policy tensor, with the privileged ones as the ``"critic"`` group unless None."""
    return obs if privileged is None else {"policy": obs, "critic": privileged}


def _device_of(env: Any, obs: Tensor | dict[str, Tensor]) -> torch.device:
    """The env's ``device``, else the one device of its observations' tensors."""
    device = getattr(env, "device", None)
    if device is not None:
        return torch.device(device)
    leaves = list(obs.values()) if isinstance(obs, dict) else [obs]
    tensors = all(isinstance(leaf, Tensor) for leaf in leaves)
    devices = {leaf.device for leaf in leaves if isinstance(leaf, Tensor)}
    if tensors and len(devices) == 1:
        return devices.pop()
    if len(devices) > 1:
        got = f"tensors on the devices {sorted(map(str, devices))}"
    else:
        got = "observations of types " + str(sorted({type(leaf).__name__ for leaf in leaves}))
    raise ValueError(
        f"FromRslRl: the env {type(env).__name__} has no attribute `device`, and its get_observations() gives "
        f"{got}, not torch tensors on one device to take it from; set env.device to the torch device of its "
        "tensors (e.g. env.device = 'cpu')"
    )


def _names(obs: Tensor | dict[str, Tensor]) -> str:
    return f"the groups {sorted(obs)}" if isinstance(obs, dict) else "one tensor, without groups"


def _computes_final_obs(env: Any) -> bool:
    """Whether the env, or the env it wraps, has Isaac Lab's ``cfg.compute_final_obs`` set."""
    for candidate in (env, getattr(env, "unwrapped", None)):
        if getattr(getattr(candidate, "cfg", None), "compute_final_obs", False) is True:
            return True
    return False


def _terminations_beneath(env: Any) -> Callable[[], Tensor] | None:
    """What reads, after a step, which envs terminated by the env beneath the wrapper, where it is reachable.

    Isaac Lab's ``DirectRLEnv`` and ``ManagerBasedRLEnv`` keep the step's flags apart in ``reset_terminated`` and
    ``reset_time_outs`` (the manager-based one also in its ``termination_manager``), where ``RslRlVecEnvWrapper``
    merges them; the wrapper's ``unwrapped`` is that env.
    """
    for candidate in (getattr(env, "unwrapped", None), env):
        if candidate is None:
            continue
        if all(isinstance(getattr(candidate, name, None), Tensor) for name in ("reset_terminated", "reset_time_outs")):
            return functools.partial(getattr, candidate, "reset_terminated")
        manager = getattr(candidate, "termination_manager", None)
        if manager is not None and all(hasattr(manager, name) for name in ("terminated", "time_outs")):
            return functools.partial(getattr, manager, "terminated")
    return None


def _box(value: Tensor) -> spaces.Box:
    dtype = np.float32 if value.is_floating_point() else np.int64
    return spaces.Box(-np.inf, np.inf, tuple(value.shape[1:]), dtype)
