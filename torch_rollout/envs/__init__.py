"""Gymnasium's CartPole-v1 and Pendulum-v1 as vector envs of torch tensors, on the CPU or a GPU.

They are ``gymnasium.vector.VectorEnv`` subclasses whose ``reset`` and
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
"""

from torch_rollout.envs._cartpole import CartPole
from torch_rollout.envs._pendulum import Pendulum

__all__ = ["CartPole", "Pendulum"]
