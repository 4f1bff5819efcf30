"""Vector envs of torch tensors: two bundled ones, and adapters that present the GPU simulators' envs as such.

- :class:`CartPole` and :class:`Pendulum`: gymnasium's CartPole-v1 and Pendulum-v1, on the CPU or a GPU;
- :class:`FromIsaacLab`: an Isaac Lab env (applied by the Collector itself to the env that ``gym.make``
  returns), its observation groups as a Dict and its time-outs bootstrapped from its final observations;
- :class:`FromRslRl`: an env with rsl_rl's ``VecEnv`` interface (Isaac Lab's, Genesis's locomotion
  examples, ...);
- :class:`FromMjlab`: mjlab's ``ManagerBasedRlEnv``;
- :class:`FromJax`: a JAX env with Brax's functional API (Brax, MuJoCo Playground), jitted and vmapped, its arrays to
  torch through DLPack without a copy (imported on first use: this module imports no JAX).

The bundled two are ``gymnasium.vector.VectorEnv`` subclasses whose ``reset`` and
``step`` take and return torch tensors on their ``device``, with every
gymnasium autoreset mode and seeding by env index, and whose steps never
wait for the device. They serve as fast, dependency-free envs for tests and
benchmarks, and as small examples of a torch-tensor vector env (the kind
that Isaac Lab or ManiSkill3 provide) that runs the same code on any device.

Examples:
    >>> import torch
    >>> from torch_rollout.envs import CartPole
    >>> envs = CartPole(4, max_episode_steps=50)
    >>> obs, _ = envs.reset(seed=0)
    >>> actions = torch.randint(2, (100, 4), generator=torch.Generator().manual_seed(0))
    >>> ends = 0
    >>> for action in actions:
    ...     obs, reward, terminated, truncated, infos = envs.step(action)
    ...     ends += terminated | truncated  # [4]: per env, no wait for the device
    >>> ends.shape, obs.shape
    (torch.Size([4]), torch.Size([4, 4]))
    >>> envs.close()

Both are registered with gymnasium when ``torch_rollout`` is imported, so an env id makes them too (on
the CPU here); where ``torch_rollout`` may not be imported yet, name the module in the id
(``"torch_rollout:torch_rollout/CartPole-v1"``) and gymnasium imports it first:

    >>> envs = gymnasium.make_vec("torch_rollout/CartPole-v1", num_envs=1024, device="cpu")
    >>> envs.num_envs, envs.device, envs.spec.max_episode_steps
    (1024, device(type='cpu'), 500)
    >>> envs.close()
"""

from typing import Any

import gymnasium

from torch_rollout.envs._cartpole import CartPole
from torch_rollout.envs._isaac_lab import FromIsaacLab
from torch_rollout.envs._mjlab import FromMjlab
from torch_rollout.envs._pendulum import Pendulum
from torch_rollout.envs._rsl_rl import FromRslRl

__all__ = ["CartPole", "FromIsaacLab", "FromJax", "FromMjlab", "FromRslRl", "Pendulum"]


def __getattr__(name: str) -> Any:
    # FromJax on first use only, so that importing torch_rollout.envs never imports JAX's adapter (nor JAX).
    if name == "FromJax":
        from torch_rollout.envs._jax import FromJax

        return FromJax
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Their gymnasium ids, for gymnasium.make_vec and the Collector's envs: torch_rollout/CartPole-v1 and
# torch_rollout/Pendulum-v1, made with their keyword arguments (device=..., autoreset_mode=...).
for _name, _steps in (("CartPole", 500), ("Pendulum", 200)):
    if f"torch_rollout/{_name}-v1" not in gymnasium.registry:
        gymnasium.register(
            f"torch_rollout/{_name}-v1", vector_entry_point=f"torch_rollout.envs:{_name}", max_episode_steps=_steps
        )
