"""torch_rollout: a PyTorch-native rollout collector with exact GAE, yielding TensorDict batches."""

from torch_rollout import envs  # registers torch_rollout/CartPole-v1 and torch_rollout/Pendulum-v1
from torch_rollout.collector import Collector
from torch_rollout.envs._double_buffer import DoubleBufferedVectorEnv, double_buffered
from torch_rollout.envs._envpool import envpool_envs
from torch_rollout.envs._gym import gym_envs
from torch_rollout.gae import GAE, compute_gae
from torch_rollout.loop._seed import Seed
from torch_rollout.loop._spec import BatchKeys, CudaGraph
from torch_rollout.loop._stats import Stats, WorkerStats
from torch_rollout.placements._backends import Processes, Ray, Thread
from torch_rollout.placements._env_calls import EnvCalls
from torch_rollout.placements._forkserver import start_workers_early
from torch_rollout.replay import ReplayRing
from torch_rollout.tuning import tune

__all__ = [
    "GAE",
    "BatchKeys",
    "Collector",
    "CudaGraph",
    "DoubleBufferedVectorEnv",
    "EnvCalls",
    "Processes",
    "Ray",
    "ReplayRing",
    "Seed",
    "Stats",
    "Thread",
    "WorkerStats",
    "compute_gae",
    "double_buffered",
    "envpool_envs",
    "envs",
    "gym_envs",
    "start_workers_early",
    "tune",
]
__version__ = "0.1.0"
